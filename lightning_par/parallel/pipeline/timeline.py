"""Record what a ``torch.distributed.pipelining`` schedule actually executes, measure its bubble, draw it.

The schedules drive their stages through three methods of ``PipelineStage``:

- ``forward_one_chunk(mb, ...)``: forward of one micro-batch (recorded as kind ``"F"``);
- ``backward_one_chunk(mb, ..., full_backward=...)``: the full backward (``full_backward=True``, GPipe, 1F1B,
  interleaved 1F1B) or only the gradient of the stage input (``full_backward=False``, zero-bubble schedules);
  both are recorded as kind ``"B"``, with :attr:`ComputeRecord.full` telling them apart;
- ``backward_weight_one_chunk(mb, ...)``: the deferred weight gradient of the zero-bubble schedules (kind ``"W"``).

:class:`ScheduleRecorder` wraps those methods on a given list of stages for the duration of a ``with`` block and
notes the start and end of every call. Waiting for a peer's activations or gradients happens in the schedule,
before these methods are called, so a record covers compute only and the gaps between records are the bubble.

Clock: each rank takes the moment it leaves a barrier over the pipeline group as its zero; the ranks leave it
within a millisecond or so of each other (a few ms on a loaded machine). :attr:`ScheduleRecorder.origin` keeps the
raw ``time.perf_counter`` value of that zero: on one host it is a clock shared by all ranks, and
:func:`gather_records` can use it to align the ranks exactly.

On CUDA the methods only queue kernels, so the host clock around them would time the launches. There each action
gets a pair of CUDA events (``enable_timing``) recorded on the current stream before and after it, and one more
event marks the zero; the times are resolved when :attr:`ScheduleRecorder.records` is first read, after one
``torch.cuda.synchronize``, as ``elapsed_time`` from the zero event. The zero event is recorded when the host
leaves the barrier, so across ranks the alignment by ``origin`` holds as far as each device was idle then. On CPU
the host clock (``time.perf_counter``) is the compute's own.

Then:

- :func:`gather_records` collects every rank's records (``all_gather_object``);
- :func:`bubble_fraction` gives each rank's idle fraction of the makespan;
- :func:`peak_in_flight` gives, per stage, the most micro-batches forwarded but not yet backwarded;
- :func:`replay` re-times the executed order with ideal durations and free communication: the schedule's own
  bubble, the exact reference a measurement should match;
- :func:`draw_timeline` draws one row per rank, as in the GPipe / 1F1B / zero-bubble papers, and returns the
  figure (``SummaryWriter.add_figure`` accepts it).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

KINDS = ("F", "B", "W")

# the PipelineStage method -> the kind of action it performs
_METHODS = {"forward_one_chunk": "F", "backward_one_chunk": "B", "backward_weight_one_chunk": "W"}

# block colours of the drawing, one per kind; later local stages of a rank are drawn in lighter tints
_COLOURS = {"F": "#4c72b0", "B": "#55a868", "W": "#c4a000"}
_LABELS = {"F": "F: forward", "B": "B: backward (input, or full)", "W": "W: backward (weights)"}


@dataclass(frozen=True)
class ComputeRecord:
    """One compute action executed by a pipeline schedule; times in seconds from the rank's zero."""

    rank: int
    kind: str  # "F", "B" or "W"
    stage: int
    microbatch: int
    start: float
    end: float
    full: bool = True  # for kind "B": a full backward (True) or the input gradient only (False)

    @property
    def duration(self) -> float:
        return self.end - self.start


