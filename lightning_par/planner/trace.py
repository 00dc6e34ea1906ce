"""Run the model's units forward and backward on fake tensors: the bytes each saves for backward, and its ops.

A fake tensor (``torch._subclasses.fake_tensor.FakeTensorMode``) has a shape, a dtype and a device but no memory,
so a unit of an 8B model runs in milliseconds and allocates nothing. Its device is the CPU, so PyTorch picks the
kernels it would pick here (the flash attention of the CPU, RMSNorm unfused), and autograd saves exactly what it
saves in a real run: the counts below equal :class:`lightning_par.measure.ActivationMeter` on real tensors
(``tests/launch/test_planner.py``).

For one configuration -- tensor-parallel size, sequence parallel, recompute, precision, micro-batch ``b`` and
sequence ``s`` -- :func:`trace_model`:

1. copies the short model (one block per kind, :func:`lightning_par.planner.model.short_model`), splits its
   parameters as tensor parallelism splits them on one rank (column-parallel linears keep ``out/tp`` features,
   row-parallel ones ``in/tp``, the vocabulary ``V/tp`` rows; the TP plan of
   :func:`~lightning_par.parallel.tensor_parallel.resolve_tp_plan`), applies the recompute of
   :func:`~lightning_par.parallel.recompute.apply_recompute` to the blocks, and casts it for ``bf16-true``;
2. runs the model once on fake token ids to capture every unit's inputs;
3. runs each unit again by itself, forward then backward with a gradient of ones, counting each storage autograd
   saves once (parameters excluded) and recording every op: FLOPs (``torch.utils.flop_counter``'s formulas) and
   bytes read and written;
4. does the same for the loss (the LightningModule's ``loss_fn``, else cross-entropy) on the logits.

A mixture-of-experts layer counts its tokens per expert (``torch.bincount``) and reads the counts on the host: data
a fake tensor does not have. The trace routes them evenly (:class:`_BalancedRouting`): each expert gets ``n k / E``
of the ``n`` tokens' ``k`` choices, so the experts' FLOPs are those of the active parameters. A Hugging Face
experts module (planned by the model's ep plan) picks each expert's tokens inside its own kernel with data-dependent
shapes; the trace runs a stand-in in its place (:func:`_balanced_experts`): every token's ``k`` choices through one
expert's weights each -- the same balanced assumption, the same FLOPs and shapes.

With sequence parallelism the norms run on ``s/tp`` tokens: the bytes they save (and, in a block, its input)
and the time of their ops are divided by tp afterwards.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.flop_counter import flop_registry

from lightning_par._compat import FakeTensorMode, TorchDispatchMode, tree_leaves, tree_map, unset_fake_temporarily
from lightning_par.parallel.experts_ep import resolve_ep_plan
from lightning_par.parallel.recompute import apply_recompute
from lightning_par.parallel.tensor_parallel import planned_split_dim, resolve_tp_plan
from lightning_par.planner.model import ModelInfo, short_model
from lightning_par.planner.runtime import NO_FP32_MASTERS, PRECISIONS  # noqa: F401
from lightning_par.topology import LayoutError


def compute_dtype(precision: str) -> str:
    return "fp32" if precision == "fp32" else "bf16"


@dataclass
class Ops:
    """The ops of one phase ("F" forward, "B" backward, with any recompute) of one unit, kept as arrays."""

    flops: list[float] = field(default_factory=list)
    nbytes: list[float] = field(default_factory=list)
    low_precision: list[bool] = field(default_factory=list)
    seq: list[bool] = field(default_factory=list)  # runs on sequence shards under sequence parallelism
    weight_grad: list[bool] = field(default_factory=list)  # produces a weight gradient (zero bubble's W)
    intensity: list[float] = field(default_factory=list)  # a GEMM's MNK / (MK + KN + MN); 0 for other ops
    # a fused attention kernel (SDPA): the share of its counted FLOPs it computes -- 0.5 under a causal mask (the
    # kernel skips the masked half; the count, as Megatron's, is the full square), 1.0 without; 0 for other ops
    attention: list[float] = field(default_factory=list)

    def add(self, flops: float, nbytes: float, low: bool, seq: bool, weight_grad: bool,
            intensity: float = 0.0, attention: float = 0.0) -> None:
        self.flops.append(flops)
        self.nbytes.append(nbytes)
        self.low_precision.append(low)
        self.seq.append(seq)
        self.weight_grad.append(weight_grad)
        self.intensity.append(intensity)
        self.attention.append(attention)

    @property
    def total_flops(self) -> float:
        return sum(self.flops)

    def time(self, hw: Any, tp_seq: int = 1, weight_grad: bool | None = None, compiled: bool = False) -> float:
        """Seconds on ``hw`` (see :meth:`times`); ``weight_grad`` True / False keeps only the ops that do / do not
        produce weight gradients."""
        total, weights, _ = self.times(hw, tp_seq, compiled)
        return total if weight_grad is None else weights if weight_grad else total - weights

    def times(self, hw: Any, tp_seq: int = 1, compiled: bool = False) -> tuple[float, float, float]:
        """Seconds on ``hw``: all ops, those making weight gradients, the matrix products. Per op the longer of its
        FLOPs at the matmul rate of its shape (:meth:`Hardware.flops`) and its bytes at the memory bandwidth, plus
        the launch overhead; ops on sequence shards take 1/``tp_seq``. A fused attention kernel in bf16 on hardware
        with an ``attention_efficiency`` runs the FLOPs it computes (half of the counted ones under a causal mask) at
        that fraction of peak; elsewhere it is a GEMM of its intensity. ``compiled``: the ops between two matrix
        products run as one fused kernel (what ``torch.compile``'s Inductor makes of them), which reads its inputs
        and writes its output once -- costed as the largest of its ops' bytes and one launch, plus the share
        ``1 - hw.fusion`` of the other ops' bytes that real fusion still moves (1: the ideal)."""
        bw, overhead = hw.memory_bandwidth, hw.op_overhead_s
        kept = 1.0 - getattr(hw, "fusion", 1.0)  # the share of a fused group's other bytes still moved
        attention_rate = hw.attention_flops() if getattr(hw, "attention_efficiency", 0.0) else 0.0
        rates: dict[tuple[bool, float], float] = {}
        total = weights = matmuls = 0.0
        fused_bytes, fused_seq, fused_sum = 0.0, False, 0.0

        def flush() -> float:
            moved = fused_bytes + kept * (fused_sum - fused_bytes)
            return ((moved / bw) / (tp_seq if fused_seq else 1) + overhead) if fused_bytes else 0.0

        attention = self.attention or [0.0] * len(self.flops)  # (Ops given lists without it: no attention)
        for f, b, low, seq, w, i, a in zip(self.flops, self.nbytes, self.low_precision, self.seq, self.weight_grad,
                                           self.intensity, attention, strict=True):
            if compiled and not f:
                fused_sum += b
                if b > fused_bytes:
                    fused_bytes, fused_seq = b, seq
                continue
            if compiled:
                total += flush()
                fused_bytes = fused_sum = 0.0
            if f and a and low and attention_rate:
                t = max(f * a / attention_rate, b / bw)
            elif f:
                key = (low, i)
                if key not in rates:
                    rates[key] = hw.flops("bf16" if low else "fp32", i or None)
                t = max(f / rates[key], b / bw)
            else:
                t = b / bw
            t = (t / tp_seq if seq else t) + overhead
            total += t
            if f:
                matmuls += t
            if w:
                weights += t
        return total + (flush() if compiled else 0.0), weights, matmuls


@dataclass
class UnitTrace:
    """What one unit does for one micro-batch on one tensor-parallel rank."""

    name: str
    saved_bytes: float  # saved for backward, each storage once (tensors shared by several units apart)
    saved_seq_bytes: float  # the part held on sequence shards under sequence parallelism (divided by tp)
    forward: Ops
    backward: Ops
    output_bytes: float  # the activation sent to the next pipeline stage
    shared: dict[int, float] = field(default_factory=dict)  # saved inputs every block gets (rotary tables): once
    # the gradients of the outputs of ops that read a parameter: what a zero-bubble schedule's input-gradient
    # backward (I) keeps, besides the whole graph, for the weight-gradient backward (W)
    weight_grad_inputs: float = 0.0
    saved_weight_path: float = 0.0  # the part of saved_bytes only weight gradients read (see _SavedCounter)

    def saved(self, tp_seq: int = 1) -> float:
        return self.saved_bytes - self.saved_seq_bytes * (1 - 1 / tp_seq)


def saved_bytes(traces: list[UnitTrace], tp_seq: int = 1) -> float:
    """Bytes a sequence of units saves for one micro-batch, a tensor they share (e.g. the rotary tables a Hugging
    Face model hands every layer) counted once."""
    shared: dict[int, float] = {}
    for t in traces:
        shared.update(t.shared)
    return sum(t.saved(tp_seq) for t in traces) + sum(shared.values())


@dataclass
class ModelTrace:
    """Per unit of the full model (a block's trace stands for every block of its kind), and the loss."""

    units: dict[str, UnitTrace]
    loss: UnitTrace
    tp: int
    sequence_parallel: bool
    recompute: str
    precision: str
    micro_batch: int
    seq_len: int


# ----------------------------------------------------------------------------------------------------------------------
# Counting
# ----------------------------------------------------------------------------------------------------------------------
def _storage_key(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _is_view(func: Any) -> bool:
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _attention_flops(q: Tensor, k: Tensor, v: Tensor) -> float:
    b, h, s_q, d = q.shape
    s_k, d_v = k.shape[-2], v.shape[-1]
    return 2.0 * b * h * s_q * s_k * d + 2.0 * b * h * s_q * s_k * d_v


def _flops(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    packet = func._overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    name = packet.__name__
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        return _attention_flops(*args[:3])
    if name == "_scaled_dot_product_flash_attention_for_cpu_backward":  # (grad_out, q, k, v, out, lse, ...)
        return 2.5 * _attention_flops(*args[1:4])
    return 0.0


_GEMM_OPERANDS = {"mm": (0, 1), "bmm": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2), "matmul": (0, 1)}


def _intensity(func: Any, args: tuple) -> float:
    """The GEMM intensity ``MNK / (MK + KN + MN)`` of a matrix product (attention: ``M = N =`` the query and key
    lengths, ``K`` the head size); 0 where the shapes are not read (the hardware's largest-shape efficiency)."""
    name = func._overloadpacket.__name__
    try:
        if name in _GEMM_OPERANDS:
            i, j = _GEMM_OPERANDS[name]
            a, b = args[i], args[j]
            m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
        elif "scaled_dot_product" in name:
            q, key = (args[1], args[2]) if name.endswith("_backward") else (args[0], args[1])
            m, k, n = q.shape[-2], q.shape[-1], key.shape[-2]
        else:
            return 0.0
    except (AttributeError, IndexError):
        return 0.0
    return float(m * n * k) / float(m * k + k * n + m * n) if m and n and k else 0.0


def _attention_share(func: Any, args: tuple, kwargs: dict) -> float:
    """For a fused attention op (SDPA's kernels, forward or backward): the share of its counted FLOPs it computes,
    0.5 with ``is_causal`` (the kernel skips the blocks above the diagonal), else 1.0; 0 for any other op."""
    if "scaled_dot_product" not in func._overloadpacket.__name__:
        return 0.0
    causal = kwargs.get("is_causal")
    if causal is None:
        names = [a.name for a in func._schema.arguments]
        causal = args[names.index("is_causal")] if "is_causal" in names and names.index("is_causal") < len(args) \
            else False
    return 0.5 if causal else 1.0


_NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense",
               "detach", "lift_fresh", "_unsafe_view", "alias"}


def _nbytes(func: Any, args: tuple, kwargs: dict, out: Any) -> float:
    name = func._overloadpacket.__name__
    if name in _NO_TRAFFIC:
        return 0.0
    outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
    if name == "embedding":  # a gather: reads the rows it returns, not the table
        return 2.0 * sum(t.nbytes for t in outs) + args[1].nbytes
    ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
    return float(sum(t.nbytes for t in ins) + sum(t.nbytes for t in outs))


class _OpRecorder(TorchDispatchMode):
    """Records every non-view op: FLOPs, bytes moved, precision, and whether it runs on sequence shards or makes a
    weight gradient."""

    def __init__(self, ops: Ops, in_seq: Callable[[], bool], weight_shapes: set[tuple[int, ...]],
                 backward: bool, params: set[int] = frozenset()) -> None:
        super().__init__()
        self.ops, self.in_seq, self.weight_shapes, self.backward = ops, in_seq, weight_shapes, backward
        self.param_like = set(params)  # parameters and what is computed from them alone (casts, transposes)
        self.param_output_bytes = 0.0  # outputs of forward ops that combine a parameter with an activation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        produces_tensor = any(isinstance(t, Tensor) for t in tree_leaves(out))
        if produces_tensor and not _is_view(func) and func._overloadpacket.__name__ not in _NO_TRAFFIC:
            flops = _flops(func, args, kwargs, out)
            low = any(t.dtype in (torch.bfloat16, torch.float16) for t in tree_leaves(args) if isinstance(t, Tensor))
            weight_grad = bool(self.backward and flops and isinstance(out, Tensor)
                               and tuple(out.shape) in self.weight_shapes)
            self.ops.add(flops, _nbytes(func, args, kwargs, out), low, self.in_seq(), weight_grad,
                         _intensity(func, args) if flops else 0.0,
                         _attention_share(func, args, kwargs) if flops else 0.0)
        if not self.backward and produces_tensor:
            keys = [_storage_key(t) for t in tree_leaves(args) if isinstance(t, Tensor)]
            outs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
            from_params = [k in self.param_like for k in keys]
            if keys and all(from_params):
                self.param_like.update(_storage_key(t) for t in outs)
            elif any(from_params):
                self.param_output_bytes += sum(t.nbytes for t in outs)
        return out


class _SavedCounter:
    """Bytes autograd saves, each storage once, parameters and buffers excluded; the part saved on sequence
    shards (by a norm under sequence parallelism, or a block's own input) counted apart."""

    def __init__(self, skip: set[int], on_shards: Callable[[Tensor], bool], shared: set[int] = frozenset()) -> None:
        self.skip, self.on_shards, self.shared_keys = skip, on_shards, shared
        self.seen: dict[int, tuple[int, bool]] = {}
        self.shared: dict[int, float] = {}

    def pack(self, t: Tensor) -> Tensor:
        key = _storage_key(t)
        if key in self.shared_keys:
            self.shared[key] = float(t.untyped_storage().nbytes())
        elif key not in self.skip and key not in self.seen:
            self.seen[key] = (t.untyped_storage().nbytes(), self.on_shards(t))
        return t

    def weight_path(self, outputs: list[Tensor]) -> float:
        """Bytes saved only by autograd nodes that read a parameter (a linear's input, a norm's normalized input):
        a zero-bubble schedule's weight-gradient backward (W) runs those nodes and releases them. What the other
        nodes saved, the input-gradient backward (I) ran with ``retain_graph=True``; it stays until the graph is
        dropped."""
        param_only: dict[Any, bool] = {}

        def only_params(node: Any) -> bool:
            if node not in param_only:
                variable = getattr(node, "variable", None)
                if variable is not None:
                    param_only[node] = _storage_key(variable) in self.skip
                else:
                    nexts = [n for n, _ in node.next_functions if n is not None]
                    param_only[node] = bool(nexts) and all(only_params(n) for n in nexts)
            return param_only[node]

        savers: dict[int, bool] = {}  # storage -> every node saving it reads a parameter
        stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
        visited: set[Any] = set()
        while stack:
            node = stack.pop()
            if node in visited:
                continue
            visited.add(node)
            nexts = [n for n, _ in node.next_functions if n is not None]
            reads_param = any(only_params(n) for n in nexts)
            for name in dir(node):
                if not name.startswith("_raw_saved_"):
                    continue
                try:
                    value = getattr(node, name)
                except RuntimeError:
                    continue
                # the packed values, not unpacked ones: unpacking what a checkpointed region saved would re-run
                # its forward (once per access, outside a backward); those holders are never in ``seen`` anyway
                packed = [v.data for v in (value if isinstance(value, (list, tuple)) else [value])]
                for t in packed:
                    if isinstance(t, Tensor) and _storage_key(t) in self.seen:
                        key = _storage_key(t)
                        savers[key] = savers.get(key, True) and reads_param
            stack.extend(n for n in nexts if not only_params(n))
        return float(sum(n for key, (n, _) in self.seen.items() if savers.get(key)))

    @property
    def total(self) -> float:
        return float(sum(n for n, _ in self.seen.values()))

    @property
    def on_seq(self) -> float:
        return float(sum(n for n, seq in self.seen.values() if seq))


# ----------------------------------------------------------------------------------------------------------------------
# Preparing the copy
# ----------------------------------------------------------------------------------------------------------------------
def _split_like_tp(root: nn.Module, tp: int, sequence_parallel: bool) -> dict[str, str]:
    """Shrink ``root``'s (meta) parameters to one tensor-parallel rank's shards; returns the resolved plan."""
    styles = resolve_tp_plan(root, tp, sequence_parallel)
    for name, style in styles.items():
        module = root.get_submodule(name)
        changed = False
        for p_name, p in list(module.named_parameters(recurse=False)):
            dim = planned_split_dim(style, module, p_name)
            if dim is None:
                continue
            shape = list(p.shape)
            if shape[dim] % tp:
                raise LayoutError(f"{name}.{p_name} has {shape[dim]} rows along dim {dim}, which tp={tp} does not "
                                  "divide.")
            shape[dim] //= tp
            setattr(module, p_name, nn.Parameter(torch.empty(shape, dtype=p.dtype, device="meta"),
                                                 requires_grad=p.requires_grad))
            changed = True
        if changed and isinstance(module, nn.Linear):
            module.out_features, module.in_features = module.weight.shape
        elif changed and isinstance(module, nn.Embedding):
            module.num_embeddings = module.weight.shape[0]
    return styles


def _leaves(args: tuple, kwargs: dict) -> tuple[tuple, dict, Tensor | None]:
    """Detached copies of a unit's captured inputs; the activation (the first floating tensor argument, or
    ``hidden_states``) becomes a leaf that requires grad, as a pipeline stage's received input is."""
    activation: list[Tensor] = []

    def detach(t: Any) -> Any:
        return t.detach() if isinstance(t, Tensor) else t

    args, kwargs = tree_map(detach, args), tree_map(detach, kwargs)
    candidates = [(i, a) for i, a in enumerate(args) if isinstance(a, Tensor)]
    if not candidates and isinstance(kwargs.get("hidden_states"), Tensor):
        kwargs = {**kwargs, "hidden_states": kwargs["hidden_states"].requires_grad_(True)}
        return args, kwargs, kwargs["hidden_states"]
    for i, a in candidates:
        if a.is_floating_point():
            args = (*args[:i], a.requires_grad_(True), *args[i + 1:])
            activation.append(args[i])
            break
    return args, kwargs, activation[0] if activation else None


def _logits(out: Any) -> Tensor:
    if isinstance(out, Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    raise LayoutError(f"the model's forward returned {type(out).__name__}; the planner needs logits (a tensor, "
                      "or an output with .logits).")


def _default_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


@contextlib.contextmanager
def _module_stack(modules: dict[str, nn.Module]) -> Iterator[list[str]]:
    stack: list[str] = []
    handles = []
    for name, module in modules.items():
        handles.append(module.register_forward_pre_hook(lambda _m, _a, n=name: stack.append(n)))
        handles.append(module.register_forward_hook(lambda _m, _a, _o, n=name: _pop(stack, n)))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def _pop(stack: list[str], name: str) -> None:
    if stack and stack[-1] == name:
        stack.pop()


@contextlib.contextmanager
def _as_in_a_real_run() -> Iterator[None]:
    """Hugging Face's mask code treats a fake tensor as a graph being traced and then builds an explicit causal
    mask (and repeats the KV heads) where a real run without padding passes ``is_causal=True`` to SDPA: skip the
    mask as a real run does when there is no padding mask and the queries cover the keys, and read the positions
    (an ``arange`` here) as one sequence per row, not packed ones."""
    import sys

    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "_ignore_causal_mask_sdpa", None)
    packed = getattr(masking, "find_packed_sequence_indices", None)
    if original is not None:
        masking.find_packed_sequence_indices = lambda position_ids: None
        def ignore(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size=None):
            plain = isinstance(q_length, int) and isinstance(kv_length, int) and q_length in (1, kv_length)
            local_ok = local_attention_size is None or kv_length < local_attention_size
            if padding_mask is None and local_ok and plain:
                return True
            return original(padding_mask, q_length, kv_length, q_offset, kv_offset, local_attention_size)

        masking._ignore_causal_mask_sdpa = ignore
    try:
        yield
    finally:
        if original is not None:
            masking._ignore_causal_mask_sdpa = original
            masking.find_packed_sequence_indices = packed


class _BalancedRouting(TorchDispatchMode):
    """``bincount(choices, minlength=E)`` under the fake mode answered with balanced counts, as a real tensor (so
    that ``.tolist()`` reads them): the ``choices.numel()`` choices spread as evenly as they go over ``E``. A
    dispatch mode, so that a full recompute's forward, run by autograd in the backward, meets it too."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default:
            choices, bins = args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            if bins <= 0:
                raise LayoutError("the planner traces an expert layer's torch.bincount only with minlength set to "
                                  "the number of experts (its output size must not depend on the data).")
            n = choices.numel()
            with unset_fake_temporarily():
                return torch.tensor([n // bins + (i < n % bins) for i in range(bins)], dtype=torch.int64)
        return func(*args, **kwargs)


def _stand_in_for_planned_experts(root: nn.Module) -> None:
    """Give each experts module a Hugging Face model's ep plan names the forward :func:`_balanced_experts` (on the
    trace's own copy of the model)."""
    for name, stacked in resolve_ep_plan(root).items():
        experts = root.get_submodule(name)
        experts.forward = functools.partial(_balanced_experts, experts, stacked)


def _balanced_experts(module: nn.Module, stacked: tuple[str, ...], hidden: Tensor, index: Tensor, weights: Tensor,
                      *args: Any, **kwargs: Any) -> Tensor:
    """A Hugging Face experts module's forward as the planner counts it: each token's ``k`` choices through the
    stacked matrices of one expert (``[out, in]`` or ``[in, out]``, whichever takes the input; a fused ``gate_up``
    output gated into its halves; biases added), weighted and summed over the choices. Balanced routing: the FLOPs and
    activations of the active experts, with the output's shape."""
    k, width = index.shape[-1], hidden.shape[-1]
    x, gated = hidden.reshape(-1, width).repeat_interleave(k, dim=0), False
    for name in stacked:
        weight = getattr(module, name)[0]
        if weight.dim() == 1:  # the bias of the matrix before it
            x = x + weight
            continue
        if gated:
            x, gated = _gate(x), False
        x = x @ weight.T if weight.shape[-1] == x.shape[-1] else x @ weight
        gated = "gate_up" in name
    x = _gate(x) if gated else x
    if x.shape[-1] != width:
        raise LayoutError(f"the planner's stand-in for {type(module).__name__} (balanced routing through its stacked "
                          f"weights {list(stacked)}) does not map the hidden size {width} back to itself: this experts "
                          "module's layout is not one the planner can count.")
    if weights.shape[-1] != k:  # (dense scores over all experts: each token's chosen ones)
        weights = weights.gather(-1, index)
    out = (x.view(-1, k, width) * weights.reshape(-1, k, 1).to(x.dtype)).sum(dim=1)
    return out.view(hidden.shape)


def _gate(x: Tensor) -> Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def _forward(model: nn.Module, tokens: Tensor, root_path: str = "") -> Any:
    """The model's output (logits, or an output holding them) for ``tokens``. A LightningModule without a
    ``forward`` of its own (the README's: its steps call ``self.model``) runs its network: the child holding the
    blocks at ``root_path``, whose forward the strategies run."""
    from lightning.pytorch import LightningModule

    if isinstance(model, LightningModule) and type(model).forward is LightningModule.forward:
        child = root_path.split(".", 1)[0]
        if not child:
            raise LayoutError(f"{type(model).__name__} has no forward and holds its blocks itself: plan needs a "
                              "forward (tokens -> logits), or the network in a child module (self.model = ...) "
                              "whose forward it runs.")
        return _forward(model.get_submodule(child), tokens)
    try:
        return model(tokens)
    except TypeError:
        return model(input_ids=tokens, use_cache=False)


def trace_model(info: ModelInfo, tp: int = 1, sequence_parallel: bool = False, recompute: str = "none",
                precision: str = "fp32", micro_batch: int = 1, seq_len: int = 128) -> ModelTrace:
    """Saved bytes and ops of every unit (and the loss) for one micro-batch on one tensor-parallel rank."""
    if precision not in PRECISIONS:
        raise LayoutError(f"precision={precision!r}: use one of {list(PRECISIONS)}.")
    short = short_model(info)
    model = copy.deepcopy(short.obj)
    root = model.get_submodule(short.root_path) if short.root_path else model
    _stand_in_for_planned_experts(model)
    styles = _split_like_tp(root, tp, sequence_parallel) if tp > 1 else {}
    blocks = [root.get_submodule(b) for b in short.blocks]
    apply_recompute(blocks, recompute)
    if precision in ("bf16-true", "bf16-mixed-master"):
        model.to(torch.bfloat16)
    seq_modules = {id(root.get_submodule(n)) for n, s in styles.items() if s == "sequence_parallel"} \
        if sequence_parallel else set()
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16-mixed" else \
        contextlib.nullcontext
    loss_fn = info.loss_fn if info.loss_fn is not None else _default_loss
    if info.loss_fn is not None and getattr(info.loss_fn, "__self__", None) is info.obj:
        loss_fn = getattr(model, info.loss_fn.__name__)  # the copy's bound method

    with FakeTensorMode(allow_non_fake_inputs=True), _BalancedRouting(), _quiet_fake_tensor_log():
        model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
        skip = {_storage_key(t) for t in [*model.parameters(), *model.buffers()]}
        unit_modules = {u: root.get_submodule(u) for u in short.units}
        captured: dict[str, tuple[tuple, dict]] = {}
        handles = [m.register_forward_pre_hook(lambda _m, a, k, u=u: captured.setdefault(u, (a, k)),
                                               with_kwargs=True) for u, m in unit_modules.items()]
        tokens = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        try:
            with torch.no_grad(), autocast(), _as_in_a_real_run():
                logits = _logits(_forward(model, tokens, short.root_path))
        except LayoutError:
            raise
        except Exception as err:  # noqa: BLE001 -- one line naming the model, not a traceback
            raise _untraceable(model, "forward", err) from err
        finally:
            for h in handles:
                h.remove()
        missing = [u for u in short.units if u not in captured]
        if missing:
            raise LayoutError(f"the forward of {type(model).__name__} never called the units {missing}.")

        traces: dict[str, UnitTrace] = {}
        for unit, module in unit_modules.items():
            args, kwargs, x = _leaves(*captured[unit])
            is_block = unit in short.blocks
            sub = {f"{unit}.{n}" if n else unit: m for n, m in module.named_modules()}

            def run(module=module, args=args, kwargs=kwargs) -> Any:
                return module(*args, **kwargs)

            inputs = {_storage_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
            shared = inputs - ({_storage_key(x)} if x is not None else set())
            try:
                traces[unit] = _trace_unit(unit, run, sub, seq_modules, skip, x, is_block, autocast, module, shared)
            except LayoutError:
                raise
            except Exception as err:  # noqa: BLE001 -- one line naming the unit, not a traceback
                raise _untraceable(model, f"unit {unit}", err) from err
        logits_leaf = logits.detach().requires_grad_(True)
        targets = torch.zeros(micro_batch, seq_len, dtype=torch.long)
        loss = _trace_unit("loss", lambda: loss_fn(logits_leaf, targets), {}, set(), skip, None, False, autocast,
                           None)

    full = {u: traces[short.represents[u]] for u in info.units}
    return ModelTrace(full, loss, tp, sequence_parallel, recompute, precision, micro_batch, seq_len)


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """torch logs the traceback of an op that fails on fake tensors before raising it; the planner turns the error
    into one line (:func:`_untraceable`), which must be the last one printed."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _untraceable(model: nn.Module, what: str, err: Exception) -> LayoutError:
    """The one-line refusal of a model whose ``what`` does not run on the trace's fake tensors."""
    cause = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}".rstrip(": .")
    return LayoutError(
        f"{type(model).__name__}'s {what} does not run on fake tensors (shapes without data), which the planner "
        f"traces: {cause}. A forward whose shapes depend on the data cannot be planned; an expert layer is traced "
        "when it declares the expert interface and counts its tokens with torch.bincount(choices, "
        "minlength=num_experts), or when a Hugging Face model's ep plan names it (docs/moe.md).")


def _trace_unit(name: str, run: Callable[[], Any], modules: dict[str, nn.Module], seq_modules: set[int],
                skip: set[int], x: Tensor | None, is_block: bool, autocast: Callable,
                owner: nn.Module | None, shared: set[int] = frozenset()) -> UnitTrace:
    forward, backward = Ops(), Ops()
    weight_shapes = {tuple(p.shape) for p in owner.parameters()} if owner is not None else set()
    input_key = _storage_key(x) if x is not None else None
    with _module_stack(modules) as stack:
        def innermost_on_shards() -> bool:
            return bool(stack) and id(modules[stack[-1]]) in seq_modules

        def on_shards(t: Tensor) -> bool:
            if not seq_modules:
                return False
            if innermost_on_shards():
                return True
            # a block's own input (saved by full recompute before any submodule runs) is a sequence shard too
            return is_block and len(stack) == 1 and _storage_key(t) == input_key

        recorder = _OpRecorder(forward, innermost_on_shards, weight_shapes, backward=False, params=skip)
        counter = _SavedCounter(skip, on_shards, shared)
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t), autocast(), recorder:
            out = run()
        outs = [t for t in tree_leaves(out) if isinstance(t, Tensor) and t.requires_grad]
        weight_path = counter.weight_path(outs)
        grads = [torch.ones_like(t) for t in outs]
        if outs:
            with _OpRecorder(backward, lambda: False, weight_shapes, backward=True):
                torch.autograd.backward(outs, grads)
    first = next((t for t in tree_leaves(out) if isinstance(t, Tensor)), None)
    return UnitTrace(name, counter.total, counter.on_seq, forward, backward,
                     float(first.nbytes) if first is not None else 0.0, counter.shared, recorder.param_output_bytes,
                     weight_path)
