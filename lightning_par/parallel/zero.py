"""ZeRO across the data-parallel mesh: stages 1 and 2 by hand, stage 3 on FSDP2.

Stage 3 is PyTorch's FSDP2 (``fully_shard`` on each repeated block that ``find_blocks`` finds, on any model):
parameters, gradients and optimizer states are DTensor shards; parameters are gathered per block for forward and
again for backward, gradients reduce-scattered.

Stages 1 and 2 are written here because PyTorch has no component for them that keeps parameters replicated and
composes with DTensor: FSDP2 with ``reshard_after_forward=False`` has stage 2's traffic but keeps parameters
*sharded* at rest (stage 3's memory), and ``ZeroRedundancyOptimizer`` all-reduces gradients (stage 0's traffic,
then discards 1 - 1/N of them). :class:`ZeroPartitioner` does what the ZeRO paper describes:

* each optimizer param group's parameters are packed into flat buckets; the model's parameters become views into
  them, so the buckets *are* the parameter memory and a gather writes straight into the model;
* each bucket is split into N equal chunks (zero-padded); rank r owns chunk r of every bucket. The optimizer's
  parameters are replaced (in place, so LR schedulers keep their optimizer) by one DTensor ``Shard(0)`` parameter per
  bucket wrapping the owned chunk -- an elementwise optimizer then keeps state for 1/N of the model, and Lightning's
  gradient clipping computes the global norm through DTensor without knowing about shards;
* gradients are reduce-scattered bucket by bucket as backward produces them (overlapping backward), averaged;
  stage 1 keeps the full gradient buffers until the step; stage 2 completes each bucket's reduce-scatter when the
  next bucket is launched and frees its full gradient then, keeping only its chunk (4 Psi / N + two buckets at the
  peak of backward, not 4 Psi);
* after the step each bucket is all-gathered (``all_gather_single``) back into the parameters, in the order the
  forward first uses the buckets; with ``prefetch=True`` each is waited for in a forward pre-hook of the modules
  holding its parameters, so bucket k's gather overlaps the forward of the modules before it
  (:meth:`ZeroPartitioner.gather_parameters`; off by default: a read outside those modules would be stale).
  Whatever reads the parameters outside a forward (``state_dict``, checkpoints, teardown) waits for all of them
  first (:meth:`ZeroPartitioner.wait_all`).

With tensor parallel (DTensor parameters on a tp mesh beside the dp mesh) each bucket packs the parameters' *local*
tensors (a tp shard, or the whole value where a parameter is replicated over tp) and every collective stays on the
dp group; the parameters remain DTensors whose local tensor is a view into the bucket. tp-split and tp-replicated
parameters go into different buckets, and the shard parameters are DTensors on the (dp, tp) mesh -- ``Shard(0)``
over dp and ``Shard(0)`` or ``Replicate()`` over tp -- so the global gradient norm, clipping and a DCP checkpoint
count every element once (:meth:`ZeroPartitioner.norm_groups` says the same explicitly).

With pipeline parallel the schedule runs many micro-batch backwards per optimizer step: ``defer_reduction=True``
keeps them from communicating, and :meth:`ZeroPartitioner.finish_gradient_sync` then reduce-scatters every bucket
once, after the pipeline summed its tied copies' gradients.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from lightning_par import _compat
from lightning_par.parallel.blocks import BlockTypes, ModelBlocks, find_blocks
from lightning_par.parallel.host_memory import fsdp_offload_policy, release_freed_memory
from lightning_par.parallel.parts import ModelParts, split
from lightning_par.parallel.pipeline.fsdp import check_disjoint
from lightning_par.topology import LayoutError

#: Optimizers whose update of an element depends only on that element's own history, so a flat chunk of a
#: parameter can be stepped apart from the rest. Shape-aware optimizers (Adafactor, LBFGS, Muon, Shampoo) cannot.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    torch.optim.Adadelta,
    torch.optim.Rprop,
    torch.optim.ASGD,
)


def check_partitionable(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """Raise a clear error for an optimizer that ZeRO ``stage`` cannot shard element by element."""
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        return
    allowed = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise LayoutError(
        f"ZeRO stage {stage} shards optimizer state element by element, which {type(optimizer).__name__} does not "
        f"allow (its update depends on whole-tensor shapes or a closure). Use one of: {allowed}; or ZeRO stage 0."
    )


@dataclass(frozen=True)
class ShardPrecision:
    """Mixed-precision dtypes for the data-parallel owners of ZeRO 1-3 (None: the parameters' own dtype).

    Attributes:
        param_dtype: what the model computes with: ZeRO-1/2 buckets (the replicated parameters) are stored in it
            and the fp32 values become a separate master shard per bucket; ZeRO-3 gathers its fp32 shards into it
            (FSDP2's ``MixedPrecisionPolicy.param_dtype``).
        reduce_dtype: the dtype gradients are summed in over data parallel.
        grad_dtype: ZeRO-1/2: the dtype of the gradient buffers the reduce-scatter reads and writes (fp32 under
            bf16-mixed-master: Megatron's fp32 main gradients, stepped by the fp32 master without a copy); None:
            ``param_dtype`` (bf16-mixed: the averaged fp32 sum is rounded once into bf16 storage).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None

    def fsdp_policy(self) -> object:
        """The same as FSDP2's ``MixedPrecisionPolicy`` (stage 3)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype)


#: What a bucket holds, which decides how its gradient enters the global norm: ``"plain"`` parameters (no tensor
#: parallel), ``"tp_shard"`` (each tp rank holds a different piece: squares are summed over tp) or
#: ``"tp_replicate"`` (every tp rank holds the same value: counted once). Exactly, per dimension of the mesh the
#: parameters are DTensors on (tp; for expert weights ep, or (ep, tp)): whether those ranks hold different pieces
#: (a bucket's ``split``).
PLAIN, TP_SHARD, TP_REPLICATE = "plain", "tp_shard", "tp_replicate"


def _local_data(param: Tensor) -> Tensor:
    """The memory a parameter computes with on this rank: a DTensor's local tensor (its tp shard, or its whole value
    where it is replicated over tp), else the tensor's own data."""
    return param._local_tensor if isinstance(param, DTensor) else param.data  # type: ignore[attr-defined]


def _split(param: Tensor, mesh_dims: int) -> tuple[bool, ...]:
    """For each dimension of the split parameters' mesh, whether ``param``'s ranks there hold different pieces."""
    if not isinstance(param, DTensor):
        return (False,) * mesh_dims
    return tuple(p.is_shard() for p in param.placements)


class _HostCopies:
    """Copies of gradients to the host for a CPU optimizer. From CUDA the copy is asynchronous (into pinned memory,
    so it overlaps the rest of backward), ordered only on the device's stream: an event recorded after it is
    awaited by :meth:`wait` before any CPU code reads the result. From the CPU it is the tensor itself."""

    def __init__(self) -> None:
        self._event: Any = None  # after the last copy launched (a stream runs its work in order)

    def to_host(self, tensor: Tensor) -> Tensor:
        if tensor.device.type != "cuda":
            return tensor.to("cpu")
        host = tensor.to("cpu", non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(tensor.device))
        return host

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()
            self._event = None


@dataclass
class _Bucket:
    """Parameters of one param group packed into one flat buffer, split into N chunks.

    Under tensor parallel the buffer holds each parameter's *local* tensor (its tp shard, or its whole value where it
    is replicated over tp), so the buckets of the tp ranks have the same layout but different contents; a bucket
    holds only ``"tp_shard"`` or only ``"tp_replicate"`` parameters (``kind``). The owned chunk is a DTensor on the
    (dp, tp) mesh: ``Shard(0)`` over dp and, over tp, ``Shard(0)`` for a tp_shard bucket (the tp ranks' chunks are
    different elements of the model) or ``Replicate()`` for a tp_replicate one; without tp it lives on the dp mesh.
    """

    params: list[nn.Parameter]
    offsets: list[int]
    flat: Tensor  # parameter storage, padded to a multiple of N
    rank: int
    world: int
    split: tuple[bool, ...] = ()  # per dimension of the split parameters' mesh: different pieces there
    mesh: DeviceMesh | None = None  # where the shard DTensor lives: dp, or (dp, tp)
    placements: tuple[Placement, ...] = ()
    global_numel: int = 0  # the shard DTensor's global size
    shard: nn.Parameter | None = None  # the optimizer's DTensor parameter (owned chunk)
    flat_grad: Tensor | None = None  # full gradient buffer while it is being filled / reduced
    reduced_chunk: Tensor | None = None  # reduce-scatter output
    send: Tensor | None = None  # flat_grad cast to the reduce dtype, alive while its reduce-scatter runs
    grad_chunk: Tensor | None = None  # mixed precision: the owned chunk's reduced gradient, in flat's dtype
    work: dist.Work | None = None
    gather: dist.Work | None = None  # the all-gather after the step, until a forward pre-hook waits for it
    gather_send: Tensor | None = None  # its input, alive while it runs
    reduced: bool = False  # this step's reduce-scatter completed; the shard holds the gradient
    ready_params: set[int] = field(default_factory=set)  # indices of params whose gradient is in flat_grad

    @property
    def complete(self) -> bool:
        return len(self.ready_params) == len(self.params)

    @property
    def chunk(self) -> int:
        return self.flat.numel() // self.world

    @property
    def kind(self) -> str:
        return PLAIN if not self.split else TP_SHARD if any(self.split) else TP_REPLICATE

    @property
    def reduce_over_tp(self) -> bool:
        """The global gradient norm sums this bucket's squares over the tp ranks (they hold different elements)."""
        return any(self.split)

    def own(self, flat: Tensor) -> Tensor:
        return flat[self.rank * self.chunk : (self.rank + 1) * self.chunk]

    def dtensor(self, local: Tensor) -> DTensor:
        assert self.mesh is not None
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=(self.global_numel,),
                                  stride=(1,))

    def region(self, index: int) -> tuple[int, int]:
        """``(start, end)`` of parameter ``index``'s local values in ``flat``."""
        start = self.offsets[index]
        return start, start + _local_data(self.params[index]).numel()


class ZeroPartitioner:
    """ZeRO stages 1 and 2 for a module whose optimizers were already built over its parameters.

    Args:
        module: the (unwrapped) module whose parameters the optimizers hold.
        optimizers: the optimizers to partition; their param lists are replaced by shard parameters in place.
        dp_mesh: the 1-D data-parallel mesh.
        stage: 1 (optimizer states sharded) or 2 (+ gradients sharded).
        bucket_cap_mb: bucket size in MiB; smaller buckets overlap communication with backward more finely.
        offload_optimizer: keep the shard parameters and optimizer state in host memory and step there.
        overlap: stage 2: let a bucket's reduce-scatter run while backward fills the next bucket (at most two
            full buckets of gradients at once); ``False``: complete each as soon as it is launched (one bucket).
        defer_reduction: reduce nothing during backward; :meth:`finish_gradient_sync` stages every parameter's
            accumulated ``.grad`` and reduce-scatters every bucket once. For pipeline schedules, which run many
            micro-batch backwards inside one optimizer step (also settable later as an attribute).
        param_dtype: mixed precision: store the buckets (the model's replicated parameters and their gradients) in
            this dtype (bf16) and keep the optimizer's shard as a separate master copy in the parameters' own dtype
            (fp32); the all-gather after the step writes the master back, rounded, into the buckets. Default: the
            parameters' dtype (the shard is then a view of its bucket).
        reduce_dtype: sum gradients over dp in this dtype (fp32): a bucket's gradient is cast to it for the
            reduce-scatter (one bucket at a time) and the averaged chunk is rounded once into the gradient storage.
        grad_dtype: the gradient buffers' dtype (default ``param_dtype``). fp32 with ``param_dtype=bf16`` is
            Megatron-style mixed precision: each parameter's bf16 gradient is upcast into an fp32 bucket, reduced
            and kept in fp32 (stage 1: 4 Psi, stage 2: 4 Psi / N) and is the master shard's step gradient as is.
        prefetch: leave the all-gathers after the step running and wait for each bucket's in a forward pre-hook of
            the modules holding its parameters; ``False`` (the default): wait for all of them in
            :meth:`gather_parameters` (on NCCL that is a wait of the compute stream, not of the host: the gathers
            still overlap Lightning's host work between the steps, but not the next forward's kernels).
        exclude: parameters the partitioner leaves alone -- not bucketed, reduced or sharded: they stay in their
            optimizer group, stepped whole (expert parallel's experts: their gradients are averaged over their own
            replicas, :mod:`~lightning_par.parallel.expert_parallel`).
        gradient_divide_factor: the reduced sum of gradients is divided by this (default: the size of ``dp_mesh``,
            an average). Expert weights partitioned over their replicas (``expert_dp``) divide by dp x cp, so their
            gradient is the average over every data-parallel rank's loss, as the other weights'.

    The prefetch needs every parameter to be read inside the forward of a module that holds it (``module.weight``
    in ``module.forward``: every torch layer, the project's and Hugging Face's models), and nothing to read the
    parameters between the step and the next forward but through ``state_dict`` (which waits). A forward that reads
    another module's parameter without calling that module may read it before its gather lands; the wait then marks
    the parameter modified in place, so such a read that autograd saved fails in backward ("modified by an inplace
    operation"), but a read it did not save (``F.embedding(ids, self.head.weight)``, a callback's
    ``on_train_batch_end`` reading ``p.data``) would silently see stale values. That is why it is off unless asked
    for.

    Mixed precision (``param_dtype=bf16, reduce_dtype=fp32``) keeps, per rank, the ZeRO paper's model states: 2 Psi
    parameters, gradients 2 Psi (stage 1) or 2 Psi / N (stage 2), and 12 Psi / N fp32 master weights and Adam
    moments. The fp32 gradient the optimizer steps the master with (4 Psi / N) exists from
    :meth:`finish_gradient_sync` to the optimizer's ``zero_grad``, a step workspace like the reduce buffers.

    Tensor parallel: parameters that are DTensors on a 1-D tp mesh (a sibling of ``dp_mesh`` in one DeviceMesh, as
    :func:`~lightning_par.parallel.tensor_parallel.apply_tensor_parallel` makes them) are packed by their local
    tensors; they stay DTensors whose local tensor is a view into the bucket, so DTensor ops, ``state_dict`` and
    ``load_state_dict`` work on them as before, and the all-gather after the step updates them in place. Buckets
    never mix tp-split and tp-replicated parameters; the shard parameters are DTensors on the (dp, tp) mesh whose
    placements say how to sum them (see :meth:`norm_groups`), so a norm computed from DTensor placements -- and
    ``clip_grad_norm_`` -- is the whole model's. Communication stays over dp only: each tp rank's reduce-scatter and
    all-gather carry its own local tensors, 1/tp of the model.

    When gradients are reduced: by default a bucket's reduce-scatter starts in backward as soon as its last
    parameter's gradient has been accumulated (overlapping backward). ``require_sync = False`` (Lightning's
    gradient accumulation, non-final batches) stops all communication: gradients accumulate in ``param.grad``, and
    :meth:`finish_gradient_sync` does nothing. ``defer_reduction = True`` leaves everything to
    :meth:`finish_gradient_sync`. A parameter whose gradient arrives twice in one step while buckets are reduced in
    backward is an error (its first gradient is already on its way), not a silently lost gradient.

    Gradient memory during backward, for Psi parameters in fp32 and bucket size B bytes: stage 1 keeps every
    bucket's full gradient (4 Psi; the averaged chunk is written into it), plus the send buffers and reduce-scatter
    outputs of at most two buckets in flight (``overlap=False``: one); stage 2 frees each bucket's full
    gradient as soon as its reduce-scatter completes and keeps only its chunk, so it holds 4 Psi / N plus at most
    2 B (``overlap=False``: B). With ``defer_reduction`` the full gradients stay in ``param.grad`` until
    :meth:`finish_gradient_sync` (4 Psi during the schedule, for either stage); at rest stage 2 holds 4 Psi / N.
    Under tensor parallel every Psi here is this rank's local share (about Psi / tp).
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Iterable[torch.optim.Optimizer],
        dp_mesh: DeviceMesh,
        stage: int,
        bucket_cap_mb: float = 25.0,
        offload_optimizer: bool = False,
        overlap: bool = True,
        defer_reduction: bool = False,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        prefetch: bool = False,
        exclude: Collection[nn.Parameter] = (),
        gradient_divide_factor: int | None = None,
    ) -> None:
        if stage not in (1, 2):
            raise LayoutError(f"ZeroPartitioner handles stages 1 and 2, not {stage}.")
        if dp_mesh.ndim != 1:
            raise LayoutError(f"ZeroPartitioner needs the 1-D data-parallel mesh, got a {dp_mesh.ndim}-D mesh.")
        self.stage = stage
        self.mesh = dp_mesh
        self.group = dp_mesh.get_group()
        self.world = dp_mesh.size()
        self.rank = dp_mesh.get_local_rank()
        self.divide_factor = gradient_divide_factor or self.world
        self.offload = offload_optimizer
        self.overlap = overlap
        self.defer_reduction = defer_reduction
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.grad_dtype = grad_dtype
        self.prefetch = prefetch
        self._in_flight: list[_Bucket] = []  # launched, not yet completed (overlap)
        self._host_copies = _HostCopies()  # offload: the gradients' device-to-host copies, awaited before the step
        self.require_sync = True
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}
        self.group_params: dict[int, list[nn.Parameter]] = {}  # id(param group) -> its model parameters
        optimizers = list(optimizers)
        for optimizer in optimizers:
            check_partitionable(optimizer, stage)
        left_out = {id(p) for p in exclude}
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]
                  if p.requires_grad and id(p) not in left_out]
        self.tp_mesh = _tensor_parallel_mesh(params, dp_mesh)
        self.shard_mesh = _shard_mesh(dp_mesh, self.tp_mesh)
        cap = max(1, int(bucket_cap_mb * 2**20))
        for optimizer in optimizers:
            optimizer.state.clear()
            for group in optimizer.param_groups:
                # the group's own order, which a plain (position-keyed) optimizer state refers to
                self.group_params[id(group)] = [p for p in group["params"] if p.requires_grad]
                buckets = self._make_buckets([p for p in self.group_params[id(group)] if id(p) not in left_out], cap)
                # the parameters left out stay the optimizer's own, stepped whole
                group["params"] = [b.shard for b in buckets] + [p for p in group["params"] if id(p) in left_out]
                self.buckets += buckets
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in self.buckets for p in b.params
        ]
        self._wrapped: list[tuple[nn.Module, Any, Any]] = []  # (compiled module, its call, our wrapper)
        self._warned = False
        self._gather_order = self._install_waits(module)
        self._hooks += self._install_master_loads(module)

    # -- where the all-gathers after the step are waited for ------------------------------------------------------
    def _install_waits(self, module: nn.Module) -> list[_Bucket]:
        """Register the waits for the gathers (with ``prefetch`` only); returns the buckets in the order the forward
        first needs them.

        A bucket is waited for before the forward of every module holding one of its parameters directly (the
        first one to run waits, the others find it done). A module inside a block compiled with
        ``nn.Module.compile`` would have its pre-hook traced into the graph: the outermost compiled module holding
        it waits instead, in a wrapper of its compiled call (eager). ``state_dict`` / ``load_state_dict`` of those
        modules and of ``module`` wait for every gather, and so does the end of ``module``'s own forward (a
        bucket whose modules did not run)."""
        named = dict(module.named_modules(remove_duplicate=False))
        bucket_ids = {id(b): b for b in self.buckets}
        targets: dict[int, tuple[nn.Module, dict[int, _Bucket]]] = {}  # id(module) -> (module, buckets)
        for name, sub in named.items():
            held = {id(self._bucket_of[id(p)][0]) for p in sub.parameters(recurse=False) if id(p) in self._bucket_of}
            if not held:
                continue
            target, parts = sub, name.split(".") if name else []
            for depth in range(len(parts) + 1):  # the outermost compiled module on the way down, if any
                outer = named.get(".".join(parts[:depth]))
                if outer is not None and _compat.compiled_call(outer) is not None:
                    target = outer
                    break
            entry = targets.setdefault(id(target), (target, {}))
            entry[1].update({i: bucket_ids[i] for i in held})
        first_use: dict[int, int] = {}
        for position, (target, buckets) in enumerate(targets.values()):
            for key in buckets:
                first_use.setdefault(key, position)
            if not self.prefetch:  # every gather is waited for in gather_parameters: no hook in the step's path
                continue
            chosen = list(buckets.values())
            call = _compat.compiled_call(target)
            if call is not None:
                wrapper = functools.partial(self._waiting_call, chosen, call)
                _compat.set_compiled_call(target, wrapper)
                self._wrapped.append((target, call, wrapper))
            else:
                self._hooks.append(target.register_forward_pre_hook(functools.partial(self._waiting_hook, chosen)))
        for sub in {id(m): m for m in (module, *(t for t, _ in targets.values()))}.values() if self.prefetch else ():
            self._hooks.append(sub.register_state_dict_pre_hook(lambda *_: self.wait_all()))
            self._hooks.append(sub.register_load_state_dict_pre_hook(lambda *_: self.wait_all()))
        if self.prefetch:
            self._hooks.append(module.register_forward_hook(self._after_forward))
        # launched in the order of first use (on NCCL the gathers run one after another on one stream); a bucket no
        # module holds (not expected) is gathered last and waited for at once
        self._unhooked = [b for b in self.buckets if id(b) not in first_use]
        used = sorted((b for b in self.buckets if id(b) in first_use), key=lambda b: first_use[id(b)])
        return used + self._unhooked

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """The end of the partitioned module's forward: a gather still outstanding belongs to a bucket none of whose
        modules ran. Its parameters were unused -- or read without their module, before the gather landed."""
        pending = [b for b in self.buckets if b.gather is not None]
        if pending and not self._warned:
            self._warned = True
            names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
            unused = [names.get(id(p), tuple(p.shape)) for b in pending for p in b.params][:4]
            warnings.warn(f"ZeRO prefetch: {type(module).__name__}'s forward ran no module holding {unused}; if it "
                          "read these parameters without calling their module, it read them before their all-gather "
                          "landed. Use prefetch=False for such a model.", RuntimeWarning, stacklevel=2)
        self.wait_all()

    def _waiting_hook(self, buckets: list[_Bucket], module: nn.Module, args: Any) -> None:
        for bucket in buckets:
            self._wait_gather(bucket)

    def _waiting_call(self, buckets: list[_Bucket], call: Any, *args: Any, **kwargs: Any) -> Any:
        for bucket in buckets:
            self._wait_gather(bucket)
        return call(*args, **kwargs)

    def _wait_gather(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s all-gather if it is still outstanding (on NCCL: the compute stream waits)."""
        work = bucket.gather
        if work is None:
            return
        bucket.gather = None
        work.wait()
        bucket.gather_send = None
        # the parameters changed in place behind autograd's back: a value of one that autograd saved before this
        # wait (read outside its module's forward, before the gather landed) now fails backward instead of
        # giving a gradient of stale values
        torch.autograd.graph.increment_version(list(bucket.params))

    def wait_all(self) -> None:
        """Wait for every all-gather still outstanding: before anything reads the parameters outside a forward
        (``state_dict``, a checkpoint, the end of fit) or writes the shards (the next step, a load)."""
        for bucket in self.buckets:
            self._wait_gather(bucket)

    @property
    def gathers_outstanding(self) -> int:
        """How many buckets' all-gathers were launched and not yet waited for."""
        return sum(b.gather is not None for b in self.buckets)

    # -- what a user writes into the parameters mid-fit reaches the masters ------------------------------------
    def _separate(self, bucket: _Bucket) -> bool:
        """The optimizer's shard of ``bucket`` is a copy beside it (the fp32 master under mixed precision, a host
        copy under offload) rather than a view of its chunk: a write into the parameters alone would be undone by the
        next step's all-gather."""
        local = bucket.shard.to_local() if bucket.shard is not None else bucket.flat
        return local.untyped_storage().data_ptr() != bucket.flat.untyped_storage().data_ptr()

    def _install_master_loads(self, module: nn.Module) -> list[Any]:
        """A ``load_state_dict`` pre-hook on every module holding a partitioned parameter (so a load into the whole
        model or into any submodule is seen): :meth:`_load_into_masters`."""
        self._names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        return [sub.register_load_state_dict_pre_hook(self._load_into_masters) for sub in module.modules()
                if any(id(p) in self._bucket_of for p in sub.parameters(recurse=False))]

    @torch.no_grad()
    def _load_into_masters(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict,
                           *args: Any) -> None:
        """``load_state_dict`` mid-fit (a callback restoring weights, an EMA swap): torch copies the values into the
        parameters -- under mixed precision their bf16 buckets -- and this puts them, at their own precision (fp32
        from the user stays fp32), into this rank's chunk of the masters too. Without it the next step would step
        the old masters and all-gather them back over the loaded weights."""
        self.wait_all()  # a gather still running would overwrite the load
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in self._bucket_of or prefix + name not in state_dict:
                continue
            if local_metadata.get("assign_to_params_buffers", False):
                raise RuntimeError(
                    f"load_state_dict(assign=True) into {type(module).__name__}.{name} during a ZeRO-1/2 fit would "
                    "replace a parameter whose memory is the partitioner's bucket: load with assign=False.")
            bucket, index = self._bucket_of[id(param)]
            value = _local_value(param, state_dict[prefix + name])
            if value is not None and self._separate(bucket):  # (a mismatch is reported by torch's own load)
                start, end = bucket.region(index)
                lo = bucket.rank * bucket.chunk
                first, last = max(start, lo), min(end, lo + bucket.chunk)
                if first < last:
                    master = bucket.shard.to_local()  # type: ignore[union-attr]
                    master[first - lo : last - lo].copy_(value.reshape(-1)[first - start : last - start])

    @torch.no_grad()
    def _adopt_direct_writes(self) -> None:
        """Before the step: a write into the parameters that bypassed ``load_state_dict`` (``p.data.copy_()``,
        ``p.copy_()`` under ``no_grad``) since the last all-gather left this rank's chunk of a bucket different from
        its master, rounded. Such parameters' masters take the written values -- at the parameters' precision, all
        that is known of them -- and a warning names them. One comparison of the owned chunk per bucket (on CUDA one
        host sync) per optimizer step; only buckets whose shard is a separate copy."""
        separate = [b for b in self.buckets if self._separate(b)]
        if not separate:
            return
        rounded = lambda b: b.shard.to_local().to(b.flat.device, b.flat.dtype)  # noqa: E731
        changed = [(_bits(b.own(b.flat)) != _bits(rounded(b))).any() for b in separate]
        if not torch.stack(changed).any().item():
            return
        written = []
        for bucket, flag in zip(separate, changed, strict=True):
            if not flag.item():
                continue
            own, now, lo = bucket.own(bucket.flat), rounded(bucket), bucket.rank * bucket.chunk
            master = bucket.shard.to_local()  # type: ignore[union-attr]
            for index, param in enumerate(bucket.params):
                start, end = bucket.region(index)
                first, last = max(start, lo) - lo, min(end, lo + bucket.chunk) - lo
                if first < last and (_bits(own[first:last]) != _bits(now[first:last])).any():
                    master[first:last].copy_(own[first:last])
                    written.append(self._names.get(id(param), str(tuple(param.shape))))
        names = ", ".join(written[:4]) + (", ..." if len(written) > 4 else "")
        warnings.warn(
            f"ZeRO-{self.stage}: parameters were written directly, not through load_state_dict ({names}): their "
            f"master weights take the written values at the parameters' precision "
            f"({str(separate[0].flat.dtype).replace('torch.', '')}); use module.load_state_dict(...) to set them at "
            "full precision.", RuntimeWarning, stacklevel=2)

    @torch.no_grad()
    def restore_parameters(self) -> None:
        """The end of fit: the model's parameters back in their own dtype (the masters'), holding the masters'
        values -- not their bf16 rounding -- so a later fit starts from them and a save carries the module's dtype.
        Each bucket of a separate dtype is all-gathered in the masters' dtype into a new bucket the parameters
        become views of (a collective; the bf16 bucket is freed); where on the same device, the shard becomes a view
        of its chunk of it, so a load after fit reaches both."""
        self.wait_all()
        self._adopt_direct_writes()  # a write after the last step (a callback's on_train_end: SWA's averaged weights)
        for bucket in self.buckets:
            assert bucket.shard is not None
            master = bucket.shard.to_local()
            if master.dtype == bucket.flat.dtype:
                continue
            full = torch.empty(bucket.flat.numel(), dtype=master.dtype, device=bucket.flat.device)
            _compat.all_gather_single(full, master.to(full.device, copy=True), group=self.group,
                                      async_op=True).wait()
            for param, offset in zip(bucket.params, bucket.offsets, strict=True):
                _point_into(param, full, offset)
            bucket.flat = full
            if master.device == full.device:
                bucket.shard._local_tensor = bucket.own(full)  # type: ignore[attr-defined]

    # -- building ------------------------------------------------------------------------------------------------
    def _slot(self, param: Tensor) -> int:
        """Elements a parameter takes in its bucket: its local size, or for a tp-split parameter the largest local
        size over the tp ranks (an uneven split), so every tp rank's buckets have the same layout."""
        if not isinstance(param, DTensor) or self.tp_mesh is None:
            return _local_data(param).numel()
        shape = list(param.shape)
        for dim, placement in enumerate(param.placements):
            if isinstance(placement, Shard):
                shape[placement.dim] = -(-shape[placement.dim] // self.tp_mesh.size(dim))
        return math.prod(shape)

    def _make_buckets(self, params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
        # Reverse registration order approximates the order backward produces gradients in, so the first buckets
        # fill (and start reducing) early. One bucket is filled at a time per (dtype, device, split): tp-split and
        # tp-replicated parameters (attention and MLP weights vs norms) alternate in a block, and never share one.
        buckets: list[_Bucket] = []
        filling: dict[tuple, list[nn.Parameter]] = {}
        filled: dict[tuple, int] = {}  # bytes in each bucket being filled
        mesh_dims = self.tp_mesh.ndim if self.tp_mesh is not None else 0
        for p in reversed(params):
            dtype = self.param_dtype or p.dtype
            key = (dtype, p.dtype, p.device, _split(p, mesh_dims))
            size = self._slot(p) * dtype.itemsize
            current = filling.setdefault(key, [])
            if current and filled[key] + size > cap_bytes:
                buckets.append(self._pack(current, key[3]))
                current = filling[key] = []
            if not current:
                filled[key] = 0
            current.append(p)
            filled[key] += size
        buckets += [self._pack(current, key[3]) for key, current in filling.items() if current]
        return buckets

    def _pack(self, params: list[nn.Parameter], split: tuple[bool, ...]) -> _Bucket:
        slots = [self._slot(p) for p in params]
        padded = -(-sum(slots) // self.world) * self.world
        dtype = self.param_dtype or params[0].dtype
        flat = torch.zeros(padded, dtype=dtype, device=params[0].device)
        # mixed precision: the parameters' own values (fp32) are packed first, so the master shard starts exact
        staging = flat if dtype == params[0].dtype else torch.zeros(padded, dtype=params[0].dtype,
                                                                    device=params[0].device)
        offsets, offset = [], 0
        for p, slot in zip(params, slots, strict=True):
            local = _local_data(p)
            staging[offset : offset + local.numel()].copy_(local.detach().reshape(-1))
            offsets.append(offset)
            offset += slot
        if staging is not flat:
            flat.copy_(staging)
        for p, offset in zip(params, offsets, strict=True):
            _point_into(p, flat, offset)
        mesh, placements, global_numel = self.shard_mesh.layout(split, padded)
        bucket = _Bucket(params=params, offsets=offsets, flat=flat, rank=self.rank, world=self.world, split=split,
                         mesh=mesh, placements=placements, global_numel=global_numel)
        local = bucket.own(staging)
        if staging is not flat:
            local = local.clone()  # the fp32 master of the owned chunk; staging's other chunks are dropped
        local = local.detach().to("cpu", copy=True) if self.offload else local
        if self.offload and torch.cuda.is_available() and flat.is_cuda:
            local = local.pin_memory()
        bucket.shard = nn.Parameter(bucket.dtensor(local))
        for i, p in enumerate(params):
            self._bucket_of[id(p)] = (bucket, i)
        if flat.device.type == "cpu":
            release_freed_memory()  # the parameters' old storage, freed below the new bucket
        return bucket

    # -- gradients -----------------------------------------------------------------------------------------------
    def _on_grad_ready(self, param: Tensor) -> None:
        if self.defer_reduction or not self.require_sync or param.grad is None:
            return  # accumulating, or a pipeline schedule: gradients stay in param.grad until finish_gradient_sync
        bucket, index = self._bucket_of[id(param)]
        if index in bucket.ready_params:
            raise RuntimeError(
                f"ZeroPartitioner: a gradient arrived a second time in one optimizer step for a parameter of shape "
                f"{tuple(param.shape)}, whose gradient was already handed to its bucket's reduce-scatter. With several "
                "backward passes per step (a pipeline schedule's micro-batches) set `defer_reduction = True` (or "
                "`require_sync = False` until the last backward) and call `finish_gradient_sync()` once."
            )
        self._stage_grad(bucket, index)
        if bucket.complete:
            self._launch_reduce(bucket)

    def _stage_grad(self, bucket: _Bucket, index: int) -> None:
        if index in bucket.ready_params:
            return
        if bucket.flat_grad is None:
            bucket.flat_grad = torch.zeros_like(bucket.flat, dtype=self.grad_dtype or bucket.flat.dtype)
        param = bucket.params[index]
        start, end = bucket.region(index)
        region = bucket.flat_grad[start:end]
        if param.grad is not None:
            region.copy_(_local_grad(param).reshape(-1))
        else:
            region.zero_()  # stage 1 reuses the buffer: an unused parameter must not keep last step's gradient
        param.grad = None  # the bucket holds it now; stage 2 frees the bucket once reduced
        bucket.ready_params.add(index)

    def _launch_reduce(self, bucket: _Bucket) -> None:
        assert bucket.flat_grad is not None
        send = bucket.flat_grad
        if self.reduce_dtype is not None and self.reduce_dtype != send.dtype:
            send = bucket.send = send.to(self.reduce_dtype)  # summed in fp32; one bucket's copy at a time
        bucket.reduced_chunk = torch.empty(bucket.chunk, dtype=send.dtype, device=bucket.flat.device)
        bucket.work = _compat.reduce_scatter_single(bucket.reduced_chunk, send, group=self.group, async_op=True)
        # Complete the buckets launched before this one, so at most two buckets are in flight at once -- this one,
        # being reduced, and the next one, being filled by backward (``overlap=False``: this one is completed now
        # too, no overlap). Completing frees a bucket's send buffer (the fp32 copy under mixed precision) and its
        # reduce-scatter output, at either stage; stage 2 also frees the full gradient.
        earlier, self._in_flight = self._in_flight, []
        for done in earlier:
            self._complete(done)
        if self.overlap:
            self._in_flight.append(bucket)
        else:
            self._complete(bucket)

    def _complete(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s reduce-scatter, average, and make the result its shard's gradient."""
        assert bucket.work is not None and bucket.reduced_chunk is not None and bucket.flat_grad is not None
        bucket.work.wait()
        chunk = bucket.reduced_chunk.div_(self.divide_factor)
        bucket.send = None
        if self.stage == 1:
            # keep the full gradient buffer (stage 1 partitions only optimizer state); the shard's gradient is a
            # view of its own chunk of it (mixed precision: the fp32 average rounded once into it)
            own = bucket.own(bucket.flat_grad)
            own.copy_(chunk)
            chunk = own
        else:
            bucket.flat_grad = None  # stage 2: only the reduced chunk is kept, in the gradients' storage dtype
            chunk = chunk.to(self.grad_dtype or bucket.flat.dtype)
        assert bucket.shard is not None
        if bucket.shard.dtype != chunk.dtype:
            # mixed precision: an fp32 master cannot take a bf16 .grad; finish_gradient_sync hands it an fp32 copy
            bucket.grad_chunk = chunk
        else:
            grad = self._host_copies.to_host(chunk) if self.offload else chunk
            bucket.shard.grad = bucket.dtensor(grad)
        bucket.work, bucket.reduced_chunk = None, None
        bucket.reduced = True

    def finish_gradient_sync(self) -> None:
        """After the last backward of an optimizer step: reduce what is left, wait, hand the shards their grads.

        Every bucket is reduce-scattered exactly once per call: those that backward already launched are waited
        for; the others (all of them with ``defer_reduction``, or the parameters that got no gradient) are staged
        from their parameters' accumulated ``.grad`` (zeros where there is none) and launched here. Does nothing
        while ``require_sync`` is False (a non-final batch of gradient accumulation).
        """
        if not self.require_sync:
            return
        self.wait_all()  # the step writes the shards: a gather of a bucket whose modules never ran must land first
        self._adopt_direct_writes()  # a user's write into the parameters since the last gather, into the masters
        for bucket in self.buckets:
            if bucket.work is None and not bucket.reduced:
                # parameters that got no gradient this step (unused) still take part, with zeros
                for index in range(len(bucket.params)):
                    self._stage_grad(bucket, index)
                self._launch_reduce(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                self._complete(bucket)
        self._in_flight = []
        self._host_copies.wait()  # the CPU optimizer must not read a gradient still being copied to the host
        for bucket in self.buckets:
            bucket.ready_params.clear()
            bucket.reduced = False
            if bucket.grad_chunk is not None:  # mixed precision: the master's fp32 gradient, for this step only
                assert bucket.shard is not None
                master = bucket.shard.to_local()
                bucket.shard.grad = bucket.dtensor(bucket.grad_chunk.to(master.device, master.dtype, copy=True))

    def gradient_buffers(self) -> list[Tensor]:
        """The gradient memory the partitioner holds besides the shards' ``.grad``: full bucket buffers and
        reduce-scatter outputs in flight (for :class:`~lightning_par.measure.GradientMeter`)."""
        return [t for b in self.buckets for t in (b.flat_grad, b.reduced_chunk, b.send, b.grad_chunk)
                if t is not None]

    # -- the global gradient norm --------------------------------------------------------------------------------
    def norm_groups(self) -> list[tuple[nn.Parameter, bool]]:
        """``(shard parameter, reduce_over_tp)`` for every bucket, in the optimizers' order.

        A shard's ``.grad`` (after :meth:`finish_gradient_sync`) is this rank's chunk of its bucket's averaged
        gradient. The whole model's squared norm is the sum of ``grad.to_local()``'s squares over the dp ranks,
        and also over the tp ranks where ``reduce_over_tp`` (a bucket of tp-split parameters), not where it is
        False (parameters replicated over tp: counted once) -- what the shard's DTensor placements on the (dp, tp)
        mesh say too. Bucket padding is zero and adds nothing.
        """
        return [(b.shard, b.reduce_over_tp) for b in self.buckets if b.shard is not None]

    @torch.no_grad()
    def norm_grads(self, exclude: Collection[int] = (), shards: Collection[int] | None = None) -> list[Tensor]:
        """The shards' gradients for the global norm (DTensors: their placements say where to sum), leaving out
        the parameters whose ids are in ``exclude`` (e.g. the tied pipeline copies another pipeline rank counts,
        ``PipelineRuntime.counted_elsewhere()``): a bucket holding one gets a copy of its gradient with that
        parameter's elements zeroed. ``shards``: only the buckets whose shard parameter's id is in it (one
        optimizer's). Use after :meth:`finish_gradient_sync`."""
        out = []
        for bucket in self.buckets:
            grad = bucket.shard.grad if bucket.shard is not None else None
            if grad is None or (shards is not None and id(bucket.shard) not in shards):
                continue
            skipped = [i for i, p in enumerate(bucket.params) if id(p) in exclude]
            if skipped:
                local = grad.to_local().clone()
                lo = bucket.rank * bucket.chunk
                for index in skipped:
                    start, end = bucket.region(index)
                    start, end = max(start - lo, 0), min(end - lo, bucket.chunk)
                    if start < end:
                        local[start:end] = 0
                grad = bucket.dtensor(local)
            out.append(grad)
        return out

    # -- parameters ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def gather_parameters(self, wait: bool = False) -> None:
        """After the optimizer stepped the owned chunks: all-gather every bucket back into the model.

        With ``prefetch`` the gathers are left running, launched in the order the forward needs them, and each is
        waited for before the forward of the first module holding one of its parameters; ``wait=True`` (or
        ``prefetch=False``) waits for all of them here."""
        self.wait_all()  # a gather still outstanding must land before a new one writes the same bucket
        in_place = "nccl" in str(dist.get_backend(self.group))
        for bucket in self._gather_order:
            assert bucket.shard is not None
            local = bucket.shard.to_local()
            if in_place and bucket.flat.is_cuda:
                # NCCL gathers in place when the input is the output's own chunk: no send buffer. The shard is that
                # chunk already, except under mixed precision (the fp32 master, rounded here) and offload (host)
                own = bucket.own(bucket.flat)
                if local.data_ptr() != own.data_ptr():
                    own.copy_(local)
                send = own
            else:
                # gloo does not promise that an input aliasing the output is safe: a separate send buffer (mixed
                # precision: the fp32 master, rounded to the buckets' bf16)
                send = local.to(bucket.flat.device, bucket.flat.dtype, copy=True)
            bucket.grad_chunk = None  # the step has used it
            bucket.gather = _compat.all_gather_single(bucket.flat, send, group=self.group, async_op=True)
            bucket.gather_send = send
        for bucket in self._unhooked:
            self._wait_gather(bucket)
        if wait or not self.prefetch:
            self.wait_all()

    def remove(self) -> None:
        """Wait for the outstanding gathers (nothing waits for them once the hooks are gone) and remove the
        hooks."""
        self.wait_all()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for module, call, wrapper in self._wrapped:
            if _compat.compiled_call(module) is wrapper:  # still ours (compile's release sets it to None)
                _compat.set_compiled_call(module, call)
        self._wrapped = []


def _local_grad(param: Tensor) -> Tensor:
    """A parameter's gradient on this rank, laid out as its local tensor. A DTensor gradient whose placements differ
    from its parameter's (``Partial`` for a replicated norm weight under sequence parallel) is redistributed to the
    parameter's first (an all-reduce over tp), as FSDP2 does."""
    grad = param.grad
    assert grad is not None
    if isinstance(grad, DTensor):
        if isinstance(param, DTensor) and tuple(grad.placements) != tuple(param.placements):
            grad = grad.redistribute(param.device_mesh, param.placements)
        grad = grad.to_local()
    local = _local_data(param)
    if grad.numel() != local.numel():
        raise RuntimeError(f"ZeroPartitioner: a gradient of {grad.numel()} elements for a parameter holding "
                           f"{local.numel()} here (shape {tuple(param.shape)}).")
    return grad


def _point_into(param: nn.Parameter, flat: Tensor, offset: int) -> None:
    """Make ``param``'s local values the view of ``flat`` at ``offset``."""
    local = _local_data(param)
    view = flat[offset : offset + local.numel()].view(local.shape)
    # the model's parameter now lives in the bucket: the all-gather after the step updates it in place. A
    # DTensor keeps its object (placements, global shape) and computes on the new local tensor, as FSDP2
    # does with its sharded parameters; its wrapper's metadata is remade from the view (dtype, storage
    # offset), since torch.compile rebuilds a DTensor input from its local tensor and refuses a wrapper
    # whose storage offset differs ("set the storage of a tensor on device cpu to a storage on ... meta")
    if isinstance(param, DTensor):
        _retype_dtensor(param, view)
        param._local_tensor = view  # type: ignore[attr-defined]
    else:
        param.data = view


def _local_value(param: nn.Parameter, value: Any) -> Tensor | None:
    """The part of ``value`` (a state dict's entry for ``param``) that this rank's bucket holds, laid out as the
    parameter's local tensor; None where torch's load would refuse it (another shape, a plain tensor for a
    DTensor)."""
    if isinstance(param, DTensor):
        if not isinstance(value, DTensor) or value.shape != param.shape:
            return None
        if tuple(value.placements) != tuple(param.placements):
            value = value.redistribute(param.device_mesh, param.placements)
        value = value.to_local()
    if not isinstance(value, Tensor) or isinstance(value, DTensor) or value.shape != _local_data(param).shape:
        return None
    return value.detach()


def _bits(t: Tensor) -> Tensor:
    """``t``'s bit patterns (NaN equal to itself, -0 not equal to 0): for an exact comparison."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _retype_dtensor(param: nn.Parameter, local: Tensor) -> None:
    """Make DTensor ``param`` a wrapper of ``local`` (its bucket's view): its dtype and storage offset. ``param.data =
    ...`` changes the wrapper's metadata but keeps the old local tensor and spec, so the spec is replaced too (the
    caller sets ``_local_tensor``); the object stays the same, so every reference to the parameter (optimizers,
    tied-weight tables) stays valid."""
    retyped = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                                 stride=param.stride())
    param.data = retyped
    param._spec = retyped._spec  # type: ignore[attr-defined]


def _tensor_parallel_mesh(params: list[Tensor], dp_mesh: DeviceMesh) -> DeviceMesh | None:
    """The mesh the DTensor parameters live on (tensor parallel: tp; expert weights: ep, or (ep, tp)), or None when
    there are none."""
    mesh = None
    dp_names = set(dp_mesh.mesh_dim_names or ())
    for p in params:
        if not isinstance(p, DTensor):
            continue
        if dp_names & set(p.device_mesh.mesh_dim_names or ()):
            raise LayoutError(
                f"ZeRO stages 1/2 pack parameters split over a mesh beside the data-parallel one; a parameter of "
                f"shape {tuple(p.shape)} is a DTensor on a {p.device_mesh.ndim}-D mesh {p.device_mesh.mesh_dim_names} "
                f"that holds the data-parallel dimension {sorted(dp_names)} (already data-parallel sharded, e.g. by "
                "FSDP2?). Apply ZeRO-1/2 after tensor and expert parallel only."
            )
        if mesh is None:
            mesh = p.device_mesh
        elif p.device_mesh is not mesh and p.device_mesh != mesh:
            raise LayoutError("ZeRO stages 1/2: the split parameters of one partitioner live on different meshes "
                              f"({mesh} and {p.device_mesh}); put them all on the one tp (or ep, tp) mesh.")
    return mesh


@dataclass
class _ShardMesh:
    """Where the shard DTensors live: the dp mesh, or the (dp, tp) mesh under tensor parallel (experts: (expert_dp,
    ep) or (expert_dp, ep, tp))."""

    mesh: DeviceMesh
    dp_dim: int
    tp_dims: tuple[int, ...] = ()

    def layout(self, split: tuple[bool, ...], padded: int) -> tuple[DeviceMesh, tuple[Placement, ...], int]:
        """``(mesh, placements, global numel)`` of the shard DTensor of a bucket of ``padded`` elements."""
        placements: list[Placement] = [Shard(0)] * self.mesh.ndim
        global_numel = padded
        for dim, different in zip(self.tp_dims, split, strict=True):
            if different:
                global_numel *= self.mesh.size(dim)  # those ranks' buckets are different elements
            else:
                placements[dim] = Replicate()
        return self.mesh, tuple(placements), global_numel


def _same_ranks(root: DeviceMesh, names: str | tuple[str, ...], mesh: DeviceMesh) -> bool:
    """Whether ``root[names]`` is, on this rank, the group of ranks ``mesh`` is."""
    key = names if isinstance(names, str) or len(names) > 1 else names[0]
    try:
        return root[key].mesh.tolist() == mesh.mesh.tolist()
    except (KeyError, RuntimeError, ValueError):
        return False


def _shard_mesh(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh | None) -> _ShardMesh:
    if tp_mesh is None:
        return _ShardMesh(dp_mesh, 0)
    root = dp_mesh._get_root_mesh()
    dp_name = (dp_mesh.mesh_dim_names or (None,))[0]
    tp_names = tuple(tp_mesh.mesh_dim_names or ())
    # a flattened dp (the dp_cp mesh of context parallel) is named among the root's flattened dimensions
    names = (*(root.mesh_dim_names or ()), *getattr(root, "_flatten_mapping", {}))
    # tp must be the dimensions of dp's root that hold the same ranks. Asked of dp's root, not of tp_mesh's: a later
    # Trainer in the same process builds a new mesh, and torch may hand back, as tp's root, the root it recorded for
    # an earlier one (of another shape once cp changes it)
    if (dp_name is None or not tp_names or dp_name in tp_names or dp_name not in names
            or any(n not in names for n in tp_names) or not _same_ranks(root, tp_names, tp_mesh)):
        raise LayoutError(
            "ZeRO stages 1/2 with tensor parallel need the dp mesh and the tensor-parallel parameters' mesh to be "
            f"two named dimensions of one DeviceMesh (got dp {dp_mesh.mesh_dim_names}, tp "
            f"{tp_mesh.mesh_dim_names}); build them as init_device_mesh(..., mesh_dim_names=(..., 'dp', 'tp'))."
        )
    order = sorted((dp_name, *tp_names), key=names.index)
    if dp_name not in (root.mesh_dim_names or ()):  # dp_cp: its dimensions lie outside tp's (pp, dp, cp, tp)
        order = [dp_name, *tp_names]
    with warnings.catch_warnings():  # torch deprecates slicing a flattened dimension; no other way to pair it
        warnings.filterwarnings("ignore", message="Slicing a flattened dim")
        mesh = root[tuple(order)]
    return _ShardMesh(mesh, order.index(dp_name), tuple(order.index(n) for n in tp_names))


# -- stage 3 ------------------------------------------------------------------------------------------------------
@dataclass
class DataParallelGroups:
    """How the searched module's parameters are grouped for FSDP2 (``fully_shard`` or ``replicate``).

    Attributes:
        found: the blocks, from :func:`~lightning_par.parallel.blocks.find_blocks`.
        blocks: ``(name, module)`` of each repeated block, one group each, in execution order.
        root: ``(name, module)`` of ``found.root``: the root group, with what is left of it once the blocks are
            grouped (embedding, final norm, head), kept gathered from forward into backward.
        outside: ``(name, module)`` of each module outside ``found.root`` that holds parameters (an auxiliary head
            of a LightningModule, say): one group each. Containers without a ``forward`` (``nn.ModuleList`` /
            ``nn.ModuleDict``) are replaced by their items. One tied to a parameter inside ``found.root`` joins
            the root group, which is then the searched module (``root == ("", module)``).
        loose: names of the parameters held directly by an ancestor of ``found.root`` (an ``nn.Parameter`` set on
            the LightningModule itself). They go into one group on the searched module, the outermost.
    """

    found: ModelBlocks
    blocks: list[tuple[str, nn.Module]]
    root: tuple[str, nn.Module]
    outside: list[tuple[str, nn.Module]] = field(default_factory=list)
    loose: list[str] = field(default_factory=list)

    def describe(self) -> str:
        text = f"{len(self.blocks)} block groups + root group `{self.root[0] or '.'}`"
        if self.outside:
            text += f" + {len(self.outside)} outside the root ({', '.join(n for n, _ in self.outside)})"
        if self.loose:
            text += f" + one outermost group for the parameters held directly by it ({', '.join(self.loose)})"
        return text


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def data_parallel_groups(module: nn.Module, block_types: BlockTypes = None,
                         found: ModelBlocks | None = None) -> DataParallelGroups:
    """Group ``module``'s parameters for FSDP2: each block, then the blocks' root, then whatever lies outside it.

    ``found``: the blocks inside ``module`` (``ModelParts.found``); where not given they are searched for here, and
    the :class:`~lightning_par.topology.LayoutError` of ``find_blocks`` (it says how to pass ``block_types=``) is
    raised where there are none.
    """
    if found is None:
        found = find_blocks(module, block_types)
    root_path = found.path
    blocks = [(_join(root_path, name), found.root.get_submodule(name)) for name in found.blocks]
    groups = DataParallelGroups(found, blocks, (root_path, found.root))

    def add_unit(path: str, child: nn.Module) -> None:
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # no forward of its own: its items are called
            groups.loose += [_join(path, n) for n, _ in child.named_parameters(recurse=False)]
            for name, item in child.named_children():
                if any(True for _ in item.parameters()):
                    add_unit(_join(path, name), item)
        else:
            groups.outside.append((path, child))

    def visit(prefix: str, ancestor: nn.Module) -> None:
        """``ancestor`` is ``module`` or a module on the way down to ``found.root``."""
        groups.loose += [_join(prefix, n) for n, _ in ancestor.named_parameters(recurse=False)]
        for name, child in ancestor.named_children():
            path = _join(prefix, name)
            if child is found.root:
                continue
            if root_path.startswith(path + "."):
                visit(path, child)
            elif any(True for _ in child.parameters()):
                add_unit(path, child)

    if root_path:
        visit("", module)
    _merge_tied(module, groups)
    return groups


def _merge_tied(module: nn.Module, groups: DataParallelGroups) -> None:
    """Keep each tied (or shared) parameter in one FSDP2 group, in place. FSDP2 holds a parameter in one group,
    gathered where that group's modules run: a second owner in another group would compute with a stale or sharded
    copy -- an error at the first forward, or a silently wrong gradient (ELECTRA's embeddings and its head, two
    groups outside the blocks' root: 5e-4 off one process). The groups holding an owner of a tied parameter are
    dissolved into their nearest common ancestor, which becomes the root group (BERT's embeddings block and head
    ``cls``: the whole causal LM, whose forward runs both)."""
    paths = [*(p for p, _ in groups.blocks), *(p for p, _ in groups.outside), groups.root[0]]

    def group_of(path: str) -> str:
        return max((g for g in paths if path == g or _under(path, g)), key=len, default="")

    owners: dict[int, set[str]] = {}
    for path, owner in module.named_modules(remove_duplicate=False):
        for param in owner.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(path)
    involved: set[str] = set()
    for held_by in owners.values():
        found_in = {group_of(path) for path in held_by}
        if len(found_in) > 1:
            involved |= found_in
    if not involved:
        return
    common = groups.root[0].split(".") if groups.root[0] else []
    for path in involved:
        parts = path.split(".") if path else []
        while common and parts[:len(common)] != common:
            common = common[:-1]
    anchor = ".".join(common)
    groups.blocks = [(p, b) for p, b in groups.blocks if p not in involved]
    groups.outside = [(p, u) for p, u in groups.outside if p not in involved]
    groups.root = (anchor, module.get_submodule(anchor) if anchor else module)
    groups.loose = [name for name in groups.loose if not _under(name, anchor)]


def _under(name: str, ancestor: str) -> bool:
    """``name`` (a module or parameter path) lies inside the module at ``ancestor`` ("" is the searched module)."""
    return not ancestor or name.startswith(ancestor + ".")


def _apply_groups(module: nn.Module, groups: DataParallelGroups, apply) -> list[nn.Module]:
    """``apply`` (``fully_shard`` or ``replicate`` with its options bound) to each group, innermost first; the
    FSDP2 roots (the outermost groups) are returned."""
    for _, block in groups.blocks:
        apply(block)
    for _, unit in groups.outside:  # (siblings of the root group, or inside it when it is the searched module)
        apply(unit)
    apply(groups.root[1])
    if groups.root[1] is module:
        return [module]
    if groups.loose:
        # what is left (parameters set directly on the LightningModule or a container on the way to the root)
        # becomes the outermost group; it is gathered by the searched module's forward, so that forward must run
        apply(module)
        return [module]
    return [groups.root[1]] + [unit for path, unit in groups.outside if not _under(path, groups.root[0])]


def fully_shard_parts(parts: ModelParts, dp_mesh: DeviceMesh, offload: bool = False, mp_policy: object | None = None,
                      reshard_after_forward: bool | None = None) -> list[nn.Module]:
    """ZeRO-3 with FSDP2 on this rank's part of the model: each repeated block its own group, then what holds them.

    Without pipeline parallelism the groups are those of :func:`data_parallel_groups` (the blocks, then the blocks'
    root, then the modules outside it). Each block is gathered just before its forward and again for its backward,
    and freed after, so the gathered parameters peak at about one block plus the root group. The rest of the root
    (embedding, final norm, head -- a small share of a real model) forms the root group, which FSDP2 keeps gathered
    from forward into backward: the same grouping torchtitan and a hand-written Lightning ``ModelParallelStrategy``
    use, with fewer, larger collectives than one group per unit. Traffic is therefore 3 Psi_blocks + 2 Psi_root
    elements (x (N-1)/N) rather than exactly 3 Psi. A tied embedding and head stay together in the root group.
    Modules with parameters outside the root (e.g. next to it in a LightningModule) are groups of their own;
    parameters set directly on the LightningModule go into an outermost group around everything, gathered by its
    ``forward``.

    Under pipeline parallelism each stage module's blocks, then the stage module itself, so that every stage is its
    own FSDP2 root (see :mod:`lightning_par.parallel.pipeline.fsdp` for what this costs per step); a parameter held
    by two stages of this rank is refused. ``reshard_after_forward``: default (None) FSDP2's own choice without a
    pipeline, ``False`` in one -- each group gathered once per step (``True``: freed after each micro-batch's
    forward, up to ``2 m`` gathers per block per step).

    ``offload``: keep the parameter shards (and the optimizer step) in host memory (FSDP2 ``CPUOffloadPolicy``).
    ``parts.experts`` (expert parallel) are sharded over the ranks holding the same experts instead
    (:func:`fully_shard_experts`).
    ``mp_policy``: FSDP2's ``MixedPrecisionPolicy`` (default: compute and reduce in the parameters' dtype).
    Returns the FSDP2 roots: the stage modules under pp.
    """
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = dict(mesh=dp_mesh, offload_policy=fsdp_offload_policy(offload, dp_mesh.device_type),
                                  # mixed precision (bf16-mixed): fp32 shards are the master weights, gathered as
                                  # bf16, gradients reduced in fp32
                                  mp_policy=mp_policy if mp_policy is not None else ShardPrecision().fsdp_policy())
    if parts.pipelined or reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = bool(reshard_after_forward)
    if parts.experts:  # expert parallel's: their own groups, inside the blocks' (innermost first)
        assert parts.expert_mesh is not None
        fully_shard_experts(parts.root, parts.experts, parts.expert_mesh, kwargs)
    shard = functools.partial(fully_shard, **kwargs)
    if not parts.pipelined:
        if parts.found is None:  # no repeated blocks (a plain model): it is one unit, as Lightning's FSDP shards it
            return shard_whole(parts.root, shard)
        groups = data_parallel_groups(parts.root, found=parts.found)
        return _apply_groups(parts.root, groups, shard)
    check_disjoint(parts.stages)
    for stage, blocks in zip(parts.stages, parts.stage_blocks, strict=True):
        for block in blocks:
            shard(block)
        shard(stage)
    return list(parts.stages)


#: the LightningModule methods that run a model which is sharded as one unit with the LightningModule itself
STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def shard_whole(module: nn.Module, shard: Any) -> list[nn.Module]:
    """ZeRO-3 of a model without repeated blocks: the model as one FSDP2 unit, gathered whole for its forward and
    backward -- each of ``module``'s children holding parameters (the model a LightningModule keeps; the items of a
    container) its own unit. Where ``module`` holds parameters itself, or its units share one, ``module`` is the
    one unit, gathered by its step methods (:data:`STEP_METHODS`, FSDP2's ``register_fsdp_forward_method``).
    Returns the FSDP2 roots. Warns that the gathered memory is then the whole model, with how to get per-block
    sharding."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    units: list[tuple[str, nn.Module]] = []
    loose = [n for n, _ in module.named_parameters(recurse=False)]

    def add(path: str, child: nn.Module) -> None:
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):  # no forward of its own: its items are called
            loose.extend(_join(path, n) for n, _ in child.named_parameters(recurse=False))
            for name, item in child.named_children():
                add(_join(path, name), item)
        elif any(True for _ in child.parameters()):
            units.append((path, child))

    for name, child in module.named_children():
        add(name, child)
    owner: dict[int, str] = {}
    shared = False
    for path, unit in units:
        for param in unit.parameters():
            shared |= owner.setdefault(id(param), path) != path
    whole = bool(loose) or shared or not units
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(
            f"ZeRO-3: found no repeated blocks in {type(module).__name__}, so "
            f"`{type(module).__name__ if whole else ', '.join(p for p, _ in units)}` is sharded as one FSDP2 unit: "
            "its parameters rest sharded, but each forward and backward gathers the whole model (peak memory is not "
            "reduced per block). For per-block sharding keep the blocks in an nn.ModuleList, or pass "
            "--trainer.strategy.block_types='[YourBlock]'.", stacklevel=2)
    if not whole:
        for _, unit in units:
            shard(unit)
        return [unit for _, unit in units]
    shard(module)
    for method in STEP_METHODS:  # (a LightningModule's step calls its model, not its own forward)
        if callable(getattr(module, method, None)):
            register_fsdp_forward_method(module, method)
    return [module]


def fully_shard_experts(module: nn.Module, experts: Collection[nn.Parameter], mesh: DeviceMesh,
                        kwargs: dict[str, Any]) -> None:
    """ZeRO-3 of expert parallel's weights (torchtitan's): each module holding experts becomes an FSDP2 group on
    ``mesh["expert_dp"]`` (the ranks holding the same experts; its parameters are DTensors on the ep or (ep, tp)
    mesh, so FSDP2 shards the rank's own experts further), its reduce-scatter divided by dp x cp: the gradient is
    the average over every data-parallel rank's loss, as the other weights'. Its child modules (a router, a shared
    expert) are groups of their own on the data-parallel mesh first. ``kwargs``: ``fully_shard``'s for the rest."""
    from torch.distributed.fsdp import fully_shard

    ids = {id(p) for p in experts}
    replicas = mesh["expert_dp"]
    holders = [m for m in module.modules() if any(id(p) in ids for p in m.parameters(recurse=False))]
    for holder in holders:
        others = [n for n, p in holder.named_parameters(recurse=False) if id(p) not in ids]
        if others:
            raise LayoutError(
                f"{type(holder).__name__} holds expert weights and other parameters ({', '.join(others)}) directly: "
                "ZeRO-3 shards the experts over their own replicas as one FSDP2 group, which must hold experts only. "
                "Move those parameters into a child module, or use zero_stage 1 or 2 with ep.")
        for child in holder.children():
            if any(True for _ in child.parameters()):
                fully_shard(child, **kwargs)
        fully_shard(holder, **{**kwargs, "mesh": replicas})
        holder.set_gradient_divide_factor(float(replicas.size() * mesh["ep"].size()))
        if replicas.size() > 1 and replicas.device_type != "cuda":
            # gloo has no pre-multiplied sum: divide after a plain one. (Not on one rank, where torch would divide
            # twice)
            holder.set_force_sum_reduction_for_comms(True)


def fully_shard_units(
    module: nn.Module, dp_mesh: DeviceMesh, offload: bool = False, block_types: BlockTypes = None,
    mp_policy: object | None = None,
) -> list[nn.Module]:
    """:func:`fully_shard_parts` on a whole model (no pipeline split), its blocks found by
    :func:`~lightning_par.parallel.blocks.find_blocks` -- a model's own declaration, a Hugging Face model's plan,
    ``block_types``, or the ``nn.ModuleList`` of blocks it keeps; without blocks this raises find_blocks'
    :class:`~lightning_par.topology.LayoutError`, which says how to pass ``block_types=``. Returns the FSDP2 roots.
    """
    return fully_shard_parts(split(module, block_types=block_types), dp_mesh, offload=offload, mp_policy=mp_policy)
