"""Expert parallelism inside a Hugging Face mixture-of-experts layer, from the model's own ``base_model_ep_plan``.

A ``transformers`` MoE model (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, gpt-oss) keeps a layer's experts in
one module whose parameters are stacked over the experts on dimension 0 (``gate_up_proj``, ``down_proj``, gpt-oss's
biases too), called by the layer as ``experts(hidden_states, top_k_index, top_k_weights)`` after the layer's own
router chose each token's experts. Its published plan says how expert parallelism splits it::

    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",   # a parameter stacked over the experts: split on dim 0
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts": "ep_dispatch_experts",         # the module: tokens to their experts' ranks and back

lightning-par applies it with its own expert parallel (:mod:`~lightning_par.parallel.expert_parallel`), whose ep
ranks hold different tokens: :func:`declare_planned_experts` gives each planned experts module the interface
:func:`~lightning_par.parallel.expert_parallel.apply_expert_parallel` splits (``num_experts``, ``expert_parameters``,
``experts(tokens, counts)``, ``token_exchange``) and a forward that groups this rank's (token, choice) pairs by
expert, sends them with the :class:`~lightning_par.parallel.expert_parallel.TokenExchange`, runs the module's own
kernel (whichever transformers picked: eager loop, grouped or batched matmul) on the local experts with routing
weights of one, and combines the outputs with the routing weights as the model's grouped kernel does (a weighted sum
over each token's choices). Routing, the load-balancing loss and the shared experts are the model's own code, run on
this rank's tokens: the one-process function of them.

Styles applied: ``ep_dispatch_experts`` (a module) and ``grouped_gemm`` (its parameters); a published plan's
``colwise``/``rowwise`` entries on dense layers (:data:`DENSE_TP_STYLES`) are left out; any other is refused at
setup, as is an experts module whose parameters are not all planned and stacked over its experts. A published plan's
pattern that matches nothing is skipped (transformers does too); a user's own ``ep_plan`` on a plain module is strict.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.parallel.experts_tp import _weights_position
from lightning_par.parallel.plans import find_plan, is_hf_model, pattern_regex
from lightning_par.topology import LayoutError

#: the module style and the parameter style of a published ep plan (Hugging Face's names)
DISPATCH_STYLE = "ep_dispatch_experts"
STACKED_STYLE = "grouped_gemm"
EP_STYLES = (DISPATCH_STYLE, STACKED_STYLE)
#: styles of a published ep plan left out on purpose: tensor-parallel splits of dense layers over the ep ranks
#: (Gemma-4's MLP beside its experts). Here the ep ranks hold different tokens, so a dense layer is one more
#: data-parallel replica -- the same function, its parameters whole on each rank
DENSE_TP_STYLES = ("colwise", "rowwise")
#: transformers up to 5.1x (5.17 tested) named its ep plan's styles after its own all-tokens-on-every-rank expert
#: parallel: the experts module ``moe_tp_experts`` (read as :data:`DISPATCH_STYLE`: the same module, the same
#: function) and the router ``ep_router`` (its outputs cut to each rank's experts), which lightning-par leaves out:
#: its ep ranks hold different tokens, and the model's own router runs on them unchanged
EP_ALIASES = {"moe_tp_experts": DISPATCH_STYLE}
ROUTER_STYLES = ("ep_router",)
#: published ep styles refused by name, with why
REFUSED_EP_STYLES = {
    "all_reduce": (
        "it sums a module's output over the ep ranks, which is right where every ep rank holds every token "
        "(transformers 5.17's expert parallel); lightning-par's ep ranks hold different tokens"),
    "replicated_with_grad_allreduce": (
        "it keeps a parameter of the experts module whole on every ep rank (a norm after the experts) with its "
        "gradient summed over them; lightning-par's expert parallel splits every parameter of an experts module "
        "over the experts and has no such replicated one yet"),
}


def resolve_ep_plan(module: nn.Module) -> dict[str, tuple[str, ...]]:
    """``{experts module FQN (relative to module): its parameters split over the experts}`` from the declared ep
    plan (empty without one), or a :class:`LayoutError` naming the module, the style and the fix for what cannot be
    applied exactly. Shapes only (meta tensors too): every rank refuses alike, before any collective (how many
    experts ep divides: :func:`~lightning_par.parallel.expert_parallel.check_expert_parallel`)."""
    found = find_plan(module, "ep")
    if found is None:
        return {}
    root, model, plan = found
    prefix, model_name, strict = f"{root}." if root else "", type(model).__name__, not is_hf_model(model)
    modules = [name for name, _ in model.named_modules() if name]
    params = [name for name, _ in model.named_parameters()]
    dispatch: list[str] = []
    stacked: dict[str, list[str]] = {}
    for pattern, style in plan.items():
        if style in DENSE_TP_STYLES + ROUTER_STYLES and not strict:
            continue
        style = EP_ALIASES.get(style, style) if not strict else style
        if style in REFUSED_EP_STYLES:
            raise LayoutError(f"{model_name}.ep_plan[{pattern!r}] = {style!r} is not applied by lightning-par: "
                              f"{REFUSED_EP_STYLES[style]}. Train {model_name} with ep=1 (its experts then whole on "
                              "every rank, or sharded by ZeRO).")
        if style not in EP_STYLES:
            raise LayoutError(
                f"{model_name}.ep_plan[{pattern!r}] = {style!r} is not a style lightning-par's expert parallel "
                f"applies; it applies {DISPATCH_STYLE!r} (an experts module: tokens sent to the ranks holding their "
                f"experts) and {STACKED_STYLE!r} (that module's parameters stacked over the experts). Remove the "
                "entry, or train with ep=1.")
        regex = pattern_regex(pattern)
        names = [n for n in (modules if style == DISPATCH_STYLE else params) if regex.fullmatch(n)]
        if not names and strict:
            raise LayoutError(f"{model_name}.ep_plan names {pattern!r} ({style!r}), but {model_name} has no "
                              f"{'module' if style == DISPATCH_STYLE else 'parameter'} of that name (\"*\" matches "
                              "one name component). Fix the pattern or remove it from the plan.")
        for name in names:
            if style == DISPATCH_STYLE:
                dispatch.append(name)
            else:
                owner, _, param = name.rpartition(".")
                stacked.setdefault(owner, []).append(param)
    for owner, names in stacked.items():
        if owner not in dispatch:
            raise LayoutError(
                f"{model_name}.ep_plan splits {owner}.{names[0]} ({STACKED_STYLE!r}), but its module {owner} is not "
                f"planned {DISPATCH_STYLE!r}: lightning-par splits stacked expert parameters only inside the experts "
                f"module that dispatches the tokens. Plan {owner} {DISPATCH_STYLE!r}, or remove the entry.")
    resolved = {}
    for name in dispatch:
        experts = model.get_submodule(name)
        _check_experts(f"{model_name}.{name}", experts, tuple(stacked.get(name, ())))
        resolved[f"{prefix}{name}"] = tuple(p for p, _ in experts.named_parameters() if p in stacked.get(name, ()))
    return resolved


def _check_experts(where: str, module: nn.Module, planned: tuple[str, ...]) -> None:
    kind = f"{where} ({type(module).__name__})"
    experts = getattr(module, "num_experts", None)
    if not isinstance(experts, int) or experts < 1:
        raise LayoutError(f"{kind} is planned {DISPATCH_STYLE!r}, but it has no `num_experts` (an int): expert "
                          "parallel needs how many experts it stacks. Remove its entries from the ep plan.")
    for pname, param in module.named_parameters():
        if pname not in planned:
            raise LayoutError(
                f"{kind} is planned {DISPATCH_STYLE!r}, but its parameter {pname!r} has no {STACKED_STYLE!r} entry: "
                f"every parameter of an experts module is indexed by expert, so each must be split over the ep "
                f"ranks. Plan {where}.{pname} {STACKED_STYLE!r}, or train with ep=1.")
        if param.dim() == 0 or param.shape[0] != experts:
            raise LayoutError(f"{where}.{pname} is planned {STACKED_STYLE!r} but its shape is {tuple(param.shape)}, "
                              f"not stacked over the {experts} experts on dimension 0: remove it from the ep plan.")
    if _weights_position(module) is None:
        raise LayoutError(f"{kind}: its forward takes no routing weights (forward(hidden_states, top_k_index, "
                          f"top_k_weights) expected), which {DISPATCH_STYLE!r} combines the experts' outputs with. "
                          "Remove its entries from the ep plan, or train with ep=1.")


def declare_planned_experts(module: nn.Module) -> dict[str, nn.Module]:
    """Give every experts module the ep plan of ``module`` places the interface of
    :mod:`~lightning_par.parallel.expert_parallel` (in place, before :func:`apply_expert_parallel` splits it); the
    modules, by name. Nothing collective: call it on every rank before the first collective."""
    declared = {}
    for name, stacked in resolve_ep_plan(module).items():
        experts = module.get_submodule(name)
        if getattr(experts, "token_exchange", None) is not None or "expert_parameters" in vars(experts):
            declared[name] = experts  # (declared already: a second setup of the same model)
            continue
        kernel = experts.forward  # the module's own forward (transformers' chosen experts implementation)
        experts.expert_parameters = stacked
        experts.token_exchange = None
        experts.experts = partial(_local_experts, experts, kernel)
        signature = inspect.signature(kernel)
        experts.forward = partial(_dispatch, experts, kernel, signature, _weights_position(experts))
        experts.forward.__signature__ = signature  # (what the checks read, as before)
        declared[name] = experts
    return declared


@contextmanager
def _held_experts(module: nn.Module, held: int) -> Iterator[None]:
    """The module's own kernel sees the experts this rank holds: the local slices of its DTensor parameters (the
    gradient flows back to them) and ``num_experts`` = how many it holds."""
    originals = {n: p for n, p in module._parameters.items() if isinstance(p, DTensor)}
    experts = module.num_experts
    for n, p in originals.items():
        module._parameters[n] = p.to_local()  # type: ignore[assignment]
    module.num_experts = held
    try:
        yield
    finally:
        module._parameters.update(originals)
        module.num_experts = experts


def _local_experts(module: nn.Module, kernel: Callable[..., torch.Tensor], tokens: torch.Tensor,
                   counts: list[int]) -> torch.Tensor:
    """``experts(tokens, counts)``: the module's kernel on tokens grouped by the experts this rank holds, each row
    its own choice, weight 1 (the routing weights are applied where the tokens came from)."""
    held = len(counts)
    index = torch.repeat_interleave(torch.arange(held, device=tokens.device),
                                    torch.tensor(counts, device=tokens.device)).unsqueeze(1)
    with _held_experts(module, held):
        return kernel(tokens, index, torch.ones(index.shape, dtype=tokens.dtype, device=tokens.device))


def _dispatch(module: nn.Module, kernel: Callable[..., torch.Tensor], signature: inspect.Signature,
              weights_at: int | str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The experts module's forward under ``ep_dispatch_experts``: this rank's (token, choice) pairs grouped by
    expert, through the token exchange, weighted and summed over each token's choices."""
    if module.token_exchange is None:  # (declared, not split: one process's forward)
        return kernel(*args, **kwargs)
    names, bound = list(signature.parameters), signature.bind(*args, **kwargs).arguments
    hidden, index = bound[names[0]], bound[names[1]]
    weights = bound[names[weights_at] if isinstance(weights_at, int) else weights_at]
    tokens, top_k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the tokens' order kept within an expert
    counts = torch.bincount(flat, minlength=module.num_experts).tolist()
    out = module.token_exchange(hidden[order // top_k], counts, module.experts)
    choices = torch.empty_like(out).index_copy_(0, order, out).view(tokens, top_k, -1)
    return (choices * weights.unsqueeze(-1).to(choices.dtype)).sum(dim=1).to(hidden.dtype)