class ScheduleRecorder:
    """Context manager recording every compute action the schedule runs on ``stages`` (this rank's stages).

    ::

        with ScheduleRecorder(stages) as recorder:
            schedule.step(x)              # or target=..., losses=... on the last stage
        records = gather_records(recorder.records, group)

    On entry the stages' methods are wrapped and, if ``torch.distributed`` is initialized, the ranks meet at a
    barrier over the stages' process group; the zero of the clock is taken right after it. On exit the original
    methods are restored. Entering again starts a new recording (the records of the previous one are dropped).
    ``device``: where the stages compute (default: the first stage's ``device``); CUDA actions are timed with CUDA
    events (see the module docstring).
    """

    def __init__(self, stages: Sequence[Any], barrier: bool = True, device: Any = None):
        if not stages:
            raise ValueError("ScheduleRecorder needs at least one pipeline stage")
        self.stages = list(stages)
        self.barrier = barrier
        self.rank = getattr(self.stages[0], "group_rank", 0)
        self.device = torch.device(device if device is not None else getattr(self.stages[0], "device", "cpu"))
        self.cuda = self.device.type == "cuda"
        self._records: list[ComputeRecord] = []
        # CUDA: (record with start = end = 0, start event, end event), resolved when the records are read
        self._pending: list[tuple[ComputeRecord, Any, Any]] = []
        self._zero_event: Any = None
        self.origin = 0.0  # raw time.perf_counter() of the zero of this rank's clock
        self._saved: list[tuple[Any, str, Any]] = []

    @property
    def records(self) -> list[ComputeRecord]:
        """The actions recorded, times in seconds from this rank's zero (on CUDA: the devices' times, resolved at
        the first read after the step, which waits for the device once)."""
        if self._pending:
            torch.cuda.synchronize(self.device)
            zero = self._zero_event
            self._records += [replace(r, start=zero.elapsed_time(start) / 1e3, end=zero.elapsed_time(end) / 1e3)
                              for r, start, end in self._pending]
            self._pending = []
        return self._records

    def __enter__(self) -> ScheduleRecorder:
        self._records, self._pending = [], []
        for stage in self.stages:
            for name, kind in _METHODS.items():
                self._saved.append((stage, name, stage.__dict__.get(name)))
                setattr(stage, name, self._wrap(stage, getattr(stage, name), kind))
        try:
            if self.barrier and dist.is_available() and dist.is_initialized():
                dist.barrier(group=getattr(self.stages[0], "group", None))
        except BaseException:
            self.__exit__()
            raise
        self.origin = time.perf_counter()
        if self.cuda:
            self._zero_event = torch.cuda.Event(enable_timing=True)
            self._zero_event.record()
        return self

    def __exit__(self, *exc_info) -> None:
        while self._saved:
            stage, name, own = self._saved.pop()
            if own is None:
                delattr(stage, name)  # the class's method shows through again
            else:
                setattr(stage, name, own)

    def _wrap(self, stage: Any, method: Callable, kind: str) -> Callable:
        signature = inspect.signature(method)

        @functools.wraps(method)
        def recorded(*args, **kwargs):
            if kind != "F" and not stage.has_backward:  # the stage returns at once: nothing is computed
                return method(*args, **kwargs)
            call = signature.bind(*args, **kwargs)
            microbatch = next(iter(call.arguments.values()))  # the chunk id comes first in all three methods
            full = kind != "B" or bool(call.arguments.get("full_backward", True))
            if self.cuda:  # the kernels this call queues, between two events on the stream
                start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start_event.record()
                try:
                    return method(*args, **kwargs)
                finally:
                    end_event.record()
                    record = ComputeRecord(self.rank, kind, stage.stage_index, int(microbatch), 0.0, 0.0, full)
                    self._pending.append((record, start_event, end_event))
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                end = time.perf_counter()
                self._records.append(ComputeRecord(self.rank, kind, stage.stage_index, int(microbatch),
                                                   start - self.origin, end - self.origin, full))

        return recorded


def gather_records(records: Iterable[ComputeRecord], group: dist.ProcessGroup | None = None,
                   origin: float | None = None) -> list[ComputeRecord]:
    """Every rank's records, on every rank of ``group`` (a collective: all ranks call it), sorted by rank and
    start time.

    By default each rank's times stay relative to its own zero (when it left the recorder's barrier). Pass
    ``origin=recorder.origin`` when all ranks run on one host: ``time.perf_counter`` is then one clock for all of
    them (``CLOCK_MONOTONIC`` on Linux) and every rank's records are moved onto the earliest rank's zero, which
    removes the skew of the barrier (a few ms on a busy machine).
    """
    parts: list[tuple[list[ComputeRecord], float | None] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (list(records), origin), group=group)
    origins = [o for _, o in parts if o is not None]
    base = min(origins) if origin is not None and origins else None
    merged = []
    for part, part_origin in parts:
        shift = part_origin - base if base is not None and part_origin is not None else 0.0
        merged += [replace(r, start=r.start + shift, end=r.end + shift) for r in part]
    return sorted(merged, key=lambda r: (r.rank, r.start))


