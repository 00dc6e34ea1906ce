"""Check, before the split, that a model's forward is the chain of its pipeline units: a pipeline never changes the
function a model computes.

A pipeline stage passes on one tensor, its last unit's output, and every stage runs the model's own forward with
the other stages' units removed (:mod:`.split`, :mod:`.adapter`). That computes the model's function only when the
forward *is* the chain of its units at every stage boundary: the first unit of each later stage takes exactly the
output of the unit before it, nothing computed from an earlier stage's units is used after that (a skip connection
from the embedding to after the blocks would see the removed unit's stand-in on a later stage: zeros, ``None`` or a
pass-through), and the model's output is its last unit's output. A model that is not a chain would otherwise train
under pp > 1 with another loss than in one process, and no error.

:func:`check_chain` verifies this by running the whole model once on a parameter-free copy on the meta device (no
memory, no compute: shapes only) with a tiny input, recording with module hooks which tensor each unit receives and
returns, and with a ``TorchFunctionMode`` which units' outputs every tensor computed in between derives from. It is
single-process and deterministic -- the same model gives the same verdict on every rank -- so it runs on every rank
before any rank waits on a collective (:class:`~.runtime.PipelineRuntime`), on the deferred (meta) model, before the
split, and raises a :class:`~lightning_par.topology.LayoutError` naming the unit whose output is used out of order.

Where the units join (which glue between units is allowed) depends on how a later stage is fed
(:func:`~.split.feeds_by_injection`):

* models fed with hidden states (``pipeline_units()`` models take them positionally, Hugging Face models as
  ``inputs_embeds``): the received activation takes the place of the first unit's output, so from there on every
  unit must take the previous unit's output unchanged (a Gemma-style ``embeddings * normalizer`` between the
  embedding and the first layer would be applied again on every later stage);
* models fed by injection (plain models: the activation replaces the first input of a stage's first unit): what the
  forward computes before that unit on a later stage is discarded, so the units of stage 0 may be combined freely
  (``tok_emb(ids) + pos_emb(positions)``) and the chain is required from the end of stage 0 on.

Value-preserving steps between units are accepted: a view covering the same elements (Hugging Face slices the
hidden states for ``logits_to_keep``), a dtype cast or copy (``.float()``, ``.to(dtype)``, ``.contiguous()``), as
long as nothing modifies the tensor in place in between. Tensors that depend only on the model's input and on
modules outside every unit (positions, masks, rotary tables) may be used anywhere; so may metadata (shape, dtype,
device) of any tensor.
"""

from __future__ import annotations

import inspect
import re
import time
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_par._compat import tree_leaves
from lightning_par.parallel.pipeline.adapter import StageIO, first_tensor, stage_io
from lightning_par.parallel.pipeline.split import feeds_by_injection, meta_copy
from lightning_par.topology import LayoutError

#: the trial input: a batch of 2 sequences of 4 tokens (the meta device allocates nothing, so size is no cost)
TRIAL_SHAPE = (2, 4)

# Ops whose result depends on a tensor argument's metadata only (shape, dtype, device), not on its values.
_METADATA_ONLY = {
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like,
    torch.randint_like, Tensor.new_zeros, Tensor.new_ones, Tensor.new_empty, Tensor.new_full, Tensor.new_tensor,
}
# Ops whose result has the values of their first argument (when the shape is kept): a cast or a copy.
_VALUE_PRESERVING = {
    Tensor.to, Tensor.float, Tensor.double, Tensor.half, Tensor.bfloat16, Tensor.type, Tensor.type_as,
    Tensor.contiguous, Tensor.clone, torch.clone,
}
# Ops taking a second tensor for its dtype/device only.
_FIRST_ONLY = {Tensor.to, Tensor.type_as}
# Ops that read a tensor's values into Python (control flow on them): answered from the real shadow (see _Flow).
_VALUE_QUERIES = {
    Tensor.item, Tensor.__bool__, Tensor.tolist, Tensor.__int__, Tensor.__float__, Tensor.__index__, Tensor.equal,
    torch.equal, torch.is_nonzero, Tensor.is_nonzero,
}
_META = torch.device("meta")
#: ops whose meta kernel takes bfloat16 only while the CPU kernel takes any float (torch's grouped matmul, which
#: Hugging Face's mixture-of-experts layers call): on meta they run in bfloat16, their output cast back
_BF16_ON_META = {"_grouped_mm", "grouped_mm"}


