"""lightning-par beside Lightning's own strategies, one run: the same model, data, seed, steps and global batch on 2
CPU ranks (gloo), pair by pair.

=================  ==========================================================  ==================================
pair               Lightning (the peer)                                        lightning-par
=================  ==========================================================  ==================================
dp                 ``DDPStrategy``                                             ``ZeroStrategy(stage=0)``
fsdp2 / zero3      ``ModelParallelStrategy(dp=2)``, ``fully_shard`` per block  ``ZeroStrategy(stage=3)``
                   then the root in ``configure_model`` (Lightning's docs)
fsdp2 no-reshard   the same with ``reshard_after_forward=False``               ``ZeroStrategy(stage=2)``
/ zero2
tp                 ``ModelParallelStrategy(tp=2)``, ``parallelize_module``      ``MegatronTPStrategy(tp=2)``
                   with Colwise/RowwiseParallel on the attention and MLP
                   projections (``benchmarks.tp_gpt.HandTPGPT``)
=================  ==========================================================  ==================================

The model is the example GPT (``--preset``, default ``small`` with 8 blocks), fp32, AdamW with its LR schedule, built
after ``torch.manual_seed`` in ``configure_model`` on every rank, so every variant starts from the same weights
(lightning-par's deferred init replays those draws; the peers build them for real). The data is fixed random token
batches, ``--batch`` sequences per optimizer step in all (data parallel: half per rank through the distributed
sampler). Each variant is its own 2-rank torchrun launch, so each process's peak memory is its own; each pair runs
in the order A B, then B A in the next round, and so on. ``--one-launch`` fits a round's variants one after another
in one launch (one start-up: what the full test set runs); the peak is then reset before each variant, whose growth
may read low where it reuses memory an earlier one freed.

Measured, per variant (largest over the ranks):

- ``ms/step``: one optimizer step, from one ``on_train_batch_start`` to the next, the slowest rank's, median over the
  steps after ``--warmup``; the ratio ours / peer is taken within each round and the median over rounds reported
  (the load of a shared machine drifts between rounds more than within one);
- ``RSS growth``: the process's resident high-water mark at the end of the fit minus its resident size just before
  ``Trainer.fit``: what the model, its states, activations and buffers added (the runtime every rank carries is left
  out); ``state``: bytes of parameters, gradients and optimizer states right after optimizer step 3
  (:func:`lightning_par.measure.state_bytes`);
- ``CPU``: the CPU time of a step summed over the ranks (median), whole and per phase (:data:`PHASES`): the work
  done, which other jobs' load blurs less than the wall time, and where a difference sits;
- the per-step losses of each rank (its own share of the batch), compared between the pair: the largest absolute
  difference over steps and ranks, every round.

``--profile DIR`` writes rank 0's torch.profiler table of the timed steps per variant, to compare op by op.

    python benchmarks/peers.py                       # 4 pairs x 2 rounds: about 10 minutes on 2 shared cores
    python benchmarks/peers.py --pairs tp --rounds 3 --profile prof
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEED = 1234
WORLD = 2
N_SAMPLES = 64  # distinct fixed samples, cycled
STATE_STEP = 3  # the optimizer step after which parameter + gradient + optimizer bytes are counted
#: the parts of a step whose CPU time is measured apart: training_step up to backward, backward (with the gradient
#: sync a strategy overlaps with it), after backward up to the optimizer (sync finished, clipping), the optimizer step
#: (and what a strategy does after it), and from one step's end to the next's start (logging, loader, hooks)
PHASES = ("forward", "backward", "before step", "optimizer step", "between steps")
LOSS_TOLERANCE = 1e-4  # largest absolute per-step loss difference allowed within a pair (losses are about 5.5)

#: variant -> (description, data-parallel size)
VARIANTS: dict[str, tuple[str, int]] = {
    "ddp": ("DDPStrategy", 2),
    "zero0": ("ZeroStrategy(stage=0)", 2),
    "fsdp2": ("ModelParallelStrategy + fully_shard", 2),
    "zero3": ("ZeroStrategy(stage=3)", 2),
    "fsdp2_noreshard": ("... fully_shard(reshard_after_forward=False)", 2),
    "zero2": ("ZeroStrategy(stage=2)", 2),
    "tp_plan": ("ModelParallelStrategy + parallelize_module", 1),
    "megatron_tp2": ("MegatronTPStrategy(tp=2)", 1),
}
#: pair -> (Lightning's variant, lightning-par's)
PAIRS: dict[str, tuple[str, str]] = {
    "dp": ("ddp", "zero0"),
    "zero3": ("fsdp2", "zero3"),
    "zero2": ("fsdp2_noreshard", "zero2"),
    "tp": ("tp_plan", "megatron_tp2"),
}


# ----------------------------------------------------------------------------------------------------------------------
# Worker: one variant, one fit, on each of the 2 ranks (under torchrun)
# ----------------------------------------------------------------------------------------------------------------------
def make_variant(name: str, opts):
    """``(strategy, LightningModule)`` of variant ``name``; every module seeds the global RNG right before it builds
    the GPT, so all variants start from the same weights."""
    import torch
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    import lightning_par
    from benchmarks.fsdp2_gpt import FSDP2GPT
    from benchmarks.tp_gpt import HandTPGPT
    from lightning_par.examples import GPTLightningModule

    class Seeded:
        def configure_model(self) -> None:
            if self.model is None:
                torch.manual_seed(SEED)
            super().configure_model()

    class PeerGPT(Seeded, GPTLightningModule):
        pass

    class PeerFSDP2(Seeded, FSDP2GPT):
        reshard_after_forward = name != "fsdp2_noreshard"

    class PeerTP(Seeded, HandTPGPT):
        pass

    kwargs = {"preset": opts.preset, "n_layers": opts.n_layers}
    strategies = {
        "ddp": lambda: (DDPStrategy(), PeerGPT),
        "zero0": lambda: (lightning_par.ZeroStrategy(stage=0), PeerGPT),
        "fsdp2": lambda: (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), PeerFSDP2),
        "fsdp2_noreshard": lambda: (ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), PeerFSDP2),
        "zero3": lambda: (lightning_par.ZeroStrategy(stage=3), PeerGPT),
        "zero2": lambda: (lightning_par.ZeroStrategy(stage=2), PeerGPT),
        "tp_plan": lambda: (ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2), PeerTP),
        "megatron_tp2": lambda: (lightning_par.MegatronTPStrategy(tp=2), PeerGPT),
    }
    strategy, cls = strategies[name]()
    return strategy, cls(**kwargs)


def fit_variant(opts, name: str, root: Path) -> dict:
    """One variant's fit on this rank; its report (:func:`benchmarks.common.fit_variants` gathers the ranks')."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.common import FixedTokens, StepMeter, status_kib

    class Measure(StepMeter):
        """:class:`~benchmarks.common.StepMeter`, plus per-step losses and the CPU time of each phase of a step."""

        def __init__(self) -> None:
            super().__init__(opts.warmup, STATE_STEP)
            self.losses: list[float] = []
            self.profiler = None
            self.phases: dict[str, list[float]] = {p: [] for p in PHASES}
            self.last = 0.0
            self.timed = False

        def mark(self, phase: str) -> None:
            """The CPU time since the previous mark belongs to ``phase`` (timed steps only)."""
            now = time.process_time()
            if self.timed:
                self.phases[phase].append(now - self.last)
            self.last = now

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            self.mark("between steps")
            super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
            self.timed = opts.warmup <= batch_idx < opts.warmup + opts.steps
            if opts.profile and batch_idx == opts.warmup and trainer.global_rank == 0:
                self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
                self.profiler.__enter__()
            self.last = time.process_time()

        def on_before_backward(self, trainer, pl_module, loss) -> None:
            self.mark("forward")

        def on_after_backward(self, trainer, pl_module) -> None:
            self.mark("backward")

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            self.mark("before step")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.mark("optimizer step")
            loss = outputs["loss"]
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss  # a DTensor under loss_parallel
            self.losses.append(float(loss))
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            self.last = time.process_time()  # the measurements above are not the step's

        def on_train_end(self, trainer, pl_module) -> None:
            if self.profiler is not None:  # the timed steps of rank 0, by op: where the time goes
                self.profiler.__exit__(None, None, None)
                table = self.profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
                Path(opts.profile).mkdir(parents=True, exist_ok=True)
                (Path(opts.profile) / f"{name}.txt").write_text(table)

    _, dp = VARIANTS[name]
    strategy, model = make_variant(name, opts)
    steps = opts.warmup + opts.steps + 1  # the start of one more step closes the last timed one
    pl.seed_everything(SEED, verbose=False)
    measure = Measure()
    trainer = pl.Trainer(
        accelerator="cpu", devices=WORLD, strategy=strategy, precision="32-true", max_steps=steps,
        limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[measure], default_root_dir=root,
    )
    # shuffled: Lightning's own strategies shuffle every training loader (a sequential one too), lightning-par's keep
    # a sequential loader in order; a shuffled one is shuffled alike by both (the same seed), so each pair sees the
    # same batches
    loader = DataLoader(FixedTokens(steps * opts.batch, opts.seq, SEED, N_SAMPLES), batch_size=opts.batch // dp,
                        shuffle=True)
    rss_before = status_kib("VmRSS") * 1024
    trainer.fit(model, loader)
    return {
        "rank": trainer.global_rank, "seconds_per_step": measure.times, "cpu_seconds_per_step": measure.cpu,
        "phase_cpu_seconds": measure.phases,
        "losses": measure.losses,
        "state_bytes": measure.state, "rss_before_fit_bytes": rss_before,
        "peak_rss_bytes": status_kib("VmHWM") * 1024,
        "numel": sum(p.numel() for p in model.parameters()),  # DTensor numel is global: the whole model's
    }


