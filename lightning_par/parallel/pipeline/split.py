"""Split a model into pipeline stages by removing the units a stage does not own.

The units are the model's parts in execution order, e.g. ``["embed", "layers.0", ..., "layers.7", "norm", "head"]``
for :class:`lightning_par.examples.GPT` (its ``pipeline_units()``), or ``["model.embed_tokens", "model.layers.0", ...,
"model.norm", "lm_head"]`` for a Hugging Face ``LlamaForCausalLM`` (from its ``base_model_pp_plan``, found by
:func:`lightning_par.parallel.blocks.find_blocks` and passed here as ``units=``). A stage is a contiguous run of those
units, and the stage's module is the model with every other unit removed, so that the parameters that remain keep
their original names (FQNs): a checkpoint written with one pipeline size loads with another, and the names stay
those ``from_pretrained`` reads.

How a unit is removed (hand-written: ``torch.distributed.pipelining`` splits by tracing the model with
``torch.export``, which fails on Hugging Face forwards with data-dependent masks and caches, and its manual
``PipelineStage`` takes an already-split module):

* an item of an ``nn.ModuleDict`` is deleted;
* an item of an ``nn.ModuleList`` is deleted *without re-indexing the rest*: the list becomes a
  :class:`KeptModuleList` that keeps the original keys (``layers.2``, ``layers.3``), iterates over the kept items,
  and returns itself for a slice that covers all of them (Hugging Face forwards run
  ``for layer in self.layers[: self.config.num_hidden_layers]``);
* any other unit of a model that declares ``pipeline_units()`` is set to ``None`` (such a model's forward skips
  ``None`` units, as ``GPT`` does); of any other model it becomes a parameter-free :class:`RemovedUnit`, so the
  model's own forward runs unchanged on every stage: a unit after the stage's units passes its input through (the
  stage returns its hidden states), a unit before them returns zeros of its output shape when the stage's input is
  injected into its first unit (see :mod:`.adapter`).

Modules outside every unit (a rotary embedding without parameters) stay on every stage.

Everything here is single-process arithmetic and module surgery: all validation raises a
:class:`~lightning_par.topology.LayoutError` before any rank waits on a collective.
"""

from __future__ import annotations

import copy
import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch import Tensor

from lightning_par.parallel.blocks import is_hf_model
from lightning_par.parallel.stage_plan import StagePlan, check_positive_int
from lightning_par.topology import LayoutError, is_number

Costs = dict[str, float] | Sequence[float] | None


