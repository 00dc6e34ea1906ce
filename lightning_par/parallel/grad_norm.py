"""The whole model's gradient norm on any layout, and clipping by it.

Each rank holds a part of every gradient: a pipeline stage's, a tensor-parallel shard, a ZeRO or FSDP2 shard over
data parallel, or several at once in 3D. The global 2-norm is the square root of the sum of squares over every
element of the unsplit model, each counted once. A gradient that is a DTensor says where it is split: its local
squares are summed over the mesh dimensions where it is ``Shard``, not over those where it is ``Replicate``. Plain
tensors are full values (a replica). Pipeline stages hold different parameters: their sums are added over the
pipeline group, a parameter held on several pipeline ranks (a tied embedding and head) counted on one of them.

Written here because ``torch.nn.utils.get_total_norm`` reduces a DTensor over its own mesh only and knows nothing of
pipeline stages, and the DTensors of one model live on different meshes (tp; dp; (dp, tp); ZeRO shards on dp).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _split_dims(grad: DTensor) -> tuple[int, ...]:
    """Mesh dimensions the gradient is split over (``Shard``, and FSDP2's ``_StridedShard`` on a tp shard)."""
    if any(placement.is_partial() for placement in grad.placements):
        raise RuntimeError("a gradient is still a partial sum (DTensor Partial): reduce it before taking the norm")
    return tuple(i for i, placement in enumerate(grad.placements) if not placement.is_replicate())


def global_grad_norm(grads: Iterable[Tensor], pp_group: dist.ProcessGroup | None = None,
                     device: torch.device | None = None) -> Tensor:
    """The 2-norm (fp32, on ``device``) of all ``grads`` of every rank, as one process would compute it.

    ``grads``: this rank's gradients, each counted here (leave out the copies another pipeline rank counts).
    ``pp_group``: the pipeline group whose ranks hold different stages (None without pipeline parallel).
    Every rank of a data- or tensor-parallel group must pass gradients of the same kinds (they hold the same
    stage), so their reductions match.
    """
    sums: dict[tuple, Tensor] = {}
    meshes: dict[tuple, DeviceMesh] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh  # keyed by names and shape: the same on every rank, unlike the object
            key = (tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape), _split_dims(grad))
            meshes[key] = mesh
            local = grad.to_local()
        else:
            key, local = ("plain",), grad
        square = local.detach().float().pow(2).sum()
        device = device or square.device
        sums[key] = sums[key] + square if key in sums else square
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key in sorted(sums, key=str):  # the same order on every rank of a group
        part = sums[key]
        if key != ("plain",):
            mesh = meshes[key]
            for dim in key[2]:
                dist.all_reduce(part, group=mesh.get_group(dim))
        total = total + part
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


@torch.no_grad()
def clip_grads_(grads: Iterable[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale ``grads`` in place so that the global norm is at most ``max_norm`` (as ``clip_grad_norm_`` does)."""
    coef = float(max_norm) / (float(total_norm) + 1e-6)
    if coef < 1.0:
        for grad in grads:
            (grad.to_local() if isinstance(grad, DTensor) else grad).mul_(coef)
