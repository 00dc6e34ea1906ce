"""Bad steps: a non-finite loss or gradient norm is caught on every rank at once, and never costs the last finite
checkpoint (docs/faults.md).

Each rank ORs two bits per optimizer step on its device, without a host sync: the loss of any of the step's
micro-batches is not finite (under a pipeline every stage holds the last stage's loss, which the runtime broadcasts;
a vocab-parallel loss may be a DTensor: its local value), and the 2-norm of the gradients this rank holds is not
finite (checked once, before the optimizer step; where Lightning clips by norm under ``stop``, the whole model's
norm that the clip computes is the check, not a second pass over the gradients). The bits travel in the per-step
flag that :class:`~lightning_par.run.preemption.PreemptionCheckpoint` already all-reduces (MAX) for SIGTERM:
one collective per step serves both, and every rank reaches the same verdict at the same step.

- ``nonfinite="stop"`` (the default): the optimizer has already applied the step when the ranks agree (no host sync
  before it); after ``nonfinite_patience`` consecutive bad steps (default 1: under ``stop`` a bad update has already
  reached the weights, which no later step repairs) every rank stops with one line naming the step, what was not
  finite and the last finite checkpoint. On a GPU the flag is copied to the host asynchronously and read one step
  later: the run stops one step after the bad one (the checkpoint guard below still checks that step's weights).
- ``nonfinite="skip"``: the ranks agree after backward and before the optimizer step (a host sync per step on a
  GPU), and a bad step's gradients are discarded on every rank -- the weights and optimizer state keep their values,
  the step still counts (``global_step`` and the learning-rate schedule advance) -- and ``train/skipped_steps`` is
  logged. After ``nonfinite_patience`` consecutive skipped steps (default 10) the run stops as above.

Under ``precision="16-mixed"`` the gradient scaler skips overflowing steps itself: only the loss is checked.

A checkpoint save first checks that the weights this rank holds are finite (and that this step's loss was), agreed by
one all-reduce per save; if not, the save is refused with a warning naming the step and a tensor, and no older
checkpoint is removed until a finite one is saved again (:class:`CheckpointGuard`). Weights that are not finite
although no step was (a NaN in a row no batch used, or written from outside a step) stop the run at that save.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

POLICIES = ("stop", "skip")
#: the default number of consecutive bad steps before a stop, per policy (see the module docstring for why)
DEFAULT_PATIENCE = {"stop": 1, "skip": 10}
#: the exit code of a run stopped at non-finite steps (a failure: a restart would meet the same step again)
EXIT_CODE = 1
LOSS, GRAD = 1, 2  # the local bits


class NonFiniteStop(SystemExit):
    """Every rank stopped at the same non-finite step; ``message`` was printed once (rank 0)."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_CODE)
        self.message = message


def check_policy(nonfinite: str, patience: int | None) -> int:
    """The patience for ``nonfinite`` (checked in the launching process); raises ValueError on a bad value."""
    if nonfinite not in POLICIES:
        raise ValueError(f"nonfinite={nonfinite!r} is not a policy for non-finite steps: use 'stop' (the default: "
                         "end the run naming the step) or 'skip' (discard the step's gradients).")
    if patience is None:
        return DEFAULT_PATIENCE[nonfinite]
    if patience < 1:
        raise ValueError(f"nonfinite_patience={patience}: the number of consecutive non-finite steps before the run "
                         "stops must be at least 1.")
    return patience


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def not_finite(tensors: list[Tensor]) -> Tensor | None:
    """A device bool: some element of ``tensors`` (local shards) is not finite; None when there are none.
    Computed as the 2-norm of them all (inf or NaN exactly when an element is, or when the norm overflows)."""
    local = [_local(t).detach() for t in tensors if t is not None and _local(t).numel()]
    if not local:
        return None
    return ~torch.isfinite(torch.nn.utils.get_total_norm(local, norm_type=2.0))