# ----------------------------------------------------------------------------------------------------------------------
# Launcher: one torchrun job per variant and round (or per round, --one-launch), pairs alternating, then the table
# ----------------------------------------------------------------------------------------------------------------------
def run_variants(tmp: Path, names: list[str], rnd: int, opts) -> dict[str, dict]:
    from benchmarks.common import launch_variants

    args = ["--preset", opts.preset, "--n-layers", str(opts.n_layers), "--batch", str(opts.batch), "--seq",
            str(opts.seq), "--warmup", str(opts.warmup), "--steps", str(opts.steps)]
    if opts.profile:
        args += ["--profile", str(Path(opts.profile).resolve())]
    return launch_variants(tmp, "benchmarks.peers", names, rnd, args, WORLD)


def step_time(run: dict) -> float:
    """The median over the timed steps of the slowest rank's step time."""
    ranks = run["ranks"]
    return statistics.median(max(r["seconds_per_step"][i] for r in ranks) for i in range(len(ranks[0][
        "seconds_per_step"])))


def cpu_time(run: dict) -> float:
    """The median over the timed steps of the CPU time of a step summed over the ranks: the work done, which other
    jobs' load on a shared machine blurs less than the wall time."""
    ranks = run["ranks"]
    return statistics.median(sum(r["cpu_seconds_per_step"][i] for r in ranks) for i in range(len(ranks[0][
        "cpu_seconds_per_step"])))


