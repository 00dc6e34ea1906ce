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
from torch.nn.parallel import DistributedDataParallel

from lightning_par.parallel.data_parallel import replicate_data_parallel
from lightning_par.parallel.layout import Layout
from lightning_par.topology import ParallelDims, Size, build_device_mesh

log = logging.getLogger(__name__)


class LayoutStrategy(ParallelStrategy):
    """Train a LightningModule on a (pp, dp, tp) device mesh with the given layout.

    Args:
        dp: data-parallel size, or ``"auto"`` for world size / (tp * pp).
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        zero_stage: ZeRO stage across data parallel (0 = replicas, gradients all-reduced like DDP).
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
        self.layout = Layout(dp=dp, tp=tp, pp=pp, zero_stage=zero_stage)
        self.bucket_cap_mb = bucket_cap_mb
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._dims: ParallelDims | None = None
        self._device_mesh: DeviceMesh | None = None

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
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.model = replicate_data_parallel(self.model, self.device_mesh["dp"], self.bucket_cap_mb)
            self.setup_optimizers(trainer)
        else:
            # No gradients to reduce outside fit: keep the module bare, only make the replicas agree.
            self._broadcast_module_states(self.model)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _broadcast_module_states(self, module: torch.nn.Module) -> None:
        group = self.device_mesh["dp"].get_group()
        if dist.get_world_size(group) == 1:
            return
        for tensor in module.state_dict().values():
            if isinstance(tensor, Tensor):
                dist.broadcast(tensor, group=group, group_src=0)

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient all-reduce on non-final micro-steps of ``accumulate_grad_batches``."""
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

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

    def teardown(self) -> None:
        if isinstance(self.model, DistributedDataParallel):
            self.model = self.model.module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="lightning-par engine: a (pp, dp, tp) layout, data parallel by default"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout})"
