"""Sizes -> a validated DeviceMesh, and each rank's place in it.

Ranks are laid out as a ``(pp, dp, cp, tp)`` grid in row-major order: tensor-parallel ranks are innermost
(adjacent ranks, which on a GPU node share the fastest links, carry the most traffic), then context parallel (the
sequence split; its key/value all-gather is the next heaviest), then data parallel, and pipeline stages outermost --
the order Megatron-LM and torchtitan use. For world 16 with pp=4 (dp=4, cp=tp=1) the pipeline groups are
[0, 4, 8, 12], [1, 5, 9, 13], ... exactly as in the seed notes. Gradients are averaged over the flattened
``dp_cp`` mesh: the cp ranks of a replica hold the same parameters and saw different tokens of the same samples.

Everything here except :func:`build_device_mesh` is pure arithmetic, so a layout is validated in the launching
process before any rank is started or waits on a collective.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: Mesh dimension names, outermost first.
MESH_DIMS: tuple[str, ...] = ("pp", "dp", "cp", "tp")
#: the flattened (dp, cp) mesh data-parallel gradients are averaged over
GRAD_MESH = "dp_cp"
#: the expert-parallel mesh's dimensions (:func:`build_expert_mesh`): the (dp, cp) ranks of one (pp, tp) coordinate
#: regrouped as (expert replicas, ep), ep innermost
EXPERT_MESH_DIMS: tuple[str, ...] = ("pp", "expert_dp", "ep", "tp")

Size = int | Literal["auto"]

#: activation recompute kinds (:mod:`lightning_par.parallel.recompute`; here, without torch, for the parsers)
RECOMPUTE_KINDS: tuple[str, ...] = ("none", "selective", "full")


class LayoutError(ValueError):
    """A parallel layout that cannot be built; the message says what is wrong and how to fix it."""


def is_number(value: object, *, integer: bool = False, minimum: float | None = None,
              above: float | None = None) -> bool:
    """Whether ``value`` is a number an option may take: an ``int`` (``integer=True``: only an ``int``, so ``1.0``
    is refused) or a finite ``float``, never a ``bool`` (``True`` is an ``int`` in Python, and would pass as 1), at
    least ``minimum`` and more than ``above`` where given. The one rule behind every numeric option's check."""
    if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
        return False
    if isinstance(value, float) and not math.isfinite(value):  # nan fails no bound test, inf passes every one
        return False
    return (minimum is None or value >= minimum) and (above is None or value > above)


def check_number(name: str, value: object, use: str, *, integer: bool = False, minimum: float | None = None,
                 above: float | None = None, what: str = "valid") -> None:
    """:class:`LayoutError` ``NAME=VALUE is not WHAT: use USE.`` unless :func:`is_number` accepts ``value``."""
    if not is_number(value, integer=integer, minimum=minimum, above=above):
        raise LayoutError(f"{name}={value!r} is not {what}: use {use}.")


