"""Which pipeline stages exist and which rank holds each: the schedule table and :class:`StagePlan`.

A plan is checked once, when it is built (in the launching process, by :class:`~lightning_par.parallel.layout.Layout`);
the split and the runtime take it as it is. Nothing here imports torch, so the layout and the planner can use it
without the pipeline runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_par.topology import LayoutError, check_number

#: How virtual stages are laid out over the pipeline ranks (see :meth:`StagePlan.stages_of`).
STAGE_STYLES: tuple[str, ...] = ("loop", "v")


@dataclass(frozen=True)
class ScheduleSpec:
    """A schedule users can name, and what it needs."""

    torch_class: str  # in torch.distributed.pipelining
    style: str  # stage placement: "loop" (rank r holds r, r+p, ...) or "v" (r and 2p-1-r)
    default_virtual: int
    fixed_virtual: int | None  # the only number of stages per rank the schedule runs, if it has one
    summary: str
    split_backward: bool = False  # backward in two halves: input gradients, later weight gradients (I / W)


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec("ScheduleGPipe", "loop", 1, 1, "all forwards, then all backwards; holds m micro-batches"),
    "1f1b": ScheduleSpec("Schedule1F1B", "loop", 1, 1, "PipeDream-Flush: GPipe's bubble, at most p in flight"),
    "interleaved_1f1b": ScheduleSpec("ScheduleInterleaved1F1B", "loop", 2, None,
                                     "v stages per rank: bubble (p-1)/(m v)"),
    "looped_bfs": ScheduleSpec("ScheduleLoopedBFS", "loop", 2, None, "v stages per rank, breadth first"),
    "zero_bubble": ScheduleSpec("ScheduleInterleavedZeroBubble", "loop", 2, None,
                                "interleaved, backward split into input and weight gradients", True),
    "zbv": ScheduleSpec("ScheduleZBVZeroBubble", "v", 2, 2, "zero-bubble V: 2 stages per rank in a V", True),
    "dualpipev": ScheduleSpec("ScheduleDualPipeV", "v", 2, 2, "DualPipe-V: 2 stages per rank, m >= 2p", True),
}


def default_microbatches(pp: int) -> int:
    """Two micro-batches per pipeline rank: every schedule runs, and GPipe / 1F1B idle (p-1)/(2p) of compute."""
    return 2 * pp


def check_schedule_name(schedule: str) -> ScheduleSpec:
    if schedule not in SCHEDULES:
        valid = ", ".join(f"{name!r} ({spec.summary})" for name, spec in SCHEDULES.items())
        raise LayoutError(f"unknown pipeline schedule {schedule!r}; valid schedules: {valid}.")
    return SCHEDULES[schedule]


def check_positive_int(name: str, value: object) -> None:
    check_number(name, value, "a positive integer", integer=True, minimum=1)


@dataclass(frozen=True)
class StagePlan:
    """``pp * virtual_stages`` stages placed over ``pp`` ranks in ``style``, run by ``schedule`` (a name in
    :data:`SCHEDULES`, or None for a placement alone) in ``n_microbatches`` micro-batches per batch.

    Every rule is checked here, once: a plan that exists is valid. Build one for a schedule with
    :meth:`for_schedule` (its defaults filled in), for pp = 1 with :meth:`single`."""

    pp: int = 1
    virtual_stages: int = 1
    style: str = "loop"
    schedule: str | None = None
    n_microbatches: int = 1

    def __post_init__(self) -> None:
        spec = check_schedule_name(self.schedule) if self.schedule is not None else None
        for name in ("pp", "n_microbatches", "virtual_stages"):
            check_positive_int(name, getattr(self, name))
        pp, v, m, schedule = self.pp, self.virtual_stages, self.n_microbatches, self.schedule
        if spec is not None and spec.fixed_virtual is not None and v != spec.fixed_virtual:
            other = "interleaved_1f1b or zero_bubble" if v > 1 else "gpipe or 1f1b"
            raise LayoutError(f"schedule {schedule!r} runs exactly {spec.fixed_virtual} stage(s) per rank, got "
                              f"virtual_stages={v}; leave virtual_stages unset, or use {other}.")
        if self.style not in STAGE_STYLES:
            raise LayoutError(f"unknown stage style {self.style!r}; use 'loop' (interleaved 1F1B) or 'v' "
                              "(ZBV / DualPipeV).")
        if spec is not None and self.style != spec.style:
            raise LayoutError(f"schedule {schedule!r} places its stages in style {spec.style!r}, got "
                              f"style={self.style!r}.")
        if self.style == "v" and v % 2:
            raise LayoutError(
                f"style='v' needs an even virtual_stages (the stages go down the ranks and back up, so each rank "
                f"holds them in pairs), got {v}. Use virtual_stages=2 for ZBV / DualPipeV, or style='loop'.")
        # the same conditions torch checks when the schedule is built, here so that they fail before launch
        if schedule == "1f1b" and m < pp:
            raise LayoutError(f"1f1b needs at least as many micro-batches as pipeline stages: n_microbatches={m} < "
                              f"pp={pp}. Use n_microbatches >= {pp}.")
        if schedule == "dualpipev" and m < self.n_stages:
            raise LayoutError(f"dualpipev needs n_microbatches >= 2 * pp = {self.n_stages}, got {m}.")
        if schedule is not None and self.style == "loop" and v > 1:
            rounds = max(1, m // pp)
            if m % rounds:
                raise LayoutError(f"{schedule} runs micro-batches in rounds of pp={pp}: n_microbatches={m} is not "
                                  f"a multiple of its {rounds} rounds. Use a multiple of {pp}, e.g. {rounds * pp}.")

    @classmethod
    def for_schedule(cls, schedule: str, pp: int, n_microbatches: int | None = None,
                     virtual_stages: int | None = None) -> StagePlan:
        """The plan of ``schedule`` on ``pp`` ranks; unset micro-batches and virtual stages take its defaults."""
        spec = check_schedule_name(schedule)
        m = default_microbatches(pp) if n_microbatches is None else n_microbatches
        v = spec.default_virtual if virtual_stages is None else virtual_stages
        return cls(pp, v, spec.style, schedule, m)

    @classmethod
    def single(cls) -> StagePlan:
        """No pipeline: one stage on one rank."""
        return cls()

    @property
    def spec(self) -> ScheduleSpec | None:
        return SCHEDULES[self.schedule] if self.schedule is not None else None

    @property
    def n_stages(self) -> int:
        return self.pp * self.virtual_stages

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages pipeline rank ``pp_rank`` holds, in increasing order.

        ``"loop"`` (interleaved 1F1B): rank r holds r, r + p, r + 2p, ... -- each pass runs down all ranks.
        ``"v"`` (ZBV, DualPipeV): the passes alternate direction, so rank r holds r and 2p - 1 - r (and 2p + r,
        4p - 1 - r, ... for more virtual stages). Rank 0 then holds both the first and the last stage.
        """
        p = self.pp
        if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < p:
            raise LayoutError(f"pp_rank={pp_rank!r} is outside the {p} pipeline ranks 0..{p - 1}.")
        return [chunk * p + (p - 1 - pp_rank if self.style == "v" and chunk % 2 else pp_rank)
                for chunk in range(self.virtual_stages)]

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``: the inverse of :meth:`stages_of`."""
        n = self.n_stages
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < n:
            raise LayoutError(f"stage {stage!r} is outside the {n} stages 0..{n - 1}.")
        chunk, offset = divmod(stage, self.pp)
        return self.pp - 1 - offset if self.style == "v" and chunk % 2 else offset

