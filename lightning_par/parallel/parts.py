"""Split first: this rank's part of the model, with its blocks found once, before any transform.

:func:`split` is the first step of applying a layout (torchtitan's ``pipeline_llm`` order: split, then
``parallelize`` each part, then build the schedule). It finds the model's repeated blocks
(:func:`~lightning_par.parallel.blocks.find_blocks`) and, under pipeline parallelism, cuts the units of this rank's
stages out of the model (:mod:`~lightning_par.parallel.pipeline.split`), after checking that the model's forward is
the chain of its units (:mod:`~lightning_par.parallel.pipeline.chain`). What it returns, :class:`ModelParts`, is all
that the later steps read: :func:`~lightning_par.parallel.parallelize.parallelize` (tensor parallel, recompute and
compile per block, the data-parallel owner's sharding) and
:class:`~lightning_par.parallel.pipeline.runtime.PipelineRuntime` (torch's stages and schedule over the transformed
stage modules). Nothing downstream searches the model for blocks again.

Everything here is single-process module surgery on the model as built (meta tensors when it was built deferred):
every refusal is a :class:`~lightning_par.topology.LayoutError` raised alike on every rank, before any collective.
The one collective is :func:`agreed`, which the strategy runs around the transforms of the parts, since those may fail
on one pipeline rank only (its stages differ from the others'). Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Generator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par.parallel.blocks import BlockTypes, ModelBlocks, find_blocks
from lightning_par.parallel.pipeline.adapter import StageIO, stage_forward, stage_io
from lightning_par.parallel.pipeline.chain import check_chain, check_layer_positions, check_unit_inputs
from lightning_par.parallel.pipeline.loss import ModelLoss, check_layer_losses
from lightning_par.parallel.pipeline.split import (
    Costs,
    KeptModuleList,
    block_units,
    held_blocks,
    model_units,
    plan_stages,
    rank_module,
    removes_to_none,
    stage_view,
    tied_parameter_groups,
)
from lightning_par.parallel.stage_plan import StagePlan
from lightning_par.topology import LayoutError


class TiedCopy(NamedTuple):
    """A parameter with copies on several pipeline ranks (a tied embedding and head), seen from this rank.

    The copy is found by name each time it is needed: tensor parallel and FSDP2 replace the ``Parameter`` objects
    after the split."""

    name: str | None  # this rank's copy's name in the rank module, if it holds one
    source: int  # the lowest pipeline rank holding a copy: it counts in the global norm and is broadcast from
    counted_here: bool  # whether this rank's copy counts in the global gradient norm
    shape: torch.Size
    dtype: torch.dtype


@dataclass
class StageSplit:
    """What the pipeline split made on this rank, for the runtime that builds torch's stages and schedule."""

    plan: StagePlan
    pp_rank: int
    module: nn.Module  # the rank module: every unit of this rank's stages, original names
    units: list[str]  # every pipeline unit of the model, in execution order
    units_by_stage: list[list[str]]  # every stage's units (not only this rank's)
    stage_ids: list[int]  # this rank's stages, in increasing order
    io: StageIO  # how a stage calls the model's forward
    model_loss: ModelLoss | None  # the model's own loss (a Hugging Face causal LM's), if it has one
    tied: list[TiedCopy]  # parameters with copies on several pipeline ranks
    chain_check_seconds: float = 0.0


