"""A rank that dies or freezes is named, and the others stop, within a bound.

A collective on a lost peer either fails (gloo: "connection closed by peer", usually at once, naming an address, not a
rank) or waits for the process group's timeout -- for a frozen rank (SIGSTOP, a hung host, a deadlocked loader) 30
minutes by default. A short process-group timeout would also cut collectives that are legitimately long (a large
checkpoint, the first step's compilation). Hand-written because torch has no liveness check between peers that is
independent of collectives: NCCL's watchdog (``TORCH_NCCL_ASYNC_ERROR_HANDLING``, ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``)
watches this process's own NCCL work, and gloo has nothing.

Each rank runs a daemon thread that bumps a counter in the job's c10d store (its own client connection) every
``interval`` seconds. Rank 0 watches every rank's counter, the others watch rank 0's and a shared verdict. A counter
that has not moved for ``timeout`` seconds -- or a store that does not answer for as long, when the process hosting it
froze -- names the rank: the watcher writes the verdict (so every rank reports the same rank), prints it, and ends
its own process at once with exit code 75 (a frozen collective cannot be interrupted otherwise). Faster where it can
be: each rank stores its host and pid, so a peer on the same host whose process is gone is named at the next look, and
a rank whose collective fails (gloo: "connection reset by peer") names the lost peer before it stops. A partial
checkpoint never commits, so nothing half-written loads. A rank that finishes marks itself done; one that fails marks
itself failed, and the others name it without waiting out the bound.
"""

from __future__ import annotations

import itertools
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

EXIT_CODE = 75  # EX_TEMPFAIL: the job can be resumed from its last checkpoint
_DONE, _FAILED = b"done", b"failed"
_generation = itertools.count()  # one key space per Trainer run in this process (every rank starts them in step)


