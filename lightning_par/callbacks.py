"""Callbacks that make a parallel run readable in TensorBoard, and the CLI's default checkpoints."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor


def _count_tokens(batch: Any) -> int:
    """Tokens in a batch: the element count of its first tensor (inputs of an ``(inputs, targets)`` batch)."""
    if isinstance(batch, Tensor):
        return batch.numel()
    if isinstance(batch, (list, tuple)) and batch:
        return _count_tokens(batch[0])
    if isinstance(batch, dict) and batch:  # a Hugging Face collator's batch: count its input_ids
        return _count_tokens(batch.get("input_ids", next(iter(batch.values()))))
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


class PipelineTimeline(pl.Callback):
    """Record one training step of a pipeline-parallel run: the executed schedule, its bubble, its memory.

    At optimizer step ``step`` every pipeline rank records the compute actions its stages run (forward, backward,
    weight-gradient backward) and the activation memory autograd holds. Global rank 0 then logs to TensorBoard
    ``pipeline/bubble_fraction`` (idle share of the step, mean over pipeline ranks),
    ``pipeline/peak_microbatches_in_flight`` (most micro-batches one stage holds activations for) and
    ``pipeline/peak_activation_MiB`` (largest over pipeline ranks), and the timeline as the figure
    ``pipeline/timeline``; it writes the same as ``pipeline_timeline.png`` and ``.json`` (per rank, per stage)
    into the log directory. Does nothing when the strategy is not pipelined.

    The bubble of a real model on a shared CPU includes contention between ranks; ``benchmarks/pipeline_bubble.py``
    measures the schedules themselves against the formulas.

    Args:
        step: the optimizer step to record (a few steps in, after the first step's shape inference).
    """

    def __init__(self, step: int = 3) -> None:
        self.step = step

    @staticmethod
    def _pipeline(trainer: pl.Trainer) -> Any:
        return getattr(trainer.strategy, "pipeline", None)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        pipeline = self._pipeline(trainer)
        if pipeline is not None and trainer.global_step == self.step and \
                batch_idx % trainer.accumulate_grad_batches == 0:
            pipeline.record_next = True

    @staticmethod
    def _draw(records: Any, path: Any, title: str, n_ranks: int) -> Any:
        """The timeline figure, or None with a warning where matplotlib (an optional extra) is not installed: the
        numbers are still logged and written to the JSON."""
        try:
            from lightning_par.parallel.pipeline.timeline import draw_timeline

            return draw_timeline(records, path, title, n_ranks=n_ranks)
        except ImportError as err:
            rank_zero_warn(f"pipeline timeline: no figure ({err}); `pip install matplotlib` to draw it. The bubble "
                           "fraction and activation memory are logged all the same.")
            return None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        pipeline = self._pipeline(trainer)
        if pipeline is None or pipeline.recording is None:
            return
        import json
        from pathlib import Path

        import torch.distributed as dist

        from lightning_par.parallel.pipeline.timeline import (
            bubble_fraction,
            gather_records,
            peak_in_flight,
        )

        recording, pipeline.recording = pipeline.recording, None
        records = gather_records(recording.records, group=pipeline.group, origin=recording.origin)
        peak_bytes: list = [None] * pipeline.pp
        dist.all_gather_object(peak_bytes, recording.peak_activation_bytes, group=pipeline.group)
        out_dir = Path(trainer.log_dir or trainer.default_root_dir)  # log_dir is a collective: all ranks ask
        if not trainer.is_global_zero:
            return
        bubble = bubble_fraction(records, pipeline.pp)
        in_flight = peak_in_flight(records)
        plan = pipeline.plan
        summary = {"step": trainer.global_step, "schedule": plan.schedule, "pp": plan.pp,
                   "n_microbatches": plan.n_microbatches, "virtual_stages": plan.virtual_stages,
                   "bubble_fraction": bubble["mean"], "bubble_per_rank": bubble["per_rank"],
                   "makespan_s": bubble["makespan"], "peak_in_flight": in_flight,
                   "peak_activation_bytes": peak_bytes, "records": [r.__dict__ for r in records]}
        metrics = {"pipeline/bubble_fraction": bubble["mean"],
                   "pipeline/peak_microbatches_in_flight": max(in_flight.values()),
                   "pipeline/peak_activation_MiB": max(peak_bytes) / 2**20}
        title = (f"{plan.schedule}: p={plan.pp}, m={plan.n_microbatches}, v={plan.virtual_stages}, "
                 f"step {trainer.global_step}, idle {bubble['mean']:.0%}")
        figure = self._draw(records, out_dir / "pipeline_timeline.png", title, pipeline.pp)
        (out_dir / "pipeline_timeline.json").write_text(json.dumps(summary, indent=1))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
            add_figure = getattr(getattr(logger, "experiment", None), "add_figure", None)
            if figure is not None and callable(add_figure):
                add_figure("pipeline/timeline", figure, global_step=trainer.global_step)


class MemoryPerRank(pl.Callback):
    """Log each rank's memory to TensorBoard every ``every`` optimizer steps: ``memory/rank{R}_MiB``.

    On CUDA the peak bytes allocated since the last log (``torch.cuda.max_memory_allocated``); on CPU the process's
    resident set (RSS, from ``/proc/self/statm``), which is what a rank costs its host. Every rank measures, global
    rank 0 logs them all, so one chart shows how evenly the layout spreads the model.

    Args:
        every: optimizer steps between two logs.
    """

    def __init__(self, every: int = 10) -> None:
        self.every = every

    @staticmethod
    def _bytes(device: Any) -> int:
        import os

        import torch

        if device.type == "cuda":
            value = torch.cuda.max_memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            return int(value)
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step % self.every or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        import torch.distributed as dist

        mine = self._bytes(trainer.strategy.root_device)
        values = [mine]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            values = [0] * trainer.world_size
            dist.all_gather_object(values, mine)
        if trainer.is_global_zero and trainer.logger is not None:
            metrics = {f"memory/rank{rank}_MiB": value / 2**20 for rank, value in enumerate(values)}
            trainer.logger.log_metrics(metrics, step=trainer.global_step)


class RunCheckpoint(ModelCheckpoint):
    """The ``lightning-par`` CLI's checkpoints when the user configures none: every ``every_n_train_steps`` optimizer
    steps and when fit ends, each named by its step (``epoch=E-step=S.ckpt``), the previous one deleted once the new
    one is complete, and ``last.ckpt`` a link to the newest.

    A plain ``ModelCheckpoint(save_last="link", every_n_train_steps=N)`` would leave the last steps of a run unsaved
    (Lightning 2.6 saves ``last`` at the end only if nothing was saved before) and would, at an epoch or validation
    end, point ``last`` at the checkpoint of an earlier step. Here ``last`` is only ever linked to a checkpoint of the
    current step, written first.
    """

    def __init__(self, every_n_train_steps: int = 500, dirpath: str | None = None) -> None:
        super().__init__(dirpath=dirpath, save_last="link", save_top_k=1, every_n_train_steps=every_n_train_steps)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # every N steps and at the end, not at epoch or validation ends (Lightning's would relink a stale one)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._should_skip_saving_checkpoint(trainer):  # the final step, unless saved already
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
