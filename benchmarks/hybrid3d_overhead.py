"""What Lightning costs on top of the 3D primitives: the same tp=2 x pp=2 layout driven by a plain PyTorch loop and
by ``Hybrid3DStrategy`` inside Lightning's ``Trainer``, alternating in the same 4 processes.

Both sides run the example GPT (``--preset``, fp32) on the same fixed batches with the same optimizer (AdamW in two
groups, matrices with weight decay, plus the warmup + cosine ``LambdaLR`` of ``GPTLightningModule``):

- **plain**: the torch-level composition the engine makes, written out by hand --
  :class:`~lightning_par.parallel.pipeline.runtime.PipelineRuntime` (1F1B, ``--microbatches``) whose ``prepare``
  applies :func:`~lightning_par.parallel.tensor_parallel.apply_tensor_parallel` (``stage=True``) to the rank module,
  then a ZeRO-1 :class:`~lightning_par.parallel.zero.ZeroPartitioner` with ``defer_reduction`` over dp (size 1
  here, as under the engine: ZeRO-1 is ``Hybrid3DStrategy``'s default). One step: ``zero_grad``, ``train_step``
  inside the plan's ``loss_context``, ``sum_tied_gradients``, ``finish_gradient_sync``, ``optimizer.step``,
  ``gather_parameters``, ``scheduler.step``. Its own device mesh (pp, dp, tp), built on the same processes.
- **lightning**: ``Trainer(strategy=Hybrid3DStrategy(tp=2, pp=2, n_microbatches=...))`` fitting a LightningModule
  on a ``DataLoader`` over the same batches; logger, progress bar, checkpointing, model summary, sanity check and
  validation off. Two modules, one fit each (``--modules``):
  ``example`` = ``lightning_par.examples.GPTLightningModule`` as it is (its ``training_step`` logs the loss with
  ``sync_dist=True`` and a torchmetrics perplexity every step), and ``bare`` = the same module whose
  ``training_step`` only returns ``compute_loss(batch)``: Lightning's loop and the strategy alone.

How it alternates: a callback runs the plain loop inside the fit, between Lightning's steps. After ``--warmup``
steps of each side, rounds of ``--steps`` steps alternate: plain, Lightning, plain, Lightning... (``--rounds`` of
each). A Lightning step is timed from the end of one ``on_train_batch_start`` to the start of the next (the whole
loop iteration: the step, the optimizer step, the hooks, logging, fetching the next batch), a plain step from its
start to the next one's; each step's time is the slowest rank's. Both models and optimizers stay resident the whole
time, so machine load, caches and memory fall on both alike. The ratio reported is of the medians of the per-step
times (Lightning / plain). Also given: the paired ratio, the median over rounds of (Lightning's step time / the
plain step time of the same round: adjacent in time, so under about the same load), and the same paired ratio of
the CPU time per step (``time.process_time``, all threads, summed over the 4 ranks). Each with a 95% bootstrap
interval. On a shared machine the wall-clock step time varies by tens of percent from one step to the next with
other people's work; the CPU time a step takes varies much less, so the CPU ratio is the steadier measure of what
Lightning adds (the wall ratio also sees waiting). The JSON also keeps each round timed barrier to barrier on
rank 0 (``round_time_paired``) and the ratio of the means.
Both sides' per-step losses are compared too: they start from the same weights and see the same batches, so they
agree to the last bit when both did the same work.

    python benchmarks/hybrid3d_overhead.py                  # small GPT, 2 modules x 40 rounds x 1 step: ~4 min
    python benchmarks/hybrid3d_overhead.py --modules bare --rounds 20
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

TP, PP = 2, 2
SEED = 1234
N_BATCHES = 8  # distinct fixed batches, cycled
LR, WEIGHT_DECAY, BETAS, WARMUP_STEPS, MIN_LR_RATIO = 3e-3, 0.1, (0.9, 0.95), 10, 0.1


# ----------------------------------------------------------------------------------------------------------------------
# Worker (one per rank, under torchrun)
# ----------------------------------------------------------------------------------------------------------------------
def make_batches(batch: int, seq: int):
    import torch

    g = torch.Generator().manual_seed(SEED)
    out = []
    for _ in range(N_BATCHES):
        tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def lr_lambda(total_steps: int):
    """``GPTLightningModule``'s schedule: linear warmup, then cosine down to ``MIN_LR_RATIO``."""

    def factor(step: int) -> float:
        if step < WARMUP_STEPS:
            return (step + 1) / WARMUP_STEPS
        progress = min(1.0, (step - WARMUP_STEPS) / max(1, total_steps - WARMUP_STEPS))
        return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class PlainLoop:
    """tp x pp by hand over lightning-par's torch-level pieces, no Lightning (see the module docstring)."""

    def __init__(self, preset: str, microbatches: int, total_steps: int) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        from lightning_par.examples.gpt import GPT, GPTConfig, causal_lm_loss
        from lightning_par.parallel.parts import split
        from lightning_par.parallel.pipeline.runtime import PipelineRuntime, resolve_schedule
        from lightning_par.parallel.tensor_parallel import apply_tensor_parallel
        from lightning_par.parallel.zero import ZeroPartitioner

        mesh = init_device_mesh("cpu", (PP, 1, TP), mesh_dim_names=("pp", "dp", "tp"))
        torch.manual_seed(SEED)
        model = GPT(GPTConfig.from_preset(preset))
        choice = resolve_schedule("1f1b", PP, microbatches)
        parts = split(model, choice, mesh["pp"])
        plan = apply_tensor_parallel(parts.pipeline.module, mesh["tp"], False, stage=True)
        self.runtime = PipelineRuntime(parts, mesh["pp"], causal_lm_loss, loss_scale=1.0 / microbatches,
                                       device=torch.device("cpu"))
        self.runtime.make_tied_copies_equal()
        self.loss_context = plan.loss_context
        params = [p for p in self.runtime.module.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=LR, betas=BETAS)
        self.partitioner = ZeroPartitioner(self.runtime.module, [self.optimizer], mesh["dp"], 1,
                                           defer_reduction=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(total_steps))

    def step(self, batch):
        """One optimizer step on ``batch``; returns the batch's loss (on every rank)."""
        self.optimizer.zero_grad(set_to_none=True)
        with self.loss_context():
            loss = self.runtime.train_step(*batch)
        self.runtime.sum_tied_gradients()
        self.partitioner.finish_gradient_sync()
        self.optimizer.step()
        self.partitioner.gather_parameters()
        self.scheduler.step()
        return loss


