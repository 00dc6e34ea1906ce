"""Old module names kept working for configs and scripts written before their modules moved.

- ``example_models`` -> ``lightning_par.examples``: the example models moved into the package; no top-level
  ``example_models`` package is installed.
- ``lightning_par.strategies.zero``, ``.tensor_parallel``, ``.pipeline`` and ``.hybrid3d`` ->
  ``lightning_par.strategies.presets``: the presets moved into one file, so that no strategy file is named like a
  transform of :mod:`lightning_par.parallel`. A config saved from a strategy name with overrides held such a path.
- ``lightning_par.parallel.{heartbeat,shutdown,preemption,bad_steps,job_store,data_order}``,
  ``lightning_par.elastic`` and ``lightning_par.data_position`` -> ``lightning_par.run.*``: run supervision moved into
  its own package (a config's callbacks may name ``PreemptionCheckpoint`` or ``AttemptProgress`` by the old path).

``import lightning_par`` (which the CLI does before it reads a config) puts a finder first on ``sys.meta_path`` that
resolves an old name ``OLD`` and ``OLD.X`` to the very module objects of the new name (so a class has one identity
under both), with one FutureWarning naming the new path. FutureWarning rather than DeprecationWarning: the old names
sit in users' YAML files and command lines, and Python hides DeprecationWarnings raised outside ``__main__``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

#: old module name -> the module it now is
ALIASES = {
    "example_models": "lightning_par.examples",
    **{f"lightning_par.strategies.{old}": "lightning_par.strategies.presets"
       for old in ("zero", "tensor_parallel", "pipeline", "hybrid3d")},
    **{f"lightning_par.parallel.{name}": f"lightning_par.run.{name}"
       for name in ("heartbeat", "shutdown", "preemption", "bad_steps", "job_store", "data_order")},
    **{f"lightning_par.{name}": f"lightning_par.run.{name}" for name in ("elastic", "data_position")},
}


def _alias_of(fullname: str) -> str | None:
    return next((old for old in ALIASES if fullname == old or fullname.startswith(old + ".")), None)


class ModuleAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder and loader of the old names: each is the module of its new name itself."""

    def find_spec(self, fullname, path=None, target=None):
        if _alias_of(fullname) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        old = _alias_of(spec.name)
        new = ALIASES[old] + spec.name[len(old):]
        if spec.name == old:
            warnings.warn(f"`{old}` is now `{ALIASES[old]}`: replace `{old}.` by `{ALIASES[old]}.` in class paths and "
                          "imports (the old name will be removed).", FutureWarning, stacklevel=2)
        return importlib.import_module(new)  # the module keeps its own __name__ and __spec__

    def exec_module(self, module):
        pass  # already executed under its new name


def install() -> None:
    """Put the alias first on ``sys.meta_path`` (once): an editable install's finder could otherwise still resolve
    a stale ``example_models`` directory."""
    if not any(isinstance(finder, ModuleAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, ModuleAlias())
