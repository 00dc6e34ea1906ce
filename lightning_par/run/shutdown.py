"""A run that completed exits 0: the process group is destroyed before the interpreter finalizes.

Lightning never destroys the process group (a script may use it after ``trainer.fit``, or fit again), so without
this it lives until the interpreter shuts down. There, a thread of ours or of torch's that is inside C++ when the
interpreter finalizes -- a gloo worker that drops the last reference to a collective's tensors (their Python objects
need the GIL), a daemon thread returning from a c10d store call -- is ended by CPython with a forced unwind, and the C++
runtime aborts the process: "terminate called without an active exception", exit code 134, after a run that
finished. (Reproduced with a daemon thread in a store call at exit; the gloo case is torch's own account in
pytorch/pytorch#179291.)

So the engine registers :func:`close_at_exit` when it creates the process group. At exit -- after the heartbeat was
stopped and the last asynchronous save committed (the strategy's teardown), while the interpreter is still whole --
every rank that finished without an exception joins the threads of ours that outlived their deadline, waits at a
barrier (bounded: a rank still busy elsewhere does not hold this one), and destroys the process group: gloo's workers
finish their queue and are joined, and rank 0's store is closed. A rank that raised skips this: its peers may be
anywhere, and it exits non-zero anyway.

From the start of that handler on, such a rank ignores SIGTERM: its run ended by agreement (completed, or preempted
with its checkpoint saved), so a SIGTERM has nothing left to stop and would only replace the exit code the run chose
(0, or 75 after a preemption) by a signal's. torchrun sends one to every worker still running as soon as one worker
exits non-zero -- after a preemption, to the ranks still finalizing a fraction of a second behind the first; they
then reported -15, not 75 (seen in benchmarks/preemption_moments.py). The barrier makes this hold: no rank leaves it
before every rank has entered the handler.
"""

from __future__ import annotations

import atexit
import gc
import logging
import signal
import subprocess
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger(__name__)

#: how long rank 0 of Lightning's launcher waits, after an error at setup, for the ranks it started to end
LAUNCHED_TIMEOUT = 30.0
#: how long a finished rank waits at exit for the others before it leaves without destroying the group
BARRIER_TIMEOUT = timedelta(seconds=60)
#: how long exit waits for a thread of ours still inside a store call (one whose store host froze never returns)
STRAGGLER_TIMEOUT = 5.0

_registered = False
_failed = False
_stragglers: list[threading.Thread] = []
_launchers: list = []  # Lightning's subprocess launchers of this process (rank 0): the ranks they started


def close_at_exit() -> None:
    """Destroy the default process group when the interpreter exits (once per process; see the module doc)."""
    global _registered
    if not _registered:
        atexit.register(_close)
        _registered = True


def mark_failed() -> None:
    """This rank's run raised: at exit, leave the process group as it is (no barrier with peers that may be
    anywhere)."""
    global _failed
    _failed = True


def launched_ranks(launcher) -> None:
    """``launcher`` (Lightning's subprocess launcher, on rank 0) starts the other ranks of this machine as children
    of this process: :func:`wait_for_launched_ranks` waits for them."""
    _launchers.append(launcher)


def wait_for_launched_ranks() -> None:
    """After an error every rank raises at setup (an agreed one: each prints the same line): wait, bounded, for the
    ranks this process launched to print theirs and exit, so that the error is the last line of the run's output,
    printed before the shell's prompt comes back -- rank 0 is the process the shell waits for. Lightning's
    child-process observer is stopped first: it would kill this process when it sees a child exit with the error."""
    procs = [proc for launcher in _launchers for proc in getattr(launcher, "procs", ())]
    if not procs:
        return
    from lightning_par._compat import quiet_child_process_observer

    quiet_child_process_observer()
    deadline = time.monotonic() + LAUNCHED_TIMEOUT
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:  # a rank elsewhere (it did not raise the same error): do not hold the exit
            pass


def straggler(thread: threading.Thread) -> None:
    """A daemon thread of ours that outlived its deadline inside a c10d call: exit waits for it (bounded)."""
    _stragglers.append(thread)


def _close() -> None:
    if not _failed and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the run's exit code stands (see the module doc)
    for thread in _stragglers:
        thread.join(STRAGGLER_TIMEOUT)
    if _failed or not dist.is_initialized():
        return
    gc.collect()  # DDP / FSDP objects in reference cycles still hold the group and their last collectives' tensors
    try:
        dist.barrier(async_op=True).wait(timeout=BARRIER_TIMEOUT)
    except Exception as err:  # noqa: BLE001 -- a peer failed or is elsewhere: destroying now would wait on it
        log.warning("lightning-par: not every rank reached the end of the run within %s (%s); leaving the process "
                    "group as it is.", BARRIER_TIMEOUT, err)
        return
    dist.destroy_process_group()
