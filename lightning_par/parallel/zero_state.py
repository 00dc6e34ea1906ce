"""ZeRO-1/2's checkpoint state (:class:`ZeroStates`) in the per-parameter format every other layout writes.

A ZeRO-1/2 optimizer steps one flat chunk per bucket (:class:`~lightning_par.parallel.zero.ZeroPartitioner`), so
its own ``state_dict`` is keyed by bucket and padded: it would resume only into the same buckets on the same number
of ranks. Here each rank's chunk is cut at the parameters' borders and written as the part of each parameter it
holds, under the same keys that ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` gives for
FSDP2, tensor-parallel, pipeline and single-process layouts (``state.<fqn>.exp_avg``, ``param_groups.<fqn>.lr``),
with the parameter's full (global) shape. DCP then moves states between any two layouts by overlapping chunks.

A chunk's share of a parameter is a flat range of its (row-major) elements, which no DTensor placement can describe.
DCP's other tensor kind, ``ShardedTensor``, holds any list of rectangular blocks, and a flat range is a few of them
(a partial row, whole rows, a partial row; recursively per dimension), each a contiguous view of the state: saving
writes the views and loading fills them in place. These ShardedTensors carry only this rank's blocks -- as DCP's own
``_flatten_sharded_tensors`` makes them -- and serve only for DCP (which plans from local blocks and the global size).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_par._compat import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    compute_local_shape_and_global_offset,
    make_wrapper_subclass,
)
from lightning_par.parallel.param_states import ParamStates, materialize_optimizer_state
from lightning_par.parallel.zero import ZeroPartitioner

# DCP reads ShardedTensor's size through its (deprecated) torch function; the objects here never leave DCP
warnings.filterwarnings("ignore", message="Please use DTensor instead and we are deprecating ShardedTensor")


@dataclass(frozen=True)
class Piece:
    """The part of one model parameter that this rank's chunk of a bucket holds."""

    param: nn.Parameter  # the model's parameter
    shard: nn.Parameter  # the optimizer's parameter (the owned chunk of the bucket)
    start: int  # first element of the parameter's local values (flattened) in the chunk
    stop: int
    at: int  # where that element sits in the chunk


#: one partitioner, or several over disjoint parameters (expert parallel: the experts' own, over ``expert_dp``)
Partitioners = ZeroPartitioner | Sequence[ZeroPartitioner]


def _each(partitioners: Partitioners) -> list[ZeroPartitioner]:
    return [partitioners] if isinstance(partitioners, ZeroPartitioner) else list(partitioners)


def _buckets(partitioners: Partitioners) -> Iterable:
    return [bucket for partitioner in _each(partitioners) for bucket in partitioner.buckets]


def _wait(partitioners: Partitioners) -> None:
    for partitioner in _each(partitioners):
        partitioner.wait_all()


def _gather(partitioners: Partitioners) -> None:
    for partitioner in _each(partitioners):
        partitioner.gather_parameters(wait=True)


def pieces(partitioners: Partitioners) -> Iterator[Piece]:
    """Every (parameter, chunk) overlap on this rank; bucket padding belongs to no parameter and is skipped."""
    for bucket in _buckets(partitioners):
        low, high = bucket.rank * bucket.chunk, (bucket.rank + 1) * bucket.chunk
        for index, param in enumerate(bucket.params):
            begin, end = bucket.region(index)
            first, last = max(begin, low), min(end, high)
            if first < last:
                yield Piece(param, bucket.shard, first - begin, last - begin, first - low)