def _in_bf16(func, args: tuple, kwargs: dict) -> Any:
    """``func`` of :data:`_BF16_ON_META` on meta tensors cast to bfloat16, its floating outputs cast back to the
    inputs' dtype (shapes only: the meta device computes nothing); None for any other op or input."""
    floats = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.is_floating_point()]
    if (getattr(func, "__name__", None) not in _BF16_ON_META or not floats
            or any(t.device.type != "meta" or t.dtype == torch.bfloat16 for t in floats)):
        return None
    dtype = floats[0].dtype

    def cast(value: Any, to: torch.dtype) -> Any:
        if isinstance(value, Tensor) and value.is_floating_point():
            return value.to(to)
        if isinstance(value, (tuple, list)):
            return type(value)(cast(v, to) for v in value)
        if isinstance(value, dict):
            return {k: cast(v, to) for k, v in value.items()}
        return value

    return cast(func(*cast(args, torch.bfloat16), **cast(kwargs, torch.bfloat16)), dtype)


def _to_cpu_device(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "meta" or isinstance(value, str) and value == "meta":
        return torch.device("cpu")
    return value


def _same_view(out: Tensor, source: Tensor) -> bool:
    """Whether ``out`` is a view of ``source``'s elements with the same geometry (the same values)."""
    base_out = out._base if out._base is not None else out
    base_src = source._base if source._base is not None else source
    return (base_out is base_src and out.dtype == source.dtype and out.shape == source.shape
            and out.stride() == source.stride() and out.storage_offset() == source.storage_offset())


class _Flow(TorchFunctionMode):
    """Tracks, for every tensor the forward computes, the units whose outputs it derives from (``origin``) and,
    for a cast, copy or same-geometry view, which tensor it has the values of (``same``).

    Forwards make decisions on values computed from their input alone (Hugging Face masks check whether the
    position ids are packed sequences: ``.all()`` then ``bool``), which a meta tensor cannot answer. So every meta
    tensor computed only from the trial input and from constants (``arange``) also gets a real *shadow* on the
    CPU, computed alongside by the same op, and a value query on it (``item``, ``bool``, ``tolist``) reads the
    shadow. Nothing that depends on a parameter or buffer has a shadow: a decision on those values cannot be made
    here, and the check says it cannot run.
    """

    def __init__(self) -> None:
        super().__init__()
        self.origin: dict[int, frozenset[int]] = {}  # id(tensor) -> indices of the units it derives from
        self.same: dict[int, tuple[Tensor, int]] = {}  # id(tensor) -> (tensor with its values, version at the time)
        self.alive: list[Tensor] = []  # every tracked tensor stays alive, so no id is reused during the trace
        self.shadow: dict[int, Tensor] = {}  # id(meta tensor) -> its real value on the CPU (input-derived only)

    def add_shadow(self, tensor: Tensor, real: Tensor) -> None:
        self.shadow[id(tensor)] = real
        self.alive.append(tensor)

    def _real(self, value: Any) -> Any:
        """``value`` with meta tensors replaced by their shadows and the meta device by the CPU; raises KeyError
        when a meta tensor has no shadow."""
        if isinstance(value, Tensor):
            return self.shadow[id(value)] if value.device.type == "meta" else value
        if isinstance(value, (tuple, list)):
            return type(value)(self._real(v) for v in value)
        if isinstance(value, dict):
            return {k: self._real(v) for k, v in value.items()}
        return _to_cpu_device(value)

    def _run_shadow(self, func, args: tuple, kwargs: dict, out: Any) -> None:
        """Compute the shadows of ``out``'s meta tensors, when every meta input has one."""
        try:
            real = func(*self._real(args), **self._real(kwargs))
        except Exception:  # noqa: BLE001 -- no shadow: a later value query on it cannot be answered
            return
        for leaf, value in zip(tree_leaves(out), tree_leaves(real), strict=False):
            if isinstance(leaf, Tensor) and leaf.device.type == "meta" and isinstance(value, Tensor):
                self.add_shadow(leaf, value)

    def track(self, tensor: Tensor, origin: frozenset[int]) -> None:
        self.origin[id(tensor)] = origin
        self.alive.append(tensor)

    def origin_of(self, value: Any) -> frozenset[int]:
        out: frozenset[int] = frozenset()
        for leaf in tree_leaves(value):
            if isinstance(leaf, Tensor):
                out |= self.origin.get(id(leaf), frozenset())
        return out

    def values_of(self, tensor: Tensor) -> Tensor | None:
        """The tensor whose values ``tensor`` has (following casts, copies and views), or None when it was
        modified in place since."""
        while id(tensor) in self.same:
            source, version = self.same[id(tensor)]
            if tensor._version != version:
                return None
            tensor = source
        return tensor

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VALUE_QUERIES:
            try:
                return func(*self._real(args), **self._real(kwargs))
            except KeyError:
                pass  # a value of the model's parameters: raises on meta (the check cannot run)
        try:
            out = func(*args, **kwargs)
        except RuntimeError:
            out = _in_bf16(func, args, kwargs)
            if out is None:
                raise
        if any(isinstance(t, Tensor) and t.device.type == "meta" for t in tree_leaves(out)):
            metas = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor) and t.device.type == "meta"]
            if all(id(t) in self.shadow for t in metas):
                self._run_shadow(func, args, kwargs, out)
            else:  # an in-place op mixing in a value without shadow leaves the shadow stale
                for leaf in tree_leaves(out):
                    self.shadow.pop(id(leaf), None)
        if func in _METADATA_ONLY:
            return out
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)]
        if not inputs:
            return out
        origin = self.origin_of(args[:1] if func in _FIRST_ONLY else (args, kwargs))
        input_ids = {id(t) for t in inputs}
        for leaf in tree_leaves(out):
            if not isinstance(leaf, Tensor):
                continue
            if id(leaf) in input_ids:  # the op returned an input: a no-op cast, or an in-place op (adds origins)
                if origin - self.origin.get(id(leaf), frozenset()):
                    self.track(leaf, self.origin.get(id(leaf), frozenset()) | origin)
                continue
            if origin:
                self.track(leaf, origin)
            first = args[0] if args and isinstance(args[0], Tensor) else None
            if first is not None and (_same_view(leaf, first) or (
                    func in _VALUE_PRESERVING and leaf.shape == first.shape)):
                self.same[id(leaf)] = (first, leaf._version)
                self.alive.append(leaf)
        return out


