"""Give a rank its share of the model, and nothing more: the last step of :func:`~lightning_par.parallel.parallelize`.

A model built under :func:`~lightning_par.parallel.deferred_init.deferred_init` has its large tensors on the meta
device. The layout is applied to it there -- pipeline split, tensor parallel (``parallelize_module`` makes meta
DTensors), recompute, FSDP2 ``fully_shard`` (meta shards) -- so that afterwards every meta tensor of the rank's
module describes exactly the piece this rank keeps: a DTensor's local shard, or a whole tensor the rank holds alone.
:func:`materialize_share` then allocates those pieces (swapped into the existing Parameters, so ties and references
hold; FSDP2 takes the new local shard at its lazy init) and fills each one, a tensor at a time, with its slice of the
value a single process would have built (:meth:`DeferredInit.value`) -- or leaves it to a loader that will overwrite
it (pretrained weights). The transient memory is one full tensor beyond the rank's share; no rank ever holds the
model. This is torchtitan's order (parallelise on meta, then initialise), with values bit-for-bit those of one
process, which torchtitan's per-shard ``init_weights`` does not give.

Why by hand: torch has no "materialise the shards of a deferred model" (torchdistx's ``materialize_module`` fills
whole tensors, for builds that no longer exist), and DTensor's ``distribute_tensor`` needs the full tensor on every
rank anyway; cutting it locally needs no communication.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par._compat import StridedShard, compute_local_shape_and_global_offset
from lightning_par.parallel.deferred_init import DeferredInit
from lightning_par.parallel.host_memory import release_freed_memory

__all__ = ["local_piece", "local_slices", "local_tensor", "materialize_share", "named_tensors"]


def local_tensor(tensor: Tensor) -> Tensor:
    """The tensor this rank stores: a DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def local_slices(tensor: Tensor) -> tuple[slice, ...] | None:
    """Where this rank's piece of ``tensor`` sits in the full tensor (one slice per dimension), or None when the
    rank holds it whole. Works for any DTensor placement: tensor-parallel shards, FSDP2's shards of them
    (``_StridedShard``), replicas."""
    if not isinstance(tensor, DTensor):
        return None
    if _packed_dim(tensor) is not None:
        raise ValueError("a packed_colwise parameter is not one slice of the full tensor: use local_piece()")
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def _packed_dim(tensor: DTensor) -> int | None:
    """The dimension of a tensor-parallel ``packed_colwise`` split (one ``_StridedShard`` on a 1-D mesh), else None.
    (FSDP2's ``_StridedShard`` on a 2-D mesh is one slice, which ``compute_local_shape_and_global_offset`` finds.)"""
    placements = tensor.placements
    if len(placements) == 1 and isinstance(placements[0], StridedShard):
        return placements[0].dim % tensor.dim()
    return None


def local_piece(tensor: Tensor, read: Callable[[tuple[slice, ...] | None], Tensor]) -> Tensor:
    """This rank's piece of ``tensor``'s full value, from ``read(slices)`` (a part of the full value; ``None``: all of
    it). A ``packed_colwise`` parameter's piece is its slice of each of the N parts, read one part at a time and
    concatenated (it is not one slice of the full tensor); any other piece is one slice (:func:`local_slices`)."""
    if not isinstance(tensor, DTensor) or _packed_dim(tensor) is None:
        return read(local_slices(tensor))
    dim, placement = _packed_dim(tensor), tensor.placements[0]
    parts, ranks, rank = placement.split_factor, tensor.device_mesh.size(), tensor.device_mesh.get_local_rank()
    part = tensor.shape[dim] // parts
    step = part // ranks  # (resolve_tp_plan checked that parts x tp divides the dimension)
    lead, trail = (slice(None),) * dim, (slice(None),) * (tensor.dim() - dim - 1)
    pieces = [read((*lead, slice(i * part + rank * step, i * part + (rank + 1) * step), *trail))
              for i in range(parts)]
    return torch.cat(pieces, dim=dim)


