"""Tensor parallelism inside a mixture-of-experts layer: Hugging Face's ``moe_tp_experts`` style, with DTensor.

A ``transformers`` MoE model (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3) keeps all its experts in one module
whose parameters are 3-D, ``[experts, out, in]``: ``gate_up_proj`` (gate|up fused, ``[E, 2I, H]``) and ``down_proj``
(``[E, H, I]``). Its published plan splits the experts like a Megatron MLP, each expert's intermediate features over
the tp ranks, with entries that name those parameters::

    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",  # each rank: its slice of gate and its slice of up
    "layers.*.mlp.experts.down_proj": "rowwise",            # ... and the matching input columns of down
    "layers.*.mlp.experts": "moe_tp_experts",               # the module: run on the slices, sum the outputs

Every rank routes every token (the router is replicated; tp does not split tokens), runs its slice of each chosen
expert, and the ranks' partial outputs are summed once per layer: the one-process function. Backward needs two sums,
both placed by DTensor (``from_local(Replicate) -> to_local(grad_placements=Partial)``, Megatron's "f"): the input
gradient (each rank's covers its slices) and the gradient of the routing weights, which multiply each rank's partial
output. The router then gets the whole gradient on every rank, alike, and stays a plain replica.

:func:`tensor_parallel.resolve_tp_plan <lightning_par.parallel.tensor_parallel.resolve_tp_plan>` folds the parameter
entries into the module's style (``"moe_tp_experts:gate_up_proj=packed_colwise,down_proj=rowwise"``), checks them
with :func:`check_experts` before any collective, and :class:`ExpertsTensorParallel` applies them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from lightning_par._compat import StridedShard
from lightning_par.topology import LayoutError

#: the module style (Hugging Face's name)
EXPERTS_STYLE = "moe_tp_experts"
#: the styles an expert parameter may have inside it: [E, out, in] split over out (packed: each of N parts) or in
EXPERT_PARAMETER_STYLES = ("packed_colwise", "colwise", "rowwise")
#: names under which an experts forward takes the routing weights, besides the third positional argument
_WEIGHT_ARGUMENTS = ("top_k_weights", "routing_weights", "topk_weights")


def encode(splits: dict[str, str]) -> str:
    """The resolved style of an experts module: its parameters' styles in its arguments."""
    return f"{EXPERTS_STYLE}:" + ",".join(f"{name}={style}" for name, style in splits.items())


def decode(style: str) -> dict[str, str]:
    """``{parameter: style}`` of a resolved ``moe_tp_experts:...`` style (see :func:`encode`)."""
    _, _, args = style.partition(":")
    return dict(arg.split("=", 1) for arg in args.split(",") if arg)


def placement(style: str) -> Placement:
    """Where a ``[E, out, in]`` expert parameter planned ``style`` keeps its slice on a tp rank."""
    kind, _, parts = style.partition(":")
    if kind == "packed_colwise":
        return StridedShard(1, split_factor=int(parts) if parts else 2)  # its slice of each of the parts
    return Shard(1) if kind == "colwise" else Shard(2)


def check_experts(where: str, module: nn.Module, splits: dict[str, str], tp: int) -> None:
    """Refuse, before any collective, an experts module that ``moe_tp_experts`` cannot split exactly: a parameter
    without a split (the summed outputs would count it tp times), one that is not ``[experts, out, in]``, a size tp
    does not divide, weights stored transposed or gate/up interleaved, a forward without routing weights."""
    module_where = f"{where} ({type(module).__name__})"
    fix = (f"Plan every parameter of it ({', '.join(f'{n!r}' for n, _ in module.named_parameters())}) with one of "
           f"{', '.join(EXPERT_PARAMETER_STYLES)}, or remove its '{EXPERTS_STYLE}' entry (the experts then stay "
           "whole on every tp rank).")
    unplanned = [name for name, _ in module.named_parameters() if name not in splits]
    if unplanned:
        raise LayoutError(
            f"{module_where} is planned '{EXPERTS_STYLE}', which sums the tp ranks' partial expert outputs, but its "
            f"{unplanned[0]!r} has no split in the plan (it would be counted {tp} times). {fix}")
    layout = ("transposed" if getattr(module, "is_transposed", False) else
              "with gate and up interleaved" if getattr(module, "is_concatenated", True) is False else None)
    if layout:
        raise LayoutError(
            f"{module_where} stores its expert weights {layout}, which '{EXPERTS_STYLE}' does not split (it splits "
            "[experts, out, in] weights with gate|up concatenated). Remove its entries from the tp plan: the experts "
            "then stay whole on every tp rank.")
    for name, style in splits.items():
        param = module.get_parameter(name)
        kind, _, parts = style.partition(":")
        if kind not in EXPERT_PARAMETER_STYLES:
            raise LayoutError(f"{where}.{name} is planned {style!r}, which lightning-par does not apply to an expert "
                              f"parameter: use one of {', '.join(EXPERT_PARAMETER_STYLES)}.")
        if param.dim() != 3:
            raise LayoutError(
                f"{where}.{name} has shape {tuple(param.shape)}, but '{EXPERTS_STYLE}' splits expert parameters of "
                f"shape [experts, out, in]. {fix}")
        dim = 2 if kind == "rowwise" else 1
        n_parts = int(parts or 2) if kind == "packed_colwise" else 1
        if param.shape[dim] % (n_parts * tp):
            raise LayoutError(
                f"{where}.{name}: dimension {dim} is {param.shape[dim]}, which {style!r} cannot cut into "
                f"{n_parts * tp} equal slices ({f'{n_parts} parts x ' if n_parts > 1 else ''}tp={tp}). Use a tp that "
                "divides the experts' intermediate size (config.moe_intermediate_size or intermediate_size).")
    if _weights_position(module) is None:
        raise LayoutError(
            f"{module_where}: its forward takes no routing weights (forward(hidden_states, top_k_index, "
            f"top_k_weights) expected), which '{EXPERTS_STYLE}' needs: they multiply each rank's partial output, so "
            "their gradient is summed over tp. Remove its entries from the tp plan.")