def bubble_fraction(records: Sequence[ComputeRecord], n_ranks: int) -> dict[str, Any]:
    """Idle fraction of the makespan, per rank and averaged over ranks.

    The makespan runs from the first action's start to the last action's end over all ranks; a rank's idle
    fraction is ``1 - busy / makespan``, with ``busy`` the summed duration of its actions. For GPipe and 1F1B with
    uniform stages this is ``(p-1)/(m+p-1)``. The other common definition, bubble time over ideal (busy) time,
    ``(p-1)/m`` for GPipe, is returned as ``bubble_ratio`` (the summed idle time over the summed busy time).
    """
    if not records:
        raise ValueError("no records")
    makespan = max(r.end for r in records) - min(r.start for r in records)
    busy = [0.0] * n_ranks
    for r in records:
        busy[r.rank] += r.duration
    idle = [1.0 - b / makespan for b in busy]
    total_busy = sum(busy)
    return {"per_rank": idle, "mean": sum(idle) / n_ranks, "makespan": makespan, "busy": busy,
            "bubble_ratio": (n_ranks * makespan - total_busy) / total_busy if total_busy else float("inf")}


def peak_in_flight(records: Iterable[ComputeRecord]) -> dict[int, int]:
    """Per stage, the most micro-batches whose forward has run and whose backward (``"B"``) has not: the
    micro-batches whose activations the stage holds at once (GPipe: ``m``; 1F1B: at most ``p``)."""
    by_stage: dict[int, list[ComputeRecord]] = defaultdict(list)
    for r in records:
        by_stage[r.stage].append(r)
    peaks = {}
    for stage, actions in sorted(by_stage.items()):
        held = peak = 0
        for r in sorted(actions, key=lambda r: r.start):  # one stage lives on one rank: its actions never overlap
            held += {"F": 1, "B": -1}.get(r.kind, 0)
            peak = max(peak, held)
        peaks[stage] = peak
    return peaks


def replay(records: Sequence[ComputeRecord], duration: Callable[[ComputeRecord], float]) -> list[ComputeRecord]:
    """The executed schedule re-timed: each rank runs its recorded actions in the recorded order, each taking
    ``duration(record)``, communication is free, and an action starts once its rank is free and its inputs exist:

    - ``F`` of stage s needs ``F`` of stage s-1 (same micro-batch);
    - ``B`` of stage s needs its own ``F`` and the ``B`` of stage s+1 (the last stage needs only its ``F``);
    - ``W`` needs the ``B`` of the same stage and micro-batch.

    With ``duration`` the nominal cost of each action this is the schedule's own bubble, the reference for a
    measurement on the same schedule.
    """
    last_stage = max(r.stage for r in records)
    queues = {rank: sorted((r for r in records if r.rank == rank), key=lambda r: r.start)
              for rank in {r.rank for r in records}}
    position = dict.fromkeys(queues, 0)
    free = dict.fromkeys(queues, 0.0)
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> end
    out: list[ComputeRecord] = []

    def needs(r: ComputeRecord) -> list[tuple[str, int, int]]:
        if r.kind == "F":
            return [("F", r.stage - 1, r.microbatch)] if r.stage > 0 else []
        if r.kind == "B":
            return [("F", r.stage, r.microbatch)] + ([("B", r.stage + 1, r.microbatch)] if r.stage < last_stage else [])
        return [("B", r.stage, r.microbatch)]

    progress = True
    while progress:
        progress = False
        for rank, queue in queues.items():
            while position[rank] < len(queue):
                r = queue[position[rank]]
                deps = needs(r)
                if any(d not in done for d in deps):
                    break
                start = max([free[rank], *(done[d] for d in deps)])
                end = start + duration(r)
                done[(r.kind, r.stage, r.microbatch)] = end
                free[rank] = end
                out.append(replace(r, start=start, end=end))
                position[rank] += 1
                progress = True
    if len(out) != len(records):
        stuck = {rank: queue[position[rank]] for rank, queue in queues.items() if position[rank] < len(queue)}
        raise RuntimeError(f"replay cannot proceed: the next actions wait on actions never recorded: {stuck}")
    return sorted(out, key=lambda r: (r.rank, r.start))


