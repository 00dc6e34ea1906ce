"""Tensor (Megatron) and sequence parallelism from a model's own declared plan, applied with DTensor.

A model declares how it may be split in Hugging Face form: a ``tp_plan`` mapping module-name patterns (``"*"``
matches one name component) to style strings. Our GPT declares ``GPT.tp_plan``; a ``transformers`` model publishes
``config.base_model_tp_plan`` plus its head's ``_tp_plan`` (merged on the instance as ``model.tp_plan``).
:func:`resolve_tp_plan` expands the patterns to module names and checks every size against ``tp`` without touching
a process group, so a bad layout fails before any rank waits; :func:`apply_tensor_parallel` turns the resolved
strings into ``torch.distributed.tensor.parallel`` styles and applies them with ``parallelize_module``.

What the engine adds to a plan, so that a published plan trains unchanged:

* ``block_input`` on the parent of each group of column-parallel linears (attention, MLP): the block's input is
  made a replicated DTensor once, so q/k/v (or gate/up) share one backward all-reduce -- Megatron's "f" -- instead
  of one each; with sequence parallelism the same place all-gathers the sequence shards once per block;
* ``replicate`` on every other module that holds parameters (norms without sequence parallelism): its parameters
  become replicated DTensors too, so every parameter is a DTensor and ``clip_grad_norm_`` computes the true
  global norm (a mix of plain tensors and DTensors cannot be stacked);
* with ``sequence_parallel``: ``sequence_parallel`` on norms (they run on sequence shards; their weight gradients
  are all-reduced over tp), row-parallel outputs and the vocab-parallel embedding reduce-scatter to sequence
  shards, the head gathers them. Training needs tp to divide the sequence length (checked each batch); without
  gradients (generation) the tokens are padded on the right instead, which a causal decoder does not notice;
* tied weights (embedding = head) are tied again after the parameters were replaced by DTensors.

Style strings (Hugging Face meaning kept for Hugging Face names):

==================================== ============================================================================
``colwise``                          Linear split on out_features; input replicated, output sharded (local)
``rowwise``                          Linear split on in_features; output all-reduced (SP: reduce-scattered)
``colwise_rep``, ``colwise_gather_output``  column-parallel, output all-gathered to the full tensor
``rowwise_rep``, ``rowwise_split_input``    row-parallel taking a replicated input
``vocab_parallel``                   Embedding: vocabulary rows sharded. Linear head: output (vocabulary) split,
                                     logits stay a ``Shard(-1)`` DTensor for the vocab-parallel cross-entropy
                                     inside :meth:`TensorParallelPlan.loss_context`, full tensor outside it
``embedding_rowwise``                Embedding with vocabulary rows sharded (Hugging Face's name)
``sequence_parallel``                norm on sequence shards (with sequence parallelism), else replicated
``replicate``, ``replicated_with_grad_allreduce``  parameters replicated on every TP rank
==================================== ============================================================================
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from lightning_par.topology import LayoutError

#: Styles of a resolved plan (see the module docstring); a declared plan may name all but ``block_input``, which
#: only the engine adds.
PLAN_STYLES: tuple[str, ...] = (
    "colwise",
    "rowwise",
    "colwise_rep",
    "colwise_gather_output",
    "rowwise_rep",
    "rowwise_split_input",
    "vocab_parallel",
    "embedding_rowwise",
    "sequence_parallel",
    "replicate",
    "replicated_with_grad_allreduce",
    "block_input",
)
_COLUMN_STYLES = ("colwise", "colwise_rep", "colwise_gather_output")
_ROW_STYLES = ("rowwise", "rowwise_rep", "rowwise_split_input")
_REPLICATE_STYLES = ("replicate", "replicated_with_grad_allreduce")
#: Config fields that tp must divide, with their meaning: ours (GPTConfig) and Hugging Face's.
_CONFIG_SIZES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("n_heads", "num_attention_heads"), "attention head count"),
    (("n_kv_heads", "num_key_value_heads"), "key/value head count"),
    (("dim", "hidden_size"), "hidden size"),
    (("ffn_dim", "intermediate_size"), "FFN size"),
    (("vocab_size",), "vocabulary size"),
)

# How many loss_context() regions are open; the vocab-parallel head returns full logits when none is.
_LOSS_PARALLEL_DEPTH = 0


# ---------------------------------------------------------------------------------------------------------------------
# Finding and resolving the plan (no process group needed)
# ---------------------------------------------------------------------------------------------------------------------
def _is_hf_model(module: nn.Module) -> bool:
    return hasattr(module, "config") and hasattr(module, "base_model_prefix") and hasattr(module, "post_init")


def _declared_plan(module: nn.Module) -> dict[str, str] | None:
    """The plan ``module`` itself declares, relative to ``module``; None when it declares none."""
    if _is_hf_model(module):
        plan = getattr(module, "tp_plan", None)  # transformers >= 5: merged on the instance by post_init
        if isinstance(plan, dict) and plan:
            return dict(plan)
        # older transformers: the base model's plan lives on the config, the head's on the class
        base = dict(getattr(module.config, "base_model_tp_plan", None) or {})
        prefix = module.base_model_prefix
        if base and prefix and getattr(module, prefix, None) is not None and getattr(module, prefix) is not module:
            base = {f"{prefix}.{k}": v for k, v in base.items()}
        base.update(getattr(type(module), "_tp_plan", None) or {})
        return base or None
    plan = getattr(module, "tp_plan", None)
    return dict(plan) if isinstance(plan, dict) and plan else None


def find_tp_plan(module: nn.Module) -> tuple[str, nn.Module, dict[str, str]] | None:
    """The first sub-module (pre-order, ``module`` included) that declares a plan: ``(fqn, model, plan)``."""
    for name, sub in module.named_modules():
        plan = _declared_plan(sub)
        if plan:
            return name, sub, plan
    return None


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    parts = ["[^.]+" if part == "*" else re.escape(part) for part in pattern.split(".")]
    return re.compile(r"\.".join(parts))


def _config_sizes(model: nn.Module) -> list[tuple[str, str, int]]:
    config = getattr(model, "config", None)
    out = []
    for names, meaning in _CONFIG_SIZES:
        for name in names:
            value = getattr(config, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                out.append((name, meaning, value))
                break
    return out


def _check_divisible(what: str, size: int, tp: int, fix: str) -> None:
    if size % tp:
        raise LayoutError(f"{what} is {size}, which tp={tp} does not divide: {fix}")


def _tp_choices(sizes: list[int]) -> str:
    import math

    common = math.gcd(*sizes) if sizes else 1
    return ", ".join(str(d) for d in range(1, common + 1) if common % d == 0)


def resolve_tp_plan(module: nn.Module, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
    """Expand and validate ``module``'s declared plan for ``tp`` ranks; no process group or mesh is needed.

    Returns ``{module FQN (relative to module): style}`` in application order, including the entries the engine adds
    (``block_input``, ``replicate``, ``sequence_parallel`` on norms). Raises :class:`LayoutError` that names the
    module, the sizes and the fix for: no plan, an unknown style, a pattern that matches no module, a head count,
    hidden/FFN size, vocabulary or sharded Linear/Embedding dimension that ``tp`` does not divide, and sequence
    parallelism on a model it cannot be applied to.
    """
    found = find_tp_plan(module)
    if found is None:
        raise LayoutError(
            f"{type(module).__name__} declares no tensor-parallel plan, so tp={tp} cannot split it. Add a `tp_plan` "
            "class attribute to the model that maps module-name patterns to styles (Hugging Face "
            "`base_model_tp_plan` form), e.g. {'layers.*.attn.q_proj': 'colwise', 'layers.*.attn.o_proj': "
            "'rowwise', 'embed': 'vocab_parallel', 'head': 'vocab_parallel'}; or train with tp=1."
        )
    root_name, model, plan = found
    prefix = f"{root_name}." if root_name else ""
    model_name = type(model).__name__

    sizes = _config_sizes(model)
    for field_name, meaning, value in sizes:
        _check_divisible(
            f"{model_name}: the {meaning} (config.{field_name})", value, tp,
            f"each tensor-parallel rank must hold an equal share. Use a tp that divides all of "
            f"{', '.join(f'{n}={v}' for n, _, v in sizes)} (choices: {_tp_choices([v for _, _, v in sizes])}), "
            f"or change config.{field_name}.",
        )

    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in PLAN_STYLES or style == "block_input":
            allowed = ", ".join(s for s in PLAN_STYLES if s != "block_input")
            raise LayoutError(
                f"{model_name}.tp_plan[{pattern!r}] = {style!r} is not a style lightning-par applies; "
                f"use one of: {allowed}."
            )
        regex = _pattern_regex(pattern)
        matched = [name for name in names if regex.fullmatch(name)]
        if not matched:
            raise LayoutError(
                f"{model_name}.tp_plan names {pattern!r}, but {model_name} has no module of that name (\"*\" "
                f"matches one name component). Its modules include: {', '.join(names[:12])}"
                f"{', ...' if len(names) > 12 else ''}. Fix the pattern or remove it from the plan."
            )
        for name in matched:
            resolved[name] = style

    for name, style in resolved.items():
        _check_module(model_name, name, model.get_submodule(name), style, tp)

    if sequence_parallel and _is_hf_model(model):
        raise LayoutError(
            f"sequence_parallel=True with the Hugging Face model {model_name}: its forward derives positions and "
            "the attention mask from the local sequence length, which sequence shards would change. Use "
            "sequence_parallel=False (tensor parallelism alone), or a model written for it such as the example GPT."
        )

    # Engine additions: one input collective per block, and every remaining parameter owner as a DTensor.
    column = [n for n, s in resolved.items() if s == "colwise"]
    parents = sorted({n.rpartition(".")[0] for n in column if "." in n}, key=names.index)
    additions: dict[str, str] = {}
    for parent in parents:
        if parent not in resolved:
            additions[parent] = "block_input"
    covered = set(resolved)
    for name, sub in model.named_modules():
        if not name or name in covered or any(name.startswith(c + ".") for c in covered):
            continue
        if any(True for _ in sub.parameters(recurse=False)):
            additions[name] = "sequence_parallel" if sequence_parallel and _is_norm(sub) else "replicate"
    if sequence_parallel:
        for name, style in list(resolved.items()):
            if style in _REPLICATE_STYLES and _is_norm(model.get_submodule(name)):
                resolved[name] = "sequence_parallel"
    # block inputs before their children so both the hooks and the listing read top-down
    ordered = {**additions, **resolved}
    return {f"{prefix}{name}": ordered[name] for name in sorted(ordered, key=names.index)}


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _check_module(model_name: str, name: str, module: nn.Module, style: str, tp: int) -> None:
    where = f"{model_name}.{name} ({type(module).__name__})"
    if style in _COLUMN_STYLES or (style == "vocab_parallel" and isinstance(module, nn.Linear)):
        if not isinstance(module, nn.Linear):
            raise LayoutError(f"{where} is planned {style!r}, which splits an nn.Linear; change its plan entry.")
        _check_divisible(f"{where}: out_features", module.out_features, tp,
                         f"{style!r} splits the output features over tp ranks. Use a tp that divides "
                         f"{module.out_features} or resize the layer.")
    elif style in _ROW_STYLES:
        if not isinstance(module, nn.Linear):
            raise LayoutError(f"{where} is planned {style!r}, which splits an nn.Linear; change its plan entry.")
        _check_divisible(f"{where}: in_features", module.in_features, tp,
                         f"{style!r} splits the input features over tp ranks. Use a tp that divides "
                         f"{module.in_features} or resize the layer.")
    elif style in ("vocab_parallel", "embedding_rowwise"):
        if not isinstance(module, nn.Embedding):
            raise LayoutError(f"{where} is planned {style!r}, which splits an nn.Embedding or head nn.Linear.")
        _check_divisible(f"{where}: the vocabulary (num_embeddings)", module.num_embeddings, tp,
                         f"vocabulary rows are split over tp ranks. Pad the vocabulary to a multiple of {tp} "
                         "or use a tp that divides it.")


def check_sequence_length(seq_len: int, tp: int) -> None:
    """Sequence parallelism splits the sequence over tp ranks: raise a clear error unless tp divides it."""
    if seq_len % tp:
        lower = seq_len - seq_len % tp
        raise LayoutError(
            f"sequence_parallel=True splits each sequence over tp={tp} ranks, but the batch's sequence length is "
            f"{seq_len}. Use a sequence length divisible by {tp} (e.g. {lower} or {lower + tp}), or "
            "sequence_parallel=False."
        )


# ---------------------------------------------------------------------------------------------------------------------
# Styles the engine adds (torch has no ready-made one for these)
# ---------------------------------------------------------------------------------------------------------------------
def _first_tensor(args: tuple, kwargs: dict) -> tuple[str | int, torch.Tensor] | None:
    if args and isinstance(args[0], torch.Tensor):
        return 0, args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states", kwargs["hidden_states"]
    return None


class BlockInput(ParallelStyle):
    """Make a block's hidden-state input one replicated DTensor that its column-parallel linears share.

    Forward: nothing to do without sequence parallelism; an all-gather of the sequence shards with it. Backward:
    the linears' partial input gradients add up locally and are reduced once (all-reduce; reduce-scatter with
    sequence parallelism), as Megatron-LM does, instead of once per linear.
    """

    def __init__(self, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.input_layout: Placement = Shard(1) if sequence_parallel else Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.input_layout

        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            found = _first_tensor(args, kwargs)
            if found is None:
                return args, kwargs
            key, tensor = found
            if not isinstance(tensor, DTensor):
                tensor = DTensor.from_local(tensor, device_mesh, (layout,), run_check=False)
            tensor = tensor.redistribute(device_mesh, (Replicate(),))
            if isinstance(key, int):
                return (tensor, *args[1:]), kwargs
            return args, {**kwargs, key: tensor}

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class ReplicateParameters(ParallelStyle):
    """Parameters replicated on every TP rank, as DTensors (so gradient-norm clipping sees one kind of tensor).

    The module still computes on plain tensors: for the duration of its forward each parameter is swapped for its
    local value (``to_local()``, through which autograd returns the gradient to the DTensor parameter). Computing
    on replicated DTensors instead would give the same numbers with a DTensor dispatch per elementwise op, which
    for a norm costs more than the norm itself.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.detach(), device_mesh, [Replicate()])
            module.register_parameter(name, nn.Parameter(replicated, requires_grad=param.requires_grad))
        swapped: list[dict[str, Any]] = []

        def to_local(mod: nn.Module, _args: Any) -> None:
            originals = {n: p for n, p in mod._parameters.items() if isinstance(p, DTensor)}
            swapped.append(originals)
            for n, p in originals.items():
                mod._parameters[n] = p.to_local()  # type: ignore[assignment]

        def restore(mod: nn.Module, _args: Any, _output: Any) -> None:
            mod._parameters.update(swapped.pop())

        module.register_forward_pre_hook(to_local)
        module.register_forward_hook(restore)
        return module


