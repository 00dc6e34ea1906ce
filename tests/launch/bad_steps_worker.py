"""Bad steps (issue 30): fits on 2 ranks where one step goes non-finite, under one layout per launch.

Run under torchrun (``tests.harness.launch_matrix``, ``--layout zero2|pp2|zero2_ep2``; the last: the example
mixture-of-experts GPT with its experts split over the 2 ranks, a NaN routed and exchanged like any token); the
cases run one after another in the same ranks, each writing ``ROOT/NAME/tb`` (per-step losses) and
``ROOT/NAME/result.json`` (how the fit ended):

- ``clean``: 12 steps of plain SGD, the default checkpointing (keep the newest, every 3 steps); the pipeline's with
  ``detect_anomaly=True``, the uninitialised tensors of its first step's metadata inference filled with NaN;
- ``nan_stop``: a NaN written into a weight at step 8 (the update of step 9 is non-finite): the run must stop there,
  the step-9 save be refused and the step-6 checkpoint survive;
- ``resume``: from that surviving checkpoint, clean, to step 12;
- ``skip``: ``nonfinite="skip"``, gradient accumulation over 2 micro-batches, the activations of step 4's first
  micro-batch made NaN: that step's gradients are discarded;
- ``lr0``: the reference for ``skip``: the same accumulation, the learning rate 0 at step 4 (no update that step);
- ``between``: a NaN written into a weight after the update of step 5, before the step-6 save: no step was
  non-finite, yet the save must be refused and the run stop there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader

from lightning_par import PipelineStrategy, ZeroStrategy
from lightning_par.examples import GPTLightningModule, MoEGPTLightningModule
from lightning_par.run.bad_steps import NonFiniteStop

STEPS, SAVE_EVERY, GLOBAL_BATCH, SEQ = 12, 3, 8, 32
POISON_STEP, SKIP_STEP, BETWEEN_STEP = 8, 4, 6
CASES = ("clean", "nan_stop", "resume", "skip", "lr0", "between")


def loader(batch: int) -> DataLoader:
    tokens = torch.randint(0, 256, (STEPS * GLOBAL_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return DataLoader([(row[:-1], row[1:]) for row in tokens], batch_size=batch, shuffle=False)


def fit(root: Path, layout: str, name: str) -> None:
    from tests.probes import PoisonAt, UninitialisedIsNaN

    pl.seed_everything(1234)
    module = MoEGPTLightningModule if layout == "zero2_ep2" else GPTLightningModule
    model = module(preset="tiny", n_layers=4, optimizer="sgd", lr=0.2)
    policy = "skip" if name == "skip" else "stop"
    if layout in ("zero2", "zero2_ep2"):
        strategy = ZeroStrategy(stage=2, ep=2 if layout == "zero2_ep2" else 1, nonfinite=policy, heartbeat_timeout=30)
        batch = GLOBAL_BATCH // 2
    else:
        strategy = PipelineStrategy(pp=2, schedule="1f1b", n_microbatches=2, nonfinite=policy, heartbeat_timeout=30)
        batch = GLOBAL_BATCH
    accumulate = 2 if name in ("skip", "lr0") else 1  # the same global batch in two micro-batches
    batch //= accumulate
    probe = {"nan_stop": [PoisonAt(POISON_STEP, "weight")], "skip": [PoisonAt(SKIP_STEP, "activation")],
             "lr0": [PoisonAt(SKIP_STEP, "lr0")], "between": [PoisonAt(BETWEEN_STEP, "weight_between")]}.get(name, [])
    anomaly = layout == "pp2" and name == "clean"
    if anomaly:  # the stages' first-step metadata inference computes on NaN: anomaly mode must not see it
        probe.append(UninitialisedIsNaN())
    keep = ModelCheckpoint(dirpath=root / name / "ckpt", every_n_train_steps=SAVE_EVERY)  # keep the newest
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, limit_val_batches=0, log_every_n_steps=1,
        accumulate_grad_batches=accumulate,
        logger=TensorBoardLogger(save_dir=root / name / "tb"), enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root / name, callbacks=[keep, *probe],
        detect_anomaly=anomaly,
    )
    ckpt = None
    if name == "resume":
        (ckpt,) = sorted((root / "nan_stop" / "ckpt").glob("*.ckpt"))
    result: dict = {"stopped": None, "resumed_from": str(ckpt) if ckpt else None}
    try:
        trainer.fit(model, train_dataloaders=loader(batch), ckpt_path=ckpt)
    except NonFiniteStop as stop:
        result.update(stopped=stop.message, code=stop.code, step=trainer.global_step)
    result["finite_weights"] = all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
                                   for p in model.parameters())
    if trainer.global_rank == 0:
        (root / name / "result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--layout", choices=("zero2", "pp2", "zero2_ep2"), required=True)
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args()
    for case in args.cases:
        fit(Path(args.root), args.layout, case)
