"""Model transforms with no Lightning import: layouts, data parallel (and later ZeRO, tensor and pipeline)."""

from typing import Any

__all__ = ["Layout"]


def __getattr__(name: str) -> Any:
    """``Layout``, imported on first use (its module imports torch; the parsers of plan --help need none)."""
    if name == "Layout":
        from lightning_par.parallel.layout import Layout

        return Layout
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
