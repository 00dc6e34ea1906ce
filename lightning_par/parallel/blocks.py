"""One way to find a model's repeated blocks and its pipeline units, for every transform that needs them.

ZeRO-3 shards each block as its own FSDP2 group, data-parallel replicas reduce gradients per block, activation
recompute wraps each block, and the pipeline split cuts the ordered units into stages. All of them ask
:func:`find_blocks`, which looks, in this order, for:

1. **our declaration**: a submodule with ``pipeline_units()`` (``lightning_par.examples.GPT`` expands its ``pp_plan``);
2. **a Hugging Face model's own**: ``config.base_model_pp_plan`` plus the head's ``_pp_plan`` give the ordered
   units, ``_no_split_modules`` names the block classes;
3. **``block_types``** given by the user (classes or class names), as Lightning's FSDPStrategy takes a wrap policy;
4. **inference**: the items of the ``nn.ModuleList`` / ``nn.ModuleDict`` whose items share one class and hold the
   most parameters; the container's parent is the root, and its other children (in registration order) are the
   units before and after the blocks.

Blocks given by ``block_types`` may also sit in an ``nn.Sequential`` or be held directly by the model
(``self.block0``, ``self.block1``, ...): the module that holds them is then the root (see :func:`_with_units`).

Explicit ``block_types`` win over inference (step 4) but not over a model's own declaration: a model that says how
it splits is believed. Nothing here imports Lightning or allocates memory; it only reads the module tree, so it
also works on a model built on the meta device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from lightning_par.topology import LayoutError

#: What ``block_types`` accepts: classes, or class names (``"Block"``) / qualified names (``"pkg.mod.Block"``),
#: which is how a YAML config or the command line gives them.
BlockTypes = Sequence[type | str] | None

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


@dataclass(frozen=True)
class ModelBlocks:
    """Where a model's repeated blocks are.

    Attributes:
        root: the module the names below are relative to (the module a pipeline splits and ZeRO-3 makes its root
            group), e.g. a ``GPT`` or a ``LlamaForCausalLM``.
        path: ``root``'s name inside the module that was searched (``"model"`` for a LightningModule's
            ``self.model``; ``""`` when the searched module is the root).
        blocks: the repeated blocks, in execution order, e.g. ``("layers.0", ..., "layers.7")``.
        units: every pipeline unit in execution order (the blocks and what comes before and after them), or
            ``None`` where the order is not known (blocks found by type anywhere in the tree).
        source: how they were found, for the log and for error messages.
    """

    root: nn.Module
    path: str
    blocks: tuple[str, ...]
    units: tuple[str, ...] | None
    source: str

    def block_modules(self) -> list[nn.Module]:
        return [self.root.get_submodule(name) for name in self.blocks]

    def describe(self) -> str:
        where = f"`{self.path}` ({type(self.root).__name__})" if self.path else type(self.root).__name__
        kinds = sorted({type(m).__name__ for m in self.block_modules()})
        text = f"{where}: {len(self.blocks)} blocks of {'/'.join(kinds)} ({_span(self.blocks)}) from {self.source}"
        if self.units is not None:
            rest = [u for u in self.units if u not in set(self.blocks)]
            text += f"; pipeline units: the blocks and {rest}"
        return text


def _span(names: Sequence[str]) -> str:
    if len(names) < 2:  # (a pipeline rank whose stages hold no block: only the units before or after them)
        return names[0] if names else "none"
    return f"{names[0]} .. {names[-1]}"


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _items(container: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(key, m) for key, m in container._modules.items() if m is not None]


def _is_block_container(module: nn.Module) -> bool:
    """An ``nn.ModuleList`` / ``nn.ModuleDict`` of at least two modules of one class that hold parameters."""
    if not isinstance(module, _CONTAINERS):
        return False
    items = [m for _, m in _items(module)]
    return len(items) >= 2 and len({type(m) for m in items}) == 1 and all(_has_params(m) for m in items)


def _expand(root: nn.Module, names: Sequence[str]) -> list[str]:
    """Unit names with each repeated container replaced by its items (``layers`` -> ``layers.0``, ...)."""
    units = []
    for name in names:
        module = root.get_submodule(name)
        if isinstance(module, _CONTAINERS):
            units += [f"{name}.{key}" for key, _ in _items(module)]
        else:
            units.append(name)
    return units


def _blocks_among(root: nn.Module, units: Sequence[str]) -> tuple[str, ...]:
    """The units that are items of a container: the repeated part of an ordered unit list."""
    out = []
    for unit in units:
        parent, _, _ = unit.rpartition(".")
        if parent and isinstance(root.get_submodule(parent), _CONTAINERS):
            out.append(unit)
    return tuple(out)


# -- 1. our declaration -------------------------------------------------------------------------------------------
def _declared(module: nn.Module) -> ModelBlocks | None:
    for path, m in module.named_modules():
        if callable(getattr(m, "pipeline_units", None)):
            units = tuple(m.pipeline_units())
            return ModelBlocks(m, path, _blocks_among(m, units), units, f"{type(m).__name__}.pipeline_units()")
    return None


# -- 2. a Hugging Face model's own plans --------------------------------------------------------------------------
def is_hf_model(module: nn.Module) -> bool:
    """A ``transformers.PreTrainedModel``, recognised without importing ``transformers``."""
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    """``module.get_submodule(name)``, or None where the module has none of that name (a published pp plan may name
    a module this model class does not build: HRM's ``layers``)."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _hf(module: nn.Module) -> ModelBlocks | None:
    top = next(((p, m) for p, m in module.named_modules() if is_hf_model(m)), None)
    if top is None:
        return None
    path, model = top
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    base_path = prefix if isinstance(base, nn.Module) and base is not model else ""
    base = model.get_submodule(base_path) if base_path else model
    plan = getattr(getattr(base, "config", None), "base_model_pp_plan", None) or {}
    units: tuple[str, ...] | None = None
    if plan and all(isinstance(_submodule(base, n), nn.Module) for n in plan):
        names = [f"{base_path}.{n}" if base_path else n for n in plan]
        head_plan = getattr(model, "_pp_plan", None) or {} if base is not model else {}
        units = tuple(_expand(model, names) + [n for n in head_plan if isinstance(getattr(model, n, None), nn.Module)])
        blocks = _blocks_among(model, units)
        return ModelBlocks(model, path, blocks, units, f"{type(model).__name__}'s Hugging Face base_model_pp_plan")
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    blocks = _outermost(model, lambda m: type(m).__name__ in no_split)
    if blocks:
        return ModelBlocks(model, path, blocks, None, f"{type(model).__name__}'s Hugging Face _no_split_modules")
    return None


# -- 3. user-given block types ------------------------------------------------------------------------------------
def _matches(module: nn.Module, block_types: Sequence[type | str]) -> bool:
    cls = type(module)
    for wanted in block_types:
        if isinstance(wanted, type):
            if isinstance(module, wanted):
                return True
        elif wanted in (cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"):
            return True
    return False


def _outermost(root: nn.Module, pred) -> tuple[str, ...]:
    """Names of the modules satisfying ``pred`` that are not inside another such module, in registration order."""
    found: list[str] = []
    for name, m in root.named_modules():
        if name and pred(m) and not any(name.startswith(f + ".") for f in found):
            found.append(name)
    return tuple(found)


def _by_type(module: nn.Module, block_types: Sequence[type | str]) -> ModelBlocks | None:
    blocks = _outermost(module, lambda m: _matches(m, block_types))
    if not blocks:
        names = [t.__name__ if isinstance(t, type) else t for t in block_types]
        raise LayoutError(
            f"block_types={names} matches no module of {type(module).__name__}. Give the class (or class name) of "
            "the model's repeated transformer block, e.g. block_types=['Block']."
        )
    return _with_units(module, blocks, f"block_types={[t if isinstance(t, str) else t.__name__ for t in block_types]}")


# -- 4. inference from containers ---------------------------------------------------------------------------------
def _inferred(module: nn.Module) -> ModelBlocks | None:
    containers = [(n, m) for n, m in module.named_modules() if _is_block_container(m)]
    if not containers:
        return None
    name, container = max(containers, key=lambda nc: sum(p.numel() for p in nc[1].parameters()))
    blocks = tuple(f"{name}.{key}" for key, _ in _items(container))
    kind = type(container).__name__
    return _with_units(module, blocks, f"its {kind} `{name}` of {type(_items(container)[0][1]).__name__}")


def _with_units(module: nn.Module, blocks: tuple[str, ...], source: str) -> ModelBlocks:
    """Blocks named inside ``module``, re-rooted at the module that runs them, with its ordered units when all
    blocks have one parent:

    * in an ``nn.ModuleList`` / ``nn.ModuleDict`` / ``nn.Sequential``: the root is the container's parent, and its
      other children with parameters come before or after the blocks by registration order;
    * held directly by a module (``self.block0 = Block()``, ...): that module is the root and its children with
      parameters, blocks included, are the units in registration order.

    Blocks with different parents get their lowest common ancestor as the root (order unknown: no units). The root
    is never left at the searched module when the blocks lie inside a submodule of it, so ZeRO-3's root group is a
    module whose forward runs (a LightningModule's is never called by its own step).
    """
    parents = {b.rpartition(".")[0] for b in blocks}
    if len(parents) == 1:
        parent_path = next(iter(parents))
        parent = module.get_submodule(parent_path) if parent_path else module
        if parent_path and isinstance(parent, (*_CONTAINERS, nn.Sequential)):
            root_path, _, container_name = parent_path.rpartition(".")
            root = module.get_submodule(root_path) if root_path else module
            local_blocks = tuple(f"{container_name}.{b.rpartition('.')[2]}" for b in blocks)
            units: list[str] = []
            for child_name, child in root.named_children():
                if child_name == container_name:
                    units += local_blocks
                elif _has_params(child):
                    units.append(child_name)
            return ModelBlocks(root, root_path, local_blocks, tuple(units), source)
        local_blocks = tuple(b.rpartition(".")[2] for b in blocks)
        units = [name for name, child in parent.named_children() if name in local_blocks or _has_params(child)]
        return ModelBlocks(parent, parent_path, local_blocks, tuple(units), source)
    split = [b.split(".")[:-1] for b in blocks]
    common: list[str] = []
    for parts in zip(*split, strict=False):  # the shortest path bounds the common prefix
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    root_path = ".".join(common)
    root = module.get_submodule(root_path) if root_path else module
    local = tuple(b[len(root_path) + 1:] if root_path else b for b in blocks)
    return ModelBlocks(root, root_path, local, None, source)


def find_blocks(module: nn.Module, block_types: BlockTypes = None) -> ModelBlocks:
    """The repeated blocks (and pipeline units, where known) of ``module`` or of the model inside it.

    Raises a :class:`LayoutError` that says how to declare them when none are found.
    """
    found = _declared(module) or _hf(module)
    if found is None and block_types:
        found = _by_type(module, block_types)
    found = found or _inferred(module)
    if found is None or not found.blocks:
        raise LayoutError(
            f"found no repeated blocks in {type(module).__name__}: it declares no `pipeline_units()` / `pp_plan`, "
            "is not a Hugging Face model with a base_model_pp_plan or _no_split_modules, and keeps no "
            "nn.ModuleList / nn.ModuleDict of modules of one class. Keep the blocks in an nn.ModuleList, or pass "
            "block_types=[YourBlock] to the strategy (on the command line: --trainer.strategy.block_types='[Block]')."
        )
    return found
