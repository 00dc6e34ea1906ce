"""What a run's logs need to say how well it uses the hardware: model FLOPs per token, peak FLOP/s, parameter counts.

- :func:`model_flops_per_token`: forward + backward FLOPs of the whole model for one token, from the planner's count
  (:func:`lightning_par.planner.trace.trace_model`: the model rebuilt on the meta device and run on fake tensors,
  every matmul and attention op counted), else ``6 x parameters + 12 x layers x hidden x sequence`` (the usual
  estimate: a multiply-add per parameter forward, two backward, plus the attention scores and their product with
  the values). "Model FLOPs": recompute is not counted, and attention counts the full score matrix. A mixture of
  experts counts its ACTIVE parameters (:func:`active_parameter_count`: the ``top_k`` experts a token uses, not all).
- :func:`peak_flops`: FLOP/s of all devices of the job: on a GPU the datasheet's dense peak for its name and dtype
  (:data:`lightning_par.planner.hardware.GPUS`; fp32 at the TF32 peak when TF32 is on); on a CPU one core's matmul
  rate, measured once per machine and kept (:func:`cpu_core_peak`), times the cores in use.
- :func:`parameter_counts`: the whole model's parameter count and this rank's share, on any layout.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.topology import LayoutError

_LAYER_NAMES = ("num_hidden_layers", "n_layers", "n_layer", "num_layers")
_HIDDEN_NAMES = ("hidden_size", "dim", "n_embd", "d_model")


def _hf_model(module: nn.Module) -> nn.Module | None:
    """The outermost Hugging Face ``PreTrainedModel`` inside ``module`` (None without ``transformers``)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return None
    return next((m for m in module.modules() if isinstance(m, transformers.PreTrainedModel)), None)


def _planner_model(module: nn.Module) -> nn.Module:
    """The model rebuilt on the meta device as the planner builds it: a Hugging Face model from its config, else the
    module's class called with its saved hyperparameters (``save_hyperparameters()``)."""
    from lightning_par.planner.model import _SkipInitOnMeta, build_model

    hf = _hf_model(module)
    if hf is not None:
        with torch.device("meta"), _SkipInitOnMeta():
            return type(hf)(hf.config)
    hparams = getattr(module, "hparams", None)
    if hparams is None:
        raise ValueError(f"{type(module).__name__} saves no hyperparameters to be rebuilt from")
    # LightningCLI adds `_class_path` (and `_instantiator`) to the saved hyperparameters: not init arguments
    return build_model(type(module), {k: v for k, v in dict(hparams).items() if not k.startswith("_")})


def planner_flops_per_token(module: nn.Module, seq_len: int) -> tuple[float, str]:
    """Forward + backward FLOPs per token of ``module``'s whole model at sequence length ``seq_len``, from the
    planner's trace; raises when the planner cannot describe the model."""
    from lightning_par.planner.model import inspect_model
    from lightning_par.planner.trace import trace_model

    info = inspect_model(_planner_model(module))
    trace = trace_model(info, micro_batch=1, seq_len=seq_len)
    forward = sum(t.forward.total_flops for t in trace.units.values()) + trace.loss.forward.total_flops
    backward = sum(t.backward.total_flops for t in trace.units.values()) + trace.loss.backward.total_flops
    return (forward + backward) / seq_len, f"the planner's count ({info.description})"