class NonFiniteFlags:
    """This rank's bits for the current optimizer step, on its device, and their host copy."""

    def __init__(self, policy: str = "stop", patience: int = 1) -> None:
        self.policy, self.patience = policy, patience
        self.check_grads = True  # off under 16-mixed (the scaler's business)
        self._bits: Tensor | None = None  # the step's bits so far, on the device
        self._in_flight: tuple[Tensor, Any] | None = None  # (pinned host copy, CUDA event) of the previous step
        self.consecutive = 0  # agreed bad steps in a row
        self.skipped = 0  # steps discarded under "skip"

    def add(self, bit: int, bad: Tensor | None) -> None:
        if bad is None:
            return
        value = bad.to(torch.int64) * bit
        self._bits = value if self._bits is None else torch.bitwise_or(self._bits, value)

    def add_loss(self, loss: Any) -> None:
        if isinstance(loss, Tensor) and loss.is_floating_point():
            self.add(LOSS, not_finite([loss]))

    def add_grads(self, grads: list[Tensor]) -> None:
        if self.check_grads:
            self.add(GRAD, not_finite(grads))

    def add_grad_norm(self, norm: Tensor) -> None:
        """The gradient bit from a norm computed already (the clip's global norm: no second pass)."""
        if self.check_grads:
            self.add(GRAD, ~torch.isfinite(norm))

    def local_now(self) -> int:
        """The step's bits on the host now (a device sync on a GPU), cleared."""
        bits, self._bits = self._bits, None
        return int(bits) if bits is not None else 0

    def local_lagged(self) -> tuple[int, int]:
        """``(bits, lag)`` to all-reduce at this step's end without stalling: on a CPU this step's (lag 0); on a GPU
        the previous step's (lag 1: its copy to pinned host memory, started a step ago, is complete by now) while
        this step's copy starts."""
        bits, self._bits = self._bits, None
        previous = self._take_in_flight()
        if bits is None or bits.device.type != "cuda":
            return previous | (int(bits) if bits is not None else 0), 1 if previous else 0
        host = torch.empty((), dtype=torch.int64, pin_memory=True)
        host.copy_(bits, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._in_flight = (host, event)
        return previous, 1

    def _take_in_flight(self) -> int:
        if self._in_flight is None:
            return 0
        host, event = self._in_flight
        self._in_flight = None
        event.synchronize()
        return int(host)

    def pending(self) -> bool:
        """Bits not yet agreed (a save then checks them itself)."""
        return self._bits is not None or self._in_flight is not None

    def peek(self) -> int:
        """The not yet agreed bits on the host (a sync: used at saves only), left in place."""
        out = int(self._bits) if self._bits is not None else 0
        if self._in_flight is not None:
            self._in_flight[1].synchronize()
            out |= int(self._in_flight[0])
        return out


def describe(loss_rank: int, grad: bool) -> str:
    """What was not finite, from the agreed flag."""
    parts = [f"the loss on rank {loss_rank - 1}"] if loss_rank else []
    return " and ".join(parts + (["the gradient norm"] if grad else []))


def stop_message(step: int, what: str, flags: NonFiniteFlags, last_finite: str | None) -> str:
    """``step``: the step as logged (``global_step`` before its update)."""
    kept = (f"the last finite checkpoint is {last_finite}" if last_finite
            else "no finite checkpoint was saved in this run")
    after = f"{flags.consecutive} such steps in a row" if flags.consecutive > 1 else "it"
    return (f"lightning-par: step {step} was not finite ({what}): every rank stopped after {after} "
            f"(nonfinite={flags.policy!r}, nonfinite_patience={flags.patience}); {kept}. Find the cause (learning "
            "rate, data, a weight), then resume from that checkpoint; --trainer.strategy.nonfinite=skip discards such "
            "steps instead")


def first_nonfinite_parameter(module: torch.nn.Module) -> str | None:
    """The name of the first parameter (this rank's part) with a non-finite element, or None."""
    for name, p in module.named_parameters():
        local = _local(p)
        if local.numel() and not bool(torch.isfinite(local).all()):
            return name
    return None


def _global_step(module: Any) -> int:
    try:
        return module.trainer.global_step
    except RuntimeError:  # a module saved outside a Trainer
        return 0


class CheckpointGuard:
    """Refuses a save whose weights (or whose step) are not finite, and the removal of older checkpoints until a
    finite one was saved again."""

    def __init__(self) -> None:
        self.refused: str | None = None  # the refused path, until a save succeeds
        self.last_finite: str | None = None

    def allow(self, strategy: Any, filepath: Any) -> bool:
        """One all-reduce (MAX) on every rank: ``[rank + 1 holding a non-finite weight, a non-finite step]``."""
        flags = strategy.nonfinite_flags
        params = list(strategy.lightning_module.parameters())
        bad = not_finite(params)  # one host sync per save, not one per parameter
        name = first_nonfinite_parameter(strategy.lightning_module) if bad is not None and bool(bad) else None
        mine = [strategy.global_rank + 1 if name else 0, flags.peek() if flags.pending() else 0]
        if dist.is_available() and dist.is_initialized() and strategy.world_size > 1:
            device = torch.device("cpu") if "gloo" in str(dist.get_backend()) else strategy.root_device
            flag = torch.tensor(mine, dtype=torch.int64, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            mine = [int(v) for v in flag.tolist()]
        weight_rank, step_bits = mine
        if not weight_rank and not step_bits:
            self.refused, self.last_finite = None, str(filepath)
            return True
        self.refused = str(filepath)
        step = _global_step(strategy.lightning_module)  # the weights after `step` updates (logged as step - 1)
        if weight_rank:
            why = (f"its weights are not finite ({name} on rank {weight_rank - 1})" if name
                   else f"its weights are not finite (on rank {weight_rank - 1})")
        else:
            parts = [word for bit, word in ((LOSS, "loss"), (GRAD, "gradient norm")) if step_bits & bit]
            why = f"the step's {' and '.join(parts)} {'were' if len(parts) > 1 else 'was'} not finite"
        speaks = strategy.global_rank == max(weight_rank - 1, 0)  # the rank that can name the tensor, once
        kept = self.last_finite or "none in this run yet"
        if weight_rank and not step_bits:
            # no step of this run was non-finite, yet a weight is (never used in a forward, or written from outside
            # a step): nothing can repair it, so every rank stops here instead of training on
            message = (f"lightning-par: the weights are not finite after step {step - 1} ({name or '?'} on rank "
                       f"{weight_rank - 1}), though no step's loss or gradient norm was: every rank stopped; refused "
                       f"to save {Path(str(filepath)).name}; the last finite checkpoint: {kept}")
            if speaks:
                print(message, file=sys.stderr, flush=True)
            raise NonFiniteStop(message)
        if speaks:
            print(f"lightning-par: warning: refused to save {Path(str(filepath)).name} after step {step - 1}: {why}; "
                  f"the last finite checkpoint: {kept}; no older checkpoint is removed until a finite one is saved",
                  file=sys.stderr, flush=True)
        return False