def _tint(colour: str, amount: float) -> tuple[float, float, float]:
    """``colour`` mixed with white; ``amount`` 0 keeps it, 1 gives white."""
    from matplotlib.colors import to_rgb

    return tuple(c + (1.0 - c) * amount for c in to_rgb(colour))


def row_label(pp_rank: int, stages: Sequence[int], idle: float) -> str:
    """A row of the timeline: the pipeline rank (within its pipeline group, not the global rank), the stages it
    holds and its idle share of the step."""
    held = ", ".join(str(s) for s in stages)
    return f"pp rank {pp_rank}\nstage{'s' if len(stages) > 1 else ''} {held}\nidle {idle:.0%}"


def box_label(record: ComputeRecord, stages: Sequence[int]) -> str:
    """A block of the timeline: its micro-batch, and its stage where the rank holds several (interleaved, V)."""
    return str(record.microbatch) if len(stages) <= 1 else f"{record.microbatch}\ns{record.stage}"


def draw_timeline(records: Sequence[ComputeRecord], path_png: str | Path | None, title: str = "",
                  n_ranks: int | None = None):
    """Draw the records as a pipeline diagram, one row per pipeline rank (0 on top), time in ms on the x axis.

    Blocks are coloured by kind (F, B, W) and labelled with the micro-batch; when a rank holds several stages
    (interleaved and V schedules) they also name their stage (``s3``) and the blocks of its later stages are lighter.
    Each row is labelled with the pipeline rank, its stages and its idle fraction (:func:`row_label`). The PNG is
    written if ``path_png`` is given; the ``matplotlib.figure.Figure`` is returned either way (log it with
    ``SummaryWriter.add_figure``). Uses the Agg canvas only: no display is needed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    if not records:
        raise ValueError("no records to draw")
    n_ranks = n_ranks or max(r.rank for r in records) + 1
    origin = min(r.start for r in records)
    makespan_ms = (max(r.end for r in records) - origin) * 1e3
    idle = bubble_fraction(records, n_ranks)["per_rank"]
    local_stages = {rank: sorted({r.stage for r in records if r.rank == rank}) for rank in range(n_ranks)}

    per_rank = len(records) / n_ranks
    fig = Figure(figsize=(min(24.0, max(8.0, 4.0 + 0.35 * per_rank)), 0.7 * n_ranks + 1.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_xlim(0, makespan_ms * 1.01)
    ax.set_ylim(n_ranks - 0.5, -0.5)
    for r in records:
        x, width = (r.start - origin) * 1e3, r.duration * 1e3
        tint = 0.45 * local_stages[r.rank].index(r.stage) / max(1, len(local_stages[r.rank]) - 1)
        ax.barh(r.rank, width, left=x, height=0.8, color=_tint(_COLOURS[r.kind], tint), edgecolor="black",
                linewidth=0.4)
        if width > 0.012 * makespan_ms:  # label the block unless it is too narrow to hold the number
            ax.text(x + width / 2, r.rank, box_label(r, local_stages[r.rank]), ha="center", va="center", fontsize=7,
                    clip_on=True)
    ax.set_yticks(range(n_ranks), [row_label(i, local_stages[i], idle[i]) for i in range(n_ranks)], fontsize=8)
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=10)
    handles = [Patch(color=_COLOURS[k], label=_LABELS[k]) for k in KINDS if any(r.kind == k for r in records)]
    if any(len(stages) > 1 for stages in local_stages.values()):
        handles.append(Patch(color=_tint("#808080", 0.45), label="sN: stage N (lighter: the rank's later stage)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_figheight(), 1, 1))  # room for the legend: about 0.35 inch
    if path_png is not None:
        Path(path_png).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path_png, dpi=120)
    return fig

