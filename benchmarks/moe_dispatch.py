"""Expert parallel's token exchange against the planner, and a mixture-of-experts step against a dense one of the same
active size (issue 29): one run on 2 and 4 gloo ranks, a table printed and ``benchmarks/results/moe_dispatch.json``.

Per world size W, one torchrun launch fits three models one after another in the same ranks (fp32, AdamW, the same
fixed random batches: a global batch of ``--batch`` sequences of ``--seq`` tokens, ``--steps`` optimizer steps):

============  ===================================================================================================
``dense``     the example GPT whose FFN has the MoE's active size (``ffn_dim = top_k x expert_ffn_dim +
              shared_ffn_dim``: the parameters a token uses, less the router's), ``ZeroStrategy(stage=1)``, dp=W
``moe``       the example MoE GPT (``--preset``, default ``small``: 8 experts, top-2, a shared expert, 4 layers),
              ``ZeroStrategy(stage=1)``: every rank holds every expert (ep=1)
``moe_epW``   the same under ``ExpertParallelStrategy(ep=W)`` (ZeRO-1), its experts split over the W ranks
============  ===================================================================================================

Measured under ``moe_epW`` (the busiest rank; steps after ``--warmup``; median):

- **bytes** each rank sends through the token exchange's ``all_to_all`` per optimizer step, counted where the
  exchange calls it (``lightning_par.parallel.expert_parallel.all_to_all_single_autograd`` wrapped): the tokens
  leaving the rank (its own split excluded) in the forward dispatch and combine, and -- counted when autograd runs
  their backward -- the gradients sent back. Beside it, the planner's ``comm_bytes["ep"]`` for the same layout and
  batch (:meth:`lightning_par.planner.plan.Planner.all_to_all_bytes`: balanced routing); their ratio is the routing's
  imbalance on the busiest rank. (The per-layer exchange of counts, ``E`` integers, is not counted by either.)
- **exchange time** per step: every ``TokenExchange`` call of the forward (counts, dispatch, combine, waited for)
  less the local experts it runs; beside the planner's forward exchange on its ``cpu`` preset
  (bytes / bandwidth + 3 latencies per layer).
- **step time** ratios: ``moe / dense``, ``moe_epW / dense``, ``moe_epW / moe`` (ratios: W ranks share this machine's
  2 cores, so absolute times say little).

    python benchmarks/moe_dispatch.py                     # 2 and 4 ranks: ~3 minutes on 2 shared cores
    python benchmarks/moe_dispatch.py --worlds 2 --steps 6
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEED = 1234
RESULT = REPO / "benchmarks" / "results" / "moe_dispatch.json"


# -- in the ranks ---------------------------------------------------------------------------------------------------
class ExchangeMeter:
    """Counts what the token exchange sends and how long it takes, by wrapping its all_to_all and its calls."""

    def __init__(self) -> None:
        self.sent = 0.0  # bytes leaving this rank, forward and backward
        self.seconds = 0.0  # forward exchange time, experts excluded
        self.on = False

    def install(self) -> None:
        import torch
        import torch.distributed as dist

        import lightning_par.parallel.expert_parallel as ep

        meter, a2a, call = self, ep.all_to_all_single_autograd, ep.TokenExchange.__call__

        class _Backward(torch.autograd.Function):
            """Identity; its backward counts the gradient rows the all_to_all's backward sends to other ranks."""

            @staticmethod
            def forward(ctx, x, nbytes):
                ctx.nbytes = nbytes
                return x.view_as(x)

            @staticmethod
            def backward(ctx, grad):
                meter.sent += ctx.nbytes if meter.on else 0.0
                return grad, None

        def counted(tensor, output_split_sizes, input_split_sizes, group):
            me = dist.get_rank(group)
            row = tensor.element_size() * (tensor[0].numel() if tensor.dim() > 1 else 1)
            out = a2a(tensor, output_split_sizes, input_split_sizes, group)
            if meter.on:
                meter.sent += (sum(input_split_sizes) - input_split_sizes[me]) * row
            # backward: each received row's gradient goes back to where it came from
            return _Backward.apply(out, (sum(output_split_sizes) - output_split_sizes[me]) * row)

        def timed(exchange, tokens, counts, experts):
            inner = [0.0]

            def run_experts(t, c):
                begin = time.perf_counter()
                out = experts(t, c)
                inner[0] += time.perf_counter() - begin
                return out

            begin = time.perf_counter()
            out = call(exchange, tokens, counts, run_experts) + 0  # + 0: wait for the combine here
            if meter.on and torch.is_grad_enabled():
                meter.seconds += time.perf_counter() - begin - inner[0]
            return out

        ep.all_to_all_single_autograd = counted
        ep.TokenExchange.__call__ = timed


def _module(kind: str, preset: str):
    from lightning_par.examples import GPTLightningModule, MoEGPTLightningModule

    moe = MoEGPTLightningModule(preset=preset, optimizer="adamw", warmup_steps=1)
    if kind != "dense":
        return moe
    c = moe.config
    dense = GPTLightningModule(preset=preset, optimizer="adamw", warmup_steps=1)
    dense.config = replace(dense.config, ffn_dim=c.top_k * c.expert_ffn_dim + c.shared_ffn_dim)
    return dense


