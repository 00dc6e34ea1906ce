"""Stands in for an install without the optional extras: ``import transformers`` fails as if it were absent.

tests/test_install.py puts this folder first on PYTHONPATH for a launched run.
"""

raise ImportError("No module named 'transformers' (blocked by tests/no_extras: an install without extras)")