@dataclass
class ModelParts:
    """This rank's part of the model.

    ``root``: the module whose parameter names are the model's (the LightningModule; under pp it holds only this
    rank's stages). ``stages``: the rank's pipeline stage modules, or ``[root]`` without pipeline parallelism.
    ``blocks``: the repeated blocks the rank holds, in order (recompute, compile and ZeRO-3 groups act on them);
    ``stage_blocks``: the same per stage module. ``found``: where the blocks are (names, the path of the module that
    holds them inside ``root``, how they were found), this rank's part of it under pp; None for a model without
    repeated blocks that no transform needs. ``pipeline``: the split's record under pp, else None.
    ``experts``: expert parallel's expert weights (set by its transform), which data-parallel sharding leaves alone
    (ZeRO-3 shards them over their own replicas instead, on ``expert_mesh``'s ``expert_dp``).
    """

    root: nn.Module
    stages: list[nn.Module]
    blocks: list[nn.Module] = field(default_factory=list)
    stage_blocks: list[list[nn.Module]] = field(default_factory=list)
    found: ModelBlocks | None = None
    pipeline: StageSplit | None = None
    experts: list[nn.Parameter] = field(default_factory=list)
    expert_mesh: DeviceMesh | None = None

    def __post_init__(self) -> None:
        if not self.stage_blocks:
            self.stage_blocks = [list(self.blocks)] if len(self.stages) == 1 else [[] for _ in self.stages]

    @property
    def pipelined(self) -> bool:
        return self.pipeline is not None

    def describe_blocks(self) -> str:
        """Which repeated blocks were found (ZeRO-3 and replicate groups, recompute, compile and pipeline units are
        built from them), for rank 0's log."""
        if self.found is None:
            return "blocks: none found; data parallel treats the model as one unit"
        mine = "rank 0's part: " if self.pipelined else ""
        return f"blocks: {mine}{self.found.describe()}"

    @property
    def block_names(self) -> list[str]:
        """This rank's blocks by name, relative to the module that holds them (``found.root``)."""
        return list(self.found.blocks) if self.found is not None else []


def split(model: nn.Module, plan: StagePlan | None = None, pp_mesh: DeviceMesh | None = None, *,
          block_types: BlockTypes = None, costs: Costs = None, units: Sequence[str] | None = None,
          holder: bool = False, need_blocks: bool = True) -> ModelParts:
    """This rank's part of ``model`` under ``plan`` (None, or pp = 1 without a schedule: the whole model, one stage).

    Args:
        model: the model, or (``holder=True``) a module holding it, such as a LightningModule.
        plan: the stages and schedule (``Layout.stage_plan``); with ``pp_mesh``, the rank's pipeline coordinate.
        block_types: how to find the blocks where the model does not say (see
            :func:`~lightning_par.parallel.blocks.find_blocks`).
        costs: per-unit costs to balance the stages (see :func:`~lightning_par.parallel.pipeline.split.plan_stages`).
        units: the model's pipeline units in execution order, given instead of found (``model`` is then the model
            itself); their repeated blocks are the units inside a container.
        holder: ``model`` holds the model to split at the blocks' path (a LightningModule's ``self.model``): that
            submodule is replaced by this rank's part, and ``model`` stays the root (its names are the model's).
            Refused where the blocks are held by ``model`` itself. Otherwise the rank's part is the root.
        need_blocks: pp = 1: a model without repeated blocks is refused (``find_blocks``' error says how to
            declare them); with False it is one unit (``found`` None), unless ``block_types`` matched nothing.
    """
    if plan is None or (plan.pp == 1 and plan.schedule is None):  # no pipeline (a schedule of one rank is one)
        found = _find(model, block_types, units, required=need_blocks or bool(block_types))
        blocks = found.block_modules() if found is not None else []
        return ModelParts(root=model, stages=[model], blocks=blocks, found=found)
    if pp_mesh is None or pp_mesh.size() != plan.pp:
        raise LayoutError(f"splitting for pp={plan.pp} needs the 1-D pipeline mesh of that size, got {pp_mesh}.")
    found = _find(model, block_types, units, required=True)
    assert found is not None
    name = type(model).__name__
    if holder and not found.path:
        raise LayoutError(
            f"pipeline parallel needs the model inside {name} as a submodule (build it in "
            "`configure_model()` as e.g. `self.model`), but the blocks are held by the LightningModule itself. "
            f"Found: {found.describe()}."
        )
    if found.units is None:
        raise LayoutError(
            f"pipeline parallel needs the units of `{found.path}` ({type(found.root).__name__}) in a known "
            "order, but its blocks do not share one parent: declare `pipeline_units()` / a `pp_plan`, or keep the "
            "blocks in one nn.ModuleList (or nn.Sequential) next to the modules that run before and after them. "
            f"Found: {found.describe()}."
        )
    whole = found.root
    all_units = list(found.units)
    units_by_stage = plan_stages(whole, plan, costs=costs, units=all_units)
    io = stage_io(whole)
    # before the split and before any collective, on the (meta) model: the same verdict on every rank
    chain_seconds = check_chain(whole, all_units, units_by_stage, io)
    positional = check_layer_positions(whole, units_by_stage)
    check_unit_inputs(whole, all_units, units_by_stage, io)
    check_layer_losses(whole, plan.pp)
    pp_rank = pp_mesh.get_local_rank()
    stage_ids = plan.stages_of(pp_rank)
    module = rank_module(whole, units_by_stage, stage_ids, units=all_units)
    to_none = removes_to_none(whole)
    stages = [stage_view(module, units_by_stage[i], units=all_units, to_none=to_none) for i in stage_ids]
    for held in (module, *stages):  # (a forward that picks each layer's setting by its index in the loop)
        for path in positional:
            layers = held.get_submodule(path)
            if isinstance(layers, KeptModuleList):
                layers.positional = True
    for i, view in zip(stage_ids, stages, strict=True):
        # an instance attribute, so the stage keeps the model's class and parameter names
        # every stage but the last hands on its last unit's output, not the model's output: a forward that computes
        # after its last unit (a logit scale) would apply that on each stage, and whether it does is known only where
        # check_chain could run the forward on meta (it warns where it cannot)
        hand_on = i < len(units_by_stage) - 1
        last_unit = view.get_submodule(units_by_stage[i][-1]) if hand_on else None
        view.forward = stage_forward(view, io, first=i == 0, entry=view.get_submodule(units_by_stage[i][0]),
                                     last_unit=last_unit)
    record = StageSplit(plan=plan, pp_rank=pp_rank, module=module, units=all_units, units_by_stage=units_by_stage,
                        stage_ids=stage_ids, io=io, model_loss=ModelLoss.of(whole),
                        tied=_tied_across_ranks(whole, plan, units_by_stage, all_units, pp_rank),
                        chain_check_seconds=chain_seconds)
    root = model
    if holder:  # the holder keeps this rank's stages from now on: the rest of the model is never materialised
        parent_name, _, attr = found.path.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, module)
    else:
        root = module
    # the blocks this rank holds, relative to its module; each stage module's own (views share the blocks)
    mine = replace(found, root=module, blocks=tuple(held_blocks(module, found.blocks)),
                   units=tuple(u for i in stage_ids for u in units_by_stage[i]))
    by_stage = [[view.get_submodule(name) for name in held_blocks(view, found.blocks)] for view in stages]
    return ModelParts(root=root, stages=stages, blocks=mine.block_modules(), stage_blocks=by_stage, found=mine,
                      pipeline=record)


