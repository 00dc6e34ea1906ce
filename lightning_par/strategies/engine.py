"""The engine's Lightning face: one ``ParallelStrategy`` that applies a :class:`~lightning_par.parallel.layout.Layout`.

Every public strategy (ZeroStrategy, MegatronTPStrategy, PipelineStrategy, Hybrid3DStrategy) is a thin preset of
:class:`LayoutStrategy`. This file holds only Lightning glue -- launcher, cluster environment, process group, mesh,
sampler, collectives for logging, the step hooks (strategies/step.py), checkpoint hooks. The model transforms live in
:mod:`lightning_par.parallel`: :meth:`LayoutStrategy.setup` picks the one owner of data-parallel gradients
(:func:`~lightning_par.parallel.gradient_sync.choose_gradient_sync`), splits the model into this rank's part
(:func:`~lightning_par.parallel.parts.split`: the whole model, or this rank's pipeline stages), hands the part to
:func:`~lightning_par.parallel.parallelize.parallelize`, which applies every layout in one order: replicas identical,
tensor parallel, recompute, (compile), the owner's data-parallel sharding, then materialisation of this rank's share
of a model built deferred in ``configure_model`` (:meth:`LayoutStrategy.model_sharded_context`) -- and, under
pipeline parallel, builds the runner of the transformed stages last.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par._compat import _SubprocessScriptLauncher, set_device_mesh, set_skip_backward
from lightning_par._compat import default_process_group_backend as _get_default_process_group_backend_for_device
from lightning_par._compat import distributed_is_initialized as _distributed_is_initialized
from lightning_par._compat import init_dist_connection as _init_dist_connection
from lightning_par._compat import optimizers_to_device as _optimizers_to_device
from lightning_par._compat import sync_ddp_if_available as _sync_ddp_if_available
from lightning_par.data_position import resumable_train_loader
from lightning_par.elastic import AttemptProgress, layouts_for
from lightning_par.parallel import shutdown
from lightning_par.parallel.bad_steps import NonFiniteFlags, NonFiniteStop, check_policy
from lightning_par.parallel.blocks import ModelBlocks, find_blocks
from lightning_par.parallel.compile import BlockCompiler, CompileOptions
from lightning_par.parallel.context_parallel import ContextParallel
from lightning_par.parallel.deferred_init import DeferredInit, deferred_init
from lightning_par.parallel.gradient_sync import NoSync, choose_gradient_sync
from lightning_par.parallel.heartbeat import Heartbeat
from lightning_par.parallel.heartbeat import check_timeout as check_heartbeat_timeout
from lightning_par.parallel.layout import Layout
from lightning_par.parallel.parallelize import ParallelizeConfig, parallelize
from lightning_par.parallel.parallelize import describe as describe_materialized
from lightning_par.parallel.parts import ModelParts, agree, split
from lightning_par.parallel.pipeline.loss import last_stage_loss
from lightning_par.parallel.pipeline.runtime import PipelineRuntime
from lightning_par.parallel.preemption import Preempted, PreemptionCheckpoint
from lightning_par.parallel.runners import Runner, SingleRunner
from lightning_par.parallel.tensor_parallel import TensorParallelPlan, check_packed_layout, check_tp_plan
from lightning_par.plugins.checkpoint_io import AtomicCheckpointIO
from lightning_par.plugins.layout_checkpoints import LayoutCheckpoints
from lightning_par.plugins.precision import LayoutPrecision
from lightning_par.strategies.compile_report import CompileReport
from lightning_par.strategies.step import LayoutStep
from lightning_par.topology import LayoutError, ParallelDims, Size, build_device_mesh, gradient_mesh

log = logging.getLogger(__name__)


class LayoutStrategy(ParallelStrategy):
    """Train a LightningModule on a (pp, dp, cp, tp) device mesh with the given layout.

    Args:
        dp: data-parallel size, or ``"auto"`` for world size / (tp * pp * cp).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        cp: context-parallel size: each sequence is split over ``cp`` ranks (causal load balancing: rank i keeps
            chunks i and 2cp-1-i of 2cp), attention runs over the whole sequence (keys and values all-gathered),
            the model gets global ``position_ids``, the loss is the token mean of the whole batch and gradients are
            averaged over dp x cp. The sequence length must divide by 2 * cp (see docs/context-parallel.md).
        zero_stage: ZeRO stage across data parallel: 0 replicas, gradients all-reduced (DDP); 1 optimizer states
            sharded; 2 + gradients sharded; 3 + parameters sharded (FSDP2).
        offload_optimizer: stages 1-3: keep the sharded optimizer state in host memory and run the step there.
        offload_parameters: stage 3: keep the resting parameter shards in host memory too.
        schedule: pp > 1: the pipeline schedule (see ``lightning_par.parallel.stage_plan.SCHEDULES``).
        n_microbatches: pp > 1: micro-batches per batch; default 2 * pp.
        virtual_stages: pp > 1: stages per pipeline rank; default 1, or 2 for the interleaved and V schedules.
        stage_costs: pp > 1: relative cost per pipeline unit (a list, or a dict by unit name) to balance the stages;
            default: balance by unit count.
        sequence_parallel: tp > 1: also split the sequence over the tensor-parallel ranks where activations would
            be replicated (norms, residual stream); each block's all-reduce becomes an all-gather + reduce-scatter.
        recompute: activation recompute per block: ``"none"``, ``"selective"`` (the attention core, Megatron's
            selective recompute) or ``"full"`` (each block keeps only its input and runs forward again in backward).
        compile: ``torch.compile`` each repeated block in place, after tensor parallel and recompute and before
            data-parallel sharding (:mod:`lightning_par.parallel.compile`): ``True``, or a dict of options
            (``backend``, ``mode``, ``fullgraph``, ``dynamic``, ``options``), or a
            :class:`~lightning_par.parallel.compile.CompileOptions` (not in the type hint, so that the command line
            takes true/false or a dict and lists no sub-options). Graphs and recompiles are counted; the fit
            ends with their summary and ``compile/*`` scalars in the logger.
        block_types: the classes (or class names) of the model's repeated blocks, for a model whose blocks cannot
            be found otherwise (see :func:`lightning_par.parallel.blocks.find_blocks`); used by ZeRO-3 and
            data-parallel grouping and by the pipeline split.
        bucket_cap_mb: gradient bucket size for the data-parallel all-reduce, in MiB (as in DDP).
        process_group_backend: ``"gloo"``, ``"nccl"`` or a per-device string such as ``"cpu:gloo,cuda:nccl"``;
            by default ``"cpu:gloo,cuda:nccl"`` on CUDA (CPU tensors, e.g. offloaded gradients' norms, can still
            take part in a collective), gloo on CPU.
        timeout: how long a collective may wait before the process group gives up (a last resort: a long one
            also cuts legitimately slow collectives).
        heartbeat_timeout: seconds after which a rank that died or froze is named and every other rank stops
            (exit code 75) instead of waiting in a collective (:mod:`lightning_par.parallel.heartbeat`); at least
            1.5 (three beats); ``None`` or 0 turns the check off.
        async_save: sharded layouts: write checkpoints in the background with DCP's ``async_save`` (training stalls
            only for the copy to host memory); committed atomically when complete, at most one in flight, an error
            raised at the next save or at teardown (:mod:`lightning_par.plugins.async_checkpoint`).
        nonfinite: what a step whose loss or gradient norm is not finite does, agreed on every rank in the per-step
            flag (:mod:`lightning_par.parallel.bad_steps`): ``"stop"`` ends the run naming the step (no host sync;
            on a GPU one step late); ``"skip"`` discards the step's gradients (a host sync per step on a GPU).
            Either way a checkpoint with non-finite weights is refused and never replaces the last finite one.
        nonfinite_patience: consecutive non-finite steps before the run stops: default 1 under ``"stop"``, 10 under
            ``"skip"``.
        accelerator: set by the Trainer from ``Trainer(accelerator=...)``; leave unset.
        parallel_devices: set by the Trainer from ``Trainer(devices=...)``; leave unset.
        cluster_environment: set by the Trainer (Lightning, torchrun, SLURM, ...); leave unset.
        checkpoint_io: a CheckpointIO plugin for one-file checkpoints (stage 0); default
            :class:`~lightning_par.plugins.checkpoint_io.AtomicCheckpointIO`.
        precision_plugin: set by the Trainer from ``Trainer(precision=...)`` (made a
            :class:`~lightning_par.plugins.precision.LayoutPrecision`); leave unset.
    """

    strategy_name = "lightning_par"

    def __init__(
        self,
        dp: Size = "auto",
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        zero_stage: int = 0,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        virtual_stages: int | None = None,
        stage_costs: list[float] | dict[str, float] | None = None,
        sequence_parallel: bool = False,
        recompute: str = "none",
        block_types: list[str] | None = None,
        bucket_cap_mb: float = 25.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        heartbeat_timeout: float | None = 60.0,
        async_save: bool = False,
        nonfinite: str = "stop",
        nonfinite_patience: int | None = None,
        compile: bool | dict[str, Any] = False,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO(),
            precision_plugin=precision_plugin,
        )
        self.layout = Layout(
            dp=dp, tp=tp, pp=pp, cp=cp, zero_stage=zero_stage, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, schedule=schedule, n_microbatches=n_microbatches,
            virtual_stages=virtual_stages, stage_costs=stage_costs, sequence_parallel=sequence_parallel,
            recompute=recompute, block_types=block_types, bucket_cap_mb=bucket_cap_mb,
        )
        self.precision_plugin = self._precision_plugin  # checks the precision against the layout, now it exists
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._heartbeat_timeout = check_heartbeat_timeout(heartbeat_timeout)  # in the launching process
        self._heartbeat: Heartbeat | None = None
        # checkpoint state, save, load, the non-finite guard and `last` links (the owner answers the state)
        self.checkpoints = LayoutCheckpoints(self, async_save)
        self.nonfinite_flags = NonFiniteFlags(nonfinite, check_policy(nonfinite, nonfinite_patience))
        self._run_guard: PreemptionCheckpoint | None = None
        self._step = LayoutStep(self)  # the step's hooks under this layout (strategies/step.py)
        self.compile_options = CompileOptions.of(compile)  # checked here, in the launching process
        self.compiler: BlockCompiler | None = None  # the blocks' compiler and its counts (from setup)
        self._num_nodes = 1
        self._dims: ParallelDims | None = None
        self._device_mesh: DeviceMesh | None = None
        self._grad_mesh: DeviceMesh | None = None
        # the mode components this layout switched on (set in setup)
        self._runner: Runner = SingleRunner()  # the PipelineRuntime under pp > 1 (from setup)
        self._tensor_parallel: TensorParallelPlan | None = None
        self._gradient_sync: NoSync = NoSync()
        self._deferred: DeferredInit | None = None  # the model's construction, replayed per rank (its share)
        self.pretrained: Any = None  # weights read into the shards instead of the initialisation (FromPretrained)
        self.materialized: dict[str, int] = {}  # bytes this rank materialised at setup (deferred init)
        self._context_parallel: ContextParallel | None = None  # cp > 1: the step's batch transform and context
        # the LightningModule this layout was applied to: a later stage of the same Trainer and model (fit, then
        # validate / test / predict, or fit again) keeps it as it is -- split, sliced and sharded once
        self._laid_out: nn.Module | None = None
        self._token = object()  # marks the models this strategy laid out (see _refuse_laid_out_elsewhere)
        self._sync_fits = False  # the data-parallel owner was chosen for fitting (it holds the ZeRO-1/2 shards)
        self._pending_init: DeferredInit | None = None  # the record of Trainer.init_module(empty_init=True)

    @property
    def precision_plugin(self) -> LayoutPrecision:
        """Always a :class:`LayoutPrecision`: the one Lightning made from ``Trainer(precision=...)`` is replaced
        (as FSDPStrategy does with its own), so each ZeRO owner gets its dtypes; a mode the layout cannot run is
        refused here, before launch."""
        if self._precision_plugin is None:
            self._precision_plugin = LayoutPrecision()  # kept: the strategy sets its global clipping on it
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        self._precision_plugin = LayoutPrecision.adopt(plugin)
        if self._precision_plugin is not None and getattr(self, "layout", None) is not None:
            self._precision_plugin.check_layout(self.layout.zero_stage, self.layout.tp, self.layout.pp)
        self._check_precision_device()

    def _check_precision_device(self) -> None:
        """A bf16 mode on a GPU without bf16 is refused when the Trainer hands over the precision (it sets the
        accelerator first), before launch."""
        if self._precision_plugin is not None and isinstance(self.accelerator, CUDAAccelerator):
            self._precision_plugin.check_device("cuda")

    @property
    def pipeline(self) -> PipelineRuntime | None:
        """This rank's pipeline runtime (pp > 1, after setup): its stages, schedule and recording switch."""
        return self._runner if isinstance(self._runner, PipelineRuntime) else None

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sequence_parallel

    @property
    def gradient_sync(self) -> NoSync:
        """The one owner of data-parallel gradient synchronisation for this layout (after setup)."""
        return self._gradient_sync

    # ----------------------------------------------------------------------------------------------------------------
    # Sizes, ranks and the mesh
    # ----------------------------------------------------------------------------------------------------------------
    @property
    def is_distributed(self) -> bool:
        # Lightning's AcceleratorConnector only knows its own strategies; without this there is no
        # DistributedSampler and `self.log(..., sync_dist=True)` would not reduce.
        return True

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def dims(self) -> ParallelDims:
        """The resolved sizes; known as soon as the Trainer has told the strategy its devices and nodes."""
        if self._dims is None:
            self._dims = self.layout.resolve(self.world_size)
        return self._dims

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("The device mesh exists only after the processes have joined the process group.")
        return self._device_mesh

    @property
    def coordinates(self) -> dict[str, int]:
        """This rank's coordinates on the mesh, e.g. ``{"pp": 0, "dp": 1, "cp": 0, "tp": 0}``."""
        return self.dims.coordinates(self.global_rank)

    @property
    def grad_mesh(self) -> DeviceMesh:
        """The mesh data-parallel gradients are averaged over: ``dp``, or the flattened ``dp_cp`` under cp > 1 (the
        cp ranks of a replica saw different tokens of the same samples)."""
        if self._grad_mesh is None:
            self._grad_mesh = gradient_mesh(self.device_mesh)
        return self._grad_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # By data-parallel rank, not global rank: every TP/PP rank of one replica must see the same batch.
        return {"num_replicas": self.dims.dp, "rank": self.coordinates["dp"]}

    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader gets a sampler whose position is saved in checkpoints, in place of the
        DistributedSampler Lightning injected (:mod:`~lightning_par.data_position`): a run resumed from a
        mid-epoch checkpoint, under this layout or another with the same global batch, trains on the samples the
        uninterrupted run would have. Evaluation and prediction loaders are left as Lightning made them."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.training:
            return resumable_train_loader(dataloader, trainer)
        return dataloader

    @property
    def process_group_backend(self) -> str | None:
        return self._process_group_backend

    def set_world_ranks(self) -> None:
        # Called by the Trainer before any process is launched: the right moment to reject a layout that does
        # not fit the world size, while nobody waits on a collective yet.
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank
        self._dims = None
        try:
            _ = self.dims
        except LayoutError as err:  # e.g. an elastic attempt on fewer ranks than the layout needs: what would fit
            layout = self.layout
            raise LayoutError(f"{err} {layouts_for(self.world_size, layout.tp, layout.pp, layout.cp)}") from None

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._share_cpu_threads()
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = default_backend(self.root_device)
        assert self.cluster_environment is not None
        if not dist.is_initialized():  # ours to destroy at exit, before the interpreter finalizes (exit code 0)
            shutdown.close_at_exit()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              **_attempt_store(self.cluster_environment, self._timeout))
        if self._heartbeat_timeout and self.world_size > 1:  # every rank has joined: from here a lost one is named
            self._heartbeat = Heartbeat(self.global_rank, self.world_size, self.cluster_environment.main_address,
                                        self.cluster_environment.main_port, self._heartbeat_timeout)
            self._heartbeat.start()
        self.checkpoints.start()  # the async saver's process group: every rank, now
        self._agree_on_rng_state()
        if not self._applied():  # a model laid out already keeps its mesh (its DTensors live on it)
            self._choose_layout()
            self._device_mesh = build_device_mesh(self.dims, self.root_device.type)
            self._grad_mesh = None
        assert self.lightning_module is not None
        # LightningModule.device_mesh reads this, as under Lightning's ModelParallelStrategy.
        set_device_mesh(self.lightning_module, self._device_mesh)
        rank_zero_info(f"{type(self).__name__}: {self.dims.describe()}, backend {self._process_group_backend}\n"
                       f"{self.dims.rank_table()}")

    def _choose_layout(self) -> None:
        """Where a strategy that picks its layout at launch (PlannedStrategy) sets ``self.layout``: every rank has
        joined, nothing is built yet."""

    def _agree_on_rng_state(self) -> None:
        """Every rank continues from global rank 0's RNG state, as ``seed_everything`` would leave them: a model that
        ``configure_model`` draws from the global RNG is then the same on every rank, seeded or not, and so is each
        pipeline stage's share of it. (``setup`` broadcasts the weights over data parallel all the same.)"""
        states = [torch.get_rng_state(), torch.cuda.get_rng_state() if self.root_device.type == "cuda" else None]
        dist.broadcast_object_list(states, src=0)
        torch.set_rng_state(states[0])
        if states[1] is not None:
            torch.cuda.set_rng_state(states[1])

    def _share_cpu_threads(self) -> None:
        # Several CPU ranks on one machine each default to one thread per core and fight over the cores; split
        # them unless the user chose (OMP_NUM_THREADS), as torchrun does.
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and self.num_processes > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.num_processes))

    # ----------------------------------------------------------------------------------------------------------------
    # Applying the layout: pipeline split, identical replicas, tensor parallel, then the data-parallel owner
    # ----------------------------------------------------------------------------------------------------------------
    def _applied(self) -> bool:
        """Whether the LightningModule is the one this layout was applied to (a later stage of the same model)."""
        return self._laid_out is not None and self._laid_out is self.lightning_module

    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device = self.precision_plugin.device or self.root_device.type  # autocast's
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not any(isinstance(c, PreemptionCheckpoint) for c in trainer.callbacks):
            trainer.callbacks.append(PreemptionCheckpoint())  # SIGTERM: agreed, saved, exit 75 (preemption.py)
        if fitting and not any(isinstance(c, AttemptProgress) for c in trainer.callbacks):
            trainer.callbacks.append(AttemptProgress())  # the step reached, for the next attempt's steps lost
        if fitting and self.compile_options is not None and not any(isinstance(c, CompileReport)
                                                                    for c in trainer.callbacks):
            trainer.callbacks.append(CompileReport())  # the fit's compile summary, at its end
        self._run_guard = next((c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
        # under 16-mixed the gradient scaler skips overflowing steps itself: only the loss is checked
        self.nonfinite_flags.check_grads = self.precision_plugin.precision != "16-mixed"
        if self._applied():
            self._setup_again(trainer, fitting)
            return
        self._refuse_laid_out_elsewhere()
        if self._pending_init is not None:  # init_module(empty_init=True) without a configure_model hook
            record, self._pending_init = self._pending_init, None
            self._adopt(record)
        self.precision_plugin.convert_module(self.model)
        self.checkpoints.own_last_links(trainer)
        if self.dims.tp > 1:
            # the whole model's plan, before any split: a pattern that matches nothing anywhere stays an error, and a
            # size tp does not divide is refused on every rank alike, before any collective
            plan = check_tp_plan(self.lightning_module, self.dims.tp, self.layout.sequence_parallel)
            check_packed_layout(plan, self.layout.zero_stage)
        # the one owner of data-parallel gradients, chosen first: its `shard` is the last transform of `parallelize`
        # (FSDP2 at ZeRO-3, with the precision's dtypes: bf16 buckets with fp32 master shards at ZeRO-1/2,
        # MixedPrecisionPolicy at ZeRO-3)
        self._gradient_sync = choose_gradient_sync(self.layout, self.grad_mesh, fitting,
                                                   self.precision_plugin.shard_precision(self.layout.zero_stage))
        # split -> parallelize -> runner (torchtitan's pipeline_llm order): under pp the LightningModule holds only
        # this rank's stages from the split on, the rest of the model is never materialised
        parts = self._split()
        if parts.pipeline is None:
            self._log_blocks(parts)
            self._parallelize(parts)
        else:
            cut = parts.pipeline  # its loss is refused before any collective
            loss_fn = last_stage_loss(self.lightning_module, cut.module, cut.model_loss, self.dims.pp)
            self._log_blocks(parts)
            # this rank's stages differ from the other pipeline ranks': a failure on one stops them all
            agree(self.device_mesh["pp"].get_group(), "prepare its stages", lambda: self._parallelize(parts))
            self._run_pipeline(trainer, fitting, parts, loss_fn)
        self.pretrained = None  # read into the shards (FromPretrained sets it again before each run)
        self._laid_out, self._sync_fits = self.lightning_module, fitting
        self.model = self._gradient_sync.wrap(self.model)
        self._finish_setup(trainer, fitting)

    def _refuse_laid_out_elsewhere(self) -> None:
        """A model another Trainer's strategy split or sharded (its DTensors live on that strategy's mesh, a pipeline
        rank holds only its stages) cannot be laid out again; alike on every rank, before any collective."""
        lm = self.lightning_module
        # (what the strategy that laid it out left on the model: a token of that strategy, not the strategy itself,
        # which the model would keep alive)
        token, sharded, described = getattr(lm, "_lightning_par_laid_out", (None, False, ""))
        if token is not None and token is not self._token and sharded:
            raise LayoutError(
                f"{type(lm).__name__} was laid out by another Trainer's strategy ({described}: its parameters are "
                "split or sharded across the ranks). Run validate/test/predict (or fit again) on the same Trainer, "
                "or give a new Trainer a new model and the checkpoint (`ckpt_path=`, or `lightning-par export "
                "CKPT OUT.ckpt` and `load_from_checkpoint`).")
        lm._lightning_par_laid_out = (self._token, self.layout.shards_parameters,
                                      f"{type(self).__name__}, {self.dims.describe()}")

    def _setup_again(self, trainer: Trainer, fitting: bool) -> None:
        """A later stage of the model laid out already (``trainer.fit(model); trainer.test(model)``): the split,
        slices and shards stay. Evaluation keeps the data-parallel owner as fit left it (ZeRO-1/2's partitioner maps
        the optimizer's bucket shards to parameters for a save); a fit after evaluation gets its owner now."""
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)  # Lightning's teardown moved it to the CPU
        if fitting:
            if not self._sync_fits and self.layout.zero_stage != 3:  # (ZeRO-3's owner shards for evaluation too)
                self._gradient_sync = choose_gradient_sync(self.layout, self.grad_mesh, fitting,
                                                           self.precision_plugin.shard_precision(
                                                               self.layout.zero_stage))
            self._sync_fits = True
            self.model = self._gradient_sync.wrap_again(self.model)
        if self.pipeline is not None:
            accumulate = trainer.accumulate_grad_batches if fitting else 1
            self.pipeline.loss_scale = 1.0 / (self.layout.stage_plan.n_microbatches * accumulate)
            if fitting:
                set_skip_backward(trainer, True)
        self._finish_setup(trainer, fitting)

    def _finish_setup(self, trainer: Trainer, fitting: bool) -> None:
        assert self.lightning_module is not None
        if fitting:
            self.setup_optimizers(trainer)
            self._gradient_sync.attach(self.lightning_module, self.optimizers)
            self._runner.grad_sync_func = self._gradient_sync.start_grad_sync  # (a pipeline's stages, as they end)
            # Lightning's clipping computes the norm of what this rank holds; clip by the whole model's instead
            self.precision_plugin.clip_grad_by_norm = self._step.clip_by_global_norm
        self._scope_metrics_to_data_parallel()
        over = f"dp={self.dims.dp} x cp={self.dims.cp}" if self.dims.cp > 1 else f"dp={self.dims.dp}"
        rank_zero_info(f"data-parallel gradients: {self._gradient_sync.name} over {over}")
        self.setup_precision_plugin()
        if fitting and not self.layout.offload_optimizer:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, parts: ModelParts) -> None:
        """Apply the layout to this rank's part, in place (:func:`~lightning_par.parallel.parallelize.parallelize`:
        one order for every layout)."""
        if self.compile_options is not None:
            self.compile_options.check_device(self.root_device)
            self.compiler = BlockCompiler(self.compile_options,
                                          split_backward=self.layout.stage_plan.spec is not None
                                          and self.layout.stage_plan.spec.split_backward)
        config = ParallelizeConfig(device=self.root_device, dp_mesh=self.grad_mesh,
                                   tp_mesh=self.device_mesh["tp"], sequence_parallel=self.layout.sequence_parallel,
                                   recompute=self.layout.recompute, compile=self.compiler,
                                   parameter_device=torch.device("cpu") if self._gradient_sync.parameters_on_host
                                   else None, cp_mesh=self.device_mesh["cp"])
        done = parallelize(parts, config, self._gradient_sync.shard, deferred=self._deferred,
                           pretrained=self.pretrained)
        self._deferred = None
        self._tensor_parallel, self._context_parallel = done.tensor_parallel, done.context_parallel
        if done.tensor_parallel is not None:
            rank_zero_info(
                f"tensor parallel over tp={self.dims.tp}: plan applied to {len(done.tensor_parallel.styles)} modules"
                f"{' with sequence parallelism' if self.layout.sequence_parallel else ''}"
                f"{', vocab-parallel loss' if done.tensor_parallel.vocab_parallel_head else ''}")
        if done.context_parallel is not None:
            rank_zero_info(f"context parallel over cp={self.dims.cp}: load-balanced sequence shards, ring attention "
                           f"over the cp group, {done.context_parallel.described}")
        if self.layout.recompute != "none":
            rank_zero_info(f"activation recompute ({self.layout.recompute}) on {len(parts.blocks)} blocks of rank 0")
        if self.compiler is not None:
            rank_zero_info(f"{self.compile_options.describe()}: {len(parts.blocks)} blocks of rank 0")
        if "kept_bytes" in done.stats:
            rank_zero_info(f"deferred init: rank 0 {describe_materialized(done.stats)}")
        if "pretrained_tensors" in done.stats:
            rank_zero_info(f"pretrained weights: rank 0 read its slices of {done.stats['pretrained_tensors']} tensors "
                           f"from {self.pretrained.path}")
        self.materialized = done.stats

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """When the layout splits parameters (ZeRO-3, tp or pp), ``configure_model`` builds the model without
        memory (deferred: large tensors on the meta device, their initialisation recorded); the layout is applied
        on meta and each rank then materialises only its share -- its stages, its tensor-parallel slices, its
        ZeRO-3 shards -- with the values a single process would have drawn. The full model never exists on any
        rank."""
        if self._applied():  # a later stage: configure_model finds its model built and laid out
            yield None
            return
        self._refuse_laid_out_elsewhere()
        if self._pending_init is not None and not self._pending_init.stats["deferred_bytes"]:
            self._pending_init = None  # init_module built no large tensor: the model is configure_model's to build
        if not self.layout.shards_parameters and self._pending_init is None:
            yield None
            return
        if self._pending_init is not None:  # built under Trainer.init_module(empty_init=True) already
            record, self._pending_init = self._pending_init, None
            yield None  # (what configure_model adds now is built eagerly; its small tensors are broadcast below)
        else:
            with deferred_init() as record:
                yield None
        self._adopt(record)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``Trainer.init_module(empty_init=True)``: the model is built deferred, as in ``configure_model`` under a
        layout that splits parameters -- its large tensors on the meta device, their initialisation recorded -- and
        the strategy materialises each rank's share at setup with the values one process would have drawn (rather
        than leaving uninitialised memory, which only a checkpoint load would overwrite)."""
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield None
            return
        with self.root_device, self.precision_plugin.tensor_init_context(), deferred_init() as record:
            yield None
        self._pending_init = record

    def _adopt(self, record: DeferredInit) -> None:
        """Take a deferred construction as the model's: global rank 0's random draws and small tensors on every rank."""
        lm = self.lightning_module
        assert lm is not None
        if _distributed_is_initialized() and dist.get_world_size() > 1:
            # every rank takes global rank 0's construction: its random draws, replayed for the deferred tensors,
            # and its small tensors (made for real), broadcast -- small by definition. The replicas agree, and every
            # share (each stage, slice and shard) holds the single process's values, even where ranks drew
            # differently (unseeded, or seeded per rank); the weights themselves are never broadcast.
            states = [record.random_states()]
            dist.broadcast_object_list(states, src=0)
            record.use_random_states(states[0])
            for tensor in lm.state_dict().values():
                if isinstance(tensor, Tensor) and not tensor.is_meta:
                    dist.broadcast(tensor, src=0)
        record.capture(lm)
        self._deferred = record

    def _find_blocks(self) -> ModelBlocks:
        assert self.lightning_module is not None
        return find_blocks(self.lightning_module, self.layout.block_types)

    def _split(self) -> ModelParts:
        """This rank's part of the model (:func:`~lightning_par.parallel.parts.split`), its blocks found once (ZeRO-3
        and replicate groups, recompute, compile and the pipeline units are built from them)."""
        lm = self.lightning_module
        assert lm is not None
        pipelined = self.dims.pp > 1
        if pipelined:
            self.checkpoints.remember_unsplit(lm)  # the whole model's entries, for lightning_module_state_dict
        layout = self.layout
        per_block = (layout.zero_stage == 3 or layout.recompute != "none" or self.compile_options is not None
                     or self.dims.cp > 1)  # (context parallel hooks the module that runs the blocks)
        parts = split(lm, layout.stage_plan, self.device_mesh["pp"] if pipelined else None,
                      block_types=layout.block_types, costs=layout.stage_costs, holder=True, need_blocks=per_block)
        return parts

    def _log_blocks(self, parts: ModelParts) -> None:
        """Say which repeated blocks were found (ZeRO-3 and replicate groups, pipeline units are built from them);
        after the checks that can refuse the layout, so that a refusal is the last line of every rank."""
        mine = "rank 0's part: " if parts.pipeline is not None else ""
        rank_zero_info(f"blocks: {mine}{parts.found.describe()}" if parts.found is not None
                       else "blocks: none found; data parallel treats the model as one unit")

    def _scope_metrics_to_data_parallel(self) -> None:
        """torchmetrics sync over the data-parallel group: the tp / pp ranks of one replica saw the same samples."""
        from torchmetrics import Metric

        assert self.lightning_module is not None
        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.process_group = self.device_mesh["dp"].get_group()

    # ----------------------------------------------------------------------------------------------------------------
    # Context parallel (cp > 1): each step's batch cut along the sequence, attention over the whole of it while the
    # step runs (lightning_par.parallel.context_parallel; applied in parallelize)
    # ----------------------------------------------------------------------------------------------------------------
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        if self._context_parallel is not None:  # on the host, where it costs no device sync
            self._context_parallel.check_padding(batch)
        return super().batch_to_device(batch, device, dataloader_idx)

    def _shard_sequence(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """``(batch, ...)`` with the batch cut to this rank's share of each sequence (cp > 1)."""
        return args if self._context_parallel is None else self._context_parallel.shard_args(args)

    # ----------------------------------------------------------------------------------------------------------------
    # Pipeline parallel (pp > 1): the schedule runs forward and backward inside ``training_step``
    # ----------------------------------------------------------------------------------------------------------------
    def _run_pipeline(self, trainer: Trainer, fitting: bool, parts: ModelParts, loss_fn: Any) -> None:
        """The runner of this rank's transformed stages: torch's stages and schedule (the PipelineRuntime)."""
        accumulate = trainer.accumulate_grad_batches if fitting else 1
        pipeline = PipelineRuntime(parts, self.device_mesh["pp"], loss_fn, device=self.root_device,
                                   loss_scale=1.0 / (self.layout.stage_plan.n_microbatches * accumulate))
        if loss_fn is None:
            rank_zero_info(f"pipeline loss: {pipeline.model_loss.name} on the last stage, the token mean over each "
                           f"whole batch ({type(self.lightning_module).__name__} defines no loss_fn: the model call "
                           "in its training_step runs the schedule)")
        self._runner = pipeline
        # a weight held by several pipeline ranks (tied embedding and head) starts equal on all of them
        pipeline.make_tied_copies_equal()
        # forward (generation in predict_step, or any other call) runs through the pipeline, output on every rank
        pipeline.module.forward = pipeline.forward_only
        rank_zero_info(pipeline.stage_table())
        log.info(pipeline.describe())
        if fitting:
            # Lightning must not run backward or zero the gradients: the schedule does both (see training_step)
            set_skip_backward(trainer, True)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step.training_step(super().training_step, *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step.predict_step(super().predict_step, *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step.evaluation_step(super().validation_step, *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step.evaluation_step(super().test_step, *args, **kwargs)

    def global_grad_norm(self, optimizer: Any = None) -> Tensor:
        """The 2-norm of the whole model's gradient (what a single process would compute), on every rank; only
        ``optimizer``'s parameters if given (:meth:`~lightning_par.strategies.step.LayoutStep.global_grad_norm`)."""
        return self._step.global_grad_norm(optimizer)

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        return self._step.backward(super().backward, closure_loss, optimizer, *args, **kwargs)

    # ----------------------------------------------------------------------------------------------------------------
    # Data-parallel gradient sync: every hook goes to the one owner
    # ----------------------------------------------------------------------------------------------------------------
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    def block_backward_sync(self) -> AbstractContextManager:
        return self._step.block_backward_sync()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        return self._step.optimizer_step(super().optimizer_step, optimizer, closure, model, **kwargs)

    # ----------------------------------------------------------------------------------------------------------------
    # Collectives used by Lightning (logging, checkpoint paths, early stopping)
    # ----------------------------------------------------------------------------------------------------------------
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        holder = [obj]
        dist.broadcast_object_list(holder, src)
        return holder[0]

    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        """Reduce over the data-parallel group by default (what ``self.log(sync_dist=True)`` uses): the tensor- and
        pipeline-parallel ranks of one replica hold the same value, so a ``sum`` over all ranks would count it
        tp * pp times."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._device_mesh is not None:
            group = self._device_mesh["dp"].get_group()
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints: one file from rank 0 (Lightning's default) unless the layout shards; then a DCP directory
    # ----------------------------------------------------------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # states load into the layout's own (sharded, partitioned, split) model and optimizers: they must exist first
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self.checkpoints.lightning_restores_optimizer

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return self.checkpoints.model_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return self.checkpoints.optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        self.checkpoints.load_model_state(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        self.checkpoints.load_optimizer_state(checkpoint)

    @property
    def last_finite_checkpoint(self) -> str | None:
        """The newest checkpoint this run saved with finite weights (None before the first)."""
        return self.checkpoints.guard.last_finite

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        self.checkpoints.save(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return self.checkpoints.load(checkpoint_path, weights_only)

    def remove_checkpoint(self, filepath: Any) -> None:
        self.checkpoints.remove(filepath)

    def on_exception(self, exception: BaseException) -> None:
        if isinstance(exception, (Preempted, NonFiniteStop)):  # every rank stopped at the same step: agreed
            super().on_exception(exception)
            return
        # a rank that fails says so, and the others stop at once naming it (a rank that died is already reported by
        # the launcher -- Lightning's, or torchrun's agent -- and its collectives fail here at once)
        shutdown.mark_failed()
        if self._heartbeat is not None:
            self._heartbeat.name_lost_peer(exception)  # a failed collective: name the lost rank and stop (exit 75)
            self._heartbeat.stop(failed=True)
            self._heartbeat = None
        super().on_exception(exception)

    def teardown(self) -> None:
        try:
            self.checkpoints.wait()  # the last save commits (or its error is raised) before the run ends
        finally:
            if self._heartbeat is not None:
                self._heartbeat.stop()
                self._heartbeat = None
            if self._runner.takes_over_step and self.lightning_module is not None:
                set_skip_backward(self.lightning_module.trainer, False)
            if self.model is not None:
                self.model = self._gradient_sync.unwrap(self.model)
            if self.compiler is not None:
                # before Lightning moves the model to the CPU (see BlockCompiler.release)
                self.compiler.release(self.lightning_module)
            lm = self.lightning_module
            if lm is not None and any(t.is_meta for t in (*lm.parameters(), *lm.buffers())):
                # setup stopped (a LayoutError) before this rank materialised its share: there is nothing to move
                # to the CPU, and copying a meta tensor would raise over the error the user must see
                lm.cpu = lambda: lm
            try:
                super().teardown()
            finally:
                if lm is not None:
                    lm.__dict__.pop("cpu", None)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls,
            description="lightning-par engine: a (pp, dp, cp, tp) layout, data parallel by default"
        )
        for cp in (2, 4):  # any other layout with cp: --trainer.strategy.cp=N on this name or hybrid3d
            strategy_registry.register(f"context_parallel{cp}", cls, cp=cp,
                                       description=f"lightning-par engine: context parallel cp={cp}, dp = the rest")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout})"


def default_backend(device: torch.device) -> str:
    """The process group backend for ``device`` when the user names none: on CUDA, NCCL for CUDA tensors and gloo for
    CPU ones (a collective on a CPU tensor -- a norm of offloaded gradients, a tensor built on the host -- would
    otherwise fail on plain NCCL with "No backend type associated with device type cpu"); Lightning's choice
    elsewhere (gloo on CPU)."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return _get_default_process_group_backend_for_device(device)


def _attempt_store(environment: Any, timeout: timedelta) -> dict[str, Any]:
    """Under torchrun, the process group's store as a fresh namespace of each attempt of the job.

    torchrun's static rendezvous (``--master-addr/--master-port``, its default) keeps one agent store across
    ``--max-restarts``, and c10d's keys do not name the attempt: a restarted rank would read the previous attempt's
    addresses (gloo: "connectFullMesh failed ... Connection refused"). Empty outside torchrun (Lightning's default)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(environment.main_address, environment.main_port, is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"lightning_par/attempt_{attempt}/", store)}
