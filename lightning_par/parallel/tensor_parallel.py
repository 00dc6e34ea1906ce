"""Tensor (Megatron) and sequence parallelism from a model's own declared plan, applied with DTensor.

A model declares how it may be split in Hugging Face form: a ``tp_plan`` mapping module-name patterns (``"*"``
matches one name component) to style strings. Our GPT declares ``GPT.tp_plan``; a ``transformers`` model publishes
``config.base_model_tp_plan`` plus its head's ``_tp_plan`` (merged on the instance as ``model.tp_plan``); a pattern
may name a parameter inside a ``moe_tp_experts`` module (transformers' 3-D expert weights), and a published plan's
pattern that matches nothing in this config is skipped, as transformers does.
:func:`resolve_tp_plan` expands the patterns to module names and checks every size against ``tp`` without touching
a process group, so a bad layout fails before any rank waits; :func:`apply_tensor_parallel` turns the resolved
strings into ``torch.distributed.tensor.parallel`` styles and applies them with ``parallelize_module``.

What the engine adds to a plan, so that a published plan trains unchanged:

* ``block_input`` on the parent of each group of column-parallel linears: their input is made a replicated
  DTensor once, so q/k/v (or gate/up) share one backward all-reduce -- Megatron's "f" -- instead of one each; with
  sequence parallelism the same place all-gathers the sequence shards once. For a parent that is one region
  (attention, an MLP module: every parameter inside is split) that is the parent's own input; for a parent that
  also holds other layers (a GPT-2 block, whose ``c_fc``/``c_proj`` sit next to ``ln_1``/``ln_2``) it is the input
  of each column-parallel child, once per distinct tensor, and the parent's own code keeps plain tensors;
* ``replicate`` on every other module that holds parameters (norms, position embeddings): its parameters become
  replicated DTensors too, so every parameter is a DTensor and ``clip_grad_norm_`` computes the true global norm
  (a mix of plain tensors and DTensors cannot be stacked);
* with ``sequence_parallel``: ``sequence_parallel`` instead of ``replicate`` (norms and the other replicated
  modules run on sequence shards, their weight gradients are all-reduced over tp; a replicated embedding such as
  learned positions has its output cut to this rank's positions), row-parallel outputs and the
  vocab-parallel embedding reduce-scatter to sequence shards, the head gathers them. Training needs tp to divide
  the sequence length (checked each batch); without gradients (generation) the tokens are padded on the right
  instead, which a causal decoder does not notice;
* tied weights (embedding = head) are tied again after the parameters were replaced by DTensors; a plan that
  splits the two differently is refused before any collective;
* dropout: a :class:`~lightning_par.parallel.rng.TensorParallelRNG` gives each tp rank its own random stream from
  a column-parallel output to the row-parallel input (where the ranks hold different heads or features), and
  leaves the default generator, identical on the tp ranks, to the replicated activations.

Biases need nothing extra: a column-parallel bias is split with the output features, a row-parallel bias is
replicated and added once to the reduced sum (DTensor adds a ``Replicate`` bias to a ``Partial`` matmul as
``bias / tp`` per rank).

Style strings (Hugging Face meaning kept for Hugging Face names):

==================================== ============================================================================
``colwise``                          Linear split on out_features; input replicated, output sharded (local)
``packed_colwise``, ``packed_colwise:N``  a fused Linear whose output is N equal parts concatenated (q|k|v: N=3;
                                     gate|up: N=2, transformers' meaning of ``packed_colwise``); each rank holds its
                                     slice of every part, so ``chunk(N, -1)`` of the local output gives this rank's
                                     q, k, v. The parameter is a ``_StridedShard`` DTensor (``full_tensor()`` is the
                                     one-process tensor); checkpoints store it as the one-process tensor
``rowwise``                          Linear split on in_features; output all-reduced (SP: reduce-scattered)
``colwise_rep``, ``colwise_gather_output``  column-parallel, output all-gathered to the full tensor
``rowwise_rep``, ``rowwise_split_input``    row-parallel taking a replicated input
``vocab_parallel``                   Embedding: vocabulary rows sharded. Linear head: output (vocabulary) split,
                                     logits stay a ``Shard(-1)`` DTensor for the vocab-parallel cross-entropy
                                     inside :meth:`TensorParallelPlan.loss_context`, full tensor outside it
``embedding_rowwise``                Embedding with vocabulary rows sharded (Hugging Face's name)
``sequence_parallel``                with sequence parallelism: a replicated module (norm) on sequence shards,
                                     gradients summed over tp; an embedding's output cut to this rank's positions.
                                     Without it: replicated
``replicate``                        parameters replicated on every TP rank
``replicated_with_grad_allreduce``   replicated, gradients summed over tp: for parameters used inside a region,
                                     on this rank's heads only (e.g. a q/k norm)
``mla_kv_a_proj``, ``mla_kv_a_proj:R``  the shared down-projection of multi-head latent attention (DeepSeek-V2/V3's
                                     ``kv_a_proj_with_mqa``): replicated, its output ``[latent | rope key]``; the
                                     last ``R`` features (``config.qk_rope_head_dim``, read at resolve time) are the
                                     rope key every head shares, which goes straight into attention on this rank's
                                     heads, so its gradient is summed over tp in backward (the latent part reaches
                                     the heads through a column-parallel ``kv_b_proj``, whose shared input already
                                     reduces it)
``embedding_colwise``                Embedding with the hidden features (columns) sharded, each rank's lookups
                                     all-gathered to the whole vector
``unit_colwise``                     transformers' head-aligned column split (k/v with fewer heads than ranks):
                                     read as ``colwise``, which it is whenever tp divides the key/value heads (checked)
``local_params``                     an attention module holding bare per-head parameters (sinks, gate biases),
                                     each named by its own ``colwise`` entry: those are split over the heads
                                     (``Shard(0)``, this rank's heads, as its column-parallel q/k/v give it) and the
                                     module computes on their local values; otherwise as ``block_input``. Only a
                                     module holding column-parallel projections, only 1-D-or-more parameters whose
                                     first dimension counts its heads
``moe_tp_experts``                   a module of experts with 3-D weights [experts, out, in] (transformers' MoE
                                     models): each expert's intermediate features split over tp by the entries
                                     that name its parameters -- ``packed_colwise`` (fused gate|up, each part
                                     split), ``colwise`` or ``rowwise`` -- and the partial outputs summed
                                     (:mod:`~lightning_par.parallel.experts_tp`). Every parameter of the module
                                     must have one; a parameter entry is applied only inside such a module
==================================== ============================================================================

Styles transformers publishes that lightning-par does not apply are refused by name (:data:`REFUSED_STYLES`, with
the reason), before any collective; ``tests/unit/test_hf_plan_styles.py`` walks every plan of the installed
transformers, so a style a new release adds is named the day it is installed.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
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
from torch.overrides import TorchFunctionMode

from lightning_par._compat import StridedShard
from lightning_par.parallel import experts_ep, experts_tp
from lightning_par.parallel.plans import find_plan, is_hf_model, pattern_regex
from lightning_par.parallel.rng import TensorParallelRNG
from lightning_par.topology import LayoutError

#: Styles of a resolved plan (see the module docstring); a declared plan may name all but ``block_input``, which
#: only the engine adds.
PLAN_STYLES: tuple[str, ...] = (
    "colwise",
    "packed_colwise",
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
    "mla_kv_a_proj",
    "embedding_colwise",
    "local_params",
    experts_tp.EXPERTS_STYLE,
    "block_input",
)
#: Hugging Face styles read as one of ours: ``unit_colwise`` replicates heads over a unit mesh only when tp exceeds the
#: head count, which the config checks refuse (tp must divide the key/value heads); otherwise it is ``colwise``
STYLE_ALIASES: dict[str, str] = {"unit_colwise": "colwise"}
#: Hugging Face styles refused by name, with why (and the nearest layout that trains): a plan naming one stops at setup
REFUSED_STYLES: dict[str, str] = {
    "all_reduce": (
        "it sums a module's forward output over the tp ranks, for a module that computes on this rank's share "
        "without a split parameter saying so (transformers 5.17's Inkling); lightning-par splits a module by the "
        "styles of its parameters and cannot check that such a sum is the one-process function"),
    "moe_identity_expert": (
        "it divides the input of identity ('zero') experts by tp so that the experts' sum over tp counts it once "
        "(transformers 5.17's LongCat-Flash); lightning-par's experts split has no such experts yet"),
    "packed_rowwise": (
        "it splits a fused expert weight packed along its input features in strides; lightning-par's experts "
        "split ('moe_tp_experts') takes 'packed_colwise', 'colwise' or 'rowwise' parameters only"),
}
_COLUMN_STYLES = ("colwise", "packed_colwise", "colwise_rep", "colwise_gather_output")
#: the column-parallel styles whose output stays sharded (local) and whose input a block shares
_LOCAL_COLUMN_STYLES = ("colwise", "packed_colwise")
#: ``packed_colwise`` without a count: transformers' meaning, a fused gate|up projection
PACKED_DEFAULT_PARTS = 2
_ROW_STYLES = ("rowwise", "rowwise_rep", "rowwise_split_input")
#: Config fields that tp must divide, with their meaning: ours (GPTConfig, GPT2Config) and Hugging Face's.
_CONFIG_SIZES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("n_heads", "num_attention_heads", "n_head"), "attention head count"),
    (("n_kv_heads", "num_key_value_heads"), "key/value head count"),
    (("dim", "hidden_size", "n_embd"), "hidden size"),
    (("ffn_dim", "intermediate_size", "n_inner"), "FFN size"),
    (("vocab_size",), "vocabulary size"),
)

# How many loss_context() regions are open; the vocab-parallel head returns full logits when none is.
_LOSS_PARALLEL_DEPTH = 0


def style_name(style: str) -> str:
    """The style without its argument: ``"packed_colwise:3"`` -> ``"packed_colwise"``."""
    return style.partition(":")[0]


def takes_block_input(style: str) -> bool:
    """Whether a resolved entry is a block's shared input (``block_input``, or ``local_params``: the same, with the
    block's per-head parameters split)."""
    return style_name(style) in ("block_input", "local_params")