def variant_summary(runs: list[dict]) -> dict:
    first = runs[0]["ranks"]
    return {
        "median_seconds_per_step": statistics.median(step_time(run) for run in runs),
        "seconds_per_step_by_round": [step_time(run) for run in runs],
        "median_cpu_seconds_per_step": statistics.median(cpu_time(run) for run in runs),
        # per phase: the median over steps and rounds of the CPU time summed over the ranks
        "phase_cpu_seconds": {p: statistics.median(
            sum(r["phase_cpu_seconds"][p][i] for r in run["ranks"]) for run in runs
            for i in range(min(len(r["phase_cpu_seconds"][p]) for r in run["ranks"]))) for p in PHASES},
        "rss_growth_bytes": max(r["peak_rss_bytes"] - r["rss_before_fit_bytes"] for run in runs for r in run["ranks"]),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for run in runs for r in run["ranks"]),
        "state_bytes": max(r["state_bytes"]["total"] for r in first),
        "state_bytes_by_category": {c: max(r["state_bytes"][c] for r in first)
                                    for c in ("parameters", "gradients", "optimizer_states")},
        "losses": [r["losses"] for r in first],  # the first round's (the comparison takes every round's)
        "numel": first[0]["numel"],
    }


def max_loss_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """The largest absolute difference of per-step losses, rank by rank (each rank's share of the batch)."""
    assert len(a) == len(b) and all(len(x) == len(y) for x, y in zip(a, b, strict=True)), "different steps or ranks"
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


def summarise(pair: str, runs: dict[str, list[dict]]) -> dict:
    peer, ours = PAIRS[pair]
    row: dict = {"pair": pair, "peer": peer, "ours": ours, "peer_strategy": VARIANTS[peer][0],
                 "our_strategy": VARIANTS[ours][0]}
    failed = [(n, r["error"]) for n in (peer, ours) for r in runs[n] if not r["ok"]]
    if failed:
        row.update(ok=False, error=f"{failed[0][0]}: {failed[0][1]}")
        return row
    a, b = variant_summary(runs[peer]), variant_summary(runs[ours])
    by_round = [step_time(o) / step_time(p) for p, o in zip(runs[peer], runs[ours], strict=True)]
    cpu_by_round = [cpu_time(o) / cpu_time(p) for p, o in zip(runs[peer], runs[ours], strict=True)]
    row.update(
        ok=True, peer_result=a, our_result=b, step_time_ratio=statistics.median(by_round),
        step_time_ratio_by_round=by_round, cpu_time_ratio=statistics.median(cpu_by_round),
        cpu_time_ratio_by_round=cpu_by_round, rss_growth_ratio=b["rss_growth_bytes"] / a["rss_growth_bytes"],
        peak_rss_ratio=b["peak_rss_bytes"] / a["peak_rss_bytes"], state_bytes_ratio=b["state_bytes"] / a[
            "state_bytes"],
        max_loss_difference=max(max_loss_difference([r["losses"] for r in p["ranks"]], [r["losses"] for r in o[
            "ranks"]]) for p, o in zip(runs[peer], runs[ours], strict=True)),  # every round's
    )
    return row


