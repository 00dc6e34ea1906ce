"""``lightning-par plan`` on paper: Megatron-LM's weak-scaling table predicted, beside the published figures.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC '21), Table 1
(as quoted in seed 004): ten GPT models from 1.7B to 1T parameters on 32 to 3072 A100s, with the tensor and pipeline
sizes, batch and achieved TFLOP/s per GPU the paper reports. Each model is built on the meta device as the example
GPT-2 (tied embedding, 4h GeLU MLP, LayerNorm; vocabulary 51,200, sequence 2048) and planned on the ``a100`` preset
as the paper ran it: 16-bit weights and activations (fp16 there, ``bf16-true`` here), full activation recompute,
1F1B with micro-batch 1, gradients all-reduced after the backward and activations split over tp between stages
(:data:`~lightning_par.planner.plan.MEGATRON_2021`). TFLOP/s are counted as the paper counts them:
``96 B s l h^2 (1 + s/6h + V/16lh)`` per step, recompute included.

The same layouts are then planned as Megatron-core runs them today (:data:`~lightning_par.planner.plan.
MEGATRON_OVERLAP`: gradient reduce-scatter under the backward and the pipeline's cooldown, parameter all-gather under
the next forward, tp collectives pipelined with the GEMMs, fused elementwise kernels; ``bf16-mixed-master`` with the
distributed optimizer, ZeRO-1): no published figure to hold them to, but with the GEMM efficiency rising with the
GEMM's shape (``lightning_par.planner.hardware.GEMM_TABLE_TRAINING``) the predicted MFU rises with the model's size,
as measured MFU does in published H100 runs.

    python benchmarks/planner_megatron.py    # about a minute; writes benchmarks/results/planner_megatron.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_par.planner import PRESETS, Candidate, Planner, Workload, build_model, inspect_model  # noqa: E402
from lightning_par.planner.plan import MEGATRON_2021, MEGATRON_OVERLAP, Runtime  # noqa: E402

SEQ, VOCAB = 2048, 51200
#: parameters (billion), heads, hidden, layers, t, p, GPUs, batch, published TFLOP/s per GPU
TABLE1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137), (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142), (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138), (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148), (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163), (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]


def paper_flops(batch: int, layers: int, hidden: int) -> float:
    """FLOPs of one step as the paper counts them (its equation 3, with recompute)."""
    return 96 * batch * SEQ * layers * hidden**2 * (1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def compare(runtime: Runtime = MEGATRON_2021, precision: str = "bf16-true", zero_stage: int = 0) -> list[dict]:
    """Each row of Table 1: the layout, the planner's bubble, memory and TFLOP/s per GPU beside the published
    (as the paper ran it by default; ``runtime``, ``precision`` and ``zero_stage`` plan the same layouts
    otherwise). ``mfu``: the model's FLOPs (no recompute) per second per GPU over the bf16 peak."""
    from lightning_par.examples import GPT2LightningModule

    rows = []
    for params, heads, hidden, layers, t, p, gpus, batch, published in TABLE1:
        info = inspect_model(build_model(GPT2LightningModule, {
            "vocab_size": VOCAB, "n_embd": hidden, "n_layers": layers, "n_heads": heads, "n_positions": SEQ}))
        dp = gpus // (t * p)
        m = batch // dp
        planner = Planner(info, PRESETS["a100"], Workload(1, SEQ, batch), runtime=runtime)
        e = planner.estimate(Candidate(dp, t, p, zero_stage, "1f1b" if p > 1 else None, 1, m, False, "full",
                                       precision))
        predicted = paper_flops(batch, layers, hidden) / e.step_time / gpus / 1e12
        rows.append({"params_b": params, "t": t, "p": p, "gpus": gpus, "batch": batch, "m": m, "bubble": e.bubble,
                     "gib_per_gpu": e.worst.total / 2**30, "fits": e.fits, "predicted_tflops": predicted,
                     "published_tflops": published, "ratio": predicted / published, "mfu": e.mfu,
                     "exposed_s": e.exposed, "step_s": e.step_time})
    return rows


def overlapped() -> list[dict]:
    """Table 1's layouts as Megatron-core runs them today (see the module docstring)."""
    return compare(MEGATRON_OVERLAP, "bf16-mixed-master", 1)


def format_table(rows: list[dict]) -> str:
    lines = ["params    t   p  GPUs  batch    m  bubble  GiB/GPU  predicted  published  ratio   MFU  "
             "exposed dp/tp/pp s"]
    for r in rows:
        x = r["exposed_s"]
        lines.append(f"{r['params_b']:6.1f}B {r['t']:3d} {r['p']:3d} {r['gpus']:5d} {r['batch']:6d} {r['m']:4d}  "
                     f"{r['bubble']:6.3f}  {r['gib_per_gpu']:7.1f}  {r['predicted_tflops']:9.1f}  "
                     f"{r['published_tflops']:9d}  {r['ratio']:5.3f}  {r['mfu']:4.0%}  "
                     f"{x['dp']:.2f}/{x['tp']:.2f}/{x['pp']:.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="benchmarks/results/planner_megatron.json")
    args = parser.parse_args()
    rows = compare()
    print("as the paper ran it (megatron-2021: nothing overlapped, bf16-true, ZeRO-0):")
    print(format_table(rows))
    worst = max(abs(r["ratio"] - 1) for r in rows)
    print(f"largest deviation from the published TFLOP/s per GPU: {worst:.1%}")
    later = overlapped()
    print("\nthe same layouts as Megatron-core runs them today (megatron-overlap, bf16-mixed-master, ZeRO-1):")
    print(format_table(later))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"hardware": PRESETS["a100"].to_dict(), "rows": rows,
                                           "overlapped_rows": later}, indent=1))


if __name__ == "__main__":
    main()
