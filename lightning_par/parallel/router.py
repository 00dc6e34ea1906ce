"""The router's statistics across data-parallel ranks: the global load-balancing loss, and the tokens-per-expert logs.

The Switch / Mixtral load-balancing loss of a layer is ``E * sum_e f_e * P_e`` (``f_e``: the fraction of the
(token, choice) pairs routed to expert e; ``P_e``: the mean router probability of e). It is a product of means over
the tokens, so it is not linear in the batch: computed on each rank's tokens (scope ``"micro_batch"``, what the
anchors and transformers do), its value depends on how the global batch is split. Scope ``"global"`` sums the two
statistics' numerators (routed counts, probability sums) and the token count over every data-parallel rank
(dp x cp, which covers the ep ranks) before the loss is formed, as Megatron-Core's global auxiliary loss does, so
each rank's loss is the one a single process computes from the whole global batch of that forward.

A layer takes part by declaring ``aux_loss_scope`` and a ``router_statistics`` attribute (None); under a
data-parallel layout :func:`apply_router_statistics` sets the latter, for the global scope, to a
:class:`SumOverRanks` of the data-parallel group: called on a tensor it returns the sum over the ranks, with a
backward that sums the gradients too. The sum is differentiable where the loss needs it (the probabilities): every
rank forms the same global loss, so the backward hands each rank ``ranks x`` its share of the gradient, which the
data-parallel average (a mean over the ranks) brings back to the global loss's own gradient. Nothing here imports
Lightning.

The logs: a layer also keeps ``tokens_per_expert`` (the (token, choice) pairs its router sent to each expert since
the last log, before any capacity) and ``dropped_tokens`` (pairs dropped by a capacity factor); :func:`router_load`
reads them, summed over a data-parallel group, and :func:`load_metrics` turns them into the logged scalars.

Under a pipeline the schedule backpropagates the last stage's loss alone, while each layer's load-balancing loss is
formed on the stage holding the layer. :func:`apply_aux_loss_in_backward` gives such a layer an
``aux_loss_backward`` (:class:`AuxLossInBackward`, the idea of Megatron-Core's ``MoEAuxLossAutoScaler``): the layer
passes its output and its weighted loss through it; the output comes back unchanged, and when the output's gradient
arrives the loss's own backward starts too, with the factor the schedule applies to each micro-batch's loss. So each
micro-batch's load-balancing loss trains its stage's routers inside any schedule, with nothing sent between stages.
A Hugging Face MoE model's loss is one function of all layers' router logits; under a pipeline
:func:`apply_layer_balancing` forms it as the sum of the layers' own terms instead (Megatron's), each on its stage.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par._compat import current_graph_task_id
from lightning_par.topology import LayoutError

#: the scopes of the load-balancing loss (see the module docstring)
AUX_LOSS_SCOPES = ("micro_batch", "global")
#: what a router layer declares to take part in the global scope and the logs
ROUTER_ATTRIBUTES = ("aux_loss_scope", "router_statistics")
#: where a Hugging Face model keeps its :class:`GlobalLoadBalancing` hook's handle
BALANCING_HOOK = "_lightning_par_global_balancing"
#: what a router layer declares to start its load-balancing loss's backward from its output's (under a pipeline)
AUX_LOSS_IN_BACKWARD = "aux_loss_backward"


def router_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The modules inside ``module`` that declare a router, by name."""
    return {name: m for name, m in module.named_modules()
            if all(hasattr(m, attribute) for attribute in ROUTER_ATTRIBUTES)}