def active_parameter_count(module: nn.Module, n_params: int) -> tuple[int, str] | None:
    """The parameters one token uses in a mixture-of-experts ``module`` of ``n_params`` parameters, and how they were
    counted; None for a dense model. From the model's config when it says (``config.active_params()``, the example
    :class:`~lightning_par.examples.moe.MoEConfig`), else ``n_params`` less the unused share ``1 - top_k / E`` of
    each mixture-of-experts layer's stacked expert weights, the layers found as the planner finds them
    (:func:`~lightning_par.parallel.expert_parallel.moe_layers`: declared, or a Hugging Face model's ep plan; on a
    pipeline, the stages this rank holds)."""
    for holder in (module, *module.modules()):
        count = getattr(getattr(holder, "config", None), "active_params", None)
        if callable(count):
            return int(count()), "the config's active_params()"
    from lightning_par.parallel.expert_parallel import moe_layers

    try:
        layers = moe_layers(module)
    except LayoutError:  # (an ep plan expert parallel cannot apply: the MFU then counts every parameter)
        return None
    unused = sum(sum(module.get_submodule(name).get_parameter(p).numel() for p in layer.parameters)
                 * (1 - layer.top_k / layer.num_experts) for name, layer in layers.items())
    return (n_params - round(unused), "the routers' top_k of their experts") if unused else None


def estimated_flops_per_token(module: nn.Module, n_params: int, seq_len: int,
                              what: str = "parameters") -> tuple[float, str]:
    """``6 N + 12 L d s``: the estimate for a model the planner cannot describe, or a mixture of experts with ``N``
    its active parameters (``what`` says which, for the description; attention left out where the number of layers
    ``L`` or the hidden size ``d`` cannot be read from the model or its ``config``)."""
    from lightning_par.planner.model import _config_value

    holder = _hf_model(module) or module
    layers = hidden = None
    for m in (holder, *holder.children()):
        layers = layers or _config_value(m, _LAYER_NAMES)
        hidden = hidden or _config_value(m, _HIDDEN_NAMES)
    if layers and hidden:
        return 6.0 * n_params + 12.0 * layers * hidden * seq_len, \
            f"6 x {n_params:,} {what} + attention (12 x {layers} layers x {hidden} x {seq_len} tokens)"
    return 6.0 * n_params, f"6 x {n_params:,} {what} (attention not counted: no layer count or hidden size found)"


def model_flops_per_token(module: nn.Module, n_params: int, seq_len: int) -> tuple[float, str]:
    """Forward + backward FLOPs per token of the whole model and how they were counted: for a mixture of experts
    :func:`estimated_flops_per_token` of its active parameters (:func:`active_parameter_count`: the planner's trace
    does not route tokens), else the planner's count, else :func:`estimated_flops_per_token` (the reason said in
    the description)."""
    active = active_parameter_count(module, n_params)
    if active is not None:
        count, how = active
        return estimated_flops_per_token(module, count, seq_len, f"active parameters of {n_params:,} ({how})")
    try:
        return planner_flops_per_token(module, seq_len)
    except Exception as err:  # noqa: BLE001 -- any model the planner cannot rebuild or trace falls back alike
        flops, how = estimated_flops_per_token(module, n_params, seq_len)
        return flops, f"{how}; the planner could not describe {type(module).__name__}: {str(err).rstrip('.')}"


# ----------------------------------------------------------------------------------------------------------------------
# Peak FLOP/s of the devices in use
# ----------------------------------------------------------------------------------------------------------------------
def compute_dtype(precision: str) -> torch.dtype:
    """The dtype matmuls run in under a Lightning precision string (``"32-true"``, ``"bf16-mixed"``...)."""
    text = str(precision)
    if "bf16" in text:
        return torch.bfloat16
    if text.startswith("16"):
        return torch.float16
    return torch.float32


def measure_matmul_flops(dtype: torch.dtype = torch.float32, budget_s: float = 0.2) -> float:
    """FLOP/s of square matmuls in ``dtype`` on this process's CPU threads: sizes 256, 512, 1024 (the largest the
    time budget allows), the best rate."""
    n, best = 256, 0.0
    while True:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        a @ b  # warm-up
        start, reps = time.perf_counter(), 0
        while reps < 2 or time.perf_counter() - start < budget_s / 4:
            a @ b
            reps += 1
        rate = 2.0 * n**3 * reps / (time.perf_counter() - start)
        best = max(best, rate)
        if n >= 1024 or 2.0 * (2 * n) ** 3 * 2 / rate > budget_s / 2:
            return best
        n *= 2


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