def packed_parts(style: str) -> int:
    """How many equal parts a ``packed_colwise[:N]`` output holds (``N``; 2 without it, as in transformers)."""
    _, _, count = style.partition(":")
    return int(count) if count else PACKED_DEFAULT_PARTS


def _valid_style(style: str) -> bool:
    name, colon, count = style.partition(":")
    if name not in PLAN_STYLES or name == "block_input":
        return False
    if name == "mla_kv_a_proj":
        return not colon or (count.isdigit() and int(count) >= 1)
    if name == "local_params":
        return not colon
    return not colon or (name == "packed_colwise" and count.isdigit() and int(count) >= 2)


# ---------------------------------------------------------------------------------------------------------------------
# Finding and resolving the plan (no process group needed)
# ---------------------------------------------------------------------------------------------------------------------
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


def resolve_tp_plan(module: nn.Module, tp: int, sequence_parallel: bool = False, *,
                    stage: bool = False, ep: int = 1) -> dict[str, str]:
    """Expand and validate ``module``'s declared plan for ``tp`` ranks; no process group or mesh is needed.

    Returns ``{module FQN (relative to module): style}`` in application order, including the entries the engine adds
    (``block_input``, ``replicate``, ``sequence_parallel`` on norms). Raises :class:`LayoutError` that names the
    module, the sizes and the fix for: no plan, an unknown style, a pattern that matches no module or parameter (but
    in a Hugging Face model's plan), experts ``moe_tp_experts`` cannot split exactly, a head count, hidden/FFN size,
    vocabulary or sharded Linear/Embedding dimension that ``tp`` does not divide, and sequence parallelism on a model
    it cannot be applied to.

    ``stage=True``: ``module`` is one pipeline stage (or one pipeline rank's stages) of the model, holding only some
    of its units, so a plan pattern that matches nothing here is skipped (the embedding lives on the first stage, the
    head on the last); every other check stays. Check the whole model once, before the split, with
    :func:`check_tp_plan` (the strict default), so that a misspelt pattern is still an error.
    ``ep > 1``: the experts modules the model's ep plan places (:mod:`~lightning_par.parallel.experts_ep`) are split
    over the experts by expert parallel instead; the tp plan's entries for them (and their parameters) are left out,
    so tensor parallel replicates them.
    A unit removed from a stage (``None``, or a parameter-free
    :class:`~lightning_par.parallel.pipeline.split.RemovedUnit` stand-in) is never matched.
    """
    found = find_plan(module, "tp")
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
    removed = _removed_units(model)
    candidates = [name for name in names if name not in removed]
    parameters = [name for name, _ in model.named_parameters()
                  if not any(name.startswith(f"{unit}.") for unit in removed)]
    resolved: dict[str, str] = {}
    planned_parameters: dict[str, str] = {}  # an expert parameter's split, applied by its module's style
    by_ep = set(experts_ep.resolve_ep_plan(model)) if ep > 1 else set()  # (relative to model, as candidates)
    for pattern, style in plan.items():
        style = _canonical_style(model_name, model, pattern, style, sequence_parallel)
        if not isinstance(style, str) or not _valid_style(style):
            allowed = ", ".join(s for s in PLAN_STYLES if s != "block_input")
            raise LayoutError(
                f"{model_name}.tp_plan[{pattern!r}] = {style!r} is not a style lightning-par applies; "
                f"use one of: {allowed} ('packed_colwise:N' for a fused projection of N equal parts, N >= 2)."
            )
        regex = pattern_regex(pattern)
        matched = [name for name in candidates if regex.fullmatch(name)]
        params = [name for name in parameters if regex.fullmatch(name)]
        if by_ep and (matched or params):  # the experts modules expert parallel splits, and their parameters
            matched = [name for name in matched if name not in by_ep]
            params = [name for name in params if name.rpartition(".")[0] not in by_ep]
            if not matched and not params:
                continue
        if not matched and params:
            planned_parameters.update(dict.fromkeys(params, style))
            continue
        if not matched and (stage or is_hf_model(model)):
            # held by another pipeline stage (the whole model was checked by check_tp_plan); or an entry of a
            # published plan for a variant this config does not build (a dense MLP in a model of experts only),
            # which transformers skips too: the module it would split does not exist, nothing stays unsplit
            continue
        if not matched:
            raise LayoutError(
                f"{model_name}.tp_plan names {pattern!r}, but {model_name} has no module of that name (\"*\" "
                f"matches one name component). Its modules include: {', '.join(names[:12])}"
                f"{', ...' if len(names) > 12 else ''}. Fix the pattern or remove it from the plan."
            )
        for name in matched:
            resolved[name] = style
    _fold_local_parameters(model_name, model, resolved, planned_parameters, tp)
    _fold_expert_parameters(model_name, model, resolved, planned_parameters, tp)

    for name, style in resolved.items():
        _check_module(model_name, name, model.get_submodule(name), style, tp)

    if sequence_parallel and is_hf_model(model):
        raise LayoutError(
            f"sequence_parallel=True with the Hugging Face model {model_name}: its forward derives positions and "
            "the attention mask from the local sequence length, which sequence shards would change. Use "
            "sequence_parallel=False (tensor parallelism alone), or a model written for it such as the example GPT."
        )

    # Engine additions: one input collective per block, and every remaining parameter owner as a DTensor.
    column = [n for n, s in resolved.items() if style_name(s) in _LOCAL_COLUMN_STYLES]
    _check_head_counts(model_name, model, column, tp)
    parents = sorted({n.rpartition(".")[0] for n in column if "." in n}, key=names.index)
    if not sequence_parallel:
        _check_grad_allreduce_in_regions(model_name, model, resolved, set(parents), tp)
    _check_region_exits(model_name, model, resolved, parents)
    for name, style in resolved.items():
        if style_name(style) == "local_params" and name not in parents:
            raise LayoutError(
                f"{model_name}.{name} ({type(model.get_submodule(name)).__name__}) is planned 'local_params', which "
                "splits its own per-head parameters over the heads its column-parallel projections give each rank, "
                "but no projection inside it is planned 'colwise': every rank computes every head there, and the "
                "split parameters would not match. Plan its q/k/v projections 'colwise' (and the output "
                "'rowwise'), or leave the module out of the plan (its parameters are then replicated)."
            )
    additions: dict[str, str] = {}
    for parent in parents:
        if parent not in resolved:
            additions[parent] = "block_input"
    covered = set(resolved)
    for name, sub in model.named_modules():
        if not name or name in covered or name in additions or any(name.startswith(c + ".") for c in covered):
            continue  # (a block_input parent replicates its own parameters, if it has any)
        if any(True for _ in sub.parameters(recurse=False)):
            additions[name] = "sequence_parallel" if sequence_parallel else "replicate"
    if sequence_parallel:  # every activation is this rank's own: a replicated parameter's gradient is partial
        for name, style in list(resolved.items()):
            if style == "replicate":
                resolved[name] = "sequence_parallel"
    # block inputs before their children so both the hooks and the listing read top-down
    ordered = {**additions, **resolved}
    _check_tied(model_name, model, ordered)
    return {f"{prefix}{name}": ordered[name] for name in sorted(ordered, key=names.index)}


