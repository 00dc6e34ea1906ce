"""Mid-epoch resume: fits that keep a checkpoint every 5 steps of a 12-step epoch, and fits resumed from step 5.

Run under torchrun (``tests.harness.launch_matrix``); the cases of one rank count run one after another in the same
ranks. A *source* case trains 18 steps (plain SGD, so a replayed or skipped batch shows in the loss) with
``ModelCheckpoint(every_n_train_steps=5)``; a *resumed* case builds a fresh model under its own layout and continues
from a source's step-5 checkpoint (of this launch, or passed with ``--source NAME=PATH``). Each case writes
``ROOT/NAME/tb`` (per-step losses) for ``tests.harness.Run``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from lightning_par import Hybrid3DStrategy, MegatronTPStrategy, PipelineStrategy, PlannedStrategy, ZeroStrategy
from lightning_par.callbacks import defaults
from lightning_par.data import TextDataModule
from lightning_par.examples import GPTLightningModule
from tests.harness import checkpoint_worker_main
from tests.probes import StepLosses

EPOCH_STEPS = 12
MAX_STEPS = 18  # into the second epoch: its order must follow too
SAVE_EVERY = 5
GLOBAL_BATCH = 8
UNEVEN = 100  # samples of the elastic cases' data: not a whole number of global batches
SEQ = 32


@dataclass
class Case:
    """A layout (``strategy()`` on ``devices`` ranks, ``dp`` replicas), its data (``"user"``: a plain shuffled
    DataLoader of random tokens; ``"text"``: the shuffled TextDataModule) and the source it resumes (or None)."""

    strategy: Callable[[], pl.strategies.Strategy]
    devices: int
    dp: int
    data: str
    source: str | None = None
    script_logs: bool = False  # lightning_par.callbacks.defaults(): what a script adds for tokens/s, MFU, memory
    batch: int | None = None  # elastic: the per-rank batch, kept when dp changes (default GLOBAL_BATCH // dp)
    source_step: int = SAVE_EVERY  # the source's checkpoint it resumes from
    samples: int | None = None  # "user" data: that many samples in a drop_last loader (default EPOCH_STEPS x 8)


def _elastic(strategy: Callable[[], pl.strategies.Strategy], devices: int, source: str | None = None,
             source_step: int = SAVE_EVERY, batch: int = 2, data: str = "user", samples: int | None = None) -> Case:
    """An elastic case: whole epochs (the resumed world draws another number of loader batches), a per-rank batch
    kept, every step's loss recorded (:class:`StepLosses`), the final weights saved and checkpoints kept."""
    return Case(strategy, devices, 0, data, source=source, batch=batch, source_step=source_step, samples=samples)


CASES: dict[str, Case] = {
    "zero1_user": Case(lambda: ZeroStrategy(stage=1), 2, 2, "user", script_logs=True),
    "zero1_user_resumed": Case(lambda: ZeroStrategy(stage=1), 2, 2, "user", source="zero1_user"),
    # dp=1 (a 2-stage pipeline, batch 8) resumed at dp=2 (ZeRO-2, batch 4 per rank): the same global batches
    "pp2_text": Case(lambda: PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=2), 2, 1, "text"),
    "pp2_text_to_zero2": Case(lambda: ZeroStrategy(stage=2), 2, 2, "text", source="pp2_text"),
    "3d_text": Case(lambda: Hybrid3DStrategy(tp=2, pp=2, schedule="1f1b", n_microbatches=2), 4, 1, "text"),
    "3d_text_resumed": Case(lambda: Hybrid3DStrategy(tp=2, pp=2, schedule="1f1b", n_microbatches=2), 4, 1, "text",
                            source="3d_text"),
    # saved at dp=1 (tp2 x pp2, batch 8), resumed at dp=2 (batch 4 per rank): the same global batches
    "3d_text_to_zero2": Case(lambda: ZeroStrategy(stage=2), 2, 2, "text", source="3d_text"),
    # elastic (docs/elastic.md): ZeRO-3 on 4 ranks (per-rank batch 2, no accumulation) resumed on 2 (accumulation
    # doubled to keep 8 samples per step), then back on 4 from the 2-rank run's step-10 checkpoint; dp2 x tp2 (batch 4
    # per replica) resumed on tp2 alone (one replica, accumulation 2)
    # (100 samples, drop_last: at dp2 the loader alone would make an epoch of 12.5 steps; the checkpoint's 12 are kept)
    "zero3_dp4": _elastic(lambda: ZeroStrategy(stage=3), 4, samples=UNEVEN),
    "zero3_dp4_to_dp2": _elastic(lambda: ZeroStrategy(stage=3), 2, source="zero3_dp4", samples=UNEVEN),
    "zero3_dp2_back_to_dp4": _elastic(lambda: ZeroStrategy(stage=3), 4, source="zero3_dp4_to_dp2", source_step=10,
                                      samples=UNEVEN),
    # ZeRO-1 on 2 ranks (per-rank batch 4) resumed on 1 (accumulation 2; the test runs it in its own process)
    "zero1_dp2": _elastic(lambda: ZeroStrategy(stage=1), 2, batch=4, samples=UNEVEN),
    "zero1_dp2_to_1": _elastic(lambda: ZeroStrategy(stage=1), 1, source="zero1_dp2", batch=4, samples=UNEVEN),
    # ... and ZeRO-3 2 -> 1, ZeRO-1 4 -> 2 -> 4, as above (the full set)
    "zero3_dp2": _elastic(lambda: ZeroStrategy(stage=3), 2, batch=4, samples=UNEVEN),
    "zero3_dp2_to_1": _elastic(lambda: ZeroStrategy(stage=3), 1, source="zero3_dp2", batch=4, samples=UNEVEN),
    "zero1_dp4": _elastic(lambda: ZeroStrategy(stage=1), 4, samples=UNEVEN),
    "zero1_dp4_to_dp2": _elastic(lambda: ZeroStrategy(stage=1), 2, source="zero1_dp4", samples=UNEVEN),
    "zero1_dp2_back_to_dp4": _elastic(lambda: ZeroStrategy(stage=1), 4, source="zero1_dp4_to_dp2", source_step=10,
                                      samples=UNEVEN),
    "dp2_tp2": _elastic(lambda: MegatronTPStrategy(tp=2), 4, batch=4),
    "dp2_tp2_to_tp2": _elastic(lambda: MegatronTPStrategy(tp=2), 2, source="dp2_tp2", batch=4),
    # strategy="planned" (it plans for the datamodule's batch per replica): re-planned for 2 ranks
    "planned4_text": _elastic(lambda: PlannedStrategy(optimizer="sgd"), 4, data="text"),
    "planned4_to_2": _elastic(lambda: PlannedStrategy(optimizer="sgd"), 2, source="planned4_text", data="text"),
}


