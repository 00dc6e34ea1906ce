"""Measure what tensor parallelism costs per transformer layer: collectives issued, bytes sent, activations saved.

Used by ``tests/unit/test_tp_accounting.py`` and ``benchmarks/tensor_parallel.py`` to hold a TP layout to the Megatron
formulas (Shoeybi et al. 2019; Korthikanti et al. 2022, table 2) and to an exact formula for the example GPT's block.
No Lightning import.

- :class:`CollectiveTracer` records every collective a DTensor program issues, with its buffer size, the size of
  its group, the pass (forward / backward) and the module that issued it.
- :func:`layer_traffic` runs one layer forward and backward under it; :func:`ring_sent_bytes` turns records into
  bytes sent per rank; :func:`megatron_traffic_formula` is what the paper predicts.
- :func:`saved_activation_bytes` counts the bytes autograd keeps for backward; :func:`megatron_activation_formula`
  is table 2, :func:`block_activation_formula` the exact count for ``lightning_par.examples.gpt.Block``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.distributed.tensor.debug import CommDebugMode

from lightning_par.measure import ActivationMeter

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

# Collective op (native functional collectives, which is what DTensor issues) -> kind. The legacy Python spellings
# are listed too: CommDebugMode sees either, depending on the torch version.
_FUNCOL: dict[str, str] = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "shard_dim_alltoall": "all_to_all",
}
# c10d ops: what ``torch.distributed.all_reduce`` & co. dispatch to, should a module call them directly.
_C10D: dict[str, str] = {
    "allreduce_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "alltoall_base_": "all_to_all",
}


_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor", "c10d")


class CollectiveRecord(NamedTuple):
    """One issued collective. ``numel`` is the element count of the full (unsharded) buffer: the input of an
    all-reduce or reduce-scatter, the output of an all-gather, so one ring formula per kind applies."""

    kind: str
    numel: int
    element_size: int
    group_size: int
    backward: bool
    module: str  # fully qualified name of the innermost module running when it was issued ("Global": none)

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


def _group_size(name_or_group: Any) -> int:
    from torch.distributed import ProcessGroup

    from lightning_par._compat import resolve_process_group

    if isinstance(name_or_group, ProcessGroup):
        return name_or_group.size()
    if isinstance(name_or_group, torch.ScriptObject):  # how c10d ops receive their group below the dispatcher
        return ProcessGroup.unbox(name_or_group).size()
    return resolve_process_group(name_or_group).size()


def _is_group(value: Any) -> bool:
    from torch.distributed import ProcessGroup

    return isinstance(value, (ProcessGroup, torch.ScriptObject)) and "ProcessGroup" in str(
        getattr(value, "_type", lambda: type(value))())


def _record_of(op: str, args: tuple) -> tuple[str, int, int, int] | None:
    """``(kind, numel of the full buffer, element size, group size)`` of a collective op, None for other ops."""
    if op in _FUNCOL:
        kind = _FUNCOL[op]
        tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
        numel, size = sum(t.numel() for t in tensors), tensors[0].element_size()
        if op == "shard_dim_alltoall":  # (input, gather_dim, shard_dim, group_name)
            return kind, numel, size, _group_size(args[3])
        group = _group_size(args[-1])
        if kind == "all_gather":  # counted by its output: the input is one rank's shard
            numel *= group
        return kind, numel, size, group
    if op in _C10D:
        # c10d ops take a tensor (list) or an (output, input) pair, then the process group; the full buffer is
        # the largest tensor among the first two arguments (all-gather's output, reduce-scatter's input).
        tensors = [t for a in args[:2] for t in (a if isinstance(a, (list, tuple)) else [a]) if isinstance(t, Tensor)]
        group = next(a for a in args if _is_group(a))
        biggest = max(tensors, key=Tensor.numel)
        return _C10D[op], biggest.numel(), biggest.element_size(), _group_size(group)
    return None


class CollectiveTracer(CommDebugMode):
    """``CommDebugMode`` that also keeps the size of each collective.

    Why a dispatch mode and not :class:`lightning_par.measure.CommCounter`: DTensor redistributes through the
    functional collectives (``torch.ops._c10d_functional.*``), which never pass through the ``torch.distributed``
    functions CommCounter wraps, but do pass through the dispatcher, below the DTensor subclass. CommDebugMode is
    torch's own mode there: it already tells forward from backward and names the issuing module (a ModTracker), so
    we only add what it leaves out -- the buffer size and the group size -- to get bytes sent, not just counts.
    """

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CollectiveRecord] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # DTensor arguments: CommDebugMode returns NotImplemented so DTensor desugars the op into local ops and
        # collectives on plain tensors, which come back here one by one.
        is_dtensor = any(getattr(t, "__name__", "") == "DTensor" for t in types)
        if not is_dtensor and getattr(func, "namespace", None) in _NAMESPACES:
            record = _record_of(func._overloadpacket.__name__, args)
            if record is not None:
                tracker = self.advanced_module_tracker
                self.records.append(CollectiveRecord(*record, backward=bool(tracker.is_bw), module=tracker.name))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def counts(self, backward: bool | None = None) -> dict[str, int]:
        """Collectives issued per kind; ``backward`` True / False selects one pass, None both."""
        out = dict.fromkeys(KINDS, 0)
        for r in self.records:
            if backward is None or r.backward == backward:
                out[r.kind] += 1
        return out


def ring_sent_bytes(records: Iterable[CollectiveRecord]) -> float:
    """Bytes each rank sends for ``records`` with the bandwidth-optimal ring algorithms, n the group size and
    N the bytes of the full buffer: all-reduce ``2 N (n-1)/n``; all-gather and reduce-scatter ``N (n-1)/n``;
    all-to-all ``N (n-1)/n`` (each rank keeps one of its n chunks)."""
    factor = {"all_reduce": 2.0, "all_gather": 1.0, "reduce_scatter": 1.0, "all_to_all": 1.0}
    return sum(factor[r.kind] * r.nbytes * (r.group_size - 1) / r.group_size for r in records if r.group_size > 1)


@dataclass
class LayerTraffic:
    """Collectives of one layer's forward and backward, as one rank issued them."""

    forward: list[CollectiveRecord] = field(default_factory=list)
    backward: list[CollectiveRecord] = field(default_factory=list)

    @staticmethod
    def _counts(records: list[CollectiveRecord]) -> dict[str, int]:
        return dict(Counter(r.kind for r in records))

    def summary(self) -> dict[str, Any]:
        return {
            "forward": self._counts(self.forward),
            "backward": self._counts(self.backward),
            "forward_ops": [(r.kind, r.nbytes) for r in self.forward],
            "backward_ops": [(r.kind, r.nbytes) for r in self.backward],
            "sent_bytes_forward": ring_sent_bytes(self.forward),
            "sent_bytes_backward": ring_sent_bytes(self.backward),
            "sent_bytes": ring_sent_bytes(self.forward + self.backward),
        }