def _clock() -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process: all its threads, gloo's included)."""
    return time.perf_counter(), time.process_time()


def interleave_callback(opts, batches, total_steps: int):
    import lightning.pytorch as pl
    import torch.distributed as dist

    class Interleave(pl.Callback):
        """Runs rounds of the plain loop between Lightning's steps and times both (see the module docstring)."""

        def __init__(self) -> None:
            self.plain: PlainLoop | None = None
            self.plain_step = 0
            self.lightning_begin: tuple[float, float] | None = None  # end of this step's on_train_batch_start
            self.round_begin: float | None = None  # start of the current Lightning round (after a barrier)
            # per step: wall seconds and CPU seconds of this rank
            self.times: dict[str, list[float]] = {"plain": [], "lightning": []}
            self.cpu: dict[str, list[float]] = {"plain": [], "lightning": []}
            self.rounds: dict[str, list[float]] = {"plain": [], "lightning": []}
            self.rounds_done = 0
            # every step's loss, to check that both sides did the same work (same initial weights and batches)
            self.losses: dict[str, list] = {"plain": [], "lightning": []}

        def _plain_steps(self, n: int, timed: bool = True) -> None:
            assert self.plain is not None
            begin = _clock()
            for _ in range(n):
                self.losses["plain"].append(self.plain.step(batches[self.plain_step % len(batches)]))
                self.plain_step += 1
                end = _clock()
                if timed:
                    self.times["plain"].append(end[0] - begin[0])
                    self.cpu["plain"].append(end[1] - begin[1])
                begin = end

        def on_train_start(self, trainer, pl_module) -> None:
            self.plain = PlainLoop(opts.preset, opts.microbatches, total_steps)
            # shapes inferred by a real first step, AdamW states allocated, DTensor's sharding caches filled
            self._plain_steps(opts.warmup, timed=False)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            entry = _clock()
            timing = self.round_begin is not None
            if timing and self.lightning_begin is not None:
                self.times["lightning"].append(entry[0] - self.lightning_begin[0])
                self.cpu["lightning"].append(entry[1] - self.lightning_begin[1])
            if batch_idx >= opts.warmup and (batch_idx - opts.warmup) % opts.steps == 0:
                dist.barrier()
                if timing:  # a Lightning round just ended
                    self.rounds["lightning"].append((time.perf_counter() - self.round_begin) / opts.steps)
                    self.rounds_done += 1
                self.round_begin = None
                if self.rounds_done < opts.rounds:
                    start = time.perf_counter()
                    self._plain_steps(opts.steps)
                    dist.barrier()
                    self.rounds["plain"].append((time.perf_counter() - start) / opts.steps)
                    self.round_begin = time.perf_counter()
            self.lightning_begin = _clock()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.losses["lightning"].append(outputs["loss"].detach())

    return Interleave()


