"""Expert parallel: each mixture-of-experts layer's experts split over ``ep`` ranks, tokens sent to them and back.

The ``ep`` ranks of a group are data-parallel ranks (:func:`~lightning_par.topology.build_expert_mesh`): they hold
different tokens and the same non-expert weights, and split each layer's experts -- rank r keeps experts
``[r E/ep, (r+1) E/ep)``, the expert weights becoming DTensors ``Shard(0)`` over the ``ep`` mesh (a deferred model
materialises only that slice, :mod:`~lightning_par.parallel.materialize`; the global gradient norm counts each
expert once, :mod:`~lightning_par.parallel.grad_norm`). In the forward, every rank routes its own tokens exactly as
one process would, groups them by expert, and :class:`TokenExchange` sends each group to the rank holding its
expert (``all_to_all_single`` with the counts exchanged first: variable splits, nothing dropped), runs the local
experts there and sends the outputs back, with autograd through both exchanges; the layer then combines them with
its routing weights. This is Megatron-Core's all-to-all token dispatcher and torchtitan's expert parallel.

A layer takes part by declaring (the example :class:`~lightning_par.examples.moe.MoEFeedForward`):

* ``num_experts`` and ``expert_parameters``: the names of its parameters stacked over the experts on dimension 0;
* ``experts(tokens, counts)``: the experts it holds on tokens grouped by expert (``counts`` per held expert);
* ``token_exchange``: None, or what this transform sets, called as ``token_exchange(tokens, counts, experts)``
  with tokens grouped by global expert.

Gradients: a rank's expert gradient sums what the tokens of its whole ep group contributed;
:class:`ExpertGradients` (run by :func:`~lightning_par.parallel.finalize.finalize`, after the data-parallel owner)
sums it over the ranks holding the same experts (``expert_dp``) and divides by dp x cp, so it is the average over
every data-parallel rank's loss, as the non-expert gradients are. That is at ZeRO-0; at ZeRO 1-3 the data-parallel
owner shards the experts over ``expert_dp`` and does the same reduction itself (a second ZeRO-1/2 partitioner, or
FSDP2 groups on ``expert_dp``: :mod:`~lightning_par.parallel.gradient_sync`). Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_par._compat import all_to_all_single_autograd, foreach_mul_
from lightning_par.parallel.experts_ep import declare_planned_experts, resolve_ep_plan
from lightning_par.topology import LayoutError

#: what a layer declares to take part (see the module docstring)
EXPERT_LAYER_ATTRIBUTES = ("num_experts", "expert_parameters", "experts", "token_exchange")


def expert_layers(module: nn.Module) -> dict[str, nn.Module]:
    """The modules inside ``module`` that declare experts, by name."""
    return {name: m for name, m in module.named_modules()
            if all(hasattr(m, attribute) for attribute in EXPERT_LAYER_ATTRIBUTES)}


@dataclass(frozen=True)
class MoELayer:
    """A mixture-of-experts layer as the planner and the MFU count it: its experts, the experts a token uses, and
    its parameters stacked over the experts."""

    num_experts: int
    top_k: int
    parameters: tuple[str, ...]


def moe_layers(module: nn.Module) -> dict[str, MoELayer]:
    """Every mixture-of-experts layer inside ``module``, by name: those declaring the interface (the example's, or a
    Hugging Face experts module expert parallel declared) and those a Hugging Face model's ``base_model_ep_plan``
    plans (not declared: no ep, or not yet). Shapes only."""
    found = {name: MoELayer(layer.num_experts, experts_per_token(layer, module), tuple(layer.expert_parameters))
             for name, layer in expert_layers(module).items()}
    for name, stacked in resolve_ep_plan(module).items():
        if name not in found:
            layer = module.get_submodule(name)
            found[name] = MoELayer(layer.num_experts, experts_per_token(layer, module), tuple(stacked))
    return found


def experts_per_token(layer: nn.Module, root: nn.Module) -> int:
    """The layer's ``top_k`` (or ``num_experts_per_tok``), else its config's, else the first one of ``root``'s
    modules' configs (a Hugging Face experts module keeps none itself)."""
    configs = (getattr(m, "config", None) for m in root.modules())
    for holder in (layer, getattr(layer, "config", None), *configs):
        for name in ("top_k", "num_experts_per_tok"):
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    raise LayoutError(f"{type(layer).__name__} has experts but no top_k (or num_experts_per_tok), nor a config "
                      "saying it: the experts each token uses must be known to count the active parameters.")


