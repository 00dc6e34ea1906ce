"""Random numbers under tensor parallelism: dropout that differs where ranks hold different data, agrees elsewhere.

Inside a tensor-parallel region -- from a column-parallel linear's output to the row-parallel linear's input --
each tp rank holds different heads or FFN features, so their dropout masks must be independent draws; with the
default generator in the same state on every rank (the same seed, consumed alike) every rank would draw the
*same* mask for its different slice. Outside the regions the activations are replicated (the residual stream after
the row-parallel reduction), and there the masks must be *equal* on every tp rank, or the replicas silently drift
apart. Megatron-LM solves this with a "model-parallel" RNG state forked inside the regions; this module does the
same: :class:`TensorParallelRNG` keeps one generator state per tp rank (seeded from the tp group's common seed + an
offset + the tp rank) and swaps it in as the default generator's state while a region is open. The default
generator is not advanced inside a region, so it stays identical on the tp ranks.

With sequence parallelism the residual stream is split over the sequence too, so every activation a dropout sees is
this rank's own; the whole forward then runs on the per-rank state.

Why hand-written rather than DTensor's tracker (``torch.distributed.tensor._random.OffsetBasedRNGTracker``): that
tracker only acts on random ops applied to a *DTensor*, and inside our regions the activations are plain local
tensors (the styles return local outputs, so model code such as ``view(B, T, -1, head_dim)`` runs unchanged);
it refuses CPU meshes (``is_rng_supported_mesh`` is False for CPU, and the tracker raises); and it works by Philox
offsets, i.e. it needs to know each shard's global position, which a region's local tensor does not carry. Here
only the generator state is swapped, which works for any device whose default generator state can be read and
written, and for ``F.dropout``, ``nn.Dropout`` and ``scaled_dot_product_attention(dropout_p=...)`` alike.

Limits: the per-rank states are not saved in checkpoints (after resuming, the in-region masks continue from the
seed, not from where they were), and activation recomputation (``torch.utils.checkpoint``) restores only the
default generator, so a recomputed region would draw new masks; neither is used with tensor parallelism here.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

#: Added to the common seed for the in-region generators (Megatron-LM uses the same offset), so the region's
#: stream is not the default generator's own stream shifted by the tp rank.
REGION_SEED_OFFSET = 2718


def _device_module(device_type: str) -> Any:
    return torch if device_type == "cpu" else torch.get_device_module(device_type)


def get_rng_state(device_type: str) -> torch.Tensor:
    """The default generator's state for ``device_type`` (the current device's, for an accelerator)."""
    return _device_module(device_type).get_rng_state()


def set_rng_state(device_type: str, state: torch.Tensor) -> None:
    _device_module(device_type).set_rng_state(state)


class TensorParallelRNG:
    """Per-tp-rank generator state for the tensor-parallel regions; see the module docstring.

    Args:
        tp_mesh: the 1-D tensor-parallel mesh.
        sync: make the default generator equal on the tp ranks first (tp rank 0's state and seed are broadcast
            over the tp group, one collective each), so the replicated region agrees even if the ranks were
            seeded differently. Set False where the caller guarantees it.
        offset: added to the common seed before the tp rank.
    """

    def __init__(self, tp_mesh: DeviceMesh, sync: bool = True, offset: int = REGION_SEED_OFFSET) -> None:
        self.device_type = tp_mesh.device_type
        self.tp_rank = tp_mesh.get_local_rank()
        base_seed = _device_module(self.device_type).initial_seed()
        if sync and tp_mesh.size() > 1:
            base_seed = self._sync_default_generator(tp_mesh, base_seed)
        self.seed = base_seed + offset + self.tp_rank
        device = torch.device(self.device_type) if self.device_type == "cpu" else _current_device(self.device_type)
        self._state = torch.Generator(device=device).manual_seed(self.seed).get_state()
        self._outer: torch.Tensor | None = None  # the default generator's state, saved while a region is open

    def _sync_default_generator(self, tp_mesh: DeviceMesh, base_seed: int) -> int:
        group = tp_mesh.get_group()
        device = torch.device("cpu") if self.device_type == "cpu" else _current_device(self.device_type)
        state = get_rng_state(self.device_type)
        common = state.to(device, copy=True)  # the broadcast writes into it: keep `state` to compare
        seed = torch.tensor([base_seed % 2**63], dtype=torch.int64, device=device)
        dist.broadcast(common, group=group, group_src=0)
        dist.broadcast(seed, group=group, group_src=0)
        common = common.cpu()
        if not torch.equal(common, state):
            warnings.warn(
                f"tp rank {self.tp_rank}: the default random generator differed from tp rank 0's; it was set to tp "
                "rank 0's state, so that dropout outside the tensor-parallel regions agrees on the tp ranks. Seed "
                "every rank the same (e.g. `seed_everything`) to avoid this.",
                stacklevel=3,
            )
            set_rng_state(self.device_type, common)
        return int(seed.item())

    @property
    def in_region(self) -> bool:
        return self._outer is not None

    def enter(self) -> None:
        """Swap in this rank's region state (nothing if a region is already open)."""
        if self._outer is None:
            self._outer = get_rng_state(self.device_type)
            set_rng_state(self.device_type, self._state)

    def exit(self) -> None:
        """Keep the advanced region state and give the default generator its own state back (nothing if closed)."""
        if self._outer is not None:
            self._state = get_rng_state(self.device_type)
            set_rng_state(self.device_type, self._outer)
            self._outer = None

    @contextmanager
    def region(self) -> Iterator[None]:
        """Run a block of code on this rank's region state, e.g. a hand-written sharded dropout."""
        opened = not self.in_region
        self.enter()
        try:
            yield
        finally:
            if opened:
                self.exit()

    def install(self, model: nn.Module, plan: dict[str, str], sequence_parallel: bool) -> list[Any]:
        """Open and close the regions with forward hooks; returns the hook handles.

        ``plan`` is the resolved plan relative to ``model``. Without sequence parallelism a region opens at each
        ``colwise`` module's output (sharded, local) and closes at each ``rowwise`` module's input; with it, the
        whole forward of ``model`` is one region. ``model``'s own forward always closes a region left open (a
        colwise output that never reaches a rowwise linear, or an exception).
        """
        handles = []

        def enter_hook(*_: Any) -> None:
            self.enter()

        def exit_hook(*_: Any) -> None:
            self.exit()

        if sequence_parallel:
            handles.append(model.register_forward_pre_hook(exit_hook))
            handles.append(model.register_forward_pre_hook(enter_hook))
        else:
            handles.append(model.register_forward_pre_hook(exit_hook))
            for name, style in plan.items():
                if style == "colwise":
                    handles.append(model.get_submodule(name).register_forward_hook(enter_hook))
                elif style == "rowwise":
                    handles.append(model.get_submodule(name).register_forward_pre_hook(exit_hook))
        handles.append(model.register_forward_hook(exit_hook, always_call=True))
        return handles


def _current_device(device_type: str) -> torch.device:
    return torch.device(device_type, _device_module(device_type).current_device())
