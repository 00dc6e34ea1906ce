"""Callbacks that make a parallel run readable in TensorBoard, and the CLI's default checkpoints.

A script of one's own gets what the CLI logs (tokens/s, MFU, memory over ranks, the pipeline timeline) with
:func:`defaults`: ``Trainer(strategy=..., callbacks=lightning_par.callbacks.defaults())``.
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor


def _first_tensor(batch: Any) -> Tensor | None:
    """The token ids of a batch: itself, the first tensor of an ``(inputs, targets)`` batch, a dict's ``input_ids``."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (list, tuple)) and batch:
        return _first_tensor(batch[0])
    if isinstance(batch, dict) and batch:  # a Hugging Face collator's batch: its input_ids
        return _first_tensor(batch.get("input_ids", next(iter(batch.values()))))
    return None


def _count_tokens(batch: Any) -> int:
    """Tokens in a batch: the element count of its token ids."""
    ids = _first_tensor(batch)
    return 0 if ids is None else ids.numel()


class TokensPerSecond(pl.Callback):
    """Log ``train/tokens_per_sec``: tokens consumed by ALL data-parallel replicas per second of training step, and
    ``train/mfu``, the model FLOPs utilisation, on the same steps.

    Lightning's ``ThroughputMonitor`` multiplies by the world size, which over-counts when tensor- or
    pipeline-parallel ranks share one batch; this counts by the data-parallel size the strategy reports.

    MFU = model FLOPs per token x tokens/s / peak FLOP/s of all devices of the job
    (:mod:`lightning_par.utilization`). FLOPs per token (forward + backward, recompute not counted): the planner's
    count for the model rebuilt on the meta device (a Hugging Face model from its config, a LightningModule from its
    saved hyperparameters) at the batches' sequence length; for a model the planner cannot describe, 6 x the whole
    model's parameters + 12 x layers x hidden x sequence for attention (said once in the log); for a mixture of
    experts, the same estimate from its ACTIVE parameters (the top-k experts a token uses). Peak: on a GPU, the
    datasheet's dense peak for the device name (:data:`lightning_par.planner.hardware.GPUS`: H100 SXM/PCIe/NVL,
    H200, A100, L40S, B200) in the precision's matmul dtype (fp32 at the TF32 peak when TF32 is on), times the world
    size; on a CPU, one core's matmul rate, measured once per machine and kept
    (:func:`lightning_par.utilization.cpu_core_peak`, so two launches divide by the same figure), times the cores
    the ranks of a node can use, times the nodes; the log line says which figure and where it is kept. No
    ``train/mfu`` on a GPU the table does not hold, unless ``peak_flops`` is given (one warning says how).

    The window is timed on the host clock after waiting for the device (``torch.cuda.synchronize`` at its two
    edges, not in between), so queued kernels are counted in the window that launched them.

    Args:
        window: number of optimizer steps the rate is averaged over.
        mfu: also log ``train/mfu``.
        peak_flops: peak FLOP/s of one device, instead of the table's or the measurement.
        flops_per_token: the model's forward + backward FLOPs per token, instead of the planner's count.
    """

    def __init__(self, window: int = 10, mfu: bool = True, peak_flops: float | None = None,
                 flops_per_token: float | None = None) -> None:
        self.window = window
        self.mfu = mfu
        self.peak_flops = peak_flops
        self.flops_per_token = flops_per_token
        self._tokens = 0
        self._start: float | None = None
        self._steps = 0
        self._n_params = 0
        self._mfu_scale: float | None = None  # FLOPs per token / peak FLOP/s, found at the first log

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.mfu and self.flops_per_token is None:  # the whole model's count, for the fallback estimate
            from lightning_par.utilization import parameter_counts

            self._n_params = parameter_counts(pl_module, getattr(trainer.strategy, "pipeline", None)).whole

    @staticmethod
    def _clock(trainer: pl.Trainer) -> float:
        """The host clock once the device has finished what was queued: CUDA kernels run behind the host, so the
        host clock alone measures launches (right only while something else, like the progress bar's ``.item()``,
        waits for the device every step)."""
        device = trainer.strategy.root_device
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize(device)
        return time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        if self._start is None:  # a window's first edge
            self._start = self._clock(trainer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        replicas = trainer.strategy.distributed_sampler_kwargs.get("num_replicas", 1) if trainer.world_size > 1 else 1
        self._tokens += _count_tokens(batch) * replicas
        self._steps += 1
        if self._steps % self.window == 0 and self._start is not None:
            elapsed = self._clock(trainer) - self._start  # the window's last edge
            rate = self._tokens / max(elapsed, 1e-9)
            if trainer.is_global_zero:
                # to the loggers directly, at this step only (a value given to self.log from a callback would be
                # logged again at every step until the next window)
                metrics = {"train/tokens_per_sec": rate}
                scale = self._scale(trainer, pl_module, batch) if self.mfu else 0.0
                if scale:
                    metrics["train/mfu"] = rate * scale
                for logger in trainer.loggers:
                    logger.log_metrics(metrics, step=trainer.global_step)
            self._tokens, self._start = 0, None

    def _scale(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any) -> float:
        """FLOPs per token / peak FLOP/s (0: no MFU), found once, outside the timed window; rank 0 only."""
        if self._mfu_scale is not None:
            return self._mfu_scale
        from lightning_par.utilization import model_flops_per_token, peak_flops

        self._mfu_scale = 0.0
        ids = _first_tensor(batch)
        seq_len = ids.shape[-1] if ids is not None and ids.dim() else 0
        peak = peak_flops(trainer.strategy.root_device, str(trainer.precision), trainer.world_size,
                          trainer.num_devices, trainer.num_nodes, self.peak_flops)
        if peak is None:
            device = trainer.strategy.root_device
            if device.type == "cuda":
                import torch

                from lightning_par.planner.hardware import GPUS

                known = ", ".join(spec.name for spec in GPUS.values())
                device = f"{device} ({torch.cuda.get_device_name(device)}; the table knows {known})"
            rank_zero_warn(f"train/mfu is not logged: no peak FLOP/s is known for {device}. Give the dense peak of "
                           "one device in the run's matmul dtype: --tokens_per_sec.peak_flops=FLOPS on the command "
                           "line, TokensPerSecond(peak_flops=FLOPS) in code.")
            return 0.0
        if self.flops_per_token is not None:
            flops, how = float(self.flops_per_token), "given"
        elif seq_len:
            flops, how = model_flops_per_token(pl_module, self._n_params, seq_len)
        else:
            rank_zero_warn("train/mfu is not logged: the batches hold no token ids to count.")
            return 0.0
        rank_zero_info(f"train/mfu: {flops / 1e6:.4g} MFLOP per token (forward + backward) from {how}; peak "
                       f"{peak.flops / 1e9:.4g} GFLOP/s ({peak.source})")
        self._mfu_scale = flops / peak.flops
        return self._mfu_scale


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


#: per CUDA device, the highest (allocated, reserved) peaks seen before MemoryPerRank reset them
_RUN_PEAKS: dict[Any, tuple[int, int]] = {}


def cuda_run_peak_bytes(device: Any) -> tuple[int, int]:
    """The peak bytes allocated and reserved on a CUDA ``device`` since the process started, across the resets of
    :class:`MemoryPerRank` (``torch.cuda.max_memory_allocated`` alone gives only the peak since the last one)."""
    import torch

    allocated, reserved = _RUN_PEAKS.get(str(device), (0, 0))
    return (max(allocated, int(torch.cuda.max_memory_allocated(device))),
            max(reserved, int(torch.cuda.max_memory_reserved(device))))


class MemoryPerRank(pl.Callback):
    """Log the ranks' memory to TensorBoard every ``every`` optimizer steps, as min, mean and max over all ranks and
    the rank using most; with ``per_rank``, also each rank's own value (one chart per rank: a few ranks, not 64).

    On CPU: the process's resident set (RSS, from ``/proc/self/statm``) at the logged step, which is what a rank
    costs its host: ``memory/min_MiB``, ``memory/mean_MiB``, ``memory/max_MiB``, ``memory/max_rank``
    (``memory/rank{R}_MiB``).

    On CUDA: the peaks of the window, from the previous log (or the start of training) to this one, whatever ran
    in it (validation included): torch's peaks are reset when a window starts and read when it ends, so the windows
    tile the training and each one's peak is whole. Bytes in tensors
    (``torch.cuda.max_memory_allocated``) as ``memory/allocated_peak_{min,mean,max}_MiB`` and
    ``memory/allocated_peak_max_rank``, and bytes the caching allocator holds from the driver, tensors and cache
    (``max_memory_reserved``), as ``memory/reserved_peak_...`` (``memory/rank{R}_allocated_peak_MiB``,
    ``memory/rank{R}_reserved_peak_MiB``). Neither counts the CUDA context nor NCCL's buffers. The whole run's peak
    survives the resets: :func:`cuda_run_peak_bytes`.

    Every rank measures, one all-gather brings the numbers to global rank 0, which logs; nothing happens between
    logs.

    Args:
        every: optimizer steps between two logs.
        per_rank: also log each rank's own value.
    """

    def __init__(self, every: int = 10, per_rank: bool = False) -> None:
        self.every = every
        self.per_rank = per_rank

    @staticmethod
    def _bytes(device: Any) -> list[float]:
        """This rank's numbers: [peak allocated, peak reserved] on CUDA (since the window's reset), [RSS] on CPU."""
        import os

        import torch

        if device.type == "cuda":
            return [float(torch.cuda.max_memory_allocated(device)), float(torch.cuda.max_memory_reserved(device))]
        with open("/proc/self/statm") as f:
            return [float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))]

    @staticmethod
    def metrics(values: list[float], per_rank: bool = False, name: str = "") -> dict[str, float]:
        """The logged scalars for each rank's bytes ``values`` (index: global rank); ``name`` (``allocated_peak``,
        ``reserved_peak``) goes into the tags, none for the CPU's resident size."""
        mib = [v / 2**20 for v in values]
        tag = f"memory/{name}_" if name else "memory/"
        out = {f"{tag}min_MiB": min(mib), f"{tag}mean_MiB": sum(mib) / len(mib), f"{tag}max_MiB": max(mib),
               f"{tag}max_rank": float(mib.index(max(mib)))}
        if per_rank:
            suffix = f"_{name}" if name else ""
            out.update({f"memory/rank{rank}{suffix}_MiB": value for rank, value in enumerate(mib)})
        return out

    @staticmethod
    def _start_window(device: Any) -> None:
        """Reset torch's CUDA peaks (keeping the run's, for :func:`cuda_run_peak_bytes`); nothing on CPU."""
        if device.type != "cuda":
            return
        import torch

        _RUN_PEAKS[str(device)] = cuda_run_peak_bytes(device)  # what the reset would lose
        torch.cuda.reset_peak_memory_stats(device)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_window(trainer.strategy.root_device)  # the first window: not setup's or the model's build

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if trainer.global_step % self.every or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        import torch
        import torch.distributed as dist

        device = trainer.strategy.root_device
        mine = torch.tensor(self._bytes(device), dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        self._start_window(device)  # the next window starts where this one ends
        values = [mine]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            values = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(values, mine)
        if trainer.is_global_zero:
            ranks = [v.tolist() for v in values]
            if device.type == "cuda":
                metrics = {**self.metrics([r[0] for r in ranks], self.per_rank, "allocated_peak"),
                           **self.metrics([r[1] for r in ranks], self.per_rank, "reserved_peak")}
            else:
                metrics = self.metrics([r[0] for r in ranks], self.per_rank)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


class RouterLoad(pl.Callback):
    """Log each mixture-of-experts layer's load every ``every`` optimizer steps: the (token, choice) pairs its router
    sent to each expert over the window (the steps since the last log, validation left out), summed over the
    data-parallel ranks, as ``moe/<layer>/max_over_mean`` (the busiest expert's share over an even one: 1 is
    balanced), ``moe/<layer>/dropped_fraction`` (pairs dropped over capacity / routed; 0 when dropless) and, with
    ``per_expert``, ``moe/<layer>/tokens_expert_<e>`` (:func:`lightning_par.parallel.router.load_metrics`).

    The layers count as they route (a Python-side sum, no collective); at a logged step one all-reduce over the
    data-parallel group sums them (and under a pipeline one gather brings every stage's layers to global rank 0).
    Does nothing for a model without router layers (:func:`lightning_par.parallel.router.router_layers`).

    Args:
        every: optimizer steps between two logs.
        per_expert: also log each expert's token count (E scalars per layer).
    """

    def __init__(self, every: int = 10, per_expert: bool = True) -> None:
        self.every = every
        self.per_expert = per_expert
        self._held: dict[str, Any] = {}
        self._active = False  # some rank holds router layers

    @staticmethod
    def _layers(pl_module: pl.LightningModule) -> dict[str, Any]:
        from lightning_par.parallel.router import router_layers

        return {n: m for n, m in router_layers(pl_module).items() if hasattr(m, "tokens_per_expert")}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_par.parallel.router import reset_router_load

        reset_router_load(pl_module)  # the window starts here: no sanity check's or earlier fit's tokens
        self._active = bool(self._layers(pl_module))
        if getattr(trainer.strategy, "pipeline", None) is not None and trainer.world_size > 1:
            import torch
            import torch.distributed as dist

            device = trainer.strategy.root_device  # (NCCL: on the GPU)
            flag = torch.tensor([float(self._active)], device=device if device.type == "cuda" else "cpu")
            # (once) a stage may hold none of the router layers
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            self._active = bool(flag.item())

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._held = {n: (m.tokens_per_expert, m.dropped_tokens) for n, m in self._layers(pl_module).items()}

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for name, layer in self._layers(pl_module).items():  # validation's routing is not training's load
            if name in self._held:
                layer.tokens_per_expert, layer.dropped_tokens = self._held[name]
        self._held = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if not self._active or trainer.global_step % self.every or (batch_idx + 1) % trainer.accumulate_grad_batches:
            return
        import torch.distributed as dist

        from lightning_par.parallel.router import load_metrics, reset_router_load, router_load

        distributed = dist.is_available() and dist.is_initialized() and trainer.world_size > 1
        group = None
        if distributed:  # the ranks that routed different tokens: the data-parallel ones (dp x cp)
            mesh = getattr(trainer.strategy, "grad_mesh", None)
            group = mesh.get_group() if mesh is not None else dist.group.WORLD
        metrics = load_metrics(router_load(pl_module, group), self.per_expert)
        reset_router_load(pl_module)
        if distributed and getattr(trainer.strategy, "pipeline", None) is not None:
            stages: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(stages, metrics)  # other stages hold other layers
            metrics = {k: v for stage in stages for k, v in stage.items()}
        if trainer.is_global_zero and metrics:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)