def _canonical_style(model_name: str, model: nn.Module, pattern: str, style: Any, sequence_parallel: bool) -> Any:
    """A declared style as the engine applies it: an alias read as its style, ``mla_kv_a_proj`` given its rope width
    from the config; a refused style raises, naming the entry, the reason and the layouts that train it."""
    if not isinstance(style, str):
        return style
    if style in REFUSED_STYLES:
        raise LayoutError(
            f"{model_name}.tp_plan[{pattern!r}] = {style!r} is not applied by lightning-par: {REFUSED_STYLES[style]}. "
            f"Train {model_name} with tp=1 (ZeRO, pipeline or expert parallel), or plan the module "
            "'replicate' in the model's tp_plan."
        )
    style = STYLE_ALIASES.get(style, style)
    if style_name(style) == "mla_kv_a_proj" and sequence_parallel:
        raise LayoutError(
            f"{model_name}.tp_plan[{pattern!r}] = {style!r} with sequence_parallel=True: the shared rope key would "
            "be computed on sequence shards while attention needs all positions. Use sequence_parallel=False."
        )
    if style == "mla_kv_a_proj":
        rope = getattr(getattr(model, "config", None), "qk_rope_head_dim", None)
        if not isinstance(rope, int) or rope < 1:
            raise LayoutError(
                f"{model_name}.tp_plan[{pattern!r}] = 'mla_kv_a_proj' needs the width of the shared rope key: the "
                "model has no config.qk_rope_head_dim. Name it in the plan as 'mla_kv_a_proj:R' (R features at the "
                "end of the projection's output)."
            )
        style = f"mla_kv_a_proj:{rope}"
    return style


def _check_grad_allreduce_in_regions(model_name: str, model: nn.Module, resolved: dict[str, str],
                                     regions: set[str], tp: int) -> None:
    """``replicated_with_grad_allreduce`` sums a replicated module's gradients over tp: right inside a region, where
    the module sees this rank's heads or features only (a q/k norm after column-parallel projections); outside every
    region (a router, a block's norm) its input and gradient are already whole on every rank, and the sum would
    multiply the gradient by tp. Refused there, before any collective."""
    for name, style in resolved.items():
        if style == "replicated_with_grad_allreduce" and not regions.intersection(_ancestors(name)):
            raise LayoutError(
                f"{model_name}.{name} ({type(model.get_submodule(name)).__name__}) is planned "
                "'replicated_with_grad_allreduce', which sums its gradients over the tp ranks: right for a module "
                "that sees only this rank's heads or features (a q/k norm inside attention), but no module holding "
                f"{name} has a column-parallel projection, so its input is the same on every rank and its gradient "
                f"already whole -- the sum would multiply it by {tp}. Plan it 'replicate' (or leave it out of the "
                "plan: the engine replicates it)."
            )


def _check_region_exits(model_name: str, model: nn.Module, resolved: dict[str, str], regions: list[str]) -> None:
    """A region (a module holding column-parallel projections) leaves through its ``rowwise`` projections, each
    summing the ranks' partial outputs into the whole. Two of them of different widths: the narrower one's whole
    output is used inside the region next to this rank's heads (Doge's ``dt_proj``, a gate for every key/value
    head), which fails in the first forward or, where the shapes broadcast, computes another function. Refused
    before any collective."""
    for region in regions:
        widths = {n: getattr(model.get_submodule(n), "out_features", None) for n, s in resolved.items()
                  if s == "rowwise" and n.rpartition(".")[0] == region}
        widths = {n: w for n, w in widths.items() if isinstance(w, int)}
        if len(set(widths.values())) > 1:
            inner, exit_ = min(widths, key=widths.__getitem__), max(widths, key=widths.__getitem__)
            raise LayoutError(
                f"{model_name}.{inner} ({widths[inner]} outputs) is planned 'rowwise' inside "
                f"{type(model.get_submodule(region)).__name__} ({region}) next to its output projection {exit_}: "
                "a row-parallel projection sums the tp ranks' partial outputs into the whole, but this one's output "
                "is used inside the module, where each rank holds its own heads only, so it does not match them. "
                f"Train {model_name} with tp=1 (ZeRO or pipeline parallel)."
            )


def _fold_local_parameters(model_name: str, model: nn.Module, resolved: dict[str, str],
                           planned_parameters: dict[str, str], tp: int) -> None:
    """Fold the plan's entries naming bare parameters of a ``local_params`` module (attention sinks, per-head gate
    biases) into its style, ``local_params:<names>``, in place; refuse, before any collective, an entry that is not
    ``colwise`` or a parameter whose first dimension is not one of the module's head counts divisible by tp (its
    split must give each rank the heads its q/k/v projections give it: whole heads, in order)."""
    for fqn, style in list(planned_parameters.items()):
        owner, _, param = fqn.rpartition(".")
        if style_name(resolved.get(owner, "")) != "local_params":
            continue
        module = model.get_submodule(owner)
        tensor = getattr(module, param)
        heads = {value for _, value in _head_counts(module)}
        config = getattr(model, "config", None)
        heads |= {v for k in ("num_attention_heads", "num_key_value_heads")
                  if isinstance(v := getattr(config, k, None), int)}
        where = f"{model_name}.{fqn} (in {type(module).__name__})"
        if style != "colwise":
            raise LayoutError(
                f"{where} is planned {style!r} inside a module planned 'local_params': lightning-par splits such a "
                "bare parameter over the heads only ('colwise', its first dimension). Plan it 'colwise' or remove the "
                "entry (the parameter is then replicated)."
            )
        if tensor.dim() < 1 or tensor.shape[0] not in heads or tensor.shape[0] % tp:
            raise LayoutError(
                f"{where} has shape {tuple(tensor.shape)}: 'local_params' splits a bare parameter over the heads, so "
                f"its first dimension must count heads ({', '.join(map(str, sorted(heads))) or 'no head count found'}"
                f") and tp={tp} must divide it. Train {model_name} with a tp that divides the head count, or tp=1."
            )
        del planned_parameters[fqn]
        _, _, names = resolved[owner].partition(":")
        resolved[owner] = f"local_params:{','.join(filter(None, (names, param)))}"


def _fold_expert_parameters(model_name: str, model: nn.Module, resolved: dict[str, str],
                            planned_parameters: dict[str, str], tp: int) -> None:
    """Fold the plan's entries that name parameters (Hugging Face's 3-D expert weights) into their module's
    ``moe_tp_experts`` style, in place; refuse, before any collective, a parameter entry whose module is not planned
    ``moe_tp_experts`` and an experts module that style cannot split exactly (:func:`experts_tp.check_experts`)."""
    owners: dict[str, dict[str, str]] = {}
    for fqn, style in planned_parameters.items():
        owner, _, param = fqn.rpartition(".")
        if style_name(resolved.get(owner, "")) != experts_tp.EXPERTS_STYLE:
            raise LayoutError(
                f"{model_name}.tp_plan splits the parameter {fqn} ({style!r}), but its module {owner} is planned "
                f"{resolved.get(owner, 'nothing')!r}: lightning-par splits a bare parameter only inside a module "
                f"planned '{experts_tp.EXPERTS_STYLE}' (an experts module, which sums the ranks' partial outputs). "
                f"Plan {owner} '{experts_tp.EXPERTS_STYLE}', or remove the entry (the parameter stays whole)."
            )
        owners.setdefault(owner, {})[param] = style
    for name, style in resolved.items():
        if style == experts_tp.EXPERTS_STYLE:
            module = model.get_submodule(name)
            splits = {p: owners.get(name, {})[p] for p, _ in module.named_parameters() if p in owners.get(name, {})}
            experts_tp.check_experts(f"{model_name}.{name}", module, splits, tp)
            resolved[name] = experts_tp.encode(splits)


def check_packed_layout(plan: dict[str, str], zero_stage: int) -> None:
    """``packed_colwise`` with ZeRO: refused (before any collective) until the ZeRO shards and their checkpoints
    handle a tensor-parallel shard that is not one slice of the parameter (this rank's slice of each part)."""
    packed = [name for name, style in plan.items() if style_name(style) == "packed_colwise"
              or (style_name(style) == experts_tp.EXPERTS_STYLE
                  and any(style_name(s) == "packed_colwise" for s in experts_tp.decode(style).values()))]
    if packed and zero_stage > 0:
        experts = style_name(plan[packed[0]]) == experts_tp.EXPERTS_STYLE
        raise LayoutError(
            f"{packed[0]} is planned {plan[packed[0]]!r}, which zero_stage={zero_stage} cannot shard yet: its "
            "tensor-parallel shard (this rank's slice of each part) is not one slice of the parameter, and the ZeRO "
            "shards and their checkpoints need one. Use zero_stage=0 (data-parallel replicas), or "
            + ("ZeRO without tp (tp=1: every rank holds every expert, ZeRO shards them)." if experts else
               "separate q/k/v (gate/up) projections planned 'colwise'.")
        )


def _head_counts(module: nn.Module) -> list[tuple[str, int]]:
    """A module's own integer attributes that count heads, whatever they are called (``n_heads``, ``num_heads``,
    ``n_kv_heads``, ``heads``...): a name with "head" in it, but not a size (``head_dim``, ``head_size``)."""
    return [(attr, value) for attr, value in vars(module).items()
            if "head" in attr.lower() and not any(w in attr.lower() for w in ("dim", "size", "scale"))
            and isinstance(value, int) and not isinstance(value, bool) and value > 0]


