"""One-file checkpoints (one process, ZeRO stage 0) with the guarantees of the sharded ones.

:class:`AtomicCheckpointIO` is the default CheckpointIO of every lightning-par strategy, and works under any
Lightning strategy too (``Trainer(plugins=[AtomicCheckpointIO()])``). Lightning's own ``TorchCheckpointIO`` writes a
temporary file and moves it into place, but never syncs it: after a power loss the new name can point at an empty
file, and the previous checkpoint is already gone. Here the file is written as ``NAME.partial``, synced, and takes
its name through :func:`~lightning_par.plugins.checkpoint_files.commit` (the old one moved aside, both renames made
durable, then the old one deleted) -- the same path a sharded directory takes -- with its size and CRC-32 beside it
(``NAME.crc32.json``), checked before it loads.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.rank_zero import rank_zero_warn

from lightning_par.plugins import checkpoint_files
from lightning_par.plugins.checkpoint_files import CheckpointError


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's one-file checkpoint, visible only when complete and synced; a damaged file is refused by name."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options (got {storage_options!r}).")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        checkpoint_files.prepare(path)
        partial = checkpoint_files.partial_path(path)
        try:
            with open(partial, "wb") as out:
                torch.save(checkpoint, out)
                out.flush()
                os.fsync(out.fileno())
            checkpoint_files.commit_file(partial, path)
        except (OSError, RuntimeError) as err:  # a full disk: torch.save's zip writer raises RuntimeError
            raise checkpoint_files.save_failed(path, err) from None

    def load_checkpoint(self, path: Any, map_location: Callable | None = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(path)
        resolved = checkpoint_files.resolve(path)
        if resolved != path:
            rank_zero_warn(f"{path} is missing, but {resolved.name}, the checkpoint it replaced, was left by a crash "
                           f"during the save: loading {resolved}.")
        if resolved.is_dir():
            raise CheckpointError(f"{resolved} is a sharded checkpoint (a directory): resume it under a lightning-par "
                                  "strategy -- ZeroStrategy(stage=0) for one process -- or make one file of its "
                                  "weights with `lightning-par export`.")
        checkpoint_files.verify_file(path, resolved)
        try:
            return super().load_checkpoint(resolved, map_location=map_location, weights_only=weights_only)
        except pickle.UnpicklingError:
            raise  # torch's own message says what was refused and how to allow it
        except (RuntimeError, EOFError) as err:
            raise CheckpointError(f"{resolved} is not a readable checkpoint file (truncated or corrupted?): "
                                  f"{err}") from err

    def remove_checkpoint(self, path: Any) -> None:
        checkpoint_files.remove(Path(path))
