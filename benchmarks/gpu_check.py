"""One prepared check of lightning-par on one GPU (issue 26), runnable on the CPU as a small rehearsal.

Each stage runs in its own subprocess (a crash or a timeout loses that stage only) and appends one JSON line to
``--out``: ``{"stage", "ok", "error", "seconds", "figures", "run_id", "device", "preset"}`` (``error``: the last line
of the exception or of the child's output; ``figures`` holds what was measured before a failure as well).

========== ========================================================================================================
stage      what it measures
========== ========================================================================================================
env        versions, device, bf16 and TF32; a bf16 matmul rate; SDPA (causal, GQA) per backend (flash, efficient,
           cudnn, math) and the one the default call takes; the context-parallel attention on a one-rank group
           (NCCL on CUDA, gloo on CPU) against plain SDPA, forward and backward
lightning  a plain PyTorch loop against ``Trainer`` + ``ZeroStrategy(stage=0)`` on the example GPT, eager and with
           ``compile=True`` (the plain loop compiles the same blocks): tokens/s, MFU, peak memory, losses, ratios
zero       ZeRO-1/2/3 (bf16-mixed on CUDA, 32-true on CPU) and bf16-mixed-master at dp=1: losses and step times;
           at ZeRO-3 the deferred build against an eager one with the same seed (bit-equal?) and the memory peak
           from setup to fit start against model bytes + the largest tensor (asserted on CUDA only)
offload    ZeRO-1/2 ``offload_optimizer`` and ZeRO-3 offload against the same stage without, plain SGD,
           ``gradient_clip_val``, 32-true: the largest parameter difference after a few steps
checkpoint how long a training step is blocked by a synchronous and by an asynchronous sharded save
planner    the planner's step time for the layouts measured above (this run's ``lightning`` and ``zero`` lines)
           beside the measured steps
========== ========================================================================================================

    PYTHONPATH=. python benchmarks/gpu_check.py --device cpu --preset tiny          # the rehearsal, ~1-2 minutes
    PYTHONPATH=. python benchmarks/gpu_check.py --device cuda --preset 1b --out $OUT/gpu_check.jsonl
    PYTHONPATH=. python benchmarks/gpu_check.py --device cuda --stages env,planner --timeout env=60

See docs/gpu.md for the device command, the wheels it needs and the targets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STAGES = ("env", "lightning", "zero", "offload", "checkpoint", "planner")
SEED = 1234
OFFLOAD_TOL = 1e-6  # largest parameter difference, offloaded optimizer against none, taken as exact

#: per preset: the GPT preset, batch x sequence, steps, SDPA's sequence length, stage timeouts (seconds). The tiny
#: preset compiles with aot_eager (traced forward and backward, run eagerly): inductor's C++ build of the blocks takes
#: most of a minute on two loaded cores, and the rehearsal checks the wiring; 1b compiles with inductor (True).
PRESETS = {
    "tiny": dict(gpt="tiny", batch=4, seq=128, warmup=2, steps=4, few=3, sdpa_seq=256, sdpa_heads=(4, 2, 32),
                 matmul=256, ckpt_steps=(2, 2, 2), compile=dict(backend="aot_eager"),
                 timeouts=dict(env=60, lightning=150, zero=90, offload=90, checkpoint=60, planner=60)),
    # the 1b GPT (~0.97B parameters with the byte vocabulary): 2 x 4096 tokens a step; the timeouts sum to 540 s
    "1b": dict(gpt="1b", batch=2, seq=4096, warmup=3, steps=10, few=3, sdpa_seq=8192, sdpa_heads=(32, 8, 128),
               matmul=8192, ckpt_steps=(2, 3, 4), compile=True,
               timeouts=dict(env=45, lightning=200, zero=110, offload=70, checkpoint=80, planner=35)),
}


# ----------------------------------------------------------------------------------------------------------------------
# Helpers shared by the stages (run in the child process)
# ----------------------------------------------------------------------------------------------------------------------
def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device) -> None:
    """Start a memory peak: CUDA's allocator statistics, or the process's resident high-water mark."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _peak(device) -> dict:
    import torch

    if device.type == "cuda":
        return {"max_allocated_bytes": torch.cuda.max_memory_allocated(device),
                "max_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    return {"peak_rss_bytes": _status_bytes("VmHWM")}


def _process_group(device) -> None:
    """A one-rank default process group: NCCL on CUDA, gloo on CPU."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(20000 + os.getpid() % 20000))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)


def _lightning_module(p: dict, **kwargs):
    from lightning_par.examples import GPTLightningModule

    return GPTLightningModule(preset=p["gpt"], **kwargs)


def _loader(p: dict, n_steps: int):
    import torch

    from benchmarks.common import FixedTokens

    # one distinct row: every batch is the same whatever order the strategy's sampler draws in, so the plain loop
    # and Lightning see the same data (the losses comparable), and throughput does not depend on the tokens
    data = FixedTokens(n_steps * p["batch"], p["seq"], SEED, distinct=1)
    return torch.utils.data.DataLoader(data, batch_size=p["batch"])


def _trainer(args, p: dict, strategy, max_steps: int, callbacks=(), **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(accelerator=args.device, devices=1, strategy=strategy, max_steps=max_steps,
                      limit_val_batches=0, num_sanity_val_steps=0, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                      default_root_dir=tempfile.mkdtemp(prefix="gpu_check_"), **kwargs)


def _free(device) -> None:
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _whole(t):
    """A tensor's whole value (a DTensor gathered), detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


class _Recorder:
    """Lightning callback: per-step losses, the time of the steps after ``warmup`` (device synchronised only at the
    window's edges), and optionally the parameters at the end."""

    def __new__(cls, *args, **kwargs):
        import lightning.pytorch as pl

        # made a Callback subclass lazily: the parent process never imports Lightning
        klass = type("Recorder", (cls, pl.Callback), {"__new__": object.__new__})
        return object.__new__(klass)

    def __init__(self, device, warmup: int, keep_params: bool = False) -> None:
        self.device, self.warmup, self.keep_params = device, warmup, keep_params
        self.losses: list[float] = []
        self.start = self.end = None
        self.steps = 0
        self.params: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == self.warmup:
            _sync(self.device)
            self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(loss.detach().float())  # read after the window: no host sync inside it
        if batch_idx >= self.warmup:
            self.steps += 1
            _sync(self.device)  # cheap where the window ends; the next batch's start is the one that counts
            self.end = time.perf_counter()

    def on_train_end(self, trainer, pl_module) -> None:
        if self.keep_params:
            self.params = {n: _whole(t).float().cpu() for n, t in pl_module.model.state_dict().items()}

    def loss_values(self) -> list[float]:
        return [float(v) for v in self.losses]

    @property
    def step_s(self) -> float:
        return (self.end - self.start) / self.steps


# ----------------------------------------------------------------------------------------------------------------------
# Stage 1: environment, matmul rate, SDPA backends, context-parallel attention
# ----------------------------------------------------------------------------------------------------------------------
def stage_env(args, p: dict, device, fig: dict) -> None:
    import lightning
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cuda = device.type == "cuda"
    fig.update(torch=torch.__version__, lightning=lightning.__version__, python=sys.version.split()[0],
               cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
               nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
               device_name=torch.cuda.get_device_name(device) if cuda else "cpu",
               bf16_supported=torch.cuda.is_bf16_supported() if cuda else True,
               tf32_matmul=torch.backends.cuda.matmul.allow_tf32, tf32_cudnn=torch.backends.cudnn.allow_tf32,
               float32_matmul_precision=torch.get_float32_matmul_precision(), threads=torch.get_num_threads())
    if cuda:
        props = torch.cuda.get_device_properties(device)
        fig.update(capability=f"{props.major}.{props.minor}", memory_bytes=props.total_memory,
                   multiprocessors=props.multi_processor_count)

    # a bf16 matmul rate: random data (zeros run faster than real data), warmed up, timed between syncs
    n = p["matmul"]
    a, b = torch.randn(n, n, device=device, dtype=torch.bfloat16), torch.randn(n, n, device=device,
                                                                               dtype=torch.bfloat16)
    reps = 20 if cuda else 3
    for _ in range(3):
        a @ b
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    _sync(device)
    fig["bf16_matmul_tflops"] = 2 * n**3 * reps / (time.perf_counter() - start) / 1e12
    fig["bf16_matmul_n"] = n
    del a, b

    # SDPA, causal with grouped-query attention, as the example GPT calls it
    heads, kv_heads, head_dim = p["sdpa_heads"]
    T = p["sdpa_seq"]
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, T, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, T, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, kv_heads, T, head_dim, device=device, dtype=dtype, generator=g)
    fig["sdpa_shape"] = dict(T=T, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype=str(dtype))

    def sdpa():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def timed(fn, reps: int = 5) -> float:
        fn()
        _sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        return (time.perf_counter() - start) / reps

    backends = {}
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cudnn", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        try:
            with sdpa_kernel(backend):
                backends[name] = {"ok": True, "seconds": timed(sdpa, 3 if name == "math" else 5)}
        except Exception as err:  # noqa: BLE001 -- a backend this input or device cannot take: say why
            backends[name] = {"ok": False, "error": str(err).strip().splitlines()[-1][:200]}
    fig["sdpa_backends"] = backends
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:  # which aten kernel the default call dispatches to
        sdpa()
    ops = sorted({e.name for e in prof.events() if "scaled_dot_product" in e.name and "_attention" in e.name})
    fig["sdpa_default_ops"] = ops
    fig["sdpa_default_seconds"] = timed(sdpa)
    causal_flops = 4 * heads * T * T * head_dim / 2  # two matmuls, half the scores under the causal mask
    fig["sdpa_default_tflops"] = causal_flops / fig["sdpa_default_seconds"] / 1e12

    # the context-parallel attention on a one-rank group, forward and backward, against plain SDPA
    import torch.distributed as dist

    from lightning_par.parallel import context_parallel as cp

    _process_group(device)
    fig["process_group_backend"] = dist.get_backend()
    ctx = cp.ContextParallel(group=dist.group.WORLD, size=1, rank=0, positions=cp.shard_positions(T, 1, 0, device))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grad_out = torch.randn_like(q)
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    ref.backward(grad_out)
    ref_grads = [t.grad.clone() for t in leaves]
    for t in leaves:
        t.grad = None
    out = cp.sequence_attention(*leaves, is_causal=True, enable_gqa=True, context=ctx)
    out.backward(grad_out)
    fig["cp_seconds"] = timed(lambda: cp.sequence_attention(q, k, v, is_causal=True, enable_gqa=True, context=ctx))

    def rel(x, y) -> float:
        return float((x.float() - y.float()).norm() / y.float().norm())

    fig["cp_rel_diff_out"] = rel(out, ref)
    fig["cp_rel_diff_grads"] = max(rel(t.grad, r) for t, r in zip(leaves, ref_grads, strict=True))
    fig["cp_over_sdpa_time"] = fig["cp_seconds"] / fig["sdpa_default_seconds"]
    # the bf16 kernels of the two paths differ (a boolean mask vs is_causal): bf16 rounding, not an error
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    fig["cp_tolerance"] = tol
    if not (fig["cp_rel_diff_out"] < tol and fig["cp_rel_diff_grads"] < tol):
        raise AssertionError(f"context-parallel attention off plain SDPA: out {fig['cp_rel_diff_out']:.2e}, grads "
                             f"{fig['cp_rel_diff_grads']:.2e} (tolerance {tol})")


