"""Lightning strategies: thin presets of one engine (:class:`LayoutStrategy`)."""

from lightning_par.strategies.engine import LayoutStrategy
from lightning_par.strategies.zero import ZeroStrategy

ALL_STRATEGIES = (LayoutStrategy, ZeroStrategy)

__all__ = ["ALL_STRATEGIES", "LayoutStrategy", "ZeroStrategy"]