def _check_head_counts(model_name: str, model: nn.Module, column: list[str], tp: int) -> None:
    """Each rank holds whole heads: tp must divide the head counts of every module holding a split projection."""
    holders = sorted({p for n in column for p in _ancestors(n)}, key=len)
    for name in holders:
        sub = model.get_submodule(name)
        for attr, value in _head_counts(sub):
            if value % tp:
                where = f"{model_name}.{name}" if name else model_name
                raise LayoutError(
                    f"{where} ({type(sub).__name__}): {attr} is {value}, which tp={tp} does not divide: each "
                    f"tensor-parallel rank holds whole heads. Use a tp that divides {value} (choices: "
                    f"{_tp_choices([value])}), or change {attr}."
                )


def _ancestors(name: str) -> list[str]:
    """``"a.b.c"`` -> ``["", "a", "a.b"]``: the modules holding module ``name``."""
    parts = name.split(".")
    return ["", *(".".join(parts[:i]) for i in range(1, len(parts)))]


def check_tp_plan(module: nn.Module, tp: int, sequence_parallel: bool = False, ep: int = 1) -> dict[str, str]:
    """Check the WHOLE model's plan for ``tp`` ranks once, before it is split into pipeline stages.

    This is :func:`resolve_tp_plan` with its strict default (every pattern must match a module of the model; the
    divisibility, style and tied-weight checks), returning the whole model's resolved plan. Each stage is then
    split with ``apply_tensor_parallel(stage_module, tp_mesh, sequence_parallel, stage=True)``, which skips the
    patterns that name another stage's units. No process group is needed.
    """
    return resolve_tp_plan(module, tp, sequence_parallel, stage=False, ep=ep)


def check_layout_plan(module: nn.Module, tp: int, sequence_parallel: bool, zero_stage: int, ep: int = 1) -> None:
    """The strategy's check at setup, before any split or collective, alike on every rank: the whole model's plan
    for ``tp`` ranks (:func:`check_tp_plan`: a pattern that matches nothing anywhere stays an error, a size ``tp``
    does not divide is refused) and its packed styles against the ZeRO stage; nothing to check for tp = 1."""
    if tp > 1:
        check_packed_layout(check_tp_plan(module, tp, sequence_parallel, ep), zero_stage)


def _removed_units(model: nn.Module) -> set[str]:
    """Names of pipeline units that a stage replaced by a parameter-free stand-in (they hold nothing to split)."""
    from lightning_par.parallel.pipeline.split import RemovedUnit  # (lazy: the pipeline package is heavier)

    return {name for name, sub in model.named_modules() if name and isinstance(sub, RemovedUnit)}


def _planned_split(style: str, module: nn.Module, param: str) -> str:
    """How ``style`` will place ``module``'s parameter ``param``: "Shard(d)" or "Replicate()"."""
    if style_name(style) == experts_tp.EXPERTS_STYLE:  # [experts, out, in]: split over out, or in for rowwise
        inside = experts_tp.decode(style)[param]
        if style_name(inside) == "packed_colwise":
            return f"_StridedShard(1, {packed_parts(inside)})"
        return "Shard(2)" if inside == "rowwise" else "Shard(1)"
    if style_name(style) == "packed_colwise":
        return f"_StridedShard(0, {packed_parts(style)})"  # each part split over the output features
    if style in _COLUMN_STYLES or (style == "vocab_parallel" and isinstance(module, nn.Linear)):
        return "Shard(0)"  # weight [out, in] and bias [out] split over the output features
    if style in _ROW_STYLES:
        return "Shard(1)" if param == "weight" else "Replicate()"
    if style in ("vocab_parallel", "embedding_rowwise"):
        return "Shard(0)"  # embedding rows
    if style == "embedding_colwise":
        return "Shard(1)"  # embedding columns (the hidden features)
    return "Replicate()"


def planned_split_dim(style: str | None, module: nn.Module, param: str) -> int | None:
    """The dimension along which ``style`` splits ``module``'s parameter ``param`` over tp (a packed projection's too:
    each rank holds 1/tp of it along that dimension), or ``None`` when it is replicated."""
    split = "Replicate()" if style is None else _planned_split(style, module, param)
    match = re.search(r"Shard\((\d+)", split)
    return int(match[1]) if match else None


def _check_tied(model_name: str, model: nn.Module, plan: dict[str, str]) -> None:
    """Tied parameters must be split the same way by their owners' styles (checked before any collective)."""
    for names in _tied_parameters(model):
        splits = {}
        for fqn in names:
            owner, _, param = fqn.rpartition(".")
            if owner in plan:
                splits[fqn] = _planned_split(plan[owner], model.get_submodule(owner), param)
        if len(set(splits.values())) > 1:
            (first, a), *rest = splits.items()
            other, b = next((n, split) for n, split in rest if split != a)
            raise LayoutError(
                f"{model_name}: {first} and {other} are one tied parameter, but the plan splits them differently "
                f"({a} as {plan[first.rpartition('.')[0]]!r} vs {b} as {plan[other.rpartition('.')[0]]!r}). Give "
                "both the same split, e.g. 'vocab_parallel' for the embedding and the head, or untie them."
            )


def _not_splittable(where: str, style: str, module: nn.Module, what: str) -> LayoutError:
    has_params = any(True for _ in module.parameters(recurse=False))
    return LayoutError(
        f"{where} is planned {style!r}, which splits {what}; {type(module).__name__} cannot be split that way"
        + (" (it holds no parameters of its own: name the linear layers inside it instead)." if not has_params else
           " (a convolution, or a Conv1D that stores its weight transposed, has another weight layout).")
        + " Change its plan entry: e.g. 'replicate', or rewrite the layer as an nn.Linear."
    )


def _check_module(model_name: str, name: str, module: nn.Module, style: str, tp: int) -> None:
    where = f"{model_name}.{name} ({type(module).__name__})"
    if style_name(style) == "packed_colwise":
        parts = packed_parts(style)
        if not isinstance(module, nn.Linear):
            raise _not_splittable(where, style, module, "an nn.Linear over its output features")
        if module.out_features % (parts * tp):
            raise LayoutError(
                f"{where}: out_features is {module.out_features}, which {parts} equal parts of tp={tp} slices each "
                f"do not divide: {style!r} splits each of its {parts} parts over the tp ranks. Use a tp that "
                f"divides {module.out_features // parts if module.out_features % parts == 0 else 'each part'}, or "
                "fix the number of parts in the plan."
            )
        return
    if style in _COLUMN_STYLES or (style == "vocab_parallel" and isinstance(module, nn.Linear)):
        if not isinstance(module, nn.Linear):
            raise _not_splittable(where, style, module, "an nn.Linear over its output features")
        _check_divisible(f"{where}: out_features", module.out_features, tp,
                         f"{style!r} splits the output features over tp ranks. Use a tp that divides "
                         f"{module.out_features} or resize the layer.")
    elif style in _ROW_STYLES:
        if not isinstance(module, nn.Linear):
            raise _not_splittable(where, style, module, "an nn.Linear over its input features")
        _check_divisible(f"{where}: in_features", module.in_features, tp,
                         f"{style!r} splits the input features over tp ranks. Use a tp that divides "
                         f"{module.in_features} or resize the layer.")
    elif style_name(style) == "mla_kv_a_proj":
        rope = int(style.partition(":")[2])
        if not isinstance(module, nn.Linear) or module.out_features <= rope:
            raise LayoutError(
                f"{where} is planned {style!r}: an nn.Linear whose output ends with the {rope} rope-key features of "
                "multi-head latent attention is expected (out_features = latent + rope). Fix the plan entry or "
                "config.qk_rope_head_dim."
            )
    elif style == "embedding_colwise":
        if not isinstance(module, nn.Embedding):
            raise _not_splittable(where, style, module, "an nn.Embedding over its hidden features")
        _check_divisible(f"{where}: embedding_dim", module.embedding_dim, tp,
                         f"{style!r} splits the hidden features over tp ranks. Use a tp that divides "
                         f"{module.embedding_dim}.")
    elif style in ("vocab_parallel", "embedding_rowwise"):
        if not isinstance(module, nn.Embedding):
            raise _not_splittable(where, style, module, "an nn.Embedding or a head nn.Linear over the vocabulary")
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


class ReplicateParameters(ParallelStyle):
    """Parameters replicated on every TP rank, as DTensors (so gradient-norm clipping sees one kind of tensor); the
    ones named in ``sharded`` split over the ranks on their first dimension instead (a ``local_params`` module's
    per-head parameters: this rank's heads).

    The module still computes on plain tensors: for the duration of its forward each parameter is swapped for its
    local value (``to_local()``, through which autograd returns the gradient to the DTensor parameter). Computing
    on replicated DTensors instead would give the same numbers with a DTensor dispatch per elementwise op, which
    for a norm costs more than the norm itself.
    """

    sharded: tuple[str, ...] = ()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if name in self.sharded else Replicate()
            distributed = distribute_tensor(param.detach(), device_mesh, [placement])
            module.register_parameter(name, nn.Parameter(distributed, requires_grad=param.requires_grad))
        _local_while(module, module)
        return module


