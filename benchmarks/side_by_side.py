"""The five layouts side by side on 4 CPU ranks, one run: step time and memory per rank under DP, ZeRO-3, TP, PP
and 3D, on the same model, global batch and steps.

=========  ===========================================================  =====================================
layout     strategy                                                     mesh
=========  ===========================================================  =====================================
dp         ``ZeroStrategy(stage=0)``: replicas, DDP all-reduce          dp=4 (each replica: batch / 4)
zero3      ``ZeroStrategy(stage=3)``: FSDP2, parameters sharded         dp=4 (each replica: batch / 4)
tp         ``MegatronTPStrategy(tp=4)``                                 tp=4
pp         ``PipelineStrategy(pp=4)``, 1F1B, 2 * pp micro-batches       pp=4
3d         ``Hybrid3DStrategy(tp=2, pp=2)``, 1F1B, 2 * pp micro-batches,  tp=2 x pp=2 (dp=1)
           ZeRO-1 (its default)
=========  ===========================================================  =====================================

The model is the example GPT (``--preset``, default ``small`` with ``--n-layers 8`` blocks and ``n_kv_heads=4`` so
that tp=4 divides every head count), fp32, AdamW (``GPTLightningModule``'s, with its LR schedule), fixed random
batches of ``--batch`` x ``--seq`` tokens (the global batch: the data-parallel layouts give each replica a quarter
through Lightning's distributed sampler). Each layout is its own 4-rank launch (torchrun), so every process's peak
memory is its own; with ``--rounds`` > 1 the layouts run again in reverse order, and so on. ``--one-launch`` fits a
round's layouts one after another in one launch (one start-up: what the full test set runs); the peak is then reset
before each layout, whose growth may read low where it reuses memory an earlier one freed.

Measured per rank, the table showing the largest value over the ranks:

- ``ms/step``: the time of one optimizer step (of the whole global batch), from one ``on_train_batch_start`` to the
  next, the slowest rank's, median over the steps after ``--warmup`` (and over the rounds); ``CPU ms/step``: the
  CPU time of that step (``time.process_time``, all threads) summed over the 4 ranks, median: the work done, which
  other people's load on a shared machine blurs less than the wall time (and which leaves out waiting: a pipeline
  bubble costs time, not CPU);
- ``peak RSS``: the process's resident high-water mark (``VmHWM`` of ``/proc/self/status``) at the end of the fit,
  which includes the Python / torch / Lightning runtime every rank carries; ``RSS growth``: that peak minus the
  resident size just before ``Trainer.fit`` -- what the model, its states, activations and communication buffers
  added;
- ``params + grads + optim``: bytes of parameters, gradients and optimizer states this rank holds right after
  optimizer step 3 (:func:`lightning_par.measure.state_bytes`: unique storages, DTensors by their local shard).

Ratios are against ``dp``. A layout that fails is reported with its error; the others go on.

Beside each row, the planner's prediction (:func:`predict`: ``lightning-par plan``'s estimate of the same layout,
model, batch and precision on its ``cpu`` hardware preset): ``pred ms`` is the planner's step time of one rank with
a core of its own, ``pred/dp`` its ratio to dp's, ``pred work/dp`` the ratio of its busy time (``Estimate.busy``:
the step less the pipeline's idle share, plus the receives) -- the one to read beside the measured ``CPU/dp``: the
4 ranks share 2 cores, so what a layout costs here is the CPU its ranks burn (compute, gloo's collectives,
DTensor's dispatch), while a rank blocked in a receive frees its core (see docs/plan.md, "predicted vs measured
on this machine").
``--predict-only`` recomputes the predictions of a stored JSON without running anything (after a planner change).

    python benchmarks/side_by_side.py                  # 5 layouts x 1 round: ~5 minutes on 2 shared cores
    python benchmarks/side_by_side.py --rounds 2 --layouts dp 3d
    python benchmarks/side_by_side.py --steps 3 --warmup 2 --one-launch  # the full test set's quick check
    python benchmarks/side_by_side.py --predict-only    # the planner's predictions into the stored JSON
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEED = 1234
WORLD = 4
N_SAMPLES = 64  # distinct fixed samples, cycled
STATE_STEP = 3  # the optimizer step after which parameter + gradient + optimizer bytes are counted

#: name -> (strategy class in lightning_par, its arguments, data-parallel size, description)
LAYOUTS: dict[str, tuple[str, dict, int, str]] = {
    "dp": ("ZeroStrategy", {"stage": 0}, 4, "ZeroStrategy(stage=0), dp=4"),
    "zero3": ("ZeroStrategy", {"stage": 3}, 4, "ZeroStrategy(stage=3), dp=4"),
    "tp": ("MegatronTPStrategy", {"tp": 4}, 1, "MegatronTPStrategy(tp=4)"),
    "pp": ("PipelineStrategy", {"pp": 4, "schedule": "1f1b"}, 1, "PipelineStrategy(pp=4, 1f1b, m=8)"),
    "3d": ("Hybrid3DStrategy", {"tp": 2, "pp": 2, "schedule": "1f1b"}, 1,
           "Hybrid3DStrategy(tp=2, pp=2, 1f1b, m=4, zero1)"),
}



def candidate(name: str, batch: int):
    """The planner's :class:`~lightning_par.planner.Candidate` for a layout of :data:`LAYOUTS`, and the sequences
    per micro-batch: the data-parallel layouts give each replica ``batch / dp`` in one micro-batch, the pipelines
    cut the batch into ``2 * pp`` micro-batches (the strategies' default)."""
    from lightning_par.planner import Candidate

    _, kw, dp, _ = LAYOUTS[name]
    tp, pp = kw.get("tp", 1), kw.get("pp", 1)
    zero = kw.get("stage", 1 if name == "3d" else 0)  # Hybrid3DStrategy's default: ZeRO-1
    m = 2 * pp if pp > 1 else 1
    return Candidate(dp, tp, pp, zero, kw.get("schedule"), 1, m, precision="fp32"), batch // dp // m


def predict(preset: str = "small", n_layers: int = 8, n_kv_heads: int = 4, batch: int = 8, seq: int = 128,
            layouts=tuple(LAYOUTS), hardware: str = "cpu") -> dict[str, dict]:
    """The planner's step time and busy time of each layout on ``hardware`` (its ``cpu`` preset: this machine), and
    their ratios to dp's: per layout ``{"step_s", "ratio_vs_dp", "busy_s", "work_ratio_vs_dp", "breakdown_s",
    "exposed_s", "bubble"}``. In process, about a
    second: the model is built on the meta device and traced on fake tensors."""
    from lightning_par.examples import GPTLightningModule
    from lightning_par.planner import Planner, Workload, build_model, inspect_model, load_hardware

    info = inspect_model(build_model(GPTLightningModule, {"preset": preset, "n_layers": n_layers,
                                                          "n_kv_heads": n_kv_heads}))
    hw = load_hardware(hardware)
    out: dict[str, dict] = {}
    for name in dict.fromkeys(("dp", *layouts)):
        c, micro = candidate(name, batch)
        est = Planner(info, hw, Workload(micro, seq, batch)).estimate(c)
        out[name] = {"label": c.label(), "step_s": est.step_time, "busy_s": est.busy, "breakdown_s": est.breakdown,
                     "exposed_s": est.exposed, "bubble": est.bubble}
    for row in out.values():
        row["ratio_vs_dp"] = row["step_s"] / out["dp"]["step_s"]
        row["work_ratio_vs_dp"] = row["busy_s"] / out["dp"]["busy_s"]
    return {name: out[name] for name in layouts}


# ----------------------------------------------------------------------------------------------------------------------
# Worker: one layout, one fit, on each of the 4 ranks (under torchrun)
# ----------------------------------------------------------------------------------------------------------------------
def fit_layout(opts, name: str, root: Path) -> dict:
    """One layout's fit on this rank; its report (:func:`benchmarks.common.fit_variants` gathers the ranks')."""
    import lightning.pytorch as pl
    import torch

    import lightning_par
    from benchmarks.common import FixedTokens, StepMeter, status_kib
    from lightning_par.examples import GPTLightningModule

    cls_name, kwargs, dp, _ = LAYOUTS[name]
    strategy = getattr(lightning_par, cls_name)(**kwargs)
    steps = opts.warmup + opts.steps + 1  # the start of one more step closes the last timed one
    pl.seed_everything(SEED, verbose=False)
    model = GPTLightningModule(preset=opts.preset, n_layers=opts.n_layers, n_kv_heads=opts.n_kv_heads)
    measure = StepMeter(opts.warmup, STATE_STEP)
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, precision="32-true", max_steps=steps,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[measure], default_root_dir=root,
    )
    data = FixedTokens(steps * opts.batch, opts.seq, SEED, N_SAMPLES)
    loader = torch.utils.data.DataLoader(data, batch_size=opts.batch // dp)
    rss_before = status_kib("VmRSS") * 1024
    trainer.fit(model, loader)
    return {
        "rank": trainer.global_rank, "coordinates": trainer.strategy.coordinates,
        "gradient_sync": trainer.strategy.gradient_sync.name, "dims": trainer.strategy.dims.describe(),
        "seconds_per_step": measure.times, "cpu_seconds_per_step": measure.cpu, "state_bytes": measure.state,
        "rss_before_fit_bytes": rss_before, "peak_rss_bytes": status_kib("VmHWM") * 1024,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "numel": sum(p.numel() for p in model.parameters()),  # DTensor numel is global: the whole model's
    }


# ----------------------------------------------------------------------------------------------------------------------
# Launcher: one torchrun job per layout (or per round, --one-launch), then the table
# ----------------------------------------------------------------------------------------------------------------------
def run_layouts(tmp: Path, names: list[str], rnd: int, opts) -> dict[str, dict]:
    from benchmarks.common import launch_variants

    args = ["--preset", opts.preset, "--n-layers", str(opts.n_layers), "--n-kv-heads", str(opts.n_kv_heads),
            "--batch", str(opts.batch), "--seq", str(opts.seq), "--warmup", str(opts.warmup), "--steps",
            str(opts.steps)]
    return launch_variants(tmp, "benchmarks.side_by_side", names, rnd, args, WORLD)


def summarise(name: str, runs: list[dict]) -> dict:
    ok = [r for r in runs if r["ok"]]
    row: dict = {"layout": name, "strategy": LAYOUTS[name][3], "ok": bool(ok), "launch_seconds": [
        r["seconds"] for r in runs]}
    if not ok:
        row["error"] = runs[-1]["error"]
        return row
    steps, cpu = [], []
    for run in ok:  # each step's time is the slowest rank's, its CPU time the sum over the ranks
        ranks = run["ranks"]
        n = len(ranks[0]["seconds_per_step"])
        steps += [max(r["seconds_per_step"][i] for r in ranks) for i in range(n)]
        cpu += [sum(r["cpu_seconds_per_step"][i] for r in ranks) for i in range(n)]
    first = ok[0]["ranks"]
    row.update(
        seconds_per_step=steps, median_seconds_per_step=statistics.median(steps),
        cpu_seconds_per_step=cpu, median_cpu_seconds_per_step=statistics.median(cpu),
        # memory: the largest over ranks and rounds
        peak_rss_bytes=max(r["peak_rss_bytes"] for run in ok for r in run["ranks"]),
        rss_growth_bytes=max(r["peak_rss_bytes"] - r["rss_before_fit_bytes"] for run in ok for r in run["ranks"]),
        state_bytes=max(r["state_bytes"]["total"] for r in first),
        state_bytes_by_category={c: max(r["state_bytes"][c] for r in first)
                                 for c in ("parameters", "gradients", "optimizer_states")},
        per_rank=[{k: r[k] for k in ("rank", "coordinates", "peak_rss_bytes", "rss_before_fit_bytes")}
                  | {"state_bytes": r["state_bytes"]["total"]} for r in first],
        gradient_sync=first[0]["gradient_sync"], dims=first[0]["dims"], numel=first[0]["numel"],
    )
    return row


def fmt_mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def add_predictions(result: dict) -> None:
    """The planner's prediction (:func:`predict`) into each measured row of ``result``, as ``row["predicted"]``."""
    rows = [r for r in result["rows"] if r["ok"]]
    pred = predict(result["preset"], result["n_layers"], result["n_kv_heads"], result["batch"], result["seq"],
                   [r["layout"] for r in rows])
    result["predicted_with"] = {"hardware": "cpu", "runtime": "lightning-par"}
    for r in rows:
        r["predicted"] = pred[r["layout"]]


def print_table(result: dict) -> None:
    rows = result["rows"]
    print(f"\n{result['preset']} GPT ({result['n_layers']} blocks, n_kv_heads={result['n_kv_heads']}, "
          f"{result['numel'] / 1e6:.2f}M parameters), fp32, AdamW, global batch {result['batch']} x seq "
          f"{result['seq']}, {WORLD} CPU ranks (gloo); {result['steps']} timed steps after {result['warmup']} x "
          f"{result['rounds']} round(s); memory: the largest rank; pred: the planner's cpu preset")
    header = (f"{'layout':<7}{'strategy':<46}{'ms/step':>9}{'CPU ms/step':>12}{'peak RSS MiB':>14}"
              f"{'RSS growth MiB':>16}{'p+g+opt MiB':>13}{'time/dp':>9}{'CPU/dp':>8}{'RSS/dp':>8}{'growth/dp':>11}"
              f"{'p+g+opt/dp':>12}{'pred ms':>9}{'pred/dp':>9}{'pred work/dp':>14}")
    print(header)
    for r in rows:
        if not r["ok"]:
            print(f"{r['layout']:<7}{r['strategy']:<46}failed: {r['error'][:100]}")
            continue
        ratios = [f"{v:.2f}" for v in r["ratios_vs_dp"].values()] if "ratios_vs_dp" in r else ["-"] * 5
        pred = r.get("predicted")
        pred_cells = (f"{pred['step_s'] * 1e3:>9.0f}{pred['ratio_vs_dp']:>9.2f}{pred['work_ratio_vs_dp']:>14.2f}"
                      if pred else f"{'-':>9}{'-':>9}{'-':>14}")
        print(f"{r['layout']:<7}{r['strategy']:<46}{r['median_seconds_per_step'] * 1e3:>9.0f}"
              f"{r['median_cpu_seconds_per_step'] * 1e3:>12.0f}{fmt_mib(r['peak_rss_bytes']):>14}"
              f"{fmt_mib(r['rss_growth_bytes']):>16}{fmt_mib(r['state_bytes']):>13}"
              f"{ratios[0]:>9}{ratios[1]:>8}{ratios[2]:>8}{ratios[3]:>11}{ratios[4]:>12}{pred_cells}")
    print(f"(load average {result['load_average_1min_at_end']:.1f} on {result['cpus']} CPUs; wall time "
          f"{result['wall_seconds']:.0f} s)")


def main() -> None:
    from benchmarks.common import add_launch_options, fit_variants

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--n-kv-heads", type=int, default=4, help="4 so that tp=4 divides it")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per optimizer step)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3, help="steps not timed")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per launch")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--json", default="benchmarks/results/side_by_side.json")
    parser.add_argument("--predict-only", action="store_true",
                        help="run nothing: add the planner's predictions to the rows of --json and print the table")
    add_launch_options(parser)
    opts = parser.parse_args()
    if opts.worker:
        fit_variants(opts, lambda name, root: fit_layout(opts, name, root))
        return
    if opts.predict_only:
        path = Path(opts.json)
        result = json.loads(path.read_text())
        add_predictions(result)
        print_table(result)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
        return

    start = time.time()
    runs: dict[str, list[dict]] = {name: [] for name in opts.layouts}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(opts.rounds):
            order = opts.layouts if rnd % 2 == 0 else opts.layouts[::-1]
            for group in [order] if opts.one_launch else [[name] for name in order]:
                for name, run in run_layouts(Path(tmp), group, rnd, opts).items():
                    runs[name].append(run)
                    status = "ok" if run["ok"] else f"FAILED: {run['error']}"
                    print(f"  {name} round {rnd}: {status} (launch: {run['seconds']:.0f} s)", flush=True)
    rows = [summarise(name, runs[name]) for name in opts.layouts]
    elapsed = time.time() - start
    base = next((r for r in rows if r["layout"] == "dp" and r["ok"]), None)
    keys = {"step_time": "median_seconds_per_step", "cpu_time": "median_cpu_seconds_per_step",
            "peak_rss": "peak_rss_bytes", "rss_growth": "rss_growth_bytes", "state_bytes": "state_bytes"}
    for r in rows:
        if r["ok"] and base is not None:
            r["ratios_vs_dp"] = {name: r[key] / base[key] for name, key in keys.items()}
    result = {"preset": opts.preset, "n_layers": opts.n_layers, "n_kv_heads": opts.n_kv_heads,
              "numel": next((r["numel"] for r in rows if r["ok"]), 0), "batch": opts.batch, "seq": opts.seq,
              "warmup": opts.warmup, "steps": opts.steps, "rounds": opts.rounds, "world": WORLD, "rows": rows,
              "one_launch": opts.one_launch,
              "load_average_1min_at_end": os.getloadavg()[0], "cpus": os.cpu_count(), "wall_seconds": elapsed}
    add_predictions(result)
    print_table(result)
    path = Path(opts.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
