"""ZeRO across the data-parallel mesh: stages 1 and 2 by hand, stage 3 on FSDP2.

Stage 3 is PyTorch's FSDP2 (``fully_shard`` on each declared unit): parameters, gradients and optimizer states are
DTensor shards; parameters are gathered per unit for forward and again for backward, gradients reduce-scattered.

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
  stage 1 keeps the full gradient buffer, stage 2 keeps only its chunk and frees the rest;
* after the step each bucket is all-gathered (``all_gather_single``) back into the parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

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


@dataclass
class _Bucket:
    """Parameters of one param group packed into one flat buffer, split into N chunks."""

    params: list[nn.Parameter]
    offsets: list[int]
    flat: Tensor  # parameter storage, padded to a multiple of N
    rank: int
    world: int
    shard: nn.Parameter | None = None  # the optimizer's DTensor parameter (owned chunk)
    flat_grad: Tensor | None = None  # full gradient buffer while it is being filled / reduced
    reduced_chunk: Tensor | None = None  # reduce-scatter output
    work: dist.Work | None = None
    ready_params: set[int] = field(default_factory=set)  # indices of params whose gradient is in flat_grad

    @property
    def complete(self) -> bool:
        return len(self.ready_params) == len(self.params)

    @property
    def chunk(self) -> int:
        return self.flat.numel() // self.world

    def own(self, flat: Tensor) -> Tensor:
        return flat[self.rank * self.chunk : (self.rank + 1) * self.chunk]


class ZeroPartitioner:
    """ZeRO stages 1 and 2 for a module whose optimizers were already built over its parameters.

    Args:
        module: the (unwrapped) module whose parameters the optimizers hold.
        optimizers: the optimizers to partition; their param lists are replaced by shard parameters in place.
        dp_mesh: the 1-D data-parallel mesh.
        stage: 1 (optimizer states sharded) or 2 (+ gradients sharded).
        bucket_cap_mb: bucket size in MiB; smaller buckets overlap communication with backward more finely.
        offload_optimizer: keep the shard parameters and optimizer state in host memory and step there.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizers: Iterable[torch.optim.Optimizer],
        dp_mesh: DeviceMesh,
        stage: int,
        bucket_cap_mb: float = 25.0,
        offload_optimizer: bool = False,
    ) -> None:
        if stage not in (1, 2):
            raise LayoutError(f"ZeroPartitioner handles stages 1 and 2, not {stage}.")
        self.stage = stage
        self.mesh = dp_mesh
        self.group = dp_mesh.get_group()
        self.world = dp_mesh.size()
        self.rank = dp_mesh.get_local_rank()
        self.offload = offload_optimizer
        self.require_sync = True
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, tuple[_Bucket, int]] = {}
        cap = max(1, int(bucket_cap_mb * 2**20))
        for optimizer in optimizers:
            check_partitionable(optimizer, stage)
            optimizer.state.clear()
            for group in optimizer.param_groups:
                params = [p for p in group["params"] if p.requires_grad]
                buckets = self._make_buckets(params, cap)
                group["params"] = [b.shard for b in buckets]
                self.buckets += buckets
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready) for b in self.buckets for p in b.params
        ]

    # -- building ------------------------------------------------------------------------------------------------
    def _make_buckets(self, params: list[nn.Parameter], cap_bytes: int) -> list[_Bucket]:
        # Reverse registration order approximates the order backward produces gradients in, so the first buckets
        # fill (and start reducing) early.
        buckets, current, current_bytes = [], [], 0
        for p in reversed(params):
            size = p.numel() * p.element_size()
            if current and (
                current_bytes + size > cap_bytes or (p.dtype, p.device) != (current[0].dtype, current[0].device)
            ):
                buckets.append(self._pack(current))
                current, current_bytes = [], 0
            current.append(p)
            current_bytes += size
        if current:
            buckets.append(self._pack(current))
        return buckets

    def _pack(self, params: list[nn.Parameter]) -> _Bucket:
        numel = sum(p.numel() for p in params)
        padded = -(-numel // self.world) * self.world
        flat = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
        offsets, offset = [], 0
        for p in params:
            flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            # the model's parameter now lives in the bucket: the all-gather after the step updates it in place
            p.data = flat[offset : offset + p.numel()].view_as(p)
            offsets.append(offset)
            offset += p.numel()
        bucket = _Bucket(params=params, offsets=offsets, flat=flat, rank=self.rank, world=self.world)
        local = bucket.own(flat)
        local = local.detach().to("cpu", copy=True) if self.offload else local
        if self.offload and torch.cuda.is_available() and flat.is_cuda:
            local = local.pin_memory()
        bucket.shard = nn.Parameter(self._dtensor(local, padded))
        for i, p in enumerate(params):
            self._bucket_of[id(p)] = (bucket, i)
        return bucket

    def _dtensor(self, local: Tensor, global_numel: int) -> DTensor:
        return DTensor.from_local(local, self.mesh, [Shard(0)], run_check=False, shape=(global_numel,), stride=(1,))

    # -- gradients -----------------------------------------------------------------------------------------------
    def _on_grad_ready(self, param: Tensor) -> None:
        if not self.require_sync or param.grad is None:
            return  # accumulating: gradients stay in param.grad, no communication on non-final micro-steps
        bucket, index = self._bucket_of[id(param)]
        self._stage_grad(bucket, index)
        if bucket.complete:
            self._launch_reduce(bucket)

    def _stage_grad(self, bucket: _Bucket, index: int) -> None:
        if index in bucket.ready_params:
            return
        if bucket.flat_grad is None:
            bucket.flat_grad = torch.zeros_like(bucket.flat)
        param, offset = bucket.params[index], bucket.offsets[index]
        region = bucket.flat_grad[offset : offset + param.numel()]
        if param.grad is not None:
            region.copy_(param.grad.reshape(-1))
        else:
            region.zero_()  # stage 1 reuses the buffer: an unused parameter must not keep last step's gradient
        param.grad = None  # the bucket holds it now; stage 2 frees the bucket once reduced
        bucket.ready_params.add(index)

    def _launch_reduce(self, bucket: _Bucket) -> None:
        assert bucket.flat_grad is not None
        bucket.reduced_chunk = torch.empty(bucket.chunk, dtype=bucket.flat.dtype, device=bucket.flat.device)
        bucket.work = dist.reduce_scatter_single(bucket.reduced_chunk, bucket.flat_grad, group=self.group,
                                                 async_op=True)

    def finish_gradient_sync(self) -> None:
        """After the last backward of an optimizer step: reduce what is left, wait, hand the shards their grads."""
        if not self.require_sync:
            return
        for bucket in self.buckets:
            if bucket.work is None:
                # parameters that got no gradient this step (unused) still take part, with zeros
                for index in range(len(bucket.params)):
                    self._stage_grad(bucket, index)
                self._launch_reduce(bucket)
        for bucket in self.buckets:
            assert bucket.work is not None and bucket.reduced_chunk is not None and bucket.flat_grad is not None
            bucket.work.wait()
            chunk = bucket.reduced_chunk.div_(self.world)
            if self.stage == 1:
                # keep the full gradient buffer (stage 1 partitions only optimizer state); the shard's gradient
                # is a view of its own chunk of it
                own = bucket.own(bucket.flat_grad)
                own.copy_(chunk)
                chunk = own
            else:
                bucket.flat_grad = None
            grad = chunk.to("cpu", non_blocking=True) if self.offload else chunk
            assert bucket.shard is not None
            bucket.shard.grad = self._dtensor(grad, bucket.flat.numel())
            bucket.work, bucket.reduced_chunk = None, None
            bucket.ready_params.clear()

    # -- parameters ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def gather_parameters(self) -> None:
        """After the optimizer stepped the owned chunks: all-gather every bucket back into the model."""
        works = []
        for bucket in self.buckets:
            assert bucket.shard is not None
            local = bucket.shard.to_local()
            # a separate send buffer: gloo does not promise that an input aliasing the output is safe
            send = local.to(bucket.flat.device, copy=True)
            works.append(dist.all_gather_single(bucket.flat, send, group=self.group, async_op=True))
        for work in works:
            work.wait()

    @torch.no_grad()
    def refresh_shards(self) -> None:
        """Copy the owned chunks of the parameters into the shard parameters (after a checkpoint load)."""
        for bucket in self.buckets:
            assert bucket.shard is not None
            local = bucket.shard.to_local()
            own = bucket.own(bucket.flat)
            if local.data_ptr() != own.data_ptr():
                local.copy_(own)

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


# -- stage 3 ------------------------------------------------------------------------------------------------------
def declared_model(module: nn.Module) -> nn.Module | None:
    """The sub-module that declares its pipeline units (``pipeline_units()``), e.g. a LightningModule's GPT."""
    return next((m for m in module.modules() if callable(getattr(m, "pipeline_units", None))), None)


def fully_shard_units(module: nn.Module, dp_mesh: DeviceMesh, offload: bool = False) -> list[nn.Module]:
    """ZeRO-3 with FSDP2: shard each repeated block (``layers.N`` of the declared units), then the model itself.

    Each block is gathered just before its forward and again for its backward, and freed after, so peak parameter
    memory is about one block. The remaining units (embedding, final norm, head -- a small share of a real model)
    form the root group, which FSDP2 keeps gathered from forward into backward: the same grouping torchtitan and a
    hand-written Lightning ``ModelParallelStrategy`` use, with fewer, larger collectives than one group per unit.
    Traffic is therefore 3 Psi_blocks + 2 Psi_root elements (x (N-1)/N) rather than exactly 3 Psi. A tied
    embedding and head stay together in the root group. A module that declares no units has each direct child
    with parameters sharded as its own root. Returns the FSDP2 roots.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    policy = CPUOffloadPolicy() if offload else OffloadPolicy()
    model = declared_model(module)
    if model is None:
        roots = [child for child in module.children() if any(True for _ in child.parameters())]
        for child in roots:
            fully_shard(child, mesh=dp_mesh, offload_policy=policy)
        return roots
    blocks = [name for name in model.pipeline_units() if "." in name]  # items of a repeated container
    for name in blocks:
        fully_shard(model.get_submodule(name), mesh=dp_mesh, offload_policy=policy)
    fully_shard(model, mesh=dp_mesh, offload_policy=policy)
    return [model]
