"""Callbacks the tests add to a launched run to report what each rank saw."""

from __future__ import annotations

import json
import os
import resource
import signal
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.nn.parallel import DistributedDataParallel

from lightning_par.measure import CommCounter, state_bytes


class RankReport(pl.Callback):
    """Write ``rank{N}.json`` per rank: coordinates, groups, sampler, environment and wrapper facts."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.batches: list[list[int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx < 3:
            # identify each sample by a few of its tokens, to check which rank saw which sample
            inputs = batch["input_ids"] if isinstance(batch, dict) else batch[0]
            self.batches.append([int(t) for t in inputs[:, :4].flatten()])

    def on_train_end(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        report = {
            "global_rank": trainer.global_rank,
            "world_size": trainer.world_size,
            "node_rank": trainer.node_rank,
            "local_rank": trainer.local_rank,
            "strategy": type(strategy).__name__,
            "cluster_environment": type(getattr(strategy, "cluster_environment", None)).__name__,
            "wrapped_model": type(strategy.model).__name__,
            "first_batches": self.batches,
        }
        mesh = getattr(strategy, "_device_mesh", None)
        if mesh is not None and hasattr(strategy, "coordinates"):  # a lightning-par strategy
            report.update(
                backend=dist.get_backend(),
                coordinates=strategy.coordinates,
                groups={d: sorted(dist.get_process_group_ranks(mesh[d].get_group())) for d in ("pp", "dp", "tp")},
                sampler=dict(strategy.distributed_sampler_kwargs),
            )
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))


class PredictionDump(BasePredictionWriter):
    """Write each rank's predictions (token ids) to ``predictions_rank{N}.json``."""

    def __init__(self, path: str) -> None:
        super().__init__(write_interval="epoch")
        self.path = Path(path)

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        rows = [row.tolist() for batch in predictions for row in batch]
        (self.path / f"predictions_rank{trainer.global_rank}.json").write_text(json.dumps(rows))