def _short(names: Sequence[str], limit: int = 8) -> str:
    """A list for an error message, abbreviated in the middle when long."""
    names = list(names)
    if len(names) <= limit:
        return repr(names)
    head, tail = names[: limit // 2], names[-(limit // 2):]
    return f"[{', '.join(map(repr, head))}, ... ({len(names) - limit} more) ..., {', '.join(map(repr, tail))}]"


# -- removed units -------------------------------------------------------------------------------------------------
class KeptModuleList(nn.ModuleList):
    """An ``nn.ModuleList`` some of whose items were removed, the rest keeping their original indices.

    ``nn.ModuleList`` re-indexes on deletion (``layers.2`` would become ``layers.0``), which renames the parameters;
    this one keeps the keys, so ``layers.2.mlp.up_proj.weight`` stays its name on the stage holding it. It behaves
    like the full list seen from one stage:

    * iteration and ``len`` cover the kept items, in order;
    * ``lst[i]`` is the item that had index ``i`` in the full list (an ``IndexError`` names the kept ones when this
      stage does not hold it);
    * a slice returns the kept items it covers, and the list itself when it covers all of them (Hugging Face
      forwards run ``for layer in self.layers[: self.config.num_hidden_layers]``);
    * deleting an item never re-indexes the others; ``append`` continues after the full list's last index.
    """

    _n_slots: int  # the length of the full list
    #: iterate over every slot, a pass-through stand-in in the slots another stage holds, so that a forward that
    #: enumerates the layers sees each at its index in the full list (``config.layer_types[i]``); set by the split
    #: where :func:`~.chain.check_layer_positions` found such a forward
    positional: bool = False

    @classmethod
    def convert(cls, module_list: nn.ModuleList) -> KeptModuleList:
        """Turn ``module_list`` (in place) into a ``KeptModuleList``; its current indices become the kept keys."""
        if not isinstance(module_list, cls):
            n_slots = len(module_list._modules)
            module_list.__class__ = cls
            module_list._n_slots = n_slots
        return module_list  # type: ignore[return-value]

    def kept_indices(self) -> list[int]:
        return [int(k) for k in self._modules]

    def __iter__(self):
        if not self.positional:
            return iter(self._modules.values())
        # (a pass-through stand-in: the stage's hidden states go through the layers of the other stages unchanged)
        return iter(self._modules.get(str(i)) or _HELD_ELSEWHERE for i in range(self._n_slots))

    def __len__(self) -> int:
        return self._n_slots if self.positional else len(self._modules)

    def _get_abs_string_index(self, idx) -> str:
        idx = operator.index(idx)
        absolute = idx + self._n_slots if idx < 0 else idx
        if str(absolute) not in self._modules:
            raise IndexError(f"index {idx} is not held by this pipeline stage: of the {self._n_slots} items it "
                             f"holds those with indices {self.kept_indices()}")
        return str(absolute)

    def __getitem__(self, idx):  # type: ignore[override]
        if isinstance(idx, slice):
            keys = [str(i) for i in range(self._n_slots)[idx] if str(i) in self._modules]
            if keys == list(self._modules):
                return self
            out = type(self)()
            out._n_slots = self._n_slots
            for key in keys:
                out.add_module(key, self._modules[key])
            return out
        return self._modules[self._get_abs_string_index(idx)]

    def __delitem__(self, idx) -> None:  # type: ignore[override]
        if isinstance(idx, slice):
            for key in [str(i) for i in range(self._n_slots)[idx] if str(i) in self._modules]:
                del self._modules[key]
        else:
            del self._modules[self._get_abs_string_index(idx)]

    def append(self, module: nn.Module) -> KeptModuleList:  # type: ignore[override]
        self.add_module(str(self._n_slots), module)
        self._n_slots += 1
        return self

    def extend(self, modules: Iterable[nn.Module]) -> KeptModuleList:  # type: ignore[override]
        for module in modules:
            self.append(module)
        return self

    def insert(self, index: int, module: nn.Module) -> None:
        raise TypeError("a pipeline stage's KeptModuleList cannot insert: that would re-index the items after it "
                        "and rename their parameters")

    def __repr__(self) -> str:
        lines = [f"({key}): {nn.modules.module._addindent(repr(m), 2)}" for key, m in self._modules.items()]
        body = "".join(f"\n  {line}" for line in lines)
        return f"{self._get_name()}(of {self._n_slots}{body}\n)" if lines else f"{self._get_name()}(of {self._n_slots})"


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` on the meta device (shapes only), made without allocating its parameters."""
    memo: dict[int, object] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for _, b in module.named_buffers(remove_duplicate=False):
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _on_meta(value: object) -> object:
    if isinstance(value, Tensor):
        return value.to("meta")
    if isinstance(value, (tuple, list)):
        return type(value)(_on_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_meta(v) for k, v in value.items()}
    return value


def _zeros_like_meta(value: object, device: torch.device) -> object:
    if isinstance(value, Tensor):
        return torch.zeros(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, (tuple, list)):
        return type(value)(_zeros_like_meta(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _zeros_like_meta(v, device) for k, v in value.items()}
    return value


class RemovedUnit(nn.Module):
    """What a removed unit of a model without ``pipeline_units()`` becomes: a module without parameters.

    Every stage runs the model's own forward, so the removed units of a stage are still called, in one of two ways:

    * ``"pass"``, a unit **after** the stage's units (the final norm and head on a stage before the last): it passes
      its input through, so the stage returns its hidden states. It refuses integer input (token or position ids):
      an identity cannot stand in for a unit called on ids, and the result would be wrong.
    * ``"shape"``, a unit **before** the stage's units (the embeddings, on a stage after the first, when the stage is
      fed by injecting the received activation into its first unit, see :mod:`.adapter`): it returns zeros of the
      shape and dtype the unit would return, worked out on a parameter-free copy on the meta device. The forward
      then runs up to the stage's first unit whatever it does with those outputs (``tok_emb(ids) + pos_emb(pos)``,
      scaling, dropout), and that unit's input is replaced by the received activation.
    """

    def __init__(self, name: str, mode: str = "pass", meta: nn.Module | None = None) -> None:
        super().__init__()
        if mode not in ("pass", "shape") or (mode == "shape" and meta is None):
            raise ValueError(f"RemovedUnit mode {mode!r}: use 'pass', or 'shape' with a meta copy of the unit")
        self.unit, self.mode = name, mode
        self.__dict__["meta"] = meta  # not a submodule: no parameters, names or device moves

    def forward(self, *args: object, **kwargs: object) -> object:
        if self.mode == "shape":
            device = next((a.device for a in [*args, *kwargs.values()] if isinstance(a, Tensor)), torch.device("cpu"))
            with torch.no_grad():
                out = self.meta(*_on_meta(args), **_on_meta(kwargs))
            return _zeros_like_meta(out, device)
        x = args[0] if args else next(iter(kwargs.values()), None)
        if isinstance(x, Tensor) and not (x.is_floating_point() or x.is_complex()):
            raise LayoutError(
                f"pipeline unit {self.unit!r} is held by another stage but was called here with a {x.dtype} tensor: "
                "a removed unit after a stage's own units passes its input through, which only works when the "
                "model's forward runs those units as a chain (blocks -> norm -> head). Keep such a module out of "
                "the units (it then stays on every stage), or declare pipeline_units() and handle removed (None) "
                "units in forward."
            )
        return x

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            # a parameter or buffer of the removed unit that the forward reads without calling the unit
            # (`hidden.to(self.lm_head.weight.dtype)`): its meta copy -- dtype and shape read right, and any
            # computation with it fails loudly on the meta device instead of going on with something else
            value = getattr(self.__dict__.get("meta"), name, None)
            if isinstance(value, Tensor):
                return value
            raise

    def extra_repr(self) -> str:
        how = "zeros of its output shape" if self.mode == "shape" else "input passed through"
        return f"{self.unit!r}: held by another pipeline stage; {how}"


#: the stand-in a positional :class:`KeptModuleList` yields for a layer another stage holds (one for all: it holds
#: nothing and passes its input through)
_HELD_ELSEWHERE = RemovedUnit("a layer another pipeline stage holds", "pass")


def removes_to_none(model: nn.Module) -> bool:
    """Whether ``model`` removes units by setting them to ``None``: it declares ``pipeline_units()`` (and so
    follows that protocol, as ``lightning_par.examples.GPT`` does); other models get :class:`RemovedUnit` stand-ins."""
    return callable(getattr(model, "pipeline_units", None))


# -- which units a model has ---------------------------------------------------------------------------------------
def _check_units(model: nn.Module, units: list[str], where: str, containers: tuple[type, ...]) -> list[str]:
    if not units:
        raise LayoutError(f"{where} returned no units; a stage needs at least one.")
    bad = [u for u in units if not isinstance(u, str) or not u]
    if bad:
        raise LayoutError(f"pipeline units must be non-empty submodule names, got {bad!r}.")
    duplicates = sorted({u for u in units if units.count(u) > 1})
    if duplicates:
        raise LayoutError(f"{where} lists {duplicates} more than once; each unit must appear once.")
    for unit in units:
        try:
            module = model.get_submodule(unit)
        except AttributeError:
            module = None
        if not isinstance(module, nn.Module):
            raise LayoutError(
                f"pipeline unit {unit!r} is not a submodule of {type(model).__name__}; {where} must name "
                "submodules by their dotted path (e.g. 'layers.0')."
            )
        parent_name = unit.rpartition(".")[0]
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, (nn.ModuleList, nn.Sequential, nn.ModuleDict)) and not isinstance(parent, containers):
            kinds = " or ".join(f"nn.{c.__name__}" for c in containers)
            raise LayoutError(
                f"pipeline unit {unit!r} sits in an {type(parent).__name__}; removing it would re-index the others "
                f"and rename their parameters. Hold repeated blocks in an {kinds} keyed '0', '1', ... like "
                "lightning_par.examples.GPT."
            )
    for unit in units:
        inner = [u for u in units if u.startswith(unit + ".")]
        if inner:
            raise LayoutError(f"pipeline unit {unit!r} contains the units {inner}; units may not nest.")
    return units


def declared_units(model: nn.Module) -> list[str]:
    """The model's pipeline units (``model.pipeline_units()``), checked so that each one can be removed.

    Each unit must name an existing submodule; units may not nest; a unit inside a container must sit in an
    ``nn.ModuleDict``, which is what the ``pipeline_units()`` protocol asks of a model (units given explicitly,
    see :func:`model_units`, may also be items of an ``nn.ModuleList``).
    """
    declare = getattr(model, "pipeline_units", None)
    if not callable(declare):
        hint = ""
        inner = next((name for name, m in model.named_modules() if callable(getattr(m, "pipeline_units", None))), None)
        if inner is not None:
            hint = f" Its submodule `{inner}` declares them: split that module instead."
        raise LayoutError(
            f"{type(model).__name__} declares no pipeline units, so it cannot be split into pipeline stages; add a "
            "`pp_plan` / `pipeline_units()` that lists its units in execution order like "
            "lightning_par.examples.GPT, or "
            "pass the units found by lightning_par.parallel.blocks.find_blocks as `units=`." + hint
        )
    return _check_units(model, list(declare()), f"{type(model).__name__}.pipeline_units()", (nn.ModuleDict,))


def model_units(model: nn.Module, units: Sequence[str] | None = None) -> list[str]:
    """The ordered pipeline units of ``model``: ``units`` when given (e.g. ``find_blocks(...).units``), checked
    against the model, else its own :func:`declared_units`. Explicit units may be items of an ``nn.ModuleList``
    (removed without re-indexing, see :class:`KeptModuleList`), an ``nn.ModuleDict``, or an ``nn.Sequential`` (a
    removed item is replaced by a :class:`RemovedUnit` in its slot, so the others keep their indices)."""
    if units is None:
        return declared_units(model)
    return _check_units(model, list(units), "the pipeline units", (nn.ModuleDict, nn.ModuleList, nn.Sequential))


def block_units(model: nn.Module, units: Sequence[str]) -> list[str]:
    """The units that are items of a container (``layers.3``, ``model.layers.3``): the repeated blocks."""
    out = []
    for unit in units:
        parent = unit.rpartition(".")[0]
        if parent and isinstance(model.get_submodule(parent), (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            out.append(unit)
    return out


def held_blocks(module: nn.Module, names: Sequence[str]) -> list[str]:
    """The blocks among ``names`` (relative to the model root, e.g. ``layers.3``) that ``module`` -- a stage or rank
    module -- still holds with their parameters, in the given order."""
    held = []
    for name in names:
        try:
            block = module.get_submodule(name)
        except AttributeError:  # a unit of another stage: removed from this one
            continue
        if block is not None and any(True for _ in block.parameters()):
            held.append(name)
    return held


# -- which stage holds which units ---------------------------------------------------------------------------------
def _unit_costs(units: list[str], costs: Costs) -> list[float]:
    if isinstance(costs, dict):
        unknown = [name for name in costs if name not in units]
        if unknown:
            raise LayoutError(f"costs name unknown pipeline units {unknown}; the units are {_short(units)}.")
        missing = [u for u in units if u not in costs]
        if missing:
            raise LayoutError(f"costs has no entry for the pipeline units {_short(missing)}; give a cost for every "
                              "unit, or pass costs=None to balance by unit count.")
        values = [costs[u] for u in units]
    else:
        values = list(costs)
        if len(values) != len(units):
            raise LayoutError(f"costs has {len(values)} entries but there are {len(units)} pipeline units "
                              f"({_short(units)}); give one cost per unit, in unit order, or a dict unit -> cost.")
    for unit, value in zip(units, values, strict=True):
        if not is_number(value, minimum=0):
            raise LayoutError(f"the cost of pipeline unit {unit!r} is {value!r}; costs must be finite and >= 0.")
    return [float(v) for v in values]


def _even_chunks(n_items: int, n_chunks: int) -> list[int]:
    """Sizes of ``n_chunks`` contiguous chunks of ``n_items``; the earliest chunks take the remainder."""
    base, extra = divmod(n_items, n_chunks)
    return [base + (i < extra) for i in range(n_chunks)]


def _split_by_count(units: list[str], n_stages: int, blocks: Sequence[str] | None) -> list[list[str]]:
    # Repeated blocks ("layers.3": an item of a container) carry the compute; every other unit rides with its
    # neighbour: the ones before the first block join it (the embedding goes to stage 0), the others join the block
    # before them (final norm and head go to the last stage).
    is_block = (lambda u: "." in u) if blocks is None else set(blocks).__contains__
    groups: list[list[str]] = []
    leading: list[str] = []
    for unit in units:
        if is_block(unit):
            groups.append([*leading, unit])
            leading = []
        elif groups:
            groups[-1].append(unit)
        else:
            leading.append(unit)
    if leading:  # no block at all
        groups.append(leading)
    if len(groups) < n_stages:  # too few blocks to give every stage one: balance the units themselves
        groups = [[u] for u in units]
    stages, start = [], 0
    for size in _even_chunks(len(groups), n_stages):
        stages.append([u for group in groups[start:start + size] for u in group])
        start += size
    return stages


def _split_by_cost(units: list[str], costs: list[float], n_stages: int) -> list[list[str]]:
    """Exact min-max contiguous partition by dynamic programming, O(n_stages * n_units^2)."""
    n = len(units)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[j][i]: the smallest possible maximum stage cost when the first i units form j non-empty stages;
    # cut[j][i]: where the last of those j stages starts.
    best = [[math.inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    for i in range(1, n + 1):
        best[1][i] = prefix[i]
    for j in range(2, n_stages + 1):
        for i in range(j, n + 1):
            for s in range(j - 1, i):
                value = max(best[j - 1][s], prefix[i] - prefix[s])
                if value <= best[j][i]:  # on ties the later cut wins: the remainder goes to the earlier stages
                    best[j][i], cut[j][i] = value, s
    bounds, end = [], n
    for j in range(n_stages, 1, -1):
        start = cut[j][end]
        bounds.append((start, end))
        end = start
    bounds.append((0, end))
    return [units[a:b] for a, b in reversed(bounds)]


def assign_units(units: list[str], n_stages: int, costs: Costs = None, *,
                 blocks: Sequence[str] | None = None) -> list[list[str]]:
    """Split ordered pipeline units into ``n_stages`` contiguous, non-empty, balanced stages.

    Without ``costs`` the repeated blocks are spread as evenly as possible by count, the earlier stages taking one
    more when they do not divide evenly (the last stage also runs the head and the loss). The blocks are
    ``blocks`` when given (see :func:`block_units`), else the units with a dot (``layers.3``). Other units go with
    their neighbouring block: the ones before the first block to stage 0, the others to the stage of the block
    before them. With fewer blocks than stages, all units are balanced by count.

    With ``costs`` (one per unit, in unit order, or a dict unit -> cost) the split minimises the largest stage cost
    exactly. Stage 0 always holds the first unit and the last stage the last one.
    """
    check_positive_int("n_stages", n_stages)
    units = list(units)
    if not units:
        raise LayoutError("there are no pipeline units to assign to stages.")
    if len(set(units)) != len(units):
        raise LayoutError(f"the pipeline units {_short(units)} contain duplicates; each unit must appear once.")
    if n_stages > len(units):
        raise LayoutError(f"{n_stages} pipeline stages but only {len(units)} pipeline units ({_short(units)}); "
                          f"use at most {len(units)} stages.")
    if costs is None:
        return _split_by_count(units, n_stages, blocks)
    return _split_by_cost(units, _unit_costs(units, costs), n_stages)


def plan_stages(model_or_units: nn.Module | list[str], plan: StagePlan | int, virtual_stages: int = 1,
                style: str = "loop", costs: Costs = None, *, units: Sequence[str] | None = None) -> list[list[str]]:
    """Units of each of the plan's stages, validated against the model.

    ``model_or_units`` is the model (its units are ``units`` when given, else its ``pipeline_units()``; the blocks
    are the units inside a container) or the ordered unit names themselves. ``plan``: a :class:`StagePlan`, or pp
    (with ``virtual_stages`` and ``style``) to build one. Call this in the launching process: every error says which
    setting to change.
    """
    if not isinstance(plan, StagePlan):
        plan = StagePlan(plan, virtual_stages, style)
    blocks = None
    if isinstance(model_or_units, nn.Module):
        units = model_units(model_or_units, units)
        blocks = block_units(model_or_units, units)
    else:
        units = list(model_or_units)
    if plan.n_stages > len(units):
        raise LayoutError(
            f"pp={plan.pp} x virtual_stages={plan.virtual_stages} = {plan.n_stages} stages but the model declares "
            f"only {len(units)} pipeline units ({_short(units)}); use at most {len(units)} stages."
        )
    return assign_units(units, plan.n_stages, costs, blocks=blocks)


# -- which rank holds which stages (for callers without a StagePlan) ------------------------------------------------
def stage_indices(pp_rank: int, pp_size: int, virtual_stages: int, style: str = "loop") -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds: :meth:`StagePlan.stages_of`."""
    return StagePlan(pp_size, virtual_stages, style).stages_of(pp_rank)


def stage_rank(stage: int, pp_size: int, virtual_stages: int, style: str = "loop") -> int:
    """The pipeline rank that holds ``stage``: :meth:`StagePlan.rank_of`."""
    return StagePlan(pp_size, virtual_stages, style).rank_of(stage)


# -- building stage modules ----------------------------------------------------------------------------------------
def _check_plan(units: list[str], units_by_stage: list[list[str]]) -> None:
    flat = [u for stage in units_by_stage for u in stage]
    unknown = [u for u in flat if u not in units]
    if unknown:
        raise LayoutError(f"units_by_stage names unknown pipeline units {unknown}; the model's units are "
                          f"{_short(units)}.")
    if any(not stage for stage in units_by_stage) or flat != units:
        raise LayoutError(f"units_by_stage must split the units {_short(units)} into non-empty contiguous stages in "
                          f"order, each unit once; got {units_by_stage}. Build it with assign_units().")


def _remove_unit(module: nn.Module, unit: str, to_none: bool, replacement: RemovedUnit | None = None) -> None:
    """Remove a unit by its dotted name without renaming anything else (see the module docstring): delete it from
    its container, set it to None, or put ``replacement`` in its place."""
    parent_name, _, name = unit.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    if isinstance(parent, nn.ModuleDict):
        del parent[name]
    elif isinstance(parent, nn.ModuleList):
        del KeptModuleList.convert(parent)._modules[name]
    elif to_none:
        setattr(parent, name, None)
    else:
        assert replacement is not None
        parent._modules[name] = replacement


def feeds_by_injection(model: nn.Module) -> bool:
    """Whether a later stage of ``model`` runs the forward on the model's input with its activation injected into
    its first unit (see :mod:`.adapter`): models that neither declare ``pipeline_units()`` nor have a Hugging Face
    ``base_model_pp_plan`` (those take hidden states themselves: a ``None`` embedding, or ``inputs_embeds=``)."""
    if removes_to_none(model):
        return False
    return not (is_hf_model(model) and getattr(getattr(model, "config", None), "base_model_pp_plan", None))


def _is_item(model: nn.Module, unit: str) -> bool:
    """Whether ``unit`` is an item of an ``nn.ModuleList`` / ``nn.ModuleDict`` (removed by deleting it)."""
    parent_name = unit.rpartition(".")[0]
    return bool(parent_name) and isinstance(model.get_submodule(parent_name), (nn.ModuleList, nn.ModuleDict))


def _removed_unit(unit: str, index: int, first_kept: int, original: nn.Module, inject: bool) -> RemovedUnit:
    """The stand-in for ``unit`` (``index`` in the unit order) on a stage whose first unit has ``first_kept``: before
    it, zeros of its output shape when the stage is fed by injection; else its input passed through."""
    meta = original.meta if isinstance(original, RemovedUnit) else meta_copy(original)
    return RemovedUnit(unit, "shape" if inject and index < first_kept else "pass", meta)


def _build_stage(model: nn.Module, units: list[str], keep: list[str]) -> nn.Module:
    kept_modules = {id(m) for unit in keep for m in model.get_submodule(unit).modules()}
    # Seeding deepcopy's memo with None for the dropped units makes it skip them entirely, so the copy never
    # allocates another stage's parameters. A module reachable from a kept unit as well is copied as usual.
    memo: dict[int, object] = {}
    for unit in units:
        module = model.get_submodule(unit)
        if unit not in keep and id(module) not in kept_modules:
            memo[id(module)] = None
    stage = copy.deepcopy(model, memo)
    to_none, inject = removes_to_none(model), feeds_by_injection(model)
    first_kept = min(units.index(u) for u in keep)
    for index, unit in enumerate(units):
        if unit not in keep:
            stand_in = None
            if not (to_none or _is_item(model, unit)):
                stand_in = _removed_unit(unit, index, first_kept, model.get_submodule(unit), inject)
            _remove_unit(stage, unit, to_none, stand_in)
    return stage


def split_model(model: nn.Module, n_stages: int, stage_index: int | list[int], costs: Costs = None, *,
                units_by_stage: list[list[str]] | None = None,
                units: Sequence[str] | None = None) -> nn.Module | list[nn.Module]:
    """The module(s) of pipeline stage ``stage_index`` out of ``n_stages``; the model itself is left unchanged.

    Each stage is a copy of the model without the units of the other stages; the parameters that remain keep
    their original names. Pass a list of indices (virtual stages, see :func:`stage_indices`) to get one module per
    index. The model's units are ``units`` when given, else its ``pipeline_units()``; which stage holds which comes
    from ``units_by_stage`` when given (e.g. from :func:`plan_stages`, so all ranks use the same plan), else from
    :func:`assign_units` with ``costs``.

    A parameter shared by units of different stages (a tied embedding and head) becomes a separate copy in each
    stage module, including two stages on the same rank; :func:`tied_parameter_groups` lists them so their
    gradients can be summed. Within one stage module a shared parameter stays one ``Parameter``.
    """
    units = model_units(model, units)
    check_positive_int("n_stages", n_stages)
    if units_by_stage is None:
        units_by_stage = assign_units(units, n_stages, costs, blocks=block_units(model, units))
    else:
        if len(units_by_stage) != n_stages:
            raise LayoutError(f"units_by_stage has {len(units_by_stage)} stages but n_stages={n_stages}.")
        _check_plan(units, [list(stage) for stage in units_by_stage])
    indices = [stage_index] if isinstance(stage_index, int) and not isinstance(stage_index, bool) else stage_index
    indices = list(indices)
    bad = [i for i in indices if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_stages]
    if bad or not indices:
        raise LayoutError(f"stage_index={stage_index!r}: every index must be one of the stages 0..{n_stages - 1}.")
    if len(set(indices)) != len(indices):
        raise LayoutError(f"stage_index={stage_index!r} repeats a stage; list each stage once.")
    stages = [_build_stage(model, units, list(units_by_stage[i])) for i in indices]
    return stages if isinstance(stage_index, list) else stages[0]


def rank_module(model: nn.Module, units_by_stage: list[list[str]], stage_ids: list[int], *,
                units: Sequence[str] | None = None) -> nn.Module:
    """One module holding the units of all of ``stage_ids`` (one pipeline rank's stages), original names kept.

    Unlike a list from :func:`split_model`, a parameter shared by two of these stages (the tied embedding and head
    on rank 0 of a V layout) stays one ``Parameter``: autograd sums its gradients, and the optimizer steps it once.
    Use :func:`stage_view` for each stage's own module over the same parameters.
    """
    units = model_units(model, units)
    _check_plan(units, [list(stage) for stage in units_by_stage])
    return _build_stage(model, units, [u for i in stage_ids for u in units_by_stage[i]])


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its submodules, parameters and buffers, with its own submodule dictionary and
    its own hook registries (copies of the current ones)."""
    view = copy.copy(module)
    view._modules = dict(module._modules)
    for key, value in module.__dict__.items():
        if "hook" in key and isinstance(value, dict):
            view.__dict__[key] = type(value)(value)
    return view


def stage_view(module: nn.Module, keep: list[str], *, units: Sequence[str] | None = None,
               to_none: bool | None = None) -> nn.Module:
    """A shallow copy of ``module`` without the units outside ``keep``: the kept units are shared with ``module``,
    not copied, so a pipeline stage built on the view trains ``module``'s own parameters.

    The view shares ``module``'s parameter and buffer dictionaries (a parameter replaced on one, by tensor parallel
    or FSDP2, is replaced on both) but has its own hook registries, holding the hooks ``module`` had when the view
    was made: a hook registered later on the view (FSDP2's ``fully_shard`` of the stage) runs only when the view is
    called, and one registered later on ``module`` only when ``module`` is called.

    ``units`` are all the pipeline units (default: ``module.pipeline_units()``); ``to_none`` says how to remove the
    others (default: :func:`removes_to_none`). A unit ``module`` holds as a :class:`RemovedUnit` gets one for this
    stage (its mode depends on whether it comes before or after the stage's units).
    """
    units = declared_units(module) if units is None else list(units)
    to_none = removes_to_none(module) if to_none is None else to_none
    first_kept = min(units.index(u) for u in keep)
    view = _shallow_copy(module)
    for index, unit in enumerate(units):
        if unit in keep:
            continue
        parent_name, _, name = unit.rpartition(".")
        current = module.get_submodule(parent_name)._modules.get(name) if parent_name else module._modules.get(name)
        if current is None:  # deleted from its container, or None: nothing to remove
            continue
        stand_in = None
        if not (to_none or _is_item(module, unit)):
            stand_in = _removed_unit(unit, index, first_kept, current, feeds_by_injection(module))
        parent = view
        if parent_name:  # copy the chain of containers down to the unit, so `module` keeps its own
            for part in parent_name.split("."):
                child = _shallow_copy(parent._modules[part])
                parent._modules[part] = child
                parent = child
        _remove_unit(parent, name, to_none, stand_in)
    return view


# -- parameters held by more than one stage ------------------------------------------------------------------------
class TiedParameter(NamedTuple):
    """A parameter held by several stages, e.g. a tied embedding/head weight.

    ``name`` is its first FQN in the model, ``stages`` the stages whose modules hold a copy of it, and
    ``name_by_stage[s]`` the FQN under which stage ``s`` holds it (``"embed.weight"`` in stage 0,
    ``"head.weight"`` in the last stage).
    """

    name: str
    stages: list[int]
    name_by_stage: dict[int, str]


def tied_parameter_groups(model: nn.Module, units_by_stage: list[list[str]], *,
                          units: Sequence[str] | None = None) -> list[TiedParameter]:
    """Every parameter that more than one stage holds a copy of, in model order.

    After :func:`split_model` each of these stages trains its own copy. To keep them one parameter, sum their
    gradients over the ranks holding those stages (and add them up locally for two stages on one rank) before the
    optimizer step; equal initial values and equal updates then keep the copies equal.

    Two cases: a tensor shared by units in different stages (``GPT(tie_embeddings=True)``: ``head.weight`` is
    ``embed.weight``), and a parameter outside every unit, which every stage keeps. ``units`` as for
    :func:`split_model`.
    """
    units = model_units(model, units)
    _check_plan(units, [list(stage) for stage in units_by_stage])
    stage_of_unit = {u: s for s, stage in enumerate(units_by_stage) for u in stage}
    every_stage = list(range(len(units_by_stage)))
    holders: dict[int, dict[int, str]] = {}  # id(parameter) -> stage -> its first FQN in that stage
    first_name: dict[int, str] = {}
    for fqn, param in model.named_parameters(remove_duplicate=False):
        unit = next((u for u in units if fqn.startswith(u + ".")), None)
        stages = every_stage if unit is None else [stage_of_unit[unit]]
        first_name.setdefault(id(param), fqn)
        for s in stages:
            holders.setdefault(id(param), {}).setdefault(s, fqn)
    return [
        TiedParameter(first_name[key], sorted(by_stage), dict(sorted(by_stage.items())))
        for key, by_stage in holders.items()
        if len(by_stage) > 1
    ]
