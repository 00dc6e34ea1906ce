"""ZeRO-0 under pipeline parallel: gradients averaged over data parallel in flat buckets, asynchronously.

:class:`BucketedAllReduce` packs gradients into buckets of at most ``bucket_cap_mb`` (per dtype and device), copies
each into one flat buffer and starts its all-reduce; at most two buckets' buffers are alive at once (launching a
third completes the oldest: wait, divide by the group size, copy back, free), so the extra memory is two buckets,
not a copy of every gradient. A bucket of one contiguous gradient is reduced in place, without a buffer. The
:class:`~lightning_par.parallel.pipeline.runtime.PipelineRuntime` launches a stage's buckets as the schedule ends
that stage's last backward of the step (B, or W in the zero-bubble schedules), and completes them all before the
optimizer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


class BucketedAllReduce:
    """Average gradients over ``group`` bucket by bucket (see the module docstring).

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
