"""lightning_par/_compat.py: the one module that touches private torch / Lightning / jsonargparse names, the check of
the installed versions against the tested ones, and the error for a private name a release no longer has."""

import ast
import os
import re
import subprocess
import sys
import warnings

import pytest
import tomllib

from lightning_par import _compat
from tests.harness import REPO

PACKAGES = ("torch", "lightning", "jsonargparse")


def _private_uses(path):
    """Private names of torch / lightning / jsonargparse that ``path`` imports or reaches as ``torch.x._y``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            names = [*node.module.split("."), *(a.name for a in node.names)]
            found += [f"from {node.module} import {n}" for n in names if n.startswith("_")]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names
                      if a.name.split(".")[0] in PACKAGES and any(c.startswith("_") for c in a.name.split("."))]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            if isinstance(root, ast.Name) and root.id == "torch":
                found.append(ast.unparse(node))
    return found


def test_only_the_compat_module_uses_private_names():
    modules = sorted((REPO / "lightning_par").rglob("*.py"))
    uses = {str(p.relative_to(REPO)): _private_uses(p) for p in modules if p.name != "_compat.py"}
    assert {p: u for p, u in uses.items() if u} == {}
    # private attributes of Lightning's objects go through _compat's accessors too
    lightning_attrs = re.compile(r"\._skip_backward|\._accelerator_connector|(?<!self)\._device_mesh\s*=")
    assert [p for p in modules if p.name != "_compat.py" and lightning_attrs.search(p.read_text())] == []


def test_scan_catches_each_form(tmp_path):
    code = tmp_path / "m.py"
    code.write_text("from torch.distributed._shard.sharded_tensor import ShardedTensor\n"
                    "from lightning.fabric.utilities.types import _Stateful\n"
                    "import torch.utils._pytree\n"
                    "x = torch._C._nn._parse_to\n")
    found = _private_uses(code)
    assert "from torch.distributed._shard.sharded_tensor import _shard" in found
    assert "from lightning.fabric.utilities.types import _Stateful" in found
    assert "torch.utils._pytree" in found and "torch._C._nn._parse_to" in found


def test_tested_versions_match_pyproject():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    deps = [re.sub(r"\[.*?\]", "", d) for d in project["dependencies"]]  # jsonargparse[signatures]
    for package, (low, high) in _compat.TESTED.items():
        major, minor = high.split(".")
        assert f"{package}>={low},<{major}.{int(minor) + 1}" in deps
    assert _compat.TESTED["torch"] == ("2.11", "2.15")
    assert _compat.check_versions() == []  # this environment is a tested one


def test_transformers_range_matches_pyproject_and_an_untested_one_is_one_line(monkeypatch):
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    low, high = _compat.OPTIONAL_TESTED["transformers"]
    major, minor = high.split(".")
    wanted = f"transformers>={low},<{major}.{int(minor) + 1}"
    assert wanted in project["optional-dependencies"]["hf"] and wanted in project["optional-dependencies"]["dev"]
    monkeypatch.delenv(_compat.ALLOW_UNTESTED, raising=False)
    for found in (f"{low}.0", f"{high}.3"):
        assert _compat.check_optional_version("transformers", found) == found
    with pytest.raises(_compat.UntestedVersionError) as err:
        _compat.check_optional_version("transformers", "4.57.1")
    message = str(err.value)
    assert len(message.splitlines()) == 1 and "found transformers 4.57.1" in message, message
    assert f"tested with transformers {low} to {high}" in message and f"Install '{wanted}'" in message, message
    monkeypatch.setenv(_compat.ALLOW_UNTESTED, "1")
    with pytest.warns(UserWarning, match="found transformers 9.0.0"):
        assert _compat.check_optional_version("transformers", "9.0.0") == "9.0.0"


@pytest.mark.parametrize("found", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu", "2.14.1", "2.15.0"])
def test_every_torch_of_the_range_is_accepted(found, monkeypatch):
    monkeypatch.delenv(_compat.ALLOW_UNTESTED, raising=False)
    assert _compat.check_versions({**_compat.installed_versions(), "torch": found}) == []


def test_untested_torch_stops_with_one_clear_message(monkeypatch):
    monkeypatch.delenv(_compat.ALLOW_UNTESTED, raising=False)
    installed = {**_compat.installed_versions(), "torch": "2.16.0+cu128"}
    with pytest.raises(_compat.UntestedVersionError) as err:
        _compat.check_versions(installed)
    message = str(err.value)
    assert "torch 2.11 to 2.15" in message and "lightning 2.6.x" in message and "found torch 2.16.0+cu128" in message
    assert "pip install 'torch>=2.11,<2.16'" in message and "LIGHTNING_PAR_ALLOW_UNTESTED=1" in message
    assert len(message.splitlines()) == 1
    assert "lightning 2.6.6" not in message  # only the untested package is named as found
    assert isinstance(err.value, ImportError)


def test_untested_versions_allowed_by_env_warn_once(monkeypatch):
    monkeypatch.setenv(_compat.ALLOW_UNTESTED, "1")
    installed = {"torch": "2.10.1", "lightning": "2.7.0", "jsonargparse": "4.53.0"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _compat.check_versions(installed) == ["torch", "lightning"]
    assert len(caught) == 1
    assert "found torch 2.10.1, lightning 2.7.0" in str(caught[0].message)
    assert "pip install 'torch>=2.11,<2.16' 'lightning==2.6.*'" in str(caught[0].message)


def test_missing_private_name_is_an_import_error_naming_it(monkeypatch):
    monkeypatch.setattr(_compat, "installed_versions", lambda: {"torch": "2.14.0", "lightning": "2.6.6"})
    with pytest.raises(ImportError) as err:
        _compat.private("torch", "torch.distributed.checkpoint._traverse", "set_element_v2")
    assert str(err.value) == (
        "lightning-par needs torch.distributed.checkpoint._traverse.set_element_v2, a private name of torch that "
        "torch 2.14.0 does not have (lightning-par is tested with torch 2.11 to 2.15): install 'torch>=2.11,<2.16'.")
    with pytest.raises(ImportError, match=r"torch\._gone_module\.x, a private name of torch that torch 2\.14\.0"):
        _compat.private("torch", "torch._gone_module", "x")
    # a Lightning attribute the accessors need
    class Loop:
        pass

    class Trainer:
        fit_loop = Loop()

    with pytest.raises(ImportError, match=r"needs Trainer\.fit_loop\._skip_backward, a private name of lightning"):
        _compat.set_skip_backward(Trainer(), True)


def test_a_renamed_private_name_falls_back_to_the_older_spelling():
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    # the spelling of the running release wins; a release without it gets the fallback (torch 2.11 and 2.12)
    assert _compat.private("torch", "torch.distributed._functional_collectives", "gone_in_this_release",
                           fallbacks=("all_gather_tensor_autograd",)) is funcol.all_gather_tensor_autograd
    assert _compat.private("torch", "torch", "gone", fallbacks=("torch.distributed:all_gather_into_tensor",)) is (
        dist.all_gather_into_tensor)
    with pytest.raises(ImportError, match=r"needs torch\.gone_a, a private name"):
        _compat.private("torch", "torch", "gone_a", fallbacks=("gone_b",))
    # the ZeRO collectives are looked up at each call, so a wrapper of torch.distributed's function sees them
    seen = []
    name = _compat.reduce_scatter_single.__name__
    assert name in ("reduce_scatter_single", "reduce_scatter_tensor")
    monkey = pytest.MonkeyPatch()
    monkey.setattr(dist, name, lambda *a, **k: seen.append(a))
    try:
        _compat.reduce_scatter_single("out", "in")
    finally:
        monkey.undo()
    assert seen == [("out", "in")]


def test_schedule_order_only_keeps_the_compute_order():
    from torch.distributed.pipelining import ScheduleInterleaved1F1B

    cls = _compat.schedule_order_only(ScheduleInterleaved1F1B)
    assert cls.__name__ == "ScheduleInterleaved1F1B" and issubclass(cls, ScheduleInterleaved1F1B)
    assert cls._prepare_schedule_with_comms is not ScheduleInterleaved1F1B._prepare_schedule_with_comms
    gone = type("NoLowering", (ScheduleInterleaved1F1B,), {})
    monkey = pytest.MonkeyPatch()
    monkey.setattr(_compat, "_SCHEDULE_LOWERING", "_lowering_renamed")
    try:
        with pytest.raises(ImportError, match=r"NoLowering\._lowering_renamed"):
            _compat.schedule_order_only(gone)
    finally:
        monkey.undo()


@pytest.mark.full  # the version table stays, in-process
def test_import_on_an_untested_torch_stops_or_warns_once(tmp_path):
    """``import lightning_par`` itself, on a torch that says it is 2.16.0: one error naming the versions; with
    LIGHTNING_PAR_ALLOW_UNTESTED=1 one warning, and the import goes on (every private name is still there)."""
    code = "import torch; torch.__version__ = '2.16.0'; import lightning_par; print('imported')"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop(_compat.ALLOW_UNTESTED, None)
    stopped = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert stopped.returncode == 1 and "imported" not in stopped.stdout
    assert ("UntestedVersionError: lightning-par is tested with torch 2.11 to 2.15, lightning 2.6.x, "
            "jsonargparse 4.53.x") in stopped.stderr
    assert "found torch 2.16.0. Install the tested versions (pip install 'torch>=2.11,<2.16')" in stopped.stderr
    env[_compat.ALLOW_UNTESTED] = "1"
    allowed = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env, cwd=tmp_path, capture_output=True,
                             text=True)
    assert allowed.returncode == 0 and allowed.stdout.strip() == "imported"
    assert allowed.stderr.count("lightning-par is tested with torch 2.11 to 2.15") == 1
