"""Data parallelism across the mesh's ``dp`` dimension.

Stage 0 keeps a full replica per rank and averages gradients with PyTorch's DistributedDataParallel: its reducer
already buckets gradients and overlaps each bucket's all-reduce with the rest of backward. A runner that defers the
reduction (a pipeline schedule runs many micro-batch backwards, in pieces DDP's reducer cannot follow) averages them
with :class:`BucketedAllReduce` instead: the same buckets and average, launched when the runner says a stage's
gradients are complete. The ZeRO stages (sharded optimizer state, gradients, parameters) build on the same ``dp``
mesh.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from lightning_par.parallel.blocks import BlockTypes, ModelBlocks


def replicate_data_parallel(module: nn.Module, dp_mesh: DeviceMesh, bucket_cap_mb: float = 25.0) -> nn.Module:
    """Wrap ``module`` so its gradients are all-reduced (averaged) over ``dp_mesh`` during backward.

    With a single data-parallel rank there is nothing to reduce and the module is returned as is.
    """
    if dp_mesh.size() == 1:
        return module
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    return DistributedDataParallel(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=bucket_cap_mb,
        # DDP broadcasts rank 0's parameters and buffers at construction (its default in every torch release: the
        # flag for it, broadcast_buffers, is deprecated since 2.13), so replicas start identical even if a user's
        # initialisation was not seeded the same on every rank.
        # gradients live in the all-reduce buckets instead of beside them: one gradient copy, as the ZeRO
        # formula for stage 0 counts (4 bytes per parameter), not two
        gradient_as_bucket_view=True,
    )


def replicate_units(module: nn.Module, dp_mesh: DeviceMesh, block_types: BlockTypes = None,
                    found: ModelBlocks | None = None, ignored: Sequence[nn.Parameter] = ()) -> list[nn.Module]:
    """Stage 0 for a model whose parameters are DTensors (tensor parallel): replicas, gradients all-reduced.

    DistributedDataParallel's reducer takes only plain tensors. ``_pre_dp_module_transform`` would make it accept a
    TP model by handing it the local shards -- but then the optimizer and gradient clipping see local shards too,
    and the clipping norm would be each rank's own, not the global one. FSDP2's ``replicate`` (the DDP of the
    composable API) keeps the parameters as DTensors on the (dp, tp) mesh -- replicated over dp, split over tp --
    all-reduces gradients per group as backward produces them (overlapping it, as DDP's buckets do) and stops
    syncing with ``set_requires_gradient_sync(False)`` for gradient accumulation. Groups are those of
    :func:`~lightning_par.parallel.zero.fully_shard_units` (each repeated block found by
    :func:`~lightning_par.parallel.blocks.find_blocks`, then the blocks' root, then what lies outside it). A model
    without blocks is one unit: each direct child holding parameters is replicated as its own root. ``found``: the
    blocks the split found (``ModelParts.found``), else they are searched for here. ``ignored``: parameters left out
    (expert parallel's experts, each rank holding others).
    Returns the roots (empty with a single data-parallel rank: nothing to reduce).
    """
    from lightning_par._compat import replicate
    from lightning_par.parallel.zero import _apply_groups, data_parallel_groups
    from lightning_par.topology import LayoutError

    if dp_mesh.size() == 1:
        return []
    apply = functools.partial(replicate, mesh=dp_mesh, ignored_params=set(ignored) or None)
    try:
        groups = data_parallel_groups(module, block_types, found=found)
    except LayoutError:
        if block_types:
            raise  # the user named block types that match nothing: say so
        roots = [child for child in module.children() if any(True for _ in child.parameters())]
        for child in roots:
            apply(child)
        return roots
    return _apply_groups(module, groups, apply)


class BucketedAllReduce:
    """Average gradients over ``group`` bucket by bucket, asynchronously.

    Gradients are packed into buckets of at most ``bucket_cap_mb`` (per dtype and device); each bucket is copied into
    one flat buffer whose all-reduce starts at once. At most ``max_in_flight`` buffers are alive (launching another
    completes the oldest: wait, divide by the group size, copy back, free), so the extra memory is two buckets, not a
    copy of every gradient; a bucket of one contiguous gradient is reduced in place.

    Attributes: ``buffer_bytes`` (the flat buffers alive now), ``peak_buffer_bytes`` (their most since
    construction), ``buckets_launched`` (all-reduces started since construction).
    """

    def __init__(self, group: dist.ProcessGroup, bucket_cap_mb: float, max_in_flight: int = 2) -> None:
        self.group = group
        self.world = dist.get_world_size(group)
        self.cap = max(1, int(bucket_cap_mb * 2**20))
        self.max_in_flight = max(1, max_in_flight)
        self._in_flight: list[tuple[Any, Tensor, list[Tensor]]] = []  # (work, buffer, gradients)
        self.buffer_bytes = 0
        self.peak_buffer_bytes = 0
        self.buckets_launched = 0

    def launch(self, grads: Sequence[Tensor]) -> None:
        """Start averaging ``grads`` (which nothing may change until :meth:`finish`); a no-op on one rank."""
        if self.world == 1:
            return
        filling: dict[tuple, list[Tensor]] = {}
        filled: dict[tuple, int] = {}
        for grad in grads:
            key = (grad.dtype, grad.device)
            bucket = filling.setdefault(key, [])
            size = grad.numel() * grad.element_size()
            if bucket and filled[key] + size > self.cap:
                self._start(bucket)
                bucket = filling[key] = []
            if not bucket:
                filled[key] = 0
            bucket.append(grad)
            filled[key] += size
        for bucket in filling.values():
            if bucket:
                self._start(bucket)

    def _start(self, grads: list[Tensor]) -> None:
        while len(self._in_flight) >= self.max_in_flight:  # free a buffer before making the next
            self._complete(self._in_flight.pop(0))
        if len(grads) == 1 and grads[0].is_contiguous():
            buffer = grads[0]  # in place
        else:
            buffer = torch.cat([g.reshape(-1) for g in grads])
            self.buffer_bytes += buffer.numel() * buffer.element_size()
            self.peak_buffer_bytes = max(self.peak_buffer_bytes, self.buffer_bytes)
        work = dist.all_reduce(buffer, group=self.group, async_op=True)
        self._in_flight.append((work, buffer, grads))
        self.buckets_launched += 1

    def _complete(self, entry: tuple[Any, Tensor, list[Tensor]]) -> None:
        work, buffer, grads = entry
        work.wait()
        buffer /= self.world
        if buffer is grads[0]:
            return
        offset = 0
        for grad in grads:
            grad.copy_(buffer[offset:offset + grad.numel()].view(grad.shape))
            offset += grad.numel()
        self.buffer_bytes -= buffer.numel() * buffer.element_size()

    def finish(self) -> None:
        """Wait for every bucket launched and write the averages into the gradients."""
        while self._in_flight:
            self._complete(self._in_flight.pop(0))
