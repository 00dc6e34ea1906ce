"""The pipeline bubble of ``torch.distributed.pipelining``'s schedules, measured, and their executed timelines.

p ranks (gloo, CPU) run each schedule on stages whose cost is set by ``time.sleep``, not by arithmetic: a sleeping
rank leaves the CPU free, so p ranks on 2 cores measure the schedule, not CPU contention. Activations are one
row of 4 floats, so communication is negligible next to the sleeps.

Cost model (per micro-batch, summed over the stages of one rank): forward ``t``, input-gradient backward ``t``,
weight-gradient backward ``t``, i.e. a full backward of ``2t``: the ``T_F = T_B = T_W`` of the zero-bubble paper and
the usual ``t_b = 2 t_f``. A rank holding v stages gives each a v-th of it. The stage (:class:`SleepStage`) builds
two autograd paths, one per backward half, so that torch's split backward pays each half where it belongs:

- ``x -> Sleep(t_f, t_b) -> h``: the input path. Its forward sleeps ``t_f``; its backward (``t_b``) runs in the
  input-gradient backward ``B`` (``stage_backward_input``: ``autograd.grad`` towards the stage input only).
- ``weight -> Sleep(0, t_w) -> w``: the weight path, joined by ``h * w``. Its backward (``t_w``) runs only in the
  weight-gradient backward ``W`` (``stage_backward_weight`` resumes autograd from ``h * w`` towards the weight).

A full backward runs both. torch computes nothing in stage 0's ``B`` (its input needs no gradient) and runs stage
0's whole backward in its ``W``: the recorded timelines show that, and the reference :func:`replay` models it.

The bubble is the idle fraction of the makespan, ``1 - busy / makespan`` averaged over ranks (see
``bubble_fraction``), of the best of ``--repeats`` measured steps (other processes on the machine only ever add
idle time), reported against:

- ``formula``: the papers' bubble in the same definition. GPipe and 1F1B: (p-1)/(m+p-1) (bubble over compute
  (p-1)/m); interleaved 1F1B and looped BFS with v stages per rank: (p-1)/(mv+p-1) (bubble over compute
  (p-1)/(mv)). Approximate only, hence not checked: ZB-H1-like interleaved zero bubble (bubble over compute about
  (p-1)/(3mv)) and the V schedules (about 0).
- ``replay``: the executed order of actions re-timed with the nominal costs and free communication: the schedule's
  own bubble. It equals the formulas above where they are exact. One schedule does worse than its replay by
  construction: torch's DualPipeV runs each overlapped forward-backward pair one after the other and only then sends
  both results (``_add_send_recv`` appends the sends after the whole OVERLAP_F_B action), which the replay, sending
  each result as soon as it is computed, does not model.

Each measured step should exceed its replay by a little: the ~1 ms per action of gloo messages and schedule
bookkeeping (``free_comm_idle`` replays the measured durations with free communication to show that share).
That overhead is about fixed per action, so the default forward cost, 50 ms per micro-batch and rank, is chosen
to keep it within 0.03 of idle for every schedule on a 2-core machine; 20 ms does not (GPipe +0.03 to +0.04).

    python benchmarks/pipeline_bubble.py                       # p=4, m=4,8,16, all schedules: about 2 minutes
    python benchmarks/pipeline_bubble.py --schedules GPipe 1F1B --microbatches 8 --tensorboard /tmp/tb
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed import pipelining

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_par.measure import ActivationMeter  # noqa: E402
from lightning_par.parallel.pipeline.timeline import (  # noqa: E402
    ComputeRecord,
    ScheduleRecorder,
    bubble_fraction,
    draw_timeline,
    gather_records,
    peak_in_flight,
    replay,
)

DIM = 4  # features per activation row: communication stays negligible


@dataclass(frozen=True)
class Schedule:
    cls_name: str  # the class in torch.distributed.pipelining
    stages_per_rank: int
    placement: str  # "loop": rank r holds stages r, r+p, ...; "v": rank r holds stages r and 2p-1-r
    formula: str | None  # "1f1b": (p-1)/(mv+p-1) is exact; "zb1p" / "zero": approximate; None: no closed form


SCHEDULES = {
    "GPipe": Schedule("ScheduleGPipe", 1, "loop", "1f1b"),
    "1F1B": Schedule("Schedule1F1B", 1, "loop", "1f1b"),
    "Interleaved1F1B": Schedule("ScheduleInterleaved1F1B", 2, "loop", "1f1b"),
    "LoopedBFS": Schedule("ScheduleLoopedBFS", 2, "loop", "1f1b"),
    "InterleavedZeroBubble": Schedule("ScheduleInterleavedZeroBubble", 2, "loop", "zb1p"),
    "ZBVZeroBubble": Schedule("ScheduleZBVZeroBubble", 2, "v", "zero"),
    "DualPipeV": Schedule("ScheduleDualPipeV", 2, "v", None),
}


def formula(schedule: Schedule, p: int, m: int) -> dict | None:
    """The papers' bubble as an idle fraction of the makespan, and whether that formula is exact here."""
    v = schedule.stages_per_rank
    if schedule.formula == "1f1b":
        ratio, exact = (p - 1) / (m * v), True
    elif schedule.formula == "zb1p":
        ratio, exact = (p - 1) / (3 * m * v), False
    elif schedule.formula == "zero":
        ratio, exact = 0.0, False
    else:
        return None
    return {"idle": ratio / (1 + ratio), "bubble_ratio": ratio, "exact": exact}


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``t_forward`` seconds and whose backward sleeps ``t_backward``."""

    @staticmethod
    def forward(ctx, x, t_forward: float, t_backward: float):
        time.sleep(t_forward)
        ctx.t_backward = t_backward
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.t_backward)
        return grad, None, None


class SleepStage(nn.Module):
    """A pipeline stage that costs ``t_f`` in forward, ``t_b`` in the input-gradient backward and ``t_w`` in the
    weight-gradient backward (see the module docstring)."""

    def __init__(self, t_f: float, t_b: float, t_w: float, dim: int = DIM):
        super().__init__()
        self.t_f, self.t_b, self.t_w = t_f, t_b, t_w
        self.timed = True  # False: no sleeping (the untimed warm-up step)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if torch.is_grad_enabled() and not x.requires_grad:
            # the first stage's input (the data) needs no gradient, but a real first stage still back-propagates
            # through its own layers: make the input path part of the graph so its backward cost is paid
            x = x.detach().requires_grad_()
        on = float(self.timed)
        return _Sleep.apply(x, on * self.t_f, on * self.t_b) * _Sleep.apply(self.weight, 0.0, on * self.t_w)


def stage_indices(schedule: Schedule, rank: int, p: int) -> list[int]:
    if schedule.placement == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + k * p for k in range(schedule.stages_per_rank)]


def nominal_cost(t: float, v: int):
    """The cost of each recorded action under the cost model; stage 0's split backward as torch runs it."""

    def cost(r: ComputeRecord) -> float:
        if r.kind == "F":
            return t / v
        if r.kind == "B":
            if r.full:
                return 2 * t / v
            return 0.0 if r.stage == 0 else t / v
        return 2 * t / v if r.stage == 0 else t / v

    return cost


