"""Give freed host memory back to the operating system.

glibc's allocator keeps freed blocks inside its heap for reuse; only the top of the heap is returned on its own.
When long-lived tensors are made right after short-lived ones are freed -- a rank's share after the full tensors it
was cut from, ZeRO buckets after the parameters they replace -- the freed blocks sit below the live ones and stay
resident, and a rank's memory shows up to twice its share at setup. ``malloc_trim(0)`` releases every free page of
the heap. Elsewhere (no glibc) this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_freed_memory() -> None:
    """Return the host heap's free pages to the OS (glibc), so resident memory is what is live."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def fsdp_offload_policy(offload: bool, device_type: str):
    """FSDP2's offload policy for a mesh of ``device_type``: parameter shards in host memory when ``offload``,
    pinned only where a device copies to them (pinning needs an accelerator: on a CPU mesh it fails)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=device_type != "cpu") if offload else OffloadPolicy()
