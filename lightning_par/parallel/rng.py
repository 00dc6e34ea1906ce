"""Random numbers under tensor parallelism: dropout that differs where ranks hold different data, agrees elsewhere.

Inside a tensor-parallel region -- from a column-parallel linear's output to the row-parallel linear's input --
each tp rank holds different heads or FFN features, so their dropout masks must be independent draws; with the
default generator in the same state on every rank (the same seed, consumed alike) every rank would draw the
*same* mask for its different slice. Outside the regions the activations are replicated (the residual stream after
the row-parallel reduction), and there the masks must be *equal* on every tp rank, or the replicas silently drift
apart. Megatron-LM forks a "model-parallel" RNG state inside the regions; :class:`TensorParallelRNG` does the same
with forward hooks from the plan: entering a region (a column-parallel module's output) swaps a per-tp-rank state
into the default generator, leaving it (the row-parallel module's input) swaps the default state back. The default
generator is not advanced inside a region, so it stays identical on the tp ranks.

The region's state is made afresh at each entry from a seed that mixes the tp group's common seed, the tp rank, the
region (which module opened it), a count of the model's forwards and the default generator's state at that moment.
So it is different per rank, per block and per step, and it is a function of the default generator's state:
activation recomputation (``torch.utils.checkpoint``, which restores the default generator before it runs a block
again) replays the very same masks, and nothing about the default generator's own stream changes -- a tensor-parallel
run draws exactly what one process would outside the regions.

With sequence parallelism the residual stream is split over the sequence too, so every activation a dropout sees is
this rank's own; the whole forward of the model is then one region. (The forward count starts at 0 in each process:
a resumed run draws other masks than the uninterrupted one would have, as it does for the default generator.)

Why hand-written rather than DTensor's tracker (``torch.distributed.tensor._random.OffsetBasedRNGTracker``): that
tracker acts only on random ops applied to a *DTensor*, and inside our regions the activations are plain local
tensors (the styles return local outputs, so model code such as ``view(B, T, -1, head_dim)`` runs unchanged); it
refuses CPU meshes (``is_rng_supported_mesh`` is False there and the tracker raises); and it works by Philox
offsets into one global stream, which needs each shard's global position, which a region's local tensor does not
carry. Swapping the default generator's state works for any device whose state can be read and written, and for
``F.dropout``, ``nn.Dropout`` and ``scaled_dot_product_attention(dropout_p=...)`` alike.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par._compat import DropoutNd

#: Mixed into the region seeds (Megatron-LM offsets its model-parallel seed by the same number).
REGION_SEED_OFFSET = 2718


def _device_module(device_type: str) -> Any:
    return torch if device_type == "cpu" else torch.get_device_module(device_type)


def _device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, _device_module(device_type).current_device())


def get_rng_state(device_type: str) -> torch.Tensor:
    """The default generator's state for ``device_type`` (the current device's, for an accelerator)."""
    return _device_module(device_type).get_rng_state()


def set_rng_state(device_type: str, state: torch.Tensor) -> None:
    _device_module(device_type).set_rng_state(state)


class TensorParallelRNG:
    """Per-tp-rank generator states for the tensor-parallel regions; see the module docstring.

    Args:
        tp_mesh: the 1-D tensor-parallel mesh.
        sync: make the default generator equal on the tp ranks first (tp rank 0's state and seed are broadcast
            over the tp group, one collective each), so the replicated activations get equal masks even if the
            ranks were seeded differently (with a warning on the ranks that differed).
        offset: mixed into the region seeds.
    """

    def __init__(self, tp_mesh: DeviceMesh, sync: bool = True, offset: int = REGION_SEED_OFFSET) -> None:
        self.device_type = tp_mesh.device_type
        self.tp_rank = tp_mesh.get_local_rank()
        base_seed = _device_module(self.device_type).initial_seed()
        if sync and tp_mesh.size() > 1:
            base_seed = self._sync_default_generator(tp_mesh, base_seed)
        #: the tp group's common seed: the region seeds differ by the tp rank (and region, step, state)
        self.seed = base_seed + offset
        self.forwards = 0  # forwards of the model so far: regions differ from step to step
        self._outer: torch.Tensor | None = None  # the default generator's state, saved while a region is open

    def _sync_default_generator(self, tp_mesh: DeviceMesh, base_seed: int) -> int:
        group, device = tp_mesh.get_group(), _device(self.device_type)
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

    def region_seed(self, region: str, state: torch.Tensor) -> int:
        """The seed of ``region``'s generator on this rank, given the default generator's ``state`` at entry."""
        key = f"{self.seed}/{self.tp_rank}/{region}/{self.forwards}/".encode()
        digest = hashlib.blake2b(key + state.numpy().tobytes(), digest_size=8).digest()
        return int.from_bytes(digest, "little") & (2**63 - 1)

    # enter and exit run eagerly under torch.compile (a graph break at each region boundary of a compiled block):
    # dynamo cannot trace the generator swap, and traced, it would guard on `forwards` and recompile every step.
    # Each graph then runs wholly inside or wholly outside a region, so its random draws (inductor seeds them from
    # the default generator at the graph's start) are per rank or common as in eager mode.
    @torch.compiler.disable
    def enter(self, region: str = "") -> None:
        """Swap in a state for ``region`` on this rank (nothing if a region is already open)."""
        if self._outer is None:
            outer = get_rng_state(self.device_type)
            generator = torch.Generator(device=_device(self.device_type))
            generator.manual_seed(self.region_seed(region, outer))
            set_rng_state(self.device_type, generator.get_state())
            self._outer = outer

    @torch.compiler.disable
    def exit(self) -> None:
        """Give the default generator its own state back, unadvanced (nothing if no region is open)."""
        if self._outer is not None:
            set_rng_state(self.device_type, self._outer)
            self._outer = None

    @contextmanager
    def region(self, name: str = "user") -> Iterator[None]:
        """Run a block of code on a per-rank state, e.g. a hand-written dropout on sharded activations."""
        opened = not self.in_region
        self.enter(name)
        try:
            yield
        finally:
            if opened:
                self.exit()

    def install(self, model: nn.Module, plan: dict[str, str], sequence_parallel: bool,
                where: Callable[[nn.Module], bool] | None = None) -> list[Any]:
        """Open and close the regions with forward hooks on ``model``'s modules; returns the hook handles.

        ``plan`` is the resolved plan relative to ``model``. Without sequence parallelism a region opens at each
        ``colwise`` module's output (sharded, local) and closes at each ``rowwise`` module's input; with it, the
        whole forward of ``model`` is one region. ``model``'s own forward closes a region left open (a colwise
        output that never reaches a row-parallel linear, or an exception) and counts the forwards.
        ``where``: opens a region only at the colwise modules it accepts (default: all), e.g. those of blocks with
        dropout (:func:`dropout_at`): a region costs a generator swap and a hash at every forward of the module.
        """

        def start(*_: Any) -> None:
            self.exit()
            self.forwards += 1
            if sequence_parallel:
                self.enter("model")

        def close(*_: Any) -> None:
            self.exit()

        handles = [model.register_forward_pre_hook(start)]
        if not sequence_parallel:
            for name, style in plan.items():
                column = style.partition(":")[0] in ("colwise", "packed_colwise")
                if column and (where is None or where(model.get_submodule(name))):
                    handles.append(model.get_submodule(name).register_forward_hook(
                        lambda *_, name=name: self.enter(name)))
                elif style == "rowwise":
                    handles.append(model.get_submodule(name).register_forward_pre_hook(close))
        handles.append(model.register_forward_hook(close, always_call=True))
        return handles


def has_dropout(module: nn.Module) -> bool:
    """Whether ``module`` declares dropout: a dropout module with ``p > 0``, a float attribute named ``*dropout*`` /
    ``*pdrop*`` above 0 (a rate handed to ``scaled_dot_product_attention``), or a ``config`` (Hugging Face style)
    with such a rate above 0. A hard-coded ``F.dropout(x, 0.1)`` in model code is not seen.

    Used with compiled blocks: without dropout the tensor-parallel regions' generator swaps change nothing, and
    their hooks (graph breaks, see :meth:`TensorParallelRNG.enter`) are left out."""
    for sub in module.modules():
        if isinstance(sub, DropoutNd) and sub.p > 0:
            return True
        if any(_is_rate(name, value) for name, value in vars(sub).items()):
            return True
        config = getattr(sub, "config", None)
        if config is not None and not isinstance(config, dict | str):
            for name in dir(config):
                if ("dropout" in name or "pdrop" in name) and not name.startswith("_"):
                    if _is_rate(name, getattr(config, name, None)):
                        return True
    return False


def _is_rate(name: str, value: Any) -> bool:
    return (("dropout" in name or "pdrop" in name) and not name.startswith("_") and isinstance(value, int | float)
            and not isinstance(value, bool) and value > 0)


def dropout_at(blocks: Sequence[nn.Module], root: nn.Module) -> Callable[[nn.Module], bool]:
    """Whether a module may feed dropout: the :func:`has_dropout` of the block holding it, or of ``root`` for a
    module outside every block (for :meth:`TensorParallelRNG.install`'s ``where``)."""
    inside: dict[int, bool] = {}
    for block in blocks:
        drops = has_dropout(block)
        for sub in block.modules():
            inside[id(sub)] = drops
    whole = has_dropout(root)
    return lambda module: inside.get(id(module), whole)