def _check_size(name: str, value: object, allow_auto: bool) -> None:
    if allow_auto and value == "auto":
        return
    allowed = 'a positive integer or "auto"' if allow_auto else "a positive integer"
    check_number(name, value, allowed, integer=True, minimum=1, what="a valid size")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved sizes of the parallel dimensions; ``dp * cp * tp * pp`` equals the world size.

    ``ep`` (expert parallel) is no dimension of its own: the dp x cp ranks of one (pp, tp) coordinate, taken in
    groups of ``ep`` consecutive ones, split the experts between them (Megatron-Core's and torchtitan's expert
    parallel), so ``ep`` divides ``dp * cp``; each expert is then replicated on ``dp * cp / ep`` ranks.
    """

    dp: int
    tp: int
    pp: int
    cp: int = 1
    ep: int = 1

    @classmethod
    def resolve(cls, world_size: int, dp: Size = "auto", tp: int = 1, pp: int = 1, cp: int = 1,
                ep: int = 1) -> ParallelDims:
        """Validate sizes against ``world_size``; ``dp="auto"`` takes what the others leave: world / (tp * pp * cp)."""
        _check_size("world_size", world_size, allow_auto=False)
        _check_size("dp", dp, allow_auto=True)
        _check_size("tp", tp, allow_auto=False)
        _check_size("pp", pp, allow_auto=False)
        _check_size("cp", cp, allow_auto=False)
        _check_size("ep", ep, allow_auto=False)
        model_parallel = tp * pp * cp
        named = f"tp={tp} x pp={pp}" + (f" x cp={cp}" if cp > 1 else "")
        if world_size % model_parallel:
            raise LayoutError(
                f"{named} = {model_parallel} does not divide the world size {world_size}. "
                f"Choose sizes whose product divides {world_size}, or launch a multiple of {model_parallel} "
                "processes (devices x num_nodes)."
            )
        if dp == "auto":
            dp = world_size // model_parallel
        elif dp * model_parallel != world_size:
            raise LayoutError(
                f"dp={dp} x {named} = {dp * model_parallel}, but the world size is {world_size}. "
                f'Set dp="auto" (it becomes {world_size // model_parallel}) or change devices x num_nodes to '
                f"{dp * model_parallel}."
            )
        if (dp * cp) % ep:
            carved = f"dp={dp} x cp={cp} = {dp * cp}" if cp > 1 else f"dp={dp}"
            raise LayoutError(
                f"ep={ep} does not divide {carved}: the experts are split over ep of the data-parallel ranks. "
                f"Choose an ep that divides {dp * cp}, or launch more data-parallel ranks."
            )
        return cls(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape in :data:`MESH_DIMS` order."""
        return tuple(getattr(self, d) for d in MESH_DIMS)

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's index along each dimension, e.g. ``{"pp": 1, "dp": 0, "cp": 0, "tp": 1}``."""
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside the world of {self.world_size} ranks.")
        coords = {}
        for name in reversed(MESH_DIMS):
            size = getattr(self, name)
            coords[name] = rank % size
            rank //= size
        return {d: coords[d] for d in MESH_DIMS}

    def rank_of(self, **coords: int) -> int:
        """Global rank at the given coordinates (missing dimensions count as 0)."""
        rank = 0
        for name in MESH_DIMS:
            rank = rank * getattr(self, name) + coords.get(name, 0)
        return rank

    def groups(self, dim: str) -> list[list[int]]:
        """All process groups along ``dim``: each list holds the ranks that differ only in that coordinate."""
        if dim not in MESH_DIMS:
            raise LayoutError(f"unknown mesh dimension {dim!r}; the dimensions are {MESH_DIMS}.")
        others = [d for d in MESH_DIMS if d != dim]
        result = []
        for fixed in itertools.product(*(range(getattr(self, d)) for d in others)):
            base = dict(zip(others, fixed, strict=True))
            result.append([self.rank_of(**base, **{dim: i}) for i in range(getattr(self, dim))])
        return sorted(result)

    def group_of(self, rank: int, dim: str) -> list[int]:
        """The ranks in ``rank``'s group along ``dim``."""
        return next(g for g in self.groups(dim) if rank in g)

    @property
    def expert_dp(self) -> int:
        """How many ranks hold each expert (its gradient is averaged over them): ``dp * cp / ep``."""
        return self.dp * self.cp // self.ep

    def expert_groups(self, dim: str = "ep") -> list[list[int]]:
        """The groups of :func:`build_expert_mesh`'s ``dim``: ``"ep"`` (ranks splitting the experts: consecutive
        data-parallel ranks) or ``"expert_dp"`` (ranks holding the same experts), by arithmetic alone."""
        if dim not in ("ep", "expert_dp"):
            raise LayoutError(f"unknown expert mesh dimension {dim!r}; the dimensions are ('ep', 'expert_dp').")

        def rank(p: int, t: int, g: int) -> int:  # g: the flattened (dp, cp) index
            return self.rank_of(pp=p, dp=g // self.cp, cp=g % self.cp, tp=t)

        outer, inner = (self.expert_dp, self.ep) if dim == "ep" else (self.ep, self.expert_dp)
        return sorted([rank(p, t, r * self.ep + i if dim == "ep" else i * self.ep + r) for i in range(inner)]
                      for p in range(self.pp) for t in range(self.tp) for r in range(outer))

    def describe(self) -> str:
        experts = f", experts over ep={self.ep} of them" if self.ep > 1 else ""
        return f"{self.describe_gradient_group()}{experts} x tp={self.tp} x pp={self.pp} (world {self.world_size}; " \
               "tp innermost, pp outermost)"

    def describe_gradient_group(self) -> str:
        """The ranks data-parallel gradients are averaged over: ``dp=N``, or ``dp=N x cp=M`` under cp > 1."""
        return f"dp={self.dp} x cp={self.cp}" if self.cp > 1 else f"dp={self.dp}"

    def rank_table(self) -> str:
        """Every global rank's coordinates and the groups along each dimension, for the start-up log."""
        shown = range(self.world_size) if self.world_size <= 64 else [*range(32), *range(self.world_size - 32,
                                                                                          self.world_size)]
        shown_dims = MESH_DIMS if self.cp > 1 else tuple(d for d in MESH_DIMS if d != "cp")
        lines = [f"rank -> ({', '.join(shown_dims)})"]
        for rank in shown:
            if rank == self.world_size - 32 and self.world_size > 64:
                lines.append(f"  ... ({self.world_size - 64} more)")
            c = self.coordinates(rank)
            lines.append(f"  {rank:>4} -> ({', '.join(str(c[d]) for d in shown_dims)})")
        for dim in MESH_DIMS:
            if getattr(self, dim) > 1:
                groups = self.groups(dim)
                listed = " ".join(str(g) for g in groups[:8]) + (f" ... ({len(groups) - 8} more)" if len(groups) > 8
                                                                 else "")
                lines.append(f"{dim} groups: {listed}")
        if self.ep > 1:
            for dim in ("ep", "expert_dp"):
                groups = self.expert_groups(dim)
                lines.append(f"{dim} groups: " + " ".join(str(g) for g in groups[:8]) +
                             (f" ... ({len(groups) - 8} more)" if len(groups) > 8 else ""))
        return "\n".join(lines)


def build_device_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """Create the one DeviceMesh every strategy works on (needs an initialized process group).

    Sub-meshes are taken by name: ``mesh["dp"]``, ``mesh["cp"]``, ``mesh["tp"]``, ``mesh["pp"]`` (and
    :func:`gradient_mesh`); each has its process group (``mesh["dp"].get_group()``), and ``get_local_rank()`` gives the
    coordinate.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.get_world_size() != dims.world_size:
        raise LayoutError(f"the process group has {dist.get_world_size()} ranks but the layout {dims.describe()}.")
    return init_device_mesh(device_type, dims.shape, mesh_dim_names=MESH_DIMS)


def build_expert_mesh(dims: ParallelDims, device_type: str) -> DeviceMesh:
    """The mesh of expert parallel (``dims.ep > 1``; needs an initialized process group): the same ranks as
    :func:`build_device_mesh`'s, the (dp, cp) ranks flattened and regrouped as (``expert_dp``, ``ep``) --
    :data:`EXPERT_MESH_DIMS`. ``mesh["ep"]``: the ranks that split one layer's experts and exchange tokens;
    ``mesh["expert_dp"]``: the ranks holding the same experts, over which their gradients are averaged.

    Its own mesh (torch cannot split one dimension of a mesh into two without private calls); the ranks' order is
    :func:`build_device_mesh`'s, row-major, so ep groups are consecutive data-parallel ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (dims.pp, dims.expert_dp, dims.ep, dims.tp), mesh_dim_names=EXPERT_MESH_DIMS)


def gradient_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh data-parallel gradients are averaged over: ``mesh["dp"]``, or under cp > 1 the (dp, cp) ranks
    flattened into one dimension, :data:`GRAD_MESH` (torchtitan's ``dp_shard_cp``); keep the one returned (torch
    deprecates slicing a flattened dimension from the root mesh)."""
    if mesh["cp"].size() == 1:
        return mesh["dp"]
    return mesh["dp", "cp"]._flatten(GRAD_MESH)
