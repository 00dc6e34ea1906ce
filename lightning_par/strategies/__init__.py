"""Lightning strategies: one engine (:class:`LayoutStrategy`) and the presets users name (:mod:`.presets`,
:mod:`.planned`)."""

from lightning_par.strategies.engine import LayoutStrategy
from lightning_par.strategies.planned import PlannedStrategy
from lightning_par.strategies.presets import (
    ExpertParallelStrategy,
    Hybrid3DStrategy,
    MegatronTPStrategy,
    PipelineStrategy,
    ZeroStrategy,
)

ALL_STRATEGIES = (LayoutStrategy, ZeroStrategy, PipelineStrategy, MegatronTPStrategy, Hybrid3DStrategy,
                  ExpertParallelStrategy, PlannedStrategy)

__all__ = [
    "ALL_STRATEGIES", "ExpertParallelStrategy", "Hybrid3DStrategy", "LayoutStrategy", "MegatronTPStrategy",
    "PipelineStrategy", "PlannedStrategy",
    "ZeroStrategy",
]
