"""A layout: how one model is spread over ranks. Every strategy is a preset of this one description."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_par.topology import LayoutError, ParallelDims, Size, _check_size

#: ZeRO stages: 0 replicas (DDP), 1 optimizer states sharded, 2 + gradients, 3 + parameters.
SUPPORTED_ZERO_STAGES: tuple[int, ...] = (0, 1, 2, 3)


@dataclass(frozen=True)
class Layout:
    """What to apply to a model: parallel sizes and the ZeRO stage across data parallel.

    Values are checked when the layout is made (types, ranges); sizes against the world size in :meth:`resolve`,
    which runs in the launching process, before any rank starts.
    """

    dp: Size = "auto"
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_parameters: bool = False

    def __post_init__(self) -> None:
        _check_size("dp", self.dp, allow_auto=True)
        _check_size("tp", self.tp, allow_auto=False)
        _check_size("pp", self.pp, allow_auto=False)
        if self.zero_stage not in SUPPORTED_ZERO_STAGES:
            raise LayoutError(
                f"zero_stage={self.zero_stage!r} is not available; this version supports "
                f"{list(SUPPORTED_ZERO_STAGES)} (0 = replicas like DDP, 1 = optimizer states sharded, "
                "2 = + gradients sharded, 3 = + parameters sharded)."
            )
        if self.offload_parameters and self.zero_stage != 3:
            raise LayoutError(
                f"offload_parameters=True needs zero_stage=3 (got {self.zero_stage}): below stage 3 every rank holds "
                "all parameters for compute. Use zero_stage=3, or offload_optimizer=True with stage 1 or 2."
            )
        if self.offload_optimizer and self.zero_stage == 0:
            raise LayoutError(
                "offload_optimizer=True needs zero_stage 1, 2 or 3 (got 0): offload moves the sharded optimizer "
                "state to host memory. Use ZeroStrategy(stage=1, offload_optimizer=True) or higher."
            )
        if self.pp > 1 and self.zero_stage != 0:
            raise LayoutError(
                f"pp={self.pp} with zero_stage={self.zero_stage}: pipeline stages compose with plain data parallel "
                "(zero_stage=0) in this version. Use zero_stage=0, or pp=1 for ZeRO stages 1-3."
            )
        if self.tp > 1 and self.pp > 1:
            raise LayoutError(
                f"tp={self.tp} with pp={self.pp}: tensor and pipeline parallel together (3D) are not available in "
                "this version. Use MegatronTPStrategy (tp, with dp) or PipelineStrategy (pp, with dp)."
            )
        if self.tp > 1 and self.zero_stage in (1, 2):
            raise LayoutError(
                f"tp={self.tp} with zero_stage={self.zero_stage}: ZeRO stages 1 and 2 pack parameters into flat "
                "buckets, which tensor-parallel (DTensor) parameters do not allow in this version. Use zero_stage=0 "
                "(replicas over data parallel) or zero_stage=3 (FSDP2 over data parallel, 2D with tp)."
            )

    def resolve(self, world_size: int) -> ParallelDims:
        """The concrete sizes for ``world_size`` ranks, or a :class:`LayoutError` that says how to fix them."""
        return ParallelDims.resolve(world_size, dp=self.dp, tp=self.tp, pp=self.pp)
