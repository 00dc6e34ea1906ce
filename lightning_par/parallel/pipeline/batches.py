"""What a pipeline can cut into micro-batches: the batch forms a LightningModule's dataloader yields.

A pipeline schedule feeds tensors to the first stage and targets to the last, cut along the batch dimension, so
the strategy must know which part of a batch is the model's input and which the target. Accepted forms:

* ``(inputs, targets)`` (a tuple or list of two tensors), as ``lightning_par.data.TextDataModule`` yields;
* a dict as Hugging Face collators make it: ``input_ids`` and ``labels`` (an ``attention_mask`` of all ones is
  accepted and dropped).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from lightning_par.topology import LayoutError

ACCEPTED_FORMS = ("(inputs, targets) tensors", "a dict with 'input_ids' and 'labels' (Hugging Face collators)")


def split_batch(batch: Any) -> tuple[Tensor, Tensor]:
    """``(inputs, targets)`` of a batch, or a :class:`LayoutError` naming the forms a pipeline accepts."""
    if isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
        return batch[0], batch[1]
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor) and isinstance(
            batch.get("labels"), Tensor):
        return batch["input_ids"], batch["labels"]
    raise LayoutError(f"pipeline parallel cannot split a batch of type {type(batch).__name__}: it accepts "
                      f"{' or '.join(ACCEPTED_FORMS)}.")