#: environment variable naming the file that keeps the CPU peaks (default ``~/.cache/lightning_par/cpu_peak.json``)
CPU_PEAK_FILE = "LIGHTNING_PAR_CPU_PEAK_FILE"


def cpu_peak_file() -> Path:
    """Where :func:`cpu_core_peak` keeps its measurements: ``$LIGHTNING_PAR_CPU_PEAK_FILE``, else
    ``$XDG_CACHE_HOME/lightning_par/cpu_peak.json`` (``~/.cache`` without it)."""
    if os.environ.get(CPU_PEAK_FILE):
        return Path(os.environ[CPU_PEAK_FILE]).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "lightning_par" / "cpu_peak.json"


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform module says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def cpu_core_peak(dtype: torch.dtype = torch.float32) -> tuple[float, str]:
    """``(FLOP/s, source)``: one core's matmul rate in ``dtype`` on this machine's CPU model.

    Measured once (:func:`measure_matmul_flops` on one thread, a 1 s budget) and kept in :func:`cpu_peak_file`,
    keyed by CPU model and dtype: every later launch divides by the same figure, so the MFU of two runs compares
    (a rate measured at each launch varied 76-206 GFLOP/s on a shared 2-core machine). Delete the file to measure
    again; ``TokensPerSecond(peak_flops=...)`` sets a figure of one's own.
    """
    path = cpu_peak_file()
    key = f"{cpu_name()} / {str(dtype).removeprefix('torch.')}"
    try:
        kept = json.loads(path.read_text())
    except (OSError, ValueError):
        kept = {}
    entry = kept.get(key) if isinstance(kept, dict) else None
    if isinstance(entry, dict) and isinstance(entry.get("flops_per_core"), int | float):
        return float(entry["flops_per_core"]), f"measured {entry.get('measured', '')}, kept in {path}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rate = measure_matmul_flops(dtype, budget_s=1.0)
    finally:
        torch.set_num_threads(threads)
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    kept = kept if isinstance(kept, dict) else {}
    kept[key] = {"flops_per_core": rate, "measured": f"{when} with torch {torch.__version__}"}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        scratch.write_text(json.dumps(kept, indent=1))
        os.replace(scratch, path)  # whole or not at all: another launch may read it now
    except OSError as error:
        return rate, f"measured now (not kept: {error})"
    return rate, f"measured now, kept in {path}"


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s of all devices of a job, and where the figure comes from."""

    flops: float
    source: str


def gpu_preset(device_name: str) -> str | None:
    """The planner's hardware preset for a CUDA device name (the nearest one, see
    :data:`lightning_par.planner.hardware.GPUS`), or None for a device the table does not hold."""
    from lightning_par.planner.hardware import detect_gpu

    spec = detect_gpu(device_name)
    return None if spec is None else spec.preset


def tf32_matmuls() -> bool:
    """Whether float32 matmuls on CUDA run on TF32 tensor cores: ``torch.set_float32_matmul_precision("high")`` or
    ``"medium"`` (Lightning suggests it), ``torch.backends.cuda.matmul.allow_tf32``, or the newer
    ``torch.backends.cuda.matmul.fp32_precision = "tf32"``."""
    matmul = torch.backends.cuda.matmul
    # torch raises on reading one API's setting after the other API set it ("a mix of the legacy and new APIs"):
    # each reading is tried on its own, and any that says TF32 counts
    readings = (lambda: getattr(matmul, "fp32_precision", None) == "tf32",
                lambda: torch.get_float32_matmul_precision() in ("high", "medium"),
                lambda: bool(matmul.allow_tf32))
    for reading in readings:
        try:
            if reading():
                return True
        except RuntimeError:
            continue
    return False


def matmul_peak_key(dtype: torch.dtype) -> str:
    """The :data:`~lightning_par.planner.hardware.GPUS` peak that matmuls in ``dtype`` run at on CUDA now."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "tf32" if tf32_matmuls() else "fp32"


