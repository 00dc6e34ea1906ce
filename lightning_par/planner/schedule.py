"""The order a pipeline schedule runs its actions in, and what that order costs: makespan, bubble, memory in flight.

The order is the one the runtime executes (:mod:`lightning_par.parallel.pipeline.runtime` builds torch's
schedule classes):

- ``gpipe`` and ``1f1b`` are torch's single-stage schedules, whose order lives in their ``_step_microbatches``
  loops: GPipe runs every forward, then every backward; 1F1B runs ``min(m, p - rank)`` forwards, then alternates one
  backward and one forward, then the remaining backwards;
- the multi-stage schedules (interleaved 1F1B, looped BFS, interleaved zero bubble, ZBV, DualPipeV) build a
  ``pipeline_order`` when they are made; it is read from torch's classes here, made on stand-in stages (no process
  group, no model), so the planner follows torch's order exactly.

:func:`simulate` then runs the order with a cost per action and a transfer time between ranks, as
:func:`lightning_par.parallel.pipeline.timeline.replay` re-times a recorded one: the makespan, each rank's idle
fraction (the bubble) and the most bytes of activations each rank holds at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import NamedTuple

from lightning_par._compat import schedule_order_only
from lightning_par.parallel.stage_plan import SCHEDULES, StagePlan

#: Of what a zero-bubble input-gradient backward's graph saved, the share counted as held until the step ends
#: (see :func:`simulate`): the middle of the bracket [0, 1] the collector's timing spans.
KEPT_AFTER_W = 0.5


class Action(NamedTuple):
    """One compute action: ``kind`` "F" (forward), "B" (full backward), "I" (input-gradient backward of the
    zero-bubble schedules) or "W" (their deferred weight-gradient backward)."""

    stage: int
    kind: str
    microbatch: int


class _StandInStage:
    """What torch's schedule constructors read from a ``PipelineStage``."""

    def __init__(self, index: int, n_stages: int, pp: int, rank: int) -> None:
        import torch

        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, pp, rank
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.has_backward = True
        self.submod = torch.nn.Identity()


def _single_stage_order(name: str, pp: int, m: int) -> dict[int, list[Action]]:
    out = {}
    for rank in range(pp):
        if name == "gpipe":
            out[rank] = [Action(rank, "F", i) for i in range(m)] + [Action(rank, "B", i) for i in range(m)]
            continue
        warmup = min(m, pp - rank)  # torch's Schedule1F1B: the last stage warms up with 1, the first with p
        actions = [Action(rank, "F", i) for i in range(warmup)]
        forward, backward = warmup, 0
        while backward < m:
            actions.append(Action(rank, "B", backward))
            backward += 1
            if forward < m:
                actions.append(Action(rank, "F", forward))
                forward += 1
        out[rank] = actions
    return out


_compute_order_only = cache(schedule_order_only)