def _used_uncalled(parent: nn.Module, attr: str) -> bool:
    """Whether ``parent``'s forward uses its child ``attr`` other than by calling it (``self.conv1d.weight``, or
    ``self.conv1d`` handed to a kernel), read from the source; True where the source cannot be read. Only then do
    its parameters need to be local while the parent runs: hooks on a block that is compiled would break its graph."""
    try:
        source = inspect.getsource(type(parent).forward)
    except (OSError, TypeError):
        return True
    return re.search(rf"self\.{re.escape(attr)}\b(?!\s*\()", source) is not None


def _local_while(runner: nn.Module, owner: nn.Module) -> None:
    """Swap ``owner``'s replicated DTensor parameters for their local values while ``runner`` runs (forward hooks).

    ``runner`` is the owner itself (:class:`ReplicateParameters`), or also its parent, which may read them itself
    (Qwen3-Next's gated delta net passes ``self.conv1d.weight`` to a convolution kernel without calling ``conv1d``)
    and would otherwise mix a DTensor with plain tensors: for plain replicated modules only, since one local value
    then serves every call of the owner in that forward, right without a gradient hook of its own."""
    swapped: list[dict[str, Any]] = []

    def to_local(_mod: nn.Module, _args: Any) -> None:
        originals = {n: p for n, p in owner._parameters.items() if isinstance(p, DTensor)}
        swapped.append(originals)
        for n, p in originals.items():
            owner._parameters[n] = p.to_local()  # type: ignore[assignment]

    def restore(_mod: nn.Module, _args: Any, _output: Any) -> None:
        owner._parameters.update(swapped.pop())

    runner.register_forward_pre_hook(to_local)
    # (not `always_call=True`, which would restore after a forward that raised too: torch.compile recompiles a block
    # holding such a hook; the strategy's teardown logs, not raises, what a failed run leaves it unable to move)
    runner.register_forward_hook(restore)


