"""The package's shape (issue 42): ``parallel/`` imports no Lightning, and the model transforms (``parallel/``,
``topology.py``) import nothing above them -- run supervision, the strategies, plugins, CLI, callbacks or examples.

Read from the source (every ``import`` and ``from ... import``, at module level or inside a function, relative ones
resolved, and ``importlib.import_module`` / ``__import__`` of a literal name), so nothing is imported to check it."""

import ast
import importlib
import sys
from pathlib import Path

import pytest

from tests.harness import REPO

LIGHTNING = ("lightning", "lightning_fabric", "pytorch_lightning")
#: what sits above the model transforms: they may be imported by these, never import them
ABOVE = tuple(f"lightning_par.{name}" for name in ("run", "strategies", "plugins", "cli", "callbacks", "examples"))


def module_name(path: Path, root: Path) -> str:
    """``lightning_par/parallel/zero.py`` -> ``lightning_par.parallel.zero``; an ``__init__.py``: its package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, root: Path) -> list[tuple[int, str]]:
    """``(line, dotted name)`` of everything ``path`` imports. ``from a.b import c`` gives ``a.b.c`` (``c`` may be a
    module or a name in ``a.b``: both are reached through ``a.b``); a relative import is resolved against the file's
    package."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = [node.module] if node.module else []
            if node.level:
                if node.level > len(package):
                    raise ValueError(f"{path}:{node.lineno}: a relative import above the top-level package")
                base = package[:len(package) - node.level + 1] + base
            found += [(node.lineno, ".".join([*base, alias.name])) for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str) and _call_name(node.func) in ("import_module", "__import__")):
            found.append((node.lineno, node.args[0].value))
    return found


def _call_name(func: ast.expr) -> str | None:
    return func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None


def violations(root: Path, files: list[Path], forbidden: tuple[str, ...]) -> dict[str, list[str]]:
    """``{file: ["line: name", ...]}`` for each import of a module in ``forbidden`` or below it."""
    found = {}
    for path in files:
        bad = [f"{line}: {name}" for line, name in imported_names(path, root)
               if any(name == f or name.startswith(f + ".") for f in forbidden)]
        if bad:
            found[str(path.relative_to(root))] = bad
    return found


def parallel_modules(root: Path) -> list[Path]:
    return sorted((root / "lightning_par" / "parallel").rglob("*.py"))


def test_parallel_imports_no_lightning():
    files = parallel_modules(REPO)
    assert len(files) >= 30  # the folder is there and read (not an empty glob from a wrong path)
    assert violations(REPO, files, LIGHTNING) == {}


def test_model_transforms_import_nothing_above_them():
    files = [*parallel_modules(REPO), REPO / "lightning_par" / "topology.py"]
    # the scan reads real imports: gradient_sync.py's own are found (so an empty answer below is not an empty scan)
    sync = {name for _, name in imported_names(REPO / "lightning_par/parallel/gradient_sync.py", REPO)}
    assert {"lightning_par.parallel.zero.ZeroPartitioner", "lightning_par.topology.LayoutError"} <= sync
    assert violations(REPO, files, ABOVE) == {}


def test_scan_catches_each_form(tmp_path):
    def write(relative: str, text: str) -> Path:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    pipeline = write("lightning_par/parallel/pipeline/m.py", (
        "import lightning\n"                                             # 1
        "import lightning.pytorch as pl\n"                               # 2
        "from lightning.pytorch.trainer.states import TrainerStatus\n"   # 3
        "from lightning_fabric import Fabric\n"                          # 4
        "import pytorch_lightning\n"                                     # 5
        "from ...run import shutdown\n"                                  # 6: lightning_par.run.shutdown
        "from ..layout import Layout\n"                                  # 7: fine (lightning_par.parallel.layout)
        "from . import chain\n"                                          # 8: fine
        "from lightning_par import run_dir, _compat\n"                   # 9: fine (run_dir is not run)
        "import lightning_utils\n"                                       # 10: fine (not lightning)
        "def f():\n"
        "    from lightning import Trainer\n"                            # 12
        "    from ... import cli\n"                                      # 13: lightning_par.cli
        "class A:\n"
        "    def g(self):\n"
        "        import lightning_par.strategies.engine\n"               # 16
        "        return importlib.import_module('lightning_par.plugins.precision')\n"  # 17
        "x = __import__('lightning_fabric.utilities')\n"                 # 18
    ))
    init = write("lightning_par/parallel/__init__.py", "from .. import callbacks\nfrom ..examples.gpt import GPT\n")
    topology = write("lightning_par/topology.py", "from lightning_par.run.heartbeat import Heartbeat\n"
                                                  "from .parallel import layout\n")
    assert parallel_modules(tmp_path) == [init, pipeline]

    assert violations(tmp_path, parallel_modules(tmp_path), LIGHTNING) == {"lightning_par/parallel/pipeline/m.py": [
        "1: lightning", "2: lightning.pytorch", "3: lightning.pytorch.trainer.states.TrainerStatus",
        "4: lightning_fabric.Fabric", "5: pytorch_lightning", "12: lightning.Trainer",
        "18: lightning_fabric.utilities"]}
    assert violations(tmp_path, [*parallel_modules(tmp_path), topology], ABOVE) == {
        "lightning_par/parallel/__init__.py": ["1: lightning_par.callbacks", "2: lightning_par.examples.gpt.GPT"],
        "lightning_par/parallel/pipeline/m.py": ["6: lightning_par.run.shutdown", "13: lightning_par.cli",
                                                 "16: lightning_par.strategies.engine",
                                                 "17: lightning_par.plugins.precision"],
        "lightning_par/topology.py": ["1: lightning_par.run.heartbeat.Heartbeat"]}
    # and what is allowed reads as allowed: the relative imports resolve to the right modules
    allowed = [(line, name) for line, name in imported_names(pipeline, tmp_path) if 7 <= line <= 9]
    assert allowed == [(7, "lightning_par.parallel.layout.Layout"), (8, "lightning_par.parallel.pipeline.chain"),
                       (9, "lightning_par.run_dir"), (9, "lightning_par._compat")]


def test_the_moved_run_modules_still_load_by_their_old_names():
    """A config written before run supervision moved names ``lightning_par.parallel.preemption.PreemptionCheckpoint``
    or ``lightning_par.elastic.AttemptProgress``: the same classes, with one FutureWarning naming the new path."""
    import lightning_par  # noqa: F401  (installs the aliases)
    from lightning_par.run import elastic, preemption

    for old, new in (("lightning_par.parallel.preemption", preemption), ("lightning_par.elastic", elastic)):
        sys.modules.pop(old, None)
        with pytest.warns(FutureWarning, match=f"`{old}` is now `{new.__name__}`"):
            module = importlib.import_module(old)
        assert module is new
    assert importlib.import_module("lightning_par.elastic").AttemptProgress is elastic.AttemptProgress