def layer_traffic(layer: nn.Module, x: Tensor) -> LayerTraffic:
    """Run ``layer(x)`` and its backward (gradient of ones) under a :class:`CollectiveTracer` each.

    Two tracers, not one: what the backward issues is then known without trusting the tracker's pass flag.
    """
    with CollectiveTracer() as fwd:
        y = layer(x)
    with CollectiveTracer() as bwd:
        y.backward(torch.ones_like(y))
    return LayerTraffic(forward=list(fwd.records), backward=list(bwd.records))


def megatron_traffic_formula(s: int, b: int, h: int, t: int, element_size: int = 2) -> dict[str, float]:
    """Bytes one rank sends per transformer layer in Megatron TP (with or without SP: an all-gather plus a
    reduce-scatter move what one all-reduce moves): two all-reduces of the ``s b h`` activations per pass,
    ``2 * 2 sbh (t-1)/t`` elements each way."""
    per_pass = 2 * 2 * s * b * h * element_size * (t - 1) / t
    return {"forward": per_pass, "backward": per_pass, "total": 2 * per_pass}


# ----------------------------------------------------------------------------------------------------------------------
# Activations saved for backward
# ----------------------------------------------------------------------------------------------------------------------
@dataclass
class SavedActivations:
    """What autograd saved during one forward: total bytes (each storage once) and one entry per storage."""

    nbytes: int
    entries: list[dict] = field(default_factory=list)


def saved_activation_bytes(fn: Callable[[], Any], exclude: Iterable[Tensor] = ()) -> tuple[Any, SavedActivations]:
    """Run ``fn()`` and count the bytes autograd saves for its backward; returns ``(fn's output, counts)``.

    Every tensor handed to ``saved_tensors_hooks`` is reduced to the storage that holds it (a DTensor's local
    shard), and each storage counts once, whole: a tensor saved by three matmuls, or a view of a saved tensor,
    costs its memory once -- that is what stays allocated until backward. Storages of ``exclude`` (pass the
    parameters) are skipped: weights are model state, not activations. The block's input is an activation (it
    stays alive for backward) and is counted, as in Korthikanti et al.
    """
    with ActivationMeter(exclude) as meter:
        out = fn()
    return out, SavedActivations(meter.seen_bytes, meter.entries)