def _summed_over(group: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """A gradient hook summing the gradient over ``group`` on its way back (Megatron's "f" on a plain tensor)."""

    def sum_over_ranks(grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        torch.distributed.all_reduce(total, group=group)
        return total

    return sum_over_ranks


class ReplicateWithGradAllReduce(ReplicateParameters):
    """Replicated parameters whose gradients are summed over the tp group on their way back to the parameter.

    For modules that see only this rank's part of the activations: a norm on a sequence shard (sequence
    parallelism), or a q/k norm inside the attention region (this rank's heads; Hugging Face's
    ``replicated_with_grad_allreduce``). Each rank's gradient covers its part only; the sum is the whole.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        sum_over_ranks = _summed_over(device_mesh.get_group())

        def reduce_weight_grads(mod: nn.Module, _args: Any) -> None:
            if torch.is_grad_enabled():
                for local in mod._parameters.values():
                    if local is not None and local.requires_grad and not isinstance(local, DTensor):
                        local.register_hook(sum_over_ranks)

        # runs after ReplicateParameters' swap (hooks run in registration order)
        module.register_forward_pre_hook(reduce_weight_grads)
        return module


class LatentKeyProjection(ReplicateParameters):
    """``mla_kv_a_proj:R``: multi-head latent attention's shared projection ``[latent | rope key]``, replicated.

    The latent part reaches the heads through the column-parallel ``kv_b_proj`` (whose shared block input sums its
    gradient over tp); the last ``R`` features, the rope key, go straight to attention on this rank's heads, so each
    rank's gradient of them covers its heads only: they are summed over tp on their way back. Without the sum the
    projection's weight and the residual stream would get 1/tp of the rope key's gradient per head group."""

    def __init__(self, rope: int) -> None:
        super().__init__()
        self.rope = rope

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        sum_over_ranks, rope = _summed_over(device_mesh.get_group()), self.rope

        def rope_gradient_summed(_mod: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            if not (torch.is_grad_enabled() and output.requires_grad):
                return output
            latent, key = output.split([output.size(-1) - rope, rope], dim=-1)
            key.register_hook(sum_over_ranks)
            return torch.cat([latent, key], dim=-1)

        module.register_forward_hook(rope_gradient_summed)
        return module


class SequenceShardedNorm(ReplicateWithGradAllReduce):
    """A norm on this rank's sequence shard (sequence parallelism), with replicated DTensor parameters.

    Like torch's ``SequenceParallel`` it takes and returns sequence shards; unlike it, the norm runs on plain local
    tensors (no DTensor dispatch per elementwise op). Each rank's weight gradient covers only its tokens, so it is
    all-reduced over the tp group on its way back to the parameter -- the one collective this needs.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)

        def unwrap(_mod: nn.Module, args: tuple) -> tuple:
            return tuple(a.to_local() if isinstance(a, DTensor) else a for a in args)

        module.register_forward_pre_hook(unwrap)
        return module


@dataclass
class _SequenceLength:
    """The sequence length of the current forward of the declared model (sequence parallelism, padded)."""

    length: int | None = None


class SequenceShardedEmbedding(ReplicateWithGradAllReduce):
    """A replicated embedding indexed by position (GPT-2's ``wpe``) under sequence parallelism.

    The model looks up all ``T`` positions, but the residual stream it is added to holds this rank's ``T / tp``:
    the output is cut to this rank's positions (the sequence is dimension -2 of the output: ``[T, h]`` or
    ``[B, T, h]``). Each rank's weight gradient then covers its positions only and is summed over tp.
    """

    def __init__(self, sequence: _SequenceLength) -> None:
        super().__init__()
        self.sequence = sequence

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        tp, rank, sequence = device_mesh.size(), device_mesh.get_local_rank(), self.sequence

        def this_ranks_positions(mod: nn.Module, _args: Any, output: torch.Tensor) -> torch.Tensor:
            full = sequence.length
            if output.dim() < 2 or output.size(-2) != full:
                raise LayoutError(
                    f"sequence_parallel=True: the replicated embedding {type(mod).__name__} returned shape "
                    f"{tuple(output.shape)}, but it is taken for a position embedding whose output (dimension -2: "
                    f"the sequence, {full} tokens) is cut to this rank's share. Split it in the plan "
                    "('vocab_parallel'), or use sequence_parallel=False."
                )
            return output.chunk(tp, dim=-2)[rank]

        module.register_forward_hook(this_ranks_positions)
        return module


class BlockInput(ReplicateParameters):
    """One replicated DTensor input for a block's column-parallel children, so they share its collectives.

    Forward: the input becomes a replicated DTensor -- nothing to do without sequence parallelism, an all-gather
    of the sequence shards with it. Backward: the column-parallel linears' partial input gradients add up locally
    and are reduced once (all-reduce; reduce-scatter with sequence parallelism), as Megatron-LM does, instead of
    once per linear. Where that happens depends on the block:

    * a **region** (``whole_block``: every parameter inside is split by the plan -- attention, a gate/up/down MLP):
      the block's own input is converted, so its forward sees the whole sequence under sequence parallelism
      (``B, T, _ = x.shape`` stays right);
    * any other block (a GPT-2 block holding ``ln_2``, ``c_fc`` and ``c_proj`` next to each other): the inputs of
      its column-parallel ``children`` are converted, once per distinct tensor (q/k/v of one ``x`` share it), and
      the block's own forward keeps plain tensors, so its norms and residual adds run as written.

    A block that holds parameters of its own gets them replicated, but for those named in ``sharded`` (a
    ``local_params`` attention's sinks), which are split over the heads; inside the block's forward all of them are
    local tensors.
    """

    def __init__(self, sequence_parallel: bool = False, children: tuple[str, ...] = (),
                 whole_block: bool = True, sharded: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.input_layout: Placement = Shard(1) if sequence_parallel else Replicate()
        self.children = children
        self.whole_block = whole_block
        self.sharded = sharded

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if any(True for _ in module.parameters(recurse=False)):
            module = super()._apply(module, device_mesh)
        layout = self.input_layout

        def replicated(tensor: torch.Tensor) -> DTensor:
            if not isinstance(tensor, DTensor):
                tensor = DTensor.from_local(tensor, device_mesh, (layout,), run_check=False)
            if tuple(tensor.placements) == (Replicate(),):
                # already replicated (no sequence parallelism): a redistribute would be one more DTensor op and
                # autograd node per block and pass for nothing -- from_local's backward all-reduces the partial
                # input gradient all the same
                return tensor
            return tensor.redistribute(device_mesh, (Replicate(),))

        if self.whole_block:
            def block_input(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
                found = _first_tensor(args, kwargs)
                if found is None:
                    return args, kwargs
                key, tensor = found
                if isinstance(key, int):
                    return (replicated(tensor), *args[1:]), kwargs
                return args, {**kwargs, key: replicated(tensor)}

            module.register_forward_pre_hook(block_input, with_kwargs=True)
            return module

        shared: list[tuple[torch.Tensor, DTensor]] = []  # (plain input, its DTensor), during one block forward

        def clear(*_: Any) -> None:
            shared.clear()

        def child_input(_child: nn.Module, args: tuple) -> tuple | None:
            if not args or not isinstance(args[0], torch.Tensor) or isinstance(args[0], DTensor):
                return None
            x = args[0]
            if torch.compiler.is_compiling():
                # In a compiled block nothing may outlive the graph: the block's own hooks (`clear`) run outside
                # it, so a DTensor kept in `shared` would become a graph output that gets no gradient, which
                # AOTAutograd refuses in backward ("Expected a DTensor tangent but got a plain Tensor"). Each
                # child converts its own input instead: the same gradients, one backward all-reduce per child.
                return (replicated(x), *args[1:])
            dx = next((d for local, d in shared if local is x), None)
            if dx is None:
                dx = replicated(x)
                shared.append((x, dx))
            return (dx, *args[1:])

        module.register_forward_pre_hook(clear)
        module.register_forward_hook(clear, always_call=True)
        for name in self.children:
            # prepend: before the child's own ColwiseParallel input hook, whichever was registered first
            module.get_submodule(name).register_forward_pre_hook(child_input, prepend=True)
        return module


class ColumnParallel(ColwiseParallel):
    """torch's ``ColwiseParallel`` that reads a plain input as ``input_layouts`` (a sequence shard with sequence
    parallelism) but takes a DTensor input -- the block input it shares with its siblings -- as it is.

    torch's version redistributes whenever the *declared* input layout differs from the one it needs, even for a
    DTensor already in that layout: a no-op forward whose backward all-reduces each linear's input gradient on its
    own, instead of the one reduce-scatter the shared block input does for all of them.
    """

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):  # same signature as torch
        tensor = inputs[0]
        if not isinstance(tensor, DTensor):
            tensor = DTensor.from_local(tensor, device_mesh, input_layouts, run_check=False)
        if tuple(tensor.placements) != tuple(desired_input_layouts):
            tensor = tensor.redistribute(placements=desired_input_layouts, async_op=True)
        return tensor


class PackedColumnParallel(ColumnParallel):
    """``packed_colwise``: a fused projection whose output is ``parts`` equal parts concatenated (q|k|v, gate|up).

    Each part is split over the tp ranks on its own, so rank r holds rows ``[part_0 slice r, part_1 slice r, ...]``
    of the weight (and bias) and its local output chunks into its own q, k and v. A plain ``colwise`` split would
    give rank 0 all of q and half of k instead. The parameters are DTensors with ``_StridedShard(0, parts)`` -- the
    placement DTensor has for this layout (transformers uses it too) -- so ``full_tensor()``, the gradient norm and
    resharding see the one-process tensor. The output is returned as the local tensor as it is: redistributing it
    to torch's ``Shard(-1)`` (what ``ColwiseParallel`` would do) would reorder the features.
    """

    def __init__(self, parts: int, input_layouts: Placement | None = None) -> None:
        super().__init__(input_layouts=input_layouts or Replicate())
        self.parts = parts

    def _partition_linear_fn(self, name, module, device_mesh):  # same signature as torch
        for param_name, param in module.named_parameters():
            placement = StridedShard(0, split_factor=self.parts)
            dist_param = nn.Parameter(distribute_tensor(param, device_mesh, [placement],
                                                        src_data_rank=self.src_data_rank),
                                      requires_grad=param.requires_grad)
            module.register_parameter(param_name, dist_param)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):  # same signature
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs


class VocabParallelHead(ColumnParallel):
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


def parallel_style(style: str, module: nn.Module, sequence_parallel: bool, children: tuple[str, ...] = (),
                   whole_block: bool = True, sequence: _SequenceLength | None = None) -> ParallelStyle:
    """The torch ``ParallelStyle`` for one resolved plan entry.

    ``children``, ``whole_block``: for ``block_input``, see :class:`BlockInput`. ``sequence``: with sequence
    parallelism, where the current sequence length is kept (for position embeddings).
    """
    seq = Shard(1) if sequence_parallel else Replicate()
    if style_name(style) == experts_tp.EXPERTS_STYLE:
        return experts_tp.ExpertsTensorParallel(experts_tp.decode(style))
    if style_name(style) == "packed_colwise":
        return PackedColumnParallel(packed_parts(style), input_layouts=seq)
    if style == "colwise":
        # a plain input is a sequence shard with sequence parallelism (a shared block input is a DTensor already)
        return ColumnParallel(input_layouts=seq)
    if style == "rowwise":
        return RowwiseParallel(output_layouts=seq)
    if style in ("colwise_rep", "colwise_gather_output"):
        return ColumnParallel(input_layouts=seq, output_layouts=Replicate())
    if style in ("rowwise_rep", "rowwise_split_input"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if style in ("vocab_parallel", "embedding_rowwise"):
        if isinstance(module, nn.Embedding):
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
        return VocabParallelHead(sequence_parallel)
    if style == "sequence_parallel" and sequence_parallel:
        if isinstance(module, nn.Embedding):
            return SequenceShardedEmbedding(sequence or _SequenceLength())
        return SequenceShardedNorm()
    if style == "replicated_with_grad_allreduce":
        return ReplicateWithGradAllReduce()
    if style_name(style) == "mla_kv_a_proj":
        return LatentKeyProjection(int(style.partition(":")[2]))
    if style == "embedding_colwise":  # torch's column split of an Embedding: its hidden features
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if style in ("replicate", "sequence_parallel"):
        return ReplicateParameters()
    if takes_block_input(style):
        sharded = tuple(filter(None, style.partition(":")[2].split(",")))
        return BlockInput(sequence_parallel, children, whole_block, sharded)
    raise LayoutError(f"unknown tensor-parallel style {style!r}; use one of {', '.join(PLAN_STYLES)}.")


# ---------------------------------------------------------------------------------------------------------------------
# Applying the plan
# ---------------------------------------------------------------------------------------------------------------------
@dataclass
class TensorParallelPlan:
    """What :func:`apply_tensor_parallel` did: the resolved plan, the torch styles, how to compute the loss, and the
    dropout RNG tracker (``rng``; its ``region()`` runs hand-written code on this rank's own random stream)."""

    plan: dict[str, str]
    styles: dict[str, ParallelStyle]
    tp_mesh: DeviceMesh
    sequence_parallel: bool
    vocab_parallel_head: bool
    tied: list[list[str]] = field(default_factory=list)
    rng: TensorParallelRNG | None = None

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
            # (the mode only under inference mode: a function mode on the stack is part of torch.compile's guards)
            with loss_parallel(), _CrossEntropyOutsideInferenceMode() if torch.is_inference_mode_enabled() \
                    else nullcontext():
                yield
        finally:
            _LOSS_PARALLEL_DEPTH -= 1


class _CrossEntropyOutsideInferenceMode(TorchFunctionMode):
    """Under inference mode (Lightning evaluates in it except over gloo; a user's ``torch.inference_mode()``)
    ``F.cross_entropy`` reaches DTensor undecomposed, where ``loss_parallel`` has no rule for it ("got mixed
    torch.Tensor and DTensor"): the call alone runs outside it, under ``no_grad``, on normal copies of inference
    tensors (which lack the autograd keys that decompose it) -- the same values."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is F.cross_entropy and torch.is_inference_mode_enabled():
            with torch.inference_mode(False), torch.no_grad():
                args = [a.clone() if isinstance(a, torch.Tensor) and a.is_inference() else a for a in args]
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _tied_parameters(module: nn.Module) -> list[list[str]]:
    owners: dict[int, list[str]] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for p_name, param in sub.named_parameters(recurse=False, remove_duplicate=False):
            owners.setdefault(id(param), []).append(f"{mod_name}.{p_name}" if mod_name else p_name)
    return [sorted(set(names), key=names.index) for names in owners.values() if len(set(names)) > 1]


def _set_parameter(module: nn.Module, fqn: str, param: nn.Parameter) -> None:
    owner, _, name = fqn.rpartition(".")
    setattr(module.get_submodule(owner) if owner else module, name, param)


def _check_or_pad_sequence(model: nn.Module, tp: int, sequence: _SequenceLength, stage: bool = False) -> None:
    """Sequence parallelism needs tp to divide the sequence length: check every batch before any collective.

    Training with another length is an error. Without gradients (generation, whose length grows one token at a
    time) the tokens are padded on the right to a multiple of tp and the output cut back: exact for the causal
    decoders sequence parallelism is applied to here, where no position sees a later one. The (padded) length is
    kept in ``sequence`` for the position embeddings. With ``stage`` (a pipeline stage after the first), a floating
    point input is the previous stage's output, already this rank's sequence shard: it is neither checked nor padded.
    """
    padded: list[int] = []

    def before(_model: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        found = _first_tensor(args, kwargs)
        if stage and found is not None and found[1].is_floating_point():
            padded.append(0)
            return None
        if found is not None and found[1].dim() >= 2:
            sequence.length = found[1].size(1)
        if found is None or found[1].dim() < 2 or found[1].size(1) % tp == 0:
            padded.append(0)
            return None
        key, tokens = found
        if torch.is_grad_enabled():
            check_sequence_length(tokens.size(1), tp)
        pad = tp - tokens.size(1) % tp
        padded.append(pad)
        sequence.length = tokens.size(1) + pad
        tokens = torch.nn.functional.pad(tokens, (0, pad) if tokens.dim() == 2 else (0, 0, 0, pad))
        if isinstance(key, int):
            return (tokens, *args[1:]), kwargs
        return args, {**kwargs, key: tokens}

    def after(_model: nn.Module, _args: tuple, _kwargs: dict, output: Any) -> Any:
        pad = padded.pop() if padded else 0
        return output[:, :-pad] if pad and isinstance(output, torch.Tensor) else output

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True)


def _is_region(module: nn.Module, name: str, plan: dict[str, str]) -> bool:
    """Every parameter inside ``name`` belongs to a module the plan splits (or replicates for use on this rank's
    heads): the block is one tensor-parallel region, e.g. attention, not a block that also holds its norms."""
    for sub_name, sub in module.get_submodule(name).named_modules(prefix=name):
        if any(True for _ in sub.parameters(recurse=False)):
            if style_name(plan.get(sub_name, "")) not in (*_COLUMN_STYLES, *_ROW_STYLES,
                                                          "replicated_with_grad_allreduce"):
                return False
    return True


#: blocks already self-checked in this process: (class, tp, plan of the block); a second setup (fit, then test) or
#: another stage with the same kind of block does not run the check again
_SELF_CHECKED: set[tuple] = set()
#: the self-check's tolerance: relative to the largest output entry, fp32 (a wrong split is off by O(1))
SELF_CHECK_RTOL = 1e-4


def _check_units(plan: dict[str, str]) -> list[str]:
    """The modules that consume a column-parallel output (the parents of the ``colwise``/``packed_colwise``
    entries), innermost first, so that an error names the smallest module (the attention, not its block); the
    model's root is left out (its forward takes token ids, not a hidden state)."""
    parents = {n.rpartition(".")[0] for n, s in plan.items() if style_name(s) in _LOCAL_COLUMN_STYLES}
    parents.discard("")
    return sorted(parents, key=lambda p: (-p.count("."), p))


def _unit_input_width(unit: nn.Module) -> int | None:
    first = next((m for m in unit.modules() if isinstance(m, nn.Linear)), None)
    return first.in_features if first is not None else None


def _takes_one_tensor(unit: nn.Module) -> bool:
    import inspect

    try:
        params = inspect.signature(unit.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    return len(required) == 1


@torch.no_grad()
def _seeded_copy(unit: nn.Module, device: torch.device, generator: torch.Generator) -> nn.Module:
    """``unit`` copied, in fp32 on ``device``, with values drawn from ``generator``: the same on every rank, whatever
    the model's own initialisation (which may not have run yet: deferred, on the meta device)."""
    whole = copy.deepcopy(unit)
    meta = any(t.is_meta for t in itertools.chain(whole.parameters(), whole.buffers()))
    whole = whole.to_empty(device=device) if meta else whole.to(device)
    whole.float().eval()
    for tensor in itertools.chain(whole.parameters(), whole.buffers()):
        if not tensor.is_floating_point():
            continue
        if tensor.dim() >= 2:
            values = torch.randn(tensor.shape, generator=generator) / tensor.shape[-1] ** 0.5
        else:
            values = 1 + 0.1 * torch.randn(tensor.shape, generator=generator)
        tensor.copy_(values)
    return whole


def _run_split(whole: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh, x: torch.Tensor) -> torch.Tensor:
    """``whole`` split by ``plan`` (names relative to it) on ``tp_mesh``, run on ``x``; its output as a full tensor."""
    split = copy.deepcopy(whole)
    styles = _styles(split, plan, sequence_parallel=False)
    own = styles.pop("", None)
    if own is not None:
        parallelize_module(split, tp_mesh, own)
    parallelize_module(split, tp_mesh, styles)
    with torch.no_grad():
        out = split(x)
    out = out[0] if isinstance(out, tuple | list) else out
    return out.full_tensor() if isinstance(out, DTensor) else out


def self_check(module: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh, model_name: str,
               declared: dict[str, str], prefix: str = "") -> float:
    """Run each distinct kind of block once split by ``plan`` and once whole, on a small seeded input, and refuse
    a plan under which it computes another function (a collective on the tp group; every tp rank calls it).

    What no static check can see is how the forward uses a column-parallel output: ``chunk(3)`` of a fused q|k|v
    planned ``colwise`` mixes q, k and v across the ranks, and ``view(b, t, self.n_heads, hd)`` assumes all the
    heads. Both give a :class:`LayoutError` that names the block and the fix (for a fused projection, the
    ``packed_colwise:N`` entry that makes it match). Blocks whose forward takes more than one required argument
    are not checked. Returns the seconds it took; each (class, tp, plan) is checked once per process. ``plan``:
    the resolved plan (names relative to ``module``); ``declared``: the model's own patterns (relative to the
    declaring model, which ``prefix`` names), quoted in the errors.
    """
    import time

    start = time.perf_counter()
    tp = tp_mesh.size()
    device = _mesh_device(tp_mesh)
    seen: set[type] = set()
    for unit_name in _check_units(plan):
        unit = module.get_submodule(unit_name)
        if type(unit) in seen:
            continue
        seen.add(type(unit))
        rel = {n[len(unit_name) + 1:] if n != unit_name else "": s for n, s in plan.items()
               if n == unit_name or n.startswith(unit_name + ".")}
        key = (type(unit), tp, tuple(sorted(rel.items())))
        if key in _SELF_CHECKED:
            continue
        width = _unit_input_width(unit)
        if width is None or not _takes_one_tensor(unit):
            continue
        generator = torch.Generator().manual_seed(0)
        whole = _seeded_copy(unit, device, generator)
        x = torch.randn(2, 4, width, generator=generator).to(device)
        try:
            with torch.no_grad():
                expected = whole(x)
        except Exception:  # noqa: BLE001 -- not a block of hidden states [b, t, width]: nothing to compare with
            continue
        expected = expected[0] if isinstance(expected, tuple | list) else expected
        error, diff = _compare(whole, rel, tp_mesh, x, expected)
        if error is not None or diff > SELF_CHECK_RTOL:
            raise _self_check_error(model_name, unit_name[len(prefix):], unit, rel, tp_mesh, x, expected, error,
                                    diff, declared)
        _SELF_CHECKED.add(key)
    return time.perf_counter() - start


def self_check_experts(module: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh, model_name: str,
                       prefix: str = "") -> None:
    """Run each kind of ``moe_tp_experts`` module once split and once whole on a seeded input and random routing,
    and refuse it if the two differ (a collective on the tp group; every tp rank calls it; once per kind and
    process). The style sums the ranks' partial outputs, which is one process's function only for experts that are,
    per chosen expert, ``down(act(gate) * up)`` times its routing weight -- not for one that normalises or adds a
    bias after ``down``, whatever it is called, Hugging Face's or a user's."""
    tp = tp_mesh.size()
    for name, style in plan.items():
        if style_name(style) != experts_tp.EXPERTS_STYLE:
            continue
        unit = module.get_submodule(name)
        key = (type(unit), tp, style)
        if key in _SELF_CHECKED:
            continue
        generator = torch.Generator().manual_seed(0)
        whole = _seeded_copy(unit, _mesh_device(tp_mesh), generator)
        inputs = experts_tp.sample_inputs(whole, experts_tp.decode(style), generator)
        error: BaseException | None = None
        diff = 0.0
        try:
            with torch.no_grad():
                expected = whole(*inputs)
                split = copy.deepcopy(whole)
                parallelize_module(split, tp_mesh, parallel_style(style, split, sequence_parallel=False))
                got = split(*inputs)
            diff = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
        except Exception as caught:  # noqa: BLE001 -- reported by name below, on every rank
            error = caught
        verdict = torch.tensor([float(error is not None), diff], device=inputs[0].device)
        torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MAX, group=tp_mesh.get_group())
        if verdict[0] > 0 or verdict[1] > SELF_CHECK_RTOL:
            failed = (f"fails ({type(error).__name__}: {error})" if error is not None else
                      "fails on another tp rank" if verdict[0] > 0 else
                      f"computes another function (largest difference from the unsplit module {float(verdict[1]):.1e} "
                      "of its output, on a test input)")
            raise LayoutError(
                f"{model_name}.{name[len(prefix):]} ({type(unit).__name__}) {failed} when "
                f"'{experts_tp.EXPERTS_STYLE}' splits it over tp={tp}: that style sums the ranks' partial outputs, "
                "which is the whole only for experts computing, per chosen expert, down(act(gate) * up) times its "
                "routing weight (nothing after down but the weighting). Remove its entries from the tp plan (the "
                "experts then stay whole on every tp rank)."
            )
        _SELF_CHECKED.add(key)


def _compare(whole: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh, x: torch.Tensor,
             expected: torch.Tensor) -> tuple[BaseException | None, float]:
    """The split block's failure, or its largest difference from ``expected`` relative to ``expected``'s largest
    entry; the worst over the tp ranks, so that every rank decides alike."""
    error: BaseException | None = None
    diff = 0.0
    try:
        got = _run_split(whole, plan, tp_mesh, x)
        diff = float((got - expected).abs().max() / expected.abs().max().clamp_min(1e-12))
    except Exception as caught:  # noqa: BLE001 -- reported by name below, on every rank
        error = caught
    verdict = torch.tensor([float(error is not None), diff], device=x.device)
    torch.distributed.all_reduce(verdict, op=torch.distributed.ReduceOp.MAX, group=tp_mesh.get_group())
    if error is None and verdict[0] > 0:
        error = RuntimeError("it failed on another tp rank")
    return error, float(verdict[1])


def _declared_pattern(declared: dict[str, str], name: str) -> str:
    return next((p for p in declared if pattern_regex(p).fullmatch(name)), name)


def _self_check_error(model_name: str, unit_name: str, unit: nn.Module, plan: dict[str, str], tp_mesh: DeviceMesh,
                      x: torch.Tensor, expected: torch.Tensor, error: BaseException | None, diff: float,
                      declared: dict[str, str]) -> LayoutError:
    tp = tp_mesh.size()
    where = f"{model_name}.{unit_name} ({type(unit).__name__})"
    # a fused projection planned 'colwise': find the entry and the number of parts that make the block match
    whole = _seeded_copy(unit, x.device, torch.Generator().manual_seed(0))
    for name, style in plan.items():
        if style != "colwise":
            continue
        out = unit.get_submodule(name).out_features
        for parts in (3, 2, 4):
            if out % (parts * tp):
                continue
            retry_error, retry_diff = _compare(whole, {**plan, name: f"packed_colwise:{parts}"}, tp_mesh, x, expected)
            if retry_error is None and retry_diff <= SELF_CHECK_RTOL:
                pattern = _declared_pattern(declared, f"{unit_name}.{name}")
                return LayoutError(
                    f"{where} computes another function when its plan splits it over tp={tp}: its forward splits "
                    f"the output of {name} ({out} features) into {parts} parts, and 'colwise' gives each rank a "
                    f"contiguous 1/{tp} of it, which mixes those parts. Declare the fused projection: "
                    f"tp_plan[{pattern!r}] = 'packed_colwise:{parts}' (each rank then holds its slice of each part)."
                )
    heads = [f"{type(sub).__name__}.{attr}={value}" for _, sub in unit.named_modules()
             for attr, value in _head_counts(sub)]
    head_hint = (f" (each rank holds 1/{tp} of {', '.join(heads)})" if heads else "")
    local = ("reshape with this rank's head count, e.g. `q.view(b, t, -1, self.head_dim)` or "
             f"`self.n_heads // {tp}` -- not the global one{head_hint}")
    if error is not None:
        return LayoutError(
            f"{where} fails when its plan splits it over tp={tp}: {type(error).__name__}: {error}. Under tensor "
            f"parallelism its forward sees 1/{tp} of the features of each column-parallel output: {local}; declare "
            "a fused projection (q|k|v in one nn.Linear) 'packed_colwise:N'."
        )
    return LayoutError(
        f"{where} computes another function when its plan splits it over tp={tp} (largest difference from the "
        f"unsplit block {diff:.1e} of its output, on a test input). Its forward must work on 1/{tp} of the "
        f"features of each column-parallel output: {local}; declare a fused projection (q|k|v in one nn.Linear) "
        "'packed_colwise:N'; split only layers whose outputs the forward treats per head or per feature."
    )


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _styles(module: nn.Module, plan: dict[str, str], sequence_parallel: bool,
            sequence: _SequenceLength | None = None) -> dict[str, ParallelStyle]:
    """The torch style of each resolved plan entry (names relative to ``module``)."""
    styles = {}
    for name, style in plan.items():
        children, whole = (), True
        if takes_block_input(style):
            children = tuple(n[len(name) + 1:] if name else n for n, s in plan.items()
                             if style_name(s) in _LOCAL_COLUMN_STYLES and n.rpartition(".")[0] == name)
            whole = _is_region(module, name, plan)
        styles[name] = parallel_style(style, module.get_submodule(name), sequence_parallel, children, whole, sequence)
    return styles


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, rng: bool = True, *,
    stage: bool = False, rng_where: Callable[[nn.Module], bool] | None = None, ep: int = 1,
) -> TensorParallelPlan:
    """Split ``module`` (in place) over the 1-D ``tp_mesh`` by its declared plan; see :func:`resolve_tp_plan`.

    Parameters become DTensors on ``tp_mesh`` (sharded where the plan splits them, replicated elsewhere); tied
    parameters stay tied. With ``sequence_parallel`` a forward pre-hook on the declared model checks each batch's
    sequence length. With ``rng`` (default) dropout draws per-tp-rank masks inside the tensor-parallel regions and
    equal masks outside (:class:`~lightning_par.parallel.rng.TensorParallelRNG`; it first makes the default
    generator equal on the tp ranks); ``rng_where`` limits the per-rank regions to the column-parallel modules it
    accepts (see :meth:`~lightning_par.parallel.rng.TensorParallelRNG.install`). The plan is checked completely
    before the first collective, so a bad plan raises the same :class:`LayoutError` on every rank; then
    :func:`self_check` runs each kind of block split and whole on the tp group (once per process) and refuses a
    plan under which the model would compute another function. Returns the
    :class:`TensorParallelPlan`; run the loss inside its ``loss_context()``.

    ``stage=True``: ``module`` is one pipeline stage (see :func:`resolve_tp_plan`); plan patterns naming units
    this stage does not hold are skipped. Check the whole model first with :func:`check_tp_plan`. Only the stage
    holding the head gets ``vocab_parallel_head=True``; ``loss_context()`` is a no-op on the others, so it can wrap
    the pipeline schedule call on every rank.
    """
    tp = tp_mesh.size()
    plan = resolve_tp_plan(module, tp, sequence_parallel, stage=stage, ep=ep)
    root_name, model, declared = find_plan(module, "tp")  # type: ignore[misc]
    prefix = f"{root_name}." if root_name else ""
    tied = _tied_parameters(module)
    sequence = _SequenceLength()
    if not is_hf_model(model):  # (a transformers model's published plan and forward are written for each other)
        self_check(module, plan, tp_mesh, type(model).__name__, declared, prefix)
    self_check_experts(module, plan, tp_mesh, type(model).__name__, prefix)
    styles = _styles(module, plan, sequence_parallel, sequence)
    parallelize_module(module, tp_mesh, styles)
    for name, style in styles.items():
        parent_name, _, attr = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        if type(style) is ReplicateParameters and name and _used_uncalled(parent, attr):
            _local_while(parent, module.get_submodule(name))
    for names in tied:  # (differing planned splits were refused by resolve_tp_plan; this checks the actual ones)
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
        _check_or_pad_sequence(model, tp, sequence, stage)
    tracker = None
    if rng:
        tracker = TensorParallelRNG(tp_mesh)
        tracker.install(model, {n[len(prefix):]: s for n, s in plan.items()}, sequence_parallel, rng_where)
    vocab_head = any(isinstance(s, VocabParallelHead) for s in styles.values())
    return TensorParallelPlan(plan=plan, styles=styles, tp_mesh=tp_mesh, sequence_parallel=sequence_parallel,
                              vocab_parallel_head=vocab_head, tied=tied, rng=tracker)


# ---------------------------------------------------------------------------------------------------------------------
# Checkpoints of packed_colwise parameters
# ---------------------------------------------------------------------------------------------------------------------
def _is_packed(value: Any) -> bool:
    return (isinstance(value, DTensor) and len(value.placements) == 1
            and isinstance(value.placements[0], StridedShard))


def _walk_packed(state: Any) -> Iterator[tuple[Any, Any]]:
    """``(container, key)`` of every packed_colwise DTensor in a nested state dict (model or optimizer state)."""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in items:
        if _is_packed(value):
            yield state, key
        elif isinstance(value, dict | list):
            yield from _walk_packed(value)


def _as_slices(value: DTensor) -> DTensor:
    return value.redistribute(value.device_mesh, [Shard(value.placements[0].dim)])


def packed_as_slices(state: Any) -> list[tuple[Any, Any, DTensor]]:
    """Replace, in place, every packed_colwise DTensor of ``state`` by the same tensor split in contiguous slices.

    DCP describes a rank's shard as one box of the full tensor, which this rank's slices of q, k and v are not (DCP
    refuses them as overlapping chunks); as ``Shard`` slices they are saved as the one-process tensor, so any layout
    -- one process, another tp, an export -- reads them back. Returns ``(container, key, original)`` for
    :func:`restore_packed`. A collective on the tp group per packed tensor (every tp rank calls it).
    """
    replaced = []
    for container, key in list(_walk_packed(state)):
        original = container[key]
        container[key] = _as_slices(original)
        replaced.append((container, key, original))
    return replaced


@torch.no_grad()
def restore_packed(replaced: list[tuple[Any, Any, DTensor]]) -> None:
    """After a load into the slices of :func:`packed_as_slices`: copy their values back into the packed tensors
    (this rank's slice of each part) and put those back in the state dict."""
    for container, key, original in replaced:
        loaded = container[key].redistribute(original.device_mesh, original.placements)
        original.to_local().copy_(loaded.to_local())
        container[key] = original

