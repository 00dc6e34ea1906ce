"""Stands in for an install without the optional extras: matplotlib and transformers look absent.

tests/launch/test_install.py puts this folder first on PYTHONPATH for a launched run; Python imports ``sitecustomize``
at start-up. Both ways a package is looked for are answered as if it were not installed: an import raises
``ModuleNotFoundError`` and its distribution metadata is not found (libraries such as torchmetrics check the metadata
before importing, so a module that merely fails to import would break them where a real absence does not).
"""

import importlib.abc
import importlib.metadata
import sys

BLOCKED = {"matplotlib", "transformers"}


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by tests/no_extras: an install without "
                                      "extras)", name=name)
        return None


_distribution = importlib.metadata.distribution


def _distribution_unless_blocked(name: str):
    if name.lower().replace("_", "-") in BLOCKED:
        raise importlib.metadata.PackageNotFoundError(name)
    return _distribution(name)


sys.meta_path.insert(0, _Absent())
importlib.metadata.distribution = _distribution_unless_blocked
