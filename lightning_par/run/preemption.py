"""Preemption: SIGTERM ends the run at the next optimizer step, on every rank at once, with a complete checkpoint and
an exit code that makes the launcher start the next attempt.

SLURM and cloud schedulers send SIGTERM before they take a node back. Lightning's own handler broadcasts over the
process group from inside the signal handler; a peer that is then blocked in another collective (a checkpoint
barrier, a ZeRO reduce) never matches it, and both ranks wait there until gloo's timeout (30 minutes) or the
scheduler's SIGKILL -- while both keep beating, so the heartbeat cannot help. So the strategies replace it:

- the handler records the signal and nothing else (no collective, no I/O);
- after each optimizer step (the end of a batch that stepped: never inside gradient accumulation), every rank
  all-reduces its flag over the process group, on its CPU backend where it has one (gloo: no device sync on a GPU);
  all ranks therefore stop after the same step, whichever of them got the signal;
- then the run saves a complete checkpoint of that step through the strategy (sharded, async or not: the async save
  commits before the process ends), prints one line naming it, and, once Lightning has logged the step, raises
  :class:`Preempted`, a ``SystemExit`` with
  code :data:`EXIT_CODE` (75, ``EX_TEMPFAIL``): never 0, so ``torchrun --max-restarts`` restarts the job and the next
  attempt resumes from the newest complete checkpoint (lightning_par/cli.py); SLURM requeues a preempted job itself
  (``--requeue``).

A rank that never reaches the step boundary (frozen, or killed) is named by the heartbeat within its bound. The
checkpoint a preemption saved is removed once the resumed run has saved a newer one.

The same per-step flag carries the step's non-finite bits (:mod:`lightning_par.run.bad_steps`): one collective
per optimizer step serves both.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_par.run.bad_steps import GRAD, LOSS, NonFiniteFlags, NonFiniteStop, describe, stop_message

log = logging.getLogger(__name__)

#: the exit code of a preempted rank (BSD ``EX_TEMPFAIL``: try again); the heartbeat's peers use the same
EXIT_CODE = 75
#: the signals that preempt a run
SIGNALS = (signal.SIGTERM,)
#: the name of a checkpoint saved at a preemption
PREFIX = "preempted"
#: the sentinel a torchrun worker keeps in its process group (it ends with its rank; see GroupSignal)
SENTINEL = "import os, time\nwhile os.getppid() == {}: time.sleep(1)"


class GroupSignal:
    """Whether a SIGTERM reached this rank's whole process group, as torchrun's agent sends it when it is stopped
    itself (it ``killpg``s each worker's own group on its way down, and then restarts nothing), or only this process,
    as a scheduler or a user signals a rank (the agent then restarts the job on exit code 75).

    Python gives a handler no sender, so a rank under torchrun (its own group leader: torchrun starts each worker in
    a new session) keeps a sentinel process in its group: a signal to the group ends it too."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        if self._proc is not None or "TORCHELASTIC_RUN_ID" not in os.environ or os.getpgrp() != os.getpid():
            return
        try:
            self._proc = subprocess.Popen([sys.executable, "-S", "-c", SENTINEL.format(os.getpid())],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL)
        except OSError:  # no sentinel: the line then says what a restart needs (see restart_outlook)
            self._proc = None

    def reached_group(self, wait: float = 0.5) -> bool | None:
        """True: the SIGTERM reached the whole group; False: this process only; None: unknown (no sentinel)."""
        if self._proc is None:
            return None
        try:  # (one kill signals the whole group; the sentinel may just not have run yet)
            return self._proc.wait(wait) == -signal.SIGTERM
        except subprocess.TimeoutExpired:
            return False

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None


def restart_outlook(path: Path, group_signal: bool | None) -> str:
    """What follows a preemption's exit code 75, as far as this rank can know: a restart by torchrun (an agent that
    is not going down itself and has restarts left) or SLURM's requeue, or none -- then how to resume by hand."""
    by_hand = f"start the job again with --ckpt_path={path} to resume from it"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        count, most = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"), os.environ.get("TORCHELASTIC_MAX_RESTARTS")
        if group_signal:
            return ("but the SIGTERM reached torchrun's agent as well (it sent it to the ranks' process groups): the "
                    f"agent is going down and restarts nothing, so {by_hand}")
        if most is not None and count.isdigit() and most.isdigit() and int(count) >= int(most):
            return (f"but torchrun has no restart left (restart {count} of --max-restarts={most}), so nothing "
                    f"restarts the job: {by_hand}")
        if group_signal is None:
            return (f"so torchrun --max-restarts starts the next attempt, which resumes from it, unless torchrun's "
                    f"agent was stopped as well: then {by_hand}")
        return "so torchrun --max-restarts starts the next attempt, which resumes from it"
    if "SLURM_JOB_ID" in os.environ:
        return f"so a SLURM requeue starts the next attempt, which resumes from it (without --requeue: {by_hand})"
    return f"nothing restarts this launch: {by_hand}"


class Preempted(SystemExit):
    """The run stopped at a preemption after saving ``path`` (exit code :data:`EXIT_CODE`)."""

    def __init__(self, message: str, path: Path | None) -> None:
        super().__init__(EXIT_CODE)
        self.message, self.path = message, path


class PreemptionCheckpoint(Callback):
    """Installs the flag-only handler when training starts and acts on an agreed signal at the end of each batch
    that stepped (see the module docstring). The strategies add it to every ``fit``."""

    def __init__(self) -> None:
        self.received: tuple[int, float] | None = None  # (signal, time) on this rank
        self._previous: dict[int, Any] = {}
        self._checked_step = -1
        self._stale: list[Path] = []  # checkpoints of earlier preemptions, removed after a newer save commits
        self._newest_at_start = ""
        self._pending: Preempted | None = None
        self._agreed_before_step: tuple[int, int, int, int, int] | None = None  # nonfinite="skip" (see agree_now)
        self._group = GroupSignal()

    # -- the handler ----------------------------------------------------------------------------------------------
    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is None:
            self.received = (signum, time.time())

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # after Lightning registered its handlers (in Trainer._run, before the loops start); only the main thread
        # may install one
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handler)
        self._group.start()
        directory = _checkpoint_dir(trainer)
        if directory is not None and directory.is_dir():
            self._stale = sorted(directory.glob(f"{PREFIX}-*.ckpt"))
        self._newest_at_start = _newest_saved(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._restore()
        self._stop()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if exception is self._pending:
            # preempted: the flag-only handler stays through the teardown, where an async save still commits; a
            # second SIGTERM there (the scheduler again, torchrun closing the ranks) must not run Lightning's, which
            # broadcasts inside the handler. Lightning's own teardown then puts back what was there before the fit.
            self._previous.clear()
            return
        self._restore()

    def _restore(self) -> None:
        self._group.stop()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    # -- the step boundary ------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        flags = _flags(trainer)
        step = trainer.global_step
        if step == self._checked_step:  # inside gradient accumulation: no optimizer step yet
            if flags is not None:  # (the micro-batch that steps is checked in the strategy's optimizer_step)
                flags.add_loss(outputs.get("loss") if isinstance(outputs, dict) else outputs)
            return
        self._checked_step = step
        newest = _newest_saved(trainer)
        if self._stale and newest != self._newest_at_start and Path(newest).exists():
            for path in self._stale:  # a newer checkpoint exists: the preemption's is no longer the last good one
                trainer.strategy.remove_checkpoint(path)
            self._stale = []
        agreed, self._agreed_before_step = self._agreed_before_step, None
        if agreed is None:
            agreed = self._agree(trainer, *(flags.local_lagged() if flags is not None else (0, 0)))
        who, signum, loss_rank, grad, lag, group = agreed
        if flags is not None:
            self._check_nonfinite(trainer, flags, step - lag - 1, loss_rank, grad)  # the step as logged
        if signum == 0 or 0 <= trainer.max_steps <= step:
            return  # no signal; or the run ends here anyway, with its own last checkpoint and exit 0
        directory = _checkpoint_dir(trainer) or Path(trainer.default_root_dir) / "checkpoints"
        path = directory / f"{PREFIX}-epoch={trainer.current_epoch}-step={step}.ckpt"
        trainer.save_checkpoint(path)
        outlook = restart_outlook(path, None if group < 0 else bool(group))
        message = (f"lightning-par: {signal.Signals(signum).name} (received by rank {who}): stopped after step {step} "
                   f"on every rank; saved {path}; exit code {EXIT_CODE}, {outlook}")
        if trainer.is_global_zero:
            print(message, flush=True)
        # raised at the next hook, not here: Lightning logs this step's metrics right after this hook
        self._pending = Preempted(message, path)

    def _check_nonfinite(self, trainer: Trainer, flags: NonFiniteFlags, step: int, loss_rank: int,
                         grad: int) -> None:
        """Count agreed bad steps in a row; stop every rank once there are ``patience`` of them."""
        if not (loss_rank or grad):
            flags.consecutive = 0
            return
        flags.consecutive += 1
        if flags.consecutive < flags.patience:
            return
        message = stop_message(step, describe(loss_rank, bool(grad)), flags,
                               getattr(trainer.strategy, "last_finite_checkpoint", None))
        if trainer.is_global_zero:
            print(message, flush=True)
        raise NonFiniteStop(message)

    def agree_now(self, trainer: Trainer) -> tuple[int, int]:
        """Under ``nonfinite="skip"``: the step's flag, agreed after backward and before the optimizer step (a host
        sync on a GPU) and kept for this step's end; returns ``(loss_rank, grad)``."""
        flags = _flags(trainer)
        self._agreed_before_step = self._agree(trainer, flags.local_now() if flags is not None else 0, 0)
        return self._agreed_before_step[2], self._agreed_before_step[3]

    def _stop(self, *args: Any) -> None:
        """The next hook after the save (the next batch, a validation due, the epoch's or the fit's end)."""
        if self._pending is not None:
            raise self._pending

    on_train_batch_start = on_validation_start = on_train_epoch_end = _stop

    def _agree(self, trainer: Trainer, bits: int, lag: int) -> tuple[int, int, int, int, int, int]:
        """``(rank, signal, loss_rank, grad, lag, group)`` agreed by every rank: the highest rank that received a
        signal and the signal (``(-1, 0)`` if none did); ``rank + 1`` of the highest rank whose loss was not finite
        (0 if none); 1 if a gradient norm was not finite; ``lag``, the steps the non-finite bits are late by;
        ``group``: 1 if a rank's signal reached its whole process group (its torchrun agent is going down), 0 if
        not, -1 if no rank could tell. One all-reduce (MAX) of five int64: ``(rank + 1) * 256 + signal`` or 0, the
        two non-finite fields, the lag and the group field."""
        group = -1
        if self.received is not None:  # (only a signalled rank looks: nothing to wait for otherwise)
            reached = self._group.reached_group()
            group = -1 if reached is None else int(reached)
        mine = [(trainer.global_rank + 1) * 256 + self.received[0] if self.received is not None else 0,
                trainer.global_rank + 1 if bits & LOSS else 0, 1 if bits & GRAD else 0, lag, group]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            flag = torch.tensor(mine, dtype=torch.int64, device=_flag_device(trainer))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = [int(v) for v in flag.tolist()]
        code, loss_rank, grad, lag, group = mine
        return code // 256 - 1, code % 256, loss_rank, grad, lag, group


def _flags(trainer: Trainer) -> NonFiniteFlags | None:
    return getattr(trainer.strategy, "nonfinite_flags", None)


def _flag_device(trainer: Trainer) -> torch.device:
    """The CPU where the process group has a CPU backend (gloo; ``cpu:gloo,cuda:nccl`` on CUDA): the flag then
    never touches the GPU stream; else the strategy's device."""
    backend = str(dist.get_backend())
    return torch.device("cpu") if "gloo" in backend else trainer.strategy.root_device


def _checkpoint_dir(trainer: Trainer) -> Path | None:
    callback = trainer.checkpoint_callback
    dirpath = getattr(callback, "dirpath", None)
    return Path(dirpath) if dirpath else None


def _newest_saved(trainer: Trainer) -> str:
    """The newest checkpoint the run's ModelCheckpoint saved (restored with its state on a resume), or ``""``."""
    callback = trainer.checkpoint_callback
    newest = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "") or ""
    return os.path.realpath(newest) if newest else ""  # last.ckpt is a link: what it names changes
