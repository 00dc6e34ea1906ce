"""PipelineStrategy: pipeline parallelism (GPipe, 1F1B, interleaved, zero bubble) inside Lightning's loop."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_par.parallel.stage_plan import SCHEDULES
from lightning_par.strategies.engine import LayoutStrategy
from lightning_par.topology import Size


class PipelineStrategy(LayoutStrategy):
    """Pipeline parallelism: the model split into ``pp`` stages that micro-batches flow through; dp across replicas.

    With ``virtual_stages`` v, there are ``pp * v`` stages, v per rank. The model declares its pipeline units in
    execution order (``pipeline_units()``: embedding, each block, final norm, head); stages are contiguous runs of
    units, balanced by count or by ``stage_costs``, and keep the original parameter names. Each Lightning batch is split
    into ``n_microbatches`` micro-batches that the schedule runs through the stages. The loss is computed on the last
    stage, either the Hugging Face way -- a ``*ForCausalLM`` whose training_step returns ``self.model(**batch).loss``
    (labels in the batch): that call runs the schedule, and the last stage computes the model's own loss, the token
    mean over the whole batch -- or, for any model, with ``loss_fn(outputs, targets)`` (one micro-batch's loss) and
    the step's loss from ``compute_loss(batch)``, which the strategy answers with the batch loss after the schedule
    ran forward and backward. Either way the step's logging works unchanged.

    ================== =========================== ============================== ===============================
    schedule           stages per rank (v)         bubble / compute (ideal)       micro-batches held per stage
    ================== =========================== ============================== ===============================
    gpipe              1                           (p-1)/m                        m
    1f1b               1                           (p-1)/m                        at most p
    interleaved_1f1b   v (default 2)               (p-1)/(m v)                    about p (per virtual stage)
    looped_bfs         v (default 2)               (p-1)/(m v)                    m
    zero_bubble        v (default 2)               about (p-1)/(3 m v)            about p
    zbv                2, in a V                   about 0                        about p
    dualpipev          2, in a V (m >= 2p)         about 0                        about p
    ================== =========================== ============================== ===============================

    Args:
        pp: pipeline-parallel size.
        schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``looped_bfs``, ``zero_bubble``, ``zbv`` or
            ``dualpipev`` (bubble and memory of each in the table of ``help(PipelineStrategy)``).
        n_microbatches: micro-batches per batch (the batch size per data-parallel replica must divide by it);
            default ``2 * pp``.
        virtual_stages: stages per rank: 1 for gpipe and 1f1b, 2 (the default) or more for interleaved_1f1b,
            looped_bfs and zero_bubble; zbv and dualpipev run exactly 2, in a V.
        dp: data-parallel size, or ``"auto"`` for world size / pp.
        zero_stage: across data parallel: 0 replicas (default), 1 optimizer states sharded, 2 + gradients,
            3 + parameters (FSDP2 per stage).
        offload_optimizer: ZeRO 1-3: keep the sharded optimizer state in host memory.
        offload_parameters: ZeRO 3: keep the resting parameter shards in host memory too.
        stage_costs: relative cost per pipeline unit (list in unit order, or dict by unit name) to balance the
            stages; default: equal units per stage.
        recompute: activation recompute per block: ``"none"``, ``"selective"`` (the attention core) or ``"full"``.
        bucket_cap_mb: gradient bucket size for the data-parallel reduction, in MiB.
        block_types: classes (or class names) of the model's repeated blocks, where they cannot be found from the
            model itself (see ``lightning_par.parallel.blocks.find_blocks``).
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

        Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(pp=4, schedule="interleaved_1f1b"))
        # or: lightning-par fit ... --trainer.strategy=pipeline --trainer.strategy.pp=4 --trainer.strategy.schedule=zbv
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pp: int = 2,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        virtual_stages: int | None = None,
        dp: Size = "auto",
        zero_stage: int = 0,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        stage_costs: list[float] | dict[str, float] | None = None,
        recompute: str = "none",
        bucket_cap_mb: float = 25.0,
        block_types: list[str] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        heartbeat_timeout: float | None = 60.0,
        async_save: bool = False,
        nonfinite: str = "stop", nonfinite_patience: int | None = None,
        compile: bool | dict[str, Any] = False,
        checkpoint_io: Any = None,
    ) -> None:
        super().__init__(
            dp=dp, tp=1, pp=pp, zero_stage=zero_stage, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, schedule=schedule, n_microbatches=n_microbatches,
            virtual_stages=virtual_stages, stage_costs=stage_costs, recompute=recompute, bucket_cap_mb=bucket_cap_mb,
            block_types=block_types, process_group_backend=process_group_backend, timeout=timeout,
            heartbeat_timeout=heartbeat_timeout, async_save=async_save,
            nonfinite=nonfinite, nonfinite_patience=nonfinite_patience, compile=compile, checkpoint_io=checkpoint_io,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="lightning-par PipelineStrategy: any size and "
                                   "schedule (--trainer.strategy.pp=N --trainer.strategy.schedule=NAME)")
        for pp in (2, 4):
            for schedule in SCHEDULES:
                name = f"pipeline{pp}_{schedule}"
                strategy_registry.register(name, cls, description=f"lightning-par PipelineStrategy(pp={pp}, "
                                           f"schedule={schedule!r})", pp=pp, schedule=schedule)
