"""Who synchronises data-parallel gradients: exactly one owner per layout, chosen in one place.

Five mechanisms can average gradients over the ``dp`` mesh, and a layout needs exactly one of them:

=====================  ===================================================================================
owner                  when
=====================  ===================================================================================
:class:`NoSync`        one data-parallel rank, or not fitting (evaluation has no gradients)
:class:`DDPSync`       ZeRO-0, plain tensors: PyTorch DDP's bucketed all-reduce, overlapped with backward
:class:`FSDPSync`      ZeRO-3 (FSDP2 ``fully_shard``), or ZeRO-0 with DTensor parameters (FSDP2 ``replicate``)
:class:`ZeroSync`      ZeRO-1/2: :class:`~lightning_par.parallel.zero.ZeroPartitioner` reduce-scatters buckets
                       (with pp > 1: once per step, after the schedule's last backward)
:class:`PipelineSync`  ZeRO-0 with pp > 1: bucketed all-reduces, each stage's launched as the schedule ends
                       that stage's last backward, waited for before the step
:class:`PipelineFSDPSync`  ZeRO-3 with pp > 1: the stages are FSDP2 modules (sharded by
                       ``parallelize`` before the pipeline is built); torch's schedule reduce-scatters once per step
=====================  ===================================================================================

Under pipeline parallel every owner first sums the gradients of weights held by several pipeline ranks (a tied
embedding and head) over the pipeline, on full gradients where the owner reduces after the schedule.

Each owner has the same hooks, called by the strategy: ``shard`` (inside
:func:`~lightning_par.parallel.parallelize.parallelize`, last of the transforms, on meta tensors when the model was
built deferred), ``bind`` (the pipeline runtime, once it exists), ``wrap`` (real tensors, before the optimizers
exist), ``attach``
(after), ``set_enabled`` (off on the non-final micro-batches of gradient accumulation), ``after_backward``
(before clipping and the step), ``after_step`` and ``unwrap``. Each owner answers its checkpoint state too
(``states``, :mod:`~lightning_par.parallel.param_states`): what a rank saves, what a load fills, and the refresh after a
load. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from lightning_par.parallel.blocks import BlockTypes, ModelBlocks
from lightning_par.parallel.data_parallel import replicate_data_parallel, replicate_units
from lightning_par.parallel.layout import Layout
from lightning_par.parallel.param_states import PARAM_STATES, ParamStates
from lightning_par.parallel.parts import ModelParts
from lightning_par.parallel.zero import ShardPrecision, ZeroPartitioner, check_partitionable, fully_shard_parts
from lightning_par.parallel.zero_state import ZeroStates

FULL_PRECISION = ShardPrecision()  # the parameters' own dtype for everything


class NoSync:
    """Nothing to synchronise: a single data-parallel rank, or no gradients (evaluation)."""

    name = "none"
    #: the owner keeps the resting parameter shards in host memory (FSDP2 CPU offload): a deferred model's
    #: parameters are then materialised there, as FSDP2 requires, while buffers go to the device
    parameters_on_host = False

    def __init__(self) -> None:
        self.enabled = True
        self.pipeline: Any = None  # the pipeline runtime (pp > 1), from bind()

    def shard(self, parts: ModelParts) -> list[nn.Module]:
        """Shard the parameters of ``parts`` over data parallel (ZeRO-3 only); returns the stage modules."""
        return parts.stages

    def bind(self, pipeline: Any) -> None:
        """The pipeline runtime, once it exists (it is built around the parts :meth:`shard` saw)."""
        self.pipeline = pipeline

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        pass

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled

    def after_backward(self) -> None:
        pass

    def after_step(self) -> None:
        pass

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module

    @property
    def states(self) -> ParamStates:
        """This layout's checkpoint state: the model's and optimizers' entries by parameter name, and their load."""
        return PARAM_STATES

    def wrap_again(self, module: nn.Module) -> nn.Module:
        """``wrap`` for a later fit of the same model, after ``unwrap``."""
        return self.wrap(module)

    def norm_grads(self, params: Sequence[Tensor], exclude: Collection[int] = ()) -> list[Tensor]:
        """The gradients of ``params`` (an optimizer's) that this rank counts in the global norm, leaving out the
        parameters whose ids are in ``exclude`` (tied pipeline copies another rank counts)."""
        return [p.grad for p in params if p.grad is not None and id(p) not in exclude]


class DDPSync(NoSync):
    """ZeRO-0 with plain tensors: PyTorch DDP (buckets all-reduced as backward produces them)."""

    name = "ddp"

    def __init__(self, dp_mesh: DeviceMesh, bucket_cap_mb: float) -> None:
        super().__init__()
        self.dp_mesh, self.bucket_cap_mb = dp_mesh, bucket_cap_mb
        self.ddp: DistributedDataParallel | None = None

    def wrap(self, module: nn.Module) -> nn.Module:
        wrapped = replicate_data_parallel(module, self.dp_mesh, self.bucket_cap_mb)
        self.ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        return wrapped

    def set_enabled(self, enabled: bool) -> None:
        super().set_enabled(enabled)
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = enabled  # what DDP.no_sync() toggles

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module


