"""PlannedStrategy (``strategy="planned"``): the planner picks the layout at launch, then the engine trains with it.

At launch -- once the process group exists, before ``configure_model`` builds the model and before anything is
parallelised -- rank 0 runs :mod:`lightning_par.planner` for the LightningModule (rebuilt on the meta device from its
class and saved hyperparameters), the world size, the batch the datamodule gives each data-parallel replica and its
sequence length, the Trainer's precision and the device memory (CUDA: the smallest free memory of any rank,
``torch.cuda.mem_get_info``; CPU: the machine's memory divided by the ranks on it), and broadcasts its choice, so
every rank applies the same one: the layout with the most tokens per second among those that fit and that this
version runs (the planner's ``runs_today``; the precision is the user's, only layouts at it are considered). Rank 0
logs the choice and the runner-up (one INFO line each, predicted memory and step time) and writes the choice to the
loggers as hyperparameters (``planned/*``) and, for TensorBoard, as text. Nothing fitting is an error on every rank
that names the best candidate's memory and the budget.

Layouts compared have the same batch per data-parallel replica (the datamodule's ``batch_size``): more replicas
process more tokens per step, so layouts are ranked by predicted tokens per second, not by step time.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_par.plugins.precision import LayoutPrecision
from lightning_par.strategies.engine import LayoutStrategy
from lightning_par.strategies.presets import engine_options
from lightning_par.topology import LayoutError

#: the Trainer's precision -> the planner's name for its bytes (bf16-mixed-master: once the planner knows it)
_PLANNER_PRECISION = {"32-true": "fp32", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true",
                      "bf16-mixed-master": "bf16-mixed-master"}


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


@dataclass(frozen=True)
class Budget:
    """What the plan is made for: ``world`` ranks, ``local`` of them per node, ``memory_gib`` per rank."""

    world: int
    local: int
    memory_gib: float


@dataclass
class Choice:
    """The planner's pick: ``best`` and ``runner_up`` (planner Estimates; ``runner_up`` may be None)."""

    best: Any
    runner_up: Any
    considered: int

    def describe(self, estimate: Any, role: str) -> str:
        return (f"{role}: {estimate.candidate.label()} (m={estimate.candidate.n_microbatches}): predicted "
                f"{_gib(estimate.worst.total)} per rank, {estimate.step_time * 1e3:.1f} ms per step, "
                f"{estimate.tokens_per_s:,.0f} tokens/s")


def _micro_batches(batch: int, pp: int) -> int | None:
    """Pipeline micro-batches for one replica's ``batch``: the engine's default 2 * pp, else pp; None if neither
    divides it."""
    for m in (2 * pp, pp):
        if batch % m == 0:
            return m
    return None


