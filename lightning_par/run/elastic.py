"""An attempt that resumes on another world size goes on as the same run (docs/elastic.md).

A checkpoint's data position (:mod:`~lightning_par.run.data_position`) records the loader-global batch (per-rank
batch x data-parallel size), the gradient accumulation and the world size it was saved with. When the resumed loader
draws another loader-global batch -- the world grew or shrank and ``dp="auto"`` (or the planner) absorbed it -- the
optimizer-step global batch (loader-global batch x accumulation) is kept: the accumulation is recomputed, Lightning's
loader-batch counters are rewritten from the samples consumed, and optimizer steps, the LR schedule and the logging
step axis (all counted in optimizer steps) continue. A global batch that no accumulation reaches is refused, naming
the nearest ones. Each resumed attempt prints one line and writes a TensorBoard text entry (:func:`report_attempt`),
with the steps lost since the checkpoint (what :class:`AttemptProgress` recorded).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


def step_batch_problem(step_batch: int, loader_global: int, per_rank: int, dp: int) -> str:
    """What to say when ``step_batch`` samples per optimizer step are not a whole number of loader batches."""
    below = (step_batch // loader_global) * loader_global
    nearest = sorted({n for n in (below, below + loader_global) if n > 0})
    offers = " or ".join(f"{n} (accumulate_grad_batches={n // loader_global})" for n in nearest)
    per_rank_ok = [b for b in range(1, step_batch // dp + 1) if step_batch % (b * dp) == 0]
    batches = ", ".join(map(str, per_rank_ok)) or "(none: change the ranks)"
    return (f"the checkpoint trained with {step_batch} samples per optimizer step; this run draws {loader_global} per "
            f"loader batch (per-rank batch {per_rank} x data-parallel size {dp}), and no accumulation reaches "
            f"{step_batch}: the nearest global batches are {offers}, which would change what the run computes. To "
            f"keep {step_batch}, give a per-rank batch of {batches} (data.batch_size; the accumulation then follows).")


def layouts_for(world: int, tp: int, pp: int, cp: int = 1) -> str:
    """For a layout whose ``tp x pp x cp`` does not divide ``world`` (an attempt with fewer ranks than it needs): the
    layouts of ``world`` ranks that split the model no finer (tp and pp dividing the given ones), largest first, and
    the planner's choice. One sentence."""
    fits = sorted(((t, p) for t in range(1, tp + 1) if tp % t == 0 for p in range(1, pp + 1)
                   if pp % p == 0 and world % (t * p * cp) == 0), key=lambda tp_pp: -tp_pp[0] * tp_pp[1])
    named = ", ".join(f"tp={t} x pp={p}{f' x cp={cp}' if cp > 1 else ''} (dp={world // (t * p * cp)})"
                      for t, p in fits[:4])
    return (f"On {world} ranks: {named or 'none of its splits'}; or --trainer.strategy=planned, the planner's "
            "fastest layout that fits these ranks (docs/elastic.md).")


def keep_step_batch(trainer: Any, state: dict[str, Any], loader_global: int, per_rank: int, dp: int) -> int | None:
    """Set ``trainer.accumulate_grad_batches`` so that an optimizer step takes the checkpoint's global batch with
    this run's ``loader_global``; returns the accumulation (``None`` if the checkpoint did not record its own: an
    older one, whose step batch is unknown). Raises ``ValueError`` when no accumulation reaches it."""
    if "accumulate_grad_batches" not in state:
        return None
    step_batch = int(state["global_batch"]) * int(state["accumulate_grad_batches"])
    if step_batch % loader_global:
        raise ValueError("lightning-par cannot resume as the same run: "
                         + step_batch_problem(step_batch, loader_global, per_rank, dp))
    accumulate = step_batch // loader_global
    if accumulate != trainer.accumulate_grad_batches:
        rank_zero_info(f"lightning-par: the checkpoint's global batch is {step_batch} samples per optimizer step "
                       f"({state['global_batch']} x accumulate_grad_batches={state['accumulate_grad_batches']}); with "
                       f"{loader_global} per loader batch here, accumulate_grad_batches={accumulate} keeps it "
                       f"(the Trainer was given {trainer.accumulate_grad_batches}).")
        trainer.accumulate_grad_batches = accumulate
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is not None:  # the pipeline scales each micro-batch loss by 1 / (micro-batches x accumulation)
            pipeline.loss_scale = 1.0 / (pipeline.plan.n_microbatches * accumulate)
    return accumulate


def rewrite_batch_counters(trainer: Any, consumed: int, old_global: int, new_global: int) -> None:
    """Lightning counts the resumed epoch in loader batches: ``consumed`` samples were ``consumed / old_global`` of
    the checkpoint's batches and are ``consumed / new_global`` of this run's. Every count of the epoch loop's batch
    progress moves by the difference (the current epoch's and the total), keeping how they stand to each other (a
    checkpoint saved from ``on_train_batch_end`` has one batch processed and not yet completed)."""
    if consumed % new_global:
        raise ValueError(f"lightning-par cannot resume as the same run: the checkpoint was saved {consumed} samples "
                         f"into its epoch, not a whole number of this run's loader batches of {new_global}; resume "
                         "from a checkpoint saved after an optimizer step or at an epoch's end.")
    delta = consumed // new_global - consumed // old_global
    progress = trainer.fit_loop.epoch_loop.batch_progress
    for counts in (progress.current, progress.total):
        for field in ("ready", "started", "processed", "completed"):
            setattr(counts, field, getattr(counts, field) + delta)


