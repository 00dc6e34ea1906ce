"""A rank that dies or freezes is named, and the others stop, within a bound.

A collective on a lost peer either fails (gloo: "connection closed by peer", usually at once, naming an address, not a
rank) or waits for the process group's timeout -- for a frozen rank (SIGSTOP, a hung host, a deadlocked loader) 30
minutes by default. A short process-group timeout would also cut collectives that are legitimately long (a large
checkpoint, the first step's compilation). Hand-written because torch has no liveness check between peers that is
independent of collectives: NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``)
watches this process's own NCCL work, and gloo has nothing.

Each rank runs two daemon threads. The *exchange* thread talks to the job's c10d store (its own client connection)
every ``interval`` seconds: it bumps this rank's counter and reads the others' (rank 0 reads every rank's, the others
rank 0's) and a shared verdict. The *watch* thread never touches the store -- a c10d store call has no deadline (its
``timeout`` covers waiting for a key, not a store whose host process froze: the call then blocks for good) -- and
judges by time alone: a counter that has not moved for ``timeout`` seconds names its rank, and a store that has not
answered an exchange for as long names rank 0, whose process hosts it. The rank that names one writes the verdict (so
every rank reports the same rank), prints it, and ends its own process at once with exit code 75 (a frozen collective
cannot be interrupted otherwise). Faster where it can be: the ranks tell each other their host and pid at start, so a
peer on the same host whose process is gone is named at the next exchange, and a rank whose collective fails (gloo:
"connection reset by peer") names the lost peer before it stops. A partial checkpoint never commits, so nothing
half-written loads. A rank that finishes marks itself done; one that fails marks itself failed, and the others name it
without waiting out the bound.

What a stranger on the network can do. torch's TCPStore has no authentication, and the one torch's rendezvous makes
listens on every interface of rank 0's host (it takes no bind address); the heartbeat's clients connect to the
rendezvous address (``MASTER_ADDR``). So every key of a run lives under a random token that rank 0 draws at start and
sends over the process group (never through the store): a writer without it cannot forge a beat, a failure or a
verdict -- what it writes under guessable names is never read. A verdict is printed only stripped of control
characters (no terminal escapes) and at most ``_MAX_TEXT`` characters long. Not guaranteed: the store and the process
group carry plain text, so whoever can read the traffic learns the token; anyone who can reach the port can flood the
store or disturb the rendezvous itself (before the token exists). Keep the rendezvous port on a private network or
behind a firewall.
"""

from __future__ import annotations

import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch.distributed as dist

from lightning_par.run import shutdown
from lightning_par.topology import LayoutError, is_number

EXIT_CODE = 75  # EX_TEMPFAIL: the job can be resumed from its last checkpoint
MIN_INTERVAL = 0.5  # seconds between beats at the least; a bound must span a few of them (a late beat is no death)
MIN_TIMEOUT = 3 * MIN_INTERVAL
_DONE, _FAILED = b"done", b"failed"
_MAX_TEXT = 500  # characters of a verdict printed


def check_timeout(value: object) -> float | None:
    """``heartbeat_timeout`` as the strategy takes it: seconds (a number >= ``MIN_TIMEOUT``), or ``None``/0 for no
    heartbeat; anything else raises :class:`LayoutError` in the launching process."""
    if value is None or (is_number(value) and value == 0):
        return None
    if not is_number(value, minimum=MIN_TIMEOUT):
        raise LayoutError(f"heartbeat_timeout={value!r} must be a number of seconds >= {MIN_TIMEOUT:g} (at least three "
                          f"beats of {MIN_INTERVAL:g} s or more: a shorter bound stops a healthy job), or None/0 to "
                          "turn the liveness check off.")
    return float(value)


def interval_for(timeout: float) -> float:
    """Seconds between beats for a bound: six beats per bound, between ``MIN_INTERVAL`` and 5 s."""
    return max(MIN_INTERVAL, min(5.0, timeout / 6))


