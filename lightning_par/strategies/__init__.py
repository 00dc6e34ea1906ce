"""Lightning strategies: thin presets of one engine (:class:`LayoutStrategy`)."""

from lightning_par.strategies.engine import LayoutStrategy
from lightning_par.strategies.pipeline import PipelineStrategy
from lightning_par.strategies.tensor_parallel import MegatronTPStrategy
from lightning_par.strategies.zero import ZeroStrategy

ALL_STRATEGIES = (LayoutStrategy, ZeroStrategy, PipelineStrategy, MegatronTPStrategy)

__all__ = ["ALL_STRATEGIES", "LayoutStrategy", "MegatronTPStrategy", "PipelineStrategy", "ZeroStrategy"]
