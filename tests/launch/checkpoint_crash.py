"""A callback the crash test adds to a launched run: stop every rank in the middle of a checkpoint save."""

from __future__ import annotations

import os
import time
from pathlib import Path

import lightning.pytorch as pl

from lightning_par.plugins import checkpoint_files


class PauseMidSave(pl.Callback):
    """In the ``save``-th sharded save, once every rank's DCP files are written but before the manifest (the last
    file), rank 0 writes ``paused`` into ``path`` and sleeps until it is killed; the other ranks wait for it in the
    save's last barrier. Each rank writes its pid to ``path/pid{rank}``."""

    def __init__(self, path: str, save: int = 2) -> None:
        self.path = Path(path)
        self.save = save

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"pid{trainer.global_rank}").write_text(str(os.getpid()))
        if trainer.global_rank != 0:
            return
        write_manifest, calls = checkpoint_files.write_manifest, []

        def pause_then_write(root: Path, files: dict) -> None:
            calls.append(root)
            if len(calls) == self.save:
                (self.path / "paused").write_text(str(root))
                time.sleep(3600)
            write_manifest(root, files)

        checkpoint_files.write_manifest = pause_then_write
