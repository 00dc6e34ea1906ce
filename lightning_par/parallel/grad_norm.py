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

from lightning_par._compat import foreach_mul_, foreach_norm


def _split_dims(grad: DTensor) -> tuple[int, ...]:
    """Mesh dimensions the gradient is split over (``Shard``, and FSDP2's ``_StridedShard`` on a tp shard)."""
    if any(placement.is_partial() for placement in grad.placements):
        raise RuntimeError("a gradient is still a partial sum (DTensor Partial): reduce it before taking the norm")
    return tuple(i for i, placement in enumerate(grad.placements) if not placement.is_replicate())


def _by_device_and_dtype(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    return groups


def _sum_of_squares(tensors: list[Tensor], device: torch.device) -> Tensor:
    """The fp32 sum of squares of all elements of ``tensors``, on ``device``: one norm kernel per device and dtype
    (``_foreach_norm``, as ``clip_grad_norm_`` does), each part moved to ``device`` -- a partial sum of gradients
    offloaded to the host joins the others (and the all-reduce, which NCCL takes for CUDA tensors only) there."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (_, dtype), group in _by_device_and_dtype(tensors).items():
        # fp32 accumulation for narrower dtypes; _foreach_norm refuses to narrow fp64, whose norms are cast after
        wide = dtype.is_floating_point and torch.finfo(dtype).bits >= 32
        norms = foreach_norm(group, 2.0) if wide else foreach_norm(group, 2.0, dtype=torch.float32)
        total = total + torch.stack(norms).float().square().sum().to(device)
    return total


def global_grad_norm(grads: Iterable[Tensor], pp_group: dist.ProcessGroup | None = None,
                     device: torch.device | None = None) -> Tensor:
    """The 2-norm (fp32, on ``device``) of all ``grads`` of every rank, as one process would compute it.

    ``grads``: this rank's gradients, each counted here (leave out the copies another pipeline rank counts).
    ``pp_group``: the pipeline group whose ranks hold different stages (None without pipeline parallel).
    ``device``: where the partial sums are reduced and the result lives (the rank's root device; default: the
    first gradient's). Every rank of a data- or tensor-parallel group must pass gradients of the same kinds (they
    hold the same stage), so their reductions match.
    """
    locals_: dict[tuple, list[Tensor]] = {}
    meshes: dict[tuple, DeviceMesh] = {}
    for grad in grads:
        if isinstance(grad, DTensor):
            mesh = grad.device_mesh  # keyed by names and shape: the same on every rank, unlike the object
            key = (tuple(mesh.mesh_dim_names or ()), tuple(mesh.mesh.shape), _split_dims(grad))
            meshes[key] = mesh
            local = grad.to_local()
        else:
            key, local = ("plain",), grad
        device = device or local.device
        locals_.setdefault(key, []).append(local.detach())
    total = torch.zeros((), dtype=torch.float32, device=device)
    for key in sorted(locals_, key=str):  # the same order on every rank of a group
        part = _sum_of_squares(locals_[key], total.device)
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
    """Scale ``grads`` in place so that the global norm is at most ``max_norm`` (as ``clip_grad_norm_`` does).

    The coefficient stays a tensor on ``total_norm``'s device and every gradient is multiplied by it, 1 where no
    clipping is needed: deciding on the host would wait for the device at every clipped step."""
    coef = torch.clamp(max_norm / (total_norm.float() + 1e-6), max=1.0)
    tensors = [grad.to_local() if isinstance(grad, DTensor) else grad for grad in grads]
    for (device, _), group in _by_device_and_dtype(tensors).items():
        foreach_mul_(group, coef.to(device))