def _mse(output, target):
    return ((output - target) ** 2).mean()


def measure(name: str, m: int, t: float, repeats: int) -> dict:
    """Run schedule ``name`` with ``m`` micro-batches on the default process group; every rank calls it and every
    rank gets the result (records of the first measured step included)."""
    schedule = SCHEDULES[name]
    rank, p = dist.get_rank(), dist.get_world_size()
    v = schedule.stages_per_rank
    n_stages = p * v
    stages = [pipelining.PipelineStage(SleepStage(t / v, t / v, t / v), i, n_stages, torch.device("cpu"))
              for i in stage_indices(schedule, rank, p)]
    cls = getattr(pipelining, schedule.cls_name)
    try:
        runner = cls(stages[0] if v == 1 else stages, n_microbatches=m, loss_fn=_mse, scale_grads=False)
    except ValueError as err:  # the same on every rank: the schedule refuses this (p, m)
        return {"schedule": name, "m": m, "p": p, "v": v, "unsupported": str(err)}

    torch.manual_seed(0)
    x, target = torch.randn(m, DIM), torch.randn(m, DIM)
    args = (x,) if any(s.is_first for s in stages) else ()
    last = any(s.is_last for s in stages)

    def step():
        losses: list = []
        runner.step(*args, **({"target": target, "losses": losses} if last else {}))

    # the first step exchanges shapes and warms the communicators: not measured, and not slept through
    for stage in stages:
        stage.submod.timed = False
    step()
    for stage in stages:
        stage.submod.timed = True
    steps = []
    params = [w for stage in stages for w in stage.submod.parameters()]
    for _ in range(repeats):
        with ScheduleRecorder(stages) as recorder, ActivationMeter(params) as meter:
            step()
        peak_bytes: list = [None] * p
        dist.all_gather_object(peak_bytes, meter.peak_bytes)
        # one host: align the ranks on the shared perf_counter clock rather than trust the barrier
        records = gather_records(recorder.records, origin=recorder.origin)
        origins: list = [None] * p
        dist.all_gather_object(origins, recorder.origin)
        measured = bubble_fraction(records, p)
        ideal = bubble_fraction(replay(records, nominal_cost(t, v)), p)
        steps.append({"records": records, "idle": measured["mean"], "per_rank": measured["per_rank"],
                      "bubble_ratio": measured["bubble_ratio"], "makespan_s": measured["makespan"],
                      "replay_idle": ideal["mean"], "replay_makespan_s": ideal["makespan"],
                      # the measured durations, communication free: what is left of the idle time is the schedule's
                      "free_comm_idle": bubble_fraction(replay(records, lambda r: r.duration), p)["mean"],
                      "clock_skew_s": max(origins) - min(origins), "peak_activation_bytes": peak_bytes})
    # the step least disturbed by everything else the machine runs: the other processes only ever add idle time
    best = min(steps, key=lambda s: s["idle"])
    return {"schedule": name, "m": m, "p": p, "v": v, "t_forward_s": t,
            "idle": best["idle"], "idle_per_step": [s["idle"] for s in steps],
            "idle_per_rank": best["per_rank"], "bubble_ratio": best["bubble_ratio"],
            "makespan_s": best["makespan_s"], "replay_idle": best["replay_idle"],
            "replay_makespan_s": best["replay_makespan_s"], "free_comm_idle": best["free_comm_idle"],
            "formula": formula(schedule, p, m), "peak_in_flight": peak_in_flight(best["records"]),
            "peak_activation_bytes": best["peak_activation_bytes"],
            "clock_skew_s": max(s["clock_skew_s"] for s in steps), "records": best["records"]}