@lru_cache(maxsize=256)
def _order(name: str, pp: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    spec = SCHEDULES[name]
    if spec.torch_class in ("ScheduleGPipe", "Schedule1F1B"):
        order = _single_stage_order(name, pp, m)
    else:
        from torch.distributed import pipelining

        stages = [_StandInStage(i, pp * v, pp, 0) for i in StagePlan(pp, v, spec.style).stages_of(0)]
        schedule = _compute_order_only(getattr(pipelining, spec.torch_class))(
            stages, n_microbatches=m, loss_fn=lambda out, target: out, scale_grads=False)
        order = {}
        for rank, actions in schedule.pipeline_order.items():
            out: list[Action] = []
            for action in actions:
                if action is None:
                    continue
                parts = getattr(action, "sub_actions", None) or (action,)  # DualPipeV's overlapped F and B
                for part in parts:
                    kind = part.computation_type.value
                    if kind in ("F", "B", "I", "W"):
                        out.append(Action(part.stage_index, kind, part.microbatch_index))
            order[rank] = out
    return tuple(tuple(order[rank]) for rank in range(pp))


def action_order(name: str, pp: int, n_microbatches: int | None = None,
                 virtual_stages: int | None = None) -> dict[int, list[Action]]:
    """Each pipeline rank's compute actions, in the order the runtime runs them."""
    plan = StagePlan.for_schedule(name, pp, n_microbatches, virtual_stages)
    order = _order(name, pp, plan.n_microbatches, plan.virtual_stages)
    return {rank: list(actions) for rank, actions in enumerate(order)}


def rank_of_stage(name: str, pp: int, virtual_stages: int) -> Callable[[int], int]:
    return StagePlan(pp, virtual_stages, SCHEDULES[name].style).rank_of


@dataclass
class Simulation:
    """A schedule run with given costs.

    Attributes:
        makespan: from the first action's start to the last action's end.
        busy: per rank, the summed duration of its actions.
        bubble: per rank, the idle fraction of the makespan; ``mean_bubble`` averages them (what the runtime's
            ``pipeline/bubble_fraction`` reports).
        peak_held: per rank, the most bytes autograd holds saved at once (what
            :class:`~lightning_par.measure.ActivationMeter` measures).
        peak_with_grads: the same with the output gradients a zero-bubble I keeps for its W.
        peak_in_flight: per stage, the most micro-batches forwarded and not yet released.
        timeline: ``(rank, action, start, end)`` of every action.
        rank_end: per rank, when its last action ends (its schedule returns).
        rank_first_forward: per rank, when its first forward starts (what precedes it is idle).
        rank_last_grads: per rank, when the first of its stages starts the backward that completes the stage's
            gradients (the last micro-batch's B, or W): from then on its gradients are final, bucket by bucket,
            and can be reduced under the rest of its schedule.
    """

    makespan: float
    busy: list[float]
    bubble: list[float]
    peak_held: list[float]
    peak_with_grads: list[float]
    peak_in_flight: dict[int, int]
    timeline: list[tuple[int, Action, float, float]]
    rank_end: list[float] = field(default_factory=list)
    rank_first_forward: list[float] = field(default_factory=list)
    rank_last_grads: list[float] = field(default_factory=list)

    @property
    def mean_bubble(self) -> float:
        return sum(self.bubble) / len(self.bubble)


def simulate(order: dict[int, list[Action]], n_stages: int, rank_of: Callable[[int], int],
             cost: Callable[[Action], float], transfer: Callable[[int, int], float] | None = None,
             held: Callable[[int], float] | None = None,
             held_for_w: Callable[[int], float] | None = None,
             released_by_w: Callable[[int], float] | None = None) -> Simulation:
    """Run ``order``: each rank runs its actions in order; an action starts when its rank is free and its inputs
    exist -- F of stage s needs F of s-1; B / I of s needs F of s and B / I of s+1; W needs I of s.

    ``cost(action)``: its duration. ``transfer(src_stage, dst_stage)``: time to move an activation or a gradient
    between the two stages when they sit on different ranks. ``held(stage)``: the bytes one micro-batch's forward
    of the stage keeps for backward; they are released by its full backward (B) or, in the zero-bubble schedules,
    by its weight-gradient backward (W): the input-gradient backward (I) keeps the graph for W, and adds
    ``held_for_w(stage)``, the output gradients W starts from (torch's ``stage_backward_input``). W then releases
    ``released_by_w(stage)`` of the stage's bytes (what only the weight gradients read). What the nodes run by I
    saved is released with the graph: on the last stage at the end of the step (the schedule keeps each
    micro-batch's loss, and with it the graph, until then); on the others when Python's garbage collector breaks
    the reference cycles torch's hooks make, somewhere between right after W and the end of the step. The planner
    cannot time the collector; it counts :data:`KEPT_AFTER_W` of those bytes as held to the end of the step. The
    first stage has no input gradient to compute: torch runs its whole backward, releasing everything, in W.
    """
    transfer = transfer or (lambda a, b: 0.0)
    held = held or (lambda s: 0.0)
    held_for_w = held_for_w or (lambda s: 0.0)
    released_by_w = released_by_w or held
    owner = [rank_of(stage) for stage in range(n_stages)]  # asked once: the inner loop runs once per action
    last = n_stages - 1
    position = dict.fromkeys(order, 0)
    free = dict.fromkeys(order, 0.0)
    done: dict[tuple[str, int, int], float] = {}
    live = dict.fromkeys(order, 0.0)
    grads = dict.fromkeys(order, 0.0)
    peak = dict.fromkeys(order, 0.0)
    peak_grads = dict.fromkeys(order, 0.0)
    in_flight: dict[int, int] = {}
    peak_flight: dict[int, int] = {}
    timeline: list[tuple[int, Action, float, float]] = []

    # each action prepared once: what it waits for (with the transfer from another rank), its cost, what it
    # completes, and how it changes the bytes its rank holds -- the loop below then only compares and adds
    from_prev = [transfer(s - 1, s) if s > 0 and owner[s - 1] != owner[s] else 0.0 for s in range(n_stages)]
    from_next = [transfer(s + 1, s) if s < last and owner[s + 1] != owner[s] else 0.0 for s in range(n_stages)]

    prepared: dict[int, list[tuple]] = {}
    for rank, actions in order.items():
        steps = []
        for action in actions:
            s, kind, mb = action.stage, action.kind, action.microbatch
            if kind == "F":
                needs = ((("F", s - 1, mb), from_prev[s]),) if s > 0 else ()
            elif kind in ("B", "I"):
                needs = ((("F", s, mb), 0.0),) + (((("G", s + 1, mb), from_next[s]),) if s < last else ())
            else:
                needs = ((("G", s, mb), 0.0),)
            live_delta = grads_delta = 0.0
            flight = 0
            if kind == "F":
                live_delta, flight = held(s), 1
            elif kind == "I" and s > 0:
                grads_delta = held_for_w(s)
            elif kind == "B" or (kind == "W" and s == 0):
                live_delta, flight = -held(s), -1
            elif kind == "W":
                kept = held(s) - released_by_w(s)
                share = 1.0 if s == last else KEPT_AFTER_W  # the last stage's loss keeps its graph to the end
                live_delta, grads_delta, flight = -(released_by_w(s) + (1 - share) * kept), -held_for_w(s), -1
            key = ("G" if kind in ("B", "I") else kind, s, mb)
            steps.append((action, needs, cost(action), key, live_delta, grads_delta, flight))
        prepared[rank] = steps

    progress = True
    while progress:
        progress = False
        for rank, steps in prepared.items():
            i, n = position[rank], len(steps)
            while i < n:
                action, needs, duration, key, live_delta, grads_delta, flight = steps[i]
                start = free[rank]
                blocked = False
                for need, extra in needs:
                    end = done.get(need)
                    if end is None:
                        blocked = True
                        break
                    if end + extra > start:
                        start = end + extra
                if blocked:
                    break
                end = start + duration
                free[rank] = end
                done[key] = end
                timeline.append((rank, action, start, end))
                s = action.stage
                if flight:
                    in_flight[s] = in_flight.get(s, 0) + flight
                    if flight > 0 and in_flight[s] > peak_flight.get(s, 0):
                        peak_flight[s] = in_flight[s]
                if live_delta:
                    live[rank] += live_delta
                if grads_delta:
                    grads[rank] += grads_delta
                if live[rank] > peak[rank]:
                    peak[rank] = live[rank]
                if live[rank] + grads[rank] > peak_grads[rank]:
                    peak_grads[rank] = live[rank] + grads[rank]
                i += 1
                progress = True
            position[rank] = i
    stuck = {r: order[r][position[r]] for r in order if position[r] < len(order[r])}
    if stuck:
        raise RuntimeError(f"the schedule cannot proceed: the next actions wait on actions it never runs: {stuck}")
    start = min(t[2] for t in timeline)
    makespan = max(t[3] for t in timeline) - start
    busy = dict.fromkeys(order, 0.0)
    rank_end = dict.fromkeys(order, start)
    first_forward = dict.fromkeys(order, float("inf"))
    last_grads: dict[int, tuple[float, float]] = {}  # stage -> (end, start) of its latest B or W
    for rank, action, begin, end in timeline:
        busy[rank] += end - begin
        rank_end[rank] = max(rank_end[rank], end)
        if action.kind == "F":
            first_forward[rank] = min(first_forward[rank], begin)
        elif action.kind in ("B", "W") and end >= last_grads.get(action.stage, (-1.0, 0.0))[0]:
            last_grads[action.stage] = (end, begin)
    grads_start = dict(rank_end)
    for stage, (_, begin) in last_grads.items():
        grads_start[owner[stage]] = min(grads_start[owner[stage]], begin)
    ranks = sorted(order)
    busy = [busy[rank] for rank in ranks]
    bubble = [1.0 - b / makespan if makespan > 0 else 0.0 for b in busy]
    return Simulation(makespan, busy, bubble, [peak[r] for r in ranks],
                      [peak_grads[r] for r in ranks], dict(sorted(peak_flight.items())), timeline,
                      [rank_end[r] - start for r in ranks], [min(first_forward[r], rank_end[r]) - start for r in ranks],
                      [grads_start[r] - start for r in ranks])


def formula_bubble(name: str, pp: int, m: int, v: int) -> float | None:
    """The closed-form idle fraction of the makespan for uniform stages with B = 2F: ``(p-1)/(m+p-1)`` for GPipe
    and 1F1B, ``(p-1)/(mv+p-1)`` for interleaved 1F1B and looped BFS; None for the zero-bubble schedules."""
    if name in ("gpipe", "1f1b"):
        return (pp - 1) / (m + pp - 1)
    if name in ("interleaved_1f1b", "looped_bfs"):
        return (pp - 1) / (m * v + pp - 1)
    return None


def extrapolate(a: Simulation, b: Simulation, m_a: int, m_b: int, m: int) -> Simulation:
    """The simulation of ``m`` micro-batches from those of ``m_a`` and ``m_b`` (both past the warmup): once every
    rank is in its steady state each further micro-batch adds the same time and the same bytes (none where the
    schedule releases as it goes, one micro-batch's under GPipe), so every figure is the line through the two. The
    timeline is left empty. For large ``m`` (thousands of micro-batches on large worlds), where running every action
    costs seconds per layout."""
    t = (m - m_a) / (m_b - m_a)

    def line(x: float, y: float) -> float:
        return x + t * (y - x)

    makespan = line(a.makespan, b.makespan)
    busy = [line(x, y) for x, y in zip(a.busy, b.busy, strict=True)]
    return Simulation(
        makespan, busy, [1.0 - u / makespan if makespan > 0 else 0.0 for u in busy],
        [line(x, y) for x, y in zip(a.peak_held, b.peak_held, strict=True)],
        [line(x, y) for x, y in zip(a.peak_with_grads, b.peak_with_grads, strict=True)],
        {s: round(line(a.peak_in_flight[s], b.peak_in_flight[s])) for s in a.peak_in_flight}, [],
        [line(x, y) for x, y in zip(a.rank_end, b.rank_end, strict=True)], list(b.rank_first_forward),
        [line(x, y) for x, y in zip(a.rank_last_grads, b.rank_last_grads, strict=True)])


def steady_microbatches(name: str, pp: int, m: int, v: int) -> int | None:
    """A number of micro-batches past the schedule's warmup (a multiple of pp, at least 2 pp and 16: every schedule
    here, with up to 16 ranks and 4 virtual stages, extrapolates exactly from it) whose double ``m`` exceeds twice
    over, or None where ``m`` is small enough to run every action (or the schedule refuses it)."""
    short = pp * -(-max(2 * pp, 16) // pp)
    if m < 4 * short:
        return None
    try:
        StagePlan.for_schedule(name, pp, short, v)
        StagePlan.for_schedule(name, pp, 2 * short, v)
    except Exception:  # noqa: BLE001 -- a LayoutError: the schedule needs other counts; run it whole
        return None
    return short
