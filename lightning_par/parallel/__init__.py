"""Model transforms with no Lightning import: layouts, data parallel (and later ZeRO, tensor and pipeline)."""

from lightning_par.parallel.layout import Layout

__all__ = ["Layout"]
