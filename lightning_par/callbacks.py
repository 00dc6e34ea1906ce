"""Callbacks that make a parallel run readable in TensorBoard."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from torch import Tensor


def _count_tokens(batch: Any) -> int:
    """Tokens in a batch: the element count of its first tensor (inputs of an ``(inputs, targets)`` batch)."""
    if isinstance(batch, Tensor):
        return batch.numel()
    if isinstance(batch, (list, tuple)) and batch:
        return _count_tokens(batch[0])
    if isinstance(batch, dict) and batch:
        return _count_tokens(next(iter(batch.values())))
    return 0


class TokensPerSecond(pl.Callback):
    """Log ``train/tokens_per_sec``: tokens consumed by ALL data-parallel replicas per second of training step.

    Lightning's ``ThroughputMonitor`` multiplies by the world size, which over-counts when tensor- or
    pipeline-parallel ranks share one batch; this counts by the data-parallel size the strategy reports.

    Args:
        window: number of optimizer steps the rate is averaged over.
    """

    def __init__(self, window: int = 10) -> None:
        self.window = window
        self._tokens = 0
        self._start: float | None = None
        self._steps = 0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        replicas = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1) if trainer.world_size > 1 else 1
        self._tokens += _count_tokens(batch) * replicas
        self._steps += 1
        if self._steps % self.window == 0 and self._start is not None:
            elapsed = time.perf_counter() - self._start
            pl_module.log("train/tokens_per_sec", self._tokens / max(elapsed, 1e-9), rank_zero_only=True)
            self._tokens, self._start = 0, None
