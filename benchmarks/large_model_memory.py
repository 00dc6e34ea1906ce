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

With ``--device cuda`` the ranks run on GPUs (NCCL; one GPU per rank, so 4 for the 4-rank layouts) and the same
figures are the device's, per rank from ``setup`` to fit start: ``peak`` is the most the caching allocator reserved
(``torch.cuda.max_memory_reserved``), ``growth`` the peak allocated in tensors (``max_memory_allocated``) less what
was allocated at ``setup``. Host RSS is still recorded. Not run on a GPU yet.

    python -m benchmarks.large_model_memory [--hidden 1024 --layers 24] [--pretrained] [--device cuda]

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


def measure(root: Path, cache: Path, model: list[str], layout: str, pretrained: Path | None = None,
            device: str = "cpu") -> list[dict]:
    """Launch ``layout`` on CPU ranks or, with ``device="cuda"``, one GPU per rank; each rank's FitStartMemory
    report, by rank."""
    devices, strategy = LAYOUTS[layout]
    accelerator = ["--trainer.accelerator=gpu"] if device == "cuda" else []  # after TINY_JOB's cpu: it wins
    args = [*FIT_START, *accelerator, *model, *strategy, "--trainer.callbacks+=tests.probes.FitStartMemory",
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


def _growth(report: dict, device: str = "cpu") -> int:
    """What the model cost a rank: its peak from ``setup`` (before ``configure_model``) to fit start, less its
    resident size at ``setup`` (rank 0's data preparation, before, may peak higher: it is not counted); on CUDA the
    peak bytes allocated on the device less those allocated at ``setup``."""
    if device == "cuda":
        return report["cuda_max_allocated_bytes"] - report["cuda_setup_allocated_bytes"]
    return report["peak_since_setup_bytes"] - report["setup_rss_bytes"]


def _peak(report: dict, device: str = "cpu") -> int:
    """A rank's peak: its resident set at fit start, or on CUDA the most the allocator reserved on the device."""
    return report["cuda_max_reserved_bytes"] if device == "cuda" else report["max_rss_bytes"]


def summarize(runs: dict[str, list[dict]], device: str = "cpu") -> dict[str, dict]:
    """Per layout: the worst rank's peak and growth, each over one process's (host RSS, or the GPU's bytes with
    ``device="cuda"``)."""
    single = runs["one process"][0]
    single_growth = _growth(single, device)
    out = {}
    for layout, ranks in runs.items():
        peaks = [_peak(r, device) for r in ranks]
        growth = max(_growth(r, device) for r in ranks)
        out[layout] = {"ranks": len(ranks), "peak_bytes": peaks,
                       "peak_ratio": max(peaks) / _peak(single, device), "growth_ratio": growth / single_growth,
                       "model_bytes": single["model_bytes"],
                       "materialized_bytes": max(r["materialized"].get("kept_bytes", 0) for r in ranks)}
    return out


def run(hidden: int, layers: int, layouts: list[str], pretrained: bool = False,
        shard_size: str = "200MB", device: str = "cpu") -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = model_args(hidden, layers)
        runs = {layout: measure(tmp / f"run{i}", tmp / "cache", model, layout, device=device)
                for i, layout in enumerate(layouts)}
        result = {"hidden": hidden, "layers": layers, "device": device, "layouts": summarize(runs, device)}
        if pretrained:
            fp32 = save_pretrained(tmp / "pretrained", hidden, layers, shard_size)
            result["pretrained"] = {}
            for i, layout in enumerate(layouts):
                ranks = measure(tmp / f"pre{i}", tmp / "cache", model, layout, tmp / "pretrained", device)
                growth = max(_growth(r, device) for r in ranks)
                result["pretrained"][layout] = {"growth_bytes": growth, "growth_over_fp32": growth / fp32}
    return result


def table(result: dict) -> str:
    n = result["layouts"]["one process"]["model_bytes"] / 4
    what = "peak CUDA memory reserved" if result.get("device") == "cuda" else "peak RSS"
    lines = [f"Llama {result['hidden']} x {result['layers']} layers, {n / 1e6:.0f}M parameters, {what} at fit start",
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: one GPU per rank, the device's allocated / reserved peaks instead of host RSS")
    parser.add_argument("--out", default=None, help="default benchmarks/results/large_model_memory[_cuda].json")
    args = parser.parse_args()
    out = args.out or str(REPO / "benchmarks" / "results" /
                          f"large_model_memory{'_cuda' if args.device == 'cuda' else ''}.json")
    result = run(args.hidden, args.layers, list(LAYOUTS), args.pretrained, device=args.device)
    print(table(result))
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