#: the throughput and memory callbacks the CLI adds to every run, by the config key that takes their options
#: (``--tokens_per_sec.window=5``); :func:`defaults` gives the same to a script
DEFAULTS: dict[str, type[pl.Callback]] = {
    "tokens_per_sec": TokensPerSecond, "pipeline_timeline": PipelineTimeline, "memory_per_rank": MemoryPerRank,
    "router_load": RouterLoad}


def defaults(**options: dict[str, Any]) -> list[pl.Callback]:
    """What the ``lightning-par`` CLI logs, for a script's ``Trainer(callbacks=...)``: ``train/tokens_per_sec`` and
    ``train/mfu`` (:class:`TokensPerSecond`), memory over ranks (:class:`MemoryPerRank`), a mixture of experts' load
    per layer (:class:`RouterLoad`) and, under a pipeline, the timeline (:class:`PipelineTimeline`). Each callback's
    options under its CLI key, e.g. ``defaults(tokens_per_sec={"window": 5}, memory_per_rank={"every": 20})``. They
    log to the trainer's loggers (nothing without one). The CLI also adds Lightning's
    ``LearningRateMonitor(logging_interval="step")``, which needs a logger: add it yourself where you have one."""
    unknown = sorted(set(options) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"defaults() got options for {', '.join(unknown)}; it takes {', '.join(DEFAULTS)}")
    return [cls(**options.get(key, {})) for key, cls in DEFAULTS.items()]


