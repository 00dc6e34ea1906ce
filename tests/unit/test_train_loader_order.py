"""A training DataLoader's order under a lightning-par strategy is the one Lightning keeps on one device:
``shuffle=False`` stays sequential (Lightning injects no sampler under ``strategy="auto"``), ``shuffle=True`` stays
shuffled and resumable (lightning_par.run.data_position)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader


class _Seen(pl.LightningModule):
    """Records the sample indices of each training batch (plain SGD on a linear layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch[:, 0].long().tolist())
        return self.layer(batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _batches(strategy, shuffle: bool) -> tuple[list[list[int]], object]:
    pl.seed_everything(7)
    model = _Seen()
    loader = DataLoader(torch.arange(24, dtype=torch.float32).unsqueeze(1), batch_size=4, shuffle=shuffle)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    return model.seen, trainer.train_dataloader


def test_a_sequential_loader_stays_sequential_and_a_shuffled_one_shuffled():
    from lightning_par import ZeroStrategy
    from lightning_par.run.data_order import DataParallelSampler

    auto, _ = _batches("auto", shuffle=False)
    par, loader = _batches(ZeroStrategy(stage=1), shuffle=False)
    assert auto == [list(range(i, i + 4)) for i in range(0, 24, 4)] * 2
    assert par == auto
    assert isinstance(loader.sampler, DataParallelSampler) and callable(loader.state_dict)  # still resumable

    shuffled, loader = _batches(ZeroStrategy(stage=1), shuffle=True)
    assert shuffled[:6] != auto[:6] and shuffled[:6] != shuffled[6:]  # shuffled, anew each epoch
    assert sorted(i for b in shuffled[:6] for i in b) == list(range(24))
    assert loader.sampler.shuffle and callable(loader.state_dict)
