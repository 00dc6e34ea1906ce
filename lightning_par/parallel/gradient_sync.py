"""Who synchronises data-parallel gradients: exactly one owner per layout, chosen in one place.

Four mechanisms can average gradients over the ``dp`` mesh, and a layout needs exactly one of them:

=====================  ===================================================================================
owner                  when
=====================  ===================================================================================
:class:`NoSync`        one data-parallel rank, or not fitting (evaluation has no gradients)
:class:`DDPSync`       ZeRO-0, plain tensors: PyTorch DDP's bucketed all-reduce, overlapped with backward; under a
                       deferring runner, the same average in buckets launched as each stage's gradients complete
:class:`FSDPSync`      ZeRO-3 (FSDP2 ``fully_shard``), or ZeRO-0 with DTensor parameters (FSDP2 ``replicate``);
                       under a deferring runner the stages are FSDP2 modules, reduce-scattered once per step
:class:`ZeroSync`      ZeRO-1/2: :class:`~lightning_par.parallel.zero.ZeroPartitioner` reduce-scatters buckets
                       (under a deferring runner, once per step)
=====================  ===================================================================================

Each owner is told at construction whether the runner **defers** its reduction: a pipeline schedule runs many
micro-batch backwards (split into input and weight halves in the zero-bubble schedules), and nothing may be reduced
per micro-batch. The step's gradients are made final in one place,
:func:`~lightning_par.parallel.finalize.finalize`, which sums the copies of weights held by several pipeline ranks
and then has the owner finish its reduction.

Each owner has the same hooks, called by the strategy: ``shard`` (inside
:func:`~lightning_par.parallel.parallelize.parallelize`, last of the transforms, on meta tensors when the model was
built deferred), ``wrap`` (real tensors, before the optimizers exist), ``attach`` (after), ``set_enabled`` (off on
the non-final micro-batches of gradient accumulation), ``start_grad_sync`` (a deferring runner's stage finished its
last backward of the step), ``finish_grad_sync`` (from ``finalize``, before clipping and the step), ``after_step`` and
``unwrap``. Each owner answers its checkpoint state too (``states``, :mod:`~lightning_par.parallel.param_states`):
what a rank saves, what a load fills, and the refresh after a load. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_par._compat import ddp_ignore_parameters
from lightning_par.parallel.blocks import BlockTypes, ModelBlocks
from lightning_par.parallel.data_parallel import BucketedAllReduce, replicate_data_parallel, replicate_units
from lightning_par.parallel.expert_parallel import ExpertGradients
from lightning_par.parallel.layout import Layout
from lightning_par.parallel.param_states import PARAM_STATES, ParamStates
from lightning_par.parallel.parts import ModelParts
from lightning_par.parallel.zero import ShardPrecision, ZeroPartitioner, check_partitionable, fully_shard_parts
from lightning_par.parallel.zero_state import ZeroStates
from lightning_par.topology import LayoutError

FULL_PRECISION = ShardPrecision()  # the parameters' own dtype for everything


class NoSync:
    """Nothing to synchronise: a single data-parallel rank, or no gradients (evaluation)."""

    name = "none"
    #: the owner keeps the resting parameter shards in host memory (FSDP2 CPU offload): a deferred model's
    #: parameters are then materialised there, as FSDP2 requires, while buffers go to the device
    parameters_on_host = False

    def __init__(self, deferred: bool = False) -> None:
        self.enabled = True
        #: the runner defers the reduction to the end of the step (a pipeline schedule: many micro-batch backwards)
        self.deferred = deferred
        #: expert parallel: the expert weights, left out of this owner's reduction and averaged over their own
        #: replicas in ``finalize`` (set before ``wrap``)
        self.experts: ExpertGradients | None = None

    @property
    def shards_experts(self) -> bool:
        """The owner reduces (and shards, at its stage) the expert weights over their own replicas itself (ZeRO 1-3):
        ``finalize`` then leaves them alone."""
        return False

    def shard(self, parts: ModelParts) -> list[nn.Module]:
        """Shard the parameters of ``parts`` over data parallel (ZeRO-3 only); returns the stage modules."""
        return parts.stages

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        pass

    def set_enabled(self, enabled: bool) -> None:
        self.enabled = enabled

    def start_grad_sync(self, params: Iterable[nn.Parameter]) -> None:
        """A deferring runner's stage finished its last backward of the step: ``params``' gradients are complete
        (the runner leaves out those still to change: tied copies, parameters two of its stages share)."""

    def finish_grad_sync(self) -> None:
        """Finish this step's data-parallel reduction (from :func:`~lightning_par.parallel.finalize.finalize`)."""

    def after_step(self) -> None:
        pass

    def unwrap(self, module: nn.Module, interrupted: bool = False) -> nn.Module:
        """``module`` without this owner's wrapping. ``interrupted``: the run ended by an exception (the strategy
        knows; a rank may be gone, so the owner runs no collective)."""
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
    """ZeRO-0 with replicas: gradients averaged over dp in buckets of ``bucket_cap_mb``.

    Not deferred: PyTorch DDP, whose reducer all-reduces each bucket as backward produces it. Deferred (a pipeline
    schedule runs backward in pieces, per micro-batch and split into input and weight halves, so there is no single
    backward for DDP's reducer to follow): :class:`~lightning_par.parallel.data_parallel.BucketedAllReduce`, each
    stage's buckets launched as the runner ends that stage's last backward of the step (:meth:`start_grad_sync`),
    overlapping what the schedule still runs; the rest -- tied copies once summed over the pipeline, parameters two
    stages share, a stage the runner did not report -- and the wait in :meth:`finish_grad_sync`.
    """

    def __init__(self, dp_mesh: DeviceMesh, bucket_cap_mb: float, deferred: bool = False) -> None:
        super().__init__(deferred)
        self.name = "pipeline_allreduce" if deferred else "ddp"
        self.dp_mesh, self.bucket_cap_mb = dp_mesh, bucket_cap_mb
        self.ddp: DistributedDataParallel | None = None
        self.reducer: BucketedAllReduce | None = None  # deferred: the buckets of the step
        self.module: nn.Module | None = None  # deferred: whose parameters finish_grad_sync reduces
        self._launched: set[int] = set()  # deferred: ids of the parameters whose buckets this step launched
        self._checked_unused = False  # DDP: parameters no backward reached, looked for at the first step

    def wrap(self, module: nn.Module) -> nn.Module:
        if self.deferred:
            self.module = module
            self.reducer = BucketedAllReduce(self.dp_mesh.get_group(), self.bucket_cap_mb)
            return module
        if self.experts is not None:  # each rank holds other experts: DDP must neither broadcast nor average them
            ids = {id(p) for p in self.experts.parameters}
            ddp_ignore_parameters(module, [n for n, p in module.named_parameters() if id(p) in ids])
        wrapped = replicate_data_parallel(module, self.dp_mesh, self.bucket_cap_mb)
        self.ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        return wrapped

    def start_grad_sync(self, params: Iterable[nn.Parameter]) -> None:
        if self.reducer is None:
            return
        params = [p for p in self._replicated(params) if p.grad is not None]
        if any(id(p) in self._launched for p in params):
            raise RuntimeError("a pipeline stage ended its last backward twice in one step; its gradients were "
                               "already being all-reduced over data parallel.")
        self._launched.update(id(p) for p in params)
        self.reducer.launch([_local(p.grad) for p in params])

    def finish_grad_sync(self) -> None:
        if self.ddp is not None and not self._checked_unused:
            self._checked_unused = True
            _refuse_unused(self.ddp, self.experts)
        if self.reducer is None or self.module is None:
            return
        try:
            self.reducer.launch([_local(p.grad) for p in self._replicated(self.module.parameters())
                                 if p.grad is not None and id(p) not in self._launched])
            self.reducer.finish()
        finally:
            self._launched = set()

    def _replicated(self, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
        """``params`` less expert parallel's experts: each rank holds other experts, averaged over their own
        replicas in ``finalize`` (the deferred form of DDP's ignored parameters)."""
        experts = {id(p) for p in self.experts.parameters} if self.experts is not None else set()
        return [p for p in params if id(p) not in experts]

    def set_enabled(self, enabled: bool) -> None:
        super().set_enabled(enabled)
        if self.ddp is not None:
            self.ddp.require_backward_grad_sync = enabled  # what DDP.no_sync() toggles

    def unwrap(self, module: nn.Module, interrupted: bool = False) -> nn.Module:
        return module.module if isinstance(module, DistributedDataParallel) else module


def _refuse_unused(ddp: DistributedDataParallel, experts: Any) -> None:
    """At the first step's end, before any update: parameters that train (``requires_grad``) and got no gradient.
    DDP's reducer waits for every one of them, so its next forward stops with torch's "Expected to have finished
    reduction" after a step whose buckets were left unreduced; one process never updates them (the optimizer skips a
    parameter without a gradient). A text-only forward of a multimodal model (an audio or vision tower) is the usual
    case: each rank finds the same ones."""
    expert_ids = {id(p) for p in experts.parameters} if experts is not None else set()  # (DDP ignores those)
    unused = [n for n, p in ddp.module.named_parameters()
              if p.requires_grad and p.grad is None and id(p) not in expert_ids]
    if unused:
        modules, many = sorted({n.rsplit(".", 1)[0] for n in unused}), "s" if len(unused) > 1 else ""
        raise LayoutError(
            f"{len(unused)} parameter{many} of {type(ddp.module).__name__} got no gradient in the first step "
            f"({', '.join(modules[:3])}{' ...' if len(modules) > 3 else ''}): data parallel's all-reduce (ZeRO-0 "
            "with replicas, DistributedDataParallel) needs every trained parameter to take part in every backward. "
            "Freeze what the forward does not use (`module.requires_grad_(False)` in configure_model: one process "
            "never updates it either), or train with ZeRO-3 (FSDP2 reduces what the backward reached). Refused "
            "before the first update.")


def _local(tensor: Tensor) -> Tensor:
    """What this rank holds of ``tensor``: a DTensor's local shard (alike on every replica), else itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class FSDPSync(NoSync):
    """FSDP2 over the dp mesh: ``fully_shard`` per block (ZeRO-3) or ``replicate`` per block (ZeRO-0 on DTensors).

    Deferred (ZeRO-3 under a pipeline): the stage modules are made FSDP2 modules
    (:func:`~lightning_par.parallel.zero.fully_shard_parts`), and torch's schedule reduce-scatters each
    group once per step, after the last micro-batch's backward; the runner holds that back on the non-final batches
    of gradient accumulation (:func:`~lightning_par.parallel.finalize.no_sync`).
    """

    def __init__(self, dp_mesh: DeviceMesh, shard: bool, offload: bool = False,
                 block_types: BlockTypes = None, precision: ShardPrecision = FULL_PRECISION,
                 deferred: bool = False) -> None:
        super().__init__(deferred)
        if deferred and not shard:
            raise ValueError("FSDP2 replicate has no deferred form here: a deferring runner's ZeRO-0 replicas are "
                             "averaged by DDPSync(deferred=True).")
        self.name = ("fsdp2_shard_stages" if deferred else "fsdp2_shard") if shard else "fsdp2_replicate"
        self.dp_mesh, self.sharded, self.offload, self.block_types = dp_mesh, shard, offload, block_types
        self.parameters_on_host = shard and offload
        self.precision = precision
        self.roots: list[nn.Module] = []
        self.found: ModelBlocks | None = None  # the blocks of the parts shard() saw: replicate's groups

    def shard(self, parts: ModelParts) -> list[nn.Module]:
        self.found = parts.found
        if self.deferred:  # the stage modules; the runner holds their reduction back (finalize.no_sync)
            return fully_shard_parts(parts, self.dp_mesh, offload=self.offload, mp_policy=self.precision.fsdp_policy())
        if self.sharded:
            self.roots = fully_shard_parts(parts, self.dp_mesh, offload=self.offload,
                                           mp_policy=self.precision.fsdp_policy())
        return parts.stages

    @property
    def shards_experts(self) -> bool:
        return self.sharded

    def wrap(self, module: nn.Module) -> nn.Module:
        if not self.sharded:  # FSDP2 replicate needs the real tensors; it leaves the experts out, as DDP does
            self.roots = replicate_units(module, self.dp_mesh, block_types=self.block_types, found=self.found,
                                         ignored=self.experts.parameters if self.experts is not None else ())
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

    Deferred, nothing is reduced during the schedule's many micro-batch backwards: after the last one the tied
    copies are summed over the pipeline, then every bucket is reduce-scattered once (the partitioner's
    ``defer_reduction``).
    """

    def __init__(self, dp_mesh: DeviceMesh, stage: int, bucket_cap_mb: float, offload: bool,
                 precision: ShardPrecision = FULL_PRECISION, deferred: bool = False) -> None:
        super().__init__(deferred)
        self.name = f"zero{stage}"
        self.dp_mesh, self.stage, self.bucket_cap_mb, self.offload = dp_mesh, stage, bucket_cap_mb, offload
        self.precision = precision
        self.partitioner: ZeroPartitioner | None = None
        #: expert parallel: a second partitioner, of the expert weights over their own replicas (``expert_dp``)
        self.expert_partitioner: ZeroPartitioner | None = None

    @property
    def shards_experts(self) -> bool:
        return True

    def attach(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        experts = self.experts.parameters if self.experts is not None else ()
        self.partitioner = self._partitioner(module, optimizers, self.dp_mesh, exclude=experts)
        if self.experts is not None:
            # the experts' optimizer state (stage 2: and gradients) sharded over the ranks holding the same experts,
            # with fp32 masters under bf16-mixed-master as the others; their reduce-scatter divides by dp x cp
            ids = {id(p) for p in experts}
            others = [p for opt in optimizers for group in opt.param_groups for p in group["params"]
                      if id(p) not in ids]
            self.expert_partitioner = self._partitioner(
                module, optimizers, self.experts.mesh["expert_dp"], exclude=others,
                gradient_divide_factor=self.experts.data_parallel)

    def _partitioner(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], mesh: DeviceMesh,
                     **kwargs: Any) -> ZeroPartitioner:
        return ZeroPartitioner(module, optimizers, mesh, self.stage, self.bucket_cap_mb, self.offload,
                               defer_reduction=self.deferred, param_dtype=self.precision.param_dtype,
                               reduce_dtype=self.precision.reduce_dtype, grad_dtype=self.precision.grad_dtype,
                               **kwargs)

    @property
    def partitioners(self) -> list[ZeroPartitioner]:
        return [p for p in (self.partitioner, self.expert_partitioner) if p is not None]

    def set_enabled(self, enabled: bool) -> None:
        super().set_enabled(enabled)
        for partitioner in self.partitioners:
            partitioner.require_sync = enabled

    def finish_grad_sync(self) -> None:
        for partitioner in self.partitioners:
            partitioner.finish_gradient_sync()  # the last buckets (all of them when deferred)

    def after_step(self) -> None:
        for partitioner in self.partitioners:
            # each rank stepped its chunk; everyone gets all of them. Left running: each bucket's gather is waited
            # for in a forward pre-hook of its modules; state_dict, checkpoints and unwrap wait for all of them
            partitioner.gather_parameters()

    def unwrap(self, module: nn.Module, interrupted: bool = False) -> nn.Module:
        for partitioner in self.partitioners:
            # its hooks go, the partitioner stays: the optimizers still hold its bucket shards, and a save after fit
            # (trainer.save_checkpoint) maps them to the parameters through it. remove() first waits for the
            # gathers of the last step, which no forward waits for now
            partitioner.remove()
        if not interrupted:
            for partitioner in self.partitioners:
                # the module back in its own dtype with the fp32 masters' values (a collective, so not after a
                # failure: a rank may be gone; the module then stays in the buckets' dtype)
                partitioner.restore_parameters()
        return module

    @property
    def states(self) -> ParamStates:
        # once the optimizers hold bucket shards (attach), the weights are saved from and loaded into the shards --
        # the experts' too, from their own partitioner's
        return ZeroStates(*self.partitioners) if self.partitioner is not None else PARAM_STATES

    def norm_grads(self, params: Sequence[Tensor], exclude: Collection[int] = ()) -> list[Tensor]:
        # the optimizer holds bucket shards; a tied copy counted elsewhere is zeroed inside its bucket's shard
        if not exclude or self.partitioner is None:
            return super().norm_grads(params)
        return self.partitioner.norm_grads(exclude, shards={id(p) for p in params})


def choose_gradient_sync(layout: Layout, dp_mesh: DeviceMesh, fitting: bool,
                         precision: ShardPrecision = FULL_PRECISION, experts: ExpertGradients | None = None) -> NoSync:
    """The one owner of data-parallel gradient synchronisation for this layout (see the table above).

    ``precision``: the ZeRO owners' dtypes under mixed precision (the precision plugin's ``shard_precision``).
    ``experts``: expert parallel's expert weights, which the owner leaves out (known once the model is laid out:
    the owner chosen before is given them then).

    ZeRO-3 shards parameters for evaluation too (that is what lets a model larger than one device be evaluated);
    every other owner exists only while fitting.
    """
    owner = _owner(layout, dp_mesh, fitting, precision)
    owner.experts = experts
    return owner


def _owner(layout: Layout, dp_mesh: DeviceMesh, fitting: bool, precision: ShardPrecision) -> NoSync:
    stage = layout.zero_stage
    offload = layout.offload_parameters or layout.offload_optimizer
    # a pipeline schedule runs many micro-batch backwards: the owner reduces once, after the last
    deferred = layout.pp > 1
    if stage == 3:
        return FSDPSync(dp_mesh, shard=True, offload=offload, block_types=layout.block_types, precision=precision,
                        deferred=deferred)
    if not fitting:
        return NoSync()
    if stage in (1, 2):  # also with one replica: the optimizer state keeps one format for any dp size
        return ZeroSync(dp_mesh, stage, layout.bucket_cap_mb, layout.offload_optimizer, precision=precision,
                        deferred=deferred)
    if dp_mesh.size() == 1:
        return NoSync()
    if layout.tp > 1 and not deferred:
        return FSDPSync(dp_mesh, shard=False, block_types=layout.block_types)  # DDP cannot take DTensors
    return DDPSync(dp_mesh, layout.bucket_cap_mb, deferred=deferred)