def describe_counts(counts: Any, pp: int = 1, stages: Any = (), n_stages: int = 1, tp: int = 1,
                    zero3_dp: int = 1) -> str:
    """The line printed after Lightning's model summary: what its counts cover, the whole model's count and rank 0's
    share. ``counts``: :class:`lightning_par.utilization.ParameterCounts` of global rank 0; ``stages``: the
    pipeline stages it holds (of ``n_stages``)."""
    if pp > 1:
        held = ", ".join(str(s) for s in stages)
        covered = f"pipeline rank 0's stage{'s' if len(stages) > 1 else ''} {held} of {n_stages}"
        covered += " at full tensor-parallel width" if tp > 1 else ""
    elif counts.summary == counts.whole:
        covered = "the whole model"
    else:
        covered = "global rank 0's share"
    parts = [f"pipeline stage{'s' if len(stages) > 1 else ''} {', '.join(str(s) for s in stages)}"] if pp > 1 else []
    parts += [f"a 1/{tp} tensor-parallel slice"] if tp > 1 else []
    parts += [f"a 1/{zero3_dp} ZeRO-3 shard"] if zero3_dp > 1 else []
    share = f" ({', '.join(parts)})" if parts else ""
    return (f"Model summary: its parameter counts cover {covered} ({counts.summary:,}); the whole model has "
            f"{counts.whole:,} parameters, global rank 0 holds {counts.here:,}{share}.")


