"""Measure what a data-parallel layout costs: collectives issued, elements sent, bytes of training state per rank.

Used by the tests and benchmarks to check the ZeRO stages against their formulas (Rajbhandari et al., 2020). No
Lightning import: it works on any module, optimizer and process group.

- :class:`CommCounter` records the collectives issued through ``torch.distributed`` (and DDP's C++ reducer, via
  a comm hook) and converts them to elements sent per rank.
- :func:`state_bytes` counts the memory held in parameters, gradients and optimizer states, by unique storage.
- :func:`zero_formula` / :func:`traffic_formula` give what the paper predicts for fp32 Adam.
- :class:`ActivationMeter` measures the bytes autograd saves for backward, live and at the peak.
- :class:`GatheredParamMeter` measures the parameter bytes ZeRO-3 (FSDP2) holds gathered during forward, at the peak;
  :class:`GradientMeter` the gradient bytes held during backward (ZeRO-1/2 buckets included).
"""

import functools
import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")

# function name -> (kind, the argument whose element count is the "numel" of the record).
# reduce-scatter is counted by its input (the full buffer), all-gather by its output (the full buffer), so both
# are "the size of the unsharded buffer" and the ring formulas below apply uniformly.
_WRAPPED: dict[str, tuple[str, str]] = {
    "all_reduce": ("all_reduce", "tensor"),
    "broadcast": ("broadcast", "tensor"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter_single": ("reduce_scatter", "input"),  # what FSDP2 calls in torch >= 2.13
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),  # what FSDP2 calls in torch >= 2.13
    "_all_gather_base": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
}

# ``torch.distributed`` re-exports the functions of ``distributed_c10d``: both names are patched, so a caller that
# goes through either module is seen. The deprecated spellings call the new ones through the c10d module, which
# would count twice; a per-thread nesting depth makes only the outermost call count.
_MODULES = (dist, dist.distributed_c10d)


class Collective(NamedTuple):
    """One issued collective: its kind, the element count of its full buffer, the size of its group."""

    kind: str
    numel: int
    group_size: int
    op: str  # the function called, e.g. "all_gather_single" or "ddp_comm_hook"


def _numel(value: Any) -> int:
    if isinstance(value, Tensor):
        return value.numel()
    if isinstance(value, (list, tuple)):
        return sum(_numel(v) for v in value)
    return 0


def _group_size(group: Any) -> int:
    try:
        return dist.get_world_size(group)
    except (RuntimeError, ValueError):
        return -1