class _SumOverRanks(torch.autograd.Function):
    """All-reduce (sum) whose backward is the all-reduce (sum) of the gradients: each rank's input feeds every
    rank's output."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any) -> Tensor:
        ctx.group = group
        out = tensor.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class SumOverRanks:
    """A router layer's ``router_statistics`` under the global scope: the sum of a tensor over the data-parallel
    ranks (``ranks`` of them), differentiable; the identity on one rank."""

    def __init__(self, group: Any, ranks: int) -> None:
        self.group, self.ranks = group, ranks

    def __call__(self, tensor: Tensor) -> Tensor:
        if self.ranks == 1 or tensor.is_meta:  # (a shape inference on meta tensors runs no collective)
            return tensor
        return _SumOverRanks.apply(tensor, self.group)


def check_aux_loss_scope(scope: str | None) -> None:
    """A strategy's ``aux_loss_scope``: None (each model's own) or one of :data:`AUX_LOSS_SCOPES`."""
    if scope is not None and scope not in AUX_LOSS_SCOPES:
        raise LayoutError(f"aux_loss_scope={scope!r} is not a scope of the load-balancing loss: use one of "
                          f"{', '.join(map(repr, AUX_LOSS_SCOPES))}, or None for each model's own.")


def apply_router_statistics(module: nn.Module, group: Any, ranks: int, scope: str | None = None,
                            sequence_parallel: bool = False) -> str | None:
    """Give every router layer of ``module`` whose scope is global the sum over the data-parallel ``group`` (of
    ``ranks`` ranks; dp x cp), and every Hugging Face model adding a load-balancing loss (:func:`balancing_models`)
    under the global scope a :class:`GlobalLoadBalancing` hook; a line for the log saying which scope each computes
    (None: no router). ``scope``: the strategy's, which replaces each layer's own (a Hugging Face model's own is
    ``"micro_batch"``, transformers' per-forward loss); a scope given for a model without a router is refused, and
    so is a load-balancing loss under ``sequence_parallel`` (each tensor-parallel rank routes its own tokens, and the
    router's gradient, summed over them, would train the sum of their losses: no scope's function)."""
    layers, models = router_layers(module), balancing_models(module)
    balanced = [n for n, m in layers.items() if getattr(m, "aux_loss_coef", 0)]
    balanced += [n for n, m in models.items() if m.router_aux_loss_coef
                 and getattr(getattr(m, "config", None), "output_router_logits", False)]
    if sequence_parallel and balanced:
        raise LayoutError(
            f"sequence_parallel=True with a load-balancing loss ({balanced[0] or type(module).__name__}): each "
            "tensor-parallel rank routes its own part of the sequence, and their losses are not yet combined into one "
            "scope's function. Train without sequence_parallel, or with the loss off (aux_loss_coef=0; a Hugging "
            "Face model: router_aux_loss_coef=0 or output_router_logits=False).")
    if scope is not None and not layers and not models:
        raise LayoutError(
            f"aux_loss_scope={scope!r} but {type(module).__name__} has no router whose load-balancing loss it could "
            "scope (a layer declaring aux_loss_scope, as lightning_par.examples.moe.MoEFeedForward, or a Hugging Face "
            "MoE model with load_balancing_loss_func): leave aux_loss_scope unset.")
    for layer in layers.values():
        layer.aux_loss_scope = scope or layer.aux_loss_scope
        if layer.aux_loss_scope == "global":
            layer.router_statistics = SumOverRanks(group, ranks)
    for model in models.values():
        if (previous := getattr(model, BALANCING_HOOK, None)) is not None:  # (a second setup of the same model)
            previous.remove()
        if scope == "global":
            setattr(model, BALANCING_HOOK, model.register_forward_hook(
                GlobalLoadBalancing(model, SumOverRanks(group, ranks)), with_kwargs=True))
    lines = [describe_routers(layers, ranks)] if layers else []
    lines += [describe_balancing(model, scope or "micro_batch", ranks) for model in models.values()]
    return "; ".join(lines) or None


def describe_routers(layers: dict[str, nn.Module], ranks: int) -> str:
    """``router: ...``: the load-balancing loss's scope (or off) and the capacity of the router ``layers``."""
    said = {"micro_batch": "scope micro_batch (each rank's tokens of each micro-batch)",
            "global": f"scope global (statistics summed over the {ranks} data-parallel ranks of each micro-batch)"}
    scopes = sorted({said[m.aux_loss_scope] for m in layers.values() if getattr(m, "aux_loss_coef", 1)})
    capacities = sorted({str(getattr(m, "capacity_factor", None)) for m in layers.values()})
    return (f"router: {len(layers)} layers, load-balancing loss {' and '.join(scopes) or 'off (aux_loss_coef=0)'}, "
            f"{'dropless' if capacities == ['None'] else 'capacity factor ' + ', '.join(capacities)}")


# ----------------------------------------------------------------------------------------------------------------------
# Hugging Face MoE models: one load-balancing loss over all layers' router logits
# ----------------------------------------------------------------------------------------------------------------------
def balancing_models(module: nn.Module) -> dict[str, nn.Module]:
    """The Hugging Face causal LMs inside ``module`` that add their routers' load-balancing loss to their ``.loss``:
    those with a ``router_aux_loss_coef`` whose modeling module computes the loss with ``load_balancing_loss_func``
    (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, gpt-oss; DeepSeek-V3 has none), by name. The class's bases are read
    too: FSDP2 (ZeRO-3) swaps a sharded module's class for a subclass defined in torch's own module."""
    return {name: m for name, m in module.named_modules() if hasattr(m, "router_aux_loss_coef")
            and any(callable(getattr(sys.modules.get(c.__module__), "load_balancing_loss_func", None))
                    for c in type(m).__mro__)}


def describe_balancing(model: nn.Module, scope: str, ranks: int) -> str:
    """``router: ...`` for a Hugging Face model: its load-balancing loss's scope, or off."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False) or not model.router_aux_loss_coef:
        return f"router: {type(model).__name__}'s load-balancing loss off (output_router_logits, router_aux_loss_coef)"
    said = {"micro_batch": "scope micro_batch (the model's own: each rank's tokens of each forward)",
            "global": f"scope global (all layers' statistics summed over the {ranks} data-parallel ranks)"}
    return (f"router: {type(model).__name__}'s load-balancing loss (coefficient {model.router_aux_loss_coef}), "
            f"{said[scope]}")


def balancing_statistics(router_logits: tuple[Tensor, ...], experts: int, top_k: int,
                         attention_mask: Tensor | None = None) -> Tensor:
    """The numerators and the count behind transformers' ``load_balancing_loss_func`` (the Switch loss over all
    layers' rows at once), ``[routed (token, choice) pairs per expert (E), router probability sums (E), rows]`` in
    fp32, padding (``attention_mask`` 0) left out as transformers leaves it out; :func:`balancing_loss` forms the
    loss. Sums, so that the sum over ranks is the statistics of all their tokens."""
    stats = torch.zeros(2 * experts + 1, dtype=torch.float32, device=router_logits[0].device)
    for logits in router_logits:
        probs = torch.softmax(logits.to(stats.device), dim=-1)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        rows = torch.ones(probs.shape[0], device=stats.device) if attention_mask is None \
            else attention_mask.reshape(-1).to(device=stats.device, dtype=torch.float32)
        counts = torch.zeros(experts, device=stats.device).scatter_add_(0, chosen.reshape(-1),
                                                                          rows.repeat_interleave(top_k))
        stats = stats + torch.cat([counts, (probs.float() * rows.unsqueeze(-1)).sum(dim=0), rows.sum().reshape(1)])
    return stats


def balancing_loss(stats: Tensor, experts: int) -> Tensor:
    """transformers' load-balancing loss of :func:`balancing_statistics`: ``E * sum_e (routed_e / rows) * (prob_e /
    rows)`` (as transformers forms it: the routed fraction not divided by top-k)."""
    rows = stats[-1]
    return experts * (stats[:experts] / rows * stats[experts:2 * experts] / rows).sum()


class GlobalLoadBalancing:
    """A forward hook (with kwargs) of a Hugging Face causal LM under the global scope: its output's ``aux_loss``
    becomes the loss of the statistics summed over the data-parallel ranks (``statistics``: a
    :class:`SumOverRanks`), and its ``loss`` has the coefficient times the difference added -- the gradient of the
    model's own per-rank term cancels exactly (it meets its negative), the global term's trains. The hook recomputes
    the model's own loss from the same router logits first and, on the first forward, refuses a model whose loss is
    not this one (a modeling file whose load-balancing loss changed): rather an error than another function."""

    def __init__(self, model: nn.Module, statistics: Callable[[Tensor], Tensor]) -> None:
        self.experts, self.top_k = model.num_experts, model.num_experts_per_tok
        self.statistics, self.name = statistics, type(model).__name__
        self.mask_at = next((i for i, n in enumerate(inspect.signature(model.forward).parameters)
                             if n == "attention_mask"), None)
        self.checked = False

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        local, logits = getattr(output, "aux_loss", None), getattr(output, "router_logits", None)
        if not isinstance(local, Tensor) or not isinstance(logits, tuple) or not logits or local.is_meta:
            return output  # (no load-balancing loss in this forward)
        mask = kwargs.get("attention_mask", args[self.mask_at] if self.mask_at is not None
                          and len(args) > self.mask_at else None)
        stats = balancing_statistics(logits, self.experts, self.top_k, mask)
        if not self.checked:
            mine = balancing_loss(stats, self.experts).detach()
            if not torch.allclose(mine, local.detach().float(), rtol=1e-4, atol=1e-6):
                raise RuntimeError(
                    f"aux_loss_scope='global': {self.name}'s load-balancing loss is {float(local.detach()):.6g} "
                    f"where the Switch loss lightning_par sums over the ranks gives {float(mine):.6g} from the same "
                    "router logits: this "
                    "version of the model computes another loss, which the global scope cannot sum. Use "
                    "aux_loss_scope='micro_batch' (the model's own loss on each rank's tokens).")
            self.checked = True
        aux = balancing_loss(self.statistics(stats), self.experts)
        if getattr(output, "loss", None) is not None:
            output.loss = output.loss + model.router_aux_loss_coef * (aux - local).to(output.loss.device)
        output.aux_loss = aux
        return output


# ----------------------------------------------------------------------------------------------------------------------
# Hugging Face MoE models under a pipeline: each layer's term, on its own stage
# ----------------------------------------------------------------------------------------------------------------------
#: where a Hugging Face model keeps its :class:`LayerBalancing`'s hook handles (a second setup removes them)
LAYER_BALANCING_HOOKS = "_lightning_par_layer_balancing"
#: the output transformers collects from each MoE layer's router (``_can_record_outputs``)
ROUTER_LOGITS = "router_logits"


def router_logit_modules(model: nn.Module) -> dict[str, int] | None:
    """The modules of ``model`` whose output transformers collects into ``router_logits`` -- read from the
    ``_can_record_outputs["router_logits"]`` of its class (an ``OutputRecorder``, a class or a class name, matched as
    transformers matches them) -- by name, each with the index of the logits in its output; None when no class of the
    model records them."""
    specs = next((s[ROUTER_LOGITS] for m in model.modules()
                  if isinstance(s := getattr(m, "_can_record_outputs", None), dict) and s.get(ROUTER_LOGITS)), None)
    if specs is None:
        return None
    found: dict[str, int] = {}
    for spec in specs if isinstance(specs, list) else [specs]:
        if isinstance(spec, type | str):  # (transformers' default index for outputs other than hidden states)
            target, class_name, layer, index = (spec, None, None, 1) if isinstance(spec, type) else \
                (None, spec, None, 1)
        else:
            target, class_name = getattr(spec, "target_class", None), getattr(spec, "class_name", None)
            layer, index = getattr(spec, "layer_name", None), getattr(spec, "index", 0)
        for name, module in model.named_modules():
            if not ((target is not None and isinstance(module, target))
                    or (class_name is not None and f".{name}".endswith(class_name))):
                continue
            if layer is None or f".{layer.strip('.')}." in f".{name}.":
                found[name] = index
    return found


def layer_balancing_refusal(model: nn.Module) -> str | None:
    """Why a pipeline cannot form ``model``'s load-balancing loss layer by layer (:class:`LayerBalancing`), or None
    when it can: a Hugging Face causal LM whose modeling module has ``load_balancing_loss_func``, whose class records
    its routers' logits, with integer ``num_experts`` and ``num_experts_per_tok``. Read from the class and the
    config alone: the same verdict on every pipeline rank, whatever its stages hold."""
    if not balancing_models(model):
        return "its modeling module has no load_balancing_loss_func to form each layer's term with"
    if router_logit_modules(model) is None:
        return (f"its class records no `{ROUTER_LOGITS}` output (_can_record_outputs), so the pipeline cannot find "
                "the module each layer's router logits come from")
    if not all(isinstance(getattr(model, a, None), int) for a in ("num_experts", "num_experts_per_tok")):
        return "it has no integer num_experts and num_experts_per_tok to call its load_balancing_loss_func with"
    return None


class LayerBalancing:
    """Under a pipeline, a Hugging Face MoE model's load-balancing loss as the sum of its layers' terms (Megatron's
    per-layer auxiliary loss), not transformers' one loss of all layers' statistics together, whose layers live on
    different stages. A forward hook on each module whose output transformers records as ``router_logits`` keeps the
    layer's logits; a forward hook on the layer's block forms its term -- the model's own ``load_balancing_loss_func``
    of those logits alone (its ``num_experts``, top-k and the stage's ``attention_mask``) times
    ``router_aux_loss_coef`` -- and starts it in the backward from the block's output (its ``aux_loss_backward``,
    :class:`AuxLossInBackward`). The block's hook runs outside a recomputed forward, so the term and its saved
    tensors are those of the forward itself (a recomputation would see the mask of the micro-batch current then).
    A forward pre-hook on each stage module reads the micro-batch's mask and calls the model with
    ``output_router_logits=False``: the stage's output then holds no loss of its stage's logits alone."""

    def __init__(self, model: nn.Module, function: Callable[..., Tensor], coefficient: float) -> None:
        self.function, self.coefficient = function, coefficient
        self.experts, self.top_k, self.name = model.num_experts, model.num_experts_per_tok, type(model).__name__
        self.takes_flag = "output_router_logits" in inspect.signature(type(model).forward).parameters
        self.mask: Tensor | None = None
        self.pending: dict[int, list[Tensor]] = {}

    def stage_call(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        self.mask, self.pending = kwargs.get("attention_mask"), {}
        return (args, {**kwargs, "output_router_logits": False}) if self.takes_flag else None

    def router_hook(self, block: nn.Module, index: int) -> Callable[[nn.Module, tuple, Any], None]:
        def keep(module: nn.Module, args: tuple, output: Any) -> None:
            logits = output[index] if isinstance(output, tuple | list) else output
            # not in a forward that recompute runs again inside the backward: the first one's term is trained
            if torch.is_grad_enabled() and isinstance(logits, Tensor) and counts_routing(logits):
                self.pending.setdefault(id(block), []).append(logits)

        return keep

    def block_output(self, block: nn.Module, args: tuple, output: Any) -> Any:
        logits, started = self.pending.pop(id(block), []), getattr(block, AUX_LOSS_IN_BACKWARD, None)
        if not logits or started is None:
            return None
        if self.mask is not None and any(self.mask.numel() != x.shape[0] for x in logits):
            raise LayoutError(
                f"{self.name} under pp: a router's logits hold {logits[0].shape[0]} rows where the stage's "
                f"attention_mask holds {self.mask.numel()} tokens, so its layer's load-balancing term cannot leave the "
                "padding out as the model would: train without padding (or without the loss) in this layout.")
        term = self.coefficient * torch.stack([self.function((x,), self.experts, self.top_k, self.mask)
                                               for x in logits]).sum()
        if isinstance(output, Tensor):
            return started(output, term)
        if isinstance(output, tuple) and output and isinstance(output[0], Tensor):
            return (started(output[0], term), *output[1:])
        raise LayoutError(f"{self.name} under pp: the block {type(block).__name__} returns {type(output).__name__}, "
                          "not a tensor (or a tuple starting with one) to start its layer's load-balancing term from.")


def apply_layer_balancing(module: nn.Module, stages: list[nn.Module], block_names: list[str]) -> str | None:
    """Under a pipeline, give every Hugging Face model inside ``module`` (this rank's stages) that adds a
    load-balancing loss a :class:`LayerBalancing`: its hooks, and ``aux_loss_backward = None`` on each block holding
    a router (``block_names``, relative to ``module``; else the router's parent), which the runtime then sets
    (:func:`apply_aux_loss_in_backward`). ``stages``: the modules the schedule calls. A line for the log (None: no
    such model). Refused: a model :func:`layer_balancing_refusal` refuses, and the global scope (not built here)."""
    lines = []
    for name, model in balancing_models(module).items():
        for handle in getattr(model, LAYER_BALANCING_HOOKS, ()):  # (a second setup of the same model)
            handle.remove()
        coefficient = model.router_aux_loss_coef
        if not coefficient or not getattr(getattr(model, "config", None), "output_router_logits", False):
            continue
        if (why := layer_balancing_refusal(model)) is not None:
            raise LayoutError(f"pipeline parallel: {type(model).__name__}'s load-balancing loss cannot be formed "
                              f"layer by layer on the stages: {why}. Set router_aux_loss_coef=0 to train under pp.")
        hook = getattr(model, BALANCING_HOOK, None)
        if hook is not None and hook.id in model._forward_hooks:
            raise LayoutError(
                f"aux_loss_scope='global' with pipeline parallel: {type(model).__name__}'s load-balancing loss is "
                "formed layer by layer on each stage under pp, from each rank's tokens; the global scope is not built "
                "for it there. Use aux_loss_scope='micro_batch' (or unset), or train with the global scope without pp.")
        function = next(getattr(sys.modules.get(c.__module__), "load_balancing_loss_func", None)
                        for c in type(model).__mro__
                        if callable(getattr(sys.modules.get(c.__module__), "load_balancing_loss_func", None)))
        balancing = LayerBalancing(model, function, coefficient)
        prefix = f"{name}." if name else ""
        handles, blocks = [], {}
        for gate_name, index in router_logit_modules(model).items():
            full = prefix + gate_name
            block_name = max((b for b in block_names if full.startswith(f"{b}.")), key=len, default=None)
            block = module.get_submodule(block_name if block_name is not None else full.rpartition(".")[0])
            blocks[id(block)] = block
            handles.append(module.get_submodule(full).register_forward_hook(balancing.router_hook(block, index)))
        for block in blocks.values():
            if not hasattr(block, AUX_LOSS_IN_BACKWARD):
                setattr(block, AUX_LOSS_IN_BACKWARD, None)
            handles.append(block.register_forward_hook(balancing.block_output))
        handles += [stage.register_forward_pre_hook(balancing.stage_call, with_kwargs=True) for stage in stages]
        setattr(model, LAYER_BALANCING_HOOKS, handles)
        lines.append(
            f"router: under pp, {type(model).__name__}'s load-balancing loss is the sum of its MoE layers' terms "
            f"(Megatron's: each layer's load_balancing_loss_func of its own router logits, times {coefficient}, "
            "started in the backward on its stage), not transformers' one loss of all layers' logits together")
    return "; ".join(lines) or None


class _AuxLossInBackward(torch.autograd.Function):
    """The identity on ``output``; its backward also gives ``aux_loss`` the gradient ``scale``, so that the loss's
    own backward runs with the output's."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, aux_loss: Tensor, scale: float) -> Tensor:
        ctx.scale, ctx.like = scale, aux_loss.detach()
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, torch.full_like(ctx.like, ctx.scale), None


class AuxLossInBackward:
    """A router layer's ``aux_loss_backward`` under a pipeline: ``(output, weighted_aux_loss) -> output``, whose
    backward backpropagates the loss scaled by ``scale()`` (read at each forward: the factor the schedule gives each
    micro-batch's loss, 1 / (micro-batches x accumulated batches)). The identity where no backward follows (no
    grad, a shape inference on meta tensors). ``values``: the weighted losses it started, detached, for the logged
    loss (a forward recomputed in the backward adds none)."""

    def __init__(self, scale: Callable[[], float]) -> None:
        self.scale = scale
        self.values: list[Tensor] = []

    def __call__(self, output: Tensor, aux_loss: Tensor) -> Tensor:
        if not torch.is_grad_enabled() or output.is_meta or not aux_loss.requires_grad:
            return output
        if counts_routing(output):
            self.values.append(aux_loss.detach())
        return _AuxLossInBackward.apply(output, aux_loss, float(self.scale()))


def apply_aux_loss_in_backward(module: nn.Module, scale: Callable[[], float]) -> dict[str, AuxLossInBackward]:
    """Give every layer of ``module`` that declares ``aux_loss_backward`` (a router layer, or any layer with an
    auxiliary loss of its own) an :class:`AuxLossInBackward` of ``scale``; they, by layer name."""
    given = {n: AuxLossInBackward(scale) for n, m in module.named_modules() if hasattr(m, AUX_LOSS_IN_BACKWARD)}
    for name, attached in given.items():
        setattr(module.get_submodule(name), AUX_LOSS_IN_BACKWARD, attached)
    return given


def started_aux_losses(given: dict[str, AuxLossInBackward], forwards: int) -> Tensor | None:
    """The sum over the layers of the mean of the last ``forwards`` weighted losses each started (a step's
    micro-batches), and forget them; None when none started any."""
    per_layer = [torch.stack(a.values[-forwards:]).float().mean() for a in given.values() if a.values]
    for attached in given.values():
        attached.values = []
    return torch.stack(per_layer).sum() if per_layer else None


def check_global_scope(layer: nn.Module) -> None:
    """Refuse a global scope that no strategy resolved while several processes train: each rank would compute a
    per-rank loss under the global name."""
    if (layer.router_statistics is None and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1):
        raise RuntimeError(
            f"{type(layer).__name__} has aux_loss_scope='global' but no strategy summed its router statistics over "
            "the data-parallel ranks (lightning_par's strategies do, in their setup): train it with a lightning_par "
            "strategy (ZeroStrategy, LayoutStrategy, ...) or use aux_loss_scope='micro_batch'.")


# ----------------------------------------------------------------------------------------------------------------------
# Tokens per expert, for the logs
# ----------------------------------------------------------------------------------------------------------------------
def counts_routing(tensor: Tensor) -> bool:
    """Whether a forward on ``tensor`` counts for the logs: not on meta tensors (a shape inference), not a forward
    that activation recompute runs again inside the backward (its tokens were counted the first time)."""
    return not tensor.is_meta and current_graph_task_id() == -1


def router_load(module: nn.Module, group: Any = None) -> dict[str, tuple[Tensor, Tensor]]:
    """Per router layer of ``module`` (by name): (tokens routed to each expert [E], dropped tokens []) since the last
    :func:`reset_router_load`, summed over ``group`` when given (a collective: every rank of it calls, for the same
    layers). Layers that routed nothing yet report zeros."""
    layers = {n: m for n, m in router_layers(module).items() if hasattr(m, "tokens_per_expert")}
    if not layers:
        return {}
    flat = torch.cat([torch.cat([_counts(m).double(), torch.as_tensor(m.dropped_tokens, dtype=torch.float64,
                                                                       device=_counts(m).device).reshape(1)])
                      for m in layers.values()])
    if group is not None:
        dist.all_reduce(flat, group=group)
    out, at = {}, 0
    for name, layer in layers.items():
        e = layer.num_experts
        out[name] = (flat[at:at + e], flat[at + e])
        at += e + 1
    return out


def _counts(layer: nn.Module) -> Tensor:
    counts = layer.tokens_per_expert
    if isinstance(counts, Tensor):
        return counts
    device = next((p.device for p in layer.parameters()), torch.device("cpu"))  # (NCCL: the layer's GPU)
    return torch.zeros(layer.num_experts, dtype=torch.int64, device=device)


def reset_router_load(module: nn.Module) -> None:
    for layer in router_layers(module).values():
        if hasattr(layer, "tokens_per_expert"):
            layer.tokens_per_expert, layer.dropped_tokens = None, 0


def load_metrics(load: dict[str, tuple[Tensor, Tensor]], per_expert: bool = True) -> dict[str, float]:
    """The logged scalars of :func:`router_load`'s figures, per layer ``L``: ``moe/L/max_over_mean`` (the busiest
    expert's tokens over the mean: 1 is balanced, E is everything on one expert), ``moe/L/dropped_fraction``
    (dropped over routed (token, choice) pairs), and with ``per_expert`` ``moe/L/tokens_expert_E`` (tokens
    routed to expert E)."""
    metrics: dict[str, float] = {}
    for name, (counts, dropped) in load.items():
        total = float(counts.sum())
        if total == 0:
            continue
        metrics[f"moe/{name}/max_over_mean"] = float(counts.max()) / (total / counts.numel())
        metrics[f"moe/{name}/dropped_fraction"] = float(dropped) / total
        if per_expert:
            metrics.update({f"moe/{name}/tokens_expert_{e}": float(c) for e, c in enumerate(counts.tolist())})
    return metrics