def plan_layouts(model: torch.nn.Module, budget: Budget, batch: int, seq_len: int, precision: str,
                 accumulate: int = 1, hardware: str = "cpu", optimizer: str | None = None,
                 zero_stages: Sequence[int] = (0, 1, 2, 3), schedules: Sequence[str] | None = None,
                 recompute: Sequence[str] | None = None, block_types: list[str] | None = None,
                 search: bool = False) -> Choice:
    """Estimate every layout of ``model`` (built on meta) on ``budget`` and pick the fastest that fits and runs.

    ``batch`` sequences per data-parallel replica and optimizer micro-step (pp > 1: split into micro-batches),
    ``accumulate`` micro-steps per optimizer step. Raises :class:`LayoutError` when nothing fits or runs; with
    ``search`` (at launch), naming the smallest larger world where something fits (an elastic attempt on too few
    ranks; each world tried is a whole plan, seconds)."""
    from dataclasses import replace as dc_replace

    from lightning_par.parallel.recompute import RECOMPUTE_KINDS
    from lightning_par.parallel.stage_plan import SCHEDULES
    from lightning_par.planner import Planner, Workload, inspect_model, load_hardware
    from lightning_par.planner.trace import PRECISIONS

    planner_precision = _PLANNER_PRECISION.get(precision)
    if planner_precision not in PRECISIONS:
        raise LayoutError(f"strategy='planned': the planner has no byte counts for precision={precision!r}; use "
                          f"one of {[k for k, v in _PLANNER_PRECISION.items() if v in PRECISIONS]}.")
    if precision == "bf16-mixed-master":
        zero_stages = [z for z in zero_stages if z > 0]
    hw = dc_replace(load_hardware(hardware), memory_gib=budget.memory_gib, reserved_gib=0.0)
    info = inspect_model(model, block_types)
    estimates = []
    for pp in (d for d in range(1, budget.world + 1) if budget.world % d == 0):
        m = 1 if pp == 1 else _micro_batches(batch, pp)
        if m is None:
            continue
        for tp in (d for d in range(1, budget.world // pp + 1) if (budget.world // pp) % d == 0):
            dp = budget.world // (pp * tp)
            if tp > budget.local:
                continue
            work = Workload(micro_batch=batch // m, seq_len=seq_len, global_batch=batch * dp * accumulate)
            planner = Planner(info, hw, work, optimizer, max_tp=budget.local)
            found, _ = planner.plan(budget.world, zero_stages=zero_stages,
                                    schedules=list(schedules or SCHEDULES), recompute=list(recompute or
                                                                                          RECOMPUTE_KINDS),
                                    precisions=[planner_precision], sizes=[(dp, tp, pp)])
            estimates += found
    if not estimates:
        raise LayoutError(f"strategy='planned': no layout of {budget.world} ranks to plan for this model and batch "
                          f"({batch} sequences per replica).")
    # the same order on every rank: fastest first, the label breaks ties
    usable = sorted((e for e in estimates if e.fits and e.runs_today),
                    key=lambda e: (-e.tokens_per_s, e.candidate.label()))
    if not usable:
        runnable = [e for e in estimates if e.runs_today] or estimates
        least = min(runnable, key=lambda e: e.worst.total)
        bigger = _smallest_world_that_fits(model, budget, batch, seq_len, precision, accumulate, hardware, optimizer,
                                           zero_stages, schedules, recompute, block_types) if search else None
        more = (f"The smallest world that fits: {bigger[0]} ranks ({bigger[1]}); use as many, " if bigger else
                "Use more ranks, ")
        raise LayoutError(
            f"strategy='planned': no layout of this model fits {_gib(budget.memory_gib * 2**30)} per rank on "
            f"{budget.world} ranks: the smallest, {least.candidate.label()}, needs "
            f"{_gib(least.worst.total)} per rank (predicted). {more}a smaller batch or "
            "sequence, or set the memory with --trainer.strategy.gpu_memory=GIB.")
    return Choice(usable[0], usable[1] if len(usable) > 1 else None, len(estimates))


def _smallest_world_that_fits(model: torch.nn.Module, budget: Budget, *args: Any) -> tuple[int, str] | None:
    """The smallest of one node (``budget.local`` ranks) more, 2, 4 and 8 times ``budget.world`` where a layout of
    ``model`` fits the same memory per rank: ``(world, layout)``, or ``None`` (each try is a whole plan: seconds)."""
    worlds = sorted({budget.world + max(budget.local, 1)} | {budget.world * 2**k for k in range(1, 4)})
    for world in worlds:
        try:
            choice = plan_layouts(model, replace(budget, world=world), *args, search=False)
        except LayoutError:
            continue
        return world, choice.best.candidate.label()
    return None


def device_memory_gib(device: torch.device, local: int) -> float:
    """Memory for one rank: CUDA: free memory of this device; CPU: the machine's memory / ``local`` ranks."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / 2**30
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30 / max(local, 1)


def default_hardware(device: torch.device) -> str:
    """The planner's preset for this rank's device: ``cpu`` on a CPU; on CUDA the preset for the device's name
    (:func:`lightning_par.planner.hardware.detect_gpu`), the nearest one with a warning that says what it gets wrong,
    and ``h100-sxm`` with a warning for a GPU the table does not hold."""
    if device.type != "cuda":
        return "cpu"
    from lightning_par.planner.hardware import detect_gpu

    name = torch.cuda.get_device_name(device)
    spec = detect_gpu(name)
    how = "give the hardware with --trainer.strategy.hardware=PRESET_OR_FILE (PlannedStrategy(hardware=...))"
    if spec is None:
        rank_zero_warn(f"strategy='planned': no hardware preset describes {name}; planning with h100-sxm's speeds. "
                       f"The chosen layout may not be the fastest here: {how}.")
        return "h100-sxm"
    if spec.preset_note:
        rank_zero_warn(f"strategy='planned': {name} ({spec.name}) is planned with the nearest preset, "
                       f"{spec.preset}: {spec.preset_note}. To plan with its own figures, {how}.")
    return spec.preset


class PlannedStrategy(LayoutStrategy):
    """The layout the planner predicts fastest among those that fit, chosen at launch (see the module docstring).

    Args:
        gpu_memory: memory per rank in GiB to plan for (default: measured at launch).
        hardware: the planner's hardware preset or file for compute and link speeds (default: ``cpu`` on CPU, on
            CUDA the preset for the detected GPU, see :func:`default_hardware`).
        zero_stages: the ZeRO stages to consider.
        schedules: the pipeline schedules to consider (default: all).
        recompute: the activation recompute kinds to consider (default: all).
        optimizer: what the planner counts states for (``adamw``, ``sgd``, ``sgd_momentum``; default: AdamW).
        seq_len: the sequence length to plan for (default: the datamodule's ``seq_len``, else the model's longest).

    The other options are :class:`~lightning_par.strategies.engine.LayoutStrategy`'s; ``async_save`` needs a chosen
    layout that saves sharded checkpoints (one that does not is an error at launch).

    Example::

        Trainer(accelerator="cpu", devices=4, strategy="planned")
        # lightning-par fit ... --trainer.strategy=planned --trainer.strategy.gpu_memory=40
    """

    strategy_name = "planned"

    @engine_options("block_types", "offload_optimizer", "bucket_cap_mb", "process_group_backend", "timeout",
                    "heartbeat_timeout", "async_save", "nonfinite", "nonfinite_patience", "checkpoint_io",
                    "accelerator", "parallel_devices", "cluster_environment", "precision_plugin")
    def __init__(self, gpu_memory: float | None = None, hardware: str | None = None,
                 zero_stages: Sequence[int] = (0, 1, 2, 3), schedules: Sequence[str] | None = None,
                 recompute: Sequence[str] | None = None, optimizer: str | None = None, seq_len: int | None = None,
                 **options: Any) -> None:
        if gpu_memory is not None and not (isinstance(gpu_memory, (int, float)) and 0 < gpu_memory < math.inf):
            raise LayoutError(f"gpu_memory={gpu_memory!r}: give the memory per rank in GiB, a positive number.")
        # the placeholder layout (dp = world) until the plan replaces it at launch; a sharded async save is checked
        # against the chosen layout then
        super().__init__(zero_stage=1 if options["async_save"] else 0, **options)
        self.plan_options = dict(gpu_memory=gpu_memory, hardware=hardware, zero_stages=tuple(zero_stages),
                                 schedules=schedules, recompute=recompute, optimizer=optimizer, seq_len=seq_len)
        self.choice: Choice | None = None

    # the precision is checked against the chosen layout, once there is one
    @LayoutStrategy.precision_plugin.setter  # type: ignore[attr-defined]
    def precision_plugin(self, plugin: Any) -> None:
        self._precision_plugin = LayoutPrecision.adopt(plugin)
        self._check_precision_device()

    def _choose_layout(self) -> None:
        opts = self.plan_options
        memory = opts["gpu_memory"]
        if memory is None:
            mine = torch.tensor([device_memory_gib(self.root_device, self.num_processes)], dtype=torch.float64,
                                device=self.root_device)  # (NCCL reduces device tensors only)
            dist.all_reduce(mine, op=dist.ReduceOp.MIN)  # the tightest rank decides
            memory = float(mine.item())
        result: list[Any] = [None]
        if self.global_rank == 0:
            try:
                result[0] = self._plan(Budget(self.world_size, self.num_processes, memory))
            except LayoutError as err:
                result[0] = str(err)
        dist.broadcast_object_list(result, src=0)
        if isinstance(result[0], str):
            raise LayoutError(result[0])
        self.choice = choice = result[0]
        c = choice.best.candidate
        self.layout = replace(c.layout(), block_types=self.layout.block_types, bucket_cap_mb=self.layout.bucket_cap_mb,
                              offload_optimizer=self.layout.offload_optimizer,
                              offload_parameters=self.layout.offload_parameters)
        self.precision_plugin.check_layout(self.layout.zero_stage, self.layout.tp, self.layout.pp)
        if self.checkpoints.async_save and not self.checkpoints.sharded:
            raise LayoutError(f"async_save=True writes sharded checkpoints; the planned layout {c.label()} saves one "
                              "file. Leave async_save off with strategy='planned'.")
        self._dims = None
        rank_zero_info(f"planned layout ({choice.considered} estimated, {_gib(memory * 2**30)} per rank): "
                       + choice.describe(choice.best, "chosen"))
        rank_zero_info("planned layout: " + (choice.describe(choice.runner_up, "runner-up") if choice.runner_up
                                             else "runner-up: none (one layout fits)"))
        self._log_choice(memory)

    def _plan(self, budget: Budget) -> Choice:
        from lightning_par.planner import build_model
        from lightning_par.planner.model import inspect_model

        module = self.lightning_module
        trainer = module.trainer
        # the init arguments save_hyperparameters() kept (LightningCLI adds its own "_class_path" and the like)
        hparams = {k: v for k, v in dict(getattr(module, "hparams", {}) or {}).items() if not k.startswith("_")}
        try:
            meta = build_model(type(module), hparams)
        except (TypeError, LayoutError) as err:
            raise LayoutError(f"strategy='planned' rebuilds {type(module).__name__} on the meta device from its "
                              f"saved hyperparameters and could not ({err}); call self.save_hyperparameters() in "
                              "its __init__.") from err
        data = getattr(trainer, "datamodule", None)
        batch = getattr(data, "batch_size", None)
        if not isinstance(batch, int) or batch < 1:
            raise LayoutError("strategy='planned' plans for the datamodule's batch_size (sequences per replica); "
                              "this run has no datamodule with an integer batch_size.")
        opts = self.plan_options
        seq = opts["seq_len"] or getattr(data, "seq_len", None) or inspect_model(meta).default_seq_len
        hardware = opts["hardware"] or default_hardware(self.root_device)
        return plan_layouts(meta, budget, batch, int(seq), self.precision_plugin.precision,
                            accumulate=int(trainer.accumulate_grad_batches or 1), hardware=hardware,
                            optimizer=opts["optimizer"], zero_stages=opts["zero_stages"],
                            schedules=opts["schedules"], recompute=opts["recompute"],
                            block_types=list(self.layout.block_types) if self.layout.block_types else None,
                            search=True)

    def _log_choice(self, memory: float) -> None:
        assert self.choice is not None
        trainer = self.lightning_module.trainer
        best = self.choice.best
        params = {"planned/layout": best.candidate.label(), "planned/memory_budget_gib": round(memory, 3),
                  "planned/predicted_gib": round(best.worst.total / 2**30, 4),
                  "planned/predicted_step_s": best.step_time}
        if self.choice.runner_up is not None:
            params["planned/runner_up"] = self.choice.runner_up.candidate.label()
        text = "  \n".join(self.choice.describe(e, role) for e, role in
                           ((best, "chosen"), (self.choice.runner_up, "runner-up")) if e is not None)
        for logger in trainer.loggers if self.global_rank == 0 else []:
            logger.log_hyperparams(params)
            add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
            if callable(add_text):
                add_text("planned_layout", text)

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls,
                                   description="lightning-par PlannedStrategy: the planner's fastest layout that fits")
