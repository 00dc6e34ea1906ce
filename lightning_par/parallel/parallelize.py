"""Apply a layout to this rank's part of the model: one fixed order for every layout.

A rank's part (:class:`~lightning_par.parallel.parts.ModelParts`, from :func:`~lightning_par.parallel.parts.split`)
is the whole model without pipeline parallelism, or the rank module holding its pipeline stages; the pipeline
runtime is built afterwards, around the transformed stage modules. The order is torchtitan's (``parallelize_llama``),
the same for every layout::

    replicas identical -> tensor parallel -> expert parallel -> context parallel -> recompute -> (compile)
    -> data-parallel sharding -> materialise share

Two ways in, one order:

* a model built under :func:`~lightning_par.parallel.deferred_init.deferred_init` (the strategy does this around
  ``configure_model`` whenever the layout splits parameters: ZeRO-3, tp or pp) holds its large tensors on the meta
  device, and every rank holds global rank 0's construction (its random draws and its small tensors), so its
  replicas are identical already. Every transform then runs on meta and only describes this rank's share; the last step
  (:func:`~lightning_par.parallel.materialize.materialize_share`) allocates exactly that share and fills it with the
  single-process values, a tensor at a time. No rank ever holds more than its share plus one tensor.
* a model built eagerly (in ``__init__``, or handed over whole) is moved to the device first and its replicas are
  made identical by a broadcast; the transforms then cut what exists.

Expert parallel (ep > 1) splits the expert layers' stacked weights over the ep ranks and sets their token exchange
(:mod:`~lightning_par.parallel.expert_parallel`; a Hugging Face model's experts modules declared so from its own ep
plan first, :mod:`~lightning_par.parallel.experts_ep`, and left out of its tp plan); a model that cannot take it
is refused first, before the replicas' broadcast, on every rank alike. Context parallel (cp > 1) comes next, right
after tensor parallel as torchtitan applies it to the attention: it hooks the modules that run the model (so
recompute and compile wrap the blocks inside them) and returns the context the step enters around forward and
backward (:mod:`~lightning_par.parallel.context_parallel`).

Pretrained weights (``pretrained``) are read into the share right after it is allocated; their random
initialisation is never computed. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par.parallel.compile import BlockCompiler
from lightning_par.parallel.context_parallel import ContextParallel, apply_context_parallel, recompute_contexts
from lightning_par.parallel.deferred_init import DeferredInit
from lightning_par.parallel.expert_parallel import (
    ExpertParallel,
    apply_expert_parallel,
    check_experts_per_token,
    prepare_expert_parallel,
)
from lightning_par.parallel.materialize import materialize_share
from lightning_par.parallel.parts import ModelParts
from lightning_par.parallel.recompute import apply_recompute
from lightning_par.parallel.rng import dropout_at, has_dropout
from lightning_par.parallel.router import apply_router_statistics
from lightning_par.parallel.tensor_parallel import TensorParallelPlan, apply_tensor_parallel


class Pretrained(Protocol):
    """Weights that replace the initialisation (``lightning_par.plugins.pretrained.PretrainedWeights``)."""

    def check(self, module: nn.Module) -> Collection[str]:
        """Check names, shapes and dtypes against ``module`` on every rank (collective); the names it fills."""

    def load(self, module: nn.Module) -> int:
        """Read this rank's slices into ``module``'s share; the number of tensors read."""


@dataclass
class ParallelizeConfig:
    """What :func:`parallelize` applies: the meshes of the dimensions it uses, the per-block options, the device."""

    device: torch.device
    dp_mesh: DeviceMesh
    tp_mesh: DeviceMesh
    sequence_parallel: bool = False
    recompute: str = "none"
    compile: BlockCompiler | None = None  # per block, after recompute
    #: where a deferred model's parameters are materialised when not on ``device``: the host, under FSDP2 offload
    parameter_device: torch.device | None = None
    #: the ``cp`` mesh: context parallel when its size is over 1 (it needs the parts' blocks)
    cp_mesh: DeviceMesh | None = None
    #: expert parallel (ep > 1): the mesh of topology.build_expert_mesh
    expert_mesh: DeviceMesh | None = None
    #: the routers' load-balancing scope (None: each model's own)
    aux_loss_scope: str | None = None


@dataclass
class Parallelized:
    """What :func:`parallelize` made: the rank's stage modules (FSDP2 roots under ZeRO-3), the tensor-parallel plan
    (tp > 1), the context-parallel context (cp > 1: the step's batch transform and step context), and the
    materialisation figures (``kept_bytes``, ``transient_bytes``, ``pretrained_tensors``)."""

    stages: list[nn.Module]
    tensor_parallel: TensorParallelPlan | None
    stats: dict[str, int]
    context_parallel: ContextParallel | None = None
    experts: ExpertParallel | None = None
    router: str | None = None  # the router layers' load-balancing scope, for the log (None: no router)

    def summary(self, config: ParallelizeConfig, blocks: int, pretrained_from: Any = None) -> list[str]:
        """What was applied to this rank's part, a line each (``blocks``: how many it has), for the log."""
        plan, cp, lines = self.tensor_parallel, self.context_parallel, []
        if plan is not None:
            lines.append(f"tensor parallel over tp={config.tp_mesh.size()}: plan applied to {len(plan.styles)} modules"
                         f"{' with sequence parallelism' if config.sequence_parallel else ''}"
                         f"{', vocab-parallel loss' if plan.vocab_parallel_head else ''}")
        if self.experts is not None:
            lines.append(self.experts.describe())
        if self.router is not None:
            lines.append(self.router)
        if cp is not None:
            assert config.cp_mesh is not None
            lines.append(f"context parallel over cp={config.cp_mesh.size()}: load-balanced sequence shards, ring "
                         f"attention over the cp group, {cp.described}")
        if config.recompute != "none":
            lines.append(f"activation recompute ({config.recompute}) on {blocks} blocks of rank 0")
        if config.compile is not None:
            lines.append(f"{config.compile.options.describe()}: {blocks} blocks of rank 0")
        if "kept_bytes" in self.stats:
            lines.append(f"deferred init: rank 0 {describe(self.stats)}")
        if "pretrained_tensors" in self.stats:
            lines.append(f"pretrained weights: rank 0 read its slices of {self.stats['pretrained_tensors']} tensors "
                         f"from {pretrained_from}")
        return lines


def parallelize(parts: ModelParts, config: ParallelizeConfig, shard: Callable[[ModelParts], Sequence[nn.Module]],
                deferred: DeferredInit | None = None, pretrained: Pretrained | None = None) -> Parallelized:
    """Apply the layout to ``parts`` in the fixed order (see the module docstring), in place: ``parts.stages`` are
    then the modules to run.

    ``shard``: the data-parallel owner's sharding of the parts (FSDP2 ``fully_shard`` at ZeRO-3, on meta tensors
    when ``deferred``; nothing for the owners that act on gradients only); returns the stage modules.
    ``deferred``: the record of the model's construction when it was built deferred.
    """
    ep = config.expert_mesh["ep"].size() if config.expert_mesh is not None else 1
    check_experts_per_token(parts.root)  # (any layout: torch.topk would fail at the first step)
    if config.expert_mesh is not None:
        # a Hugging Face model's experts from its own ep plan; a pipeline rank's stages may hold no expert layer
        # (the whole model was declared and checked before the split)
        prepare_expert_parallel(parts.root, ep, part=parts.pipelined)
    if deferred is None:  # (a deferred model took global rank 0's construction when it was recorded)
        parts.root.to(config.device)
        make_replicas_identical(parts.root, (config.dp_mesh, config.tp_mesh))
    plan = None
    if config.tp_mesh.size() > 1:
        # before data-parallel sharding: FSDP2 and the ZeRO partitioner then see DTensor parameters
        # the dropout regions' generator swaps (rng.py) change nothing without dropout: each costs a state read and
        # write, a hash and a new generator per column-parallel output and forward (on CUDA, device state round
        # trips), and inside compiled blocks a graph break. They are installed only in blocks with dropout;
        # sequence parallelism swaps once, around the whole forward. The tracker itself (its common default
        # generator, its region() for hand-written dropout) is kept in eager mode.
        rng = config.compile is None or config.sequence_parallel or has_dropout(parts.root)
        plan = apply_tensor_parallel(parts.root, config.tp_mesh, config.sequence_parallel, rng=rng,
                                     stage=parts.pipelined, rng_where=dropout_at(parts.blocks, parts.root), ep=ep)
    experts = apply_expert_parallel(parts.root, config.expert_mesh) if config.expert_mesh is not None else None
    # (the owner's sharding leaves them alone, or shards them over their own replicas)
    parts.experts, parts.expert_mesh = (experts.parameters, experts.mesh) if experts is not None else ([], None)
    # a global load-balancing loss sums the routers' statistics over the ranks the gradients are averaged over
    router = apply_router_statistics(parts.root, config.dp_mesh.get_group(), config.dp_mesh.size(),
                                     config.aux_loss_scope, config.sequence_parallel)
    cp = None
    if config.cp_mesh is not None and config.cp_mesh.size() > 1:
        cp = apply_context_parallel(parts.root, parts.stages, parts.blocks, config.cp_mesh, parts.pipelined)
    apply_recompute(parts.blocks, config.recompute, context_fn=recompute_contexts if cp is not None else None)
    if config.compile is not None:
        for block in parts.blocks:
            config.compile(block)
    parts.stages = stages = list(shard(parts))  # the modules the runner runs (FSDP2 roots under ZeRO-3)
    fills: Collection[str] = pretrained.check(parts.root) if pretrained is not None else ()
    stats: dict[str, int] = {}
    if deferred is not None:
        stats = materialize_share(parts.root, deferred, config.device, skip=fills,
                                  parameter_device=config.parameter_device)
    if pretrained is not None:
        stats["pretrained_tensors"] = pretrained.load(parts.root)
    return Parallelized(stages=stages, tensor_parallel=plan, stats=stats, context_parallel=cp, experts=experts,
                        router=router)


def make_replicas_identical(module: nn.Module, meshes: Sequence[DeviceMesh]) -> None:
    """Broadcast the tensors of a model built eagerly over each mesh from its first rank, so replicas agree by
    construction, seeded or not: DDP would do it at wrap time, FSDP2 and the ZeRO partitioner keep each rank's own
    values."""
    for mesh in meshes:
        group = mesh.get_group()
        if dist.get_world_size(group) == 1:
            continue
        for tensor in module.state_dict().values():
            if isinstance(tensor, Tensor):
                dist.broadcast(tensor, group=group, group_src=0)


def describe(stats: dict[str, Any]) -> str:
    kept, transient = stats.get("kept_bytes", 0), stats.get("transient_bytes", 0)
    return f"materialised {kept / 2**20:.1f} MiB (largest full tensor on the way: {transient / 2**20:.1f} MiB)"
