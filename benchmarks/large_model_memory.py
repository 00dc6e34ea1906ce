"""Peak memory per rank at fit start for a model of 340M parameters: one process vs pipeline ranks.

Under pipeline parallel the model is built without memory (``lightning_par.parallel.deferred_init``) and each rank
materialises only its stages, so no rank ever holds the whole model. One process must hold all of it. Measured:
the peak resident set size (``ru_maxrss``) of each rank when ``on_fit_start`` runs (after setup, before the first
step, so optimizer state is not yet allocated), read from ``tests.probes.FitStartMemory``.

    python benchmarks/large_model_memory.py [--preset 350m] [--pp 4]

Prints a table and writes ``benchmarks/results/large_model_memory.json``. About 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import REPO
from example_models.gpt import GPTConfig
from tests.harness import launch_cli

FIT_START = ["--trainer.callbacks+=tests.probes.FitStartMemory", "--trainer.max_steps=1",
             "--trainer.limit_val_batches=0", "--data.batch_size=8", "--data.seq_len=32",
             "--data.max_corpus_bytes=100000", "--sample_tokens=0", "--trainer.log_every_n_steps=1"]


def measure(root: Path, cache: Path, preset: str, devices: int, strategy: str) -> list[int]:
    layers = GPTConfig.from_preset(preset).n_layers  # the test job's --model.n_layers=8 would override the preset's
    args = [*FIT_START, f"--trainer.callbacks.path={root / 'memory'}", f"--model.preset={preset}",
            f"--model.n_layers={layers}",
            f"--trainer.strategy={strategy}"]
    launch_cli(root, cache, args, devices=devices, timeout=1200).check()
    reports = sorted((root / "memory").glob("fit_start_rank*.json"))
    return [json.loads(p.read_text())["max_rss_bytes"] for p in reports]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="350m")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "large_model_memory.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        single = measure(tmp / "single", tmp / "cache", args.preset, 1, "auto")
        pipeline = measure(tmp / "pipeline", tmp / "cache", args.preset, args.pp, f"pipeline{args.pp}_1f1b")
    ratio = max(pipeline) / single[0]
    print(f"| run | ranks | peak RSS at fit start per rank (GiB) | max / one process |\n|---|---|---|---|\n"
          f"| one process | 1 | {single[0] / 2**30:.2f} | 1.00 |\n"
          f"| pipeline, pp={args.pp} | {args.pp} | {', '.join(f'{b / 2**30:.2f}' for b in pipeline)} | "
          f"{ratio:.2f} |")
    result = {"preset": args.preset, "pp": args.pp, "single_bytes": single[0], "pipeline_bytes": pipeline,
              "ratio": ratio}
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