def named_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every parameter and buffer of ``module`` by name, a tensor held under several names (tied) once."""
    seen: set[int] = set()
    for name, tensor in itertools.chain(module.named_parameters(remove_duplicate=False),
                                        module.named_buffers(remove_duplicate=False)):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


@torch.no_grad()
def materialize_share(module: nn.Module, record: DeferredInit, device: torch.device,
                      skip: Collection[str] = (), parameter_device: torch.device | None = None) -> dict[str, int]:
    """Allocate this rank's piece of every meta tensor of ``module`` on ``device`` and fill it with its slice of the
    single-process value recorded by ``record`` (names relative to ``module``, as captured).

    ``skip``: names whose pieces are left allocated but unfilled, because a loader overwrites them next (their
    random initialisation is never computed). Tensors that are already real keep their values and move to
    ``device``. A parameter keeps its identity (its data is swapped in), so ties and every reference to it hold;
    FSDP2 takes the new local shard at its lazy init. ``parameter_device``: where parameters go instead of
    ``device`` (the host, when FSDP2 offloads them: it refuses parameters materialised on the GPU). States kept outside
    parameters and buffers (torchmetrics' metric states) follow ``device`` too, as ``module.to(device)`` would take
    them in an eager build. Returns ``kept_bytes`` (bytes of this rank's pieces) and
    ``transient_bytes`` (the largest full tensor computed on the way).
    """
    stats = {"kept_bytes": 0, "transient_bytes": 0}
    meta = {name for name, tensor in named_tensors(module) if local_tensor(tensor).is_meta}
    unknown = sorted(meta - set(record.fqns) - set(skip)) if meta else []
    if unknown:
        raise RuntimeError(f"{len(unknown)} tensors are on the meta device but were not built under deferred "
                           f"initialisation, e.g. {unknown[:3]}: build the model in configure_model().")
    # every piece is allocated before any full value is computed: the short-lived full tensors then reuse one region
    # of the heap instead of being interleaved with the pieces that stay (measured, 85M-parameter Llama at tp=4:
    # interleaved, glibc's heap kept up to 2.7x the rank's share resident)
    targets = []
    for name, tensor in named_tensors(module):
        was_meta = local_tensor(tensor).is_meta
        home = parameter_device if parameter_device is not None and isinstance(tensor, nn.Parameter) else device
        target = _allocate(module, tensor, home)
        if was_meta:
            stats["kept_bytes"] += local_tensor(target).numel() * target.element_size()
            targets.append((name, tensor, target))
    for name, tensor, target in targets:
        if name in skip:
            continue
        full = record.value(name)
        stats["transient_bytes"] = max(stats["transient_bytes"], full.numel() * full.element_size())
        piece = local_piece(tensor, lambda slices, full=full: full if slices is None else full[slices])
        local_tensor(target).copy_(piece)
        del piece
        del full
    release_freed_memory()  # the full tensors' blocks
    _move_metric_states(module, device)
    return stats


def _move_metric_states(module: nn.Module, device: torch.device) -> None:
    """Move the torchmetrics metrics inside ``module`` to ``device``: their states are neither parameters nor buffers,
    so the allocation above does not reach them, and an eager build's ``module.to(device)`` (``Metric._apply``)
    would have moved them; left on the host, the first ``update`` with a GPU loss fails."""
    from torchmetrics import Metric

    for sub in module.modules():
        if isinstance(sub, Metric) and sub.device != device:
            sub.to(device)


def _allocate(module: nn.Module, tensor: Tensor, device: torch.device) -> Tensor:
    """Give ``tensor`` (wherever ``module`` holds it) storage on ``device``: uninitialised for a meta tensor, its
    values for a real one. Why not ``module.to_empty``: it empties real tensors too -- torchmetrics states included,
    which ``Metric._apply`` reaches -- and makes a new Parameter per holder, parting tied weights."""
    if local_tensor(tensor).device == device and not local_tensor(tensor).is_meta:
        return tensor
    fresh = torch.empty_like(tensor, device=device) if local_tensor(tensor).is_meta else tensor.to(device)
    if isinstance(tensor, nn.Parameter):
        torch.utils.swap_tensors(tensor, nn.Parameter(fresh, requires_grad=tensor.requires_grad))
        return tensor
    for holder in module.modules():  # a buffer: replaced under every name it has
        for leaf, buffer in holder._buffers.items():
            if buffer is tensor:
                holder._buffers[leaf] = fresh
    return fresh