class Heartbeat:
    """Liveness of every rank of a job through its c10d store at ``host:port``; ``start`` after the process group
    exists (every rank calls it: it is a collective), ``stop`` at teardown."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, timeout: float,
                 interval: float | None = None) -> None:
        self.rank, self.world_size, self.host, self.port = rank, world_size, host, port
        self.timeout = float(timeout)
        self.interval = interval if interval is not None else interval_for(self.timeout)
        self.prefix = ""  # lightning_par/heartbeat/<token>/, once started
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._store: dist.TCPStore | None = None
        # written by the exchange thread, judged by the watch thread
        self._answered = time.monotonic()  # when the store last answered a whole exchange
        self._seen: dict[int, tuple[bytes | None, float]] = {}  # rank -> (its counter, since when)
        self._names: dict[int, tuple[str, int]] = {}  # rank -> (host, pid), as the rank told at start
        self._ending = threading.Lock()

    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def _verdict_key(self) -> str:
        return f"{self.prefix}verdict"

    def start(self) -> None:
        token, names = _over_process_group()
        self.prefix, self._names = f"lightning_par/heartbeat/{token}/", dict(enumerate(names))
        self._store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.timeout))
        self._store.set(self._key(self.rank), b"0")
        watched = [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]
        self._answered = now = time.monotonic()
        self._seen = {r: (None, now) for r in watched}
        self._threads = [threading.Thread(target=target, name=f"lightning-par-heartbeat-{target.__name__[1:]}",
                                          daemon=True) for target in (self._exchange, self._watch)]
        for thread in self._threads:
            thread.start()

    def stop(self, failed: bool = False) -> None:
        """Stop beating; tell the others this rank finished (or failed: they stop at once, naming it)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=2 * self.interval)  # the exchange thread may be stuck in a store that froze
            if thread.is_alive():
                shutdown.straggler(thread)  # joined (bounded) at exit, before the interpreter finalizes
        if self._store is not None:
            _within(self.interval, self._store.set, self._key(self.rank), _FAILED if failed else _DONE)
            self._store = None  # this client closes with the last thread using it

    # -- the threads ---------------------------------------------------------------------------------------------
    def _exchange(self) -> None:
        """Every interval: beat, read the verdict and the watched counters. Any call may block for good (the store's
        host froze); the watch thread then stops the process."""
        assert self._store is not None
        store, beat, watched = self._store, 0, list(self._seen)
        while not self._stop.wait(self.interval):
            beat += 1
            try:
                store.set(self._key(self.rank), str(beat).encode())
                verdict = store.get(self._verdict_key()) if store.check([self._verdict_key()]) else None
                present = [r for r in watched if store.check([self._key(r)])]
                values = store.multi_get([self._key(r) for r in present]) if present else []
            except Exception as err:  # noqa: BLE001 -- the store's host closed it: rank 0 died (or finished)
                if self._stop.is_set() or self._seen.get(0, (None,))[0] == _DONE:
                    return
                self._store_host_lost(f"{type(err).__name__}: {_clean(str(err).splitlines()[0])}")
            self._answered = now = time.monotonic()
            if verdict is not None:
                self._stop_process(_clean(verdict.decode(errors="replace")), write=False)
            lost = self._local_peer_lost([r for r, v in zip(present, values, strict=True) if v not in (_DONE, _FAILED)])
            if lost:  # on this host a killed process is seen at once; elsewhere its beats stop (the bound)
                self._stop_process(lost)
            for r, value in zip(present, values, strict=True):
                if value == _FAILED:
                    self._stop_process(f"rank {r} failed with an exception (its log says which)")
                if value != self._seen[r][0]:
                    self._seen[r] = (value, now)

    def _watch(self) -> None:
        """Every interval: name a rank whose counter, or the store, has been silent for the bound (no store call)."""
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            seen = dict(self._seen)
            if now - self._answered > self.timeout and seen.get(0, (None,))[0] != _DONE:
                self._store_host_lost(f"the store has not answered for {now - self._answered:.0f} s (rank 0 froze, "
                                      "or its host is unreachable)")
            for r, (value, since) in seen.items():
                if value != _DONE and now - since > self.timeout:
                    what = "never started beating" if value is None else f"sent no heartbeat for {now - since:.0f} s"
                    self._stop_process(f"{self._who(r)} stopped answering: it {what} (died or froze)")

    def _store_host_lost(self, detail: str) -> None:
        self._stop_process(f"{self._who(0)}, which hosts the job's store at {self.host}:{self.port}, stopped "
                           f"answering: {detail}", write=False)  # no store to write the verdict to

    def _who(self, rank: int) -> str:
        """``rank K (host, pid P)`` (``rank K`` if it is not in the process group)."""
        if rank not in self._names:
            return f"rank {rank}"
        host, pid = self._names[rank]
        return f"rank {rank} ({host}, pid {pid})"

    def _local_peer_lost(self, ranks: list[int], states: str = "ZX") -> str | None:
        """``rank K (host, pid P) died ...`` for the first of ``ranks`` on this host whose process is in one of
        ``states`` (Z, X: gone; T: stopped), looked up in /proc; ``None`` if none (or the store does not answer)."""
        for rank in ranks:
            host, pid = self._names.get(rank, ("", 0))
            state = _process_state(pid) if host == socket.gethostname() else None
            if state is None or state not in states:
                continue
            try:  # one that finished (or failed, and says so) between the read of its beat and now is no loss
                if self._store.get(self._key(rank)) in (_DONE, _FAILED):
                    continue
            except Exception:  # noqa: BLE001 -- the store is gone: the bound applies
                continue
            return f"{self._who(rank)} {'is frozen (stopped)' if state == 'T' else 'died (its process is gone)'}"
        return None

    # -- a collective failed ---------------------------------------------------------------------------------------
    def name_lost_peer(self, error: BaseException) -> None:
        """Called when this rank's training raised. If ``error`` is a failed collective, find the peer that was lost
        and stop naming it, rather than reporting only "connection closed by peer [address]"; otherwise return.

        A peer on this host is looked up in /proc at once (a killed process is gone or a zombie, a frozen one is
        stopped); one elsewhere is named by the watch thread within the bound (its beats stop), so this waits for
        that verdict, at most ``timeout`` plus two intervals.
        """
        text = f"{type(error).__name__}: {error}"
        if self._store is None or not (isinstance(error, dist.DistError)
                                       or "gloo" in text or "NCCL" in text):  # gloo's errors name its sources
            return
        peers = [r for r in range(self.world_size) if r != self.rank]
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        while time.monotonic() < deadline and self._threads and self._threads[-1].is_alive():
            # looked up again and again: a killed peer's sockets close (failing this collective) before its process
            # is a zombie, and a job under torchrun restarts only once every rank of it has exited
            lost = self._local_peer_lost(peers, states="ZXT")
            if lost:
                self._stop_process(f"{lost}; this rank's collective failed ({_clean(text.splitlines()[0][:200])})")
            time.sleep(0.2)  # else the watch thread names the lost rank and ends the process

    def _stop_process(self, why: str, write: bool = True) -> None:
        with self._ending:  # one verdict per process: a second thread that finds one waits here for the exit
            if write and self._store is not None:  # for the others to read; not waiting on a store that froze
                _within(min(self.interval, 2.0), self._store.set, self._verdict_key(), why.encode())
            message = (f"[rank {self.rank}] lightning-par: {why}. Stopping this rank (exit code {EXIT_CODE}) rather "
                       f"than waiting in a collective (heartbeat_timeout={self.timeout:g} s); resume from the last "
                       "checkpoint.")
            print(message, file=sys.stderr, flush=True)
            sys.stdout.flush()
            self._exit(EXIT_CODE)

    _exit = staticmethod(os._exit)  # a test replaces it


