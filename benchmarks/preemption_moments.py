"""Preemption at random moments (issue 30): SIGTERM to every rank, as a scheduler preempting the job sends it, at N
moments drawn with a fixed seed over three layouts and three kinds of moment, each run under
``torchrun --max-restarts=1``.

Layouts: ZeRO-2 on 2 ranks, a 2-stage 1F1B pipeline, tp2 x pp2 on 4 ranks. Moments: inside a random optimizer step (a
random fraction of a step's duration after it starts), inside a synchronous checkpoint save, inside an asynchronous
one (a random fraction of a save's duration after it starts; the async write runs beside the next steps). The job:
the tiny GPT, plain SGD, 16 steps in epochs of 8, a checkpoint every 4 steps, heartbeat bound 10 s. The signal is
sent by a thread of rank 0 (``tests.probes.PreemptEveryRank``) to every rank's pid; this process watches the pids.

For each moment: the first attempt's exit codes (as torchrun reports them), seconds from the signal until every
rank's process has exited, the step the checkpoint was saved at against the step the signal landed in, whether that
checkpoint is complete (checked file by file by the next attempt before it saves anything), whether torchrun
restarted the job and the job then ended with exit 0, and the per-step losses of the interrupted job against one
uninterrupted run of the same layout (max abs difference). A moment is ``ok`` when all of that holds.

    python benchmarks/preemption_moments.py                  # 20 moments, about 15 min on 2 idle cores
    python benchmarks/preemption_moments.py --moments 3      # one per layout (tests/launch/test_preemption.py, --full)

Writes benchmarks/results/preemption_moments.json; exits 1 if a moment is not ok.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_par.run.preemption import EXIT_CODE  # noqa: E402
from tests.harness import Run, launch_torchrun, preempted_at, restarted_from, torchrun_first_failure  # noqa: E402

#: name -> (ranks, strategy arguments, per-rank batch): one replica of 8 samples per step, or two of 4
LAYOUTS = {
    "zero2_dp2": (2, ["--trainer.strategy=zero2"], 4),
    "pp2_1f1b": (2, ["--trainer.strategy=pipeline2_1f1b"], 8),
    "tp2_pp2": (4, ["--trainer.strategy=hybrid3d", "--trainer.strategy.tp=2", "--trainer.strategy.pp=2"], 8),
}
KINDS = ("mid_step", "mid_sync_save", "mid_async_save")
MAX_STEPS, EPOCH_STEPS, SAVE_EVERY = 16, 8, 4
HEARTBEAT_S = 10.0
SGD = ["--model.optimizer=sgd", "--model.lr=0.2"]
#: the saves a signal may land in: not the first (it measures a save's duration), not the run's last
SIGNALLED_SAVES = tuple(range(2 * SAVE_EVERY, MAX_STEPS, SAVE_EVERY))


def draw(n: int, seed: int) -> list[dict]:
    """``n`` moments: the layout and kind cycle so that every 9 consecutive moments hold each pair once (and the
    first 3 each layout and each kind once); the step and the fraction are drawn from ``seed``."""
    rng = random.Random(seed)
    names = list(LAYOUTS)
    moments = []
    for i in range(n):
        kind = KINDS[(i + i // len(names)) % len(KINDS)]
        if kind == "mid_step":  # at least one step before it to time; stopped at least one step before the end
            step = rng.randint(2, MAX_STEPS - 3)
        else:
            step = rng.choice(SIGNALLED_SAVES)
        moments.append({"index": i, "layout": names[i % len(names)], "kind": kind, "step": step,
                        "fraction": round(rng.random(), 3)})
    return moments


def job_args(layout: str, async_save: bool = False) -> tuple[int, list[str]]:
    ranks, strategy, batch = LAYOUTS[layout]
    args = [f"--trainer.max_steps={MAX_STEPS}", f"--data.batch_size={batch}", "--trainer.limit_val_batches=0",
            f"--trainer.limit_train_batches={EPOCH_STEPS}", "--sample_tokens=0", *SGD, *strategy,
            f"--trainer.strategy.heartbeat_timeout={HEARTBEAT_S}", "--trainer.enable_checkpointing=true",
            f"--checkpoint_every_n_steps={SAVE_EVERY}"]
    return ranks, args + (["--trainer.strategy.async_save=true"] if async_save else [])


class ExitWatch(threading.Thread):
    """From the signal on (``signal.json`` appears), when each signalled process exits, polled every 5 ms: gone, or
    a zombie its torchrun agent has not reaped yet -- whose exit code ``/proc`` then still shows (``codes``; a
    process reaped between two polls has none)."""

    def __init__(self, probe: Path, limit: float) -> None:
        super().__init__(daemon=True)
        self.probe, self.limit, self.done = probe, limit, threading.Event()
        self.exits: dict[int, float] = {}
        self.codes: dict[int, int] = {}

    def run(self) -> None:
        file = self.probe / "signal.json"
        while not file.is_file():  # the probe writes it whole (a rename), then signals
            if self.done.wait(0.005):
                return
        pids = json.loads(file.read_text())["pids"]
        deadline = time.time() + self.limit
        while len(self.exits) < len(pids) and time.time() < deadline:
            for pid in pids:
                if pid in self.exits:
                    continue
                try:
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:  # reaped
                    self.exits[pid] = time.time()
                    continue
                if fields[0] in ("Z", "X"):
                    self.exits[pid] = time.time()
                    status = int(fields[-1])  # as waitpid(2) reports it: the code, or the signal that ended it
                    self.codes[pid] = status >> 8 if status & 0x7F == 0 else -(status & 0x7F)
            time.sleep(0.005)


def expected_steps(signal: dict) -> list[int]:
    """The steps the agreed stop may follow: the step in progress when the signal landed on rank 0 (its end is the
    first step boundary after it); in a batch's end hooks (where saves and the agreement run), that step or, if
    every rank had already agreed there, the next."""
    started = signal["step_started"]
    return [started + 1] if signal["phase"] == "step" else [started + 1, started + 2]


def preempt(moment: dict, root: Path, cache: Path, reference: list[float], timeout: float) -> dict:
    layout, kind = moment["layout"], moment["kind"]
    ranks, args = job_args(layout, async_save=kind == "mid_async_save")
    probe = root / "probe"
    args += ["--trainer.callbacks+=tests.probes.PreemptEveryRank", f"--trainer.callbacks.path={probe}",
             f"--trainer.callbacks.moment={'step' if kind == 'mid_step' else 'save'}",
             f"--trainer.callbacks.step={moment['step']}", f"--trainer.callbacks.fraction={moment['fraction']}"]
    watch = ExitWatch(probe, limit=timeout)
    watch.start()
    run = launch_torchrun(root / "run", cache, args, nnodes=1, nproc_per_node=ranks, timeout=timeout,
                          torchrun_args=("--max-restarts=1",))
    watch.done.set()
    watch.join(5)
    out = dict(moment, seconds=round(run.seconds, 1), exit_code=run.returncode)
    signal_file = probe / "signal.json"
    if not signal_file.is_file():
        return dict(out, ok=False, error="no signal was sent", log_tail=run.log[-3000:])
    signal = json.loads(signal_file.read_text())
    out.update(signal_phase=signal["phase"], signal_step_started=signal["step_started"],
               save_in_flight=signal["save_in_flight"], delay_s=round(signal["delay"], 3))
    exited = [watch.exits.get(pid) for pid in signal["pids"]]
    out["every_rank_exited"] = all(t is not None for t in exited)
    out["signal_to_exit_s"] = round(max(exited) - signal["time"], 2) if out["every_rank_exited"] else None
    stops = [float(p.read_text()) for p in (probe / "pids").glob("stopped_rank*")]
    # until the last rank stopped (its checkpoint written, or handed to the async writer); the rest is the teardown
    out["signal_to_stop_s"] = round(max(stops) - signal["time"], 2) if len(stops) == ranks else None
    # the code of each rank seen exiting, and the one torchrun reported for the first that failed
    out["first_attempt_exit_codes"] = [watch.codes.get(pid) for pid in signal["pids"]]
    out["torchrun_first_failure"] = torchrun_first_failure(run.log)
    out["torchrun_closed_a_rank"] = "closing signal" in run.log or "Closing process" in run.log
    stopped = preempted_at(run.log)
    out["checkpoint_step"] = stopped[1] if stopped else None
    out["expected_steps"] = expected_steps(signal)
    resumed_file = probe / "resumed.json"
    resumed = json.loads(resumed_file.read_text()) if resumed_file.is_file() else {}
    out["checkpoint_complete"] = bool(resumed.get("complete"))
    out["checkpoint_error"] = resumed.get("error")
    restarted = restarted_from(run.log)
    out["restarted"] = restarted is not None and stopped is not None and restarted == stopped[2]
    out["resumed_at_step"] = resumed.get("global_step")
    out["max_abs_loss_diff"] = _loss_diff(run, reference)
    checks = {
        "exit 75 on every rank of the first attempt": out["torchrun_first_failure"] == EXIT_CODE
            and all(code in (EXIT_CODE, None) for code in out["first_attempt_exit_codes"]),
        f"every rank exited within the heartbeat bound ({HEARTBEAT_S:.0f} s)":
            out["signal_to_exit_s"] is not None and out["signal_to_exit_s"] <= HEARTBEAT_S,
        "the checkpoint at the signal's step": out["checkpoint_step"] in out["expected_steps"],
        "the checkpoint complete": out["checkpoint_complete"],
        "restarted from it": out["restarted"] and out["resumed_at_step"] == out["checkpoint_step"],
        "the job ended with exit 0": run.returncode == 0,
        "losses equal the uninterrupted run's": out["max_abs_loss_diff"] is not None
                                                 and out["max_abs_loss_diff"] <= 1e-5,
    }
    failed = [name for name, ok in checks.items() if not ok]
    out.update(ok=not failed, failed=failed)
    if failed:
        out["log_tail"] = run.log[-4000:]
    return out


def _loss_diff(run: Run, reference: list[float]) -> float | None:
    """The largest per-step difference over the job's steps, both attempts together (the second attempt's steps
    replace anything the first logged at the same step); None if a step is missing."""
    try:
        losses = run.scalars()["train/loss"]
    except (KeyError, OSError):
        return None
    if sorted(losses) != list(range(len(reference))):
        return None
    return max(abs(losses[s] - reference[s]) for s in range(len(reference)))


def uninterrupted(layout: str, root: Path, cache: Path, timeout: float) -> tuple[list[float], float]:
    ranks, args = job_args(layout)
    run = launch_torchrun(root, cache, args, nnodes=1, nproc_per_node=ranks, timeout=timeout).check()
    return run.losses(), run.seconds


def table(rows: list[dict]) -> str:
    head = ("| # | layout | moment | step, fraction | landed in | save in flight | exit codes | signal to stop, exit | "
            "checkpoint step (expected) | complete | restarted | max abs loss diff | wall |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        if "signal_phase" not in r:
            lines.append(f"| {r['index']} | {r['layout']} | {r['kind']} | {r['step']}, {r['fraction']} | "
                         f"{r.get('error', '?')} | | | | | | | | {r['seconds']} s |")
            continue
        landed = f"step {r['signal_step_started']}" + (" (end hooks)" if r["signal_phase"] == "boundary" else "")
        expected = "/".join(str(s) for s in r["expected_steps"])
        diff = "-" if r["max_abs_loss_diff"] is None else f"{r['max_abs_loss_diff']:.1e}"
        exit_s = "-" if r["signal_to_exit_s"] is None else f"{r['signal_to_exit_s']:.1f} s"
        if r.get("signal_to_stop_s") is not None:
            exit_s = f"{r['signal_to_stop_s']:.1f} s, {exit_s}"
        codes = ",".join("?" if c is None else str(c) for c in r["first_attempt_exit_codes"])
        lines.append(
            f"| {r['index']} | {r['layout']} | {r['kind']} | {r['step']}, {r['fraction']} | {landed} | "
            f"{'yes' if r['save_in_flight'] else 'no'} | {codes} | "
            f"{exit_s} | {r['checkpoint_step']} ({expected}) | {'yes' if r['checkpoint_complete'] else 'NO'} | "
            f"{'yes' if r['restarted'] else 'NO'} | {diff} | {r['seconds']:.0f} s |")
    return "\n".join(lines)


def summary(rows: list[dict], seed: int, reference_seconds: dict[str, float], start: float, drawn: int) -> dict:
    exits = [r["signal_to_exit_s"] for r in rows if r.get("signal_to_exit_s") is not None]
    return {
        "job": {"model": "tiny GPT, 8 layers", "optimizer": "SGD lr 0.2", "max_steps": MAX_STEPS,
                "epoch_steps": EPOCH_STEPS, "checkpoint_every": SAVE_EVERY, "heartbeat_timeout_s": HEARTBEAT_S,
                "torchrun": "--max-restarts=1", "layouts": {k: v[1] for k, v in LAYOUTS.items()}},
        "seed": seed, "moments_drawn": drawn, "moments_run": len(rows), "moments": rows,
        "all_ok": len(rows) == drawn and all(r["ok"] for r in rows),
        "reference_seconds": {k: round(v, 1) for k, v in reference_seconds.items()},
        "signal_to_exit_s": {"median": statistics.median(exits), "max": max(exits)} if exits else None,
        "max_abs_loss_diff": max((r["max_abs_loss_diff"] for r in rows if r.get("max_abs_loss_diff") is not None),
                                 default=None),
        "total_seconds": round(time.time() - start, 1),
        "cpus": os.cpu_count(), "load_average_1min_at_end": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--moments", type=int, default=20, help="how many preempted runs (default 20)")
    parser.add_argument("--seed", type=int, default=30, help="draws the moments (default 30)")
    parser.add_argument("--dir", default=None, help="where the runs go (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds per launch")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "preemption_moments.json"))
    args = parser.parse_args(argv)
    start = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    moments = draw(args.moments, args.seed)
    print(f"{len(moments)} moments; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        root = Path(tmp)
        cache = root / "cache"
        references, reference_seconds = {}, {}
        for layout in dict.fromkeys(m["layout"] for m in moments):
            references[layout], reference_seconds[layout] = uninterrupted(layout, root / f"reference_{layout}",
                                                                          cache, args.timeout)
            print(f"reference {layout}: {reference_seconds[layout]:.0f} s", flush=True)
        rows = []
        for moment in moments:
            row = preempt(moment, root / f"moment{moment['index']}", cache, references[moment["layout"]],
                          args.timeout)
            rows.append(row)
            print(f"moment {row['index']} ({row['layout']}, {row['kind']}): {'ok' if row['ok'] else 'FAILED'} "
                  f"{row.get('failed') or ''} in {row['seconds']:.0f} s", flush=True)
            out.write_text(json.dumps(summary(rows, args.seed, reference_seconds, start, len(moments)), indent=1))
    result = summary(rows, args.seed, reference_seconds, start, len(moments))
    print()
    print(table(rows))
    print(f"\n{sum(r['ok'] for r in rows)} of {len(rows)} moments ok; signal to exit: "
          f"{result['signal_to_exit_s']}; total {result['total_seconds']:.0f} s")
    out.write_text(json.dumps(result, indent=1))  # written after each moment too: an interrupted run keeps them
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["all_ok"] else 1)