def check_expert_parallel(module: nn.Module, ep: int, part: bool = False) -> dict[str, nn.Module]:
    """The expert layers of ``module``, or a :class:`LayoutError` naming the layer and the fix when ``ep`` cannot
    split them: no expert layer at all, experts not divisible by ``ep``, a declared parameter that is not stacked over
    the experts. Arithmetic on shapes only (meta tensors too): every rank refuses alike, before any collective.
    ``part``: ``module`` is a pipeline rank's part, whose stages may hold no expert layer (the whole model was
    checked before the split)."""
    layers = expert_layers(module)
    if not layers and not part:
        raise LayoutError(f"ep={ep} but {_no_expert_layers(module)}")
    check_experts_per_token(module)
    for name, layer in layers.items():
        experts = layer.num_experts
        if experts % ep:
            allowed = [n for n in range(1, experts + 1) if experts % n == 0]
            raise LayoutError(f"{name} has {experts} experts, which ep={ep} does not divide: every ep rank holds "
                              f"the same number of them. Use ep in {allowed}.")
        for pname in layer.expert_parameters:
            param = getattr(layer, pname, None)
            if not isinstance(param, nn.Parameter) or param.dim() == 0 or param.shape[0] != experts:
                shape = tuple(param.shape) if isinstance(param, Tensor) else type(param).__name__
                raise LayoutError(f"{name}.{pname} is declared in expert_parameters but is not a parameter stacked "
                                  f"over the {experts} experts on dimension 0 (it is {shape}): list only those.")
    return layers


#: where the interface is shown: its stacked weights and the methods around them
EXPERTS_EXAMPLE = ("the README's 'Mixture of experts' (class MoE) or lightning_par/examples/moe.py (MoEFeedForward), "
                   "docs/moe.md")


def _no_expert_layers(module: nn.Module) -> str:
    """Why ``module`` has no expert layer expert parallel can split, naming the module that looks like one: experts
    kept as an ``nn.ModuleList`` (the weights must be stacked), or an interface declared in part."""
    root = type(module).__name__
    for name, layer in module.named_modules():
        missing = [a for a in EXPERT_LAYER_ATTRIBUTES if not hasattr(layer, a)]
        if missing and any(hasattr(layer, a) for a in ("expert_parameters", "token_exchange")):
            return (f"{name or root} ({type(layer).__name__}) declares part of the expert layer interface, without "
                    f"{', '.join(missing)}: expert parallel needs all of {', '.join(EXPERT_LAYER_ATTRIBUTES)} (see "
                    f"{EXPERTS_EXAMPLE}), or use ep=1.")
        for child_name, child in layer.named_children():
            items = list(child.children()) if isinstance(child, nn.ModuleList) else []
            looks_like_experts = "expert" in child_name.lower() or any(
                hasattr(layer, a) for a in ("num_experts", "n_experts", "num_local_experts", "top_k"))
            if (len(items) > 1 and looks_like_experts and len({type(i) for i in items}) == 1
                    and any(True for _ in items[0].parameters())):
                where = f"{name}.{child_name}" if name else child_name
                stacked = ", ".join(f"{n.replace('.', '_')} {[len(items), *p.shape]}"
                                    for n, p in items[0].named_parameters())
                return (f"{where} ({type(layer).__name__}) keeps its {len(items)} experts as an nn.ModuleList of "
                        f"{type(items[0]).__name__}, which expert parallel cannot split: it splits expert weights "
                        f"stacked over the experts on dimension 0, one nn.Parameter per weight ({stacked}), in a "
                        f"layer declaring {', '.join(EXPERT_LAYER_ATTRIBUTES)} (expert_parameters: the stacked "
                        f"weights' names). Stack them as {EXPERTS_EXAMPLE} show, or use ep=1.")
    return (f"{root} has no expert layers: expert parallel splits mixture-of-experts layers whose expert weights are "
            "stacked over the experts on dimension 0, found by the attributes "
            f"{', '.join(EXPERT_LAYER_ATTRIBUTES)} ({EXPERTS_EXAMPLE}) or by a Hugging Face model's ep plan "
            "('ep_dispatch_experts', lightning_par.parallel.experts_ep). Use ep=1 for a dense model.")


