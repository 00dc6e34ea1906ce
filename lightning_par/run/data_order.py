"""The order of the training samples under data parallelism: one global order per epoch, resumable anywhere in it.

An epoch's global order depends only on ``(seed, epoch, dataset length)`` -- a permutation drawn from a generator
seeded with ``seed + epoch``, or ``0 .. n-1`` without shuffling -- never on how many data-parallel ranks read it.
Rank ``r`` of ``W`` takes positions ``r, r + W, r + 2W, ...``, so with a per-rank batch ``b`` the ranks' ``g``-th
batches together hold positions ``[g*b*W, (g+1)*b*W)``: the global batch a single process with batch ``b*W`` draws,
whatever ``W`` is. This is :class:`~torch.utils.data.DistributedSampler`'s split (and its order, for the same seed),
so a run that used Lightning's injected sampler continues with the same batches.

What DistributedSampler lacks is a position: :meth:`DataParallelSampler.resume` makes the next epoch's iteration
start ``consumed`` global samples in, which is how a run resumed from a mid-epoch checkpoint trains on exactly the
samples the uninterrupted run would have, under any layout with the same global batch.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DistributedSampler


class DataParallelSampler(DistributedSampler):
    """This rank's share of each epoch's global sample order, able to start an epoch part-way through.

    Args:
        dataset: a sized dataset (only its length is read).
        num_replicas: data-parallel size ``W`` (1 for one process).
        rank: this rank's data-parallel rank, in ``[0, W)``.
        shuffle: draw a new permutation per epoch (seeded by ``seed + epoch``); otherwise dataset order.
        seed: the shuffle seed, the same on every rank.
        drop_last: drop the tail that does not divide by ``W`` instead of padding it with the epoch's first samples
            (as DistributedSampler; only the last ``< W`` positions of an epoch depend on ``W``).

    ``len()`` is always a whole epoch's share, also when an epoch was resumed part-way: a trainer counts the batches
    it already did and stops the resumed epoch by that count (Lightning's fit loop does).
    """

    def __init__(self, dataset: Sized, num_replicas: int = 1, rank: int = 0, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False) -> None:
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, num_replicas) and num_replicas >= 1, got rank={rank}, "
                             f"num_replicas={num_replicas}")
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self._start: tuple[int, int] | None = None  # (epoch, consumed): where the next iteration of `epoch` begins
        self._epoch_offset = 0  # this sampler's epoch minus the caller's epoch number (see resume)
        self._align_epoch = False

    @property
    def dataset_length(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def global_order(self, epoch: int) -> list[int]:
        """The whole epoch's sample indices in global order, padded or cut to a multiple of ``num_replicas``."""
        n = self.dataset_length
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        if len(order) >= self.total_size:
            return order[:self.total_size]
        repeats = math.ceil(self.total_size / max(len(order), 1))
        return (order * repeats)[:self.total_size]  # pad with the epoch's first samples (again, if n < W)

    def pin_epoch(self, samples: int) -> None:
        """Make every epoch ``samples`` positions of the global order (cut, or padded as above), whatever the dataset
        length: an elastic resume keeps the epoch of the run it continues, which another per-rank split (padding,
        a dropped last batch) would make longer or shorter (docs/elastic.md)."""
        if samples <= 0 or samples % self.num_replicas:
            raise ValueError(f"an epoch of {samples} samples is not a positive multiple of the data-parallel size "
                             f"{self.num_replicas}")
        self.total_size, self.num_samples = samples, samples // self.num_replicas

    def resume(self, epoch: int, consumed: int) -> None:
        """Start the next iteration ``consumed`` global samples into ``epoch``.

        The next :meth:`set_epoch` call names the epoch the caller is about to run; it is taken to be ``epoch``
        and later numbers keep that distance (Lightning alone numbers an epoch that a ``max_steps`` stop cut short
        as finished, and runs the rest of it under the next number: checkpoints saved without
        :func:`~lightning_par.run.data_position.keep_epoch_count` still resume on the right samples).
        """
        if consumed < 0 or consumed % self.num_replicas:
            raise ValueError(f"consumed={consumed} must be a non-negative multiple of the data-parallel size "
                             f"{self.num_replicas} (whole global batches)")
        self.epoch = epoch
        self._start = (epoch, consumed)
        self._align_epoch = True

    def set_epoch(self, epoch: int) -> None:
        if self._align_epoch:
            self._epoch_offset = self.epoch - epoch
            self._align_epoch = False
        self.epoch = epoch + self._epoch_offset

    def __iter__(self) -> Iterator[int]:
        consumed = 0
        if self._start is not None and self._start[0] == self.epoch:
            consumed = self._start[1]
        self._start = None  # one iteration starts part-way; the next ones start at the beginning
        return iter(self.global_order(self.epoch)[consumed + self.rank::self.num_replicas])
