"""Memory per rank at fit start, every layout against one process: no rank ever builds the whole model.

The model is a Hugging Face Llama the project never saw, built from a config (default ~300M parameters). Under
every layout that splits parameters (ZeRO-3, tp, pp and their mixes) the strategy builds it deferred and each rank
materialises only its share (``lightning_par.parallel.materialize``). Measured per rank from
``tests.probes.FitStartMemory`` (the fit stops there, before any step, so no optimizer state exists yet):

* ``peak``: peak resident set size at fit start / one process's (the whole process: Python, torch, Lightning);
* ``growth``: (peak from ``setup``, before ``configure_model``, to fit start - resident size at ``setup``) / one
  process's growth: the memory the model itself cost;
* with ``--pretrained``, the same runs started from the model's ``save_pretrained`` directory (several safetensors
  shards) through ``FromPretrained``: growth / the model's fp32 bytes.

    python -m benchmarks.large_model_memory [--hidden 1024 --layers 24] [--pretrained]

Prints a table and writes ``benchmarks/results/large_model_memory.json``. About 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import REPO
from tests.harness import launch_cli

#: layout -> (ranks, strategy arguments)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "one process": (1, ["--trainer.strategy=auto"]),
    "ZeRO-3, dp=4": (4, ["--trainer.strategy=zero3"]),
    "TP, tp=4": (4, ["--trainer.strategy=megatron_tp4"]),
    "tp2 x pp2": (4, ["--trainer.strategy=hybrid3d_tp2_pp2"]),
    "dp2 x pp2, ZeRO-3": (4, ["--trainer.strategy=lightning_par.LayoutStrategy", "--trainer.strategy.pp=2",
                              "--trainer.strategy.zero_stage=3"]),
    "pp=4": (4, ["--trainer.strategy=pipeline4_1f1b"]),
}
FIT_START = ["--trainer.max_steps=1", "--trainer.limit_val_batches=0", "--data.batch_size=8", "--data.seq_len=32",
             "--data.max_corpus_bytes=100000", "--sample_tokens=0", "--trainer.log_every_n_steps=1"]


def model_args(hidden: int, layers: int) -> list[str]:
    """A Llama of ``layers`` blocks of width ``hidden`` (16 heads of 64, 4 key/value heads, SwiGLU 2.75 x)."""
    return ["--model=lightning_par.examples.HFLlamaLightningModule", f"--model.hidden_size={hidden}",
            f"--model.n_layers={layers}", f"--model.n_heads={hidden // 64}", "--model.n_kv_heads=4",
            f"--model.intermediate_size={int(hidden * 2.75) // 64 * 64}"]


def measure(root: Path, cache: Path, model: list[str], layout: str, pretrained: Path | None = None) -> list[dict]:
    """Launch ``layout``; each rank's FitStartMemory report, by rank."""
    devices, strategy = LAYOUTS[layout]
    args = [*FIT_START, *model, *strategy, "--trainer.callbacks+=tests.probes.FitStartMemory",
            f"--trainer.callbacks.path={root / 'memory'}", "--trainer.callbacks.stop=true"]
    if pretrained is not None:
        args += ["--trainer.callbacks+=lightning_par.FromPretrained", f"--trainer.callbacks.path={pretrained}"]
    launch_cli(root, cache, args, devices=devices, timeout=1200).check()
    reports = sorted((root / "memory").glob("fit_start_rank*.json"), key=lambda p: int(p.stem.rpartition("k")[2]))
    return [json.loads(p.read_text()) for p in reports]


def save_pretrained(out: Path, hidden: int, layers: int, shard_size: str) -> int:
    """The model's weights as a Hugging Face directory in several safetensors shards; returns its fp32 bytes."""
    import torch

    from lightning_par.examples import HFLlamaLightningModule

    torch.manual_seed(7)
    lm = HFLlamaLightningModule(hidden_size=hidden, n_layers=layers, n_heads=hidden // 64, n_kv_heads=4,
                                intermediate_size=int(hidden * 2.75) // 64 * 64)
    lm.configure_model()
    lm.model.save_pretrained(out, max_shard_size=shard_size)
    return sum(p.numel() * 4 for p in lm.parameters())


def _growth(report: dict) -> int:
    """What the model cost a rank: its peak from ``setup`` (before ``configure_model``) to fit start, less its
    resident size at ``setup`` (rank 0's data preparation, before, may peak higher: it is not counted)."""
    return report["peak_since_setup_bytes"] - report["setup_rss_bytes"]


def summarize(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per layout: the worst rank's peak and growth, each over one process's."""
    single = runs["one process"][0]
    single_growth = _growth(single)
    out = {}
    for layout, ranks in runs.items():
        peak = max(r["max_rss_bytes"] for r in ranks)
        growth = max(_growth(r) for r in ranks)
        out[layout] = {"ranks": len(ranks), "peak_bytes": [r["max_rss_bytes"] for r in ranks],
                       "peak_ratio": peak / single["max_rss_bytes"], "growth_ratio": growth / single_growth,
                       "model_bytes": single["model_bytes"],
                       "materialized_bytes": max(r["materialized"].get("kept_bytes", 0) for r in ranks)}
    return out


def run(hidden: int, layers: int, layouts: list[str], pretrained: bool = False,
        shard_size: str = "200MB") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = model_args(hidden, layers)
        runs = {layout: measure(tmp / f"run{i}", tmp / "cache", model, layout) for i, layout in enumerate(layouts)}
        result = {"hidden": hidden, "layers": layers, "layouts": summarize(runs)}
        if pretrained:
            fp32 = save_pretrained(tmp / "pretrained", hidden, layers, shard_size)
            result["pretrained"] = {}
            for i, layout in enumerate(layouts):
                ranks = measure(tmp / f"pre{i}", tmp / "cache", model, layout, tmp / "pretrained")
                growth = max(_growth(r) for r in ranks)
                result["pretrained"][layout] = {"growth_bytes": growth, "growth_over_fp32": growth / fp32}
    return result


def table(result: dict) -> str:
    n = result["layouts"]["one process"]["model_bytes"] / 4
    lines = [f"Llama {result['hidden']} x {result['layers']} layers, {n / 1e6:.0f}M parameters, peak RSS at fit start",
             "| layout | ranks | peak per rank (GiB) | peak / one process | growth / one process's | "
             "materialised (MiB) |", "|---|---|---|---|---|---|"]
    for layout, row in result["layouts"].items():
        lines.append(f"| {layout} | {row['ranks']} | {', '.join(f'{b / 2**30:.2f}' for b in row['peak_bytes'])} | "
                     f"{row['peak_ratio']:.2f} | {row['growth_ratio']:.2f} | {row['materialized_bytes'] / 2**20:.0f} |")
    if "pretrained" in result:
        lines += ["", "FromPretrained (save_pretrained shards): growth from setup to fit start / model fp32 bytes",
                  "| layout | growth (GiB) | / fp32 bytes |", "|---|---|---|"]
        for layout, row in result["pretrained"].items():
            lines.append(f"| {layout} | {row['growth_bytes'] / 2**30:.2f} | {row['growth_over_fp32']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--pretrained", action="store_true", help="also start each layout from save_pretrained")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "large_model_memory.json"))
    args = parser.parse_args()
    result = run(args.hidden, args.layers, list(LAYOUTS), args.pretrained)
    print(table(result))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