def check_experts_per_token(module: nn.Module) -> None:
    """A :class:`LayoutError` naming the layer where a token would be routed to more experts than the layer has
    (``top_k`` or ``num_experts_per_tok`` over ``num_experts``; a Hugging Face config's too): ``torch.topk`` would
    fail at the first step. Attributes only: every rank refuses alike, before any collective."""
    def count(holder: object, names: tuple[str, ...]) -> int | None:
        for attribute in names:
            value = getattr(holder, attribute, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        return None

    seen: set[int] = set()
    for name, layer in module.named_modules():
        where = f"{name or type(module).__name__} ({type(layer).__name__})"
        holders = [(layer, where, ("top_k", "num_experts_per_tok"))] \
            if all(hasattr(layer, a) for a in EXPERT_LAYER_ATTRIBUTES) else []
        config = getattr(layer, "config", None)
        if config is not None and not isinstance(config, dict) and id(config) not in seen:
            seen.add(id(config))  # (a config's top_k was a generation setting in older transformers)
            holders.append((config, f"{where}.config", ("num_experts_per_tok",)))
        for holder, said, names in holders:
            top_k = count(holder, names)
            experts = count(holder, ("num_experts", "num_local_experts", "n_routed_experts"))
            if top_k is not None and experts is not None and 0 < experts < top_k:
                raise LayoutError(f"{said}: top_k={top_k} is larger than its {experts} experts (each token is routed "
                                  f"to top_k different experts). Use top_k <= {experts}.")


def prepare_expert_parallel(module: nn.Module, ep: int, part: bool = False) -> dict[str, nn.Module]:
    """A Hugging Face model's experts declared from its own ep plan
    (:func:`~lightning_par.parallel.experts_ep.declare_planned_experts`), then :func:`check_expert_parallel`. Under
    pp it runs on the whole model before the split (the stages are copies of the model: each copy of a declared
    experts module keeps the interface, its forward bound to the copy) and again on the rank's part."""
    declare_planned_experts(module)
    return check_expert_parallel(module, ep, part)


class TokenExchange:
    """A layer's ``token_exchange`` under expert parallel: tokens grouped by global expert to the ranks holding
    them, the local experts run there, outputs back in the tokens' order; differentiable."""

    def __init__(self, mesh: DeviceMesh, num_experts: int) -> None:
        self.group = mesh.get_group()
        self.ranks = mesh.size()
        self.local_experts = num_experts // self.ranks

    def __call__(self, tokens: Tensor, counts: list[int], experts: Callable[[Tensor, list[int]], Tensor]) -> Tensor:
        ranks, local = self.ranks, self.local_experts
        # the counts first: how many tokens each rank sends this rank for each of its experts ([source, expert])
        sent = torch.tensor(counts, dtype=torch.int64, device=tokens.device)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=self.group)
        by_source = received.view(ranks, local).tolist()
        send_splits = sent.view(ranks, local).sum(dim=1).tolist()
        recv_splits = [sum(row) for row in by_source]
        # (each result waits for its collective when first used)
        arrived = all_to_all_single_autograd(tokens, recv_splits, send_splits, self.group)
        # arrived in (source, expert) order; the experts take them in (expert, source) order
        order = _regroup(by_source, tokens.device)
        out = experts(arrived[order], [sum(row[i] for row in by_source) for i in range(local)])
        back = out[torch.argsort(order)]
        return all_to_all_single_autograd(back, send_splits, recv_splits, self.group)


