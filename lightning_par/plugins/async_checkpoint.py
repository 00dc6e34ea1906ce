"""Sharded saves that overlap training: DCP's ``async_save``, with the same atomic commit as a synchronous save.

A save copies every rank's states to host memory (DCP's staging, :class:`_HostCopy`: into host buffers kept from one
save to the next, pinned on a GPU machine, the device-to-host copies on a side CUDA stream so the training thread
only launches them; on the CPU a copy in the training thread, the only stall) and returns;
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
from lightning_par.parallel import zero_state
from lightning_par.plugins import checkpoint_files, sharded_checkpoint
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
        self._stager = _HostCopy()  # its host buffers serve every save: the next save first waits for this one

    @property
    def in_flight(self) -> bool:
        return self._future is not None

    def save(self, checkpoint: dict[str, Any], path: Path) -> None:
        self.wait()
        partial, sharded = sharded_checkpoint.begin(checkpoint, path, self.is_writer, self.barrier)
        result = dcp.async_save(sharded, checkpoint_id=partial, process_group=self.group, async_stager=self._stager)
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
    """Stage a checkpoint as a copy in host memory, into buffers reused from one save to the next.

    DCP's default stager copies tensors and DTensors but refuses ShardedTensors, which ZeRO-1/2's per-parameter
    blocks are (:mod:`~lightning_par.parallel.zero_state`); this one copies all three. The host buffer of each
    tensor is kept (by its place in the state dict, shape and dtype) for the next save, as allocating and, on a GPU
    machine, pinning gigabytes per save would cost more than the copy. Device tensors are copied on a side CUDA
    stream, which first waits for the training stream (the values are the step's); the training stream then waits
    for the copies (on the GPU, not the host) before it may change a parameter, and the writer thread waits for them
    on the host (the future :meth:`stage` returns, which DCP's executor waits on) before it reads a buffer. Reusing
    the buffers is safe because :class:`AsyncSaver` waits for the save in flight before the next one stages.
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._stream: Any = None  # the side CUDA stream, made on the first device tensor
        self._device_copies = False  # whether the save being staged copied from the device

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any] | Future:
        self._device_copies = False
        staged = {key: self._copy(value, (key,)) for key, value in state_dict.items()}
        if not self._device_copies:
            return staged
        copied = torch.cuda.Event()
        copied.record(self._stream)
        torch.cuda.current_stream().wait_event(copied)  # no parameter changes before its copy is taken
        future: Future = Future()

        def host_ready() -> None:  # in a thread: the training thread never waits for the copies
            try:
                copied.synchronize()
                future.set_result(staged)
            except BaseException as err:  # noqa: BLE001 -- handed to DCP's writer, which raises it
                future.set_exception(err)

        threading.Thread(target=host_ready, name="lightning-par-staging", daemon=True).start()
        return future

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass

    @torch.no_grad()
    def _tensor(self, tensor: torch.Tensor, where: tuple[Any, ...]) -> torch.Tensor:
        """The host copy of ``tensor`` in the buffer kept for ``where``."""
        tensor = tensor.detach()
        key = (*where, tuple(tensor.shape), tensor.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            pin = tensor.device.type == "cuda"
            buffer = self._buffers[key] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
        if tensor.device.type != "cuda":
            return buffer.copy_(tensor)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=tensor.device)
        if not self._device_copies:  # once per save: the copies see the values the training stream computed
            self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
            self._device_copies = True
        with torch.cuda.stream(self._stream):
            return buffer.copy_(tensor, non_blocking=True)

    def _copy(self, value: Any, where: tuple[Any, ...]) -> Any:
        if isinstance(value, dict):
            return {key: self._copy(item, (*where, key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._copy(item, (*where, i)) for i, item in enumerate(value))
        if isinstance(value, ShardedTensor):
            shards = [Shard(self._tensor(shard.tensor, (*where, tuple(shard.metadata.shard_offsets))), shard.metadata)
                      for shard in value.local_shards()]
            return zero_state.blocks_tensor(shards, value.size())
        if isinstance(value, DTensor):
            return DTensor.from_local(self._tensor(value.to_local(), where), value.device_mesh, value.placements,
                                      run_check=False, shape=value.shape, stride=value.stride())
        if isinstance(value, torch.Tensor):
            return self._tensor(value, where)
        return copy.deepcopy(value)
