"""Data parallelism across the mesh's ``dp`` dimension.

Stage 0 keeps a full replica per rank and averages gradients with PyTorch's DistributedDataParallel: its reducer
already buckets gradients and overlaps each bucket's all-reduce with the rest of backward, so nothing here is
hand-written. The ZeRO stages (sharded optimizer state, gradients, parameters) build on the same ``dp`` mesh.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel


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
        # DDP broadcasts rank 0's parameters and buffers at construction, so replicas start identical even if
        # a user's initialisation was not seeded the same on every rank.
        broadcast_buffers=True,
        # gradients live in the all-reduce buckets instead of beside them: one gradient copy, as the ZeRO
        # formula for stage 0 counts (4 bytes per parameter), not two
        gradient_as_bucket_view=True,
    )
