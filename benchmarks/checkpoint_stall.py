"""How long training stalls for a sharded checkpoint save: synchronous (``dcp.save``) against asynchronous (DCP's
``async_save``, what ``LayoutStrategy(async_save=True)`` uses), side by side in one run.

One process (a gloo group of one) trains the example GPT with AdamW and saves its model and optimizer states every
``--every`` steps through the strategy's own save paths (``sharded_checkpoint.save`` and ``AsyncSaver.save``: same
files, same manifest and atomic commit). For each save the stall is the time the steps from the save until it has
committed took beyond the median step time of the steps with no save around them: the blocking part (DCP's staging
copy to host memory, or the whole write) plus whatever the background writer slows the next steps down by.

    python benchmarks/checkpoint_stall.py                      # GPT 125m preset (~118M parameters, ~1.4 GB saved)
    python benchmarks/checkpoint_stall.py --preset small --steps 12 --every 4   # a smoke run

Writes benchmarks/results/checkpoint_stall.json.
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

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from lightning_par.examples.gpt import GPT, GPTConfig  # noqa: E402
from lightning_par.plugins import sharded_checkpoint  # noqa: E402
from lightning_par.plugins.async_checkpoint import AsyncSaver  # noqa: E402


def _checkpoint(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> dict:
    """What the strategy hands to its save: states keyed by parameter name, plus Lightning's counters."""
    return {"state_dict": sharded_checkpoint.model_state(model),
            "optimizer_states": [sharded_checkpoint.optimizer_state(model, optimizer)],
            "global_step": step, "epoch": 0}


def run(mode: str, args: argparse.Namespace, root: Path) -> dict:
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset(args.preset))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, model.config.vocab_size, (args.batch, args.seq + 1))
    saver = AsyncSaver(is_writer=True, barrier=dist.barrier) if mode == "async" else None
    times, saves, blocking, committed_at = [], [], [], {}
    for step in range(args.steps):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        # a save needs --window steps after it to be measured
        if args.warmup <= step < args.steps - args.window and (step - args.warmup) % args.every == 0:
            saves.append(step)
            path = root / f"{mode}-step{step}.ckpt"
            before = time.perf_counter()
            if saver is None:
                sharded_checkpoint.save(_checkpoint(model, optimizer, step), path, True, dist.barrier)
            else:
                saver.save(_checkpoint(model, optimizer, step), path)
            blocking.append(time.perf_counter() - before)
        times.append(time.perf_counter() - start)
        for s in saves:
            if s not in committed_at and (root / f"{mode}-step{s}.ckpt").exists():
                committed_at[s] = step  # the save has its final name: complete
        print(f"{mode} step {step}: {times[-1]:.3f} s" + (" (save)" if saves and saves[-1] == step else ""), flush=True)
    if saver is not None:
        saver.wait()
    # a save's window: from its step to the step it committed in (at least --window steps, never past the next save)
    windows = {}
    for i, s in enumerate(saves):
        end = max(committed_at.get(s, args.steps - 1), s + args.window - 1)
        end = min(end, (saves[i + 1] - 1) if i + 1 < len(saves) else args.steps - 1)
        windows[s] = range(s, end + 1)
    in_window = {k for w in windows.values() for k in w}
    baseline = statistics.median(t for k, t in enumerate(times) if k >= args.warmup and k not in in_window)
    stalls = [sum(times[k] - baseline for k in w) for w in windows.values()]
    return {"mode": mode, "baseline_step_s": baseline, "step_times_s": times, "saves": saves,
            "blocking_s": blocking, "stall_s": stalls, "median_stall_s": statistics.median(stalls),
            "median_blocking_s": statistics.median(blocking),
            "committed_after_steps": [committed_at.get(s, -1) - s for s in saves]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="125m", help="example GPT preset (default 125m, ~118M parameters)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=31, help="training steps per mode")
    parser.add_argument("--warmup", type=int, default=6, help="steps before the first save, not measured")
    parser.add_argument("--every", type=int, default=8, help="steps between saves")
    parser.add_argument("--window", type=int, default=3, help="least steps counted after each save")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "checkpoint_stall.json"))
    args = parser.parse_args()
    if args.every <= args.window or args.steps <= args.warmup + args.every:
        parser.error("need --every > --window and --steps > --warmup + --every (two saves at least)")

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        results = {}
        for mode in ("sync", "async"):
            results[mode] = run(mode, args, Path(tmp))
            saved = sum(f.stat().st_size for f in Path(tmp).glob(f"{mode}-step*/*"))
            results[mode]["bytes_per_save"] = saved // len(results[mode]["saves"])
    dist.destroy_process_group()

    n_params = GPTConfig.from_preset(args.preset).num_params()
    sync, asyn = results["sync"], results["async"]
    ratio = asyn["median_stall_s"] / sync["median_stall_s"]
    print(f"\nGPT {args.preset} ({n_params / 1e6:.0f}M parameters, AdamW), {sync['bytes_per_save'] / 2**30:.2f} GiB "
          f"per save, {torch.get_num_threads()} threads")
    print(f"{'mode':<6} {'step (median)':>14} {'save call':>10} {'stall per save':>15} {'committed after':>16}")
    for r in (sync, asyn):
        print(f"{r['mode']:<6} {r['baseline_step_s']:>12.2f} s {r['median_blocking_s']:>8.2f} s "
              f"{r['median_stall_s']:>13.2f} s {statistics.median(r['committed_after_steps']):>10.0f} steps")
    print(f"async / sync stall: {ratio:.2f}")
    out = {"preset": args.preset, "params": n_params, "batch": args.batch, "seq": args.seq,
           "threads": torch.get_num_threads(), "async_over_sync_stall": ratio, **results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