class SequenceShardedNorm(ReplicateParameters):
    """A norm on this rank's sequence shard (sequence parallelism), with replicated DTensor parameters.

    Like torch's ``SequenceParallel`` it takes and returns sequence shards; unlike it, the norm runs on plain local
    tensors (no DTensor dispatch per elementwise op). Each rank's weight gradient covers only its tokens, so it is
    all-reduced over the tp group on its way back to the parameter -- the one collective this needs.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        group = device_mesh.get_group()

        def sum_over_shards(grad: torch.Tensor) -> torch.Tensor:
            total = grad.clone()
            torch.distributed.all_reduce(total, group=group)
            return total

        def reduce_weight_grads(mod: nn.Module, _args: Any) -> None:
            if torch.is_grad_enabled():
                for local in mod._parameters.values():
                    if local is not None and local.requires_grad and not isinstance(local, DTensor):
                        local.register_hook(sum_over_shards)

        def unwrap(_mod: nn.Module, args: tuple) -> tuple:
            return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)

        # runs after ReplicateParameters' swap (hooks run in registration order)
        module.register_forward_pre_hook(reduce_weight_grads)
        module.register_forward_pre_hook(unwrap)
        return module


class VocabParallelHead(ColwiseParallel):
    """Output head split over the vocabulary: logits stay ``Shard(-1)`` for the vocab-parallel cross-entropy.

    Inside :meth:`TensorParallelPlan.loss_context` the logits are a DTensor and ``F.cross_entropy`` runs on the
    shards (``loss_parallel``: no rank holds [tokens, vocab]); outside it (generation, prediction) they are
    all-gathered to an ordinary tensor.
    """

    def __init__(self, sequence_parallel: bool = False) -> None:
        super().__init__(input_layouts=Shard(1) if sequence_parallel else Replicate(), output_layouts=Shard(-1),
                         use_local_output=False)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)

        def full_logits_outside_loss(_module: nn.Module, _inputs: Any, output: Any) -> Any:
            if _LOSS_PARALLEL_DEPTH == 0 and isinstance(output, DTensor):
                return output.full_tensor()
            return output

        module.register_forward_hook(full_logits_outside_loss)
        return module


def parallel_style(style: str, module: nn.Module, sequence_parallel: bool) -> ParallelStyle:
    """The torch ``ParallelStyle`` for one resolved plan entry."""
    seq = Shard(1) if sequence_parallel else Replicate()
    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq)
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
    if style in ("rowwise_rep", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if style in ("vocab_parallel", "embedding_rowwise"):
        if isinstance(module, nn.Embedding):
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        return VocabParallelHead(sequence_parallel)
    if style == "sequence_parallel" and sequence_parallel:
        return SequenceShardedNorm()
    if style in (*_REPLICATE_STYLES, "sequence_parallel"):
        return ReplicateParameters()
    if style == "block_input":
        return BlockInput(sequence_parallel)
    raise LayoutError(f"unknown tensor-parallel style {style!r}; use one of {', '.join(PLAN_STYLES)}.")


# ---------------------------------------------------------------------------------------------------------------------
# Applying the plan
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class TensorParallelPlan:
    """What :func:`apply_tensor_parallel` did: the resolved plan, the torch styles, and how to compute the loss."""

    plan: dict[str, str]
    styles: dict[str, ParallelStyle]
    tp_mesh: DeviceMesh
    sequence_parallel: bool
    vocab_parallel_head: bool
    tied: list[list[str]] = field(default_factory=list)

    @contextmanager
    def loss_context(self) -> Iterator[None]:
        """Run the loss's forward AND backward in here: with a vocab-parallel head, ``F.cross_entropy`` then works
        on the vocabulary shards (``loss_parallel``); otherwise nothing changes."""
        global _LOSS_PARALLEL_DEPTH
        if not self.vocab_parallel_head:
            yield
            return
        _LOSS_PARALLEL_DEPTH += 1
        try:
            with loss_parallel():
                yield
        finally:
            _LOSS_PARALLEL_DEPTH -= 1


def _tied_parameters(module: nn.Module) -> list[list[str]]:
    owners: dict[int, list[str]] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for p_name, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
    return [sorted(set(names), key=names.index) for names in owners.values() if len(set(names)) > 1]


def _set_parameter(module: nn.Module, fqn: str, param: nn.Parameter) -> None:
    owner, _, name = fqn.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, name, param)


def _check_or_pad_sequence(model: nn.Module, tp: int) -> None:
    """Sequence parallelism needs tp to divide the sequence length: check every batch before any collective.

    Training with another length is an error. Without gradients (generation, whose length grows one token at a
    time) the tokens are padded on the right to a multiple of tp and the output cut back: exact for the causal
    decoders sequence parallelism is applied to here, where no position sees a later one.
    """
    padded: list[int] = []

    def before(_model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        found = _first_tensor(args, kwargs)
        if found is None or found[1].dim() < 2 or found[1].size(1) % tp == 0:
            padded.append(0)
            return None
        key, tokens = found
        if torch.is_grad_enabled():
            check_sequence_length(tokens.size(1), tp)
        pad = tp - tokens.size(1) % tp
        padded.append(pad)
        tokens = torch.nn.functional.pad(tokens, (0, pad) if tokens.dim() == 2 else (0, 0, 0, pad))
        if isinstance(key, int):
            return (tokens, *args[1:]), kwargs
        return args, {**kwargs, key: tokens}

    def after(_model: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> Any:
        pad = padded.pop() if padded else 0
        return output[:, :-pad] if pad and isinstance(output, torch.Tensor) else output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False
) -> TensorParallelPlan:
    """Split ``module`` (in place) over the 1-D ``tp_mesh`` by its declared plan; see :func:`resolve_tp_plan`.

    Parameters become DTensors on ``tp_mesh`` (sharded where the plan splits them, replicated elsewhere); tied
    parameters stay tied. With ``sequence_parallel`` a forward pre-hook on the declared model checks each batch's
    sequence length. Returns the :class:`TensorParallelPlan`; run the loss inside its ``loss_context()``.
    """
    tp = tp_mesh.size()
    plan = resolve_tp_plan(module, tp, sequence_parallel)
    root_name, model, _ = find_tp_plan(module)  # type: ignore[misc]
    tied = _tied_parameters(module)
    styles = {name: parallel_style(style, module.get_submodule(name), sequence_parallel) for name, style in
              plan.items()}
    parallelize_module(module, tp_mesh, styles)
    for names in tied:
        first = module.get_parameter(names[0])
        for other in names[1:]:
            replaced = module.get_parameter(other)
            if isinstance(first, DTensor) and isinstance(replaced, DTensor) and first.placements != replaced.placements:
                raise LayoutError(
                    f"{names[0]} and {other} are one tied parameter, but the plan splits them differently "
                    f"({first.placements} vs {replaced.placements}). Give both the same split, e.g. "
                    "'vocab_parallel' for the embedding and the head."
                )
            _set_parameter(module, other, first)
    if sequence_parallel:
        _check_or_pad_sequence(model, tp)
    vocab_head = any(isinstance(s, VocabParallelHead) for s in styles.values())
    return TensorParallelPlan(plan=plan, styles=styles, tp_mesh=tp_mesh, sequence_parallel=sequence_parallel,
                              vocab_parallel_head=vocab_head, tied=tied)
