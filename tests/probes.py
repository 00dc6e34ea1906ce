"""Callbacks the tests add to a launched run to report what each rank saw."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter


class RankReport(pl.Callback):
    """Write ``rank{N}.json`` per rank: coordinates, groups, sampler, environment and wrapper facts."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx < 3:
            # identify each sample by a few of its tokens, to check which rank saw which sample
            self.batches.append([int(t) for t in batch[0][:, :4].flatten()])

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        report = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "strategy": type(strategy).__name__,
            "cluster_environment": type(getattr(strategy, "cluster_environment", None)).__name__,
            "wrapped_model": type(strategy.model).__name__,
            "first_batches": self.batches,
        }
        mesh = getattr(strategy, "_device_mesh", None)
        if mesh is not None:  # a lightning-par strategy (the single-process reference runs without one)
            report.update(
                backend=dist.get_backend(),
                coordinates=strategy.coordinates,
                groups={d: sorted(dist.get_process_group_ranks(mesh[d].get_group())) for d in ("pp", "dp", "tp")},
                sampler=dict(strategy.distributed_sampler_kwargs),
            )
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))


class PredictionDump(BasePredictionWriter):
    """Write each rank's predictions (token ids) to ``predictions_rank{N}.json``."""

    def __init__(self, path: str) -> None:
        super().__init__(write_interval="epoch")
        self.path = Path(path)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        rows = [row.tolist() for batch in predictions for row in batch]
        (self.path / f"predictions_rank{trainer.global_rank}.json").write_text(json.dumps(rows))


class DieAt(pl.Callback):
    """Kill one rank abruptly (no cleanup, like a crashed node) when it starts a given training step."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os._exit(17)