def _fit(kind: str, world: int, args: argparse.Namespace, root: Path) -> dict:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from benchmarks.common import FixedTokens, StepMeter
    from lightning_par import ExpertParallelStrategy, ZeroStrategy

    pl.seed_everything(SEED)
    strategy = ExpertParallelStrategy(ep=world, stage=1) if kind.startswith("moe_ep") else ZeroStrategy(stage=1)
    steps = StepMeter(warmup=args.warmup, state_step=1)
    meter = ExchangeMeter.instance
    per_step: list[tuple[float, float]] = []

    class Sample(pl.Callback):  # the exchange's figures of each measured step
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            meter.sent, meter.seconds, meter.on = 0.0, 0.0, batch_idx >= args.warmup

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if meter.on:
                per_step.append((meter.sent, meter.seconds))
            meter.on = False

    data = DataLoader(FixedTokens(args.batch * args.steps, args.seq, SEED), batch_size=args.batch // world)
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=args.steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[steps, Sample()], default_root_dir=root, limit_val_batches=0)
    trainer.fit(_module(kind, args.preset), data)
    params = sum(p.numel() for p in trainer.lightning_module.parameters())
    return {"step_s": statistics.median(steps.times), "sent": statistics.median(s for s, _ in per_step)
            if per_step else 0.0, "exchange_s": statistics.median(t for _, t in per_step) if per_step else 0.0,
            "params": params, "rank": torch.distributed.get_rank()}


def worker() -> None:
    import torch.distributed as dist

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--world", type=int, required=True)
    add_options(parser)
    args = parser.parse_args(sys.argv[2:])
    ExchangeMeter.instance = ExchangeMeter()
    ExchangeMeter.instance.install()
    results = {}
    for kind in ("dense", "moe", f"moe_ep{args.world}"):
        mine = _fit(kind, args.world, args, Path(args.out) / kind)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results[kind] = everyone
    if dist.get_rank() == 0:
        Path(args.out, "results.json").write_text(json.dumps(results))


# -- the run --------------------------------------------------------------------------------------------------------
def add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)


def planned(world: int, args: argparse.Namespace) -> dict:
    """The planner's figures for the same layout, batch and precision on its ``cpu`` preset."""
    from lightning_par.planner.hardware import load_hardware
    from lightning_par.planner.model import build_model, inspect_model
    from lightning_par.planner.plan import Candidate, Planner, Workload

    info = inspect_model(build_model("lightning_par.examples.MoEGPTLightningModule", {"preset": args.preset}))
    hw = load_hardware("cpu")
    planner = Planner(info, hw, Workload(args.batch // world, args.seq, args.batch), "adamw")
    c = Candidate(world, 1, 1, 1, n_microbatches=1, precision="fp32", recompute="none", ep=world)
    estimate = planner.estimate(c)
    forward, layers = planner.all_to_all_bytes(c, info.units, 4)
    return {"sent": estimate.comm_bytes["ep"], "forward_exchange_s": forward / hw.bandwidth(world > hw.devices_per_node)
            + 3 * layers * hw.latency_s, "active": info.active_numel, "total": info.numel,
            "label": c.label()}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker()
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--json", default=str(RESULT))
    add_options(parser)
    args = parser.parse_args()
    from tests.harness import launch_matrix

    rows = []
    for world in args.worlds:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            options = [f"--preset={args.preset}", f"--batch={args.batch}", f"--seq={args.seq}",
                       f"--steps={args.steps}", f"--warmup={args.warmup}"]
            run = launch_matrix(root, root / "cache", "benchmarks.moe_dispatch",
                                ["--worker", "--out", str(root), "--world", str(world), *options], nproc=world,
                                timeout=1200).check()
            measured = json.loads((root / "results.json").read_text())
        plan = planned(world, args)
        ep = f"moe_ep{world}"
        slowest = {k: max(r["step_s"] for r in ranks) for k, ranks in measured.items()}
        busiest = max(measured[ep], key=lambda r: r["sent"])
        rows.append({
            "world": world, "layout": plan["label"], "launch_s": run.seconds,
            "params": {k: ranks[0]["params"] for k, ranks in measured.items()},
            "active_params": plan["active"], "total_params": plan["total"],
            "step_s": slowest,
            "ratio_moe_over_dense": slowest["moe"] / slowest["dense"],
            "ratio_ep_over_dense": slowest[ep] / slowest["dense"],
            "ratio_ep_over_moe": slowest[ep] / slowest["moe"],
            "all_to_all_bytes_per_step": {"measured": busiest["sent"], "planned": plan["sent"],
                                          "ratio": busiest["sent"] / plan["sent"],
                                          "per_rank": [r["sent"] for r in measured[ep]]},
            "forward_exchange_s": {"measured": max(r["exchange_s"] for r in measured[ep]),
                                   "planned": plan["forward_exchange_s"],
                                   "share_of_step": max(r["exchange_s"] for r in measured[ep]) / slowest[ep]},
        })
    header = (f"{'W':>2}  {'a2a KiB/step meas':>17}  {'planned':>8}  {'meas/plan':>9}  {'fwd exch ms':>11}  "
              f"{'planned':>8}  {'exch/step':>9}  {'moe/dense':>9}  {'epW/dense':>9}  {'epW/moe':>8}")
    print(header)
    for r in rows:
        b, t = r["all_to_all_bytes_per_step"], r["forward_exchange_s"]
        print(f"{r['world']:>2}  {b['measured'] / 1024:>17.1f}  {b['planned'] / 1024:>8.1f}  {b['ratio']:>9.3f}  "
              f"{t['measured'] * 1e3:>11.1f}  {t['planned'] * 1e3:>8.1f}  {t['share_of_step']:>9.2f}  "
              f"{r['ratio_moe_over_dense']:>9.2f}  {r['ratio_ep_over_dense']:>9.2f}  {r['ratio_ep_over_moe']:>8.2f}")
    Path(args.json).write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