def _regroup(counts: list[list[int]], device: torch.device) -> Tensor:
    """The row order that turns blocks laid out ``[source][expert]`` (``counts[s][e]`` rows each) into
    ``[expert][source]``."""
    starts, at = [], 0
    for row in counts:
        starts.append([])
        for n in row:
            starts[-1].append(at)
            at += n
    pieces = [torch.arange(starts[s][e], starts[s][e] + counts[s][e], device=device)
              for e in range(len(counts[0])) for s in range(len(counts))]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)


@dataclass
class ExpertParallel:
    """What :func:`apply_expert_parallel` did: the layers, their expert parameters (DTensors split over ``ep``)."""

    layers: dict[str, nn.Module]
    parameters: list[nn.Parameter]
    mesh: DeviceMesh  # the expert mesh (topology.build_expert_mesh)

    def describe(self) -> str:
        local = sum(p.to_local().numel() for p in self.parameters)
        total = sum(p.numel() for p in self.parameters)
        return (f"expert parallel over ep={self.mesh['ep'].size()}: {len(self.layers)} expert layers, "
                f"{local}/{total} expert parameters on each rank, tokens exchanged by all_to_all, expert gradients "
                f"averaged over expert_dp={self.mesh['expert_dp'].size()}")


def apply_expert_parallel(module: nn.Module, mesh: DeviceMesh) -> ExpertParallel:
    """Split every expert layer of ``module`` over ``mesh["ep"]`` in place (meta tensors too: the slice is then
    what a deferred model materialises) and set its ``token_exchange``."""
    ep_mesh = mesh["ep"]
    layers = check_expert_parallel(module, ep_mesh.size(), part=True)  # (the caller checked the model)
    rank, params = ep_mesh.get_local_rank(), []
    for layer in layers.values():
        held = layer.num_experts // ep_mesh.size()
        for pname in layer.expert_parameters:
            full = getattr(layer, pname)
            # under tensor parallel a weight outside the plan is already replicated over tp: split over (ep, tp)
            on_tp = isinstance(full, DTensor)
            whole = full.to_local() if on_tp else full
            piece = whole.detach()[rank * held:(rank + 1) * held].clone()
            split = DTensor.from_local(piece, mesh["ep", "tp"] if on_tp else ep_mesh,
                                       [Shard(0), Replicate()] if on_tp else [Shard(0)], run_check=False,
                                       shape=full.shape, stride=full.stride())
            param = nn.Parameter(split, requires_grad=full.requires_grad)
            setattr(layer, pname, param)
            params.append(param)
        layer.token_exchange = TokenExchange(ep_mesh, layer.num_experts)
    return ExpertParallel(layers=layers, parameters=params, mesh=mesh)


class ExpertGradients:
    """The expert weights' share of :func:`~lightning_par.parallel.finalize.finalize`: each expert gradient summed
    over the ranks holding that expert (``expert_dp``) and divided by the data-parallel ranks (dp x cp), in one
    flat all-reduce; the data-parallel owner leaves these parameters out (at ZeRO 1-3 it shards and reduces them
    over ``expert_dp`` itself, ``NoSync.shards_experts``, and ``finish`` is not called). ``mesh``: the expert mesh;
    ``data_parallel``: dp x cp, the divisor."""

    def __init__(self, experts: ExpertParallel, data_parallel: int) -> None:
        self.parameters = experts.parameters
        self.mesh, self.data_parallel = experts.mesh, data_parallel
        replicas = experts.mesh["expert_dp"]
        self.group = replicas.get_group() if replicas.size() > 1 else None
        self.scale = 1.0 / data_parallel

    def finish(self) -> None:
        grads = [p.grad.to_local() for p in self.parameters if p.grad is not None]
        if not grads:
            return
        if self.group is None:
            foreach_mul_(grads, self.scale)
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat.mul_(self.scale)
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))
