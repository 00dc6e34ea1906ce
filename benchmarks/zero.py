"""ZeRO stages measured against the paper's formulas, and side by side with Lightning's own strategies.

(a) Memory and traffic: each ZeRO stage (``zero0`` ... ``zero3``) at several data-parallel sizes trains the example
    GPT for a few steps; ``tests.probes.StateReport`` measures, per rank, the bytes of parameters, gradients and
    optimizer states right after optimizer step 3 and the elements sent during that step. Printed beside the fp32
    Adam formulas (4/4/8 bytes per parameter, divided by N where the stage shards) and 2 Psi (N-1)/N elements sent
    (3 Psi (N-1)/N for stage 3).
(b) Speed and memory, same model, data and steps: Lightning ``ddp``, Lightning ``ModelParallelStrategy`` with an
    FSDP2-sharded GPT (``benchmarks/fsdp2_gpt.py``), and ``zero0`` ... ``zero3``. Throughput is read from the
    ``train/tokens_per_sec`` series (first window dropped), the strategies alternate over rounds, and each ZeRO
    stage is compared with its Lightning counterpart: stages 0-2 with ``ddp``, stage 3 with FSDP2 (step-time ratio:
    median over rounds of the ratio within a round).

A strategy that fails to launch (e.g. a stage not implemented yet) is reported with its error; the others go on.

    python benchmarks/zero.py                 # dp 1, 2, 4; 60 steps x 2 rounds at 2 ranks
    python benchmarks/zero.py --quick         # dp 2 only; 30 steps x 1 round
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    FSDP2,
    last_error,
    launch,
    state_report_args,
    state_reports,
    throughput_windows,
)
from lightning_par.measure import CATEGORIES, traffic_formula, zero_formula  # noqa: E402

#: the optimizer step StateReport measures (after warm-up of the first steps, before the end of the run)
STEP = 3
ZERO = [f"zero{stage}" for stage in range(4)]
LIGHTNING = ["ddp", FSDP2]


def stage_of(strategy: str) -> int | None:
    """``"zero2"`` -> 2; ``None`` for a strategy that is not a ZeRO stage by name."""
    suffix = strategy.removeprefix("zero")
    return int(suffix) if suffix != strategy and suffix.isdigit() else None


def reference_of(strategy: str) -> str | None:
    """The Lightning strategy a ZeRO stage is compared with: FSDP2 for stage 3, DDP below."""
    stage = stage_of(strategy)
    return None if stage is None else (FSDP2 if stage == 3 else "ddp")


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def fmt_ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3f}"


def worst_rank(reports: list[dict]) -> dict:
    """Per category the largest value over ranks (shards differ only by padding)."""
    return {
        "bytes": {c: max(r["bytes"][c] for r in reports) for c in (*CATEGORIES, "total")},
        "sent": {k: max(r["sent"][k] for r in reports) for k in reports[0]["sent"]},
        "sent_total": max(sum(r["sent"].values()) for r in reports),
        "calls": reports[0]["calls"],
        "peak_rss_bytes": max(r.get("peak_rss_bytes") or 0 for r in reports) or None,
        "by_device": reports[0]["bytes"]["by_device"],
    }


# ----------------------------------------------------------------------------------------------------------------------
# (a) memory and traffic against the formulas
# ----------------------------------------------------------------------------------------------------------------------
def memory_and_traffic(tmp: Path, cache: Path, strategies: list[str], dps: list[int], preset: str) -> list[dict]:
    rows = []
    for dp in dps:
        for strategy in strategies:
            root = tmp / f"mem-{strategy}-dp{dp}"
            extra = [f"--trainer.max_steps={STEP}", "--data.batch_size=2", "--trainer.limit_val_batches=0",
                     *state_report_args(root, STEP)]
            run = launch(root, cache, strategy, dp, preset, extra)
            row: dict = {"strategy": strategy, "stage": stage_of(strategy), "dp": dp, "seconds": run.seconds}
            reports = state_reports(run) if run.returncode == 0 else []
            if run.returncode != 0 or len(reports) != dp or any(r["bytes"] is None for r in reports):
                row.update(ok=False, error=last_error(run) if run.returncode else "no state report")
                rows.append(row)
                print(f"  {strategy} dp={dp}: FAILED ({row['error']})", flush=True)
                continue
            stage = reports[0]["stage"] if reports[0]["stage"] is not None else row["stage"]
            numel = reports[0]["numel"]
            measured = worst_rank(reports)
            formula = zero_formula(stage, numel, dp)
            traffic = traffic_formula(stage, numel, dp)
            row.update(ok=True, stage=stage, numel=numel, **measured, formula=formula,
                       ratio={c: ratio(measured["bytes"][c], formula[c]) for c in (*CATEGORIES, "total")},
                       traffic_formula=traffic, traffic_ratio=ratio(measured["sent_total"], traffic))
            rows.append(row)
            print(f"  {strategy} dp={dp}: ok ({run.seconds:.0f} s)", flush=True)
    return rows


def print_memory_table(rows: list[dict], preset: str) -> None:
    numel = next((r["numel"] for r in rows if r["ok"]), None)
    print(f"\n(a) {preset} GPT ({numel} parameters): bytes per rank after optimizer step {STEP} and elements sent "
          "during it, measured / ZeRO formula (ratio); worst rank")
    head = f"{'strategy':<8}{'dp':>3}"
    for title in ("parameters", "gradients", "optimizer states", "elements sent"):
        head += f"  {title:^33}"
    print(head)
    for r in rows:
        line = f"{r['strategy']:<8}{r['dp']:>3}"
        if not r["ok"]:
            print(f"{line}  failed: {r['error']}")
            continue
        for c in CATEGORIES:
            cell = f"{fmt_bytes(r['bytes'][c])} / {fmt_bytes(r['formula'][c])} ({fmt_ratio(r['ratio'][c])})"
            line += f"  {cell:>33}"
        cell = f"{r['sent_total']:.0f} / {r['traffic_formula']:.0f} ({fmt_ratio(r['traffic_ratio'])})"
        line += f"  {cell:>33}"
        print(line)


# ----------------------------------------------------------------------------------------------------------------------
# (b) speed and memory next to Lightning's strategies
# ----------------------------------------------------------------------------------------------------------------------
def side_by_side(tmp: Path, cache: Path, strategies: list[str], devices: int, steps: int, rounds: int,
                 preset: str) -> list[dict]:
    results = {s: {"strategy": s, "windows": [], "round_medians": {}, "ok": True, "seconds": []} for s in strategies}
    for rnd in range(rounds):
        for strategy in strategies:
            res = results[strategy]
            if not res["ok"]:
                continue
            root = tmp / f"speed-{strategy}-{rnd}"
            extra = [f"--trainer.max_steps={steps}", "--data.seq_len=128", "--data.batch_size=8",
                     "--trainer.limit_val_batches=0", "--tokens_per_sec.window=10", *state_report_args(root, STEP)]
            run = launch(root, cache, strategy, devices, preset, extra)
            reports = state_reports(run) if run.returncode == 0 else []
            if run.returncode != 0 or not reports or any(r["bytes"] is None for r in reports):
                res.update(ok=False, error=last_error(run) if run.returncode else "no state report")
                print(f"  {strategy} round {rnd}: FAILED ({res['error']})", flush=True)
                continue
            windows = throughput_windows(run)
            res["windows"] += windows
            res["round_medians"][rnd] = statistics.median(windows)
            res["seconds"].append(run.seconds)
            res.update(worst_rank(reports))
            print(f"  {strategy} round {rnd}: ok ({run.seconds:.0f} s)", flush=True)

    rows = list(results.values())
    for res in rows:
        if res["ok"]:
            res["tokens_per_sec_median"] = statistics.median(res["windows"])
    for res in rows:
        ref = results.get(reference_of(res["strategy"]) or "", {})
        res["reference"] = reference_of(res["strategy"])
        both = res["ok"] and ref.get("ok", False)
        # Step time ours / step time reference = reference tokens/s / our tokens/s, paired within each round: the
        # load of a shared machine drifts between rounds far more than between neighbouring runs of one round.
        paired = [ref["round_medians"][rnd] / ours for rnd, ours in res["round_medians"].items()
                  if both and rnd in ref["round_medians"]]
        res["step_time_ratio"] = statistics.median(paired) if paired else None
        res["step_time_ratio_by_round"] = paired
        res["peak_rss_ratio"] = ratio(res["peak_rss_bytes"], ref["peak_rss_bytes"]) if both else None
        res["state_bytes_ratio"] = ratio(res["bytes"]["total"], ref["bytes"]["total"]) if both else None
    return rows


def print_speed_table(rows: list[dict], preset: str, devices: int, steps: int, rounds: int) -> None:
    print(f"\n(b) {preset} GPT, {devices} CPU ranks, {steps} steps x {rounds} rounds, seq 128 x batch 8 per rank; "
          "ratios are ours / the Lightning reference")
    print(f"{'strategy':<10}{'vs':>6}{'tokens/s':>10}{'step time':>11}{'peak RSS':>12}{'ratio':>8}"
          f"{'state bytes':>13}{'ratio':>8}{'sent/step':>11}")
    for r in rows:
        name = r["strategy"]
        if not r["ok"]:
            print(f"{name:<10}  failed: {r['error']}")
            continue
        ref = r["reference"] or ""
        print(f"{name:<10}{ref:>6}{r['tokens_per_sec_median']:>10.0f}{fmt_ratio(r['step_time_ratio']):>11}"
              f"{fmt_bytes(r['peak_rss_bytes']):>12}{fmt_ratio(r['peak_rss_ratio']):>8}"
              f"{fmt_bytes(r['bytes']['total']):>13}{fmt_ratio(r['state_bytes_ratio']):>8}{r['sent_total']:>11.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--quick", action="store_true", help="a reduced grid: dp 2 only, 30 steps x 1 round")
    parser.add_argument("--dps", type=int, nargs="+", help="data-parallel sizes for (a) (default 1 2 4)")
    parser.add_argument("--strategies", nargs="+", default=ZERO, help="ZeRO strategy names (default zero0..zero3)")
    parser.add_argument("--devices", type=int, default=2, help="ranks for (b)")
    parser.add_argument("--steps", type=int, help="steps per run in (b) (default 60)")
    parser.add_argument("--rounds", type=int, help="alternating rounds in (b) (default 2)")
    parser.add_argument("--skip-speed", action="store_true", help="only (a)")
    parser.add_argument("--json", default="benchmarks/results/zero.json")
    opts = parser.parse_args()
    dps = opts.dps or ([2] if opts.quick else [1, 2, 4])
    steps = opts.steps or (30 if opts.quick else 60)
    rounds = opts.rounds or (1 if opts.quick else 2)

    start = time.time()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        cache = tmp / "cache"
        print("(a) memory and traffic", flush=True)
        memory = memory_and_traffic(tmp, cache, opts.strategies, dps, opts.preset)
        speed = []
        if not opts.skip_speed:
            print("(b) side by side", flush=True)
            speed = side_by_side(tmp, cache, [*LIGHTNING, *opts.strategies], opts.devices, steps, rounds, opts.preset)

    print_memory_table(memory, opts.preset)
    if speed:
        print_speed_table(speed, opts.preset, opts.devices, steps, rounds)
    elapsed = time.time() - start
    print(f"\nbenchmark wall time {elapsed:.0f} s")
    out = Path(opts.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "preset": opts.preset, "measured_step": STEP, "quick": opts.quick, "wall_seconds": elapsed,
        "memory_traffic": memory,
        "speed": {"devices": opts.devices, "steps": steps, "rounds": rounds, "rows": speed},
    }, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
