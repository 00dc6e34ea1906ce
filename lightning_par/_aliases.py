"""The old name of the example models, ``example_models``, kept working for configs and scripts written before they
moved into the package (``lightning_par.examples``).

No top-level ``example_models`` package is installed. ``import lightning_par`` (which the CLI does before it reads a
config) puts a finder first on ``sys.meta_path`` that resolves ``example_models`` and ``example_models.X`` to the very
module objects ``lightning_par.examples`` and ``lightning_par.examples.X`` (so a class has one identity under both
names), with one FutureWarning naming the new path. FutureWarning rather than DeprecationWarning: the old name sits
in users' YAML files and command lines, and Python hides DeprecationWarnings raised outside ``__main__``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

OLD, NEW = "example_models", "lightning_par.examples"


class ExamplesAlias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finder and loader of ``example_models[.X]``: each is the module ``lightning_par.examples[.X]`` itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != OLD and not fullname.startswith(OLD + "."):
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = NEW + spec.name[len(OLD):]
        if spec.name == OLD:
            warnings.warn(f"`{OLD}` is now `{NEW}`: replace `{OLD}.` by `{NEW}.` in class paths and imports (the old "
                          "name will be removed).", FutureWarning, stacklevel=2)
        return importlib.import_module(new)  # the module keeps its own __name__ and __spec__

    def exec_module(self, module):
        pass  # already executed under its new name


def install() -> None:
    """Put the alias first on ``sys.meta_path`` (once): an editable install's finder could otherwise still resolve
    a stale ``example_models`` directory."""
    if not any(isinstance(finder, ExamplesAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, ExamplesAlias())
