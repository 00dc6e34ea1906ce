"""MegatronTPStrategy: tensor (and sequence) parallelism inside data-parallel replicas, a preset of the engine."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_par.strategies.engine import LayoutStrategy
from lightning_par.topology import Size


class MegatronTPStrategy(LayoutStrategy):
    """Megatron-style tensor parallelism over ``tp`` ranks, data parallel (optionally ZeRO-3) across replicas.

    The model declares its split in Hugging Face form (``tp_plan``: module-name patterns -> ``"colwise"``,
    ``"rowwise"``, ``"vocab_parallel"``, ...; a ``transformers`` model's own published plan works unchanged) and
    the engine applies it with DTensor. Attention q/k/v and MLP gate/up are column-parallel, the output projections
    row-parallel; heads and key/value heads are divided over the tp ranks (attention must reshape with the local
    head count); a fused q|k|v ``nn.Linear`` is ``"packed_colwise:3"``. A plan under which a block computes another
    function is refused at setup by a self-check (docs/tensor-parallel.md). A ``"vocab_parallel"`` head keeps the
    logits split over the vocabulary and the cross-entropy runs on the shards. Per transformer block and step, on
    the tp group (b batch, s sequence, h hidden; activations in elements):

    ================== =================================== ===================================== =================
    sequence_parallel  forward                             backward                              norm activations
    ================== =================================== ===================================== =================
    False              2 all-reduce (bsh)                  2 all-reduce (bsh)                    bsh per rank
    True               2 all-gather + 2 reduce-scatter     2 all-gather + 2 reduce-scatter       bsh / tp per rank
    ================== =================================== ===================================== =================

    (An all-reduce moves the same bytes as an all-gather plus a reduce-scatter, so sequence parallelism costs no
    extra traffic and divides the memory of the activations outside the split linears by tp.)

    Args:
        tp: tensor-parallel size; must divide the attention heads, key/value heads, hidden and FFN sizes and the
            vocabulary (checked before training, with the allowed values in the error).
        sequence_parallel: split norms and the residual stream over the sequence too; the sequence length must be
            divisible by tp.
        dp: data-parallel size, or ``"auto"`` for world size / tp.
        zero_stage: across data parallel: 0 replicas (gradients all-reduced), 1 / 2 (optimizer states / + gradients
            sharded; each tp rank's buckets hold its own shards) or 3 (FSDP2, 2D with tp).
        offload_optimizer: stages 1-3: keep the sharded optimizer state in host memory.
        offload_parameters: stage 3: keep the resting parameter shards in host memory too.
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

        Trainer(accelerator="gpu", devices=8, strategy=MegatronTPStrategy(tp=4, sequence_parallel=True))
        # or: lightning-par fit ... --trainer.strategy=megatron_tp --trainer.strategy.tp=4 \
        #     --trainer.strategy.sequence_parallel=true
    """

    strategy_name = "megatron_tp"

    def __init__(
        self,
        tp: int = 2,
        sequence_parallel: bool = False,
        dp: Size = "auto",
        zero_stage: int = 0,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
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
            dp=dp, tp=tp, pp=1, zero_stage=zero_stage, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, sequence_parallel=sequence_parallel, recompute=recompute,
            bucket_cap_mb=bucket_cap_mb, block_types=block_types, process_group_backend=process_group_backend,
            timeout=timeout, heartbeat_timeout=heartbeat_timeout, async_save=async_save,
            nonfinite=nonfinite, nonfinite_patience=nonfinite_patience, compile=compile,
            checkpoint_io=checkpoint_io,
        )

    @property
    def tp(self) -> int:
        return self.layout.tp

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets: dict[str, dict[str, Any]] = {cls.strategy_name: {}}  # any size: --trainer.strategy.tp=N
        for tp in (2, 4, 8):
            presets[f"megatron_tp{tp}"] = {"tp": tp}
            presets[f"megatron_tp{tp}_sp"] = {"tp": tp, "sequence_parallel": True}
            presets[f"megatron_tp{tp}_zero3"] = {"tp": tp, "zero_stage": 3}
        for name, init_args in presets.items():
            strategy_registry.register(
                name, cls, description=f"lightning-par MegatronTPStrategy({init_args})", **init_args
            )
