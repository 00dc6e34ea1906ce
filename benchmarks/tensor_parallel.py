"""Tensor (Megatron) and sequence parallelism measured against the formulas, and side by side with Lightning.

(a) Traffic: one transformer block of the example GPT, split by lightning-par's TP engine
    (``apply_tensor_parallel``) and by the hand-written torch plan of ``benchmarks/tp_gpt.py``, runs forward and
    backward on t gloo ranks (t = 2, 4, with and without sequence parallelism) under
    :class:`~lightning_par.parallel.tp_accounting.CollectiveTracer`: collectives per pass and bytes sent per rank
    (ring formulas) beside Megatron's 2 + 2 all-reduces of ``sbh``. Then one whole training step of a 2-layer GPT
    (forward, vocab-parallel loss, backward, AdamW step), traffic by where it was issued.
(b) Activation memory: bytes the block saves for backward (``saved_tensors_hooks``, each storage once, parameters
    excluded) for t = 1, 2, 4 with and without SP, beside table 2 of Korthikanti et al. and beside our exact formula
    for this block (:func:`~lightning_par.parallel.tp_accounting.block_activation_formula`).
(c) Side by side: the tiny GPT trained with lightning-par's ``MegatronTPStrategy`` (tp=2) and with Lightning's
    ``ModelParallelStrategy`` given the same plan by hand (``benchmarks.tp_gpt.HandTPGPT``), separate launches,
    alternating over rounds: step time ratio ours / theirs (median of per-round ratios), peak RSS and bytes of
    parameters + gradients + optimizer states per rank. Neither side runs the CLI's post-fit text sample.

    python benchmarks/tensor_parallel.py            # everything, about 5 minutes on 2 idle cores
    python benchmarks/tensor_parallel.py --quick    # (c) with 1 round of 20 steps
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_par.parallel.tp_accounting import (  # noqa: E402
    CollectiveTracer,
    block_activation_formula,
    block_activation_sbh_form,
    layer_traffic,
    megatron_activation_formula,
    megatron_traffic_formula,
    ring_sent_bytes,
    saved_activation_bytes,
    split_by_tp,
)

#: The block measured in (a) and (b): every size divisible by t = 4 (heads, kv heads, hidden, ffn, sequence), GQA
#: (2 query heads per kv head), ffn_dim not 4h, sequence length different from head_dim so no shape is ambiguous.
BLOCK = {"dim": 128, "n_heads": 8, "n_kv_heads": 4, "ffn_dim": 352}
SEQ, BATCH = 32, 2
STEP_LAYERS = 2


def _config(n_layers: int = 1):
    from lightning_par.examples.gpt import GPTConfig

    return GPTConfig(**BLOCK, n_layers=n_layers)


def _block(impl: str, mesh, sp: bool):
    """One block split over ``mesh`` by ``impl``: "engine" (lightning-par) or "hand" (``benchmarks/tp_gpt.py``)."""
    from lightning_par.examples.gpt import GPT, Block

    torch.manual_seed(0)
    if impl == "engine":
        from lightning_par.parallel.tensor_parallel import apply_tensor_parallel

        model = GPT(_config())
        apply_tensor_parallel(model, mesh, sequence_parallel=sp)
        return model.layers["0"]
    from benchmarks.tp_gpt import apply_hand_plan

    return apply_hand_plan(Block(_config()), mesh, sequence_parallel=sp, block=True)


def _block_input(rank: int, t: int, sp: bool) -> torch.Tensor:
    torch.manual_seed(1)
    x = torch.randn(BATCH, SEQ, BLOCK["dim"])
    if sp:  # with sequence parallelism a block receives this rank's slice of the sequence
        x = x.chunk(t, dim=1)[rank].contiguous()
    return x.requires_grad_(True)


def measure_block(block: torch.nn.Module, x: torch.Tensor) -> dict:
    """Activation bytes of one forward, then the collectives of a fresh forward and its backward."""
    _, saved = saved_activation_bytes(lambda: block(x), exclude=list(block.parameters()))
    traffic = layer_traffic(block, x)
    return {"saved_bytes": saved.nbytes, "saved": saved.entries, **traffic.summary()}


def measure_step(mesh, sp: bool, impl: str = "engine") -> dict:
    """Collectives of the second training step of a ``STEP_LAYERS``-layer GPT split by ``impl`` (see
    :func:`_block`), by phase and by the module that issued them (the first step warms AdamW's states up)."""
    from torch.distributed.tensor.parallel import loss_parallel

    from lightning_par.examples.gpt import GPT, causal_lm_loss

    torch.manual_seed(0)
    model = GPT(_config(STEP_LAYERS))
    if impl == "engine":
        from lightning_par.parallel.tensor_parallel import apply_tensor_parallel

        loss_context = apply_tensor_parallel(model, mesh, sequence_parallel=sp).loss_context
    else:
        from benchmarks.tp_gpt import apply_hand_plan

        apply_hand_plan(model, mesh, sequence_parallel=sp)
        loss_context = loss_parallel
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(2)
    tokens = torch.randint(0, model.config.vocab_size, (BATCH, SEQ + 1))
    phases: dict[str, list] = {}
    for _ in range(2):
        # One tracer over forward and backward: its module tracker names the module a backward collective
        # belongs to only if it saw that module's forward.
        with loss_context(), CollectiveTracer() as passes:
            loss = causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        with CollectiveTracer() as opt:
            optimizer.step()
        optimizer.zero_grad()
        phases = {"forward": [r for r in passes.records if not r.backward],
                  "backward": [r for r in passes.records if r.backward], "optimizer": opt.records}

    def where(module: str) -> str:
        # "GPT.layers.1.attn.o_proj" -> "layers"; "Global" during the loss -> "loss"
        parts = module.split(".")
        if "layers" in parts:
            return "layers"
        return {"Global": "loss", "GPT": "loss"}.get(module, parts[-1])

    table: dict[str, dict[str, dict]] = {}
    for phase, records in phases.items():
        for r in records:
            place = "optimizer" if phase == "optimizer" else where(r.module)
            cell = table.setdefault(place, {}).setdefault(phase, {"calls": {}, "sent_bytes": 0.0, "ops": []})
            cell["calls"][r.kind] = cell["calls"].get(r.kind, 0) + 1
            cell["sent_bytes"] += ring_sent_bytes([r])
            cell["ops"].append((r.kind, r.nbytes))
    total = sum(ring_sent_bytes(rs) for rs in phases.values())
    return {"by_place": table, "sent_bytes": total, "layers": STEP_LAYERS}


def _worker(rank: int, world: int, store: str, out: str, impls: tuple[str, ...], with_step: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result: dict = {"rank": rank, "t": world, "blocks": {}, "steps": {}}
    try:
        mesh = init_device_mesh("cpu", (world,))
        for sp in (False, True):
            for impl in impls:
                key = f"{impl}{'+sp' if sp else ''}"
                try:
                    result["blocks"][key] = measure_block(_block(impl, mesh, sp), _block_input(rank, world, sp))
                except Exception:  # report, keep measuring the other variants
                    result["blocks"][key] = {"error": traceback.format_exc()}
            for impl in impls if with_step else ():
                key = f"{impl}{'+sp' if sp else ''}"
                try:
                    result["steps"][key] = measure_step(mesh, sp, impl)
                except Exception:
                    result["steps"][key] = {"error": traceback.format_exc()}
        Path(f"{out}.{rank}").write_bytes(pickle.dumps(result))
    finally:
        dist.destroy_process_group()


def measure_tp(t: int, impls: tuple[str, ...] = ("engine", "hand"), with_step: bool = True) -> list[dict]:
    """Run (a) and (b) on ``t`` gloo ranks in child processes; one result dict per rank."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result")
        # fork, not spawn: the children inherit the imported modules (torch, lightning: seconds per rank on 2 cores).
        # Spawn only if this process holds a process group, which a forked child would inherit half-alive.
        method = "spawn" if dist.is_initialized() else "fork"
        mp.start_processes(_worker, args=(t, os.path.join(tmp, "store"), out, impls, with_step), nprocs=t,
                           join=True, start_method=method)
        return [pickle.loads(Path(f"{out}.{rank}").read_bytes()) for rank in range(t)]


def measure_unsharded() -> dict:
    """The block without tensor parallelism (t = 1), in this process."""
    from lightning_par.examples.gpt import Block

    torch.manual_seed(0)
    block = Block(_config())
    _, saved = saved_activation_bytes(lambda: block(_block_input(0, 1, False)), exclude=list(block.parameters()))
    return {"saved_bytes": saved.nbytes, "saved": saved.entries}


def formulas(t: int, sp: bool) -> dict:
    """Table 2 and our formula for the measured block at t ranks."""
    h, a = BLOCK["dim"], BLOCK["n_heads"]
    ours = block_activation_formula(SEQ, BATCH, h, a, BLOCK["n_kv_heads"], BLOCK["ffn_dim"], t, sp)
    return {
        "megatron_bytes": megatron_activation_formula(SEQ, BATCH, h, a, t, sp),
        "ours_bytes": ours["total"],
        "ours_parts": ours,
        "traffic": megatron_traffic_formula(SEQ, BATCH, h, t, element_size=4),
    }


# ----------------------------------------------------------------------------------------------------------------------
# (a) + (b): tables
# ----------------------------------------------------------------------------------------------------------------------
def accounting(ts: tuple[int, ...] = (2, 4)) -> dict:
    per_t = {t: measure_tp(t) for t in ts}
    unsharded = measure_unsharded()
    traffic_rows, memory_rows = [], []
    f1 = formulas(1, False)
    memory_rows.append({"t": 1, "sp": False, "impl": "none", "measured": unsharded["saved_bytes"],
                        "megatron": f1["megatron_bytes"], "ours": f1["ours_bytes"]})
    for t, ranks in per_t.items():
        for sp in (False, True):
            f = formulas(t, sp)
            for impl in ("engine", "hand"):
                key = f"{impl}{'+sp' if sp else ''}"
                blocks = [r["blocks"][key] for r in ranks]
                if any("error" in b for b in blocks):
                    err = next(b["error"] for b in blocks if "error" in b).strip().splitlines()[-1]
                    traffic_rows.append({"t": t, "sp": sp, "impl": impl, "error": err})
                    memory_rows.append({"t": t, "sp": sp, "impl": impl, "error": err})
                    continue
                b0 = blocks[0]
                traffic_rows.append({
                    "t": t, "sp": sp, "impl": impl, "forward": b0["forward"], "backward": b0["backward"],
                    "sent_bytes_forward": max(b["sent_bytes_forward"] for b in blocks),
                    "sent_bytes_backward": max(b["sent_bytes_backward"] for b in blocks),
                    # the formula covers the activations' collectives; anything else (SP: norm-weight gradients)
                    # is listed apart
                    "activation_sent_bytes": {ph: _sent(b0[f"{ph}_ops"], t, activation=True)
                                              for ph in ("forward", "backward")},
                    "other_ops": {ph: [op for op in b0[f"{ph}_ops"] if op[1] != ACTIVATION_BYTES]
                                  for ph in ("forward", "backward")},
                    "formula_bytes_per_pass": f["traffic"]["forward"],
                    "same_on_all_ranks": all(b["forward"] == b0["forward"] and b["backward"] == b0["backward"]
                                             and b["sent_bytes"] == b0["sent_bytes"] for b in blocks),
                })
                memory_rows.append({"t": t, "sp": sp, "impl": impl,
                                    "measured": max(b["saved_bytes"] for b in blocks),
                                    "megatron": f["megatron_bytes"], "ours": f["ours_bytes"]})
    for row in memory_rows:
        if "error" not in row:
            row["ratio_megatron"] = row["measured"] / row["megatron"]
            row["ratio_ours"] = row["measured"] / row["ours"]
    steps = {t: ranks[0]["steps"] for t, ranks in per_t.items()}
    split = {}
    for sp in (False, True):
        # t = 1 is the unsharded block, the same with or without SP
        by_t = {r["t"]: r["measured"] for r in memory_rows
                if "error" not in r and (r["impl"] == "none" or (r["impl"] == "engine" and r["sp"] == sp))}
        if {1, 2} <= set(by_t):
            split["sp" if sp else "tp"] = split_by_tp(by_t)
    return {"traffic": traffic_rows, "memory": memory_rows, "steps": steps, "split": split,
            "saved_tensors": {"t1": unsharded["saved"],
                              **{f"t{t}_{k}": ranks[0]["blocks"][k].get("saved") for t, ranks in per_t.items()
                                 for k in ("engine", "engine+sp")}}}


ACTIVATION_BYTES = SEQ * BATCH * BLOCK["dim"] * 4  # one [b, s, h] fp32 activation


def _sent(ops: list, t: int, activation: bool) -> float:
    """Ring bytes sent per rank by the ``(kind, nbytes)`` ops whose buffer is (or is not) one activation."""
    factor = {"all_reduce": 2.0}
    return sum(factor.get(k, 1.0) * n * (t - 1) / t for k, n in ops if (n == ACTIVATION_BYTES) == activation)


def _calls(counts: dict) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A"}
    return " ".join(f"{n}{short.get(k, k)}" for k, n in sorted(counts.items())) or "-"


def print_traffic(rows: list[dict], steps: dict) -> None:
    s, b, h = SEQ, BATCH, BLOCK["dim"]
    print(f"\n(a) traffic of one block (s={s}, b={b}, h={h}, fp32), per rank; formula: Megatron 2 all-reduces of sbh "
          "per pass = 4 sbh (t-1)/t elements")
    print("    sent = bytes sent per rank by the collectives of the activations (buffer sbh); other = the rest")
    print(f"{'t':>2} {'SP':>3} {'impl':<7} {'forward':>11} {'backward':>15} {'sent fwd':>10} {'sent bwd':>10} "
          f"{'formula':>10} {'ratio':>6}  other")
    for r in rows:
        head = f"{r['t']:>2} {'yes' if r['sp'] else 'no':>3} {r['impl']:<7}"
        if "error" in r:
            print(f"{head} failed: {r['error'][:80]}")
            continue
        act = r["activation_sent_bytes"]
        ratio = (act["forward"] + act["backward"]) / (2 * r["formula_bytes_per_pass"])
        other = " ".join(f"{k}({n} B)" for ph in ("forward", "backward") for k, n in r["other_ops"][ph]) or "-"
        print(f"{head} {_calls(r['forward']):>11} {_calls(r['backward']):>15} {act['forward']:>10.0f} "
              f"{act['backward']:>10.0f} {r['formula_bytes_per_pass']:>10.0f} {ratio:>6.3f}  {other}")
    for t, by_sp in steps.items():
        for name, step in by_sp.items():
            if "error" in step:
                print(f"\n  whole step t={t} {name}: failed: {step['error'].strip().splitlines()[-1][:100]}")
                continue
            layer_formula = STEP_LAYERS * megatron_traffic_formula(s, b, h, t, 4)["total"]
            impl, _, sp = name.partition("+")
            print(f"\n  whole training step, {STEP_LAYERS}-layer GPT, t={t}, {'TP+SP' if sp else 'TP'}, {impl}: "
                  f"{step['sent_bytes']:.0f} bytes sent per rank; layers' formula {layer_formula:.0f}")
            for place, phases in step["by_place"].items():
                cells = "  ".join(f"{ph}: {_calls(c['calls'])} {c['sent_bytes']:.0f} B" for ph, c in phases.items())
                print(f"    {place:<10} {cells}")


def print_memory(rows: list[dict], split: dict) -> None:
    s, b, h, a = SEQ, BATCH, BLOCK["dim"], BLOCK["n_heads"]
    print(f"\n(b) activations saved for backward by one block, bytes per rank (s={s}, b={b}, h={h}, a={a}, "
          f"kv heads {BLOCK['n_kv_heads']}, ffn {BLOCK['ffn_dim']}, fp32)")
    print("    table 2 (16-bit + dropout masks): TP sbh(10 + 24/t + 5as/ht), TP+SP sbh(34/t + 5as/ht)")
    print(f"    ours, TP:    {block_activation_sbh_form(h, a, BLOCK['n_kv_heads'], BLOCK['ffn_dim'], False)}")
    print(f"    ours, TP+SP: {block_activation_sbh_form(h, a, BLOCK['n_kv_heads'], BLOCK['ffn_dim'], True)}")
    print(f"{'t':>2} {'SP':>3} {'impl':<7} {'measured':>9} {'table 2':>9} {'meas/t2':>8} {'ours':>9} {'meas/ours':>10}")
    for r in rows:
        head = f"{r['t']:>2} {'yes' if r['sp'] else 'no':>3} {r['impl']:<7}"
        if "error" in r:
            print(f"{head} failed: {r['error'][:80]}")
            continue
        print(f"{head} {r['measured']:>9.0f} {r['megatron']:>9.0f} {r['ratio_megatron']:>8.3f} {r['ours']:>9.0f} "
              f"{r['ratio_ours']:>10.4f}")
    sbh = SEQ * BATCH * BLOCK["dim"]
    for name, fit in split.items():
        label, table2 = ("TP+SP", "0") if name == "sp" else ("TP   ", "10")
        print(f"  {label} engine: bytes(t) = {fit['replicated']:.0f} + {fit['sharded']:.0f}/t (residual "
              f"{fit['max_relative_residual']:.1e}); replicated part {fit['replicated'] / sbh:.2f} sbh bytes, "
              f"table 2: {table2} sbh")


# ----------------------------------------------------------------------------------------------------------------------
# (c) side by side with Lightning's ModelParallelStrategy
# ----------------------------------------------------------------------------------------------------------------------
OURS, THEIRS = "MegatronTPStrategy", "ModelParallelStrategy"


def _strategy_args(name: str, tp: int) -> list[str]:
    if name == THEIRS:
        return ["--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
                "--trainer.strategy.data_parallel_size=1", f"--trainer.strategy.tensor_parallel_size={tp}",
                "--model=benchmarks.tp_gpt.HandTPGPT"]
    return ["--trainer.strategy=lightning_par.MegatronTPStrategy", f"--trainer.strategy.tp={tp}",
            "--model=benchmarks.tp_gpt.GPTNoSample"]


def side_by_side(tmp: Path, tp: int, steps: int, rounds: int, preset: str) -> dict:
    from benchmarks.common import last_error, state_report_args, state_reports, throughput_windows
    from benchmarks.zero import worst_rank
    from tests.harness import launch_cli

    cache = tmp / "cache"
    results = {n: {"strategy": n, "ok": True, "round_medians": {}, "windows": [], "seconds": []}
               for n in (OURS, THEIRS)}
    for rnd in range(rounds):
        order = (OURS, THEIRS) if rnd % 2 == 0 else (THEIRS, OURS)  # alternate who runs first
        for name in order:
            res = results[name]
            if not res["ok"]:
                continue
            root = tmp / f"{name}-{rnd}"
            args = [*_strategy_args(name, tp), f"--model.preset={preset}", f"--trainer.max_steps={steps}",
                    "--data.seq_len=128", "--data.batch_size=8", "--trainer.limit_val_batches=0",
                    "--tokens_per_sec.window=10", *state_report_args(root, 3)]
            run = launch_cli(root, cache, args, devices=tp, timeout=600)
            reports = state_reports(run) if run.returncode == 0 else []
            if run.returncode != 0 or len(reports) != tp or any(r["bytes"] is None for r in reports):
                res.update(ok=False, error=last_error(run) if run.returncode else "no state report")
                print(f"  {name} round {rnd}: FAILED ({res['error']})", flush=True)
                continue
            windows = throughput_windows(run)
            res["windows"] += windows
            res["round_medians"][rnd] = statistics.median(windows)
            res["seconds"].append(run.seconds)
            measured = worst_rank(reports)
            res.update(peak_rss_bytes=measured["peak_rss_bytes"], state_bytes=measured["bytes"])
            print(f"  {name} round {rnd}: ok ({run.seconds:.0f} s, {res['round_medians'][rnd]:.0f} tokens/s)",
                  flush=True)
    ours, theirs = results[OURS], results[THEIRS]
    out = {"tp": tp, "steps": steps, "rounds": rounds, "preset": preset, "ours": ours, "theirs": theirs,
           # other work on the machine shows in the ratios' spread: record how busy it was
           "load_average_1min_at_end": os.getloadavg()[0], "cpus": os.cpu_count()}
    if ours["ok"] and theirs["ok"]:
        # step time ours / theirs = their tokens/s / ours, paired within a round (load drifts between rounds)
        paired = [theirs["round_medians"][r] / ours["round_medians"][r] for r in ours["round_medians"]
                  if r in theirs["round_medians"]]
        out.update(step_time_ratio=statistics.median(paired), step_time_ratio_by_round=paired,
                   peak_rss_ratio=ours["peak_rss_bytes"] / theirs["peak_rss_bytes"],
                   state_bytes_ratio=ours["state_bytes"]["total"] / theirs["state_bytes"]["total"])
    return out


def print_side_by_side(res: dict) -> None:
    from benchmarks.zero import fmt_bytes

    print(f"\n(c) {res['preset']} GPT, tp={res['tp']} on {res['tp']} CPU ranks, {res['steps']} steps x {res['rounds']} "
          "rounds, seq 128 x batch 8; ratios ours / theirs")
    print(f"{'strategy':<22}{'tokens/s':>10}{'peak RSS':>12}{'params+grads+optim':>20}")
    for key in ("ours", "theirs"):
        r = res[key]
        if not r["ok"]:
            print(f"{r['strategy']:<22}failed: {r['error'][:90]}")
            continue
        print(f"{r['strategy']:<22}{statistics.median(r['windows']):>10.0f}{fmt_bytes(r['peak_rss_bytes']):>12}"
              f"{fmt_bytes(r['state_bytes']['total']):>20}")
    if "step_time_ratio" in res:
        rounds = ", ".join(f"{x:.3f}" for x in res["step_time_ratio_by_round"])
        print(f"step time ratio {res['step_time_ratio']:.3f} (by round: {rounds}); peak RSS ratio "
              f"{res['peak_rss_ratio']:.3f}; state bytes ratio {res['state_bytes_ratio']:.3f}; load average "
              f"{res['load_average_1min_at_end']:.1f} on {res['cpus']} CPUs")


# ----------------------------------------------------------------------------------------------------------------------
# (d) the plans alone: engine vs hand-written, interleaved in the same processes
# ----------------------------------------------------------------------------------------------------------------------
class _OpCounter(TorchDispatchMode):
    """Count the ops a step dispatches: on DTensors (each costs a sharding propagation) and on plain tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.dtensor = self.local = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(getattr(t, "__name__", "") == "DTensor" for t in types):
            self.dtensor += 1
            return NotImplemented  # let DTensor desugar it; its local ops come back here
        self.local += 1
        return func(*args, **(kwargs or {}))


def _interleaved_worker(rank: int, world: int, store: str, out: str, preset: str, rounds: int, steps: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from benchmarks.tp_gpt import apply_hand_plan
    from lightning_par.examples.gpt import GPT, GPTConfig, causal_lm_loss
    from lightning_par.parallel.tensor_parallel import apply_tensor_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        runs = {}
        for impl in ("engine", "hand"):
            torch.manual_seed(0)
            model = GPT(GPTConfig.from_preset(preset))
            if impl == "engine":
                context = apply_tensor_parallel(model, mesh).loss_context
            else:
                apply_hand_plan(model, mesh)
                context = loss_parallel
            runs[impl] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3), context)
        torch.manual_seed(1)
        tokens = torch.randint(0, 256, (8, 129))

        def step(impl: str) -> None:
            model, optimizer, context = runs[impl]
            with context():
                causal_lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad()

        times: dict[str, list[float]] = {"engine": [], "hand": []}
        for impl in ("engine", "hand"):  # warm-up: DTensor's sharding-propagation caches, AdamW states
            for _ in range(3):
                step(impl)
        # A count that load cannot blur: ops dispatched in one step, at the DTensor level and below it
        ops = {}
        for impl in ("engine", "hand"):
            with _OpCounter() as counter:
                step(impl)
            ops[impl] = {"dtensor_ops": counter.dtensor, "local_ops": counter.local}
        for rnd in range(rounds):
            for impl in (("engine", "hand") if rnd % 2 == 0 else ("hand", "engine")):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(steps):
                    step(impl)
                dist.barrier()
                times[impl].append((time.perf_counter() - start) / steps)
        if rank == 0:
            Path(out).write_text(json.dumps({"times": times, "ops": ops}))
    finally:
        dist.destroy_process_group()


def interleaved(preset: str, tp: int = 2, rounds: int = 60, steps: int = 1) -> dict:
    """Step time of the engine's plan and the hand-written plan, alternating every ``steps`` steps in the same
    ``tp`` processes, so that a machine's changing load falls on both alike. No Lightning: the plans alone.

    The ratio is of the medians of the step times (a burst of other work spoils single steps of either plan, and
    the median drops them), not the median of per-round ratios, which such a burst skews one way."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        method = "spawn" if dist.is_initialized() else "fork"
        mp.start_processes(_interleaved_worker, args=(tp, os.path.join(tmp, "store"), out, preset, rounds, steps),
                           nprocs=tp, join=True, start_method=method)
        result = json.loads(Path(out).read_text())
    times = result["times"]
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"tp": tp, "preset": preset, "rounds": rounds, "steps_per_round": steps, "seconds_per_step": times,
            "median_seconds_per_step": medians, "step_time_ratio": medians["engine"] / medians["hand"],
            "mean_ratio": statistics.fmean(times["engine"]) / statistics.fmean(times["hand"]),
            "ops_per_step": result["ops"]}


def print_interleaved(res: dict) -> None:
    e, h = (res["median_seconds_per_step"][k] for k in ("engine", "hand"))
    print(f"\n(d) the plans alone, {res['preset']} GPT, tp={res['tp']}, seq 128 x batch 8, {res['rounds']} steps of "
          f"each, alternating in the same processes: engine {e * 1e3:.1f} ms/step, hand {h * 1e3:.1f} ms/step "
          f"(medians); ratio engine / hand {res['step_time_ratio']:.3f} (of means {res['mean_ratio']:.3f})")
    ops = res["ops_per_step"]
    print("    ops dispatched per training step (DTensor-level / plain-tensor level): " + ", ".join(
        f"{k} {v['dtensor_ops']} / {v['local_ops']}" for k, v in ops.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--quick", action="store_true", help="(c) with 1 round of 20 steps")
    parser.add_argument("--steps", type=int, help="steps per launch in (c) (default 60)")
    parser.add_argument("--rounds", type=int, help="alternating rounds in (c) (default 4)")
    parser.add_argument("--skip-speed", action="store_true", help="only (a) and (b)")
    parser.add_argument("--json", default="benchmarks/results/tensor_parallel.json")
    opts = parser.parse_args()
    steps = opts.steps or (20 if opts.quick else 60)
    rounds = opts.rounds or (1 if opts.quick else 4)

    start = time.time()
    print("(a)+(b) accounting on 2 and 4 gloo ranks", flush=True)
    acc = accounting()
    speed = plans = None
    if not opts.skip_speed:
        print("(c) side by side", flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            speed = side_by_side(Path(tmp), 2, steps, rounds, opts.preset)
        print("(d) the plans alone", flush=True)
        plans = interleaved(opts.preset, rounds=20 if opts.quick else 100)
    print_traffic(acc["traffic"], acc["steps"])
    print_memory(acc["memory"], acc["split"])
    if speed:
        print_side_by_side(speed)
    if plans:
        print_interleaved(plans)
    elapsed = time.time() - start
    print(f"\nbenchmark wall time {elapsed:.0f} s")
    out = Path(opts.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"block": BLOCK, "seq": SEQ, "batch": BATCH, "wall_seconds": elapsed,
                               "accounting": acc, "side_by_side": speed, "plans_interleaved": plans}, indent=1,
                              default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