def user_loader(batch: int, samples: int | None = None) -> DataLoader:
    """What a user writes: a map-style dataset and ``DataLoader(ds, batch_size, shuffle=True)``; 12 global batches
    (``samples``: that many samples, ``drop_last=True``)."""
    count = samples or EPOCH_STEPS * GLOBAL_BATCH
    tokens = torch.randint(0, 256, (count, SEQ + 1), generator=torch.Generator().manual_seed(0))
    rows = [(row[:-1], row[1:]) for row in tokens]
    return DataLoader(rows, batch_size=batch, shuffle=True, drop_last=samples is not None)


class FinalWeights(pl.Callback):
    """At the end of fit, the whole model's weights (DTensor shards gathered on every rank), saved by rank 0."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor

        weights = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                   for k, v in pl_module.state_dict().items()}
        if trainer.is_global_zero:
            torch.save(weights, self.path)


def step_checkpoint(root: Path, step: int) -> Path:
    (path,) = sorted(root.glob(f"ckpt/*step={step}.ckpt"))
    return path


def fit(root: Path, cache: str, name: str, sources: dict[str, Path]) -> None:
    case = CASES[name]
    pl.seed_everything(1234)
    model = GPTLightningModule(preset="tiny", n_layers=4, optimizer="sgd", lr=0.2)
    elastic = case.batch is not None
    batch = case.batch if elastic else GLOBAL_BATCH // case.dp
    keep = [] if case.source and not elastic else [
        ModelCheckpoint(dirpath=root / name / "ckpt", every_n_train_steps=SAVE_EVERY, save_top_k=-1)]
    trainer = pl.Trainer(
        accelerator="cpu", devices=case.devices, strategy=case.strategy(), max_steps=MAX_STEPS,
        limit_train_batches=None if elastic else EPOCH_STEPS, limit_val_batches=0, log_every_n_steps=1,
        logger=TensorBoardLogger(save_dir=root / name / "tb"), enable_checkpointing=bool(keep),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root / name,
        callbacks=[*keep, *(defaults() if case.script_logs else []),
                   *([StepLosses(str(root / name / "steps.json")), FinalWeights(root / name / "weights.pt")]
                     if elastic else [])],
    )
    ckpt = None
    if case.source is not None:
        ckpt = sources.get(case.source) or step_checkpoint(root / case.source, case.source_step)
    if case.data == "user":
        trainer.fit(model, train_dataloaders=user_loader(batch, case.samples), ckpt_path=ckpt)
    else:
        data = TextDataModule(seq_len=SEQ, max_corpus_bytes=300_000, shuffle=True, batch_size=batch, cache_dir=cache)
        trainer.fit(model, datamodule=data, ckpt_path=ckpt)


if __name__ == "__main__":
    checkpoint_worker_main(fit)