class Heartbeat:
    """Liveness of every rank of a job through its c10d store at ``host:port``; ``start`` after the process group
    exists (every rank has joined), ``stop`` at teardown."""

    def __init__(self, rank: int, world_size: int, host: str, port: int, timeout: float,
                 interval: float | None = None) -> None:
        self.rank, self.world_size, self.host, self.port = rank, world_size, host, port
        self.timeout = float(timeout)
        self.interval = interval if interval is not None else max(0.5, min(5.0, self.timeout / 6))
        self.prefix = f"lightning_par/heartbeat/{next(_generation)}/"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: dist.TCPStore | None = None

    def _key(self, rank: int) -> str:
        return f"{self.prefix}{rank}"

    def start(self) -> None:
        self._store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.timeout))
        self._store.set(self._key(self.rank), b"0")
        self._store.set(self._who_key(self.rank), f"{socket.gethostname()} {os.getpid()}".encode())
        self._thread = threading.Thread(target=self._run, name="lightning-par-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, failed: bool = False) -> None:
        """Stop beating; tell the others this rank finished (or failed: they stop at once, naming it)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + self.timeout)
        if self._store is not None:
            try:
                self._store.set(self._key(self.rank), _FAILED if failed else _DONE)
            except Exception:  # noqa: BLE001 -- the store host may be gone already; nothing to tell then
                pass

    # -- the thread ----------------------------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._store is not None
        store, beat = self._store, 0
        watched = [r for r in range(self.world_size) if r != self.rank] if self.rank == 0 else [0]
        seen: dict[int, tuple[bytes | None, float]] = {r: (None, time.monotonic()) for r in watched}
        while not self._stop.wait(self.interval):
            beat += 1
            try:
                store.set(self._key(self.rank), str(beat).encode())
                if store.check([self._verdict_key()]):
                    self._stop_process(store.get(self._verdict_key()).decode(), write=False)
                present = [r for r in watched if store.check([self._key(r)])]
                values = store.multi_get([self._key(r) for r in present]) if present else []
            except Exception as err:  # noqa: BLE001 -- a store that fails or does not answer within the bound
                if self._stop.is_set():
                    return
                self._stop_process(f"rank 0 (whose process hosts the job's store at {self.host}:{self.port}) "
                                   f"stopped answering ({type(err).__name__}: {str(err).splitlines()[0]})",
                                   write=False)
            lost = self._local_peer_lost([r for r, v in zip(present, values, strict=True) if v not in (_DONE, _FAILED)])
            if lost:  # on this host a killed process is seen at once; elsewhere its beats stop (the bound)
                self._stop_process(lost)
            now = time.monotonic()
            for r, value in zip(present, values, strict=True):
                if value == _FAILED:
                    self._stop_process(f"rank {r} failed with an exception (its log says which)")
                if value == _DONE:
                    seen[r] = (value, now + 1e9)  # finished: never stale
                elif value != seen[r][0]:
                    seen[r] = (value, now)
            for r, (value, since) in seen.items():
                if now - since > self.timeout:
                    what = "never started beating" if value is None else f"sent no heartbeat for {now - since:.0f} s"
                    self._stop_process(f"{self._who(r)} stopped answering: it {what} (died or froze)")

    def _verdict_key(self) -> str:
        return f"{self.prefix}verdict"

    def _who_key(self, rank: int) -> str:
        return f"{self.prefix}who/{rank}"

    def _who(self, rank: int) -> str:
        """``rank K (host, pid P)``, or ``rank K`` when the store does not know (or answer)."""
        try:
            host, pid = self._store.get(self._who_key(rank)).decode().split()
            return f"rank {rank} ({host}, pid {pid})"
        except Exception:  # noqa: BLE001
            return f"rank {rank}"

    def _local_peer_lost(self, ranks: list[int], states: str = "ZX") -> str | None:
        """``rank K (host, pid P) died ...`` for the first of ``ranks`` on this host whose process is in one of
        ``states`` (Z, X: gone; T: stopped), looked up in /proc; ``None`` if none (or the store does not answer)."""
        for rank in ranks:
            try:
                pid = _local_pid(self._store, self._who_key(rank))
                state = _process_state(pid) if pid is not None else None
                # one that finished (or failed, and says so) between the read of its beat and now is no loss
                lost = state is not None and state in states and self._store.get(self._key(rank)) not in (_DONE,
                                                                                                           _FAILED)
            except Exception:  # noqa: BLE001 -- the store is gone or the rank never started: the bound applies
                continue
            if lost:
                return f"{self._who(rank)} {'is frozen (stopped)' if state == 'T' else 'died (its process is gone)'}"
        return None

    # -- a collective failed ---------------------------------------------------------------------------------------
    def name_lost_peer(self, error: BaseException) -> None:
        """Called when this rank's training raised. If ``error`` is a failed collective, find the peer that was lost
        and stop naming it, rather than reporting only "connection closed by peer [address]"; otherwise return.

        A peer on this host is looked up in /proc at once (a killed process is gone or a zombie, a frozen one is
        stopped); one elsewhere is named by the heartbeat thread within the bound (its beats stop), so this waits
        for that verdict, at most ``timeout`` plus one interval.
        """
        text = f"{type(error).__name__}: {error}"
        if self._store is None or not (isinstance(error, dist.DistError)
                                       or "gloo" in text or "NCCL" in text):  # gloo's errors name its sources
            return
        lost = self._local_peer_lost([r for r in range(self.world_size) if r != self.rank], states="ZXT")
        if lost:
            self._stop_process(f"{lost}; this rank's collective failed ({text.splitlines()[0][:200]})")
        deadline = time.monotonic() + self.timeout + 2 * self.interval
        while time.monotonic() < deadline and self._thread is not None and self._thread.is_alive():
            time.sleep(0.2)  # the heartbeat thread names the lost rank and ends the process

    def _stop_process(self, why: str, write: bool = True) -> None:
        if write and self._store is not None:
            try:
                self._store.set(self._verdict_key(), why.encode())
            except Exception:  # noqa: BLE001
                pass
        message = (f"[rank {self.rank}] lightning-par: {why}. Stopping this rank (exit code {EXIT_CODE}) rather than "
                   f"waiting in a collective (heartbeat_timeout={self.timeout:g} s); resume from the last checkpoint.")
        print(message, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_CODE)


def _local_pid(store: dist.Store, key: str) -> int | None:
    """The pid stored under ``key`` if that process runs on this host."""
    host, pid = store.get(key).decode().split()
    return int(pid) if host == socket.gethostname() else None


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