def _over_process_group() -> tuple[str, list[tuple[str, int]]]:
    """The run's random token, drawn by rank 0, and every rank's ``(host, pid)``, exchanged over the default process
    group (collectives), never through the store: a writer on the store can neither learn nor forge them."""
    token = [secrets.token_hex(16) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    names: list = [None] * dist.get_world_size()
    dist.all_gather_object(names, (socket.gethostname(), os.getpid()))
    return token[0], names


def _within(seconds: float, call: Callable, *args) -> None:
    """``call(*args)`` in a daemon thread, waiting at most ``seconds``; errors ignored (a store that is gone or
    frozen has nobody left to tell)."""
    def run() -> None:
        try:
            call(*args)
        except Exception:  # noqa: BLE001
            pass
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        shutdown.straggler(thread)


def _clean(text: str) -> str:
    """``text`` without control characters (terminal escapes, newlines), at most ``_MAX_TEXT`` characters."""
    text = "".join(ch if ch.isprintable() else " " for ch in text)
    return text if len(text) <= _MAX_TEXT else text[:_MAX_TEXT - 3] + "..."


def _process_state(pid: int) -> str | None:
    """The state letter of a local process (``R``, ``S``, ``T`` stopped, ``Z`` zombie), ``X`` if there is none,
    ``None`` where /proc cannot tell (not Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "X" if os.path.isdir("/proc/self") else None
    except OSError:
        return None