class ParallelModelSummary(ModelSummary):
    """Lightning's model summary, followed by a line that says what its counts cover under the layout -- pipeline
    rank 0's stages under pp, the whole model under tp and ZeRO (DTensors count at their global size) -- the
    whole model's parameter count (over every pipeline stage, a tied weight once) and what global rank 0 holds
    (:func:`describe_counts`). The ``lightning-par`` CLI uses it in place of Lightning's default summary."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        if not self._max_depth:
            return
        from lightning_par.utilization import parameter_counts

        strategy = trainer.strategy
        pipeline = getattr(strategy, "pipeline", None)
        counts = parameter_counts(pl_module, pipeline)  # a collective under pp: every rank
        if not trainer.is_global_zero:
            return
        dims = getattr(strategy, "dims", None)
        layout = getattr(strategy, "layout", None)
        pp, tp = (dims.pp, dims.tp) if dims is not None else (1, 1)
        dp = dims.dp if dims is not None else 1
        zero3 = dp if layout is not None and layout.zero_stage == 3 else 1
        stages, n_stages = (), 1
        if pipeline is not None:
            stages, n_stages = tuple(pipeline.stage_ids), pipeline.plan.n_stages
        rank_zero_info(describe_counts(counts, pp, stages, n_stages, tp, zero3))


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
