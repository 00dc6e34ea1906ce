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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_par._compat import current_graph_task_id

#: the scopes of the load-balancing loss (see the module docstring)
AUX_LOSS_SCOPES = ("micro_batch", "global")
#: what a router layer declares to take part in the global scope and the logs
ROUTER_ATTRIBUTES = ("aux_loss_scope", "router_statistics")
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


def apply_router_statistics(module: nn.Module, group: Any, ranks: int) -> str | None:
    """Give every router layer of ``module`` whose scope is global the sum over the data-parallel ``group`` (of
    ``ranks`` ranks; dp x cp); a line for the log saying which scope each layer computes (None: no router)."""
    layers = router_layers(module)
    if not layers:
        return None
    for layer in layers.values():
        if layer.aux_loss_scope == "global":
            layer.router_statistics = SumOverRanks(group, ranks)
    return describe_routers(layers, ranks)


def describe_routers(layers: dict[str, nn.Module], ranks: int) -> str:
    """``router: ...``: the load-balancing loss's scope (or off) and the capacity of the router ``layers``."""
    said = {"micro_batch": "scope micro_batch (each rank's tokens of each micro-batch)",
            "global": f"scope global (statistics summed over the {ranks} data-parallel ranks of each micro-batch)"}
    scopes = sorted({said[m.aux_loss_scope] for m in layers.values() if getattr(m, "aux_loss_coef", 1)})
    capacities = sorted({str(getattr(m, "capacity_factor", None)) for m in layers.values()})
    return (f"router: {len(layers)} layers, load-balancing loss {' and '.join(scopes) or 'off (aux_loss_coef=0)'}, "
            f"{'dropless' if capacities == ['None'] else 'capacity factor ' + ', '.join(capacities)}")


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
    """Give every router layer of ``module`` that can take one an :class:`AuxLossInBackward` of ``scale``; they, by
    layer name."""
    given = {n: AuxLossInBackward(scale) for n, m in router_layers(module).items() if hasattr(m, AUX_LOSS_IN_BACKWARD)}
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
