"""Side by side, in one run: Lightning's own ``ddp`` and lightning-par's ``ZeroStrategy(stage=0)`` on the same job.

Both launch the ``lightning-par`` CLI on the same model, data, seed and steps; throughput is read back from the
``train/tokens_per_sec`` TensorBoard series, one value per window (the first, with start-up effects, is dropped).
The machine is shared and noisy, so the result is a ratio of medians, and the strategies alternate over rounds.

    python benchmarks/data_parallel.py --devices 2 --steps 60 --rounds 2 --json dp_bench.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import launch, throughput_windows  # noqa: E402

STRATEGIES = {"lightning ddp": "ddp", "lightning-par zero0": "zero0"}


def tokens_per_sec(root: Path, cache: Path, strategy: str, devices: int, steps: int, preset: str) -> list[float]:
    args = [f"--trainer.max_steps={steps}", "--data.seq_len=128", "--data.batch_size=8",
            "--trainer.limit_val_batches=0", "--tokens_per_sec.window=10"]
    return throughput_windows(launch(root, cache, strategy, devices, preset, args).check())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--json", default="benchmarks/results/data_parallel.json")
    opts = parser.parse_args()

    samples: dict[str, list[float]] = {name: [] for name in STRATEGIES}
    with tempfile.TemporaryDirectory() as tmp:
        cache = Path(tmp) / "cache"
        for rnd in range(opts.rounds):
            for name, strategy in STRATEGIES.items():
                root = Path(tmp) / f"{strategy}-{rnd}"
                samples[name] += tokens_per_sec(root, cache, strategy, opts.devices, opts.steps, opts.preset)

    baseline = statistics.median(samples["lightning ddp"])
    rows = []
    print(f"\n{opts.preset} GPT, {opts.devices} CPU ranks, {opts.steps} steps x {opts.rounds} rounds")
    print(f"{'strategy':<22}{'tokens/s (median)':>20}{'step-time ratio vs ddp':>26}")
    for name, values in samples.items():
        median = statistics.median(values)
        ratio = baseline / median  # step time ours / step time ddp
        rows.append({"strategy": name, "tokens_per_sec_median": median, "step_time_ratio_vs_ddp": ratio,
                     "windows": values})
        print(f"{name:<22}{median:>20.0f}{ratio:>26.3f}")
    out = Path(opts.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"devices": opts.devices, "steps": opts.steps, "preset": opts.preset, "rows": rows},
                              indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
