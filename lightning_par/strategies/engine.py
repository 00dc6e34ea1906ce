"""The engine's Lightning face: one ``ParallelStrategy`` that applies a :class:`~lightning_par.parallel.layout.Layout`.

Every public strategy is a thin preset of :class:`LayoutStrategy` (strategies/presets.py, planned.py). Its base
(strategies/mesh.py) holds the ranks, process group and mesh; this file is the glue of the layout's setup, in one
order for every layout: the owner of data-parallel gradients is chosen
(:func:`~lightning_par.parallel.gradient_sync.choose_gradient_sync`), the model is split into this rank's part
(:func:`~lightning_par.parallel.parts.split`: the whole model, or its pipeline stages),
:func:`~lightning_par.parallel.parallelize.parallelize` applies every transform to the part (and materialises the
share of a model built deferred, strategies/construction.py), then the runner of the part is built. The step's hooks
are strategies/step.py's; the checkpoint hooks are the owners' (plugins/layout_checkpoints.py).
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import AbstractContextManager, contextmanager
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from lightning_par._compat import optimizers_to_device as _optimizers_to_device
from lightning_par._compat import set_device_mesh
from lightning_par.parallel.compile import BlockCompiler, CompileOptions
from lightning_par.parallel.context_parallel import ContextParallel
from lightning_par.parallel.expert_parallel import ExpertGradients, prepare_expert_parallel
from lightning_par.parallel.gradient_sync import NoSync, choose_gradient_sync
from lightning_par.parallel.layout import Layout
from lightning_par.parallel.parallelize import ParallelizeConfig, parallelize
from lightning_par.parallel.parts import ModelParts, agreed, split
from lightning_par.parallel.pipeline.loss import last_stage_loss
from lightning_par.parallel.pipeline.runtime import PipelineRuntime
from lightning_par.parallel.runners import Runner, SingleRunner
from lightning_par.parallel.tensor_parallel import TensorParallelPlan, check_layout_plan
from lightning_par.plugins.checkpoint_io import AtomicCheckpointIO
from lightning_par.plugins.layout_checkpoints import LayoutCheckpoints
from lightning_par.plugins.precision import LayoutPrecision
from lightning_par.run import shutdown
from lightning_par.run.bad_steps import NonFiniteFlags, NonFiniteStop, check_policy
from lightning_par.run.data_position import resumable_train_loader
from lightning_par.run.elastic import AttemptProgress
from lightning_par.run.heartbeat import Heartbeat
from lightning_par.run.heartbeat import check_timeout as check_heartbeat_timeout
from lightning_par.run.preemption import Preempted, PreemptionCheckpoint
from lightning_par.strategies.compile_report import CompileReport
from lightning_par.strategies.construction import Construction
from lightning_par.strategies.mesh import MeshStrategy
from lightning_par.strategies.options import described
from lightning_par.strategies.step import LayoutStep
from lightning_par.topology import Size

log = logging.getLogger(__name__)


@described
class LayoutStrategy(MeshStrategy):
    """Train a LightningModule on a (pp, dp, cp, tp) device mesh with the given layout.

    The options are described in :mod:`lightning_par.strategies.options` (``help(LayoutStrategy)`` and the CLI's
    ``--trainer.strategy.help`` show them).
    """

    strategy_name = "lightning_par"

    def __init__(
        self,
        dp: Size = "auto",
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
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
        aux_loss_scope: str | None = None,
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
        super().__init__(process_group_backend, timeout, accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, precision_plugin=precision_plugin,
                         checkpoint_io=checkpoint_io if checkpoint_io is not None else AtomicCheckpointIO())
        self.layout = Layout(
            dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, zero_stage=zero_stage, offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters, schedule=schedule, n_microbatches=n_microbatches,
            virtual_stages=virtual_stages, stage_costs=stage_costs, sequence_parallel=sequence_parallel,
            recompute=recompute, block_types=block_types, bucket_cap_mb=bucket_cap_mb, aux_loss_scope=aux_loss_scope)
        self.precision_plugin = self._precision_plugin  # checks the precision against the layout, now it exists
        self._heartbeat_timeout = check_heartbeat_timeout(heartbeat_timeout)  # in the launching process
        self._heartbeat: Heartbeat | None = None
        # checkpoint state, save, load, the non-finite guard and `last` links (the owner answers the state)
        self.checkpoints = LayoutCheckpoints(self, async_save)
        self.nonfinite_flags = NonFiniteFlags(nonfinite, check_policy(nonfinite, nonfinite_patience))
        self._run_guard: PreemptionCheckpoint | None = None
        self._step = LayoutStep(self)  # the step's hooks under this layout (strategies/step.py)
        self.compile_options = CompileOptions.of(compile)  # checked here, in the launching process
        self.compiler: BlockCompiler | None = None  # the blocks' compiler and its counts (from setup)
        # the mode components this layout switched on (set in setup)
        self._runner: Runner = SingleRunner()  # the PipelineRuntime under pp > 1 (from setup)
        self._tensor_parallel: TensorParallelPlan | None = None
        self._gradient_sync: NoSync = NoSync()
        self._construction = Construction()  # a model built deferred (until setup materialises its share), laid out
        self.pretrained: Any = None  # weights read into the shards instead of the initialisation (FromPretrained)
        self.materialized: dict[str, int] = {}  # bytes this rank materialised at setup (deferred init)
        self._context_parallel: ContextParallel | None = None  # cp > 1: the step's batch transform and context
        self._sync_fits = False  # the data-parallel owner was chosen for fitting (it holds the ZeRO-1/2 shards)
        self._experts: ExpertGradients | None = None  # ep > 1: the expert weights, no data-parallel owner's (setup)

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

    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader gets a sampler whose position is saved in checkpoints, in place of the
        DistributedSampler Lightning injected (:mod:`~lightning_par.run.data_position`): a run resumed from a
        mid-epoch checkpoint, under this layout or another with the same global batch, trains on the samples the
        uninterrupted run would have. Evaluation and prediction loaders are left as Lightning made them."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None and trainer.training:
            return resumable_train_loader(dataloader, trainer)
        return dataloader

    def setup_environment(self) -> None:
        super().setup_environment()  # the process group (strategies/mesh.py)
        if self._heartbeat_timeout and self.world_size > 1:  # every rank has joined: from here a lost one is named
            assert self.cluster_environment is not None
            self._heartbeat = Heartbeat(self.global_rank, self.world_size, self.cluster_environment.main_address,
                                        self.cluster_environment.main_port, self._heartbeat_timeout)
            self._heartbeat.start()
        self.checkpoints.start()  # the async saver's process group: every rank, now
        self._agree_on_rng_state()
        if not self._applied():  # a model laid out already keeps its mesh (its DTensors live on it)
            self._choose_layout()
            self._build_mesh()
        assert self.lightning_module is not None
        # LightningModule.device_mesh reads this, as under Lightning's ModelParallelStrategy.
        set_device_mesh(self.lightning_module, self._device_mesh)
        rank_zero_info(f"{type(self).__name__}: {self.dims.describe()}, backend {self._process_group_backend}\n"
                       f"{self.dims.rank_table()}")

    def _choose_layout(self) -> None:
        """Where a strategy that picks its layout at launch (PlannedStrategy) sets ``self.layout``: every rank has
        joined, nothing is built yet."""

    # ----------------------------------------------------------------------------------------------------------------
    # Applying the layout: pipeline split, identical replicas, tensor parallel, then the data-parallel owner
    # ----------------------------------------------------------------------------------------------------------------
    def _applied(self) -> bool:
        return self._construction.laid_out(self.lightning_module)

    def setup(self, trainer: Trainer) -> None:
        # a stage called under torch.inference_mode() (Lightning's own tests do) still builds and moves ordinary
        # parameters: an inference tensor cannot become a Parameter (DTensor's swap fails), nor train in a later fit
        with torch.inference_mode(False):
            self._setup(trainer)

    def _setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.device = self.precision_plugin.device or self.root_device.type  # autocast's
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            # SIGTERM: agreed, saved, exit 75 (preemption.py); the step reached, for the next attempt's steps lost;
            # the fit's compile summary at its end (nothing without compile)
            _add_callbacks(trainer, PreemptionCheckpoint, AttemptProgress, CompileReport)
        self._run_guard = next((c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint)), None)
        # under 16-mixed the gradient scaler skips overflowing steps itself: only the loss is checked
        self.nonfinite_flags.check_grads = self.precision_plugin.precision != "16-mixed"
        if self._applied():
            self._setup_again(trainer, fitting)
            return
        self._claim()
        self._construction.adopt_pending(self.lightning_module)  # init_module(empty_init=True), no configure_model
        self.precision_plugin.convert_module(self.model)
        self.checkpoints.own_last_links(trainer)
        check_layout_plan(self.lightning_module, self.dims.tp, self.layout.sequence_parallel, self.layout.zero_stage,
                          self.dims.ep)
        # the one owner of data-parallel gradients, chosen first: its `shard` is the last transform of `parallelize`
        # (FSDP2 at ZeRO-3, with the precision's dtypes: bf16 buckets with fp32 master shards at ZeRO-1/2,
        # MixedPrecisionPolicy at ZeRO-3)
        self._choose_gradient_sync(fitting)
        # split -> parallelize -> runner (torchtitan's pipeline_llm order): under pp the LightningModule holds only
        # this rank's stages from the split on, the rest of the model is never materialised
        parts = self._split()
        if parts.pipeline is None:
            rank_zero_info(parts.describe_blocks())  # after the checks that can refuse the layout
            self._parallelize(parts)
        else:
            cut = parts.pipeline  # its loss is refused before any collective
            loss_fn = last_stage_loss(self.lightning_module, cut.module, cut.model_loss, self.dims.pp)
            rank_zero_info(parts.describe_blocks())  # after the checks that can refuse the layout
            # this rank's stages differ from the other pipeline ranks': a failure on one stops them all
            with agreed(self.device_mesh["pp"].get_group(), "prepare its stages"):
                self._parallelize(parts)
            self._run_pipeline(parts, loss_fn)
        self.pretrained = None  # read into the shards (FromPretrained sets it again before each run)
        self._construction.done(self.lightning_module)
        self.model = self._gradient_sync.wrap(self.model)
        self._finish_setup(trainer, fitting)

    def _claim(self) -> None:
        assert self.lightning_module is not None
        self._construction.claim(self.lightning_module, self.layout.shards_parameters,
                                 f"{type(self).__name__}, {self.dims.describe()}")

    def _choose_gradient_sync(self, fitting: bool) -> None:
        self._gradient_sync = choose_gradient_sync(self.layout, self.grad_mesh, fitting,
                                                   self.precision_plugin.shard_precision(self.layout.zero_stage),
                                                   self._experts)
        self._sync_fits = fitting

    def _setup_again(self, trainer: Trainer, fitting: bool) -> None:
        """A later stage of the model laid out already (``trainer.fit(model); trainer.test(model)``): the split,
        slices and shards stay. Evaluation keeps the data-parallel owner as fit left it (ZeRO-1/2's partitioner maps
        the optimizer's bucket shards to parameters for a save); a fit after evaluation gets its owner now."""
        assert self.lightning_module is not None
        self.lightning_module.to(self.root_device)  # Lightning's teardown moved it to the CPU
        if fitting:
            if not self._sync_fits and self.layout.zero_stage != 3:  # (ZeRO-3's owner shards for evaluation too)
                self._choose_gradient_sync(fitting)
            self._sync_fits = True
            self.model = self._gradient_sync.wrap_again(self.model)
        self._finish_setup(trainer, fitting)

    def _finish_setup(self, trainer: Trainer, fitting: bool) -> None:
        assert self.lightning_module is not None
        self._step.attach(trainer, fitting)
        if fitting:
            self.setup_optimizers(trainer)
            self._gradient_sync.attach(self.lightning_module, self.optimizers)
            self._runner.grad_sync_func = self._gradient_sync.start_grad_sync  # (a pipeline's stages, as they end)
            # Lightning's clipping computes the norm of what this rank holds; clip by the whole model's instead
            self.precision_plugin.clip_grad_by_norm = self._step.clip_by_global_norm
        self._scope_metrics_to_data_parallel()
        over = self.dims.describe_gradient_group()
        rank_zero_info(f"data-parallel gradients: {self._gradient_sync.name} over {over}")
        self.setup_precision_plugin()
        if fitting and not self.layout.offload_optimizer:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, parts: ModelParts) -> None:
        """Apply the layout to this rank's part, in place (:func:`~lightning_par.parallel.parallelize.parallelize`:
        one order for every layout)."""
        self.compiler = self.compile_options and self.compile_options.compiler(self.root_device, self.layout.stage_plan)
        config = ParallelizeConfig(device=self.root_device, dp_mesh=self.grad_mesh,
                                   tp_mesh=self.device_mesh["tp"], sequence_parallel=self.layout.sequence_parallel,
                                   recompute=self.layout.recompute, compile=self.compiler,
                                   parameter_device=torch.device("cpu") if self._gradient_sync.parameters_on_host
                                   else None, cp_mesh=self.device_mesh["cp"], expert_mesh=self.expert_mesh,
                                   aux_loss_scope=self.layout.aux_loss_scope)
        done = parallelize(parts, config, self._gradient_sync.shard, deferred=self._construction.take(),
                           pretrained=self.pretrained)
        self._tensor_parallel, self._context_parallel = done.tensor_parallel, done.context_parallel
        self._experts = None if done.experts is None else ExpertGradients(done.experts, self.dims.dp * self.dims.cp)
        self._gradient_sync.experts = self._experts  # averaged over their replicas in finalize, not by the owner
        for line in done.summary(config, len(parts.blocks), getattr(self.pretrained, "path", None)):
            rank_zero_info(line)
        self.materialized = done.stats

    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """When the layout splits parameters (ZeRO-3, tp or pp), ``configure_model`` builds the model without
        memory (deferred: large tensors on the meta device, their initialisation recorded); the layout is applied
        on meta and each rank then materialises only its share -- its stages, its tensor-parallel slices, its
        ZeRO-3 shards -- with the values a single process would have drawn (strategies/construction.py). The full
        model never exists on any rank."""
        if self._applied():  # a later stage: configure_model finds its model built and laid out
            yield None
            return
        self._claim()
        with self._construction.configure_model(lambda: self.lightning_module, self.layout.shards_parameters):
            yield None

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
        with self.root_device, self.precision_plugin.tensor_init_context(), self._construction.init_module():
            yield None

    def _split(self) -> ModelParts:
        """This rank's part of the model (:func:`~lightning_par.parallel.parts.split`), its blocks found once (ZeRO-3
        and replicate groups, recompute, compile and the pipeline units are built from them)."""
        lm, layout = self.lightning_module, self.layout
        assert lm is not None
        pp_mesh = self.device_mesh["pp"] if self.dims.pp > 1 else None
        if pp_mesh is not None:
            self.checkpoints.remember_unsplit(lm)  # the whole model's entries, for lightning_module_state_dict
            if self.dims.ep > 1:  # the whole model's expert layers: a rank's stages may hold none
                prepare_expert_parallel(lm, self.dims.ep)
        return split(lm, layout.stage_plan, pp_mesh, block_types=layout.block_types, costs=layout.stage_costs,
                     holder=True, need_blocks=layout.transforms_blocks(compiled=self.compile_options is not None))

    def _scope_metrics_to_data_parallel(self) -> None:
        """torchmetrics sync over the data-parallel group: the tp / pp ranks of one replica saw the same samples."""
        from torchmetrics import Metric

        assert self.lightning_module is not None
        for module in self.lightning_module.modules():
            if isinstance(module, Metric):
                module.process_group = self.device_mesh["dp"].get_group()

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        self._step.check_batch(batch)  # on the host, where it costs no device sync
        return super().batch_to_device(batch, device, dataloader_idx)

    # ----------------------------------------------------------------------------------------------------------------
    # Pipeline parallel (pp > 1): the schedule runs forward and backward inside ``training_step``
    # ----------------------------------------------------------------------------------------------------------------
    def _run_pipeline(self, parts: ModelParts, loss_fn: Any) -> None:
        """The runner of this rank's transformed stages: torch's stages and schedule (the PipelineRuntime); its loss
        scale and Lightning's backward are set per Trainer stage (:meth:`~lightning_par.strategies.step.LayoutStep.
        attach`)."""
        pipeline = PipelineRuntime(parts, self.device_mesh["pp"], loss_fn, device=self.root_device, loss_scale=1.0)
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

    #: the error the run stopped with (on_exception), which teardown must not replace with its own
    _failure: BaseException | None = None

    def on_exception(self, exception: BaseException) -> None:
        self._failure = exception
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
            self._step.detach()
            if self.model is not None:
                self.model = self._gradient_sync.unwrap(self.model, interrupted=_interrupted(self.model))
            if self.compiler is not None:
                # before Lightning moves the model to the CPU (see BlockCompiler.release)
                self.compiler.release(self.lightning_module)
            # (moves the model to the CPU: ordinary tensors, as in setup, under a stage run in inference mode)
            with self._construction.unmaterialised_stays(self.lightning_module), torch.inference_mode(False):
                try:
                    super().teardown()
                except Exception as err:
                    if self._failure is None:
                        raise
                    # (the failed step's traceback still holds the parameters, so moving a DTensor one -- which
                    # swaps tensors -- fails; the run's own error is the one to raise, which Lightning does next)
                    log.warning("lightning-par: teardown after the run failed could not finish (%s: %s)",
                                type(err).__name__, err)

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


def _interrupted(module: Any) -> bool:
    """The fit of ``module`` (a LightningModule) ended by an exception (Lightning's teardown after it)."""
    try:
        return module.trainer.state.status == TrainerStatus.INTERRUPTED
    except (AttributeError, RuntimeError):  # not a LightningModule, or not attached to a Trainer
        return False


def _add_callbacks(trainer: Trainer, *kinds: type) -> None:
    """Each callback of ``kinds`` the user did not add (with their own arguments), added with its defaults."""
    trainer.callbacks.extend([kind() for kind in kinds if not any(isinstance(c, kind) for c in trainer.callbacks)])