class CommCounter:
    """Record the collectives issued while it is installed and enabled.

    Use as a context manager (``with CommCounter() as c: ...``) or with :meth:`install` / :meth:`uninstall`.
    Installing wraps the python-level collectives of ``torch.distributed`` (see ``_WRAPPED``) in both
    ``torch.distributed`` and ``torch.distributed.distributed_c10d``; that covers FSDP2, which in torch 2.13 issues
    ``dist.all_gather_single`` / ``dist.reduce_scatter_single`` from its ``DefaultAllGather`` /
    ``DefaultReduceScatter`` objects, looking the function up on the module at call time.

    Not seen: code that imported a collective by name before installation (``from torch.distributed import
    all_reduce``), functional collectives (``torch.distributed._functional_collectives``, used by DTensor
    redistribution), and collectives issued from C++ -- in particular DDP's gradient all-reduce; for that register
    :meth:`ddp_comm_hook` on the DDP module.

    Counting happens only while :attr:`enabled` (see :meth:`pause` / :meth:`resume`), so a window such as one
    optimizer step can be measured inside a longer run.

    Args:
        enabled: whether to count from the start.
        process_group: the group the DDP comm hook all-reduces over (``None``: the default group); set it to the
            DDP module's ``process_group``.
    """

    def __init__(self, enabled: bool = True, process_group: dist.ProcessGroup | None = None) -> None:
        self.enabled = enabled
        self.process_group = process_group
        self.records: list[Collective] = []
        self._originals: list[tuple[Any, str, Callable]] = []
        self._local = threading.local()

    # -- switching ----------------------------------------------------------------------------------------------
    def install(self) -> "CommCounter":
        """Wrap the collectives of ``torch.distributed``; idempotent."""
        if self._originals:
            return self
        for module in _MODULES:
            for name, (kind, arg) in _WRAPPED.items():
                original = getattr(module, name, None)
                if original is None:  # e.g. the legacy names in a torch that dropped them
                    continue
                self._originals.append((module, name, original))
                setattr(module, name, self._wrap(original, name, kind, arg))
        return self

    def uninstall(self) -> None:
        """Put the original functions back."""
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals.clear()

    def __enter__(self) -> "CommCounter":
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def pause(self) -> None:
        self.enabled = False

    def resume(self) -> None:
        self.enabled = True

    def reset(self) -> None:
        self.records.clear()

    # -- recording ----------------------------------------------------------------------------------------------
    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _wrap(self, original: Callable, name: str, kind: str, arg: str) -> Callable:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.enabled and self._depth() == 0:
                bound = signature.bind(*args, **kwargs)
                size = _group_size(bound.arguments.get("group"))
                if size > 0:  # -1: this rank is not in the group and sends nothing
                    self.records.append(Collective(kind, _numel(bound.arguments.get(arg)), size, name))
            self._local.depth = self._depth() + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth -= 1

        return counted

    @staticmethod
    def ddp_comm_hook(state: "CommCounter", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """A DDP comm hook that counts each gradient bucket as an all-reduce, then averages it as DDP does.

        Register with ``ddp_model.register_comm_hook(counter, CommCounter.ddp_comm_hook)``; the all-reduce runs
        over ``counter.process_group`` (set it to ``ddp_model.process_group``). DDP checks the hook's annotations
        at run time, which is why this module does not postpone annotations.
        """
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        if state.enabled:
            size = _group_size(state.process_group)
            state.records.append(Collective("all_reduce", bucket.buffer().numel(), size, "ddp_comm_hook"))
        # The hook's own dist.all_reduce must not be counted a second time by the installed wrapper.
        state._local.depth = state._depth() + 1
        try:
            return allreduce_hook(state.process_group, bucket)
        finally:
            state._local.depth -= 1

    # -- results ------------------------------------------------------------------------------------------------
    def calls(self) -> dict[str, int]:
        """Number of collectives issued per kind (including those over a group of one)."""
        out = dict.fromkeys(KINDS, 0)
        for record in self.records:
            out[record.kind] += 1
        return out

    def sent_elements(self) -> dict[str, float]:
        """Elements each rank sends per kind, with the bandwidth-optimal ring algorithms.

        Over a group of ``n`` ranks, with ``numel`` the size of the full (unsharded) buffer:

        - all-reduce: ``2 (n-1)/n numel`` (a reduce-scatter followed by an all-gather);
        - reduce-scatter: ``(n-1)/n numel`` of its input;
        - all-gather: ``(n-1)/n numel`` of its output;
        - broadcast: ``(n-1)/n numel`` (pipelined ring: each rank but the last forwards the buffer, spread evenly).

        A group of one sends nothing. Elements, not bytes: multiply by the element size of the dtype.
        """
        out = dict.fromkeys(KINDS, 0.0)
        factor = {"all_reduce": 2.0, "reduce_scatter": 1.0, "all_gather": 1.0, "broadcast": 1.0}
        for record in self.records:
            n = record.group_size
            if n > 1:
                out[record.kind] += factor[record.kind] * (n - 1) / n * record.numel
        return out

    def total_sent(self) -> float:
        return sum(self.sent_elements().values())


# ----------------------------------------------------------------------------------------------------------------------
# Memory held by training state
# ----------------------------------------------------------------------------------------------------------------------
CATEGORIES = ("parameters", "gradients", "optimizer_states")


def _local(tensor: Tensor) -> Tensor:
    """The tensor that actually holds this rank's memory: a DTensor's local shard, the result inside an
    ``AsyncCollectiveTensor`` (what a row-parallel layer returns while its all-reduce is in flight), else the tensor
    itself."""
    from lightning_par._compat import AsyncCollectiveTensor

    if isinstance(tensor, AsyncCollectiveTensor):
        return tensor.elem
    local = getattr(tensor, "_local_tensor", None)
    return local if isinstance(local, Tensor) else tensor


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterable[Tensor]:
    for state in optimizer.state.values():
        values = state.values() if isinstance(state, dict) else [state]
        for value in values:
            if isinstance(value, Tensor) and value.dim() > 0:
                yield value


def state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] | torch.optim.Optimizer) -> dict:
    """Bytes this rank holds in parameters, gradients and optimizer states.

    - ``parameters``: ``module.parameters()``;
    - ``gradients``: the ``.grad`` of the module's parameters and of the optimizers' parameters (ZeRO-1/2 shard
      parameters live only in the optimizer);
    - ``optimizer_states``: every tensor in ``optimizer.state``, except 0-dim ones (Adam's ``step`` counters: a few
      bytes, not part of the 8 bytes per parameter of the formula).

    Memory is counted by unique storage, whole: views into one flat buffer count once (with its padding), and a
    storage reached from two categories counts in the first of the order above. A DTensor counts by its local
    tensor; a freed storage (FSDP2 resizes unsharded parameters to 0) counts 0.

    Returns ``{"parameters": int, "gradients": int, "optimizer_states": int, "total": int,
    "by_device": {category: {device_type: int}}}`` (offloaded state shows under ``"cpu"``).
    """
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    optimizers = list(optimizers)

    params = list(module.parameters())
    opt_params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
    grads = [p.grad for p in (*params, *opt_params) if p.grad is not None]
    states = [t for opt in optimizers for t in _optimizer_tensors(opt)]

    seen: set[tuple[str, int]] = set()
    result: dict[str, Any] = {}
    by_device: dict[str, dict[str, int]] = {}
    for category, tensors in zip(CATEGORIES, (params, grads, states), strict=True):
        total, devices = 0, {}
        for tensor in tensors:
            local = _local(tensor)
            if local.device.type == "meta":
                continue
            storage = local.untyped_storage()
            key = (str(local.device), storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
            devices[local.device.type] = devices.get(local.device.type, 0) + storage.nbytes()
        result[category] = total
        by_device[category] = devices
    result["total"] = sum(result[c] for c in CATEGORIES)
    result["by_device"] = by_device
    return result


# ----------------------------------------------------------------------------------------------------------------------
# What the ZeRO paper predicts
# ----------------------------------------------------------------------------------------------------------------------
def zero_formula(stage: int, numel: int, n: int, tp: int = 1) -> dict[str, float]:
    """Bytes per rank for ``numel`` (Psi) fp32 parameters trained with Adam over ``n`` data-parallel ranks.

    Parameters 4 Psi (stage 3: 4 Psi/N), gradients 4 Psi (stages 2, 3: 4 Psi/N), optimizer states 8 Psi (two fp32
    moments; stages 1-3: 8 Psi/N). Padding of shards is not included.

    ``tp``: tensor-parallel ranks splitting the model below data parallel: every term is divided by ``tp`` too
    (params 4 Psi/tp; Adam states 8 Psi/(tp N) from stage 1; gradients 4 Psi/tp, or 4 Psi/(tp N) from stage 2).
    Parameters replicated over tp (norms) make the true share slightly larger; pass this rank's local element count
    (:func:`local_numel`) with ``tp=1`` for the exact figure.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    psi = float(numel) / tp
    out = {
        "parameters": 4 * psi / (n if stage >= 3 else 1),
        "gradients": 4 * psi / (n if stage >= 2 else 1),
        "optimizer_states": 8 * psi / (n if stage >= 1 else 1),
    }
    out["total"] = sum(out.values())
    return out


def local_numel(module: nn.Module) -> int:
    """Elements of ``module``'s parameters this rank holds: a DTensor's local tensor (under tensor parallel its shard,
    or its whole value where it is replicated -- the Psi/tp of the ZeRO formulas, exactly), a plain parameter whole;
    each parameter once."""
    return sum(_local(p).numel() for p in module.parameters())


def traffic_formula(stage: int, numel: int, n: int) -> float:
    """Elements each rank sends per optimizer step: ``2 Psi (N-1)/N`` for stages 0-2 (all-reduce, or
    reduce-scatter + all-gather), ``3 Psi (N-1)/N`` for stage 3 (parameters all-gathered in forward and again in
    backward, gradients reduce-scattered)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    return (3 if stage == 3 else 2) * float(numel) * (n - 1) / n


# ----------------------------------------------------------------------------------------------------------------------
# Activations saved for backward
# ----------------------------------------------------------------------------------------------------------------------
def _storage_key(tensor: Tensor) -> tuple[str, int]:
    local = _local(tensor)
    return str(local.device), local.untyped_storage().data_ptr()


class ActivationMeter:
    """Context manager measuring the activation memory autograd holds for backward, live and at its peak.

    Every tensor autograd saves (``saved_tensors_hooks``) is reduced to the storage that holds it (a DTensor's
    local shard) and counted once however many times it is saved, from when it is first saved until the last saved
    reference to it is released (after the backward that used it, or when the graph is dropped). Storages of
    ``exclude`` (pass the parameters) are not counted: weights are model state, not activations.

    ``peak_bytes``: the most held at once (over a pipeline step, what the micro-batches in flight hold: ``m`` of
    them for GPipe, at most ``p`` for 1F1B). ``seen_bytes`` and ``entries``: every storage saved while inside, once
    each (for one forward, the bytes its backward will need).
    """

    def __init__(self, exclude: Iterable[Tensor] = ()):
        self._skip = {_storage_key(t) for t in exclude}
        self._live: dict[tuple[str, int], list[int]] = {}  # storage -> [references held, bytes]
        self._seen: set[tuple[str, int]] = set()
        self.entries: list[dict] = []
        self.live_bytes = self.peak_bytes = self.seen_bytes = 0
        self._hooks: Any = None

    def _pack(self, tensor: Tensor) -> Any:
        key = _storage_key(tensor)
        if key in self._skip or tensor.device.type == "meta":
            return tensor
        local = _local(tensor)
        entry = self._live.setdefault(key, [0, local.untyped_storage().nbytes()])
        if key not in self._seen:
            self._seen.add(key)
            self.seen_bytes += entry[1]
            self.entries.append({"shape": tuple(local.shape), "dtype": str(local.dtype).removeprefix("torch."),
                                 "bytes": entry[1], "dtensor": local is not tensor})
        if entry[0] == 0:
            self.live_bytes += entry[1]
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        entry[0] += 1
        return _Saved(self, key, tensor)

    def _release(self, key: tuple[str, int]) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live_bytes -= entry[1]
            del self._live[key]

    def __enter__(self) -> "ActivationMeter":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._hooks.__exit__(*exc_info)


class _Saved:
    """One saved reference; autograd dropping it (after use) is what frees the activation."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, meter: ActivationMeter, key: tuple[str, int], tensor: Tensor):
        self.meter, self.key, self.tensor = meter, key, tensor

    def __del__(self) -> None:
        self.meter._release(self.key)


def _unpack(saved: Any) -> Tensor:
    return saved.tensor if isinstance(saved, _Saved) else saved


# ----------------------------------------------------------------------------------------------------------------------
# ZeRO-3: parameters gathered during forward; ZeRO-1/2: gradients held during backward
# ----------------------------------------------------------------------------------------------------------------------
def _storage_nbytes(tensors: Iterable[Tensor], seen: set[tuple[str, int]]) -> int:
    total = 0
    for tensor in tensors:
        local = _local(tensor)
        if local.device.type == "meta":
            continue
        storage = local.untyped_storage()
        key = (str(local.device), storage.data_ptr())
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def fsdp_groups(module: nn.Module) -> dict[str, list[Any]]:
    """The FSDP2 parameter groups inside ``module``: ``{name of the fully_shard-ed module: [FSDPParam, ...]}``.

    FSDP2 keeps a group's gathered (unsharded) parameters in per-parameter buffers (``FSDPParam.all_gather_outputs``
    and, with all-gather extensions, ``_unsharded_inner_tensors``) whose storage it allocates for the all-gather and
    resizes to 0 when it reshards; this reads them through those (private) attributes of torch 2.13.
    """
    from torch.distributed.fsdp import FSDPModule

    out: dict[str, list[Any]] = {}
    for name, sub in module.named_modules():
        if not isinstance(sub, FSDPModule):
            continue
        state = sub._get_fsdp_state()
        param_groups = getattr(state, "_fsdp_param_groups", None)
        if param_groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            param_groups = [single] if single is not None else []
        out[name] = [p for group in param_groups for p in group.fsdp_params]
    return out


def _gathered_tensors(fsdp_params: Iterable[Any]) -> list[Tensor]:
    return [t for p in fsdp_params
            for t in (*getattr(p, "all_gather_outputs", ()), *getattr(p, "_unsharded_inner_tensors", ()))]


class GatheredParamMeter:
    """Context manager measuring the parameter bytes ZeRO-3 (FSDP2) holds gathered during forward, at its peak.

    While inside, every module of ``module`` samples, when its forward starts and ends, the storage allocated for
    the unsharded parameters of every FSDP2 group (each storage once, padding included). A hook added later than
    FSDP2's runs after it: at a module's start its group is already gathered, at its end already freed, so the
    samples inside a block see that block gathered. The all-gather's transient flat receive buffer is not counted.

    ``peak_bytes``: the most gathered at once; ``peak_groups``: which groups were gathered then (names of the
    ``fully_shard``-ed modules, ``""`` for ``module`` itself); ``group_bytes``: each group's full size (its
    parameters' global element count x element size, without padding) -- the formula for one forward is the
    largest block plus the root group(s) kept gathered.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.groups = fsdp_groups(module)
        self.group_bytes = {
            name: sum(p.sharded_param.numel() * p.sharded_param.element_size() for p in params)
            for name, params in self.groups.items()
        }
        self.peak_bytes = 0
        self.peak_groups: list[str] = []
        self.samples = 0
        self._handles: list[Any] = []

    def live(self) -> tuple[int, list[str]]:
        """Bytes gathered now, and the groups holding any."""
        seen: set[tuple[str, int]] = set()
        total, holding = 0, []
        for name, params in self.groups.items():
            n = _storage_nbytes(_gathered_tensors(params), seen)
            if n:
                total += n
                holding.append(name)
        return total, holding

    def _sample(self, *_: Any) -> None:
        total, holding = self.live()
        self.samples += 1
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_groups = total, holding

    def __enter__(self) -> "GatheredParamMeter":
        for sub in self.module.modules():
            self._handles.append(sub.register_forward_pre_hook(self._sample))
            self._handles.append(sub.register_forward_hook(self._sample))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class GradientMeter:
    """Context manager measuring the gradient bytes held during backward, at the peak.

    Counted, each storage once: the ``.grad`` of ``module``'s parameters and of the optimizers' parameters (ZeRO-1/2
    shards), the gradient arriving for a parameter (before autograd stores it), and ``extra()`` -- buffers a
    gradient owner keeps aside, e.g. :meth:`ZeroPartitioner.gradient_buffers
    <lightning_par.parallel.zero.ZeroPartitioner.gradient_buffers>` (full bucket gradients, reduce-scatter outputs).
    Samples are taken whenever a parameter's gradient arrives (a tensor hook: before it is accumulated) and after it
    has been accumulated and handed on (a post-accumulate hook registered after the owner's), so the moments when
    buffers are allocated and before they are freed are both seen. Hooks sit on the parameters registered when the
    meter is made (not on FSDP2's unsharded parameters).
    """

    def __init__(self, module: nn.Module, optimizers: Iterable[torch.optim.Optimizer] = (),
                 extra: Callable[[], Iterable[Tensor]] | None = None) -> None:
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.optimizers = list(optimizers)
        self.extra = extra
        self.peak_bytes = 0
        self.samples = 0
        self._handles: list[Any] = []

    def live_bytes(self, arriving: Tensor | None = None) -> int:
        opt_params = [p for opt in self.optimizers for group in opt.param_groups for p in group["params"]]
        tensors = [p.grad for p in (*self.params, *opt_params) if p.grad is not None]
        tensors += list(self.extra()) if self.extra is not None else []
        if arriving is not None:
            tensors.append(arriving)
        return _storage_nbytes(tensors, set())

    def _sample(self, arriving: Tensor | None = None) -> None:
        self.samples += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes(arriving))

    def _on_grad(self, grad: Tensor) -> None:
        self._sample(grad)

    def __enter__(self) -> "GradientMeter":
        self._sample()
        for p in self.params:
            self._handles.append(p.register_hook(self._on_grad))
            self._handles.append(p.register_post_accumulate_grad_hook(lambda _p: self._sample()))
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
