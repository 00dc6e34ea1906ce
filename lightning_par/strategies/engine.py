"""The engine's Lightning face: one ``ParallelStrategy`` that applies a :class:`~lightning_par.parallel.layout.Layout`.

Every public strategy (``ZeroStrategy`` today) is a thin preset of :class:`LayoutStrategy`. This file holds only
Lightning glue -- launcher, cluster environment, process group, mesh, sampler, collectives for logging, the
wrap/unwrap of the model; the model transforms themselves live in :mod:`lightning_par.parallel`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from lightning_par.parallel.data_parallel import replicate_data_parallel, replicate_units
from lightning_par.parallel.layout import Layout
from lightning_par.parallel.pipeline.runtime import (
    PipelineRuntime,
    ScheduleChoice,
    check_schedule_name,
    resolve_schedule,
)
from lightning_par.parallel.tensor_parallel import TensorParallelPlan, apply_tensor_parallel
from lightning_par.parallel.zero import ZeroPartitioner, check_partitionable, fully_shard_units
from lightning_par.plugins import sharded_checkpoint
from lightning_par.topology import LayoutError, ParallelDims, Size, build_device_mesh

log = logging.getLogger(__name__)


class LayoutStrategy(ParallelStrategy):
    """Train a LightningModule on a (pp, dp, tp) device mesh with the given layout.

    Args:
        dp: data-parallel size, or ``"auto"`` for world size / (tp * pp).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        zero_stage: ZeRO stage across data parallel: 0 replicas, gradients all-reduced (DDP); 1 optimizer states
            sharded; 2 + gradients sharded; 3 + parameters sharded (FSDP2).
        offload_optimizer: stages 1-3: keep the sharded optimizer state in host memory and run the step there.
        offload_parameters: stage 3: keep the resting parameter shards in host memory too.
        schedule: pp > 1: the pipeline schedule (see ``lightning_par.parallel.pipeline.runtime.SCHEDULES``).
        n_microbatches: pp > 1: micro-batches per batch; default 2 * pp.
        virtual_stages: pp > 1: stages per pipeline rank; default 1, or 2 for the interleaved and V schedules.
        stage_costs: pp > 1: relative cost per pipeline unit (a list, or a dict by unit name) to balance the stages;
            default: balance by unit count.
        sequence_parallel: tp > 1: also split the sequence over the tensor-parallel ranks where activations would
            be replicated (norms, residual stream); each block's all-reduce becomes an all-gather + reduce-scatter.
        bucket_cap_mb: gradient bucket size for the data-parallel all-reduce, in MiB (as in DDP).
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default nccl on CUDA, gloo on CPU.
        timeout: how long a collective may wait before the process group gives up, so a dead rank does not
            leave the others hanging forever.
        accelerator: set by the Trainer from ``Trainer(accelerator=...)``; leave unset.
        parallel_devices: set by the Trainer from ``Trainer(devices=...)``; leave unset.
        cluster_environment: set by the Trainer (Lightning, torchrun, SLURM, ...); leave unset.
        checkpoint_io: a CheckpointIO plugin, as for any Lightning strategy.
        precision_plugin: set by the Trainer from ``Trainer(precision=...)``; leave unset.
    """

    strategy_name = "lightning_par"

    def __init__(
        self,
        dp: Size = "auto",
        tp: int = 1,
        pp: int = 1,
        zero_stage: int = 0,
        offload_optimizer: bool = False,
        offload_parameters: bool = False,
        schedule: str = "1f1b",
        n_microbatches: int | None = None,
        virtual_stages: int | None = None,
        stage_costs: list[float] | dict[str, float] | None = None,
        sequence_parallel: bool = False,
        bucket_cap_mb: float = 25.0,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
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
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.layout = Layout(
            dp=dp,
            tp=tp,
            pp=pp,
            zero_stage=zero_stage,
            offload_optimizer=offload_optimizer,
            offload_parameters=offload_parameters,
        )
        check_schedule_name(schedule)
        self.schedule = schedule
        self.n_microbatches = n_microbatches
        self.virtual_stages = virtual_stages
        self.stage_costs = stage_costs
        self.sequence_parallel = sequence_parallel
        self._tensor_parallel: TensorParallelPlan | None = None  # tp > 1
        self._schedule_choice: ScheduleChoice | None = None
        self._pipeline: PipelineRuntime | None = None
        self.bucket_cap_mb = bucket_cap_mb
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._dims: ParallelDims | None = None
        self._device_mesh: DeviceMesh | None = None
        self._partitioner: ZeroPartitioner | None = None  # ZeRO stages 1 and 2
        self._fsdp_roots: list[torch.nn.Module] = []  # ZeRO stage 3

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
        """This rank's coordinates on the mesh, e.g. ``{"pp": 0, "dp": 1, "tp": 0}``."""
        return self.dims.coordinates(self.global_rank)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # By data-parallel rank, not global rank: every TP/PP rank of one replica must see the same batch.
        return {"num_replicas": self.dims.dp, "rank": self.coordinates["dp"]}

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
        _ = self.dims
        if self.dims.pp > 1:
            self._schedule_choice = resolve_schedule(self.schedule, self.dims.pp, self.n_microbatches,
                                                     self.virtual_stages)

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
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        assert self.cluster_environment is not None
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout)
        self._device_mesh = build_device_mesh(self.dims, self.root_device.type)
        assert self.lightning_module is not None
        # LightningModule.device_mesh reads this, as under Lightning's ModelParallelStrategy.
        self.lightning_module._device_mesh = self._device_mesh
        rank_zero_info(f"{type(self).__name__}: {self.dims.describe()}, backend {self._process_group_backend}")

    def _share_cpu_threads(self) -> None:
        # Several CPU ranks on one machine each default to one thread per core and fight over the cores; split
        # them unless the user chose (OMP_NUM_THREADS), as torchrun does.
        if self.root_device.type == "cpu" and "OMP_NUM_THREADS" not in os.environ and self.num_processes > 1:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.num_processes))

    # ----------------------------------------------------------------------------------------------------------------
    # Applying the layout
    # ----------------------------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self.dims.pp > 1:
            self._setup_pipeline(trainer, fitting)  # before moving: each rank moves only its own stages
        self.model_to_device()
        if self.dims.tp > 1:
            self._setup_tensor_parallel()  # before data parallel: FSDP2 / replicate then see DTensor parameters
        stage = self.layout.zero_stage
        dp_mesh = self.device_mesh["dp"]
        if stage == 3:
            # sharded for evaluation too: that is what lets a model larger than one device be evaluated
            offload = self.layout.offload_parameters or self.layout.offload_optimizer
            if offload and self.root_device.type == "cpu":
                rank_zero_info("ZeRO-3 offload: on CPU the parameters already live in host memory; nothing to move.")
                offload = False
            self._fsdp_roots = fully_shard_units(self.model, dp_mesh, offload=offload)
        elif fitting and stage == 0 and self._tensor_parallel is not None:
            self._fsdp_roots = replicate_units(self.model, dp_mesh)  # DDP cannot take DTensor parameters
        elif fitting and stage == 0 and self._pipeline is None:
            self.model = replicate_data_parallel(self.model, dp_mesh, self.bucket_cap_mb)
        elif not fitting:
            # no gradients to reduce outside fit: keep the module bare, only make the replicas agree
            self._broadcast_module_states(self.model)
        if fitting:
            self.setup_optimizers(trainer)
            if stage == 3:
                for optimizer in self.optimizers:
                    check_partitionable(optimizer, stage)
            if stage in (1, 2):
                self._partitioner = ZeroPartitioner(
                    self.model, self.optimizers, dp_mesh, stage, self.bucket_cap_mb, self.layout.offload_optimizer
                )
        self.setup_precision_plugin()
        if fitting and not self.layout.offload_optimizer:
            _optimizers_to_device(self.optimizers, self.root_device)

    # ----------------------------------------------------------------------------------------------------------------
    # Pipeline parallel (pp > 1): the schedule runs forward and backward inside ``training_step``
    # ----------------------------------------------------------------------------------------------------------------
    def _setup_pipeline(self, trainer: Trainer, fitting: bool) -> None:
        lm = self.lightning_module
        assert lm is not None and self._schedule_choice is not None
        parent, attr, model = _declared_model_slot(lm)
        for hook in ("loss_fn", "compute_loss"):
            if not callable(getattr(lm, hook, None)):
                raise LayoutError(
                    f"pipeline parallel (pp={self.dims.pp}) needs {type(lm).__name__}.{hook}(): the loss is computed "
                    "on the last stage, inside the schedule. Define `loss_fn(outputs, targets)` (the loss of one "
                    "micro-batch) and compute your step's loss through `compute_loss(batch)` (default: "
                    "`self.loss_fn(self(inputs), targets)`), as example_models.GPTLightningModule does."
                )
        accumulate = trainer.accumulate_grad_batches if fitting else 1
        choice = self._schedule_choice
        self._pipeline = PipelineRuntime(model, self.device_mesh["pp"], choice, lm.loss_fn,
                                         loss_scale=1.0 / (choice.n_microbatches * accumulate),
                                         device=self.root_device, costs=self.stage_costs)
        setattr(parent, attr, self._pipeline.module)
        # forward (generation in predict_step, or any other call) runs through the pipeline, output on every rank
        self._pipeline.module.forward = self._pipeline.forward_only
        log.info(self._pipeline.describe())
        if fitting:
            # Lightning must not run backward or zero the gradients: the schedule does both (see training_step)
            trainer.fit_loop._skip_backward = True
            self.precision_plugin.clip_grad_by_norm = self._clip_pipeline_grad_norm

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._pipeline is None:
            with self._tensor_parallel_loss():
                return super().training_step(*args, **kwargs)
        lm = self.lightning_module
        assert lm is not None
        batch, batch_idx = args[0], args[1]
        with self.precision_plugin.train_step_context():
            if batch_idx % lm.trainer.accumulate_grad_batches == 0:  # where Lightning would zero the gradients
                for optimizer in self.optimizers:
                    optimizer.zero_grad(set_to_none=True)
            inputs, targets = batch
            loss = self._pipeline.train_step(inputs, targets)
            if self._pipeline.require_sync:  # the last batch before an optimizer step
                self._pipeline.sync_gradients(self.device_mesh["dp"].get_group())
            with _loss_given(lm, lambda _batch: loss):
                return lm.training_step(*args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pipeline_eval_loss(), self._tensor_parallel_loss():
            return super().validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self._pipeline_eval_loss(), self._tensor_parallel_loss():
            return super().test_step(*args, **kwargs)

    @contextmanager
    def _pipeline_eval_loss(self) -> Generator[None, None, None]:
        """Evaluation's ``compute_loss`` runs forward-only through the stages; the loss comes from the last."""
        if self._pipeline is None:
            yield None
            return
        pipeline = self._pipeline
        assert self.lightning_module is not None
        with _loss_given(self.lightning_module, lambda batch: pipeline.forward_only(batch[0], batch[1])):
            yield None

    def _clip_pipeline_grad_norm(self, optimizer: Any, clip_val: float) -> None:
        """Clip by the global norm over all stages (each rank holds only its stages' gradients)."""
        assert self._pipeline is not None
        total = self._pipeline.global_grad_norm()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grads_with_norm_(params, clip_val, total)

    # ----------------------------------------------------------------------------------------------------------------
    # Tensor parallel (tp > 1): the model's declared plan, applied by lightning_par.parallel.tensor_parallel
    # ----------------------------------------------------------------------------------------------------------------
    def _setup_tensor_parallel(self) -> None:
        assert self.model is not None
        self._tensor_parallel = apply_tensor_parallel(self.model, self.device_mesh["tp"], self.sequence_parallel)
        rank_zero_info(
            f"tensor parallel over tp={self.dims.tp}: plan applied to {len(self._tensor_parallel.styles)} modules"
            f"{' with sequence parallelism' if self.sequence_parallel else ''}"
            f"{', vocab-parallel loss' if self._tensor_parallel.vocab_parallel_head else ''}"
        )

    @contextmanager
    def _tensor_parallel_loss(self) -> Generator[None, None, None]:
        """A vocab-parallel head's loss runs on vocabulary shards: its forward and backward both run in here."""
        if self._tensor_parallel is None:
            yield None
            return
        with self._tensor_parallel.loss_context():
            yield None

    def backward(self, closure_loss: Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> Tensor:
        with self._tensor_parallel_loss():
            return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _broadcast_module_states(self, module: torch.nn.Module) -> None:
        group = self.device_mesh["dp"].get_group()
        if dist.get_world_size(group) == 1:
            return
        for tensor in module.state_dict().values():
            if isinstance(tensor, Tensor):
                # a DTensor's shard goes to the replicas with the same tensor-parallel coordinate
                tensor = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                dist.broadcast(tensor, group=group, group_src=0)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """No gradient communication on the non-final micro-steps of ``accumulate_grad_batches``."""
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield None
            return
        self._set_gradient_sync(False)
        try:
            yield None
        finally:
            self._set_gradient_sync(True)

    def _set_gradient_sync(self, enabled: bool) -> None:
        for owner in (self._partitioner, self._pipeline):  # both sync gradients themselves, when allowed
            if owner is not None:
                owner.require_sync = enabled
        for root in self._fsdp_roots:
            root.set_requires_gradient_sync(enabled)

    def post_backward(self, closure_loss: Tensor) -> None:
        # ZeRO-1/2: the last buckets are reduced and every shard gets its gradient before clipping and the step
        if self._partitioner is not None:
            self._partitioner.finish_gradient_sync()

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self._partitioner is not None:
            self._partitioner.gather_parameters()  # each rank stepped its chunk; everyone gets all of them
        return output

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
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints: stage 0 saves one file from rank 0 (Lightning's default); stages 1-3 a sharded DCP directory
    # ----------------------------------------------------------------------------------------------------------------
    @property
    def _sharded(self) -> bool:
        # tp > 1: parameters are DTensor shards, which only torch.distributed.checkpoint saves and loads as such
        return self.layout.zero_stage > 0 or self.layout.pp > 1 or self.layout.tp > 1

    @property
    def _fqn_states(self) -> bool:
        # states keyed by parameter names (torch.distributed.checkpoint.state_dict): what lets each rank save only
        # what it holds, and a checkpoint load into another layout
        return self.layout.zero_stage == 3 or self.layout.pp > 1 or self.layout.tp > 1

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # sharded states load into the partitioned optimizer / sharded model, so they must exist first
        return self._sharded

    @property
    def lightning_restore_optimizer(self) -> bool:
        return not self._sharded

    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self._fqn_states:
            return sharded_checkpoint.model_state(self.lightning_module)
        return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        if self._fqn_states:
            return sharded_checkpoint.optimizer_state(self.lightning_module, optimizer)
        return super().optimizer_state(optimizer)

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        if not self._sharded:
            super().load_model_state_dict(checkpoint, strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        if not self._sharded:
            super().load_optimizer_state_dict(checkpoint)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        if not self._sharded:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        sharded_checkpoint.save(checkpoint, path, is_writer=self.is_global_zero, barrier=self.barrier)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if not self._sharded:
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None
        meta = sharded_checkpoint.load(path, self.lightning_module, self.optimizers, fsdp=self._fqn_states)
        if self._partitioner is not None:
            self._partitioner.refresh_shards()  # offloaded shards are copies: take the loaded parameters
        return meta

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:
            sharded_checkpoint.remove(Path(filepath))

    def teardown(self) -> None:
        if self._pipeline is not None and self.lightning_module is not None:
            self.lightning_module.trainer.fit_loop._skip_backward = False
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.model.module
        if self._partitioner is not None:
            self._partitioner.remove()
            self._partitioner = None
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="lightning-par engine: a (pp, dp, tp) layout, data parallel by default"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout})"


def _declared_model_slot(lm: torch.nn.Module) -> tuple[torch.nn.Module, str, torch.nn.Module]:
    """(parent, attribute, module) of the submodule that declares pipeline units, e.g. ``(lm, "model", gpt)``."""
    for name, module in lm.named_modules():
        if name and callable(getattr(module, "pipeline_units", None)):
            parent_name, _, attr = name.rpartition(".")
            return (lm.get_submodule(parent_name) if parent_name else lm), attr, module
    raise LayoutError(
        f"pipeline parallel needs a submodule of {type(lm).__name__} that declares its pipeline units "
        "(`pipeline_units()` listing embedding, blocks, final norm and head in execution order, as example_models.GPT "
        "does); none was found. Build the model in `configure_model()` and declare its units."
    )


@contextmanager
def _loss_given(lm: Any, compute_loss: Any) -> Generator[None, None, None]:
    """Run the LightningModule's own step with ``compute_loss`` answered by the pipeline, so its logging is kept."""
    lm.compute_loss = compute_loss
    try:
        yield None
    finally:
        del lm.compute_loss
