"""The training data's position in Lightning's checkpoints, so a run resumed anywhere in an epoch goes on exactly.

Lightning saves the state of every training loader that has ``state_dict`` / ``load_state_dict`` (its "stateful"
loaders, e.g. torchdata's StatefulDataLoader) with the fit loop's state, and loads it when a fit restarts, before the
loader's iterator is made. :func:`resumable_train_loader` makes a training DataLoader one of them: its sampler becomes
a :class:`~lightning_par.run.data_order.DataParallelSampler` (in place of the DistributedSampler Lightning
injects into a plain or shuffled DataLoader), and a :class:`DataPosition` answers for it. The saved position is
``(epoch, samples consumed, seed)`` of the global order, computed at save time from Lightning's own progress
counters, so it does not depend on the layout: a checkpoint saved at dp=1 resumes at dp=2 with the same global
batches. The state travels in the checkpoint's loop state -- in a one-file checkpoint, and in the ``meta.json`` of a
sharded one, which every rank reads.

The strategies call it on the training loader (``LayoutStrategy.process_dataloader``); ``TextDataModule`` calls it
on its own loader, so it resumes exactly under Lightning's own strategies too. It is data-loading state that the
strategy saves, so it sits beside :mod:`lightning_par.data`, below the strategies that use it.

Both also call :func:`keep_epoch_count`: Lightning closes an epoch that ``max_steps`` cut short as if it had ended, so
a checkpoint saved when fit stops is numbered one epoch on and a resumed run trains the rest of that epoch under the
next number (every stop and resume added one). With it, the numbers, the checkpoints' names and the progress bar are
those of the uninterrupted run.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.distributed import DistributedSamplerWrapper
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.rank_zero import WarningCache
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset

from lightning_par._compat import Stateful, update_dataloader
from lightning_par.run import elastic
from lightning_par.run.data_order import DataParallelSampler

_warnings = WarningCache()


def resumable_train_loader(loader: Any, trainer: Any) -> Any:
    """``loader`` with a resumable data-parallel sampler and a saved position (see the module docstring).

    Left as it is: a loader that keeps its own state (torchdata's StatefulDataLoader: Lightning saves and loads it).
    Given a :class:`DataParallelSampler` in place of a plain DistributedSampler (Lightning's injected one, or the
    user's with the same arguments). Any other sampler, batch sampler or iterable dataset cannot be positioned:
    one warning says that a mid-epoch resume replays that epoch, and the loader is left as it is.
    """
    keep_epoch_count(trainer)
    if isinstance(loader, Stateful):
        return loader
    if not isinstance(loader, DataLoader):
        return _not_resumable(loader, f"is a {type(loader).__name__}, not a DataLoader")
    if isinstance(loader.dataset, IterableDataset):
        return _not_resumable(loader, f"reads an IterableDataset ({type(loader.dataset).__name__})")
    if loader.batch_size is None or type(loader.batch_sampler) is not BatchSampler:
        return _not_resumable(loader, f"has its own batch sampler ({type(loader.batch_sampler).__name__})")
    sampler = loader.sampler
    if type(sampler) is DistributedSampler:
        sampler = DataParallelSampler(sampler.dataset, num_replicas=sampler.num_replicas, rank=sampler.rank,
                                      shuffle=sampler.shuffle, seed=sampler.seed, drop_last=sampler.drop_last)
        loader = update_dataloader(loader, sampler, mode=RunningStage.TRAINING)
    elif not isinstance(sampler, DataParallelSampler):
        return _not_resumable(loader, f"has its own sampler ({_sampler_name(sampler)})")
    if loader.drop_last and len(sampler) < loader.batch_size:  # Lightning: "No training batches", and exit 0
        raise ValueError(f"the training DataLoader gives no batch: {len(sampler)} samples on each of "
                         f"{sampler.num_replicas} data-parallel ranks, fewer than its batch_size={loader.batch_size} "
                         "(drop_last=True). Use a smaller batch size, or more data.")
    position = DataPosition(trainer, sampler, loader.batch_size, loader.drop_last)
    # instance attributes: Lightning's `_Stateful` check (a Protocol) accepts them, and the loader keeps its class
    loader.state_dict = position.state_dict
    loader.load_state_dict = position.load_state_dict
    return loader


def keep_epoch_count(trainer: Any) -> None:
    """Keep an epoch that a ``max_steps`` stop cuts short open in ``trainer``'s fit loop, and continue the progress
    bar where a mid-epoch resume picks the epoch up. Once per trainer; nothing without a fit loop.

    Lightning counts the cut epoch as processed and completed when fit stops: ``current_epoch`` then names the next
    epoch in the checkpoint saved at the end and in the resumed run. Undoing those two counts leaves the state of a
    checkpoint saved after the epoch's last trained batch, which Lightning resumes mid-epoch, in the same epoch.
    Lightning's bar is not told about such a resume (``on_train_epoch_start`` is skipped): it is started here, with
    the total of the uninterrupted epoch.
    """
    fit_loop = getattr(trainer, "fit_loop", None)
    if fit_loop is None or getattr(fit_loop, "_lightning_par_epoch_count", False):
        return
    fit_loop._lightning_par_epoch_count = True
    advance_start, advance_end = fit_loop.on_advance_start, fit_loop.on_advance_end

    def on_advance_start() -> None:
        resumed_mid_epoch = fit_loop.restarted_mid_epoch
        advance_start()
        if resumed_mid_epoch:
            _continue_progress_bar(trainer)

    def on_advance_end() -> None:
        batches = fit_loop.epoch_loop.batch_progress.current
        cut = 0 <= fit_loop.max_steps <= trainer.global_step and batches.ready < trainer.num_training_batches
        advance_end()
        if cut:
            for counts in (fit_loop.epoch_progress.current, fit_loop.epoch_progress.total):
                counts.processed -= 1
                counts.completed -= 1

    fit_loop.on_advance_start, fit_loop.on_advance_end = on_advance_start, on_advance_end


def _continue_progress_bar(trainer: Any) -> None:
    """Start Lightning's bar (tqdm or rich) on a resumed epoch, its total the uninterrupted epoch's: Lightning's
    ``total_train_batches`` under ``max_steps`` counts the steps left from now, not from the epoch's start."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    bar = trainer.progress_bar_callback
    if bar is None:
        return
    bar.on_train_epoch_start(trainer, trainer.lightning_module)
    total = bar.total_train_batches
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    if total < trainer.num_training_batches:  # counted from now: add the steps this epoch already made
        total = min(trainer.num_training_batches, total + done // trainer.accumulate_grad_batches)
    total = None if total == float("inf") else total
    if isinstance(bar, TQDMProgressBar) and bar.train_progress_bar is not None:
        bar.train_progress_bar.total = total
        bar.train_progress_bar.n = done
    elif isinstance(bar, RichProgressBar) and bar.progress is not None and bar.train_progress_bar_id is not None:
        bar.progress.update(bar.train_progress_bar_id, total=total, completed=done)


def _not_resumable(loader: Any, what: str) -> Any:
    _warnings.warn(
        f"lightning-par cannot save the position of the training data in an epoch: the training loader {what}. "
        "A run resumed from a checkpoint saved mid-epoch will replay that epoch from its start. A DataLoader with "
        "a plain or shuffled sampler is positioned (lightning-par gives it a resumable sampler), as is one with "
        "lightning_par.run.data_order.DataParallelSampler or torchdata's StatefulDataLoader."
    )
    return loader


def _sampler_name(sampler: Any) -> str:
    """The user's sampler's class, also inside the DistributedSamplerWrapper Lightning puts around it."""
    if isinstance(sampler, DistributedSamplerWrapper):
        inner = getattr(sampler.dataset, "_sampler", sampler)
        return f"{type(inner).__name__}, in Lightning's DistributedSamplerWrapper"
    return type(sampler).__name__


class DataPosition:
    """Where a training loader stands in its global order, as Lightning's progress counters say.

    Args:
        trainer: the Trainer whose fit loop counts the batches.
        sampler: the loader's sampler.
        batch_size: the loader's per-rank batch size.
        drop_last: whether the loader drops a last, partial batch.
    """

    def __init__(self, trainer: Any, sampler: DataParallelSampler, batch_size: int, drop_last: bool = False) -> None:
        self.trainer = trainer
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.global_batch = batch_size * sampler.num_replicas

    def _loader_batches(self) -> int:
        whole, rest = divmod(len(self.sampler), self.batch_size)
        return whole + (1 if rest and not self.drop_last else 0)

    def epoch_samples(self) -> tuple[int, bool]:
        """``(samples, whole)``: the global samples an epoch of this run trains, and whether they are whole loader
        batches (not so when the epoch ends in a partial one)."""
        batches = self.trainer.num_training_batches
        whole = len(self.sampler) // self.batch_size
        if batches <= whole:
            return int(batches) * self.global_batch, True
        return self.sampler.total_size, False

    def resume_point(self) -> tuple[int, int, bool]:
        """``(epoch, batches, ended)``: where the epoch that a fit resumed from a checkpoint saved now continues, in
        the sampler's epochs and in batches of it already trained -- the count Lightning's restarted loop starts
        from -- and whether that epoch's loop has ended.

        Lightning counts a batch as trained once ``processed`` (a checkpoint saved from ``on_train_batch_end`` has
        its optimizer step; ``completed`` is raised after that hook). A restarted epoch continues at that count,
        except when the checkpoint was saved from the last batch's ``on_train_batch_end``: then the next epoch starts
        afresh. After an epoch's loop has ended (saved at the epoch's end, after validation, after ``fit``), its
        batches stay counted until the next epoch starts, and Lightning resumes into that epoch, at its end (under
        the next epoch number if the epoch was closed): that iteration is given nothing, and the next epoch follows,
        as in the uninterrupted run.
        """
        fit_loop = self.trainer.fit_loop
        epochs = fit_loop.epoch_progress.current
        batches = fit_loop.epoch_loop.batch_progress.current
        if epochs.ready > epochs.started:  # an epoch is being started: its sampler epoch is set, no batch yet
            return self.sampler.epoch, 0, False
        if batches.processed >= self.trainer.num_training_batches:
            if batches.completed < batches.processed:
                return self.sampler.epoch + 1, 0, False
            return self.sampler.epoch, batches.processed, True
        return self.sampler.epoch, batches.processed, False

    def state_dict(self) -> dict[str, Any]:
        epoch, batches, ended = self.resume_point()
        epoch_samples, epoch_whole = self.epoch_samples()
        return {"epoch": epoch, "consumed_samples": batches * self.global_batch, "epoch_ended": ended,
                "global_batch": self.global_batch, "seed": self.sampler.seed, "shuffle": self.sampler.shuffle,
                "dataset_length": self.sampler.dataset_length,
                # what an attempt on another world size needs to keep the run's function (elastic.py)
                "accumulate_grad_batches": self.trainer.accumulate_grad_batches,
                "world_size": self.trainer.world_size, "epoch_samples": epoch_samples, "epoch_whole": epoch_whole}

    def _keep_epoch(self, state: dict[str, Any], elastic: bool) -> None:
        """Make this run's epochs the checkpoint's: the same samples, so the same optimizer steps. Another
        loader-global batch splits the global order into another number of loader batches (a dropped last batch,
        padding), and an elastic attempt's pinned epoch must stay pinned when the next attempt resumes it."""
        if "epoch_samples" not in state:
            return
        samples, whole = int(state["epoch_samples"]), bool(state["epoch_whole"])
        limit = self.trainer.limit_train_batches
        unlimited = isinstance(limit, float) and limit == 1.0
        if not elastic and (not unlimited or state["dataset_length"] != self.sampler.dataset_length):
            return  # the same loader batch: an epoch changed by the user's own settings is theirs to change
        fail = f"lightning-par cannot resume as the same run: the checkpoint's epoch is {samples} samples"
        if elastic and not unlimited:
            raise ValueError(f"{fail}, and limit_train_batches={limit} counts loader batches, which hold "
                             f"{self.global_batch} samples here and {state['global_batch']} in the checkpoint's run: "
                             "leave limit_train_batches unset in an elastic job (docs/elastic.md), or keep the "
                             "loader-global batch (per-rank batch x data-parallel size).")
        natural = self._loader_batches()
        natural_whole = self.drop_last or len(self.sampler) % self.batch_size == 0
        if (samples, whole) == (natural * self.global_batch if natural_whole else self.sampler.total_size,
                                natural_whole):
            return  # this run's epochs are the checkpoint's already
        if not whole or samples % self.global_batch or samples // self.global_batch > natural:
            why = ("ending in a partial loader batch, which another loader batch does not reproduce: give the "
                   "training DataLoader drop_last=True" if not whole else
                   f"(the global order cut to it), which this run cannot split into whole loader batches of "
                   f"{self.global_batch} ({natural} of them here): change the per-rank batch")
            raise ValueError(f"{fail} {why}, or keep the loader-global batch ({state['global_batch']} samples: "
                             "per-rank batch x data-parallel size).")
        self.sampler.pin_epoch(samples)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not {"epoch", "consumed_samples", "global_batch"} <= set(state):
            _warnings.warn(
                "The checkpoint's data position has no samples consumed or global batch (saved by an older version): "
                "the position in its epoch cannot be kept. The epoch restarts from its first batch, and the global "
                "batch is this run's (batch_size x data-parallel size x accumulate_grad_batches).")
            return
        epoch, consumed = int(state["epoch"]), int(state["consumed_samples"])
        self.sampler.seed = int(state["seed"])  # the order the checkpoint's run followed, whatever seed this run set
        if not state["epoch_ended"] and not 0 <= consumed < self.sampler.total_size:
            # the sampler would yield nothing: a silent skip of the epoch
            checkpoint = getattr(self.trainer, "ckpt_path", None) or "The checkpoint"
            raise ValueError(
                f"{checkpoint}: its data position, {consumed} samples into epoch {epoch}, is not inside an epoch of "
                f"this data ({self.sampler.total_size} samples): the checkpoint is damaged or from other data. "
                "Resume from another checkpoint.")
        accumulate = None
        if state["global_batch"] != self.global_batch:
            # another loader-global batch (the world changed): keep the optimizer step's, and the position in samples
            accumulate = elastic.keep_step_batch(self.trainer, state, self.global_batch, self.batch_size,
                                                 self.sampler.num_replicas)
            if accumulate is None and consumed and not state["epoch_ended"]:
                raise ValueError(
                    f"The checkpoint was saved {consumed} samples into epoch {epoch}, in global batches of "
                    f"{state['global_batch']} samples; this run's global batch is {self.global_batch} (per-rank batch "
                    f"{self.batch_size} x data-parallel size {self.sampler.num_replicas}), and the checkpoint (an "
                    "older one) does not say its gradient accumulation, so the samples per optimizer step cannot be "
                    "kept: keep batch_size x data-parallel size, or resume from a checkpoint saved at an epoch's end.")
            if accumulate is not None:
                self._keep_epoch(state, elastic=True)
            if consumed:  # mid-epoch, or at the end of the epoch Lightning resumes into
                elastic.rewrite_batch_counters(self.trainer, consumed, int(state["global_batch"]), self.global_batch)
        else:
            self._keep_epoch(state, elastic=False)
        elastic.report_attempt(self.trainer, state, accumulate)
        if state["epoch_ended"]:  # Lightning resumes at the end of this epoch: nothing of it is left
            self.sampler.resume(epoch, self.sampler.total_size)
            return
        if consumed and (state["dataset_length"], state["shuffle"]) != (self.sampler.dataset_length,
                                                                         self.sampler.shuffle):
            _warnings.warn(
                f"The checkpoint's training data had {state['dataset_length']} samples (shuffle={state['shuffle']}), "
                f"this run's has {self.sampler.dataset_length} (shuffle={self.sampler.shuffle}): epoch {epoch} "
                f"continues after {consumed} samples of the new order, which is not the order the checkpoint's run "
                "trained in.")
        self.sampler.resume(epoch, consumed)
