"""Lightning strategies: thin presets of one engine (:class:`LayoutStrategy`)."""

from lightning_par.strategies.engine import LayoutStrategy
from lightning_par.strategies.hybrid3d import Hybrid3DStrategy
from lightning_par.strategies.pipeline import PipelineStrategy
from lightning_par.strategies.planned import PlannedStrategy
from lightning_par.strategies.tensor_parallel import MegatronTPStrategy
from lightning_par.strategies.zero import ZeroStrategy

ALL_STRATEGIES = (LayoutStrategy, ZeroStrategy, PipelineStrategy, MegatronTPStrategy, Hybrid3DStrategy,
                  PlannedStrategy)

__all__ = [
    "ALL_STRATEGIES", "Hybrid3DStrategy", "LayoutStrategy", "MegatronTPStrategy", "PipelineStrategy", "PlannedStrategy",
    "ZeroStrategy",
]