class FSDPSync(NoSync):
    """FSDP2 over the dp mesh: ``fully_shard`` per block (ZeRO-3) or ``replicate`` per block (ZeRO-0 on DTensors)."""

    def __init__(self, dp_mesh: DeviceMesh, shard: bool, offload: bool = False,
                 block_types: BlockTypes = None, precision: ShardPrecision = FULL_PRECISION) -> None:
        super().__init__()
        self.name = "fsdp2_shard" if shard else "fsdp2_replicate"
        self.dp_mesh, self.sharded, self.offload, self.block_types = dp_mesh, shard, offload, block_types
        self.parameters_on_host = shard and offload
        self.precision = precision
        self.roots: list[nn.Module] = []
        self.found: ModelBlocks | None = None  # the blocks of the parts shard() saw: replicate's groups

    def shard(self, parts: ModelParts) -> list[nn.Module]:
        self.found = parts.found
        if self.sharded:
            self.roots = fully_shard_parts(parts, self.dp_mesh, offload=self.offload,
                                           mp_policy=self.precision.fsdp_policy())
        return parts.stages

    def wrap(self, module: nn.Module) -> nn.Module:
        if not self.sharded:  # FSDP2 replicate needs the real tensors
            self.roots = replicate_units(module, self.dp_mesh, block_types=self.block_types, found=self.found)
        return module

    def wrap_again(self, module: nn.Module) -> nn.Module:
        return module  # replicate's hooks outlive unwrap

    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        if self.sharded:
            for optimizer in optimizers:
                check_partitionable(optimizer, 3)

    def set_enabled(self, enabled: bool) -> None:
        super().set_enabled(enabled)
        for root in self.roots:
            root.set_requires_gradient_sync(enabled)


class ZeroSync(NoSync):
    """ZeRO-1/2: gradients reduce-scattered into the optimizer's shards, parameters all-gathered after the step.

    With a pipeline (``pipeline`` = its runtime) nothing is reduced during the schedule's many micro-batch
    backwards: after the last one the tied copies are summed over the pipeline, then every bucket is
    reduce-scattered once (the partitioner's ``defer_reduction``).
    """

    def __init__(self, dp_mesh: DeviceMesh, stage: int, bucket_cap_mb: float, offload: bool,
                 precision: ShardPrecision = FULL_PRECISION) -> None:
        super().__init__()
        self.name = f"zero{stage}"
        self.dp_mesh, self.stage, self.bucket_cap_mb, self.offload = dp_mesh, stage, bucket_cap_mb, offload
        self.precision = precision
        self.partitioner: ZeroPartitioner | None = None

    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.partitioner = ZeroPartitioner(module, optimizers, self.dp_mesh, self.stage, self.bucket_cap_mb,
                                           self.offload, defer_reduction=self.pipeline is not None,
                                           param_dtype=self.precision.param_dtype,
                                           reduce_dtype=self.precision.reduce_dtype,
                                           grad_dtype=self.precision.grad_dtype)

    def set_enabled(self, enabled: bool) -> None:
        super().set_enabled(enabled)
        if self.partitioner is not None:
            self.partitioner.require_sync = enabled

    def after_backward(self) -> None:
        if self.pipeline is not None and self.enabled:
            self.pipeline.sum_tied_gradients()  # full gradients, before they are reduce-scattered
        if self.partitioner is not None:
            self.partitioner.finish_gradient_sync()  # the last buckets (all of them under a pipeline)

    def after_step(self) -> None:
        if self.partitioner is not None:
            # each rank stepped its chunk; everyone gets all of them. Left running: each bucket's gather is waited
            # for in a forward pre-hook of its modules; state_dict, checkpoints and unwrap wait for all of them
            self.partitioner.gather_parameters()

    def unwrap(self, module: nn.Module) -> nn.Module:
        if self.partitioner is not None:
            # its hooks go, the partitioner stays: the optimizers still hold its bucket shards, and a save after fit
            # (trainer.save_checkpoint) maps them to the parameters through it. remove() first waits for the
            # gathers of the last step, which no forward waits for now
            self.partitioner.remove()
        return module

    @property
    def states(self) -> ParamStates:
        # once the optimizers hold bucket shards (attach), the weights are saved from and loaded into the shards
        return ZeroStates(self.partitioner) if self.partitioner is not None else PARAM_STATES

    def norm_grads(self, params: Sequence[Tensor], exclude: Collection[int] = ()) -> list[Tensor]:
        # the optimizer holds bucket shards; a tied copy counted elsewhere is zeroed inside its bucket's shard
        if not exclude or self.partitioner is None:
            return super().norm_grads(params)
        return self.partitioner.norm_grads(exclude, shards={id(p) for p in params})