# ----------------------------------------------------------------------------------------------------------------------
# Stage 2: plain PyTorch loop vs Lightning + ZeroStrategy(stage=0), eager and compiled
# ----------------------------------------------------------------------------------------------------------------------
def _plain_loop(args, p: dict, device, compiled: bool) -> dict:
    """The same model, optimizer, data and precision as the Lightning run, in a bare loop."""
    import torch

    from lightning_par.examples.gpt import GPT, causal_lm_loss

    lm = _lightning_module(p)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = GPT(lm.config)
    if compiled:
        opts = p["compile"] if isinstance(p["compile"], dict) else {}
        for block in model.layers.values():
            block.compile(**opts, dynamic=False)  # what the strategy's compile does: each block in place
    hp = lm.hparams
    params = [q for q in model.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW([{"params": [q for q in params if q.dim() >= 2], "weight_decay": hp.weight_decay},
                                   {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}],
                                  lr=hp.lr, betas=tuple(hp.betas))
    n = p["warmup"] + p["steps"]
    losses, start = [], None
    for i, (inputs, targets) in enumerate(_loader(p, n)):
        if i == p["warmup"]:
            _sync(device)
            start = time.perf_counter()
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = causal_lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    _sync(device)
    step_s = (time.perf_counter() - start) / p["steps"]
    return {"step_s": step_s, "losses": [float(v) for v in losses]}


def _lightning_loop(args, p: dict, device, compiled: bool) -> dict:
    import lightning.pytorch as pl

    from lightning_par import ZeroStrategy

    pl.seed_everything(SEED, verbose=False)
    lm = _lightning_module(p, warmup_steps=0, min_lr_ratio=1.0)  # a constant lr, as the plain loop's
    n = p["warmup"] + p["steps"]
    rec = _Recorder(device, p["warmup"])
    trainer = _trainer(args, p, ZeroStrategy(stage=0, compile=p["compile"] if compiled else False), n, [rec],
                       precision="bf16-mixed" if device.type == "cuda" else "32-true")
    trainer.fit(lm, _loader(p, n))
    return {"step_s": rec.step_s, "losses": rec.loss_values()}


def stage_lightning(args, p: dict, device, fig: dict) -> None:
    import torch

    from lightning_par.utilization import model_flops_per_token, peak_flops

    precision = "bf16-mixed" if device.type == "cuda" else "32-true"
    lm = _lightning_module(p)
    n_params = lm.config.num_params()
    tokens = p["batch"] * p["seq"]
    flops_per_token, how = model_flops_per_token(lm, n_params, p["seq"])
    peak = peak_flops(device, precision, world_size=1, local_ranks=1, num_nodes=1)
    fig.update(params=n_params, batch=p["batch"], seq=p["seq"], tokens_per_step=tokens, precision=precision,
               flops_per_token=flops_per_token, flops_counted_by=how,
               peak_flops=peak.flops if peak else None, peak_source=peak.source if peak else None,
               warmup_steps=p["warmup"], timed_steps=p["steps"], compile=p["compile"])
    errors = []
    for mode in ("eager", "compiled"):
        for runner, who in ((_plain_loop, "plain"), (_lightning_loop, "lightning")):
            key = f"{who}_{mode}"
            _free(device)
            torch._dynamo.reset()
            _reset_peak(device)
            try:
                row = runner(args, p, device, mode == "compiled")
            except Exception as err:  # noqa: BLE001 -- one variant failing keeps the others' figures
                traceback.print_exc()
                errors.append(f"{key}: {_last_line(err)}")
                fig[key] = {"error": errors[-1]}
                continue
            row["tokens_per_s"] = tokens / row["step_s"]
            row["mfu"] = row["tokens_per_s"] * flops_per_token / peak.flops if peak else None
            row.update(_peak(device), first_loss=row["losses"][0], last_loss=row["losses"][-1])
            fig[key] = row
        plain, light = fig.get(f"plain_{mode}", {}), fig.get(f"lightning_{mode}", {})
        if "tokens_per_s" in plain and "tokens_per_s" in light:
            fig[f"lightning_over_plain_{mode}"] = light["tokens_per_s"] / plain["tokens_per_s"]
            fig[f"first_loss_diff_{mode}"] = abs(light["first_loss"] - plain["first_loss"])
    if errors:
        raise RuntimeError("; ".join(errors))


# ----------------------------------------------------------------------------------------------------------------------
# Stage 3: ZeRO-1/2/3 and bf16-mixed-master at dp=1; deferred init at ZeRO-3
# ----------------------------------------------------------------------------------------------------------------------
class _DeferredCheck:
    """Lightning callback: the memory peak from setup to fit start, then the built model against an eager build
    with the same seed on the same device."""

    def __new__(cls, *args, **kwargs):
        import lightning.pytorch as pl

        klass = type("DeferredCheck", (cls, pl.Callback), {"__new__": object.__new__})
        return object.__new__(klass)

    def __init__(self, device, out: dict) -> None:
        self.device, self.out = device, out

    def setup(self, trainer, pl_module, stage) -> None:  # before configure_model and the strategy's setup
        _reset_peak(self.device)
        self.base = _current_bytes(self.device)
        if self.device.type == "cuda":  # the allocator's events, to name what is alive at the peak
            from lightning_par import _compat

            _compat.cuda_record_memory_history(max_entries=200_000)

    def on_fit_start(self, trainer, pl_module) -> None:
        import torch

        from lightning_par.examples.gpt import GPT

        peak = _peak(self.device)
        peak_bytes = next(iter(peak.values()))
        state = pl_module.model.state_dict()
        sizes = [_whole(t).numel() * _whole(t).element_size() for t in state.values()]
        self.out.update(setup_peak_bytes=peak_bytes - self.base, setup_peak=peak, model_bytes=sum(sizes),
                        largest_tensor_bytes=max(sizes), materialized=dict(trainer.strategy.materialized))
        # the bound: the model, one full tensor being computed, and the tensors small enough to be built eagerly
        # (below the deferral threshold: model bytes - materialised bytes), which the construction record still
        # holds while FSDP2 keeps its own copy of them (seen on an H200: exactly these at the peak)
        eager_small = sum(sizes) - self.out["materialized"].get("kept_bytes", sum(sizes))
        bound = sum(sizes) + max(sizes) + max(eager_small, 0)
        self.out.update(setup_peak_bound_bytes=bound, eager_small_bytes=eager_small)
        self.out["setup_peak_within_bound"] = self.out["setup_peak_bytes"] <= bound
        if self.device.type == "cuda":
            # the allocator's peak counted 1 MiB that its event trace does not show (H200, torch 2.11: every
            # allocation of the trace at its peak is named below); the bound is asserted on the trace's peak
            alive = self.out["alive_at_setup_peak"] = _alive_at_peak(state.values())
            self.out["outside_trace_bytes"] = self.out["setup_peak_bytes"] - alive["peak_bytes_since_setup"]
            self.out["setup_peak_within_bound"] = alive["peak_bytes_since_setup"] <= bound
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(SEED)
            with torch.device(self.device):
                eager = GPT(pl_module.config).state_dict()
        mismatched, worst = [], 0.0
        for name, tensor in state.items():
            mine = _whole(tensor)
            if mine.dtype != eager[name].dtype or not torch.equal(mine, eager[name]):
                mismatched.append(name)
                worst = max(worst, float((mine.float() - eager[name].float()).abs().max()))
        self.out.update(deferred_tensors=len(state), deferred_mismatched=len(mismatched),
                        deferred_first_mismatched=mismatched[:3], deferred_max_abs_diff=worst)
        del eager


def _alive_at_peak(model_tensors) -> dict:
    """Replay the CUDA allocator's events since recording began: the allocations alive at the largest total that
    are not the model's own tensors, largest first, each with the innermost Python frames that made it."""
    from lightning_par import _compat

    snapshot = _compat.cuda_memory_snapshot()
    _compat.cuda_record_memory_history(enabled=None)
    own = {_whole_ptr(t) for t in model_tensors}
    live, total, best, best_live = {}, 0, -1, {}
    for event in (snapshot.get("device_traces") or [[]])[0]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] in ("free_requested", "free_completed") and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]  # counted free at the request, as memory_allocated does
        if total > best:
            best, best_live = total, dict(live)
    others = sorted((e for addr, e in best_live.items() if addr not in own), key=lambda e: -e["size"])

    def where(event) -> list[str]:
        frames = [f for f in event.get("frames", []) if f.get("filename", "").endswith(".py")]
        return [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames[:4]]

    return {"peak_bytes_since_setup": best, "others_bytes": sum(e["size"] for e in others),
            "others": [{"bytes": e["size"], "frames": where(e)} for e in others[:8]]}