def megatron_activation_formula(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False) -> float:
    """Korthikanti et al. 2022, table 2: bytes of activations per transformer layer, 16-bit activations with
    1-byte dropout masks, no recomputation. ``t = 1``: ``sbh (34 + 5as/h)``; TP: ``sbh (10 + 24/t + 5as/(ht))``;
    TP + SP: ``sbh (34/t + 5as/(ht))``."""
    sbh, attn = s * b * h, 5 * a * s / (h * t)
    if sp:
        return sbh * (34 / t + attn)
    return sbh * (10 + 24 / t + attn)


def block_activation_formula(s: int, b: int, h: int, a: int, kv_heads: int, ffn: int, t: int = 1,
                             sp: bool = False, element_size: int = 4) -> dict[str, float]:
    """Exact bytes ``lightning_par.examples.gpt.Block`` saves for backward on one rank, split as table 2 splits them.

    Derived from what autograd saves in its forward (torch 2.13, CPU), element counts:

    - ``norms``: each of the two RMSNorms saves its input, ``x * rsqrt(mean(x^2))`` and the ``rsqrt`` itself
      (``nn.RMSNorm`` is not fused on CPU): ``2 (2 sbh + sb)``. Divided by t with sequence parallelism (the
      norms run on sequence shards).
    - ``linear_inputs``: the norm outputs, which feed q/k/v and gate/up: ``2 sbh``. Never divided: with sequence
      parallelism the *all-gathered* tensor is what the column-parallel matmuls save (Megatron instead saves the
      shard and all-gathers it again in backward, which is why table 2 divides its whole ``10 sbh`` by t).
    - ``rope``: the cos and sin tables, ``[s, head_dim/2]`` each: ``s * head_dim``, on every rank.
    - ``attention``: rotated q (``sbh``), rotated k and v (``sb kv_dim`` each, GQA: kv_dim = kv_heads *
      head_dim), the SDPA output and its reshaped copy that o_proj saves (``2 sbh``), the softmax log-sum-exp
      (``sba``): the CPU flash kernel keeps no ``a s^2`` score matrix. Divided by t (heads are split).
    - ``mlp``: gate and up outputs, silu(gate), silu(gate) * up: ``4 sb ffn``, divided by t.

    Times ``element_size`` (4 for fp32). Returns the parts and their ``"total"``.
    """
    head_dim, sb = h // a, s * b
    sbh, kv = sb * h, kv_heads * (h // a)
    parts = {
        "norms": 2 * (2 * sbh + sb) / (t if sp else 1),
        "linear_inputs": 2 * sbh,
        "rope": s * head_dim,
        "attention": (3 * sbh + 2 * sb * kv + sb * a) / t,
        "mlp": 4 * sb * ffn / t,
    }
    out = {k: v * element_size for k, v in parts.items()}
    out["total"] = sum(out.values())
    return out


def block_activation_sbh_form(h: int, a: int, kv_heads: int, ffn: int, sp: bool, element_size: int = 4) -> str:
    """:func:`block_activation_formula` written like table 2, e.g. ``"4 sbh (6 + 16/t) + 4 sb (2 + 4/t) + 4 s*16"``."""
    head_dim = h // a
    shard = 3 + 2 * kv_heads * head_dim / h + 4 * ffn / h
    e = element_size
    if sp:
        return f"{e} sbh (2 + {shard + 4:g}/t) + {e} sb ({2 + a:g}/t) + {e} s*{head_dim}"
    return f"{e} sbh (6 + {shard:g}/t) + {e} sb (2 + {a:g}/t) + {e} s*{head_dim}"


def split_by_tp(measured: dict[int, float]) -> dict[str, float]:
    """Fit ``bytes(t) = replicated + sharded / t`` through the measurements at t = 1 and 2; the residual at every
    other t (e.g. 4) says whether the memory really falls as ``1/t``. Table 2's TP row is ``replicated = 10 sbh``,
    its TP+SP row ``replicated = 0``."""
    sharded = 2 * (measured[1] - measured[2])
    replicated = measured[1] - sharded
    residual = max((abs(replicated + sharded / t - m) / m for t, m in measured.items()), default=0.0)
    return {"replicated": replicated, "sharded": sharded, "max_relative_residual": residual}


# ----------------------------------------------------------------------------------------------------------------------
# Activations kept alive for backward, recompute included
# ----------------------------------------------------------------------------------------------------------------------
def _plain_tensors(value: Any) -> list[Tensor]:
    """The plain tensors holding ``value``'s data: a DTensor's local shard, any wrapper subclass's inner tensors."""
    from lightning_par._compat import is_traceable_wrapper_subclass, tree_flatten

    out: list[Tensor] = []
    stack = [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]
    while stack:
        t = stack.pop()
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            stack.extend(inner for n in names if isinstance(inner := getattr(t, n), Tensor))
        elif isinstance(t, Tensor) and t.device.type != "meta":
            out.append(t)
    return out


def _storage_key(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class LiveActivationMeter:
    """The bytes a forward leaves alive until backward, counted as live storages: works with recompute.

    ``saved_tensors_hooks`` (:class:`~lightning_par.measure.ActivationMeter`) do not see what
    ``torch.utils.checkpoint`` keeps (it installs its own inner hooks), so this records instead the output storage of
    every op run inside it (a ``TorchDispatchMode``; a DTensor counts by its local shard) with a weak reference, and
    :meth:`live_bytes` sums the storages still alive: whatever autograd (or a checkpoint) holds for backward, plus
    whatever the caller still references -- exclude the latter (the forward's output) and the parameters. Call it
    right after the forward, before backward; run ``gc.collect()`` first if reference cycles may hold temporaries.
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        from lightning_par._compat import TorchDispatchMode

        meter = self
        self._weakref = StorageWeakRef
        self.refs: dict[int, tuple[Any, int]] = {}
        self.exclude = {_storage_key(t) for t in _plain_tensors(list(exclude))}

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                meter._record(out)
                return out

        self._mode = _Mode()

    def _record(self, out: Any) -> None:
        for t in _plain_tensors(out):
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key or key in self.exclude:
                continue
            known = self.refs.get(key)
            if known is None or known[0].expired():  # (a freed storage's address is reused by a later one)
                self.refs[key] = (self._weakref(storage), storage.nbytes())

    def __enter__(self) -> LiveActivationMeter:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    def live_bytes(self, exclude: Iterable[Tensor] = ()) -> int:
        """Bytes of the recorded storages still alive, each once, leaving out the storages of ``exclude``."""
        skip = {_storage_key(t) for t in _plain_tensors(list(exclude))}
        return sum(n for key, (ref, n) in self.refs.items() if not ref.expired() and key not in skip)


def live_activation_bytes(block: nn.Module, x: Tensor, *args: Any, **kwargs: Any) -> int:
    """Bytes ``block(x, ...)`` keeps for its backward on this rank, recompute (full or selective) included.

    Counted like :func:`saved_activation_bytes` (and Korthikanti et al.): the storages alive after the forward,
    except the parameters and the block's output, plus the block's input ``x`` (an activation every recompute kind
    keeps: full recompute keeps only it). The output is held while counting and dropped after, so autograd's graph
    is freed on return (no backward is run).
    """
    import gc

    params = list(block.parameters())
    meter = LiveActivationMeter(exclude=[*params, x])
    with meter:
        out = block(x, *args, **kwargs)
    gc.collect()
    kept = meter.live_bytes(exclude=[out])
    return kept + sum(t.untyped_storage().nbytes() for t in _plain_tensors(x))


def recompute_activation_formula(kind: str, s: int, b: int, h: int, a: int, kv_heads: int, ffn: int, t: int = 1,
                                 sp: bool = False, element_size: int = 4) -> float:
    """Exact bytes ``lightning_par.examples.gpt.Block`` keeps per block on one rank under recompute ``kind``.

    ``none``: :func:`block_activation_formula`. ``full``: the block input only, ``sbh`` elements (``sbh/t`` with
    sequence parallelism, where the input is this rank's sequence shard). ``selective``: the attention core's
    outputs are dropped -- the SDPA output (``sbh/t``) and its log-sum-exp (``sba/t``) -- but its inputs (rotated q,
    k, v) stay, as they do without recompute.
    """
    if kind == "full":
        return s * b * h / (t if sp else 1) * element_size
    parts = block_activation_formula(s, b, h, a, kv_heads, ffn, t, sp, element_size)
    if kind == "none":
        return parts["total"]
    if kind == "selective":
        return parts["total"] - (s * b * h + s * b * a) / t * element_size
    raise ValueError(f"recompute kind {kind!r}: use none, selective or full")