def fit_one(opts, module_name: str, batches) -> dict:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.utils.data import DataLoader, Dataset

    from lightning_par import Hybrid3DStrategy
    from lightning_par.examples import GPTLightningModule

    class Bare(GPTLightningModule):
        def training_step(self, batch, batch_idx):
            return self.compute_loss(batch)

    class FixedBatches(Dataset):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i):
            return batches[i % len(batches)]

    # warm-up, the rounds, and one more step whose start closes the last round
    total_steps = opts.warmup + opts.rounds * opts.steps + 1
    pl.seed_everything(SEED, verbose=False)
    cls = Bare if module_name == "bare" else GPTLightningModule
    model = cls(preset=opts.preset, lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS, warmup_steps=WARMUP_STEPS,
                min_lr_ratio=MIN_LR_RATIO)
    callback = interleave_callback(opts, batches, total_steps)
    trainer = pl.Trainer(
        accelerator="cpu", devices=TP * PP, strategy=Hybrid3DStrategy(tp=TP, pp=PP, n_microbatches=opts.microbatches),
        precision="32-true", max_steps=total_steps, limit_val_batches=0, num_sanity_val_steps=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[callback], default_root_dir=opts.root,
    )
    loader = DataLoader(FixedBatches(total_steps), batch_size=None, shuffle=False)
    trainer.fit(model, loader)
    # each step's wall time is the slowest rank's; its CPU time the sum over the ranks
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (callback.times, callback.cpu))
    n = {side: len(gathered[0][0][side]) for side in ("plain", "lightning")}
    times = {side: [max(rank[0][side][i] for rank in gathered) for i in range(n[side])] for side in n}
    cpu = {side: [sum(rank[1][side][i] for rank in gathered) for i in range(n[side])] for side in n}
    losses = {side: [float(v) for v in values] for side, values in callback.losses.items()}
    n = min(len(v) for v in losses.values())
    diff = max(abs(a - b) / abs(b) for a, b in zip(losses["lightning"][:n], losses["plain"][:n], strict=True))
    return {"module": module_name, "seconds_per_step": times, "cpu_seconds_per_step": cpu,
            "round_seconds_per_step": callback.rounds,
            "gradient_sync": trainer.strategy.gradient_sync.name, "losses": losses,
            "loss_max_rel_diff": diff}


def worker(opts) -> None:
    import torch.distributed as dist

    batches = make_batches(opts.batch, opts.seq)
    results = [fit_one(opts, name, batches) for name in opts.modules]
    if dist.get_rank() == 0:
        Path(opts.out).write_text(json.dumps(results))
    dist.barrier()


# ----------------------------------------------------------------------------------------------------------------------
# Launcher: torchrun on 4 ranks, then the table
# ----------------------------------------------------------------------------------------------------------------------
def _interval(resample, n: int = 2000) -> tuple[float, float]:
    """95% bootstrap interval of the statistic ``resample(rng)`` computes on one resample."""
    rng = random.Random(0)
    values = sorted(resample(rng) for _ in range(n))
    return values[int(0.025 * n)], values[int(0.975 * n) - 1]


def ratio_of_medians(plain: list[float], lightning: list[float]) -> dict:
    """median(lightning) / median(plain), with a 95% bootstrap interval (each side's steps resampled)."""
    def resample(rng):
        return (statistics.median(rng.choices(lightning, k=len(lightning)))
                / statistics.median(rng.choices(plain, k=len(plain))))

    return {"ratio": statistics.median(lightning) / statistics.median(plain), "interval_95": _interval(resample)}


def paired_ratio(plain: list[float], lightning: list[float]) -> dict:
    """Median over the rounds of lightning / plain of the same round (adjacent in time, so under about the same
    load), with a 95% bootstrap interval (rounds resampled)."""
    ratios = [lt / pt for pt, lt in zip(plain, lightning, strict=True)]

    def resample(rng):
        return statistics.median(rng.choices(ratios, k=len(ratios)))

    return {"ratio": statistics.median(ratios), "interval_95": _interval(resample), "by_round": ratios}


def per_round(values: list[float], steps: int) -> list[float]:
    return [statistics.fmean(values[i:i + steps]) for i in range(0, len(values), steps)]


