"""Hybrid3DStrategy: data x tensor x pipeline parallel on one device mesh, ZeRO across data parallel."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_par.strategies.engine import LayoutStrategy
from lightning_par.topology import Size


class Hybrid3DStrategy(LayoutStrategy):
    """3D parallelism: ``pp`` pipeline stages, each split over ``tp`` tensor-parallel ranks, in ``dp`` replicas.

    One (pp, dp, cp, tp) device mesh (cp: context parallel, 1 unless set): tensor-parallel ranks innermost (adjacent
    ranks, the fastest links), pipeline outermost. The model is built without memory and split into stages first;
    each rank materialises only its own stages (the full model never exists on a rank), then each stage gets, in this
    order, the model's tensor-parallel plan (patterns naming another stage's units are skipped there), activation
    recompute and ZeRO across data parallel. Rank 0 logs the rank table (global rank -> (pp, dp, tp), with cp when
    set) and which units each stage holds.

    ZeRO with pipelines: stages 1 and 2 reduce-scatter each gradient bucket once per optimizer step, after the
    schedule's last backward (not once per micro-batch); stage 3 (FSDP2 per block and per stage) gathers each group
    once per step and reduce-scatters it once, after the last backward. The loss is declared as for
    PipelineStrategy: ``self.model(**batch).loss`` of a Hugging Face causal LM, or ``loss_fn`` + ``compute_loss``.

    Args:
        tp: tensor-parallel size (must divide heads, hidden and FFN sizes and the vocabulary).
        pp: pipeline-parallel size.
        dp: data-parallel size, or ``"auto"`` for world size / (tp * pp * cp).
        cp: context-parallel size: each sequence split over ``cp`` ranks (between dp and tp on the mesh), attention
            over the whole sequence, gradients averaged over dp x cp (see docs/context-parallel.md).
        zero_stage: across data parallel: 0 replicas, 1 optimizer states sharded (default), 2 + gradients,
            3 + parameters (FSDP2).
        schedule: pipeline schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``zero_bubble``,
            ``zbv`` or ``dualpipev`` (see PipelineStrategy).
        n_microbatches: micro-batches per batch; default ``2 * pp``.
        virtual_stages: stages per pipeline rank for the interleaved / V schedules.
        sequence_parallel: split norms and the residual stream over the sequence too (activations sent between
            stages are then sequence shards, 1 / tp of the bytes).
        recompute: ``"none"``, ``"selective"`` (the attention core) or ``"full"`` per block.
        block_types: classes (or class names) of the model's repeated blocks, where they cannot be found otherwise.
        stage_costs: relative cost per pipeline unit, to balance the stages.
        offload_optimizer: ZeRO 1-3: keep the sharded optimizer state in host memory.
        offload_parameters: ZeRO 3: keep the resting parameter shards in host memory too.
        bucket_cap_mb: gradient bucket size for the data-parallel reduction, in MiB.
        process_group_backend: ``"gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``; by default the last on CUDA,
            gloo on CPU.
        timeout: how long a collective may wait before giving up, so a dead rank does not hang the others.
        heartbeat_timeout: seconds after which a rank that died or froze is named and the others stop (exit 75);
            ``None`` or 0: off.
        async_save: write checkpoints in the background (DCP ``async_save``).
        nonfinite, nonfinite_patience: a non-finite loss or gradient norm: ``"stop"`` or ``"skip"`` (see
            :class:`~lightning_par.strategies.engine.LayoutStrategy`).
        compile: ``torch.compile`` each block in place: ``True``, or a dict of options (``backend``, ``mode``,
            ``fullgraph``, ``dynamic``, ``options``) or a ``CompileOptions``; see ``lightning_par.parallel.compile``.
        checkpoint_io: a CheckpointIO plugin for one-file checkpoints; default atomic writes.

    Example::

        Trainer(accelerator="gpu", devices=8, strategy=Hybrid3DStrategy(tp=2, pp=2))   # dp = 8 / 4 = 2
        # or: lightning-par fit ... --trainer.strategy=hybrid3d --trainer.strategy.tp=2 --trainer.strategy.pp=2
    """

    strategy_name = "hybrid3d"

    def __init__(
        self,
        tp: int = 2,
        pp: int = 2,
        dp: Size = "auto",
        cp: int = 1,
        zero_stage: int = 1,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        virtual_stages: int | None = None,
        sequence_parallel: bool = False,
        recompute: str = "none",
        block_types: list[str] | None = None,
        stage_costs: list[float] | dict[str, float] | None = None,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        bucket_cap_mb: float = 25.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        heartbeat_timeout: float | None = 60.0,
        async_save: bool = False,
        nonfinite: str = "stop", nonfinite_patience: int | None = None,
        compile: bool | dict[str, Any] = False,
        checkpoint_io: Any = None,
    ) -> None:
        super().__init__(
            dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero_stage, schedule=schedule, n_microbatches=n_microbatches,
            virtual_stages=virtual_stages, sequence_parallel=sequence_parallel, recompute=recompute,
            block_types=block_types, stage_costs=stage_costs, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, bucket_cap_mb=bucket_cap_mb,
            process_group_backend=process_group_backend, timeout=timeout, heartbeat_timeout=heartbeat_timeout,
            async_save=async_save,
            nonfinite=nonfinite, nonfinite_patience=nonfinite_patience, compile=compile, checkpoint_io=checkpoint_io,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets: dict[str, dict[str, Any]] = {cls.strategy_name: {}}  # any size: --trainer.strategy.tp=N ...pp=M
        for tp, pp in ((2, 2), (2, 4), (4, 2)):
            presets[f"hybrid3d_tp{tp}_pp{pp}"] = {"tp": tp, "pp": pp}
            presets[f"hybrid3d_tp{tp}_pp{pp}_sp"] = {"tp": tp, "pp": pp, "sequence_parallel": True}
        presets["hybrid3d_tp2_pp2_zero3"] = {"tp": 2, "pp": 2, "zero_stage": 3}
        presets["hybrid3d_tp2_pp2_cp2"] = {"tp": 2, "pp": 2, "cp": 2}
        for name, init_args in presets.items():
            strategy_registry.register(name, cls, description=f"lightning-par Hybrid3DStrategy({init_args})",
                                       **init_args)
