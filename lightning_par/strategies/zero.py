"""ZeroStrategy: data parallelism with the ZeRO family of memory savings (stages 0-3), as a preset of the engine."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout

from lightning_par.parallel.layout import SUPPORTED_ZERO_STAGES
from lightning_par.strategies.engine import LayoutStrategy


class ZeroStrategy(LayoutStrategy):
    """Data parallelism over every rank (tp = pp = 1) with a ZeRO stage.

    Per rank, for fp32 Adam and N data-parallel ranks (the ZeRO paper's accounting):

    ====== ======================================== ============ ========= =========== ====================
    stage  what is sharded                          parameters   gradients Adam states traffic per step
    ====== ======================================== ============ ========= =========== ====================
    0      nothing (DDP: all-reduce)                4Ψ           4Ψ        8Ψ          2Ψ(N-1)/N
    1      optimizer states                         4Ψ           4Ψ        8Ψ/N        2Ψ(N-1)/N
    2      + gradients                              4Ψ           4Ψ/N      8Ψ/N        2Ψ(N-1)/N
    3      + parameters (FSDP2)                     4Ψ/N         4Ψ/N      8Ψ/N        3Ψ(N-1)/N
    ====== ======================================== ============ ========= =========== ====================

    Args:
        stage: ZeRO stage: 0 replicas, gradients all-reduced (DDP); 1 optimizer states sharded; 2 + gradients
            sharded; 3 + parameters sharded (FSDP2).
        offload_optimizer: stages 1-3: keep the optimizer's shard and state in host memory, step there.
        offload_parameters: stage 3 only: keep the resting parameter shards in host memory as well.
        recompute: activation recompute per block: ``"none"``, ``"selective"`` (the attention core) or ``"full"``.
        bucket_cap_mb: gradient bucket size for the all-reduce / reduce-scatter, in MiB.
        block_types: classes (or class names) of the model's repeated blocks, where they cannot be found from the
            model itself (see ``lightning_par.parallel.blocks.find_blocks``).
        process_group_backend: ``"gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``; by default the last on CUDA,
            gloo on CPU.
        timeout: how long a collective may wait before giving up, so a dead rank does not hang the others.
        heartbeat_timeout: seconds after which a rank that died or froze is named and the others stop (exit 75);
            ``None`` or 0: off.
        async_save: stages 1-3: write checkpoints in the background (DCP ``async_save``).
        nonfinite, nonfinite_patience: a non-finite loss or gradient norm: ``"stop"`` or ``"skip"`` (see
            :class:`~lightning_par.strategies.engine.LayoutStrategy`).
        compile: ``torch.compile`` each block in place: ``True``, or a dict of options (``backend``, ``mode``,
            ``fullgraph``, ``dynamic``, ``options``) or a ``CompileOptions``; see ``lightning_par.parallel.compile``.
        checkpoint_io: a CheckpointIO plugin for stage 0's one-file checkpoints; default atomic writes.

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=ZeroStrategy(stage=0))
        # or: lightning-par fit ... --trainer.strategy=zero --trainer.strategy.stage=2
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 0,
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
            dp="auto", tp=1, pp=1, zero_stage=stage, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, recompute=recompute, bucket_cap_mb=bucket_cap_mb,
            block_types=block_types, process_group_backend=process_group_backend, timeout=timeout,
            heartbeat_timeout=heartbeat_timeout, async_save=async_save,
            nonfinite=nonfinite, nonfinite_patience=nonfinite_patience, compile=compile, checkpoint_io=checkpoint_io,
        )

    @property
    def stage(self) -> int:
        return self.layout.zero_stage

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        presets: dict[str, dict[str, Any]] = {"zero": {}}
        presets.update({f"zero{stage}": {"stage": stage} for stage in SUPPORTED_ZERO_STAGES})
        presets.update({f"zero{stage}_offload": {"stage": stage, "offload_optimizer": True} for stage in (1, 2)})
        presets["zero3_offload"] = {"stage": 3, "offload_optimizer": True, "offload_parameters": True}
        for name, init_args in presets.items():
            strategy_registry.register(name, cls, description=f"lightning-par ZeroStrategy({init_args})", **init_args)