def _worker(rank: int, world: int, store: str, cases: list, t: float, repeats: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        results = [measure(name, m, t, repeats) for name, m in cases]
        if rank == 0:
            Path(out).write_bytes(pickle.dumps(results))
    finally:
        dist.destroy_process_group()


def run(cases: list[tuple[str, int]], p: int = 4, t: float = 0.05, repeats: int = 2) -> list[dict]:
    """Measure each ``(schedule name, m)`` of ``cases`` on ``p`` spawned gloo ranks; one result dict per case."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pkl")
        mp.spawn(_worker, args=(p, os.path.join(tmp, "store"), cases, t, repeats, out), nprocs=p, join=True)
        return pickle.loads(Path(out).read_bytes())


_LEGEND = """\
idle: 1 - busy/makespan, mean over ranks, the best of the measured steps. theory: the papers' formula in that
definition (~: approximate). replay: torch's executed order re-timed with the nominal costs, communication free
(the schedule's exact bubble). delta: measured - theory where the formula is exact, else measured - replay.
free-comm: the measured durations replayed with free communication; measured - free-comm is the idle time due to
communication and the schedule's own bookkeeping. bub/busy: idle time over busy time (the (p-1)/m definition).
peak: most micro-batches forwarded but not yet backwarded on one stage. act B r0: the most bytes autograd held for
backward at once on rank 0 (lightning_par.measure.ActivationMeter), which the peak in flight sets."""


def _row(r: dict) -> str:
    if "unsupported" in r:
        return f"{r['schedule']:<22} {r['m']:>3}  unsupported: {r['unsupported'][:70]}"
    f = r["formula"]
    theory = "     -" if f is None else f"{f['idle']:6.3f}" + ("~" if not f["exact"] else " ")
    delta = r["idle"] - (f["idle"] if f and f["exact"] else r["replay_idle"])
    peak = max(r["peak_in_flight"].values())
    return (f"{r['schedule']:<22} {r['m']:>3} {r['idle']:8.3f} {theory:>7} {r['replay_idle']:7.3f} {delta:+7.3f} "
            f"{r['free_comm_idle']:9.3f} {r['bubble_ratio']:8.3f} {r['makespan_s'] * 1e3:8.0f} "
            f"{r['replay_makespan_s'] * 1e3:8.0f} {peak:5d} {r['peak_activation_bytes'][0]:8d}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--t-forward", type=float, default=0.05, help="forward seconds per micro-batch and rank")
    parser.add_argument("--repeats", type=int, default=2, help="measured steps per case (the best is kept)")
    parser.add_argument("--draw-m", type=int, default=8, help="draw the timelines of this m")
    parser.add_argument("--out", default="benchmarks/results", help="pipeline_bubble.json and timeline PNGs")
    parser.add_argument("--tensorboard", default=None, help="also log the timelines to this TensorBoard dir")
    opts = parser.parse_args()

    began = time.perf_counter()
    cases = [(name, m) for name in opts.schedules for m in opts.microbatches]
    results = run(cases, opts.ranks, opts.t_forward, opts.repeats)
    wall = time.perf_counter() - began

    t_ms = opts.t_forward * 1e3
    print(f"p={opts.ranks}; per micro-batch and rank: forward {t_ms:.0f} ms, input-gradient {t_ms:.0f} ms, "
          f"weight-gradient {t_ms:.0f} ms (full backward {2 * t_ms:.0f} ms)\n{_LEGEND}")
    print(f"{'schedule':<22} {'m':>3} {'measured':>8} {'theory':>7} {'replay':>7} {'delta':>7} {'free-comm':>9} "
          f"{'bub/busy':>8} {'span ms':>8} {'ideal ms':>8} {'peak':>5} {'act B r0':>8}")
    for r in results:
        print(_row(r))
    print(f"total {wall:.0f} s")

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    writer = None
    if opts.tensorboard:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(opts.tensorboard)
    for r in results:
        if r["m"] == opts.draw_m and "records" in r:
            title = (f"{r['schedule']}: p={r['p']}, m={r['m']}, {r['v']} stage(s) per rank; "
                     f"idle {r['idle']:.1%} (replay {r['replay_idle']:.1%})")
            fig = draw_timeline(r["records"], out / f"timeline_{r['schedule']}.png", title, r["p"])
            if writer is not None:
                writer.add_figure(f"pipeline/{r['schedule']}", fig)
    if writer is not None:
        writer.close()
    summary = {"p": opts.ranks, "t_forward_s": opts.t_forward, "definition": "idle fraction of the makespan, "
               "1 - busy/makespan, mean over ranks; bubble_ratio = idle time / busy time", "wall_s": wall,
               "results": [{k: v for k, v in r.items() if k != "records"} for r in results]}
    (out / "pipeline_bubble.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