def sample_inputs(module: nn.Module, splits: dict[str, str], generator: torch.Generator,
                  tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A test input for an experts module: hidden states, each token's top-2 experts (distinct) and their weights,
    drawn from ``generator``, on the module's device."""
    weight = module.get_parameter(next(iter(splits)))
    n_experts, width = weight.shape[0], weight.shape[2]  # [experts, out, in] (gate|up's in: the hidden size)
    top_k = min(2, n_experts)
    hidden = torch.randn(tokens, width, generator=generator)
    index = torch.rand(tokens, n_experts, generator=generator).argsort(dim=-1)[:, :top_k]
    weights = torch.rand(tokens, top_k, generator=generator)
    return hidden.to(weight.device), index.to(weight.device), weights.to(weight.device)


def _weights_position(module: nn.Module) -> int | str | None:
    """Where the experts forward takes its routing weights: positional index 2, or a keyword of that name."""
    try:
        names = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return None
    if len(names) >= 3 and "weight" in names[2]:
        return 2
    return next((n for n in _WEIGHT_ARGUMENTS if n in names), None)


def _sum_gradient(tensor: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; backward: the gradient summed over tp (each rank's covers its slices of the experts)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _sum_output(partial: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The tp ranks' partial outputs summed (all-reduce); backward: the whole gradient, as it is, on every rank."""
    return DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()


class ExpertsTensorParallel(ParallelStyle):
    """``moe_tp_experts``: each expert's intermediate features split over the tp ranks (see the module docstring).

    ``splits``: ``{parameter: style}``, a style of :data:`EXPERT_PARAMETER_STYLES` for every parameter of the
    module. The parameters become DTensors (``_StridedShard(1, 2)`` for gate|up: ``full_tensor()``, the gradient norm,
    checkpoints and the deferred build see the one-process tensor); the module's own forward runs on their local
    slices, whichever kernel transformers picks for it (eager loop, grouped or batched matmul).
    """

    def __init__(self, splits: dict[str, str]) -> None:
        super().__init__()
        self.splits = splits

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, style in self.splits.items():
            param = module.get_parameter(name)
            split = distribute_tensor(param.detach(), device_mesh, [placement(style)],
                                      src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        weights_at = _weights_position(module)
        swapped: list[dict[str, Any]] = []

        def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            args = (_sum_gradient(args[0], device_mesh), *args[1:])
            if isinstance(weights_at, int) and len(args) > weights_at:
                args = (*args[:weights_at], _sum_gradient(args[weights_at], device_mesh), *args[weights_at + 1:])
            else:
                key = weights_at if isinstance(weights_at, str) else "top_k_weights"
                kwargs = {**kwargs, key: _sum_gradient(kwargs[key], device_mesh)}
            originals = {n: p for n, p in mod._parameters.items() if isinstance(p, DTensor)}
            swapped.append(originals)
            for n, p in originals.items():
                mod._parameters[n] = p.to_local()  # type: ignore[assignment]
            return args, kwargs

        def after(mod: nn.Module, _args: tuple, _kwargs: dict, output: torch.Tensor) -> torch.Tensor:
            mod._parameters.update(swapped.pop())
            return _sum_output(output, device_mesh)

        module.register_forward_pre_hook(before, with_kwargs=True)
        module.register_forward_hook(after, with_kwargs=True)
        return module
