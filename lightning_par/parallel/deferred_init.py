"""Deferred construction: build a model without memory, then materialise only the tensors this rank owns.

A strategy that must never hold the whole model on one rank (issue 10) runs the user's constructor under
:func:`deferred_init`, splits the resulting model into pipeline stages or shards, and asks the record for the
tensors it keeps::

    with deferred_init() as record:
        model = GPT(config)            # large tensors are `meta`: no memory; random init is recorded
    record.capture(model)              # fully-qualified names (FQNs) of the model as the constructor left it
    stage = copy.deepcopy(model)       # ... split on meta: drop the modules another rank owns ...
    record.materialize(stage, keep={"layers.2.attn.q_proj.weight", ...})

The kept tensors are bit-for-bit the tensors a single process would have built from the same RNG state (so a
parallel run starts exactly where a single-process run starts), and the RNG leaves the context in the state the
single process would have after construction.

How it works. Two modes are active while the constructor runs:

* a ``TorchDispatchMode`` sees every aten op. A factory op (``empty``, ``zeros``, ``randn``, ``arange``, ``*_like``,
  ...) whose output has at least ``threshold`` elements makes a ``meta`` tensor instead: a *deferred* tensor. Every
  op that writes a deferred tensor (``normal_``, ``uniform_``, ``fill_``, ``copy_``, ``mul_``, writes through views
  such as ``p.data[...]``), and every op that reads one to make a new tensor (``w * 2``, ``.to(bf16)``, ``clone``),
  is appended to a log, whose deferred tensor arguments are kept as (storage, dtype, size, stride, offset) and whose
  real tensor arguments (a ``copy_`` source) as values. Their results are deferred too. Small tensors are real, and
  every op that only touches real tensors runs eagerly, as usual, so constructors that compute buffers (rotary
  ``inv_freq`` from ``arange``) keep working and small tensors simply have their final values.
* a ``TorchFunctionMode`` makes deferred tensors look real to the constructor: ``is_meta`` is False, ``device`` is
  the device the tensor would have had, ``.to(that device)`` is the tensor itself. (Otherwise
  ``nn.init.trunc_normal_`` and ``orthogonal_`` would skip them as meta tensors.)

Random ops are the crux. A random op on a deferred tensor runs once, during construction, on a temporary of the same
dtype, size and strides (one reused buffer), so the RNG stream advances exactly as in a single process, and the
generator's state before the op is saved in the log. Replaying the op later from that state gives the same values
whichever other tensors are replayed, so :meth:`DeferredInit.materialize` replays only the log entries the kept
tensors depend on: it allocates just those tensors (plus, while needed, deferred intermediates they are computed
from, e.g. the fp32 original of a tensor cast to bf16), and non-owned tensors cost nothing. (Consuming the RNG at
materialisation instead, by replaying every random op from the state at the start, would cost the same RNG time, but
could not serve a constructor that must see random values, like ``trunc_normal_``'s rejection loop in torch 2.13.)

Data-dependent construction is handled: when the constructor needs a value of a deferred tensor (``.item()``,
``bool(t)``, ``tolist()``, an op with a data-dependent shape, an in-place op on a real tensor reading a deferred
one, the rejection loop of ``nn.init.trunc_normal_``), that value is computed from the log on the spot ("forced"),
with temporaries of its size. Refused, with :class:`DeferredInitError`: growing a deferred tensor's storage
(``resize_``); an op that writes deferred and real tensors at once, or writes a deferred tensor and also returns a
new one; modifying, after it was used, a large real tensor that the log keeps by reference (e.g. a ``copy_`` source).

Why our own and not torchdistx's ``deferred_init`` (the same idea): torchdistx is a C++ extension with its own
dispatch keys whose last release (0.2.0) dates from June 2022 and its nightlies from October 2022, so there are no
builds for the torch we use. Current torch gives us meta tensors and Python dispatch and function modes; with the
per-op RNG snapshot, the whole mechanism fits in this file.

Limits. Tensor subclasses (DTensor, quantised tensors) must not be created inside the context. Storage-level
identity checks (``untyped_storage().data_ptr()``) see 0 for deferred tensors. Generators are saved and restored with
``get_state``/``set_state``: CPU, and accelerators with ``default_generators`` (CUDA; tested on CPU only). The global
default dtype at each logged op is replayed with it. Values that construction leaves in ``empty`` memory are, as
eagerly, undefined.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from lightning_par._compat import DisableTorchFunction, TorchDispatchMode, parse_to, tree_flatten, tree_map

__all__ = ["DEFAULT_THRESHOLD", "DeferredInit", "DeferredInitError", "deferred_init"]

DEFAULT_THRESHOLD = 2**14
"""Factory outputs with at least this many elements are deferred (meta); smaller tensors are made for real."""

_aten = torch.ops.aten
_META = torch.device("meta")
# Ops that read only the metadata (dtype, device, shape, strides) of their tensor argument.
_TEMPLATE_OPS = frozenset({_aten.empty_like, _aten.zeros_like, _aten.ones_like, _aten.full_like, _aten.rand_like,
                           _aten.randn_like, _aten.randint_like, _aten.new_empty, _aten.new_empty_strided,
                           _aten.new_zeros, _aten.new_ones, _aten.new_full})
_RESIZE_OPS = frozenset({_aten.resize_, _aten.resize_as_})
_FAKED_GETTERS = frozenset({"is_meta", "device", "is_cpu", "is_cuda"})
_FACTORY_OPTIONS = frozenset({"dtype", "layout", "device", "pin_memory", "memory_format"})
_FORCING_METHODS = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__})


class DeferredInitError(RuntimeError):
    """A construction step that :func:`deferred_init` cannot record or replay faithfully."""


@dataclass(frozen=True)
class _Ref:
    """A deferred tensor in the log: a view of recorded storage ``sid``."""

    sid: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class _Template:
    """A tensor argument read only for its metadata (``zeros_like(x)``): replayed as a meta tensor."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Const:
    """A real tensor argument, kept by value: small ones cloned, large ones by reference (checked unchanged)."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor, threshold: int):
        if tensor.numel() < max(threshold, DEFAULT_THRESHOLD):
            self.tensor, self.version = tensor.detach().clone(), None
        else:  # the object itself: below autograd, detach() would not share its version counter
            self.tensor, self.version = tensor, tensor._version

    def value(self) -> torch.Tensor:
        if self.version is not None and self.tensor._version != self.version:
            raise DeferredInitError(
                f"a real tensor (shape {list(self.tensor.shape)}, {self.tensor.dtype}) that construction used as an "
                "input of a deferred tensor was modified in place afterwards; its original value is lost")
        return self.tensor.detach()


@dataclass
class _Op:
    """One log entry: ``func(*args, **kwargs)`` with deferred tensors as _Ref, real ones as _Const."""

    func: Any
    args: tuple
    kwargs: dict
    reads: frozenset[int]  # storages whose values the op reads
    writes: tuple[int, ...]  # storages it writes: mutated arguments, or the fresh storages of its outputs
    outputs: tuple[tuple[int, int, _Ref], ...]  # (leaf index in the flattened result, sid, ref) of fresh outputs
    rng: tuple[torch.Generator, torch.Tensor] | None  # generator and its state before a random op
    default_dtype: torch.dtype  # what a factory's dtype=None meant (torch.set_default_dtype, precision contexts)


@dataclass
class _Storage:
    device: torch.device  # where the storage would have been allocated
    nbytes: int
    keepalive: Any  # the meta storage: its address identifies the storage while we hold it


@dataclass
class _Entry:
    """A parameter or buffer of the captured module."""

    ref: _Ref | None  # deferred tensors
    tensor: torch.Tensor | None  # real tensors (their values are final)
    version: int | None


def deferred_init(threshold: int = DEFAULT_THRESHOLD) -> DeferredInit:
    """A :class:`DeferredInit` recorder, to be used as ``with deferred_init() as record: model = Model(...)``.

    Args:
        threshold: tensors made by factory ops with at least this many elements are deferred (created on meta);
            smaller ones are real. 0 defers every tensor.
    """
    return DeferredInit(threshold)


class DeferredInit:
    """Records a model's construction so that any subset of its parameters and buffers can be built later.

    Use as a context manager around the constructor (once), then :meth:`capture` the constructed module (or let the
    first :meth:`materialize` capture the module it is given) and :meth:`materialize` the tensors a rank owns, by
    fully-qualified name, into the original module or a copy of it (a pipeline stage made by ``copy.deepcopy`` of
    the meta model has the same names but new tensor objects).

    Attributes:
        threshold: see :func:`deferred_init`.
        stats: counters for tests and benchmarks: ``ops`` (log entries), ``deferred_bytes`` (bytes of all deferred
            storages), ``forced`` (values computed during construction), ``max_temporary_bytes`` (largest temporary
            made during construction); after :meth:`materialize`: ``replayed`` (ops run), ``kept_bytes`` (bytes of
            the deferred storages materialised) and ``peak_bytes`` (most bytes held at once while replaying).
    """

    def __init__(self, threshold: int = DEFAULT_THRESHOLD):
        if threshold < 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        self.threshold = threshold
        self._ops: list[_Op] = []
        self._storages: list[_Storage] = []
        self._sid_by_key: dict[int, int] = {}
        self._entries: dict[str, _Entry] | None = None
        self._modes: tuple[_FunctionMode, _DispatchMode] | None = None
        self._used = False
        self._scratch: dict[torch.device, torch.UntypedStorage] = {}
        self._kept: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # real tensors put on meta: (tensor, value)
        self.stats: dict[str, int] = {"ops": 0, "deferred_bytes": 0, "forced": 0, "max_temporary_bytes": 0}

    # ------------------------------------------------------------------ public API

    def __enter__(self) -> DeferredInit:
        if self._used:
            raise RuntimeError("a DeferredInit records one construction; make a new one with deferred_init()")
        self._used = True
        self._modes = (_FunctionMode(self), _DispatchMode(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        function_mode, dispatch_mode = self._modes
        dispatch_mode.__exit__(*exc)
        function_mode.__exit__(*exc)
        self._modes = None
        self._scratch.clear()

    @property
    def fqns(self) -> tuple[str, ...]:
        """Names of the captured module's parameters and buffers (tied ones under each name), in module order."""
        if self._entries is None:
            raise RuntimeError("no module captured yet: call capture(module) (or materialize(module))")
        return tuple(self._entries)

    def to_meta(self, registered: Iterable[tuple[torch.nn.Module, str, torch.Tensor]]) -> None:
        """After the construction, before :meth:`capture`: the real tensors registered during it (``(module, name,
        tensor)``: small parameters and buffers, made for real) replaced in their modules by meta ones, their values
        kept for :meth:`materialize` -- every tensor of the model then waits on meta, as under
        ``torch.device("meta")``. A tensor registered under several names stays one."""
        if self._modes is not None:
            raise RuntimeError("to_meta() must be called after the deferred_init() context has exited")
        made: dict[int, torch.Tensor] = {}
        for module, name, tensor in registered:
            is_param = module._parameters.get(name) is tensor
            if tensor.is_meta or not (is_param or module._buffers.get(name) is tensor):
                continue  # deferred already, or replaced since
            if id(tensor) not in made:
                meta = torch.empty_like(tensor.detach(), device=_META)
                made[id(tensor)] = torch.nn.Parameter(meta, tensor.requires_grad) if is_param else meta
                self._kept[id(made[id(tensor)])] = (made[id(tensor)], tensor.detach())
            (module._parameters if is_param else module._buffers)[name] = made[id(tensor)]

    @property
    def kept(self) -> list[torch.Tensor]:
        """The values of the tensors :meth:`to_meta` put on meta, in its order (every rank built them alike)."""
        return [value for _, value in self._kept.values()]

    def capture(self, module: torch.nn.Module) -> tuple[str, ...]:
        """Remember the parameters and buffers of ``module`` as construction left them, by name; returns the names.

        Call it after the ``with`` block, before the module is split or copied; names are relative to ``module``.
        """
        if self._modes is not None:
            raise RuntimeError("capture() must be called after the deferred_init() context has exited")
        entries = {}
        for name, tensor in itertools.chain(module.named_parameters(remove_duplicate=False),
                                            module.named_buffers(remove_duplicate=False)):
            if self._is_deferred(tensor):
                entries[name] = _Entry(self._ref(tensor), None, None)
            elif id(tensor) in self._kept:
                value = self._kept[id(tensor)][1]
                entries[name] = _Entry(None, value, value._version)
            else:
                entries[name] = _Entry(None, tensor, tensor._version)
        self._entries = entries
        return tuple(entries)

    def materialize(self, module: torch.nn.Module,
                    keep: Iterable[str] | Callable[[str], bool] | None = None,
                    device: torch.device | str | None = None) -> torch.nn.Module:
        """Give ``module`` real values for the kept parameters and buffers, and meta tensors for the others.

        Args:
            module: the captured module, or a copy of it with some submodules removed; tensors are found by name.
                Names that the module no longer has are skipped.
            keep: captured names to materialise (an iterable, or a predicate on names); None keeps all.
            device: where the kept tensors go; by default where construction would have put them. Values are always
                computed where construction would have computed them (so that they equal a single process's).

        Returns ``module``. Tied parameters kept under several names stay one Parameter. Only the kept tensors, and
        deferred tensors they were computed from, are allocated. The global RNG state is left as it was.
        """
        if self._modes is not None:
            raise RuntimeError("materialize() must be called after the deferred_init() context has exited")
        if self._entries is None:
            self.capture(module)
        keep_set = self._resolve_keep(keep)
        device = torch.device(device) if device is not None else None
        wanted = {self._entries[name].ref.sid for name in keep_set if self._entries[name].ref is not None}
        stores = self._replay(wanted, stats=True)
        self.stats["kept_bytes"] = sum(stores[sid].nbytes() for sid in wanted)

        made: dict[tuple, torch.Tensor] = {}  # one tensor (and one Parameter) per storage view: ties stay tied
        for name, entry in self._entries.items():
            owner_name, _, leaf = name.rpartition(".")
            try:
                owner = module.get_submodule(owner_name)
            except AttributeError:
                continue
            is_param = leaf in owner._parameters
            current = owner._parameters.get(leaf) if is_param else owner._buffers.get(leaf)
            if current is None:
                continue
            ident = (entry.ref,) if entry.ref is not None else ("real", id(entry.tensor))
            if name in keep_set:
                key = ("keep", *ident, is_param)
                if key not in made:
                    if entry.ref is not None:
                        value = _view(stores[entry.ref.sid], entry.ref)
                    elif not current.is_meta:  # real since construction: it has its value
                        if device is None or current.device == device:
                            continue
                        value = current.detach()
                    else:
                        if entry.tensor._version != entry.version:
                            raise DeferredInitError(f"{name} was modified in place after capture()")
                        value = entry.tensor.detach()
                    if device is not None:
                        value = value.to(device)
                    made[key] = _wrap(value, current, is_param)
            else:
                if current.is_meta:
                    continue
                key = ("meta", *ident, is_param)
                if key not in made:
                    made[key] = _wrap(torch.empty_strided(current.shape, current.stride(), dtype=current.dtype,
                                                          device=_META), current, is_param)
            (owner._parameters if is_param else owner._buffers)[leaf] = made[key]
        return module

    def value(self, name: str) -> torch.Tensor:
        """The full value of the captured tensor ``name``, as a single process would have built it, computed alone
        (replaying only the log entries it depends on; the RNG state is left as it was)."""
        if self._entries is None:
            raise RuntimeError("no module captured yet: call capture(module) first")
        if name not in self._entries:
            raise KeyError(f"{name} is not a parameter or buffer of the captured module")
        entry = self._entries[name]
        if entry.ref is None:
            return entry.tensor.detach()
        return _view(self._replay({entry.ref.sid})[entry.ref.sid], entry.ref)

    def random_states(self) -> list[torch.Tensor]:
        """The generator state recorded before each random op of the construction, in order."""
        return [op.rng[1] for op in self._ops if op.rng is not None]

    def use_random_states(self, states: list[torch.Tensor]) -> None:
        """Replay the random ops from ``states`` (another rank's :meth:`random_states`) instead of this rank's own:
        ranks that built the same model from different RNG states then materialise the same values."""
        ops = [op for op in self._ops if op.rng is not None]
        if len(ops) != len(states):
            raise DeferredInitError(f"the construction made {len(ops)} random draws here and {len(states)} on the "
                                    "rank whose draws every rank takes: the model is built differently on each rank")
        for op, state in zip(ops, states, strict=True):
            op.rng = (op.rng[0], state)

    # ------------------------------------------------------------------ bookkeeping

    def _resolve_keep(self, keep) -> set[str]:
        if keep is None:
            return set(self._entries)
        if callable(keep):
            return {name for name in self._entries if keep(name)}
        if isinstance(keep, str):
            raise TypeError("keep must be an iterable of names or a predicate, not a single string")
        keep_set = set(keep)
        unknown = sorted(keep_set - set(self._entries))
        if unknown:
            raise KeyError(f"not parameters or buffers of the captured module: {unknown[:5]}"
                           + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else ""))
        return keep_set

    def _key(self, t: torch.Tensor) -> int | None:
        try:
            return t.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested, wrapper subclasses)
            return None

    def _is_deferred(self, t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_meta and self._key(t) in self._sid_by_key

    def _ref(self, t: torch.Tensor) -> _Ref:
        return _Ref(self._sid_by_key[self._key(t)], t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset())

    def _device_of(self, t: torch.Tensor) -> torch.device:
        """The device ``t`` has, or for a deferred tensor would have had."""
        if self._is_deferred(t):
            return self._storages[self._sid_by_key[self._key(t)]].device
        return t.device

    def _new_storage(self, t: torch.Tensor, device: torch.device) -> int:
        storage = t.untyped_storage()
        sid = len(self._storages)
        self._storages.append(_Storage(device, storage.nbytes(), storage))
        self._sid_by_key[storage._cdata] = sid
        self.stats["deferred_bytes"] += storage.nbytes()
        return sid

    def _encode(self, func, args, kwargs, device: torch.device | None):
        """Log form of an op's arguments, and the storages it reads."""
        reads = set()
        template = func.overloadpacket in _TEMPLATE_OPS

        def enc(x):
            if not isinstance(x, torch.Tensor):
                return x
            if self._is_deferred(x):
                ref = self._ref(x)
                reads.add(ref.sid)
                return ref
            return _Const(x, self.threshold)

        args, kwargs = tuple(args), dict(kwargs)
        if template:  # its tensor is a template: only its metadata is read
            t = args[0]
            args = (_Template(t.dtype, tuple(t.shape), tuple(t.stride())), *args[1:])
            if kwargs.get("device") is None:
                kwargs["device"] = device
        return tree_map(enc, args), tree_map(enc, kwargs), frozenset(reads)

    def _target_device(self, args, kwargs) -> torch.device:
        if kwargs.get("device") is not None:
            return torch.device(kwargs["device"])
        for x in tree_flatten((args, kwargs))[0]:
            if isinstance(x, torch.Tensor):
                return self._device_of(x)
        return torch.device("cpu")

    def _record(self, func, args, kwargs, device, writes=(), out=None, rng=None) -> None:
        """Append an op to the log; the tensors of ``out`` (a meta result) become new deferred storages."""
        eargs, ekwargs, reads = self._encode(func, args, kwargs, device)
        outputs = []
        if out is not None:
            for i, t in enumerate(tree_flatten(out)[0]):
                if isinstance(t, torch.Tensor):
                    sid = self._new_storage(t, device)
                    outputs.append((i, sid, self._ref(t)))
            writes = tuple(sid for _, sid, _ in outputs)
        self._ops.append(_Op(func, eargs, ekwargs, reads, tuple(writes), tuple(outputs), rng,
                             torch.get_default_dtype()))
        self.stats["ops"] += 1

    # ------------------------------------------------------------------ the modes' handlers

    def _on_function(self, func, args, kwargs):
        if getattr(func, "__name__", None) == "__get__":
            attr = getattr(getattr(func, "__self__", None), "__name__", None)
            if attr in _FAKED_GETTERS and args and self._is_deferred(args[0]):
                dev = self._device_of(args[0])
                faked = {"is_meta": False, "device": dev, "is_cpu": dev.type == "cpu", "is_cuda": dev.type == "cuda"}
                return faked[attr]
        elif args and self._is_deferred(args[0]):
            t = args[0]
            if func is torch.Tensor.get_device:
                dev = self._device_of(t)
                return -1 if dev.type == "cpu" else (dev.index if dev.index is not None else 0)
            if func is torch.Tensor.to:
                return self._to(t, *args[1:], **kwargs)
            if func is torch.Tensor.cpu:
                return self._to(t, "cpu")
            if func is torch.Tensor.cuda:
                return self._to(t, args[1] if len(args) > 1 else kwargs.get("device", "cuda"))
            if func is torch.Tensor.new_tensor:
                kwargs = {"dtype": t.dtype, "device": self._device_of(t), **kwargs}
                return torch.tensor(*args[1:], **kwargs)
            if func in _FORCING_METHODS:
                with DisableTorchFunction():
                    forced = self._force(t)
                return func(forced, *args[1:], **kwargs)
        elif func is torch.Tensor.to and len(args) > 1 and self._is_deferred(args[1]):  # x.to(deferred_other)
            other = args[1]
            return func(args[0], self._device_of(other), other.dtype, *args[2:], **kwargs)
        if func is torch.where and len(args) == 3 and any(self._is_deferred(a) for a in args):
            # torch.where(cond, x, float("-inf")) wraps the number into a 0-dim tensor on x's device, meta here:
            # its value would be lost to the replay (MiniMax's decay mask). A 0-dim CPU tensor keeps it, and
            # promotes as the number would (a dimensionless operand does not change the result's dtype category)
            args = tuple(torch.tensor(a) if isinstance(a, (bool, int, float)) else a for a in args)
        return func(*args, **kwargs)

    def _to(self, t, *args, **kwargs):
        """``Tensor.to`` of a deferred tensor: itself when nothing changes, else a deferred copy."""
        if args and isinstance(args[0], torch.Tensor):
            args = (self._device_of(args[0]), args[0].dtype, *args[1:])
        copy = kwargs.pop("copy", False)
        device, dtype, non_blocking, memory_format = parse_to(*args, **kwargs)
        here = self._device_of(t)
        device = here if device is None else _normalize(device)
        dtype = t.dtype if dtype is None else dtype
        memory_format = torch.preserve_format if memory_format is None else memory_format
        if device == _normalize(here) and dtype == t.dtype and memory_format == torch.preserve_format and not copy:
            return t
        return _aten._to_copy.default(t, dtype=dtype, device=device, non_blocking=non_blocking,
                                      memory_format=memory_format)

    def _on_dispatch(self, func, args, kwargs):
        flat = tree_flatten((args, kwargs))[0]
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        deferred = [t for t in tensors if self._is_deferred(t)]
        packet = func.overloadpacket
        if torch.Tag.inplace_view in func.tags:  # t_, transpose_, set_, resize_, ...: metadata, not values
            if packet in _RESIZE_OPS and deferred:
                before = deferred[0].untyped_storage().nbytes()
                out = func(*args, **kwargs)
                if deferred[0].untyped_storage().nbytes() != before:
                    raise DeferredInitError(f"{func} grows a deferred tensor's storage; that cannot be replayed")
                return out
            return func(*args, **kwargs)
        mutated = _mutated_args(func, args, kwargs)
        if not mutated and func.is_view:
            return func(*args, **kwargs)
        random = torch.Tag.nondeterministic_seeded in func.tags

        if mutated:
            mutated_deferred = [t for t in mutated if self._is_deferred(t)]
            if not mutated_deferred:  # writes real tensors: run now, on real values
                if deferred:
                    args, kwargs = self._force_tree((args, kwargs))
                return func(*args, **kwargs)
            if len(mutated_deferred) != len(mutated):
                raise DeferredInitError(f"{func} writes deferred and real tensors at once; not supported")
            result = _inplace_result(func, args, kwargs)
            rng = None
            if random:
                rng = self._consume(func, args, kwargs, temporaries={id(t) for t in mutated})
            self._record(func, args, kwargs, self._device_of(mutated[0]), writes=tuple(
                dict.fromkeys(self._sid_by_key[self._key(t)] for t in mutated)), rng=rng)
            return result

        template = packet in _TEMPLATE_OPS
        if template or not tensors:  # a factory
            device = self._target_device(args, kwargs)
            if device.type == "meta":  # asked for meta explicitly: not ours to defer
                return func(*args, **kwargs)
            margs, mkwargs = _metaize(func, args, kwargs, force_device=True)
            out = func(*margs, **mkwargs)
            leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if not all(t.is_meta for t in leaves):  # an op without a device argument: it made real tensors
                return out
            if all(t.numel() < self.threshold for t in leaves):
                rargs, rkwargs = self._realize_template(func, args, kwargs, device)
                return func(*rargs, **rkwargs)
            rng = self._consume(func, args, kwargs, template_device=device, meta_out=out) if random else None
            self._record(func, args, kwargs, device, out=out, rng=rng)
            return out

        if deferred:  # reads deferred tensors: defer the result too, unless its value is needed now
            if all(str(r.type).startswith("Tensor") for r in func._schema.returns) and func._schema.returns:
                try:
                    margs, mkwargs = _metaize(func, args, kwargs)
                    out = func(*margs, **mkwargs)
                except Exception:  # no meta kernel, or a data-dependent shape: compute it
                    out = None
                if out is not None:
                    rng = self._consume(func, args, kwargs) if random else None
                    self._record(func, args, kwargs, self._target_device(args, kwargs), out=out, rng=rng)
                    return out
            args, kwargs = self._force_tree((args, kwargs))
            return func(*args, **kwargs)

        # real inputs only: run now; a large result (torch.outer of two small vectors, ...) is deferred
        rng = None
        if random:
            gen = self._generator(func, args, kwargs, self._target_device(args, kwargs))
            rng = (gen, gen.get_state())
        out = func(*args, **kwargs)
        leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if leaves and any(t.numel() >= self.threshold for t in leaves) and all(not t.is_meta for t in leaves):
            meta_out = tree_map(lambda x: _meta_like(x) if isinstance(x, torch.Tensor) else x, out)
            self._record(func, args, kwargs, self._target_device(args, kwargs), out=meta_out, rng=rng)
            return meta_out
        return out

    # ------------------------------------------------------------------ random ops, forcing, replay

    def _generator(self, func, args, kwargs, device: torch.device) -> torch.Generator:
        gen = _bound_arg(func, args, kwargs, "generator")
        if gen is not None:
            return gen
        if device.type == "cpu":
            return torch.default_generator
        module = torch.get_device_module(device.type)
        return module.default_generators[device.index if device.index is not None else module.current_device()]

    def _consume(self, func, args, kwargs, temporaries=(), template_device=None, meta_out=None):
        """Run a random op now, on temporaries, so the RNG advances as in a single process; return its RNG state."""
        template = args[0] if func.overloadpacket in _TEMPLATE_OPS else None
        out_overload = _out_overload(func) if meta_out is not None and template is None else None
        if out_overload is not None:  # a factory (randn, rand, randint, ...): into the scratch buffer, via its out=
            kwargs = {k: v for k, v in kwargs.items() if k not in _FACTORY_OPTIONS}
            kwargs["out"] = self._scratch_tensor(meta_out, template_device)
            func = out_overload

        scratch_used = []

        def real(x):
            if not isinstance(x, torch.Tensor) or x is template:
                return x
            if id(x) in temporaries:
                if scratch_used:
                    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=self._device_of(x))
                scratch_used.append(x)
                return self._scratch_tensor(x, self._device_of(x))
            return self._force(x) if self._is_deferred(x) else x

        if template_device is not None:
            args, kwargs = self._realize_template(func, args, kwargs, template_device)
            device = template_device
        else:
            device = self._device_of(next(t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)))
        args, kwargs = tree_map(real, (tuple(args), dict(kwargs)))
        gen = self._generator(func, args, kwargs, device)
        state = gen.get_state()
        out = func(*args, **kwargs)
        temps = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tree_flatten((args, kwargs, out))[0]
                 if isinstance(t, torch.Tensor) and not t.is_meta}
        temp_bytes = sum(temps.values())
        self.stats["max_temporary_bytes"] = max(self.stats["max_temporary_bytes"], temp_bytes)
        return gen, state

    def _scratch_tensor(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A temporary with the layout of meta ``t`` on ``device``, in a buffer reused by all random ops.

        Reusing one buffer, rather than allocating and freeing one per op, keeps the allocator from holding on to the
        freed temporaries (glibc keeps freed heap memory resident), so construction's memory stays one temporary.
        """
        extent = 0 if 0 in t.shape else 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
        nbytes = extent * t.element_size()
        storage = self._scratch.get(device)
        if storage is None or storage.nbytes() < nbytes:
            self._scratch.pop(device, None)
            storage = self._scratch[device] = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        return torch.empty(0, dtype=t.dtype, device=device).set_(storage, 0, tuple(t.shape), tuple(t.stride()))

    def _realize_template(self, func, args, kwargs, device):
        """Arguments to make a factory op's output for real: a deferred template becomes meta, device explicit."""
        if func.overloadpacket in _TEMPLATE_OPS and self._is_deferred(args[0]):
            kwargs = dict(kwargs)
            if kwargs.get("device") is None:
                kwargs["device"] = device
        return tuple(args), kwargs

    def _force_tree(self, tree):
        return tree_map(lambda x: self._force(x) if self._is_deferred(x) else x, tree)

    def _force(self, t: torch.Tensor) -> torch.Tensor:
        """The value of deferred tensor ``t``, computed now from the log."""
        ref = self._ref(t)
        self.stats["forced"] += 1
        return _view(self._replay({ref.sid})[ref.sid], ref)

    def _replay(self, wanted: set[int], stats: bool = False) -> dict[int, torch.UntypedStorage]:
        """Run the log entries that storages ``wanted`` depend on; return those storages (real)."""
        ops = self._ops
        run, needed = [False] * len(ops), set(wanted)
        for i in range(len(ops) - 1, -1, -1):
            if needed.intersection(ops[i].writes):
                run[i] = True
                needed |= ops[i].reads
        last_use = {}
        for i, op in enumerate(ops):
            if run[i]:
                for sid in itertools.chain(op.reads, op.writes):
                    last_use[sid] = i
        generators = {id(op.rng[0]): op.rng[0] for i, op in enumerate(ops) if run[i] and op.rng is not None}
        saved = {key: gen.get_state() for key, gen in generators.items()}
        default_dtype = torch.get_default_dtype()
        stores: dict[int, torch.UntypedStorage] = {}
        live = peak = replayed = 0
        try:
            with torch.no_grad(), DisableTorchFunction():
                for i, op in enumerate(ops):
                    if not run[i]:
                        continue
                    replayed += 1
                    resolve = _resolver(stores)
                    args, kwargs = tree_map(resolve, (op.args, op.kwargs))
                    if op.rng is not None:
                        op.rng[0].set_state(op.rng[1])
                    if op.default_dtype != torch.get_default_dtype():
                        torch.set_default_dtype(op.default_dtype)
                    out = tree_flatten(op.func(*args, **kwargs))[0]
                    for leaf, sid, ref in op.outputs:
                        stores[sid] = _conform(out[leaf], ref, self._storages[sid].nbytes)
                        live += stores[sid].nbytes()
                    peak = max(peak, live)
                    for sid in set(itertools.chain(op.reads, op.writes)):
                        if last_use[sid] == i and sid not in wanted and sid in stores:
                            live -= stores.pop(sid).nbytes()
        finally:
            torch.set_default_dtype(default_dtype)
            for key, gen in generators.items():
                gen.set_state(saved[key])
        if stats:
            self.stats.update(replayed=replayed, peak_bytes=peak)
        missing = wanted - stores.keys()
        if missing:
            raise DeferredInitError(f"internal error: no log entry creates deferred storages {sorted(missing)}")
        return stores


class _FunctionMode(TorchFunctionMode):
    def __init__(self, record: DeferredInit):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.record._on_function(func, args, kwargs or {})


class _DispatchMode(TorchDispatchMode):
    def __init__(self, record: DeferredInit):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        with DisableTorchFunction():
            return self.record._on_dispatch(func, args, kwargs or {})


# ---------------------------------------------------------------------- helpers


def _normalize(device) -> torch.device:
    device = torch.device(device)
    if device.type not in ("cpu", "meta") and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


def _bound_arg(func, args, kwargs, name: str):
    for i, arg in enumerate(func._schema.arguments):
        if arg.name == name:
            return args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(name)
    return None


def _mutated_args(func, args, kwargs) -> list[torch.Tensor]:
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        out.extend(v for v in values if isinstance(v, torch.Tensor))
    return out


def _inplace_result(func, args, kwargs):
    """What an op that only writes its arguments returns: those arguments (by alias set)."""
    schema = func._schema
    results = []
    for ret in schema.returns:
        if ret.alias_info is None or not ret.alias_info.is_write:
            raise DeferredInitError(f"{func} writes a deferred tensor and also returns a new one; not supported")
        for i, arg in enumerate(schema.arguments):
            if arg.alias_info is not None and arg.alias_info.before_set == ret.alias_info.before_set:
                results.append(args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name))
                break
    if not results:
        return None
    return results[0] if len(results) == 1 else tuple(results)


