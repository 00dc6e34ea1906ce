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
        stage: ZeRO stage, 0-3 (table above).
        offload_optimizer: stages 1-3: keep the optimizer's shard and state in host memory, step there.
        offload_parameters: stage 3 only: keep the resting parameter shards in host memory as well.
        bucket_cap_mb: gradient bucket size for the all-reduce / reduce-scatter, in MiB.
        block_types: classes (or class names) of the model's repeated blocks, where they cannot be found from the
            model itself (see ``lightning_par.parallel.blocks.find_blocks``).
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default nccl on CUDA, gloo on CPU.
        timeout: how long a collective may wait before giving up, so a dead rank does not hang the others.

    Example::

        Trainer(accelerator="cpu", devices=4, strategy=ZeroStrategy(stage=0))
    """

    strategy_name = "zero"

    def __init__(
        self,
        stage: int = 0,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        bucket_cap_mb: float = 25.0,
        block_types: list[str] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            dp="auto",
            tp=1,
            pp=1,
            zero_stage=stage,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
            bucket_cap_mb=bucket_cap_mb,
            block_types=block_types,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
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