#: torchrun's ``--rdzv-id`` when none is given: the same for every job, so it names none
DEFAULT_RUN_ID = "none"

#: where rank 0 records the last optimizer step an attempt reached, in the run's log directory
PROGRESS_FILE = "lightning_par_progress.json"


def _run_dir(trainer: Any) -> Path | None:
    """The first logger's run directory (``None`` without a logger: nothing is written to the working directory)."""
    log_dir = getattr(trainer.logger, "log_dir", None)
    return Path(log_dir) if log_dir else None


class AttemptProgress(Callback):
    """Rank 0 writes the step just reached (and the time) after each optimizer step, a few bytes into the run's log
    directory, so the next attempt can say how many steps were lost; a kill cannot leave it half written in a way
    that is read (a torn file is ignored)."""

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        run_dir = _run_dir(trainer) if trainer.is_global_zero else None
        if run_dir is not None and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            path = run_dir / PROGRESS_FILE
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"step": trainer.global_step, "time": time.time(),
                                        "world_size": trainer.world_size,
                                        "torchelastic_run_id": os.environ.get("TORCHELASTIC_RUN_ID")}))


def reached_step(trainer: Any) -> tuple[int, float] | None:
    """``(step, time)``: the last optimizer step an earlier attempt of this run recorded (:class:`AttemptProgress`)
    and when, or ``None``."""
    run_dir = _run_dir(trainer)
    if run_dir is None:
        return None
    try:
        record = json.loads((run_dir / PROGRESS_FILE).read_text())
        return int(record["step"]), float(record["time"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def same_torchelastic_job(run_dir: Path) -> bool:
    """Whether ``run_dir``'s last recorded step was made by this torchrun job (the same ``TORCHELASTIC_RUN_ID``):
    torchrun restarts the workers when a node joins (a membership change) without counting a restart, so
    ``TORCHELASTIC_RESTART_COUNT`` stays 0 before any failure, and only this tells the attempt that it continues."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    try:
        recorded = json.loads((run_dir / PROGRESS_FILE).read_text()).get("torchelastic_run_id")
    except (OSError, ValueError, AttributeError):
        return False
    if run_id == DEFAULT_RUN_ID:  # every job's without --rdzv-id: not this job's identity
        if recorded == run_id:
            rank_zero_warn(f"lightning-par: this torchrun job has no run id of its own (--rdzv-id defaults to "
                           f"'{DEFAULT_RUN_ID}' for every job), nor had the run in {run_dir}: it starts its own run "
                           "rather than continue that one; give each job its own --rdzv-id so that an attempt after "
                           "a node joins continues its job's run (docs/elastic.md).")
        return False
    return bool(run_id) and recorded == run_id


def report_attempt(trainer: Any, state: dict[str, Any], accumulate: int | None) -> str:
    """One line (and a TensorBoard text entry, ``elastic/attempt``) for a resumed attempt: world size, layout, why
    this layout, the checkpoint resumed, the steps lost since it was saved. Returns the line (on every rank)."""
    strategy = trainer.strategy
    world, before = trainer.world_size, state.get("world_size")
    dims = getattr(strategy, "dims", None)
    layout = dims.describe() if dims is not None else type(strategy).__name__
    choice = getattr(strategy, "choice", None)
    if choice is not None:
        why = f"the planner's fastest layout that fits ({choice.best.candidate.label()})"
    elif before is not None and before != world and dims is not None:
        why = f"data-parallel size re-derived for {world} ranks (dp = world / (tp x pp x cp))"
    else:
        why = "the layout given"
    step = trainer.global_step
    reached = reached_step(trainer) if trainer.is_global_zero else None
    lost = "unknown (no earlier attempt recorded in this run's directory)" if reached is None else (
        f"{max(0, reached[0] - step)} (the last attempt reached step {reached[0]}, {time.time() - reached[1]:.0f} s "
        "ago)")
    acc = accumulate if accumulate is not None else trainer.accumulate_grad_batches
    line = (f"lightning-par: attempt on {world} ranks (the checkpoint's: {before if before is not None else 'unknown'})"
            f"; layout {layout}, accumulate_grad_batches={acc}: {why}; resumed {trainer.ckpt_path} at step {step}; "
            f"steps lost: {lost}")
    rank_zero_info(line)
    for logger in trainer.loggers if trainer.is_global_zero else []:
        add_text = getattr(getattr(logger, "experiment", None), "add_text", None)
        if callable(add_text):
            add_text("elastic/attempt", line, global_step=step)
    return line
