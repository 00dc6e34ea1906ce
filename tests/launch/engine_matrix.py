"""One layout of each strategy family on the same 4 ranks, trained from weights that DIFFER per rank.

Run under torchrun (``tests.harness.launch_matrix``). Each rank seeds its model with ``1234 + rank`` and no
``seed_everything``, so the engine must make the replicas identical itself: rank 0's weights (which equal the
single-process reference's, seeded 1234) must reach every rank that replicates them. Plain SGD (no momentum,
no clipping): a gradient off by a constant factor moves the loss. Per layout, every rank writes
``ROOT/NAME/rank{R}.json`` with what it checked; rank 0's TensorBoard events hold the per-step losses.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torchmetrics
from lightning.pytorch.loggers import TensorBoardLogger
from torch.distributed.tensor import DTensor

from lightning_par import LayoutStrategy
from lightning_par.data import TextDataModule
from lightning_par.examples import GPTLightningModule
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS, SGD_LR

#: name -> (strategy arguments, batch size per rank)
LAYOUTS: dict[str, tuple[dict, int]] = {
    "zero0_dp4": (dict(zero_stage=0), GLOBAL_BATCH // 4),
    "zero1_dp4": (dict(zero_stage=1), GLOBAL_BATCH // 4),
    "zero2_dp4": (dict(zero_stage=2), GLOBAL_BATCH // 4),
    "zero3_dp4": (dict(zero_stage=3), GLOBAL_BATCH // 4),
    "tp2_dp2": (dict(tp=2), GLOBAL_BATCH // 2),
    # activation recompute composed with FSDP2 and with tensor parallel: same trajectory, less memory
    "zero3_dp4_full_recompute": (dict(zero_stage=3, recompute="full"), GLOBAL_BATCH // 4),
    "tp2_dp2_selective_recompute": (dict(tp=2, recompute="selective"), GLOBAL_BATCH // 2),
    "pp2_dp2": (dict(pp=2, schedule="1f1b", n_microbatches=2), GLOBAL_BATCH // 2),
    # every rank draws the same weights: each pipeline stage then holds the single process's values for its units
    "pp2_dp2_seeded": (dict(pp=2, schedule="1f1b", n_microbatches=2), GLOBAL_BATCH // 2),
}
#: layouts whose stages are drawn by different ranks: replicas agree, but the model is not the single process's.
#: None since issue 17: a layout that splits parameters builds the model deferred, and every rank replays global
#: rank 0's draws, so pp2_dp2's stages hold the single process's values too.
PER_STAGE_DRAWS: tuple[str, ...] = ()


def _checksums(module: torch.nn.Module) -> dict[str, float]:
    """Sum of every parameter's (full) values, by name; a DTensor is gathered first (a collective)."""
    out = {}
    for name, param in module.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = float(value.detach().double().sum())
    return out


class RankSeededGPT(GPTLightningModule):
    """The tiny GPT, its weights drawn from seed ``1234 + global rank``, counting its steps in a SumMetric."""

    def __init__(self, preset: str = "tiny", n_layers: int | None = None, optimizer: str = "sgd",
                 lr: float = SGD_LR, same_seed: bool = False):
        super().__init__(preset=preset, n_layers=n_layers, optimizer=optimizer, lr=lr)
        self.same_seed = same_seed
        self.steps_seen = torchmetrics.SumMetric()
        self.initial: dict[str, float] = {}

    def configure_model(self):
        if self.model is None:
            torch.manual_seed(1234 + (0 if self.same_seed else int(os.environ.get("RANK", "0"))))
            super().configure_model()
            self.initial = _checksums(self)

    def training_step(self, batch, batch_idx):
        self.steps_seen.update(torch.tensor(1.0))
        # a sum over ranks must count one value per data-parallel replica, not per rank
        self.log("probe/ones_sum", torch.tensor(1.0), reduce_fx="sum", sync_dist=True, on_step=True,
                 on_epoch=False, batch_size=1)
        return super().training_step(batch, batch_idx)


class ReplicaCheck(pl.Callback):
    """After setup: each parameter equals the value the rank it is replicated from drew; at the end: the sums."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.report: dict = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        initial = [None] * dist.get_world_size()
        dist.all_gather_object(initial, pl_module.initial)
        now = _checksums(pl_module)
        coords = strategy.coordinates
        # where the values come from: global rank 0 (a broadcast over dp and tp from the replica of rank 0, or, for
        # a model built deferred, rank 0's random draws replayed on every rank)
        source = 0
        errors = [abs(now[n] - initial[source][n]) / max(abs(initial[source][n]), 1e-12) for n in now]
        differs = sum(initial[0][n] != initial[1][n] for n in initial[0])  # whether the ranks drew different weights
        self.report.update(max_rel_err=max(errors), n_params=len(errors), params_differing_at_init=differs,
                           coordinates=coords, gradient_sync=strategy.gradient_sync.name)

    def on_train_end(self, trainer, pl_module) -> None:
        self.report.update(
            ones_sum=float(trainer.callback_metrics["probe/ones_sum"]),
            steps_seen=float(pl_module.steps_seen.compute()),
            strategy_reduce_sum=float(trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum")),
            dp=trainer.strategy.dims.dp,
        )
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(self.report, indent=1))


def fit(root: Path, cache: str, name: str) -> None:
    strategy_args, batch = LAYOUTS[name]
    model = RankSeededGPT(preset="tiny", n_layers=8, same_seed=name.endswith("_seeded"))
    data = TextDataModule(seq_len=32, max_corpus_bytes=300_000, shuffle=False, batch_size=batch, cache_dir=cache)
    trainer = pl.Trainer(
        accelerator="cpu", devices=4, strategy=LayoutStrategy(**strategy_args), max_steps=PARITY_STEPS,
        limit_train_batches=EPOCH_STEPS, limit_val_batches=2, log_every_n_steps=1,
        logger=TensorBoardLogger(save_dir=root / name / "tb"),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[ReplicaCheck(root / name)], default_root_dir=root / name,
    )
    trainer.fit(model, data)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    args = parser.parse_args()
    for name in args.layouts:
        fit(Path(args.root), args.cache, name)


if __name__ == "__main__":
    main()
