"""``--model=mymodule.MyModel`` from the folder holding ``mymodule.py``, as ``python -m`` finds it, and one line for a
class path that cannot be imported (was "No module named" after jsonargparse's usage and every subtype it tried)."""

from __future__ import annotations

import sys

import pytest

from lightning_par import cli

MODULE = '''
import torch
from lightning import LightningModule


class MyModel(LightningModule):
    def __init__(self, width: int = 3):
        super().__init__()
        self.net = torch.nn.Linear(width, width)
'''


@pytest.fixture
def folder(tmp_path, monkeypatch):
    """A script's folder, the current directory, not on sys.path (a console script's sys.path[0] is its own)."""
    (tmp_path / "lp_user_module.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-par"])  # (LightningCLI warns when args differ from it)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "lp_user_module", raising=False)
    yield tmp_path
    sys.modules.pop("lp_user_module", None)


def test_a_model_in_the_current_directory_is_found(folder, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["fit", "--model=lp_user_module.MyModel", "--model.width=5", "--print_config"])
    out = capsys.readouterr().out
    assert done.value.code in (0, None), out
    assert "class_path: lp_user_module.MyModel" in out and "width: 5" in out


@pytest.mark.parametrize(("args", "said"), [
    (["--model=lp_missing.MyModel"],
     "--model=lp_missing.MyModel: no module named 'lp_missing', neither in the current directory ({folder}) nor on "
     "PYTHONPATH. Run lightning-par from the folder that holds lp_missing.py (or its package), or add that folder to "
     "PYTHONPATH: PYTHONPATH=/path/to/folder lightning-par ..."),
    (["--model", "lp_user_module.Other"], "--model=lp_user_module.Other: lp_user_module ({folder}/lp_user_module.py) "
                                          "has no 'Other'."),
    (["--model=lp_user_module.MyModel", "--data=lp_pkg.sub.Data"], "--data=lp_pkg.sub.Data: no module named 'lp_pkg'"),
])
def test_a_class_path_that_cannot_be_imported_fails_in_one_line(folder, capsys, args, said):
    with pytest.raises(SystemExit) as done:
        cli.main(["fit", *args])
    err = capsys.readouterr().err
    assert done.value.code == 2
    assert err.startswith("lightning-par: error: " + said.format(folder=folder)) and err.count("\n") == 1, err