def summarise(raw: dict, steps: int) -> dict:
    wall, cpu = raw["seconds_per_step"], raw["cpu_seconds_per_step"]
    return {
        **raw,
        "median_seconds_per_step": {side: statistics.median(v) for side, v in wall.items()},
        "median_cpu_seconds_per_step": {side: statistics.median(v) for side, v in cpu.items()},
        "step_time_ratio": ratio_of_medians(wall["plain"], wall["lightning"]),
        "step_time_paired": paired_ratio(per_round(wall["plain"], steps), per_round(wall["lightning"], steps)),
        "round_time_paired": paired_ratio(raw["round_seconds_per_step"]["plain"],
                                          raw["round_seconds_per_step"]["lightning"]),
        "mean_ratio": statistics.fmean(wall["lightning"]) / statistics.fmean(wall["plain"]),
        "cpu_time_ratio": ratio_of_medians(cpu["plain"], cpu["lightning"]),
        "cpu_time_paired": paired_ratio(per_round(cpu["plain"], steps), per_round(cpu["lightning"], steps)),
    }


def _fmt(r: dict) -> str:
    lo, hi = r["interval_95"]
    return f"{r['ratio']:.3f} [{lo:.2f}, {hi:.2f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="steps of each side before the rounds")
    parser.add_argument("--rounds", type=int, default=40, help="rounds of each side")
    parser.add_argument("--steps", type=int, default=1, help="steps per round")
    parser.add_argument("--modules", nargs="+", default=["example", "bare"], choices=["example", "bare"])
    parser.add_argument("--json", default="benchmarks/results/hybrid3d_overhead.json")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.worker:
        worker(opts)
        return

    from tests.harness import launch_matrix

    start = time.time()
    forwarded = ["--preset", opts.preset, "--batch", str(opts.batch), "--seq", str(opts.seq), "--microbatches",
                 str(opts.microbatches), "--warmup", str(opts.warmup), "--rounds", str(opts.rounds), "--steps",
                 str(opts.steps), "--modules", *opts.modules]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "times.json"
        run = launch_matrix(Path(tmp), Path(tmp) / "cache", "benchmarks.hybrid3d_overhead",
                            ["--worker", "--out", str(out), "--root", tmp, *forwarded], nproc=TP * PP, timeout=1800)
        if run.returncode != 0 or not out.exists():
            sys.exit(f"the 4-rank run failed (exit {run.returncode}):\n{run.log[-6000:]}")
        rows = [summarise(raw, opts.steps) for raw in json.loads(out.read_text())]
    elapsed = time.time() - start

    print(f"\n{opts.preset} GPT, tp={TP} x pp={PP} on {TP * PP} CPU ranks (gloo), fp32, 1F1B with {opts.microbatches} "
          f"micro-batches, batch {opts.batch} x seq {opts.seq}, AdamW + LambdaLR, ZeRO-1 over dp=1 (defer_reduction); "
          f"{opts.rounds} alternating rounds x {opts.steps} steps of each side after {opts.warmup} warm-up steps")
    print(f"{'module':<9}{'plain / Lightning ms':>22}{'ratio of medians [95%]':>25}{'paired [95%]':>22}"
          f"{'CPU plain / Lightning ms':>26}{'CPU paired [95%]':>22}{'loss diff':>11}")
    for r in rows:
        m, c = r["median_seconds_per_step"], r["median_cpu_seconds_per_step"]
        wall = f"{m['plain'] * 1e3:.0f} / {m['lightning'] * 1e3:.0f}"
        cpu = f"{c['plain'] * 1e3:.0f} / {c['lightning'] * 1e3:.0f}"
        print(f"{r['module']:<9}{wall:>22}{_fmt(r['step_time_ratio']):>25}{_fmt(r['step_time_paired']):>22}"
              f"{cpu:>26}{_fmt(r['cpu_time_paired']):>22}{r['loss_max_rel_diff']:>11.0e}")
    load = os.getloadavg()[0]
    print(f"(target: ratio of medians <= 1.05; load average {load:.1f} on {os.cpu_count()} CPUs; "
          f"wall time {elapsed:.0f} s)")
    result = {"preset": opts.preset, "tp": TP, "pp": PP, "dp": 1, "zero_stage": 1, "schedule": "1f1b",
              "microbatches": opts.microbatches, "batch": opts.batch, "seq": opts.seq, "warmup": opts.warmup,
              "rounds": opts.rounds, "steps_per_round": opts.steps, "rows": rows,
              "load_average_1min_at_end": load, "cpus": os.cpu_count(), "wall_seconds": elapsed}
    path = Path(opts.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
