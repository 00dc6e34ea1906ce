"""Train the test job once per pipeline schedule, one ``Trainer.fit`` after another in the same ranks.

Run under torchrun (``tests.harness.launch_matrix``): the ranks start and join the process group once, and each
schedule gets a fresh model, data module and Trainer on the same seed -- what ``tests.harness.TINY_JOB`` +
``conftest.job`` give one CLI launch, minus the repeated start-up (most of a launch's time on 2 cores). Each
schedule writes ``ROOT/NAME/tb`` (TensorBoard events) like a CLI launch, so :class:`tests.harness.Run` reads it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_par import PipelineStrategy
from lightning_par.callbacks import PipelineTimeline
from lightning_par.data import TextDataModule
from lightning_par.examples import GPTLightningModule
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS


def fit(root: Path, cache: str, pp: int, schedule: str, checkpoint: bool, tied: bool = False) -> None:
    pl.seed_everything(1234)
    model = GPTLightningModule(preset="tiny", n_layers=8, tie_embeddings=tied)
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=False, batch_size=GLOBAL_BATCH,
                          cache_dir=cache)
    callbacks: list = [PipelineTimeline(step=3)]
    if checkpoint:
        callbacks.append(ModelCheckpoint(dirpath=root / "ckpt", save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu", devices=pp, strategy=PipelineStrategy(pp=pp, schedule=schedule),
        max_steps=PARITY_STEPS, limit_train_batches=EPOCH_STEPS, limit_val_batches=2, log_every_n_steps=1,
        logger=TensorBoardLogger(save_dir=root / "tb"), enable_checkpointing=checkpoint, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks, default_root_dir=root,
    )
    trainer.fit(model, data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--pp", type=int, required=True)
    parser.add_argument("--schedules", nargs="+", required=True)
    parser.add_argument("--checkpoint", nargs="*", default=[], help="schedules that keep every checkpoint")
    parser.add_argument("--tied", nargs="*", default=[], help="schedules to run again with tied embeddings")
    args = parser.parse_args()
    root = Path(args.root)
    for schedule in args.schedules:
        fit(root / f"pp{args.pp}_{schedule}", args.cache, args.pp, schedule, schedule in args.checkpoint)
    for schedule in args.tied:
        fit(root / f"pp{args.pp}_tied_{schedule}", args.cache, args.pp, schedule, False, tied=True)


if __name__ == "__main__":
    main()
