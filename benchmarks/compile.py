"""torch.compile per block: what compiling costs at the start and what it gives per step, eager beside compiled.

For each layout, one torchrun launch of this file on its ranks fits the example GPT (``--preset``, fp32, AdamW,
fixed batches) three times in the same processes: eager, compiled (``compile=True``: inductor, one graph per block
shape), eager again -- so machine load falls on both sides alike (the two eager fits are pooled). Each optimizer
step is timed on every rank from one ``on_train_batch_start`` to the next, the slowest rank counting. Reported:

- **compile s**: the compiled fit's first step minus the eager median step (tracing, inductor's code generation
  and the C++ compiler; the backward compiles at the first backward, inside that step), and the seconds the counting
  backend saw (forward graphs only);
- **step ratio**: median compiled step / median eager step, over the steps after ``--warmup``;
- the per-step losses of both (they agree within 1e-4: inductor reorders float operations) and the graphs and
  recompiles counted.

The inductor cache (``TORCHINDUCTOR_CACHE_DIR``) is a fresh directory per run, so compile times are cold.
On CPU, inductor generates C++ and calls the system compiler; on 2 shared cores its time is large next to a small
model's step, and the step ratio says little about a GPU (where fusing the norms, rotary embedding and SwiGLU saves
memory traffic that dominates).

    python benchmarks/compile.py                              # tiny GPT, zero3 and tp2 on 2 ranks: ~4 min
    python benchmarks/compile.py --preset small --layouts zero3_dp2
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

#: layout name -> (ranks, strategy class name, its arguments)
LAYOUTS: dict[str, tuple[int, str, dict]] = {
    "zero3_dp2": (2, "ZeroStrategy", dict(stage=3)),
    "tp2": (2, "MegatronTPStrategy", dict(tp=2)),
    "pp2_zbv": (2, "PipelineStrategy", dict(pp=2, schedule="zbv", n_microbatches=2)),
}


def worker(args: argparse.Namespace) -> None:
    """One layout, on this rank: eager, compiled, eager; rank 0 writes ``--out``."""
    import lightning.pytorch as pl
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    import lightning_par
    from example_models import GPTLightningModule

    ranks, cls_name, strategy_args = LAYOUTS[args.layout]
    torch.manual_seed(0)
    data = [(t[:-1], t[1:]) for t in torch.randint(0, 256, (args.batch * 4, args.seq + 1))]

    class StepTimes(pl.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.losses: list[float] = []
            self._last: float | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            now = time.perf_counter()
            if self._last is not None:
                self.times.append(now - self._last)
            self._last = now

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss))

        def on_train_end(self, trainer, pl_module) -> None:
            self.times.append(time.perf_counter() - self._last)

    def fit(compiled: bool) -> tuple[list[float], list[float], dict | None]:
        pl.seed_everything(1234)
        model = GPTLightningModule(preset=args.preset)
        timer = StepTimes()
        strategy = getattr(lightning_par, cls_name)(**strategy_args, compile=compiled)
        trainer = pl.Trainer(accelerator="cpu", devices=ranks, strategy=strategy, max_steps=args.steps,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
                             callbacks=[timer])
        trainer.fit(model, DataLoader(data, batch_size=args.batch))
        summary = strategy.compiler.summary() if strategy.compiler is not None else None
        times = torch.tensor(timer.times)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's step
        return times.tolist(), timer.losses, (None if summary is None else
                                               dict(graphs=summary.graphs, recompiles=summary.recompiles,
                                                    backend_seconds=summary.seconds))

    eager_a, losses, _ = fit(False)
    compiled, compiled_losses, counts = fit(True)
    eager_b, _, _ = fit(False)
    if dist.get_rank() == 0:
        eager = eager_a[args.warmup:] + eager_b[args.warmup:]
        eager_median = statistics.median(eager)
        compiled_median = statistics.median(compiled[args.warmup:])
        result = dict(layout=args.layout, ranks=ranks, preset=args.preset, batch=args.batch, seq=args.seq,
                      steps=args.steps, warmup=args.warmup, eager_step_s=eager_median,
                      compiled_step_s=compiled_median, step_ratio=compiled_median / eager_median,
                      compile_s=compiled[0] - eager_median, first_step_eager_s=eager_a[0],
                      first_step_compiled_s=compiled[0], counts=counts,
                      max_rel_loss_diff=max(abs(a - b) / abs(b) for a, b in zip(compiled_losses, losses, strict=True)),
                      eager_losses=losses, compiled_losses=compiled_losses)
        Path(args.out).write_text(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", nargs="+", default=["zero3_dp2", "tp2"], choices=list(LAYOUTS))
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layout", help=argparse.SUPPRESS)  # the worker's own
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout:
        return worker(args)

    from tests.harness import launch_matrix

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")  # cold compiles, every run
        for layout in args.layouts:
            out = Path(tmp) / f"{layout}.json"
            worker_args = ["--layout", layout, "--out", str(out), "--preset", args.preset, "--batch",
                           str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup",
                           str(args.warmup)]
            run = launch_matrix(Path(tmp) / layout, Path(tmp) / "cache", "benchmarks.compile", worker_args,
                                nproc=LAYOUTS[layout][0], timeout=1500)
            if run.returncode:
                raise SystemExit(f"{layout} failed:\n{run.log[-4000:]}")
            results.append(json.loads(out.read_text()))
    print(f"torch.compile per block, example GPT preset {args.preset!r}, batch {args.batch} x {args.seq} tokens, "
          f"fp32, CPU (inductor + g++), {args.steps} steps per fit, medians after {args.warmup}")
    print(f"{'layout':<12} {'eager s/step':>12} {'compiled':>9} {'ratio':>6} {'compile s':>10} {'graphs':>6} "
          f"{'recompiles':>10} {'loss diff':>9}")
    for r in results:
        counts = r["counts"] or {}
        print(f"{r['layout']:<12} {r['eager_step_s']:>12.4f} {r['compiled_step_s']:>9.4f} {r['step_ratio']:>6.2f} "
              f"{r['compile_s']:>10.1f} {counts.get('graphs', 0):>6} {counts.get('recompiles', 0):>10} "
              f"{r['max_rel_loss_diff']:>9.1e}")
    path = REPO / "benchmarks" / "results" / "compile.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"written to {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
