"""A model as the planner sees it: built on the meta device, its units, blocks, parameters and tensor-parallel split.

Nothing here allocates a weight. The model is built inside ``torch.device("meta")`` (a LightningModule's
``configure_model()`` included), so an 8B or a 1T model costs a few megabytes of Python objects. What the planner
needs is then read from the module tree, with the same functions the strategies use:

- the pipeline units and repeated blocks: :func:`lightning_par.parallel.blocks.find_blocks` (our ``pp_plan``, a
  Hugging Face ``base_model_pp_plan``, or the ``nn.ModuleList`` of a plain PyTorch model);
- every parameter, the units that hold it (a tied embedding/head: two), its shape and dtype;
- how tensor parallelism splits it: :func:`lightning_par.parallel.tensor_parallel.resolve_tp_plan` (which also
  says when tp does not divide the heads, the hidden or FFN size or the vocabulary);
- its mixture-of-experts layers, found as expert parallel finds them (declared, or from a Hugging Face model's ep
  plan: :func:`lightning_par.parallel.expert_parallel.moe_layers`): experts, top-k, the parameters stacked over the
  experts, and so the parameters a token uses (active) beside all of them (:class:`Experts`).

:func:`build_model` makes the model from a class path and its init arguments, or from a Hugging Face
``config.json``.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_par.parallel.blocks import ModelBlocks, find_blocks
from lightning_par.parallel.expert_parallel import moe_layers
from lightning_par.parallel.tensor_parallel import planned_split_dim, resolve_tp_plan
from lightning_par.topology import LayoutError

_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


# ----------------------------------------------------------------------------------------------------------------------
# Building on the meta device
# ----------------------------------------------------------------------------------------------------------------------
def import_object(path: str) -> Any:
    module_name, _, name = path.rpartition(".")
    if not module_name:
        raise LayoutError(f"--model={path!r}: give the full import path, "
                          "e.g. lightning_par.examples.GPTLightningModule.")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as err:
        raise LayoutError(f"--model={path!r} cannot be imported: {err}") from err


def _coerce(value: str, annotation: Any, default: Any) -> Any:
    import yaml

    parsed = yaml.safe_load(value) if value != "" else ""
    kind = type(default) if default not in (None, inspect.Parameter.empty) else None
    text = str(annotation)
    if (kind is float or text in ("float", "<class 'float'>") or "float" in text.split("|")[0]) and isinstance(
            parsed, (int, str)) and not isinstance(parsed, bool):
        try:
            return float(parsed)
        except ValueError:
            return parsed
    if kind is tuple and isinstance(parsed, list):
        return tuple(parsed)
    return parsed


def parse_init_args(cls: type, pairs: Mapping[str, str]) -> dict[str, Any]:
    """``{"preset": "8b", "n_layers": "4"}`` -> typed init arguments of ``cls`` (YAML values, floats where the
    signature says float)."""
    params = inspect.signature(cls.__init__).parameters
    takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = {}
    for key, value in pairs.items():
        if key not in params and not takes_kwargs:
            valid = [n for n in params if n != "self"]
            raise LayoutError(f"{cls.__name__} takes no argument {key!r}; its arguments are {valid}.")
        p = params.get(key)
        out[key] = _coerce(value, p.annotation if p else None, p.default if p else None) if isinstance(
            value, str) else value
    return out


class _SkipInitOnMeta(TorchFunctionMode):
    """Weight initialisation has nothing to fill on the meta device, but its ops still run through Python
    decompositions there (about 2 ms per tensor: seconds for a 1T model): skip the in-place init ops on meta."""

    SKIP = frozenset({"normal_", "uniform_", "fill_", "zero_", "erfinv_", "clamp_", "mul_", "add_", "copy_",
                      "exponential_", "bernoulli_", "random_", "div_", "sub_", "trunc_normal_", "kaiming_uniform_",
                      "kaiming_normal_", "xavier_uniform_", "xavier_normal_", "zeros_", "ones_", "constant_"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.SKIP:  # a tensor method, or torch.nn.init's (tensor=... keyword)
            target = args[0] if args else next(iter(kwargs.values()), None)
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def build_model(model: str | type | nn.Module | None = None, init_args: Mapping[str, Any] | None = None,
                hf_config: str | Path | None = None) -> nn.Module:
    """The model on the meta device: a class (or its import path) called with ``init_args``, then its
    ``configure_model()`` if it has one (LightningModules build their network there); or a Hugging Face causal LM
    from a local ``config.json`` (or the folder holding it)."""
    with torch.device("meta"), _SkipInitOnMeta():
        if hf_config is not None:
            import transformers

            # never the code a config directory may ship (transformers would ask "[y/N]" on a terminal)
            config = transformers.AutoConfig.from_pretrained(str(hf_config), trust_remote_code=False)
            return transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=False)
        if isinstance(model, nn.Module):
            obj = model
        else:
            cls = import_object(model) if isinstance(model, str) else model
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise LayoutError(f"--model={model!r} is not an nn.Module class (a LightningModule or a plain "
                                  "PyTorch model).")
            obj = cls(**parse_init_args(cls, dict(init_args or {})))
        if callable(getattr(obj, "configure_model", None)):
            try:
                obj.configure_model()
            except (LayoutError, TypeError):
                raise
            except Exception as err:  # noqa: BLE001 -- one line naming the module, not a traceback
                cause = f"{type(err).__name__}: {str(err).rstrip('.')}"
                raise LayoutError(f"{type(obj).__name__}.configure_model() failed on the meta device, where the "
                                  f"planner builds it without a Trainer: {cause}. Build the model from init "
                                  "arguments alone (e.g. a vocab_size argument, given as --model.vocab_size=N) rather "
                                  "than from self.trainer.") from err
    return obj


# ----------------------------------------------------------------------------------------------------------------------
# What is in it
# ----------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ParamInfo:
    """One parameter (a tied one once): its first name relative to the root, shape, dtype, owner and units."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    owner: str
    units: tuple[str, ...]  # the pipeline units holding it; () when outside every unit (every stage keeps one)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _shard_numel(shape: tuple[int, ...], dim: int | None, n: int) -> int:
    """Elements of one shard of ``shape`` split ``n`` ways along ``dim`` (None: not split)."""
    if dim is None or n == 1:
        return math.prod(shape)
    rest = math.prod(shape) // shape[dim]
    return -(-shape[dim] // n) * rest


@dataclass
class TPSplit:
    """How tensor parallelism of size ``tp`` splits each parameter: ``dims[name]`` is the split dimension (None:
    replicated on every tp rank); ``styles`` the resolved plan (module FQN relative to the root -> style)."""

    tp: int
    sequence_parallel: bool
    dims: dict[str, int | None]
    styles: dict[str, str]

    def local_numel(self, param: ParamInfo) -> int:
        return _shard_numel(param.shape, self.dims.get(param.name), self.tp)

    def local_shape(self, param: ParamInfo) -> tuple[int, ...]:
        dim = self.dims.get(param.name)
        if dim is None or self.tp == 1:
            return param.shape
        shape = list(param.shape)
        shape[dim] = -(-shape[dim] // self.tp)
        return tuple(shape)


@dataclass(frozen=True)
class Experts:
    """The model's mixture-of-experts layers: ``layers[name] = (experts, top_k)``, and the names of the parameters
    stacked over the experts (dimension 0: what expert parallel splits)."""

    layers: dict[str, tuple[int, int]]
    params: frozenset[str]
    numel: int  # elements of all expert weights

    @property
    def active_numel(self) -> int:
        """Of :attr:`numel`, the elements one token's ``top_k`` experts hold (the same per expert in a layer)."""
        return round(self.numel * sum(k for _, k in self.layers.values()) / sum(e for e, _ in self.layers.values()))

    def divides(self, ep: int) -> bool:
        """Whether ``ep`` ranks split every layer's experts evenly."""
        return all(e % ep == 0 for e, _ in self.layers.values())

    def describe(self) -> str:
        kinds = sorted({f"{e} experts, top-{k}" for e, k in self.layers.values()})
        return f"{'; '.join(kinds)} in {len(self.layers)} layers"


def find_experts(root: nn.Module) -> Experts | None:
    """The mixture-of-experts layers of ``root`` (None: a dense model): declared, or planned by a Hugging Face
    model's ep plan (:func:`~lightning_par.parallel.expert_parallel.moe_layers`)."""
    layers = moe_layers(root)
    if not layers:
        return None
    names = {f"{name}.{p}" if name else p for name, layer in layers.items() for p in layer.parameters}
    numel = sum(p.numel() for n, p in root.named_parameters() if n in names)
    return Experts({name: (layer.num_experts, layer.top_k) for name, layer in layers.items()}, frozenset(names), numel)


@dataclass
class ModelInfo:
    """The model, its blocks and units, its parameters, and what a forward needs (vocabulary, loss)."""

    obj: nn.Module
    found: ModelBlocks
    units: list[str]
    params: list[ParamInfo]
    description: str
    vocab_size: int | None
    hidden_size: int | None
    optimizer: str
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    experts: Experts | None = None  # its mixture-of-experts layers; None for a dense model
    _splits: dict[tuple[int, bool], TPSplit] = field(default_factory=dict, repr=False)
    _short: ShortModel | None = field(default=None, repr=False)

    @property
    def root(self) -> nn.Module:
        return self.found.root

    @property
    def blocks(self) -> tuple[str, ...]:
        return self.found.blocks

    @property
    def numel(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def active_numel(self) -> int:
        """The parameters one token uses: every expert weight replaced by its top-k share (all for a dense model)."""
        return self.numel - (self.experts.numel - self.experts.active_numel if self.experts else 0)

    @property
    def default_seq_len(self) -> int:
        """The sequence length to plan for when none is given: the model's longest (``max_seq_len``,
        ``max_position_embeddings`` or ``n_positions``, of its config or itself), at most 8192; else 2048."""
        for holder in (getattr(self.root, "config", None), self.root):
            for name in ("max_seq_len", "max_position_embeddings", "n_positions"):
                value = getattr(holder, name, None)
                if isinstance(value, int) and value > 0:
                    return min(value, 8192)
        return 2048

    def unit_params(self, unit: str) -> list[ParamInfo]:
        return [p for p in self.params if unit in p.units]

    def tp_split(self, tp: int, sequence_parallel: bool = False) -> TPSplit:
        """The tensor-parallel split for ``tp`` ranks; raises :class:`LayoutError` when tp cannot split the model."""
        key = (tp, sequence_parallel)
        if key not in self._splits:
            if tp == 1:
                self._splits[key] = TPSplit(1, False, {}, {})
            else:
                styles = resolve_tp_plan(self.root, tp, sequence_parallel)
                dims: dict[str, int | None] = {}
                for p in self.params:
                    dims[p.name] = planned_split_dim(styles.get(p.owner), self.root.get_submodule(p.owner),
                                                     p.name.rpartition(".")[2])
                self._splits[key] = TPSplit(tp, sequence_parallel, dims, styles)
        return self._splits[key]


def _config_value(obj: nn.Module, names: tuple[str, ...]) -> int | None:
    for holder in (getattr(obj, "config", None), obj):
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return None


def _first(module: nn.Module, kind: type) -> nn.Module | None:
    return next((m for m in module.modules() if isinstance(m, kind)), None)


def _optimizer_of(obj: nn.Module) -> str:
    hparams = getattr(obj, "hparams", None)
    name = None
    if hparams is not None:
        try:
            name = hparams.get("optimizer")
        except AttributeError:
            name = None
    return str(name).lower() if name else "adamw"


def inspect_model(obj: nn.Module, block_types: list[str] | None = None) -> ModelInfo:
    """Read units, blocks and parameters of a model built by :func:`build_model`."""
    found = find_blocks(obj, block_types)
    root = found.root
    units = list(found.units) if found.units is not None else list(found.blocks)
    owners: dict[int, str] = {}
    for mod_name, module in root.named_modules(remove_duplicate=False):
        for p_name, p in module.named_parameters(recurse=False, prefix=mod_name, remove_duplicate=False):
            owners.setdefault(id(p), p_name.rpartition(".")[0])
    held: dict[int, list[str]] = {}
    first: dict[int, tuple[str, nn.Parameter]] = {}
    for fqn, p in root.named_parameters(remove_duplicate=False):
        first.setdefault(id(p), (fqn, p))
        unit = next((u for u in units if fqn.startswith(u + ".")), None)
        if unit is not None and unit not in held.setdefault(id(p), []):
            held[id(p)].append(unit)
        held.setdefault(id(p), [])
    params = [ParamInfo(fqn, tuple(p.shape), p.dtype, owners[key], tuple(held[key]))
              for key, (fqn, p) in first.items()]
    embedding = _first(root, nn.Embedding)
    vocab = _config_value(root, ("vocab_size",)) or (embedding.num_embeddings if embedding is not None else None)
    hidden = _config_value(root, ("dim", "hidden_size", "n_embd")) or (
        embedding.embedding_dim if embedding is not None else None)
    loss_fn = getattr(obj, "loss_fn", None)
    numel = sum(p.numel for p in params)
    experts = find_experts(root)
    description = (f"{type(obj).__name__}: {numel / 1e9:.3g}B parameters ({numel:,}), {len(found.blocks)} blocks of "
                   f"{type(root.get_submodule(found.blocks[0])).__name__}, units from {found.source}")
    info = ModelInfo(obj, found, units, params, description, vocab, hidden, _optimizer_of(obj),
                     loss_fn if callable(loss_fn) else None, experts)
    if experts is not None:
        info.description += (f"; mixture of experts: {experts.describe()}, {info.active_numel / 1e9:.3g}B active "
                             f"parameters per token ({info.active_numel:,})")
    return info


# ----------------------------------------------------------------------------------------------------------------------
# A short copy to trace: one block of each kind
# ----------------------------------------------------------------------------------------------------------------------
def block_signature(module: nn.Module) -> tuple:
    """Blocks with the same class and parameter shapes cost the same: one of them is traced for all."""
    return (type(module).__qualname__, tuple((n, tuple(p.shape)) for n, p in module.named_parameters()))


@dataclass
class ShortModel:
    """A copy of the model that keeps the first block of each signature (usually one block in all).

    ``represents[unit]`` names the unit of the short copy whose costs stand for ``unit`` of the full model.
    """

    obj: nn.Module
    root_path: str
    units: list[str]
    represents: dict[str, str]
    blocks: list[str]


def short_model(info: ModelInfo) -> ShortModel:
    """Deep-copy the (meta) model and remove all blocks but one per signature."""
    if info._short is not None:
        return info._short
    kept: dict[tuple, str] = {}
    represents: dict[str, str] = {}
    for unit in info.units:
        if unit in info.blocks:
            sig = block_signature(info.root.get_submodule(unit))
            kept.setdefault(sig, unit)
            represents[unit] = kept[sig]
        else:
            represents[unit] = unit
    keep = set(kept.values())
    by_container: dict[str, list[str]] = {}
    for block in info.blocks:
        by_container.setdefault(block.rpartition(".")[0], []).append(block)
    # copy the model with only the kept blocks in their containers (the others are taken out for the copy and put
    # back): copying a 1T model's 128 blocks to delete 127 of them costs seconds
    saved: dict[str, dict[str, nn.Module]] = {}
    for container_path in by_container:
        container = info.root.get_submodule(container_path)
        if not isinstance(container, _CONTAINERS):
            raise LayoutError(f"the blocks of {type(info.root).__name__} sit in a {type(container).__name__}; the "
                              "planner handles blocks in an nn.ModuleList or nn.ModuleDict.")
        saved[container_path] = container._modules
        container._modules = {k: m for k, m in container._modules.items() if f"{container_path}.{k}" in keep}
    try:
        obj = copy.deepcopy(info.obj)
    finally:
        for container_path, modules in saved.items():
            info.root.get_submodule(container_path)._modules = modules
    root = obj.get_submodule(info.found.path) if info.found.path else obj
    renamed: dict[str, str] = {}
    for container_path, names in by_container.items():
        container = root.get_submodule(container_path)
        survivors = [n for n in names if n in keep]
        if isinstance(container, nn.ModuleList):  # re-index the survivors 0, 1, ...
            container._modules = {str(i): container._modules[n.rpartition(".")[2]] for i, n in enumerate(survivors)}
            renamed.update({n: f"{container_path}.{i}" for i, n in enumerate(survivors)})
        else:
            renamed.update({n: n for n in survivors})
    represents = {u: renamed.get(r, r) for u, r in represents.items()}
    short_units = [renamed.get(u, u) for u in info.units if u not in info.blocks or u in keep]
    short = ShortModel(obj, info.found.path, short_units, represents, [renamed[b] for b in info.blocks if b in keep])
    info._short = short
    return short
