"""Checkpoints of expert-parallel layouts: the example MoE GPT's step-10 checkpoint resumed under another ep size.

Run under torchrun (``tests.harness.launch_matrix``) on 1, 2 or 4 ranks, as ``tests.launch.reshard_matrix``: a
*source* case trains 20 steps (AdamW, the LR schedule over 20 steps) keeping its checkpoints; a *resume* case builds
a fresh model under its own layout and continues from a source's step-10 checkpoint (the epoch's end) or step-5 one
(mid-epoch) (``--source NAME=DIR``: the directory of a source run by another launch). Each case writes
``ROOT/NAME/tb`` (per-step losses) for ``tests.harness.Run``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_par import LayoutStrategy, PipelineStrategy, ZeroStrategy
from lightning_par.data import TextDataModule
from lightning_par.examples import MoEGPTLightningModule
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS
from tests.harness import checkpoint_worker_main


@dataclass
class Case:
    """A layout (``strategy()``, ``devices`` ranks, ``dp`` data-parallel ranks) and ``source``: the case whose step-10
    checkpoint it resumes, or ``None`` for a source (trained from step 0, checkpoints kept)."""

    strategy: Callable[[], pl.strategies.Strategy]
    devices: int
    dp: int
    source: str | None = None
    at: int = EPOCH_STEPS  # the source's step to resume from (5: mid-epoch, from the source's "mid" checkpoints)
    mid: bool = False  # a source that also keeps a checkpoint every 5 steps (mid-epoch), in NAME/mid
    precision: str = "32-true"


CASES: dict[str, Case] = {
    # sources: one process (Lightning's one file), ep2 under ZeRO-1 (expert_dp 1: the experts' partitioner holds a
    # rank's experts whole), ep2 x expert_dp2 under ZeRO-3 (each expert module an FSDP2 group on expert_dp), dp2 x
    # tp2 x ep2 under ZeRO-1 (experts on (ep, tp))
    "one_process": Case(lambda: ZeroStrategy(stage=0), 1, 1),
    "ep2_zero1": Case(lambda: ZeroStrategy(stage=1, ep=2), 2, 2, mid=True),
    "ep2_zero3_dp4": Case(lambda: ZeroStrategy(stage=3, ep=2), 4, 4),
    "ep2_tp2_zero1": Case(lambda: LayoutStrategy(tp=2, ep=2, zero_stage=1), 4, 2),
    # ep2 x expert_dp2 under ZeRO-1/2: the experts' buckets, optimizer state and chunks partitioned over their 2
    # replicas by their own partitioner, beside the dense weights' over dp4
    "ep2_zero1_dp4": Case(lambda: ZeroStrategy(stage=1, ep=2), 4, 4),
    "ep2_zero2_dp4": Case(lambda: ZeroStrategy(stage=2, ep=2), 4, 4),
    # ... under bf16-mixed: both partitioners keep fp32 masters apart from the bf16 buckets (the masters are saved)
    "ep2_zero2_dp4_bf16": Case(lambda: ZeroStrategy(stage=2, ep=2), 4, 4, precision="bf16-mixed"),
    # pp2 x dp2, 1F1B, the experts of each stage over ep2 (ZeRO-1: both partitioners per stage)
    "ep2_pp2": Case(lambda: PipelineStrategy(pp=2, ep=2, zero_stage=1, schedule="1f1b", n_microbatches=2), 4, 2),
    # resumes (source -> target)
    "ep2_zero1_mid_to_one_process": Case(lambda: ZeroStrategy(stage=0), 1, 1, "ep2_zero1", at=5),
    "ep2_tp2_zero1_to_one_process": Case(lambda: ZeroStrategy(stage=0), 1, 1, "ep2_tp2_zero1"),
    "ep2_zero1_to_zero2_dp2": Case(lambda: ZeroStrategy(stage=2), 2, 2, "ep2_zero1"),  # a layout without ep
    "one_process_to_ep2_zero0": Case(lambda: ZeroStrategy(stage=0, ep=2), 2, 2, "one_process"),  # one file into ep
    "one_process_to_ep2_zero1": Case(lambda: ZeroStrategy(stage=1, ep=2), 2, 2, "one_process"),  # ... beside shards
    "ep2_zero1_mid_to_ep4_zero3": Case(lambda: ZeroStrategy(stage=3, ep=4), 4, 4, "ep2_zero1", at=5),
    "ep2_zero3_dp4_to_ep4_zero0": Case(lambda: ZeroStrategy(stage=0, ep=4), 4, 4, "ep2_zero3_dp4"),
    "ep2_zero1_dp4_to_ep4_zero1": Case(lambda: ZeroStrategy(stage=1, ep=4), 4, 4, "ep2_zero1_dp4"),
    "ep2_zero2_dp4_to_ep4_zero2": Case(lambda: ZeroStrategy(stage=2, ep=4), 4, 4, "ep2_zero2_dp4"),
    "ep2_zero1_dp4_to_one_process": Case(lambda: ZeroStrategy(stage=0), 1, 1, "ep2_zero1_dp4"),
    "ep2_zero2_dp4_to_one_process": Case(lambda: ZeroStrategy(stage=0), 1, 1, "ep2_zero2_dp4"),
    "ep2_pp2_to_one_process": Case(lambda: ZeroStrategy(stage=0), 1, 1, "ep2_pp2"),
    "ep2_pp2_to_ep2": Case(lambda: ZeroStrategy(stage=2, ep=2), 2, 2, "ep2_pp2"),  # without pp
}


def fit(root, cache: str, name: str, sources: dict) -> None:
    case = CASES[name]
    pl.seed_everything(1234)
    model = MoEGPTLightningModule(preset="tiny", n_layers=4)
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=False, batch_size=GLOBAL_BATCH // case.dp,
                          cache_dir=cache)
    keep = [ModelCheckpoint(dirpath=root / name / "ckpt", save_top_k=-1)] if case.source is None else []
    if case.mid:
        keep.append(ModelCheckpoint(dirpath=root / name / "mid", every_n_train_steps=5, save_top_k=-1))
    trainer = pl.Trainer(
        accelerator="cpu", devices=case.devices, strategy=case.strategy(), precision=case.precision,
        max_steps=PARITY_STEPS,
        limit_train_batches=EPOCH_STEPS, limit_val_batches=2, log_every_n_steps=1,
        logger=TensorBoardLogger(save_dir=root / name / "tb"), enable_checkpointing=bool(keep),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root / name, callbacks=keep,
    )
    ckpt = None if case.source is None else checkpoint(sources.get(case.source) or root / case.source, case.at)
    trainer.fit(model, data, ckpt_path=ckpt)


def checkpoint(run: Path, step: int) -> Path:
    """The checkpoint a source run (its directory) saved at ``step``: at the epoch's end, or mid-epoch."""
    (path,) = sorted(run.glob(f"{'ckpt' if step == EPOCH_STEPS else 'mid'}/*step={step}.ckpt"))
    return path


if __name__ == "__main__":
    checkpoint_worker_main(fit)
