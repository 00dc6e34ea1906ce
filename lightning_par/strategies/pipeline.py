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
        schedule: one of the names above.
        n_microbatches: micro-batches per batch (the batch size per data-parallel replica must divide by it);
            default ``2 * pp``.
        virtual_stages: stages per rank for the interleaved / V schedules; default as in the table.
        dp: data-parallel size, or ``"auto"`` for world size / pp.
        stage_costs: relative cost per pipeline unit (list in unit order, or dict by unit name) to balance the
            stages; default: equal units per stage.
        block_types: classes (or class names) of the model's repeated blocks, where they cannot be found from the
            model itself (see ``lightning_par.parallel.blocks.find_blocks``).
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default nccl on CUDA, gloo on CPU.
        timeout: how long a collective may wait before giving up, so a dead rank does not hang the others.

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=PipelineStrategy(pp=4, schedule="interleaved_1f1b"))
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        pp: int = 2,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        virtual_stages: int | None = None,
        dp: Size = "auto",
        stage_costs: list[float] | dict[str, float] | None = None,
        block_types: list[str] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dp=dp,
            tp=1,
            pp=pp,
            schedule=schedule,
            n_microbatches=n_microbatches,
            virtual_stages=virtual_stages,
            stage_costs=stage_costs,
            block_types=block_types,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
        )

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for pp in (2, 4):
            for schedule in SCHEDULES:
                name = f"pipeline{pp}_{schedule}"
                strategy_registry.register(name, cls, description=f"lightning-par PipelineStrategy(pp={pp}, "
                                           f"schedule={schedule!r})", pp=pp, schedule=schedule)
