"""Attention memory per rank under context parallel, against the sequence length: the ring attention
(:func:`lightning_par.parallel.context_parallel.sequence_attention`) beside the path it replaced (keys and values
all-gathered, a boolean [T / cp, T] causal mask from global positions, SDPA with that mask; reimplemented below, in
this benchmark only).

cp = 2 on two gloo ranks (CPU), one attention call forward and backward per length: batch 1, 4 query heads over 2
key/value heads (GQA), head dim 16, fp32. Per rank and length: the extra peak resident memory of the call (the
kernel's ``VmHWM`` after ``/proc/self/clear_refs`` reset it, minus the resident memory before; inputs made before),
and the largest tensor any aten op returned (a dispatch mode). Rank 0's figures are printed (the ranks are alike).

    python benchmarks/cp_attention_memory.py                  # T = 1k .. 16k, ~1 minute on 2 cores, ~1.5 GB
    python benchmarks/cp_attention_memory.py --lengths 1024 2048

Prints a table and writes ``benchmarks/results/cp_attention_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from benchmarks.common import status_kib  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 16
MIB = 1 << 20


def _mask_path(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The replaced path: K/V all-gathered (autograd: backward reduce-scatters), the [T / cp, T] mask."""
    import torch.distributed.nn.functional as dnn

    from lightning_par.parallel.context_parallel import shard_positions

    size = dist.get_world_size()

    def gather(t: torch.Tensor) -> torch.Tensor:
        return torch.cat(dnn.all_gather(t.movedim(2, 0).contiguous()), dim=0).movedim(0, 2)

    seq = positions.numel() * size
    kv_pos = torch.cat([shard_positions(seq, size, r) for r in range(size)])
    mask = positions[:, None] >= kv_pos[None, :]
    return torch.nn.functional.scaled_dot_product_attention(q, gather(k), gather(v), attn_mask=mask,
                                                            enable_gqa=True)


def _measure(path: str, seq: int, cp) -> dict:
    from lightning_par._compat import TorchDispatchMode, tree_leaves
    from lightning_par.parallel.context_parallel import sequence_attention

    largest = [0]

    class Largest(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            largest[0] = max([largest[0], *(t.numel() * t.element_size() for t in tree_leaves(out)
                                            if isinstance(t, torch.Tensor))])
            return out

    cp.shard((torch.zeros(1, seq, dtype=torch.long),) * 2)
    local = seq // cp.size
    torch.manual_seed(cp.rank)
    q, k, v = (torch.randn(1, h, local, HEAD_DIM, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS))
    grad = torch.randn(1, HEADS, local, HEAD_DIM)
    dist.barrier()
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak (VmHWM) to the resident memory now
    start = time.perf_counter()
    with Largest():
        if path == "ring":
            out = sequence_attention(q, k, v, enable_gqa=True, context=cp)
        else:
            out = _mask_path(q, k, v, cp.positions)
        out.backward(grad)
    seconds = time.perf_counter() - start
    peak = status_kib("VmHWM")
    del out
    dist.barrier()
    return {"peak_extra_mib": (peak - before) / 1024, "largest_tensor_mib": largest[0] / MIB, "seconds": seconds}


def _rank(rank: int, store: str, lengths: list[int], out: str) -> None:
    from lightning_par.parallel.context_parallel import ContextParallel

    torch.set_num_threads(1)  # two ranks on the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    cp = ContextParallel(group=dist.group.WORLD, size=2, rank=rank)
    for path in ("ring", "mask"):  # warm-up: the first call's one-time allocations are not the attention's
        _measure(path, lengths[0], cp)
    rows = []
    for seq in lengths:
        for path in ("ring", "mask"):
            rows.append({"T": seq, "path": path, **_measure(path, seq, cp)})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "cp_attention_memory.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows_file = os.path.join(tmp, "rows.json")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), args.lengths, rows_file), nprocs=2, join=True)
        rows = json.loads(Path(rows_file).read_text())
    by = {(r["T"], r["path"]): r for r in rows}
    print(f"cp=2, 2 gloo ranks, B=1, {HEADS} heads / {KV_HEADS} kv heads, head dim {HEAD_DIM}, fp32; per rank, "
          "one attention forward + backward")
    print(f"{'T':>6} | {'ring peak MiB':>13} {'largest':>8} {'s':>6} | {'mask peak MiB':>13} {'largest':>8} {'s':>6}")
    for seq in args.lengths:
        ring, mask = by[(seq, "ring")], by[(seq, "mask")]
        print(f"{seq:>6} | {ring['peak_extra_mib']:>13.1f} {ring['largest_tensor_mib']:>8.2f} {ring['seconds']:>6.2f} "
              f"| {mask['peak_extra_mib']:>13.1f} {mask['largest_tensor_mib']:>8.2f} {mask['seconds']:>6.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"cp": 2, "batch": 1, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
                                    "dtype": "float32", "torch": torch.__version__, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