def run_pairs(opts) -> list[dict]:
    """Every pair, ``opts.rounds`` times, A B then B A; the rows of the table."""
    runs: dict[str, list[dict]] = {v: [] for pair in opts.pairs for v in PAIRS[pair]}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(opts.rounds):
            order = [name for pair in opts.pairs for name in (PAIRS[pair] if rnd % 2 == 0 else PAIRS[pair][::-1])]
            for group in [order] if opts.one_launch else [[name] for name in order]:
                for name, run in run_variants(Path(tmp), group, rnd, opts).items():
                    runs[name].append(run)
                    status = "ok" if run["ok"] else f"FAILED: {run['error']}"
                    print(f"  {name} round {rnd}: {status} (launch: {run['seconds']:.0f} s)", flush=True)
    return [summarise(pair, runs) for pair in opts.pairs]


def fmt_mib(n: float) -> str:
    return f"{n / 2**20:.1f}"


def print_table(rows: list[dict], opts) -> None:
    numel = next((r["our_result"]["numel"] for r in rows if r["ok"]), 0)
    print(f"\n{opts.preset} GPT ({opts.n_layers} blocks, {numel / 1e6:.2f}M parameters), fp32, AdamW, global batch "
          f"{opts.batch} x seq {opts.seq}, {WORLD} CPU ranks (gloo); {opts.steps} timed steps after {opts.warmup}, "
          f"{opts.rounds} round(s); ratios ours / Lightning's, memory of the largest rank")
    print(f"{'pair':<7}{'Lightning':<46}{'lightning-par':<25}{'ms/step':>15}{'time':>7}{'CPU':>7}{'RSS growth MiB':>17}"
          f"{'growth':>8}{'state MiB':>13}{'state':>7}{'max |dloss|':>13}")
    for r in rows:
        if not r["ok"]:
            print(f"{r['pair']:<7}{r['peer_strategy']:<46}{r['our_strategy']:<25}failed: {r['error'][:100]}")
            continue
        a, b = r["peer_result"], r["our_result"]
        ms = f"{a['median_seconds_per_step'] * 1e3:.0f}/{b['median_seconds_per_step'] * 1e3:.0f}"
        growth = f"{fmt_mib(a['rss_growth_bytes'])}/{fmt_mib(b['rss_growth_bytes'])}"
        state = f"{fmt_mib(a['state_bytes'])}/{fmt_mib(b['state_bytes'])}"
        print(f"{r['pair']:<7}{r['peer_strategy']:<46}{r['our_strategy']:<25}{ms:>15}{r['step_time_ratio']:>7.2f}"
              f"{r['cpu_time_ratio']:>7.2f}"
              f"{growth:>17}{r['rss_growth_ratio']:>8.2f}{state:>13}{r['state_bytes_ratio']:>7.2f}"
              f"{r['max_loss_difference']:>13.1e}")
    print("CPU ms per phase of a step, summed over the ranks (median), Lightning's / lightning-par's:")
    print(f"{'pair':<7}" + "".join(f"{p:>17}" for p in PHASES))
    for r in rows:
        if r["ok"]:
            a, b = r["peer_result"]["phase_cpu_seconds"], r["our_result"]["phase_cpu_seconds"]
            print(f"{r['pair']:<7}" + "".join(f"{f'{a[p] * 1e3:.0f}/{b[p] * 1e3:.0f}':>17}" for p in PHASES))


def main(argv: list[str] | None = None) -> dict:
    from benchmarks.common import add_launch_options, fit_variants

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--n-layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences per optimizer step)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=3, help="steps not timed")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per launch")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pairs", nargs="+", default=list(PAIRS), choices=list(PAIRS))
    parser.add_argument("--json", default="benchmarks/results/peers.json")
    parser.add_argument("--profile", help="a folder: rank 0's timed steps under torch.profiler, one table per variant")
    add_launch_options(parser)
    opts = parser.parse_args(argv)
    if opts.worker:
        fit_variants(opts, lambda name, root: fit_variant(opts, name, root))
        return {}

    start = time.time()
    rows = run_pairs(opts)
    elapsed = time.time() - start
    print_table(rows, opts)
    load = os.getloadavg()[0]
    print(f"(load average {load:.1f} on {os.cpu_count()} CPUs; wall time {elapsed:.0f} s)")
    result = {"preset": opts.preset, "n_layers": opts.n_layers, "batch": opts.batch, "seq": opts.seq,
              "warmup": opts.warmup, "steps": opts.steps, "rounds": opts.rounds, "world": WORLD, "rows": rows,
              "one_launch": opts.one_launch, "load_average_1min_at_end": load, "cpus": os.cpu_count(),
              "wall_seconds": elapsed}
    if opts.json:
        path = Path(opts.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