def _out_overload(func):
    """The ``out=`` overload of a factory op (``randn.default`` -> ``randn.out``), or None."""
    name = func._overloadname
    out = getattr(func.overloadpacket, "out" if name == "default" else f"{name}_out", None)
    return out if out is not None and any(a.name == "out" for a in out._schema.arguments) else None


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=_META)


def _metaize(func, args, kwargs, force_device: bool = False):
    """The op's arguments with real tensors replaced by meta ones and the device by meta (shapes only)."""
    args, kwargs = tree_map(lambda x: _meta_like(x) if isinstance(x, torch.Tensor) and not x.is_meta else x,
                            (tuple(args), dict(kwargs)))
    if kwargs.get("device") is not None or (force_device and any(a.name == "device" for a in func._schema.arguments)):
        kwargs["device"] = _META
    return args, kwargs


def _view(storage: torch.UntypedStorage, ref: _Ref) -> torch.Tensor:
    return torch.empty(0, dtype=ref.dtype, device=storage.device).set_(storage, ref.offset, ref.size, ref.stride)


def _resolver(stores):
    def resolve(x):
        if isinstance(x, _Ref):
            return _view(stores[x.sid], x)
        if isinstance(x, _Const):
            return x.value()
        if isinstance(x, _Template):
            return torch.empty_strided(x.size, x.stride, dtype=x.dtype, device=_META)
        return x
    return resolve


def _conform(t: torch.Tensor, ref: _Ref, nbytes: int) -> torch.UntypedStorage:
    """The storage of a replayed output, in the layout recorded for it (meta kernels may choose other strides)."""
    if t.dtype != ref.dtype or tuple(t.shape) != ref.size:
        raise DeferredInitError(f"replay produced {t.dtype}{list(t.shape)}, construction {ref.dtype}{list(ref.size)}")
    if tuple(t.stride()) == ref.stride and t.storage_offset() == ref.offset:
        return t.untyped_storage()
    storage = torch.empty(nbytes, dtype=torch.uint8, device=t.device).untyped_storage()
    _view(storage, ref).copy_(t)
    return storage


def _wrap(value: torch.Tensor, current: torch.Tensor, is_param: bool) -> torch.Tensor:
    if not is_param:
        return value
    param = torch.nn.Parameter(value, requires_grad=current.requires_grad)
    param.__dict__.update(getattr(current, "__dict__", {}))
    return param
