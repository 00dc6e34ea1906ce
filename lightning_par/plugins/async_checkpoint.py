"""Sharded saves that overlap training: DCP's ``async_save``, with the same atomic commit as a synchronous save.

A save copies every rank's states to host memory (DCP's staging, in the training thread: the only stall) and returns;
DCP's thread writes the files, then the coordinator writes DCP's metadata once every rank's files are written (over a
gloo group of its own, so nothing in the background shares a communicator with training). When that is done on the
writer rank, the checksums, the manifest and the rename happen there, in the same thread: the checkpoint takes its
name only then, so ``last`` never names an incomplete one. At most one save is in flight: the next save, and the
strategy's teardown, first wait for it and raise its error, naming the checkpoint. Checkpoints Lightning asks to
delete while a save is in flight (``save_top_k``) are deleted after that save commits, so a crash never leaves fewer
complete checkpoints than the user kept; a ``last`` link to the save in flight (``save_last="link"``) is made when it
commits, so until then ``last`` still names the previous, complete one.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.tensor import DTensor

from lightning_par._compat import Shard, ShardedTensor
from lightning_par.plugins import checkpoint_files, sharded_checkpoint, zero_checkpoint
from lightning_par.plugins.checkpoint_files import CheckpointError


class AsyncSaver:
    """One rank's asynchronous sharded saves. Make it on every rank together (it creates a process group)."""

    def __init__(self, is_writer: bool, barrier: Callable[[], None]) -> None:
        self.is_writer, self.barrier = is_writer, barrier
        self.group = dist.new_group(backend="gloo")  # DCP's background collectives, apart from training's
        self._future: Future | None = None
        self._path: Path | None = None
        self._committed = threading.Event()
        self._committed.set()
        self._error: BaseException | None = None
        self._removals: list[Path] = []
        self._links: list[Path] = []  # links to make to the save in flight once it commits
        self._uncommitted: Path | None = None  # the writer's save in flight: links to it and deletions wait
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def save(self, checkpoint: dict[str, Any], path: Path) -> None:
        self.wait()
        partial, sharded = sharded_checkpoint.begin(checkpoint, path, self.is_writer, self.barrier)
        result = dcp.async_save(sharded, checkpoint_id=partial, process_group=self.group, async_stager=_HostCopy())
        future = result.upload_completion if isinstance(result, AsyncSaveResponse) else result
        self._future, self._path = future, path
        if self.is_writer:
            self._committed.clear()
            with self._lock:
                self._uncommitted = path
            future.add_done_callback(lambda done: self._commit(done, partial, path))

    def _commit(self, done: Future, partial: Path, path: Path) -> None:
        """On the writer, in DCP's thread, once every rank's files and DCP's metadata are written."""
        try:
            done.result()
            sharded_checkpoint.finish(partial, path)
            committed = True
        except BaseException as err:  # noqa: BLE001 -- kept for the next save or teardown, which raise it
            self._error, committed = err, False
        with self._lock:  # the lock covers only the hand-over: the training thread never waits on the checksums
            links, self._links = self._links, []  # a failed save is never linked
            if committed:  # deletions held back wait for a save that commits
                removals, self._removals = self._removals, []
            else:
                removals = []
            self._uncommitted = None  # from here a link or deletion asked for happens at once
        try:
            for link in links:  # ``last`` names the new checkpoint before the older ones go
                checkpoint_files.link(path, link)
            for old in removals:
                checkpoint_files.remove(old)
        except BaseException as err:  # noqa: BLE001
            self._error = self._error or err
        finally:
            self._committed.set()

    def remove(self, path: Path) -> None:
        """Delete a checkpoint now, or after the save in flight commits."""
        with self._lock:
            if self._uncommitted is not None:
                self._removals.append(path)
                return
        checkpoint_files.remove(path)

    def link(self, target: Path, link_path: Path) -> None:
        """Point ``link_path`` at ``target`` now, or, if ``target`` is the save in flight, when it commits."""
        with self._lock:
            if self._uncommitted == target:
                self._links.append(link_path)
                return
        checkpoint_files.link(target, link_path)

    def wait(self) -> None:
        """Block until the save in flight is written (and, on the writer, committed); raise its error, if any."""
        if self._future is None:
            return
        future, path = self._future, self._path
        self._future = self._path = None
        try:
            future.result()
        except BaseException as err:  # noqa: BLE001
            self._error = self._error or err
        self._committed.wait()
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"the asynchronous save of {path} failed ({type(error).__name__}: {error}); "
                                  "the previous checkpoint is still the latest.") from error


class _HostCopy(AsyncStager):
    """Stage a checkpoint as a copy in host memory, in the calling (training) thread.

    DCP's default stager copies tensors and DTensors but refuses ShardedTensors, which ZeRO-1/2's per-parameter
    blocks are (:mod:`~lightning_par.plugins.zero_checkpoint`); this one copies all three.
    """

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return {key: _copy(value) for key, value in state_dict.items()}

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


@torch.no_grad()
def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_copy(item) for item in value)
    if isinstance(value, ShardedTensor):
        shards = [Shard(shard.tensor.to("cpu", copy=True), shard.metadata) for shard in value.local_shards()]
        return zero_checkpoint.blocks_tensor(shards, value.size())
    if isinstance(value, DTensor):
        return DTensor.from_local(value.to_local().to("cpu", copy=True), value.device_mesh, value.placements,
                                  run_check=False, shape=value.shape, stride=value.stride())
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return copy.deepcopy(value)