def _chain_input(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """What a unit takes as the pipeline's activation: its first positional argument, or the keyword of its
    forward's first parameter (as :class:`~.adapter._Injection` replaces it)."""
    if args:
        return args[0]
    try:
        name = next(iter(inspect.signature(module.forward).parameters), None)
    except (TypeError, ValueError):
        name = None
    if name in kwargs:
        return kwargs[name]
    return next(iter(kwargs.values()), None)


def _first_tensor(value: Any) -> Tensor | None:
    try:
        return first_tensor(value)
    except LayoutError:
        return None


def _trial_input(model: nn.Module, units: Sequence[str], io: StageIO) -> tuple[tuple, dict] | None:
    """A tiny input for the forward on meta: token ids when the first unit holds an embedding (or the model has a
    Hugging Face input keyword), features of the first linear layer's width otherwise; None if neither."""
    first = model.get_submodule(units[0])
    leaf = next((m for m in first.modules() if isinstance(m, (nn.Embedding, nn.Linear))), None)
    if io.input_key is not None or isinstance(leaf, nn.Embedding) or leaf is None and any(
            isinstance(m, nn.Embedding) for m in model.modules()):
        x = torch.zeros(TRIAL_SHAPE, dtype=torch.long, device="meta")
    elif isinstance(leaf, nn.Linear):
        x = torch.zeros(TRIAL_SHAPE[0], leaf.in_features, dtype=leaf.weight.dtype, device="meta")
    else:
        return None
    kwargs = dict(io.constant)
    if io.input_key is not None:
        return (), {io.input_key: x, **kwargs}
    return (x,), kwargs


def _names(units: Sequence[str], indices: frozenset[int] | set[int]) -> str:
    names = [repr(units[i]) for i in sorted(indices)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def check_chain(model: nn.Module, units: Sequence[str], units_by_stage: Sequence[Sequence[str]],
                io: StageIO | None = None, example: tuple[tuple, dict] | None = None,
                found: dict[str, Any] | None = None) -> float:
    """Raise a :class:`LayoutError` unless ``model``'s forward is the chain of ``units`` at the stage boundaries of
    ``units_by_stage`` (see the module docstring); returns the seconds the check took. ``found["after_last_unit"]``
    (when ``found`` is given) says whether the forward computes its output from the last unit's (a logit scale, a
    soft-cap) rather than returning it: then each stage but the last passes on its last unit's output explicitly.

    The model is not modified or run: a parameter-free copy on the meta device is. ``example`` is the trial input
    ``(args, kwargs)`` on the meta device (default: 2 x 4 token ids, or features of the first linear layer's width).
    When the model's forward cannot run on the meta device, nothing can be checked: a warning says so.
    """
    start = time.perf_counter()
    units = list(units)
    if len(units_by_stage) < 2:
        return time.perf_counter() - start
    io = stage_io(model) if io is None else io
    stage_of = {u: s for s, stage in enumerate(units_by_stage) for u in stage}
    inject = feeds_by_injection(model)
    # from which unit on each unit must take the previous unit's output (see the module docstring)
    chain_from = len(units_by_stage[0]) if inject else 1
    name = type(model).__name__
    how_to_fix = (
        "Declare pipeline units that form a chain (each unit takes the output of the unit before it and nothing "
        "else computed by another stage's units, and the model returns the last unit's output): move the "
        "computation that uses it inside one unit, or put the modules involved into one unit; or use a layout "
        "without pipeline parallel (pp=1: tensor parallel, ZeRO)."
    )
    pp_hint = f"the pipeline split {[list(s) for s in units_by_stage]}"

    if example is None:
        example = _trial_input(model, units, io)
        if example is None:
            warnings.warn(f"could not check that {name}'s forward is the chain of its pipeline units: no trial input "
                          "could be made for it (its first unit holds no nn.Embedding or nn.Linear).", stacklevel=2)
            return time.perf_counter() - start

    meta = meta_copy(model)
    flow = _Flow()
    for leaf in tree_leaves(example):  # the trial input's values: zeros
        if isinstance(leaf, Tensor) and leaf.device.type == "meta":
            flow.add_shadow(leaf, torch.zeros(leaf.shape, dtype=leaf.dtype))
    index = {id(meta.get_submodule(u)): i for i, u in enumerate(units)}
    calls: list[int] = []
    outputs: dict[int, tuple[Tensor, int]] = {}  # unit index -> (its output, version)
    problems: list[str] = []

    def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        i = index[id(module)]
        calls.append(i)
        if problems or calls.count(i) > 1:
            return
        unit, stage = units[i], stage_of[units[i]]
        x = _chain_input(module, args, kwargs)
        others = [v for v in (*args, *kwargs.values()) if v is not x]
        earlier = {j for j in flow.origin_of(others) if stage_of[units[j]] != stage}
        if earlier:
            problems.append(
                f"pipeline unit {unit!r} (stage {stage}) is given a tensor computed from the output of "
                f"{_names(units, earlier)} (stage {stage_of[units[min(earlier)]]}) besides its input, but under "
                f"{pp_hint} only the output of the last unit of a stage reaches the next stage.")
            return
        if i < chain_from:
            return
        prev, prev_stage = units[i - 1], stage_of[units[i - 1]]
        produced = outputs.get(i - 1)
        if stage == prev_stage == len(units_by_stage) - 1 and all(
                stage_of[units[j]] == stage for j in flow.origin_of(x)) and (
                produced is None or produced[0]._version == produced[1]):
            # glue between two units of the last stage, computed from that stage's units (a scale between the final
            # norm and the head) runs there alone: every earlier stage hands on its last unit's output. Not in place:
            # on an earlier stage the removed units pass that very tensor through, and the step would modify it
            return
        if isinstance(x, Tensor) and produced is not None:
            source = flow.values_of(x)
            if source is produced[0] and produced[0]._version == produced[1]:
                return
        origin = flow.origin_of(x) - {i - 1}
        where = "stage boundary" if prev_stage != stage else "boundary"
        if origin:
            problems.append(
                f"pipeline unit {unit!r} (stage {stage}) takes a tensor computed from the output of "
                f"{_names(units, origin)} (stage {stage_of[units[min(origin)]]})"
                f"{' and ' + repr(prev) if i - 1 in flow.origin_of(x) else ''}, not the output of {prev!r} (the unit "
                f"before it) alone: the output of {_names(units, origin)} is used out of order (a skip connection "
                f"past the {where} between {prev!r} and {unit!r}), which a pipeline stage cannot pass on.")
        else:
            modified = produced is not None and produced[0]._version != produced[1]
            problems.append(
                f"pipeline unit {unit!r} (stage {stage}) does not take the output of {prev!r} (the unit before it) "
                f"unchanged: the forward {'modifies it in place' if modified else 'computes something else from it'} "
                f"in between, and a pipeline stage would run that step on the activation it receives or passes on.")

    def post_hook(module: nn.Module, args: tuple, output: Any) -> Any:
        i = index[id(module)]
        if calls.count(i) == 1:
            for leaf in tree_leaves(output):
                if isinstance(leaf, Tensor):  # a unit's output derives from that unit (what it took was checked)
                    flow.track(leaf, frozenset({i}))
            y = _first_tensor(output)
            if y is not None:
                outputs[i] = (y, y._version)
        return None

    handles = []
    for u in units:
        module = meta.get_submodule(u)
        handles.append(module.register_forward_pre_hook(pre_hook, with_kwargs=True))
        handles.append(module.register_forward_hook(post_hook))
    args, kwargs = example
    try:
        with torch.no_grad(), flow:
            result = meta(*args, **kwargs)
    except LayoutError:
        raise
    except Exception as err:  # noqa: BLE001 -- the check cannot run; say so, do not refuse the model
        warnings.warn(f"could not check that {name}'s forward is the chain of its pipeline units: it does not run on "
                      f"the meta device ({type(err).__name__}: {err}).", stacklevel=2)
        return time.perf_counter() - start
    finally:
        for handle in handles:
            handle.remove()

    def refuse(problem: str) -> LayoutError:
        return LayoutError(f"{name}'s forward is not the chain of its pipeline units, so pipeline parallel would "
                           f"change what it computes: {problem} {how_to_fix}")

    first_calls = list(dict.fromkeys(calls))
    missing = [units[i] for i in range(len(units)) if i not in first_calls]
    if missing:
        raise refuse(f"its forward does not call the pipeline units {missing}.")
    again = next((i for i in calls if calls.count(i) > 1), None)
    if again is not None:
        after = calls[len(calls) - 1 - calls[::-1].index(again) - 1]
        raise refuse(f"its forward calls the pipeline unit {units[again]!r} (stage {stage_of[units[again]]}) more "
                     f"than once, again after {units[after]!r} (stage {stage_of[units[after]]}): a unit is held by "
                     "one stage only, so its output is used out of order.")
    if first_calls != list(range(len(units))):
        raise refuse(f"its forward calls the units in the order {[units[i] for i in first_calls]}, not in the "
                     f"declared order {units}.")
    if problems:
        raise refuse(problems[0])
    try:
        y = first_tensor(result, io.output_key)
    except LayoutError:
        return time.perf_counter() - start  # the adapter refuses such an output itself, with its own message
    last = len(units) - 1
    produced = outputs.get(last)
    if produced is None or flow.values_of(y) is not produced[0] or produced[0]._version != produced[1]:
        # What the forward computes from the last unit's output alone (a logit scale, a soft-cap) is the last
        # stage's: it runs the model's own forward, and each earlier stage passes on its last unit's output
        # (adapter.stage_forward's last_unit); an in-place step or a use of an earlier unit's output cannot be split.
        origin = flow.origin_of(y) - {last}
        in_place = produced is not None and produced[0]._version != produced[1]
        if origin or in_place or last not in flow.origin_of(y):
            detail = (f"it is computed from the output of {_names(units, origin)} as well" if origin else
                      "the forward modifies it in place" if in_place else
                      "the forward returns something not computed from it")
            raise refuse(f"the model's output is not computed from the output of its last pipeline unit "
                         f"{units[last]!r} alone: {detail}, which no pipeline stage can run.")
        if found is not None:
            found["after_last_unit"] = True
    return time.perf_counter() - start


# A forward that looks up per-layer settings by the loop's position: `for i, layer in enumerate(self.layers)` with
# `self.config.layer_types[i]` (Gemma-2/3, Cohere-2 and some 80 Hugging Face models pick each layer's attention mask
# and rotary table so). A stage iterates over the layers it holds only, from position 0.
_ENUMERATED = re.compile(r"for\s+(\w+)\s*,\s*(\w+)\s+in\s+enumerate\(\s*self\.(\w+)")


def check_layer_positions(model: nn.Module, units_by_stage: Sequence[Sequence[str]]) -> list[str]:
    """The lists of layers a stage must iterate with their full-list indices, or a :class:`LayoutError`.

    Where the forward of a module of ``model`` enumerates its list of layers and indexes a config list by the
    position (read from its source), a stage iterating over its own layers only would run a layer with another
    layer's setting where the values differ (a stage starting at layer 3 runs it with ``layer_types[0]``). When the
    loop hands each layer's output to the next (``hidden = layer(hidden, ...)``), the stage iterates over every
    slot instead, the other stages' layers passing the hidden states through (:attr:`~.split.KeptModuleList
    .positional`): those lists are returned (relative to ``model``). Any other loop is refused where a stage would
    get a setting wrong. Single-process: every rank alike."""
    positional: list[str] = []
    if len(units_by_stage) < 2:
        return positional
    for path, module in model.named_modules():
        config = getattr(module, "config", None)
        try:
            source = inspect.getsource(type(module).forward)
        except (OSError, TypeError):
            continue
        for var, layer, attr in _ENUMERATED.findall(source):
            names = sorted(set(re.findall(rf"config\.(\w+)\[\s*{var}\s*\]", source)))
            layers = f"{path}.{attr}" if path else attr
            if names and re.search(rf"(\w+)\s*=\s*{layer}\(\s*\1\b", source):
                positional.append(layers)  # a chain of layers: the stage keeps every index
                continue
            for stage, units in enumerate(units_by_stage):
                held = [int(u.rpartition(".")[2]) for u in units
                        if u.rpartition(".")[0] == layers and u.rpartition(".")[2].isdigit()]
                for name in names:
                    values = getattr(config, name, None)
                    if not isinstance(values, (list, tuple)):
                        continue
                    wrong = next(((pos, j) for pos, j in enumerate(held)
                                  if j < len(values) and pos < len(values) and values[pos] != values[j]), None)
                    if wrong is not None:
                        pos, j = wrong
                        raise LayoutError(
                            f"{type(module).__name__}'s forward looks up config.{name}[{var}] by each layer's "
                            f"position in {layers}, and pipeline stage {stage} holds layers {held[0]}..{held[-1]}: "
                            f"it would run layer {j} with the {name} of layer {pos} ({values[pos]!r} instead of "
                            f"{values[j]!r}), another function than one process's. Use pp=1 (ZeRO, tensor or "
                            f"context parallel), or stages that start where config.{name} repeats "
                            "(stage_costs=).")
    return positional


def check_unit_inputs(model: nn.Module, units: Sequence[str], units_by_stage: Sequence[Sequence[str]],
                      io: StageIO) -> None:
    """Refuse a unit whose forward takes the model's input (``input_ids``: a layer routing its experts by token id,
    DeepSeek-V4's hash routing) where a later stage gets hidden states in its place (``io.hidden_key``): the layer
    would get ``None`` there and fail at its first forward -- on that stage only, the others left waiting in the
    schedule. Single-process, before the split: every rank alike."""
    if len(units_by_stage) < 2 or io.input_key is None or io.hidden_key is None or io.inject:
        return
    later = {u for stage in units_by_stage[1:] for u in stage}
    for unit in units:
        if unit not in later:
            continue
        layer = model.get_submodule(unit)
        if io.input_key in inspect.signature(layer.forward).parameters:
            raise LayoutError(
                f"{type(layer).__name__} ({unit}) takes the model's `{io.input_key}` in its forward (e.g. experts "
                f"routed by token id), but under pipeline parallel a later stage gets the hidden states "
                f"(`{io.hidden_key}`) instead, so the layer would have no `{io.input_key}` there. Train "
                f"{type(model).__name__} with pp=1 (ZeRO, tensor or expert parallel).")
