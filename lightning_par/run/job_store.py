"""One job, one store: a second job on a port another job holds fails at once, and its ranks never join that job.

Rank 0 of a process group hosts the group's TCP store on ``MASTER_PORT``; the other ranks connect to whatever listens
there. With Lightning's launcher, rank 0 starts the other ranks of its machine first and binds the port after: when
another job holds it, rank 0 died with torch's raw ``EADDRINUSE`` while its ranks stayed connected to the other job's
store, waiting there for minutes (seen in issue 41). So:

- the launching process (global rank 0) checks that a ``MASTER_PORT`` the user set is free before it starts any rank
  (:func:`before_launch`), and hands the ranks it starts a job id (:data:`JOB_ENV`);
- rank 0 binds the store itself, writes the job id into it, and turns a lost race for the port into the same error;
- a rank holding a job id reads the id in the store it reached before it joins the group (:func:`job_store`): another
  job's id, or a rank 0 that ended without one, stops it with the same one line.

Under torchrun the agent hosts the store: a second agent on a held port fails in torch's own code before any worker
starts (``torchrun --master_port`` / ``--rdzv-endpoint`` pick another). Ranks of another machine's launcher hold no
job id (nothing is shared across machines but the address), so they connect unchecked.
"""

from __future__ import annotations

import errno
import os
import socket
import time
import uuid
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_par.topology import LayoutError

#: the job id rank 0 of Lightning's launcher gives the ranks it starts: "<rank 0's pid>-<random>"
JOB_ENV = "LIGHTNING_PAR_JOB"
#: the store key under which rank 0 writes it
JOB_KEY = "lightning_par/job"
#: how often a rank looks for the job id while it waits for rank 0
POLL_S = 0.05


class PortInUseError(LayoutError):
    """``MASTER_PORT`` is held by another job (its store); the message names the port and how to pick another."""


def port_message(port: int, what: str) -> str:
    return (f"MASTER_PORT={port} {what}: another job holds this port (its process group's store), and this job's "
            "ranks must not join it. Pick a free port: MASTER_PORT=<free port> (or leave MASTER_PORT unset: "
            "Lightning then picks a free one); under torchrun, --master_port=<free port> or "
            "--rdzv-endpoint=<host>:<free port>.")


def port_in_use(port: int) -> bool:
    """Whether a socket on this machine listens on ``port``, on any address (as the store's bind would find it)."""
    for family, address in ((socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 here
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: TIME_WAIT is no clash
            try:
                sock.bind((address, port))
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return True
    return False


def before_launch(environment: Any) -> None:
    """In the process that starts the other ranks (Lightning's launcher): refuse a ``MASTER_PORT`` the user set that
    another job holds, before any rank starts; give the ranks started from here this job's id."""
    if dist.is_initialized():  # a second fit of this process: its group, store and ranks stay
        return
    if environment.node_rank() != 0:  # rank 0, who writes the id, is on another machine
        os.environ.pop(JOB_ENV, None)
        return
    if "MASTER_PORT" in os.environ:  # (a port Lightning picks itself is free by construction)
        port = int(os.environ["MASTER_PORT"])
        if port_in_use(port):
            raise PortInUseError(port_message(port, "is in use on this machine"))
    os.environ[JOB_ENV] = f"{os.getpid()}-{uuid.uuid4().hex}"


def job_store(address: str, port: int, rank: int, world_size: int, timeout: timedelta | None) -> dict[str, Any]:
    """The store to join the process group through (``init_process_group(store=...)``), checked to be this job's.

    Rank 0 binds it and writes this job's id; a rank with a job id (started by rank 0's launcher) waits until the id
    is there and equal to its own. Empty (torch's own env:// rendezvous) for a rank without an id."""
    job = os.environ.get(JOB_ENV, "")
    launcher = int(job.split("-", 1)[0]) if job.split("-", 1)[0].isdigit() else -1
    if rank != 0 and launcher != os.getppid():  # an id inherited from elsewhere, not from this job's rank 0
        job = ""
    timeout = timeout or timedelta(minutes=30)
    if rank == 0:
        try:
            store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                                  multi_tenant=True)
        except dist.DistNetworkError as err:  # the port was taken between the launcher's check and here
            if "EADDRINUSE" not in str(err):
                raise
            raise PortInUseError(port_message(port, "is in use on this machine")) from None
        store.set(JOB_KEY, job)
        return {"store": _as_rendezvous_gives(store)}
    if not job:
        return {}
    store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check([JOB_KEY]):
        if os.getppid() != launcher:  # rank 0 (this rank's parent) ended before its store had this job's id
            raise PortInUseError(port_message(port, f"(rank {rank}): rank 0 ended before this job's store started, "
                                                    "and what listens there is not this job"))
        if time.monotonic() > deadline:
            raise PortInUseError(port_message(port, f"(rank {rank}): no job id in the store after {timeout}"))
        time.sleep(POLL_S)
    found = store.get(JOB_KEY).decode()
    if found != job:
        raise PortInUseError(port_message(port, f"(rank {rank}): the store there is another job's (job id {found!r}, "
                                                f"not this job's {job!r})"))
    return {"store": _as_rendezvous_gives(store)}


def _as_rendezvous_gives(store: Any) -> Any:
    """``store`` under the prefix torch's own ``env://`` rendezvous puts every process group's keys in: a rank that
    joins without a job id (another machine's, a SLURM task) rendezvouses that way, and its keys must meet rank 0's
    (without the prefix every rank waited in gloo's connection forever: the SLURM requeue of tests/launch/
    test_elastic.py)."""
    return dist.PrefixStore("default_pg", store)