def peak_flops(device: torch.device, precision: str, world_size: int, local_ranks: int, num_nodes: int,
               per_device: float | None = None) -> Peak | None:
    """Peak FLOP/s of the job's devices for matmuls in the precision's dtype.

    ``per_device`` given: that times ``world_size``. A GPU: its dense peak from
    :data:`lightning_par.planner.hardware.GPUS`, looked up by ``torch.cuda.get_device_name``, for bf16 or fp16, and
    for fp32 the TF32 peak when TF32 is on (:func:`tf32_matmuls`, read now), else the plain fp32 one, times
    ``world_size``; None for a GPU the table does not hold. A CPU: one core's rate (:func:`cpu_core_peak`: measured
    once per machine and kept), times the cores the job's ranks can use on a node (``min(cores, local_ranks x
    threads)``) times ``num_nodes``.
    """
    if per_device is not None:
        return Peak(per_device * world_size, f"{per_device:.3g} FLOP/s per device given x {world_size}")
    dtype = compute_dtype(precision)
    if device.type == "cuda":
        from lightning_par.planner.hardware import detect_gpu

        device_name = torch.cuda.get_device_name(device)
        spec = detect_gpu(device_name)
        if spec is None:
            return None
        key = matmul_peak_key(dtype)
        each = spec.peak_flops[key]
        why = {"tf32": ", fp32 matmuls with TF32 on", "fp32": ", TF32 off"}.get(key, "")
        return Peak(each * world_size, f"{device_name} ({spec.name}): {each / 1e12:.4g} TFLOP/s dense {key}{why}, "
                                       f"NVIDIA's datasheet x {world_size}")
    if device.type != "cpu":
        return None
    per_core, source = cpu_core_peak(dtype)
    cores = min(usable_cores(), local_ranks * torch.get_num_threads())
    return Peak(per_core * cores * num_nodes,
                f"{cpu_name()}: {per_core / 1e9:.1f} GFLOP/s per core ({str(dtype)[6:]} matmul, one thread; {source})"
                f" x {cores} cores{f' x {num_nodes} nodes' if num_nodes > 1 else ''}")


# ----------------------------------------------------------------------------------------------------------------------
# Parameter counts on any layout
# ----------------------------------------------------------------------------------------------------------------------
def _local_numel(p: torch.Tensor) -> int:
    to_local = getattr(p, "to_local", None)  # a DTensor: this rank's shard
    return to_local().numel() if callable(to_local) else p.numel()


@dataclass(frozen=True)
class ParameterCounts:
    """``whole``: the whole model's parameters (a tied weight once); ``here``: those this rank holds (its pipeline
    stages, tensor-parallel slices, ZeRO-3 shards); ``summary``: what Lightning's ModelSummary counts on this rank
    (global sizes of DTensors, but only this rank's pipeline stages)."""

    whole: int
    here: int
    summary: int


def parameter_counts(module: nn.Module, pipeline: Any = None) -> ParameterCounts:
    """Counts of ``module``'s parameters (a LightningModule under any layout). With a pipeline runtime
    (``strategy.pipeline``) the whole model is summed over the pipeline group, a copy another rank counts left
    out: a collective, every rank calls it."""
    params = list(module.parameters())
    summary = sum(p.numel() for p in params)
    here = sum(_local_numel(p) for p in params)
    if pipeline is None:
        return ParameterCounts(summary, here, summary)
    elsewhere = pipeline.counted_elsewhere()
    mine = torch.tensor([sum(p.numel() for p in params if id(p) not in elsewhere)], dtype=torch.float64)
    group = pipeline.group
    if dist.is_available() and dist.is_initialized() and group is not None:
        if dist.get_backend(group) == "nccl":
            mine = mine.cuda()
        dist.all_reduce(mine, group=group)
    return ParameterCounts(int(mine.item()), here, summary)
