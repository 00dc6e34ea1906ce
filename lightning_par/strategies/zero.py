"""ZeroStrategy: data parallelism with the ZeRO family of memory savings, as a preset of the engine."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_par.strategies.engine import LayoutStrategy


class ZeroStrategy(LayoutStrategy):
    """Data parallelism over every rank (tp = pp = 1) with a ZeRO stage.

    Stage 0 keeps a full replica of parameters, gradients and optimizer state on each rank and averages gradients
    with a bucketed all-reduce overlapped with backward (DDP semantics).

    Args:
        stage: ZeRO stage. ``0``: replicas, gradients all-reduced.
        bucket_cap_mb: gradient bucket size for the all-reduce, in MiB.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default nccl on CUDA, gloo on CPU.
        timeout: how long a collective may wait before giving up, so a dead rank does not hang the others.

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=ZeroStrategy(stage=0))
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 0,
        bucket_cap_mb: float = 25.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dp="auto",
            tp=1,
            pp=1,
            zero_stage=stage,
            bucket_cap_mb=bucket_cap_mb,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
        )

    @property
    def stage(self) -> int:
        return self.layout.zero_stage

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register("zero", cls, description="lightning-par ZeRO data parallel (stage 0 = DDP)")
        strategy_registry.register("zero0", cls, description="lightning-par ZeRO stage 0: DDP semantics", stage=0)
