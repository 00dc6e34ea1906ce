"""Resume the test job's step-10 checkpoint under another layout, one ``Trainer.fit`` after another in the same ranks.

Run under torchrun (``tests.harness.launch_matrix``) on 1, 2 or 4 ranks. A *source* case trains the job's 20 steps
(AdamW, the LR schedule over 20 steps) keeping its checkpoints; a *resume* case builds a fresh model under its own
layout and continues from a source's step-10 checkpoint -- one of this launch's sources, or one passed with
``--source NAME=PATH`` (the 3D run of ``tests.launch.hybrid3d_matrix``, or a source of an earlier launch). Each case
writes ``ROOT/NAME/tb`` (per-step losses), as a CLI launch does, for ``tests.harness.Run``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_par import Hybrid3DStrategy, MegatronTPStrategy, PipelineStrategy, ZeroStrategy
from lightning_par.data import TextDataModule
from lightning_par.examples import GPTLightningModule
from lightning_par.plugins.precision import LayoutPrecision
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS
from tests.harness import checkpoint_worker_main


@dataclass
class Case:
    """A layout (``strategy()``, ``devices`` ranks, ``dp`` replicas) and where it starts: ``source`` is the case whose
    step-10 checkpoint it resumes, or ``None`` for a source (trained from step 0, checkpoints kept)."""

    strategy: Callable[[], pl.strategies.Strategy]
    devices: int
    dp: int
    source: str | None = None
    precision: str = "32-true"
    link_last: bool = False  # also ModelCheckpoint(save_last="link", save_top_k=1) in NAME/linked
    save_after_fit: bool = False  # a source whose fit stops at step 10 and is then saved by trainer.save_checkpoint


CASES: dict[str, Case] = {
    # sources
    "one_process": Case(lambda: ZeroStrategy(stage=0), 1, 1),  # one file, Lightning's own format
    "zero1_dp2": Case(lambda: ZeroStrategy(stage=1), 2, 2),  # ZeRO-1 bucket shards, saved per parameter
    # tp2 x pp2 (sequence parallel, interleaved, ZeRO-1 over one replica): "3d", passed in from the 3D matrix
    # resumes (source -> target)
    "3d_to_one_process": Case(lambda: ZeroStrategy(stage=0), 1, 1, "3d"),
    "zero1_dp2_to_pp2": Case(lambda: PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=2), 2, 1, "zero1_dp2"),
    "zero1_dp2_to_tp2": Case(lambda: MegatronTPStrategy(tp=2), 2, 1, "zero1_dp2"),
    "3d_to_zero2_dp2": Case(lambda: ZeroStrategy(stage=2), 2, 2, "3d"),
    "3d_to_zero3_dp2": Case(lambda: ZeroStrategy(stage=3), 2, 2, "3d"),
    "one_process_to_zero1_dp2": Case(lambda: ZeroStrategy(stage=1), 2, 2, "one_process"),
    # into 3D (4 ranks): one file (by its parameter names) and ZeRO-1 shards into tp2 x pp2 stages
    "one_process_to_3d": Case(lambda: Hybrid3DStrategy(tp=2, pp=2, schedule="1f1b", n_microbatches=2), 4, 1,
                              "one_process"),
    "zero1_dp2_to_3d": Case(lambda: Hybrid3DStrategy(tp=2, pp=2, schedule="1f1b", n_microbatches=2), 4, 1,
                            "zero1_dp2"),
    # checkpoints written in the background (DCP async_save), resumed synchronously
    "zero2_async_dp2": Case(lambda: ZeroStrategy(stage=2, async_save=True), 2, 2, link_last=True),
    "zero2_async_dp2_resumed": Case(lambda: ZeroStrategy(stage=2), 2, 2, "zero2_async_dp2"),
    # bf16-mixed ZeRO-2: the fp32 master weights (not the bf16 parameters) are saved and restored
    "zero2_bf16_dp2": Case(lambda: ZeroStrategy(stage=2), 2, 2, precision="bf16-mixed"),
    "zero2_bf16_dp2_resumed": Case(lambda: ZeroStrategy(stage=2), 2, 2, "zero2_bf16_dp2", precision="bf16-mixed"),
    # bf16-mixed-master ZeRO-1 (fp32 gradient buckets): the same, with Megatron-style mixed precision
    "zero1_master_dp2": Case(lambda: ZeroStrategy(stage=1), 2, 2, precision="bf16-mixed-master"),
    "zero1_master_dp2_resumed": Case(lambda: ZeroStrategy(stage=1), 2, 2, "zero1_master_dp2",
                                     precision="bf16-mixed-master"),
    # trainer.save_checkpoint(path) once fit has returned (the strategy torn down), under ZeRO-1 and 3D (ZeRO-1 over
    # one replica of a 2-stage pipeline)
    "zero1_dp2_saved_after_fit": Case(lambda: ZeroStrategy(stage=1), 2, 2, save_after_fit=True),
    "zero1_dp2_saved_after_fit_to_tp2": Case(lambda: MegatronTPStrategy(tp=2), 2, 1, "zero1_dp2_saved_after_fit"),
    "3d_pp2_saved_after_fit": Case(lambda: Hybrid3DStrategy(tp=1, pp=2, schedule="1f1b", n_microbatches=2), 2, 1,
                                   save_after_fit=True),
    "3d_pp2_saved_after_fit_to_zero2_dp2": Case(lambda: ZeroStrategy(stage=2), 2, 2, "3d_pp2_saved_after_fit"),
}


def step10(root: Path) -> Path:
    (path,) = sorted(root.glob(f"ckpt/*step={EPOCH_STEPS}.ckpt"))
    return path


def fit(root: Path, cache: str, name: str, sources: dict[str, Path]) -> None:
    case = CASES[name]
    pl.seed_everything(1234)
    model = GPTLightningModule(preset="tiny", n_layers=8)
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=False, batch_size=GLOBAL_BATCH // case.dp,
                          cache_dir=cache)
    keep = [ModelCheckpoint(dirpath=root / name / "ckpt", save_top_k=-1)] if case.source is None else []
    stop = []
    if case.save_after_fit:  # the step-10 checkpoint is the one saved after fit, with the 20-step LR schedule
        keep, stop = [], [_StopAt(EPOCH_STEPS)]
    if case.link_last:
        keep.append(ModelCheckpoint(dirpath=root / name / "linked", save_top_k=1, save_last="link",
                                    every_n_train_steps=EPOCH_STEPS))  # (a state key of its own)
    trainer = pl.Trainer(
        accelerator="cpu", devices=case.devices, strategy=case.strategy(),
        # Lightning's Trainer takes only its own precision flags: bf16-mixed-master goes in as the plugin
        **(dict(plugins=[LayoutPrecision(case.precision)]) if case.precision == "bf16-mixed-master" else
           dict(precision=case.precision)),
        max_steps=PARITY_STEPS,
        limit_train_batches=EPOCH_STEPS, limit_val_batches=2, log_every_n_steps=1,
        logger=TensorBoardLogger(save_dir=root / name / "tb"), enable_checkpointing=bool(keep),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root / name, callbacks=[*keep, *stop],
    )
    ckpt = None if case.source is None else sources.get(case.source) or step10(root / case.source)
    trainer.fit(model, data, ckpt_path=ckpt)
    if case.save_after_fit:
        trainer.save_checkpoint(root / name / "ckpt" / f"after-fit-step={EPOCH_STEPS}.ckpt")


class _StopAt(pl.Callback):
    """End fit after optimizer step ``step`` (keeping ``max_steps``, which the LR schedule spans)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


if __name__ == "__main__":
    checkpoint_worker_main(fit)
