"""A layout: how one model is spread over ranks. Every strategy is a preset of this one description."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_par.topology import LayoutError, ParallelDims, Size, _check_size

#: ZeRO stages the engine can apply today. Stage 0 is plain data parallelism (DDP semantics).
SUPPORTED_ZERO_STAGES: tuple[int, ...] = (0,)


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

    def __post_init__(self) -> None:
        _check_size("dp", self.dp, allow_auto=True)
        _check_size("tp", self.tp, allow_auto=False)
        _check_size("pp", self.pp, allow_auto=False)
        if self.zero_stage not in SUPPORTED_ZERO_STAGES:
            raise LayoutError(
                f"zero_stage={self.zero_stage!r} is not available; this version supports "
                f"{list(SUPPORTED_ZERO_STAGES)} (0 = replicated parameters, gradients all-reduced like DDP)."
            )
        if self.tp > 1 or self.pp > 1:
            raise LayoutError(
                f"tp={self.tp}, pp={self.pp}: tensor and pipeline parallelism are not available in this version; "
                "use tp=1 and pp=1 (data parallel only)."
            )

    def resolve(self, world_size: int) -> ParallelDims:
        """The concrete sizes for ``world_size`` ranks, or a :class:`LayoutError` that says how to fix them."""
        return ParallelDims.resolve(world_size, dp=self.dp, tp=self.tp, pp=self.pp)
