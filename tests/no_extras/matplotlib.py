"""Stands in for an install without the optional extras: ``import matplotlib`` fails as if it were absent.

tests/test_install.py puts this folder first on PYTHONPATH for a launched run.
"""

raise ImportError("No module named 'matplotlib' (blocked by tests/no_extras: an install without extras)")
