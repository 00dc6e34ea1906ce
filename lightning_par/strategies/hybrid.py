"""Hybrid3DStrategy: data x tensor x pipeline parallel on one device mesh, ZeRO across data parallel."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_par.strategies.engine import LayoutStrategy
from lightning_par.topology import Size


class Hybrid3DStrategy(LayoutStrategy):
    """3D parallelism: ``tp`` ranks split each layer (innermost), ``dp`` replicas (ZeRO across them), ``pp`` stages.

    The ranks form one ``(pp, dp, tp)`` mesh: tensor-parallel ranks are adjacent (the fastest links), pipeline
    stages outermost. Per pipeline stage the engine applies, in order: the model's tensor-parallel plan to the
    stage's units, activation recompute per block, then data parallel with the chosen ZeRO stage. Rank 0 logs
    every rank's coordinates, the groups and the units each stage holds at start-up.

    Args:
        tp: tensor-parallel size (divides heads, KV heads, hidden and FFN sizes, vocabulary).
        pp: pipeline-parallel size (at most the number of pipeline units).
        dp: data-parallel size, or ``"auto"``: world size / (tp * pp).
        zero_stage: across data parallel: 0 replicas, 1 optimizer states sharded (default), 2 + gradients,
            3 + parameters.
        schedule: the pipeline schedule (``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``,
            ``zero_bubble``, ``zbv``, ``dualpipev``).
        n_microbatches: micro-batches per batch; default ``2 * pp``.
        virtual_stages: stages per pipeline rank for the interleaved and V schedules.
        sequence_parallel: split norms and the residual stream over the sequence within tensor parallel.
        recompute: activation recompute per block: ``"none"``, ``"selective"`` or ``"full"``.
        block_types: classes (or class names) of the model's repeated blocks, where they cannot be found from the
            model itself.
        stage_costs: relative cost per pipeline unit to balance the stages (default: by count).
        offload_optimizer: keep the sharded optimizer state in host memory.
        bucket_cap_mb: gradient bucket size for data-parallel reductions, in MiB.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default nccl on CUDA, gloo on CPU.
        timeout: how long a collective may wait before giving up, so a dead rank does not hang the others.

    Example::

        Trainer(accelerator="gpu", devices=8, strategy=Hybrid3DStrategy(tp=2, pp=2))   # dp = 8 / 4 = 2
        # or: lightning-par fit ... --trainer.strategy=hybrid3d_tp2_pp2
    """

    strategy_name = "hybrid3d"

    def __init__(
        self,
        tp: int = 2,
        pp: int = 2,
        dp: Size = "auto",
        zero_stage: int = 1,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        virtual_stages: int | None = None,
        sequence_parallel: bool = False,
        recompute: str = "none",
        block_types: list[str] | None = None,
        stage_costs: list[float] | dict[str, float] | None = None,
        offload_optimizer: bool = False,
        bucket_cap_mb: float = 25.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dp=dp, tp=tp, pp=pp, zero_stage=zero_stage, schedule=schedule, n_microbatches=n_microbatches,
            virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, recompute=recompute,
            block_types=block_types, stage_costs=stage_costs, offload_optimizer=offload_optimizer,
            bucket_cap_mb=bucket_cap_mb, process_group_backend=process_group_backend, timeout=timeout, **kwargs,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for tp, pp in ((2, 2), (2, 4), (4, 2)):
            for suffix, extra in (("", {}), ("_sp", {"sequence_parallel": True})):
                init_args = {"tp": tp, "pp": pp, **extra}
                strategy_registry.register(f"hybrid3d_tp{tp}_pp{pp}{suffix}", cls,
                                           description=f"lightning-par Hybrid3DStrategy({init_args})", **init_args)
