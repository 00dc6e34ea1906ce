"""The engine's base: a Lightning ``ParallelStrategy`` whose ranks form a (pp, dp, cp, tp) device mesh.

:class:`MeshStrategy` is what does not depend on the model: world sizes and ranks, the launcher, the process group
(one store per torchrun attempt), the mesh, the data-parallel sampler, and the collectives Lightning itself calls
(logging, checkpoint paths, early stopping). :class:`~lightning_par.strategies.engine.LayoutStrategy` adds the model:
applying the layout, the step and checkpoints.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_par._compat import _SubprocessScriptLauncher, keep_sequential_train_loaders
from lightning_par._compat import default_process_group_backend as _get_default_process_group_backend_for_device
from lightning_par._compat import distributed_is_initialized as _distributed_is_initialized
from lightning_par._compat import init_dist_connection as _init_dist_connection
from lightning_par._compat import sync_ddp_if_available as _sync_ddp_if_available
from lightning_par.parallel.layout import Layout
from lightning_par.run import job_store, shutdown
from lightning_par.run.elastic import layouts_for
from lightning_par.topology import LayoutError, ParallelDims, build_device_mesh, build_expert_mesh, gradient_mesh


class MeshStrategy(ParallelStrategy):
    """Ranks, process group and mesh for ``self.layout`` (set by the subclass before Lightning calls any hook)."""

    layout: Layout

    def __init__(self, process_group_backend: str | None, timeout: timedelta | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._num_nodes = 1
        self._dims: ParallelDims | None = None
        self._device_mesh: DeviceMesh | None = None
        self._grad_mesh: DeviceMesh | None = None
        self._expert_mesh: DeviceMesh | None = None

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
    def expert_mesh(self) -> DeviceMesh | None:
        """The mesh of expert parallel (``ep``, ``expert_dp``; :func:`~lightning_par.topology.build_expert_mesh`),
        None when ep = 1."""
        return self._expert_mesh

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
        try:
            _ = self.dims
        except LayoutError as err:  # e.g. an elastic attempt on fewer ranks than the layout needs: what would fit
            layout = self.layout
            raise LayoutError(f"{err} {layouts_for(self.world_size, layout.tp, layout.pp, layout.cp)}") from None

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            job_store.before_launch(self.cluster_environment)  # a MASTER_PORT another job holds: refused here
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
            shutdown.launched_ranks(self._launcher)

    def setup_environment(self) -> None:
        """Join the process group; every rank then continues from global rank 0's RNG state."""
        super().setup_environment()
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:  # a shuffle=False training loader stays sequential, as under Lightning on one device
            keep_sequential_train_loaders(trainer)
        self._share_cpu_threads()
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = default_backend(self.root_device)
        assert self.cluster_environment is not None
        if not dist.is_initialized():  # ours to destroy at exit, before the interpreter finalizes (exit code 0)
            shutdown.close_at_exit()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, timeout=self._timeout,
                              **self._store())

    def _store(self) -> dict[str, Any]:
        """The store to join through: torchrun's agent store (a namespace per attempt), else this job's own, checked
        to be this job's (run/job_store.py); nothing when the group exists already."""
        assert self.cluster_environment is not None
        if dist.is_initialized():
            return {}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return _attempt_store(self.cluster_environment, self._timeout)
        environment = self.cluster_environment
        return job_store.job_store(environment.main_address, environment.main_port, self.global_rank,
                                   self.world_size, self._timeout)

    def _build_mesh(self) -> None:
        self._device_mesh = build_device_mesh(self.dims, self.root_device.type)
        self._grad_mesh = None
        self._expert_mesh = build_expert_mesh(self.dims, self.root_device.type) if self.dims.ep > 1 else None

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
        tp * pp times. A mean is over dp x cp (:attr:`grad_mesh`): the cp ranks of a replica saw different tokens of
        the same samples, so a value they differ in (a mixture of experts' per-rank load-balancing loss) is averaged
        as its gradients are, and one they share (the loss under cp, a mean over whole sequences) is unchanged; a sum
        stays over dp (a count of samples is the same on the cp ranks)."""
        if not isinstance(tensor, Tensor):
            return tensor
        if group is None and self._device_mesh is not None:
            mean = reduce_op is None or (reduce_op.lower() in ("mean", "avg") if isinstance(reduce_op, str)
                                         else reduce_op == dist.ReduceOp.AVG)
            group = (self.grad_mesh if mean else self._device_mesh["dp"]).get_group()
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)


def default_backend(device: torch.device) -> str:
    """The process group backend for ``device`` when the user names none: on CUDA, NCCL for CUDA tensors and gloo for
    CPU ones (a collective on a CPU tensor -- a norm of offloaded gradients, a tensor built on the host -- would
    otherwise fail on plain NCCL with "No backend type associated with device type cpu"); Lightning's choice
    elsewhere (gloo on CPU)."""
    if device.type == "cuda":
        return "cpu:gloo,cuda:nccl"
    return _get_default_process_group_backend_for_device(device)


def _attempt_store(environment: Any, timeout: timedelta | None) -> dict[str, Any]:
    """Under torchrun, the process group's store as a fresh namespace of each attempt of the job.

    torchrun's static rendezvous (``--master-addr/--master-port``, its default) keeps one agent store across
    ``--max-restarts``, and c10d's keys do not name the attempt: a restarted rank would read the previous attempt's
    addresses (gloo: "connectFullMesh failed ... Connection refused"). Empty outside torchrun (Lightning's default)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(environment.main_address, environment.main_port, is_master=False, timeout=timeout)
    return {"store": dist.PrefixStore(f"lightning_par/attempt_{attempt}/", store)}