def _whole_ptr(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.untyped_storage().data_ptr()


def _current_bytes(device) -> int:
    import torch

    return torch.cuda.memory_allocated(device) if device.type == "cuda" else _status_bytes("VmRSS")


def stage_zero(args, p: dict, device, fig: dict) -> None:
    import lightning.pytorch as pl

    from lightning_par import ZeroStrategy
    from lightning_par.plugins.precision import LayoutPrecision

    mixed = "bf16-mixed" if device.type == "cuda" else "32-true"
    runs = [(f"zero{s}", s, mixed) for s in (1, 2, 3)] + [(f"master_zero{s}", s, "bf16-mixed-master")
                                                          for s in (1, 2, 3)]
    n = 1 + p["few"]
    errors, deferred = [], {}
    for key, stage, precision in runs:
        _free(device)
        pl.seed_everything(SEED, verbose=False)
        rec = _Recorder(device, 1)
        callbacks = [rec] + ([_DeferredCheck(device, deferred)] if key == "zero3" else [])
        # Lightning's Trainer takes only its own precision flags: bf16-mixed-master goes in as the plugin
        flags = dict(plugins=[LayoutPrecision(precision)]) if precision == "bf16-mixed-master" else dict(
            precision=precision)
        try:
            trainer = _trainer(args, p, ZeroStrategy(stage=stage), n, callbacks, **flags)
            trainer.fit(_lightning_module(p), _loader(p, n))
            losses = rec.loss_values()
            fig[key] = {"precision": precision, "losses": losses, "step_s": rec.step_s,
                        "finite": all(math.isfinite(v) for v in losses), **_peak(device)}
        except Exception as err:  # noqa: BLE001 -- one stage failing keeps the others' figures
            traceback.print_exc()
            errors.append(f"{key}: {_last_line(err)}")
            fig[key] = {"error": errors[-1]}
    fig["deferred_init"] = deferred
    base = fig.get("zero1", {}).get("losses")
    for key, *_ in runs:  # every run starts from the same weights and data: the first loss agrees
        if base and "losses" in fig[key]:
            fig[key]["first_loss_diff_vs_zero1"] = abs(fig[key]["losses"][0] - base[0])
    if deferred:
        if deferred["deferred_mismatched"]:
            errors.append(f"deferred init: {deferred['deferred_mismatched']} of {deferred['deferred_tensors']} "
                          f"tensors differ from an eager build (max {deferred['deferred_max_abs_diff']:.3g})")
        if device.type == "cuda" and not deferred["setup_peak_within_bound"]:
            errors.append(f"deferred init: peak {deferred['setup_peak_bytes']} B from setup to fit start > model "
                          f"{deferred['model_bytes']} B + largest tensor {deferred['largest_tensor_bytes']} B + "
                          f"eagerly built tensors {deferred['eager_small_bytes']} B")
    if errors:
        raise RuntimeError("; ".join(errors))


# ----------------------------------------------------------------------------------------------------------------------
# Stage 4: optimizer offload against none, plain SGD, clipped
# ----------------------------------------------------------------------------------------------------------------------
def stage_offload(args, p: dict, device, fig: dict) -> None:
    import lightning.pytorch as pl

    from lightning_par import ZeroStrategy

    n, clip = p["few"], 0.5
    runs = {"zero1": dict(stage=1), "zero1_offload": dict(stage=1, offload_optimizer=True),
            "zero2": dict(stage=2), "zero2_offload": dict(stage=2, offload_optimizer=True),
            "zero3": dict(stage=3), "zero3_offload": dict(stage=3, offload_optimizer=True, offload_parameters=True)}
    params, errors = {}, []
    fig.update(steps=n, gradient_clip_val=clip, precision="32-true", optimizer="sgd", tolerance=OFFLOAD_TOL)
    for key, kw in runs.items():
        _free(device)
        pl.seed_everything(SEED, verbose=False)
        rec = _Recorder(device, 0, keep_params=True)
        try:
            trainer = _trainer(args, p, ZeroStrategy(**kw), n, [rec], precision="32-true", gradient_clip_val=clip)
            trainer.fit(_lightning_module(p, optimizer="sgd", lr=0.2), _loader(p, n))
        except Exception as err:  # noqa: BLE001 -- one layout failing keeps the others' figures
            traceback.print_exc()
            errors.append(f"{key}: {_last_line(err)}")
        # parameters taken at the end of training still compare when teardown failed after it
        if rec.params is not None:
            params[key] = rec.params
        fig[key] = {"losses": rec.loss_values(), "trained": rec.params is not None}
        if errors and errors[-1].startswith(f"{key}: "):
            fig[key]["error"] = errors[-1]
    for stage in (1, 2, 3):
        a, b = params.get(f"zero{stage}"), params.get(f"zero{stage}_offload")
        if a is not None and b is not None:
            diff = max(float((a[k] - b[k]).abs().max()) for k in a)
            fig[f"zero{stage}_offload_max_abs_diff"] = diff
            # the same fp32 arithmetic on host and device, up to an FMA's rounding (~1e-9 at these weights); a
            # gradient copied before it landed, or clipped by another norm, moves weights by ~lr x grad (1e-4+)
            if diff > OFFLOAD_TOL:
                errors.append(f"zero{stage} offload differs from no offload by {diff:.3g} (> {OFFLOAD_TOL})")
    if "zero1" in params:  # the steps moved the weights (a diff of 0 between two frozen models proves nothing)
        fig["sgd_moved_loss"] = fig["zero1"]["losses"][0] - fig["zero1"]["losses"][-1]
    if errors:
        raise RuntimeError("; ".join(errors))


# ----------------------------------------------------------------------------------------------------------------------
# Stage 5: how long a save blocks training, synchronous and asynchronous
# ----------------------------------------------------------------------------------------------------------------------
def _stall(mode: str, p: dict, device, root: Path) -> dict:
    """Train the preset GPT (AdamW, bf16 autocast on CUDA) and save once through the strategy's own save paths
    (``sharded_checkpoint.save`` / ``AsyncSaver.save``); the stall is the save step and the ``after`` steps following
    it beyond the median step before it."""
    import torch
    import torch.distributed as dist

    from lightning_par.examples.gpt import GPT, causal_lm_loss
    from lightning_par.plugins import sharded_checkpoint
    from lightning_par.plugins.async_checkpoint import AsyncSaver

    warmup, before, after = p["ckpt_steps"]
    torch.manual_seed(SEED)
    with torch.device(device):
        model = GPT(_lightning_module(p).config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    saver = AsyncSaver(is_writer=True, barrier=dist.barrier) if mode == "async" else None
    path = root / f"{mode}.ckpt"
    times, blocking, committed_after = [], None, None
    loader = iter(_loader(p, warmup + before + 1 + after))
    for step in range(warmup + before + 1 + after):
        inputs, targets = (t.to(device) for t in next(loader))
        _sync(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = causal_lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step == warmup + before:
            _sync(device)  # the step's own work done: what follows is the save's
            begin = time.perf_counter()
            checkpoint = {"state_dict": sharded_checkpoint.model_state(model),
                          "optimizer_states": [sharded_checkpoint.optimizer_state(model, optimizer)],
                          "global_step": step, "epoch": 0}
            if saver is None:
                sharded_checkpoint.save(checkpoint, path, True, dist.barrier)
            else:
                saver.save(checkpoint, path)
            del checkpoint
            blocking = time.perf_counter() - begin
        _sync(device)
        times.append(time.perf_counter() - start)
        if committed_after is None and blocking is not None and path.exists():
            committed_after = step - (warmup + before)
    wait = time.perf_counter()
    if saver is not None:
        saver.wait()
    waited = time.perf_counter() - wait
    baseline = statistics.median(times[warmup:warmup + before])
    stall = sum(t - baseline for t in times[warmup + before:])
    saved = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return {"baseline_step_s": baseline, "step_times_s": times, "blocking_s": blocking, "stall_s": stall,
            "committed_after_steps": committed_after, "waited_at_end_s": waited, "bytes_saved": saved}


def stage_checkpoint(args, p: dict, device, fig: dict) -> None:
    _process_group(device)
    with tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as tmp:
        for mode in ("sync", "async"):
            _free(device)
            fig[mode] = _stall(mode, p, device, Path(tmp))
    fig["async_over_sync_blocking"] = fig["async"]["blocking_s"] / fig["sync"]["blocking_s"]
    fig["async_over_sync_stall"] = fig["async"]["stall_s"] / fig["sync"]["stall_s"]


# ----------------------------------------------------------------------------------------------------------------------
# Stage 6: the planner's predicted step beside the measured ones
# ----------------------------------------------------------------------------------------------------------------------
def stage_planner(args, p: dict, device, fig: dict) -> None:
    from lightning_par.examples import GPTLightningModule
    from lightning_par.planner import Candidate, Planner, Workload, build_model, inspect_model, load_hardware
    from lightning_par.utilization import gpu_preset

    measured = _measured_steps(args)
    if not measured:
        raise RuntimeError(f"no measured step of run {args.run_id} in {args.out}: run the lightning or zero stage "
                           "in the same invocation")
    if device.type == "cuda":
        import torch

        hardware = gpu_preset(torch.cuda.get_device_name(device))
        if hardware is None:
            raise RuntimeError(f"the planner has no preset for {torch.cuda.get_device_name(device)}")
    else:
        hardware = "cpu"
    info = inspect_model(build_model(GPTLightningModule, {"preset": p["gpt"]}))
    planner = Planner(info, load_hardware(hardware), Workload(p["batch"], p["seq"], p["batch"]))
    fig.update(hardware=hardware, rows={})
    for name, (zero, precision, step_s) in measured.items():
        est = planner.estimate(Candidate(1, 1, 1, zero, precision=precision))
        fig["rows"][name] = {"zero_stage": zero, "precision": precision, "measured_step_s": step_s,
                             "predicted_step_s": est.step_time, "predicted_over_measured": est.step_time / step_s}


def _measured_steps(args) -> dict[str, tuple[int, str, float]]:
    """This run's measured steps: name -> (ZeRO stage, the planner's precision name, seconds per step)."""
    out = Path(args.out)
    lines = [json.loads(line) for line in out.read_text().splitlines() if line.strip()] if out.exists() else []
    found: dict[str, tuple[int, str, float]] = {}
    for line in lines:
        if line.get("run_id") != args.run_id:
            continue
        fig = line.get("figures", {})
        if line["stage"] == "lightning":
            precision = "fp32" if fig.get("precision") == "32-true" else fig.get("precision")
            for mode in ("eager", "compiled"):
                if "step_s" in fig.get(f"lightning_{mode}", {}):
                    found[f"zero0_{mode}"] = (0, precision, fig[f"lightning_{mode}"]["step_s"])
        if line["stage"] == "zero":
            for key in ("zero1", "zero2", "zero3", "master_zero1", "master_zero2", "master_zero3"):
                row = fig.get(key, {})
                if "step_s" in row:
                    precision = "fp32" if row["precision"] == "32-true" else row["precision"]
                    found[key] = (int(key[-1]), precision, row["step_s"])
    return found


# ----------------------------------------------------------------------------------------------------------------------
# The runner: each stage a child process, one JSON line each
# ----------------------------------------------------------------------------------------------------------------------
def _last_line(err: BaseException) -> str:
    """The error's last line; an error raised while handling another (Lightning's teardown after a failed fit)
    names the first one, which is the cause."""
    def line(e: BaseException) -> str:
        text = f"{type(e).__name__}: {e}".strip()
        return text.splitlines()[-1][:300]

    first = err
    while first.__context__ is not None and first.__context__ is not first:
        first = first.__context__
    return line(err) if first is err else f"{line(first)} (then {line(err)})"


def child(args) -> None:
    """Run one stage here; print its result as the last line of stdout."""
    import torch

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # the planner's cpu preset is one thread per rank; and CI's 2 cores are shared
    import lightning_par  # noqa: F401 -- registers the strategies; fails here first if the import is broken

    p = PRESETS[args.preset]
    fig: dict = {}
    result = {"ok": True, "error": None}
    try:
        globals()[f"stage_{args.stage}"](args, p, device, fig)
    except BaseException as err:  # noqa: BLE001 -- the stage's error is its result
        traceback.print_exc()
        result = {"ok": False, "error": _last_line(err)}
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    print("GPU_CHECK_RESULT " + json.dumps({**result, "figures": fig}, default=str), flush=True)


def run_stage(args, stage: str, timeout: float) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", stage, "--device", args.device,
           "--preset", args.preset, "--out", args.out, "--run-id", args.run_id]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    start = time.perf_counter()
    # its own process group, so a timeout also ends what it started (inductor's compile workers)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        code = "timeout"
    seconds = time.perf_counter() - start
    marked = [ln for ln in output.splitlines() if ln.startswith("GPU_CHECK_RESULT ")]
    if marked:
        result = json.loads(marked[-1].removeprefix("GPU_CHECK_RESULT "))
    else:
        tail = [ln for ln in output.splitlines() if ln.strip()]
        why = f"timed out after {timeout:.0f} s" if code == "timeout" else f"exit code {code}"
        result = {"ok": False, "error": f"{why}: {tail[-1][:400] if tail else 'no output'}", "figures": {}}
    if args.log_dir:
        Path(args.log_dir, f"gpu_check_{stage}.log").write_text(output)
    return {"stage": stage, "ok": result["ok"], "error": result["error"], "seconds": round(seconds, 2),
            "figures": result["figures"], "run_id": args.run_id, "device": args.device, "preset": args.preset}


def _summary(line: dict) -> str:
    f = line["figures"]
    keys = {"env": ["device_name", "bf16_matmul_tflops", "sdpa_default_ops", "cp_rel_diff_out"],
            "lightning": ["lightning_over_plain_eager", "lightning_over_plain_compiled"],
            "zero": [], "offload": [f"zero{s}_offload_max_abs_diff" for s in (1, 2, 3)],
            "checkpoint": ["async_over_sync_blocking"], "planner": []}[line["stage"]]
    parts = [f"{k}={f[k]:.3g}" if isinstance(f.get(k), float) else f"{k}={f.get(k)}" for k in keys if k in f]
    if line["stage"] == "lightning":
        parts += [f"mfu_{m}={f[f'lightning_{m}'].get('mfu'):.3g}" for m in ("eager", "compiled")
                  if isinstance(f.get(f"lightning_{m}", {}).get("mfu"), float)]
    if line["stage"] == "planner":
        parts += [f"{k}:{r['predicted_over_measured']:.2f}" for k, r in f.get("rows", {}).items()]
    status = "ok" if line["ok"] else f"FAILED ({line['error']})"
    return f"{line['stage']:<11}{line['seconds']:>7.1f} s  {status}  {' '.join(parts)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="1b")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_check.jsonl"))
    parser.add_argument("--timeout", action="append", default=[], metavar="STAGE=SECONDS",
                        help="a stage's time limit (repeatable); the preset's by default")
    parser.add_argument("--log-dir", default=None, help="write each stage's full output here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        args.stage = args.child
        child(args)
        return 0
    stages = [s for s in args.stages.split(",") if s]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        parser.error(f"unknown stage(s) {unknown}; stages: {', '.join(STAGES)}")
    timeouts = dict(PRESETS[args.preset]["timeouts"])
    for item in args.timeout:
        name, _, seconds = item.partition("=")
        if name not in STAGES or not seconds:
            parser.error(f"--timeout wants STAGE=SECONDS, got {item!r}")
        timeouts[name] = float(seconds)
    args.run_id = uuid.uuid4().hex[:12]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    start, failed = time.perf_counter(), 0
    for stage in stages:
        line = run_stage(args, stage, timeouts[stage])
        with open(args.out, "a") as f:
            f.write(json.dumps(line, default=str) + "\n")
        failed += not line["ok"]
        print(_summary(line), flush=True)
    print(f"{len(stages) - failed} of {len(stages)} stages ok in {time.perf_counter() - start:.0f} s; "
          f"lines appended to {args.out} (run {args.run_id})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
