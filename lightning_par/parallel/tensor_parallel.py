"""Tensor (Megatron) and sequence parallelism from a model's own declared plan, applied with DTensor.

A model declares how it may be split in Hugging Face form: a ``tp_plan`` mapping module-name patterns (``"*"``
matches one name component) to style strings. Our GPT declares ``GPT.tp_plan``; a ``transformers`` model publishes
``config.base_model_tp_plan`` plus its head's ``_tp_plan`` (merged on the instance as ``model.tp_plan``).
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
==================================== ============================================================================
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
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

from lightning_par.parallel.rng import TensorParallelRNG
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


def resolve_tp_plan(module: nn.Module, tp: int, sequence_parallel: bool = False, *,
                    stage: bool = False) -> dict[str, str]:
    """Expand and validate ``module``'s declared plan for ``tp`` ranks; no process group or mesh is needed.

    Returns ``{module FQN (relative to module): style}`` in application order, including the entries the engine adds
    (``block_input``, ``replicate``, ``sequence_parallel`` on norms). Raises :class:`LayoutError` that names the
    module, the sizes and the fix for: no plan, an unknown style, a pattern that matches no module, a head count,
    hidden/FFN size, vocabulary or sharded Linear/Embedding dimension that ``tp`` does not divide, and sequence
    parallelism on a model it cannot be applied to.

    ``stage=True``: ``module`` is one pipeline stage (or one pipeline rank's stages) of the model, holding only some
    of its units, so a plan pattern that matches nothing here is skipped (the embedding lives on the first stage, the
    head on the last); every other check stays. Check the whole model once, before the split, with
    :func:`check_tp_plan` (the strict default), so that a misspelt pattern is still an error.
    A unit removed from a stage (``None``, or a parameter-free
    :class:`~lightning_par.parallel.pipeline.split.RemovedUnit` stand-in) is never matched.
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
    removed = _removed_units(model)
    candidates = [name for name in names if name not in removed]
    resolved: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in PLAN_STYLES or style == "block_input":
            allowed = ", ".join(s for s in PLAN_STYLES if s != "block_input")
            raise LayoutError(
                f"{model_name}.tp_plan[{pattern!r}] = {style!r} is not a style lightning-par applies; "
                f"use one of: {allowed}."
            )
        regex = _pattern_regex(pattern)
        matched = [name for name in candidates if regex.fullmatch(name)]
        if not matched and stage:
            continue  # held by another pipeline stage (the whole model was checked by check_tp_plan)
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


def check_tp_plan(module: nn.Module, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
    """Check the WHOLE model's plan for ``tp`` ranks once, before it is split into pipeline stages.

    This is :func:`resolve_tp_plan` with its strict default (every pattern must match a module of the model; the
    divisibility, style and tied-weight checks), returning the whole model's resolved plan. Each stage is then
    split with ``apply_tensor_parallel(stage_module, tp_mesh, sequence_parallel, stage=True)``, which skips the
    patterns that name another stage's units. No process group is needed.
    """
    return resolve_tp_plan(module, tp, sequence_parallel, stage=False)


def _removed_units(model: nn.Module) -> set[str]:
    """Names of pipeline units that a stage replaced by a parameter-free stand-in (they hold nothing to split)."""
    from lightning_par.parallel.pipeline.split import RemovedUnit  # (lazy: the pipeline package is heavier)

    return {name for name, sub in model.named_modules() if name and isinstance(sub, RemovedUnit)}


def _planned_split(style: str, module: nn.Module, param: str) -> str:
    """How ``style`` will place ``module``'s parameter ``param``: "Shard(d)" or "Replicate()"."""
    if style in _COLUMN_STYLES or (style == "vocab_parallel" and isinstance(module, nn.Linear)):
        return "Shard(0)"  # weight [out, in] and bias [out] split over the output features
    if style in _ROW_STYLES:
        return "Shard(1)" if param == "weight" else "Replicate()"
    if style in ("vocab_parallel", "embedding_rowwise"):
        return "Shard(0)"  # embedding rows
    return "Replicate()"


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


class ReplicateWithGradAllReduce(ReplicateParameters):
    """Replicated parameters whose gradients are summed over the tp group on their way back to the parameter.

    For modules that see only this rank's part of the activations: a norm on a sequence shard (sequence
    parallelism), or a q/k norm inside the attention region (this rank's heads; Hugging Face's
    ``replicated_with_grad_allreduce``). Each rank's gradient covers its part only; the sum is the whole.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        group = device_mesh.get_group()

        def sum_over_ranks(grad: torch.Tensor) -> torch.Tensor:
            total = grad.clone()
            torch.distributed.all_reduce(total, group=group)
            return total

        def reduce_weight_grads(mod: nn.Module, _args: Any) -> None:
            if torch.is_grad_enabled():
                for local in mod._parameters.values():
                    if local is not None and local.requires_grad and not isinstance(local, DTensor):
                        local.register_hook(sum_over_ranks)

        # runs after ReplicateParameters' swap (hooks run in registration order)
        module.register_forward_pre_hook(reduce_weight_grads)
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

    A block that holds parameters of its own gets them replicated.
    """

    def __init__(self, sequence_parallel: bool = False, children: tuple[str, ...] = (),
                 whole_block: bool = True) -> None:
        super().__init__()
        self.input_layout: Placement = Shard(1) if sequence_parallel else Replicate()
        self.children = children
        self.whole_block = whole_block

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
    if style in ("replicate", "sequence_parallel"):
        return ReplicateParameters()
    if style == "block_input":
        return BlockInput(sequence_parallel, children, whole_block)
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
            if plan.get(sub_name) not in (*_COLUMN_STYLES, *_ROW_STYLES, "replicated_with_grad_allreduce"):
                return False
    return True


def apply_tensor_parallel(
    module: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False, rng: bool = True, *,
    stage: bool = False, rng_where: Callable[[nn.Module], bool] | None = None,
) -> TensorParallelPlan:
    """Split ``module`` (in place) over the 1-D ``tp_mesh`` by its declared plan; see :func:`resolve_tp_plan`.

    Parameters become DTensors on ``tp_mesh`` (sharded where the plan splits them, replicated elsewhere); tied
    parameters stay tied. With ``sequence_parallel`` a forward pre-hook on the declared model checks each batch's
    sequence length. With ``rng`` (default) dropout draws per-tp-rank masks inside the tensor-parallel regions and
    equal masks outside (:class:`~lightning_par.parallel.rng.TensorParallelRNG`; it first makes the default
    generator equal on the tp ranks); ``rng_where`` limits the per-rank regions to the column-parallel modules it
    accepts (see :meth:`~lightning_par.parallel.rng.TensorParallelRNG.install`). The plan is checked completely
    before the first collective, so a bad plan raises the same :class:`LayoutError` on every rank. Returns the
    :class:`TensorParallelPlan`; run the loss inside its ``loss_context()``.

    ``stage=True``: ``module`` is one pipeline stage (see :func:`resolve_tp_plan`); plan patterns naming units
    this stage does not hold are skipped. Check the whole model first with :func:`check_tp_plan`. Only the stage
    holding the head gets ``vocab_parallel_head=True``; ``loss_context()`` is a no-op on the others, so it can wrap
    the pipeline schedule call on every rank.
    """
    tp = tp_mesh.size()
    plan = resolve_tp_plan(module, tp, sequence_parallel, stage=stage)
    root_name, model, _ = find_tp_plan(module)  # type: ignore[misc]
    prefix = f"{root_name}." if root_name else ""
    tied = _tied_parameters(module)
    sequence = _SequenceLength()
    styles = {}
    for name, style in plan.items():
        children, whole = (), True
        if style == "block_input":
            children = tuple(n[len(name) + 1:] for n, s in plan.items()
                             if s == "colwise" and n.rpartition(".")[0] == name)
            whole = _is_region(module, name, plan)
        styles[name] = parallel_style(style, module.get_submodule(name), sequence_parallel, children, whole, sequence)
    parallelize_module(module, tp_mesh, styles)
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