class DieAt(pl.Callback):
    """Kill one rank abruptly (no cleanup, like a crashed node) when it starts a given training step."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os._exit(17)


class FreezeAt(pl.Callback):
    """Freeze one rank (SIGSTOP: alive, holding its sockets, answering nothing) when it starts a given training step;
    its pid and the time go to ``path`` first, so the test can measure the others' reaction and kill it after.
    ``sig="SIGKILL"`` kills it instead. ``attempt=K``: only in the job's attempt K (torchrun's restart count)."""

    def __init__(self, rank: int, step: int, path: str, sig: str = "SIGSTOP", attempt: int | None = None) -> None:
        self.rank, self.step, self.path, self.sig = rank, step, path, getattr(signal, sig)
        self.attempt = attempt

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.attempt is not None and restarts != self.attempt:
            return
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            Path(self.path).write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            os.kill(os.getpid(), self.sig)


class SignalAt(pl.Callback):
    """Send ``sig`` to this process on ``rank`` at optimizer step ``step`` (``moment``: where), only in the job's
    attempt ``attempt`` (torchrun's restart count). Its time goes to ``path``."""

    # moments: ``step`` (after backward, before the optimizer), ``save`` (inside a checkpoint save, before its files
    # are written: they are then written, and the ranks meet at the save's barriers, with the signal pending),
    # ``after_save`` (the start of the step after a save: an async save is then still being written)

    def __init__(self, rank: int, step: int, path: str, sig: str = "SIGTERM", attempt: int | None = 0,
                 moment: str = "step") -> None:
        self.rank, self.step, self.path, self.sig, self.attempt = rank, step, path, getattr(signal, sig), attempt
        self.moment = moment

    def _maybe(self, trainer, moment: str) -> None:
        restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        if self.attempt is not None and restarts != self.attempt or moment != self.moment:
            return
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            Path(self.path).write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            os.kill(os.getpid(), self.sig)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._maybe(trainer, "step")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self._maybe(trainer, "save")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._maybe(trainer, "after_save")


class PreemptEveryRank(pl.Callback):
    """A scheduler preempting the job: SIGTERM to every rank's process at once, at a chosen moment of the job's
    first attempt, and in the next attempt a check of the checkpoint it resumed from. Files go to ``path``.

    Every rank writes its pid to ``pids/rank{N}`` when training starts. On global rank 0, a thread sends the signal
    to every pid ``fraction`` of a measured duration after the moment begins:

    - ``step``: optimizer step ``step`` (its first batch starting with ``global_step == step``); the duration is the
      median of the earlier steps' (batch start to batch start);
    - ``save``: the checkpoint save at ``global_step == step`` (``on_save_checkpoint``); the duration is the previous
      save's, from its start until no ``*.partial`` is left in the checkpoint directory (a sync save's write, an
      async save's write in the background until it committed).

    ``signal.json``: the time the signal was sent, the pids (by rank), ``step_started`` (the global step when rank 0's
    current batch started), ``phase`` (``step``: inside a batch, before its end hooks; ``boundary``: in its end
    hooks, where saves and the preemption check run) and ``save_in_flight`` (a ``*.partial`` in the checkpoint
    directory: a save was still being written). Every rank writes the time it stopped (the exception that ends the
    attempt) to ``pids/stopped_rank{N}``. In a later attempt rank 0 writes ``resumed.json`` when training starts,
    before any save: the checkpoint resumed from, the global step it restored, and whether it is complete (every file
    there at its size and checksum, :mod:`lightning_par.plugins.checkpoint_files`)."""

    def __init__(self, path: str, moment: str, step: int, fraction: float) -> None:
        if moment not in ("step", "save"):
            raise ValueError(f"moment={moment!r}: 'step' or 'save'")
        self.path, self.moment, self.step, self.fraction = Path(path), moment, step, fraction
        self.phase, self.step_started = "start", -1
        self.step_starts: list[float] = []
        self.save_seconds: float | None = None
        self.sent = False
        self._directory: Path | None = None

    @staticmethod
    def _attempt() -> int:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def on_train_start(self, trainer, pl_module) -> None:
        if self._attempt() > 0:
            if trainer.is_global_zero:
                self._check_resumed(trainer)
            return
        (self.path / "pids").mkdir(parents=True, exist_ok=True)
        (self.path / "pids" / f"rank{trainer.global_rank}").write_text(str(os.getpid()))
        dirpath = getattr(trainer.checkpoint_callback, "dirpath", None)
        self._directory = Path(dirpath) if dirpath else None

    def on_exception(self, trainer, pl_module, exception) -> None:
        """The time this rank stopped (the preemption's checkpoint written, or handed to the async writer)."""
        if self._attempt() == 0:
            (self.path / "pids" / f"stopped_rank{trainer.global_rank}").write_text(str(time.time()))

    def _check_resumed(self, trainer) -> None:
        from lightning_par.plugins import checkpoint_files

        path = Path(str(trainer.ckpt_path))
        error = None
        try:
            target = checkpoint_files.resolve(path)
            if target.is_dir():
                files = checkpoint_files.read_manifest(target)
                checkpoint_files.check_sizes(target, files)
                checkpoint_files.check_checksums(target, files, sorted(files))
            else:
                checkpoint_files.verify_file(path, target)
        except Exception as err:  # noqa: BLE001 -- reported, not raised: the benchmark says what was wrong
            error = f"{type(err).__name__}: {err}"
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "resumed.json").write_text(json.dumps(
            {"path": str(path), "global_step": trainer.global_step, "complete": error is None, "error": error}))

    def _armed(self, trainer) -> bool:
        return not self.sent and trainer.is_global_zero and self._attempt() == 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.phase, self.step_started = "step", trainer.global_step
        if not self._armed(trainer):
            return
        self.step_starts.append(time.time())
        if self.moment == "step" and trainer.global_step == self.step:
            gaps = sorted(b - a for a, b in zip(self.step_starts[:-1], self.step_starts[1:], strict=True))
            self._send_after(self.fraction * gaps[len(gaps) // 2], trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.phase = "boundary"

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if not self._armed(trainer) or self._directory is None:
            return
        if self.moment == "save" and trainer.global_step == self.step:
            assert self.save_seconds is not None, "a save before the signalled one measures its duration"
            self._send_after(self.fraction * self.save_seconds, trainer)
        else:
            threading.Thread(target=self._time_save, args=(time.time(),), daemon=True).start()

    def _partials(self) -> list[str]:
        return [p.name for p in self._directory.glob("*.partial")] if self._directory is not None else []

    def _time_save(self, began: float) -> None:
        """The save's duration: until the partial it writes has appeared and gone again (or 10 s)."""
        seen = False
        while time.time() - began < 10:
            partial = bool(self._partials())
            seen = seen or partial
            if seen and not partial:
                break
            time.sleep(0.002)
        self.save_seconds = time.time() - began

    def _send_after(self, delay: float, trainer) -> None:
        self.sent = True
        pids = [int(p.read_text()) for p in sorted((self.path / "pids").glob("rank*"))]

        def send() -> None:
            time.sleep(delay)
            record = {"time": time.time(), "delay": delay, "pids": pids, "step_started": self.step_started,
                      "phase": self.phase, "global_step": trainer.global_step, "partials": self._partials()}
            record["save_in_flight"] = bool(record["partials"])
            (self.path / "signal.json.tmp").write_text(json.dumps(record))
            os.replace(self.path / "signal.json.tmp", self.path / "signal.json")  # whole, for whoever watches it
            for pid in pids:
                os.kill(pid, signal.SIGTERM)

        threading.Thread(target=send, daemon=True).start()


class GradNorms(pl.Callback):
    """Record the global gradient norm before clipping of the first optimizer steps into the rank report.

    The gradients may be DTensor shards (ZeRO, FSDP2); ``clip_grad_norm_``'s own norm computation reduces over
    the mesh, so equal numbers across layouts mean the norm Lightning clips by is the global one.
    """

    def __init__(self, steps: int = 5) -> None:
        self.steps = steps
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step < self.steps:
            if hasattr(trainer.strategy, "global_grad_norm"):  # a lightning-par strategy: any layout
                self.norms.append(float(trainer.strategy.global_grad_norm(optimizer)))
                return
            grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            self.norms.append(float(norm))

    def on_train_end(self, trainer, pl_module) -> None:
        root = Path(trainer.default_root_dir) / "reports"
        root.mkdir(parents=True, exist_ok=True)
        (root / f"norms_rank{trainer.global_rank}.json").write_text(json.dumps(self.norms))


class StateReport(pl.Callback):
    """Write ``state_rank{N}.json`` per rank: the elements sent during one whole optimizer step, by collective kind,
    and the bytes of parameters, gradients and optimizer states held right after that step.

    The window opens at the first micro-batch of optimizer step ``step`` (1-based: the step that makes
    ``trainer.global_step == step``) and closes after its optimizer step, so with ``accumulate_grad_batches`` it
    spans every micro-batch of that step. A DDP-wrapped model (stage 0, Lightning ``ddp``) all-reduces in C++:
    a counting comm hook is registered on it at the start of training. The file is written again at the end of
    training with the peak memory of the process.

    Args:
        path: folder for the reports.
        step: which optimizer step to measure.
    """

    def __init__(self, path: str, step: int = 3) -> None:
        self.path = Path(path)
        self.step = step
        self.counter = CommCounter(enabled=False)
        self.report: dict = {}

    def on_train_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        self.report = {
            "global_rank": trainer.global_rank,
            "strategy": type(strategy).__name__,
            "stage": getattr(strategy, "stage", None),
            # DTensor.numel() is the global count, so this is the unsharded model under every strategy
            "numel": sum(p.numel() for p in pl_module.parameters()),
            "dp": (getattr(strategy, "distributed_sampler_kwargs", None) or {}).get("num_replicas", trainer.world_size),
            "step": self.step,
            "sent": None,
            "calls": None,
            "bytes": None,
        }
        model = strategy.model
        if isinstance(model, DistributedDataParallel):
            self.counter.process_group = model.process_group
            model.register_comm_hook(self.counter, CommCounter.ddp_comm_hook)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        first_micro_batch = batch_idx % trainer.accumulate_grad_batches == 0
        if trainer.global_step == self.step - 1 and first_micro_batch and not self.counter.enabled:
            self.counter.reset()
            self.counter.install()
            self.counter.resume()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not (self.counter.enabled and trainer.global_step == self.step):
            return
        self.counter.pause()
        self.counter.uninstall()
        self.report.update(
            sent=self.counter.sent_elements(),
            calls=self.counter.calls(),
            bytes=state_bytes(trainer.strategy.model, trainer.optimizers),
        )
        self._write(trainer)

    def on_train_end(self, trainer, pl_module) -> None:
        self.counter.uninstall()
        # ru_maxrss is in KiB on Linux
        self.report["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        device = trainer.strategy.root_device
        if device.type == "cuda":  # the whole run's peak: MemoryPerRank resets torch's at each of its windows
            from lightning_par.callbacks import cuda_run_peak_bytes

            self.report["peak_cuda_bytes"] = cuda_run_peak_bytes(device)[0]
        else:
            self.report["peak_cuda_bytes"] = None
        self._write(trainer)

    def _write(self, trainer) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / f"state_rank{trainer.global_rank}.json").write_text(json.dumps(self.report, indent=1))


def _peak_since_reset() -> int:
    """VmHWM: the peak resident size since the process started or since ``/proc/self/clear_refs`` was given 5."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))


class FitStartMemory(pl.Callback):
    """Write ``fit_start_rank{N}.json``: this rank's peak resident set size when ``on_fit_start`` runs
    (``max_rss_bytes``), its resident size when ``setup`` runs, before ``configure_model`` (``setup_rss_bytes``), its
    peak from then to fit start (``peak_since_setup_bytes``), the
    parameters it holds (``local_parameters``, a DTensor's local shard) and the whole model's parameter bytes
    (``model_bytes``, the full tensors it holds a piece of). On CUDA also the device's bytes allocated at ``setup``
    (``cuda_setup_allocated_bytes``) and the peaks allocated and reserved from then to fit start
    (``cuda_max_allocated_bytes``, ``cuda_max_reserved_bytes``; None on CPU)."""

    def __init__(self, path: str, stop: bool = False) -> None:
        self.path = Path(path)
        self.stop = stop  # end the fit there (memory benchmarks: no step is needed)
        self.setup_rss = 0
        self.setup_cuda: int | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        try:  # a library's import is not the model's memory: the example HF module imports it in configure_model
            import transformers.models.llama.modeling_llama  # noqa: F401
        except ImportError:
            pass
        with open("/proc/self/statm") as statm:
            self.setup_rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        # the peak from here on: rank 0's data preparation (before setup) may have peaked higher than anything after
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM to the current resident size
        device = trainer.strategy.root_device
        if device.type == "cuda":  # the same on the device: its peaks from here on
            self.setup_cuda = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)

    def on_fit_start(self, trainer, pl_module) -> None:
        from torch.distributed.tensor import DTensor

        self.path.mkdir(parents=True, exist_ok=True)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        params = list({id(p): p for p in pl_module.parameters()}.values())
        local = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        device = trainer.strategy.root_device
        cuda = device.type == "cuda"
        (self.path / f"fit_start_rank{trainer.global_rank}.json").write_text(json.dumps({
            "max_rss_bytes": peak, "setup_rss_bytes": self.setup_rss, "peak_since_setup_bytes": _peak_since_reset(),
            "local_parameters": sum(t.numel() for t in local if not t.is_meta),
            "model_bytes": sum(p.numel() * p.element_size() for p in params),
            "materialized": getattr(trainer.strategy, "materialized", {}),
            "cuda_setup_allocated_bytes": self.setup_cuda,
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device) if cuda else None}))
        if self.stop:
            trainer.should_stop = True


class PoisonAt(pl.Callback):
    """A bad step at optimizer step ``step`` (the batch that starts with ``global_step == step``), on every rank:

    - ``weight``: NaN written into one element of the first parameter this rank holds outside an embedding (it
      stays in the weights);
    - ``activation``: the first ``nn.Linear``'s output made NaN for that batch only (that step's loss and gradients;
      under gradient accumulation its first micro-batch);
    - ``lr0``: the learning rate 0 for that step -- with plain SGD, a run without that step's update (a reference);
    - ``weight_between``: NaN written into that weight at the end of the batch that made ``global_step == step``,
      after its update and before the checkpoint callbacks run (a weight poisoned outside any step).
    """

    def __init__(self, step: int, what: str = "weight") -> None:
        self.step, self.what = step, what
        self._hook = None
        self._lrs: list[float] = []
        self._done = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step or self._done:
            return
        self._done = True  # once: under gradient accumulation, the step's first micro-batch only
        if self.what == "weight":
            self._poison_weight(pl_module)
        elif self.what == "activation":
            linear = next(m for m in pl_module.modules() if isinstance(m, torch.nn.Linear))
            self._hook = linear.register_forward_hook(lambda module, args, out: out * float("nan"))
        elif self.what == "lr0":
            for group in trainer.optimizers[0].param_groups:
                self._lrs.append(group["lr"])
                group["lr"] = 0.0

    @staticmethod
    def _poison_weight(pl_module) -> None:
        # a weight every token goes through (not an embedding row, which a batch without that token never reads)
        param = next(p for m in pl_module.modules() if not isinstance(m, torch.nn.Embedding)
                     for p in m.parameters(recurse=False) if p.is_floating_point())
        local = param.to_local() if hasattr(param, "to_local") else param
        with torch.no_grad():
            local.view(-1)[0] = float("nan")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self.what == "weight_between" and trainer.global_step == self.step:
            self._poison_weight(pl_module)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._lrs and trainer.global_step > self.step:
            for group, lr in zip(trainer.optimizers[0].param_groups, self._lrs, strict=True):
                group["lr"] = lr
            self._lrs = []


class UninitialisedIsNaN(pl.Callback):
    """During the first training step, ``torch.empty_strided`` returns floating-point tensors filled with NaN: what
    uninitialised memory may hold. torch's pipeline stages build their first step's metadata-inference inputs with
    it, so a run that computes with such a tensor (and backpropagates under ``detect_anomaly``) fails every time
    instead of by chance."""

    def __init__(self) -> None:
        self._original = None

    def on_train_start(self, trainer, pl_module) -> None:
        self._original = original = torch.empty_strided

        def nan_filled(*args, **kwargs):
            out = original(*args, **kwargs)
            return out.fill_(float("nan")) if out.is_floating_point() else out

        torch.empty_strided = nan_filled

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._original is not None:
            torch.empty_strided = self._original
            self._original = None

    on_exception = lambda self, trainer, pl_module, exception: self.on_train_batch_end(  # noqa: E731
        trainer, pl_module, None, None, 0)


class StepLosses(pl.Callback):
    """Each optimizer step's loss over its whole global batch (the micro-batches' losses summed, each divided by the
    accumulation; averaged over the ranks, which hold the same loss under tp and pp) and the time it ended:
    ``path`` {"steps": {step: loss}, "times": {step: seconds}, "accumulate": N}."""

    def __init__(self, path: str) -> None:
        self.path, self.steps, self.times, self.pending = Path(path), {}, {}, 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        loss = outputs["loss"].detach().float().clone()
        torch.distributed.all_reduce(loss)
        self.pending += float(loss) / trainer.world_size
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self.steps[trainer.global_step - 1] = self.pending
            self.times[trainer.global_step - 1] = time.time()
            self.pending = 0.0

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:  # one file per attempt that ends: the last attempt's steps are the ones it ran
            self.path.write_text(json.dumps({"steps": self.steps, "times": self.times,
                                             "accumulate": trainer.accumulate_grad_batches}))

class KillAgentAt(pl.Callback):
    """A node lost: at ``step`` of the job's first attempt, the ranks whose torchrun agent has the pid written in
    ``pid_file`` SIGKILL that agent and all its workers (each in its own session, so not one process group), this
    rank last. The time goes to ``path`` first."""

    def __init__(self, step: int, pid_file: str, path: str) -> None:
        self.step, self.pid_file, self.path = step, Path(pid_file), Path(path)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) or trainer.global_step != self.step:
            return
        if self.pid_file.is_file() and int(self.pid_file.read_text()) == os.getppid():
            self.path.write_text(json.dumps({"step": self.step, "time": time.time()}))
            agent, workers = os.getppid(), []
            for stat in Path("/proc").glob("[0-9]*/stat"):  # the agent's workers, found while it is their parent
                try:
                    pid, ppid = int(stat.parent.name), int(stat.read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if ppid == agent and pid != os.getpid():
                    workers.append(pid)
            for pid in [agent, *workers, os.getpid()]:
                os.kill(pid, signal.SIGKILL)


class SlowSteps(pl.Callback):
    """Sleep ``seconds`` after each training batch while the world has ``world`` ranks: a run slow enough for an
    agent to join it mid-run (the losses do not depend on time)."""

    def __init__(self, seconds: float, world: int) -> None:
        self.seconds, self.world = seconds, world

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.world_size == self.world:
            time.sleep(self.seconds)