class PipelineSync(NoSync):
    """ZeRO-0 under pipeline parallel: gradients all-reduced over dp in buckets, tied copies summed over the pipeline.

    The schedule runs backward in pieces (per micro-batch, and split into input and weight gradients in the
    zero-bubble schedules), so there is no single backward for DDP's reducer to overlap with. Instead each stage's
    buckets are launched as the schedule ends that stage's last backward of the step
    (:meth:`~lightning_par.parallel.pipeline.runtime.PipelineRuntime.overlap_dp_reduction`), overlapping what the
    schedule still runs on this rank; the tied copies are summed and reduced, and everything waited for, in
    ``after_backward``.
    """

    name = "pipeline_allreduce"

    def __init__(self, dp_mesh: DeviceMesh, bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        self.dp_mesh, self.bucket_cap_mb = dp_mesh, bucket_cap_mb

    def bind(self, pipeline: Any) -> None:
        super().bind(pipeline)
        if self.dp_mesh.size() > 1:
            pipeline.overlap_dp_reduction(self.dp_mesh.get_group(), self.bucket_cap_mb)

    def set_enabled(self, enabled: bool) -> None:
        super().set_enabled(enabled)
        if self.pipeline is not None:
            self.pipeline.require_sync = enabled  # no reduction in the schedule while gradients accumulate

    def after_backward(self) -> None:
        if self.enabled:
            self.pipeline.sync_gradients(self.dp_mesh.get_group(), self.bucket_cap_mb)


class PipelineFSDPSync(NoSync):
    """ZeRO-3 under pipeline parallel: the stage modules were made FSDP2 modules by ``parallelize``
    (:func:`~lightning_par.parallel.zero.fully_shard_parts`), and torch's schedule reduce-scatters each
    group once per step; the runtime holds the reduction back on the non-final batches of gradient accumulation.
    Left here: the tied copies' (sharded) gradients, summed over the pipeline."""

    name = "fsdp2_shard_stages"

    def __init__(self, dp_mesh: DeviceMesh, offload: bool = False, precision: ShardPrecision = FULL_PRECISION) -> None:
        super().__init__()
        self.dp_mesh, self.offload, self.precision = dp_mesh, offload, precision
        self.parameters_on_host = offload

    def shard(self, parts: ModelParts) -> list[nn.Module]:
        return fully_shard_parts(parts, self.dp_mesh, offload=self.offload, mp_policy=self.precision.fsdp_policy())

    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        for optimizer in optimizers:
            check_partitionable(optimizer, 3)

    def set_enabled(self, enabled: bool) -> None:
        super().set_enabled(enabled)
        self.pipeline.require_sync = enabled

    def after_backward(self) -> None:
        if self.enabled:
            self.pipeline.sum_tied_gradients()


def choose_gradient_sync(layout: Layout, dp_mesh: DeviceMesh, fitting: bool,
                         precision: ShardPrecision = FULL_PRECISION) -> NoSync:
    """The one owner of data-parallel gradient synchronisation for this layout (see the table above).

    ``precision``: the ZeRO owners' dtypes under mixed precision (the precision plugin's ``shard_precision``).

    ZeRO-3 shards parameters for evaluation too (that is what lets a model larger than one device be evaluated);
    every other owner exists only while fitting.
    """
    stage = layout.zero_stage
    offload = layout.offload_parameters or layout.offload_optimizer
    if layout.pp > 1:
        # ZeRO-3 stages are sharded by parallelize (for evaluation too: FSDP2 gathers them itself);
        # the tied copies are summed over the pipeline even with a single replica
        if stage == 3:
            return PipelineFSDPSync(dp_mesh, offload=offload, precision=precision)
        if not fitting:
            return NoSync()
        if stage in (1, 2):
            return ZeroSync(dp_mesh, stage, layout.bucket_cap_mb, layout.offload_optimizer, precision=precision)
        return PipelineSync(dp_mesh, layout.bucket_cap_mb)
    if stage == 3:
        return FSDPSync(dp_mesh, shard=True, offload=offload, block_types=layout.block_types, precision=precision)
    if not fitting:
        return NoSync()
    if stage in (1, 2):  # also with one replica: the optimizer state keeps one format for any dp size
        return ZeroSync(dp_mesh, stage, layout.bucket_cap_mb, layout.offload_optimizer, precision=precision)
    if dp_mesh.size() == 1:
        return NoSync()
    if layout.tp > 1:
        return FSDPSync(dp_mesh, shard=False, block_types=layout.block_types)  # DDP cannot take DTensors
    return DDPSync(dp_mesh, layout.bucket_cap_mb)