def _find(model: nn.Module, block_types: BlockTypes, units: Sequence[str] | None, required: bool) -> ModelBlocks | None:
    """The model's blocks: from ``units`` when given (``model`` is the model itself), else ``find_blocks``."""
    if units is not None:
        units = model_units(model, units)
        return ModelBlocks(model, "", tuple(block_units(model, units)), tuple(units), "the given pipeline units")
    try:
        return find_blocks(model, block_types)
    except LayoutError:
        if required:
            raise  # the error says how to declare the blocks
        return None


def _tied_across_ranks(model: nn.Module, plan: StagePlan, units_by_stage: list[list[str]], units: list[str],
                       pp_rank: int) -> list[TiedCopy]:
    """Parameters of the unsplit ``model`` whose copies land on more than one pipeline rank, seen from ``pp_rank``."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out = []
    for tied in tied_parameter_groups(model, units_by_stage, units=units):
        by_rank: dict[int, str] = {}
        for stage, name in tied.name_by_stage.items():
            by_rank.setdefault(plan.rank_of(stage), name)
        if len(by_rank) > 1:
            source = min(by_rank)
            out.append(TiedCopy(by_rank.get(pp_rank), source, source == pp_rank, params[tied.name].shape,
                                params[tied.name].dtype))
    return out


@contextmanager
def agreed(group: dist.ProcessGroup, what: str) -> Generator[None, None, None]:
    """Run the block on every rank of ``group``, then agree (one ``all_gather_object``): an error raised on one rank
    -- a layout its pipeline stages cannot take -- is raised on all of them, not left waiting in a later collective.
    ``what`` names the step in the error the other ranks raise."""
    error: BaseException | None = None
    try:
        yield None
    except Exception as err:  # noqa: BLE001 -- re-raised below, after the other ranks heard of it
        error = err
    messages: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(messages, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if failed:
        rank, message = failed[0]
        raise LayoutError(f"pipeline rank {rank} could not {what} (so none of the ranks goes on): {message}")