def blocks(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[list[int], list[int]]]:
    """``(offsets, sizes)`` of the rectangular blocks that elements ``[start, stop)`` of a row-major tensor of
    ``shape`` make, in order; each is contiguous (ones, then a count, then whole trailing dimensions)."""
    out: list[tuple[list[int], list[int]]] = []

    def cut(dim: int, prefix: list[int], start: int, stop: int) -> None:
        inner = math.prod(shape[dim + 1:])
        trailing = list(shape[dim + 1:])
        if start % inner:  # a partial slice at the front: recurse into it
            row = start // inner
            end = min(stop, (row + 1) * inner)
            cut(dim + 1, [*prefix, row], start - row * inner, end - row * inner)
            start = end
        whole_end = stop // inner
        if start < stop and whole_end > start // inner:  # whole slices
            out.append(([*prefix, start // inner, *[0] * len(trailing)],
                        [1] * len(prefix) + [whole_end - start // inner, *trailing]))
            start = whole_end * inner
        if start < stop:  # a partial slice at the back
            cut(dim + 1, [*prefix, whole_end], start - whole_end * inner, stop - whole_end * inner)

    if not shape:
        return [([], [])] if stop > start else []
    cut(0, [], start, stop)
    return out


def _local_offset(param: Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's local shape of ``param`` and its offset in the full parameter (tensor parallel splits it)."""
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        return tuple(shape), tuple(offset)
    return tuple(param.shape), (0,) * param.dim()


def _blocks_tensor(values: Tensor, param: Tensor, piece: Piece) -> ShardedTensor:
    """``values`` (one state of the chunk, flat) as the blocks of ``param``'s full shape that ``piece`` covers."""
    shape, offset = _local_offset(param)
    rank = dist.get_rank() if dist.is_initialized() else 0
    shards, at = [], piece.at
    for offsets, sizes in blocks(shape, piece.start, piece.stop):
        count = math.prod(sizes)
        view = values[at:at + count].view(sizes)
        place = [o + base for o, base in zip(offsets, offset, strict=True)]
        shards.append(Shard(view, ShardMetadata(place, list(sizes), f"rank:{rank}/{values.device}")))
        at += count
    return blocks_tensor(shards, torch.Size(param.shape))


def blocks_tensor(shards: list[Shard], size: torch.Size) -> ShardedTensor:
    """A DCP-only ShardedTensor: this rank's blocks ``shards`` of a tensor of ``size`` (no cross-rank metadata, no
    process group)."""
    dtype, device = shards[0].tensor.dtype, shards[0].tensor.device
    tensor = make_wrapper_subclass(ShardedTensor, size, dtype=dtype, device=device)
    tensor._metadata = ShardedTensorMetadata([s.metadata for s in shards], size, TensorProperties(dtype=dtype))
    tensor._local_shards = shards
    tensor._sharding_spec = None
    tensor._process_group = None
    return tensor


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer,
                    partitioner: Partitioners) -> dict[str, Any]:
    """``optimizer``'s state (its state must exist: a step was taken or it was materialized) as this rank's part
    of the per-parameter flat format; the tensors are views of the optimizer's own, so DCP can load into them."""
    _wait(partitioner)  # no all-gather after the step still writing a bucket (the shard's chunk among them)
    names = {id(p): name for name, p in module.named_parameters()}
    group_of = {id(p): group for group in optimizer.param_groups for p in group["params"]}
    flat: dict[str, Any] = {}
    for piece in pieces(partitioner):
        group = group_of.get(id(piece.shard))
        if group is None:  # another optimizer's bucket
            continue
        name = names[id(piece.param)]
        for key, value in optimizer.state.get(piece.shard, {}).items():
            local = value.to_local() if isinstance(value, DTensor) else value
            if isinstance(local, Tensor) and local.dim() == 1 and local.numel() == _chunk_numel(piece.shard):
                flat[f"state.{name}.{key}"] = _blocks_tensor(local, piece.param, piece)
            else:  # per-parameter scalars (Adam's step): the same on every rank holding a piece
                flat[f"state.{name}.{key}"] = value
        for key, value in group.items():
            if key != "params":
                flat[f"param_groups.{name}.{key}"] = value
    return flat


def _chunk_numel(shard: nn.Parameter) -> int:
    return (shard.to_local() if isinstance(shard, DTensor) else shard).numel()


def set_hyperparameters(module: nn.Module, optimizer: torch.optim.Optimizer, partitioner: Partitioners,
                        flat: dict[str, Any]) -> None:
    """After DCP filled the state tensors in place: each param group's hyper-parameters from the loaded entries of
    its parameters (DCP replaces those dict values rather than filling them)."""
    names = {id(p): name for name, p in module.named_parameters()}
    owner = {id(piece.shard): names[id(piece.param)] for piece in pieces(partitioner)}
    for group in optimizer.param_groups:
        name = next((owner[id(s)] for s in group["params"] if id(s) in owner), None)
        if name is None:
            continue
        for key in list(group):
            entry = f"param_groups.{name}.{key}"
            if key != "params" and entry in flat:
                group[key] = flat[entry]


def copy_full(target: dict[str, Any], full: dict[str, Any]) -> None:
    """Copy whole tensors (as one process holds them) into ``target``'s tensors and blocks, for the keys in both:
    each rank takes the blocks of its chunks."""
    for key, value in target.items():
        if key not in full:
            continue
        if isinstance(value, ShardedTensor):
            for shard in value.local_shards():
                where = tuple(slice(o, o + n) for o, n in zip(shard.metadata.shard_offsets,
                                                               shard.metadata.shard_sizes, strict=True))
                shard.tensor.copy_(full[key][where])
        elif isinstance(value, DTensor):  # outside the buckets (a frozen parameter split by tp or ep): its slice
            shape, offset = _local_offset(value)
            value.to_local().copy_(full[key][tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))])
        elif isinstance(value, Tensor):
            value.copy_(full[key])


def fill_from_full(module: nn.Module, optimizer: torch.optim.Optimizer, partitioner: Partitioners,
                   full: dict[str, Any]) -> None:
    """Set ``optimizer``'s state from ``full``, the flat per-parameter format with whole tensors. The optimizer's
    state must exist."""
    copy_full(optimizer_state(module, optimizer, partitioner), full)
    set_hyperparameters(module, optimizer, partitioner, full)


def model_state(module: nn.Module, partitioner: Partitioners) -> dict[str, Any]:
    """The model's state with each bucket parameter's weights taken from the optimizer's shards rather than the
    buckets: under mixed precision the buckets hold bf16 copies and the shards the fp32 master weights, which are the
    ones to save (and to load into, before the all-gather writes them back into the buckets). A rank holding no
    element of a parameter writes nothing for it."""
    _wait(partitioner)  # the gathers after the step land before anything is read (also a state_dict hook)
    state = module.state_dict(keep_vars=True)
    held: dict[int, Piece] = {id(piece.param): piece for piece in pieces(partitioner)}
    partitioned = {id(p) for bucket in _buckets(partitioner) for p in bucket.params}
    out: dict[str, Any] = {}
    for name, value in state.items():
        if id(value) not in partitioned:
            out[name] = value.detach() if isinstance(value, Tensor) else value
        elif id(value) in held:
            piece = held[id(value)]
            master = piece.shard.to_local() if isinstance(piece.shard, DTensor) else piece.shard
            out[name] = _blocks_tensor(master.detach(), value, piece)
    return out


def finish_model_load(module: nn.Module, partitioner: Partitioners, loaded: dict[str, Any]) -> None:
    """After DCP filled :func:`model_state`'s blocks (the optimizer's shards) in place: load the entries outside
    the buckets (buffers, frozen parameters) into the module, and all-gather the shards into the buckets -- under
    mixed precision the fp32 masters, rounded once, as after a step. Every rank calls it (a collective)."""
    rest = {name: value for name, value in loaded.items() if not isinstance(value, ShardedTensor)}
    partitioned = {id(p) for bucket in _buckets(partitioner) for p in bucket.params}
    own = module.state_dict(keep_vars=True)
    rest = {name: value for name, value in rest.items() if id(own.get(name)) not in partitioned}
    module.load_state_dict(rest, strict=False)
    _gather(partitioner)  # outside a forward: nothing else would wait for it


class ZeroStates(ParamStates):
    """The checkpoint state of ZeRO-1/2 (the answers of its owner, ``ZeroSync``): the weights come from, and load
    into, the optimizer's shards -- the fp32 masters under mixed precision -- and the load's refresh all-gathers the
    shards into the buckets, the model's parameters (rounded once, as after a step). Refreshing the other way, shards
    from the buckets, would round the fp32 masters to bf16.

    Expert parallel has two partitioners over disjoint parameters -- the dense weights' over dp, the experts' over
    their own replicas (``expert_dp``) -- and both are answered by the same code: each rank's chunks of either are
    cut at the parameters' borders and placed in the parameter's full shape (an expert weight's ep/tp offset
    included), so every expert is saved once, by name, whatever the ep and expert_dp sizes."""

    def __init__(self, *partitioners: ZeroPartitioner) -> None:
        self.partitioners = list(partitioners)
        self.partitioner = self.partitioners[0]  # the one over dp: every group's model parameters (group_params)

    def wait(self) -> None:
        _wait(self.partitioners)

    def model_state(self, module: nn.Module) -> dict[str, Any]:
        return model_state(module, self.partitioners)

    def optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer_state(module, optimizer, self.partitioners)

    def optimizer_target(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        materialize_optimizer_state(optimizer)  # the load fills the state tensors' views
        return self.optimizer_state(module, optimizer)

    def load_model_state(self, module: nn.Module, state: dict[str, Any]) -> None:
        finish_model_load(module, self.partitioners, state)

    def load_optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        set_hyperparameters(module, optimizer, self.partitioners, state)

    def load_full_model_state(self, module: nn.Module, full: dict[str, Any]) -> None:
        super().load_full_model_state(module, full)  # buffers and parameters outside the buckets
        copy_full(model_state(module, self.partitioners), full)  # the shards (fp32 masters) from the full values
        _gather(self.partitioners)

    def optimizer_groups(self, optimizer: torch.optim.Optimizer) -> list[Sequence[Tensor]]:
        # the groups' parameters before the partitioners replaced them by bucket shards (the first one saw them all)
        return [self.partitioner.group_params[id(group)] for group in optimizer.param_groups]

    def load_full_optimizer_state(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        flat = {f"state.{name}.{key}": value for name, entry in state["state"].items() for key, value in entry.items()}
        for group in state["param_groups"]:
            flat.update({f"param_groups.{name}.{key}": value for name in group["params"]
                         for key, value in group.items() if key != "params"})
        fill_from_full(module, optimizer, self.partitioners, flat)
