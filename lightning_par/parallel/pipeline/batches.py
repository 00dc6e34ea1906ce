"""What a pipeline can cut into micro-batches: the batch forms a LightningModule's dataloader yields.

A pipeline schedule feeds the model's inputs to the first stage and the targets to the last stage's
``loss_fn(outputs, targets)``, cut along the batch dimension, so the strategy must know which part of a batch is
which. :func:`split_batch` accepts:

* ``(inputs, targets)``: a tuple or list of two tensors [B, ...], as ``lightning_par.data.TextDataModule`` yields;
  returned as they are;
* a dict as Hugging Face collators make it: ``input_ids`` and ``labels`` [B, T] and optionally ``attention_mask``
  [B, T]. The labels follow Hugging Face's convention (aligned with ``input_ids``; the model shifts them, ``-100``
  is ignored), so they are returned shifted to next-token targets, ``targets[:, t] = labels[:, t + 1]`` and ``-100``
  at the last position: the targets a tuple batch has, and what ``transformers``' own causal-LM loss compares the
  logits with. An all-ones mask is dropped; a mask with zeros (padding) comes back with the ids as the inputs
  ``{"input_ids": ..., "attention_mask": ...}``, which the pipeline cuts like the ids and gives to every stage.

With a LightningModule's ``loss_fn`` the loss the pipeline reports is the mean of the micro-batch losses (as with
gradient accumulation): with ``-100`` labels spread unevenly over the micro-batches it is not the token mean over the
whole batch. A Hugging Face step (``self.model(**batch).loss``, no ``loss_fn``) gets the model's own loss and the
token mean over the whole batch (:mod:`.loss`): the model is called with the unshifted labels, which it shifts itself.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_par.topology import LayoutError

IGNORE_INDEX = -100
ACCEPTED_FORMS = (
    "a tuple (inputs, targets) of two tensors",
    "a dict with 'input_ids' and 'labels' tensors and optionally 'attention_mask' (Hugging Face collators)",
)
DICT_KEYS = ("input_ids", "labels", "attention_mask")


def _refuse(what: str) -> LayoutError:
    return LayoutError(f"pipeline parallel cannot split {what} into micro-batches: it accepts "
                       f"{' or '.join(ACCEPTED_FORMS)}.")


def next_token_targets(labels: Tensor) -> Tensor:
    """Hugging Face causal-LM labels (aligned with the inputs) as next-token targets: shifted left by one,
    ``-100`` at the last position."""
    pad = torch.full_like(labels[..., :1], IGNORE_INDEX)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def split_batch(batch: Any) -> tuple[Tensor | dict[str, Tensor], Tensor]:
    """``(inputs, targets)`` of a batch, or a :class:`LayoutError` naming the forms a pipeline accepts.

    ``inputs`` is a tensor, or ``{"input_ids", "attention_mask"}`` for a dict batch whose mask has zeros.
    """
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
            return batch[0], batch[1]
        kinds = ", ".join(type(t).__name__ for t in batch)
        raise _refuse(f"a {type(batch).__name__} of {len(batch)} ({kinds})")
    if not isinstance(batch, Mapping):
        raise _refuse(f"a batch of type {type(batch).__name__}")
    missing = [k for k in ("input_ids", "labels") if not isinstance(batch.get(k), Tensor)]
    if missing:
        raise _refuse(f"a dict batch without {' and '.join(map(repr, missing))} tensors (its keys: "
                      f"{sorted(map(str, batch))})")
    unknown = sorted(str(k) for k in batch if k not in DICT_KEYS)
    if unknown:
        raise LayoutError(f"pipeline parallel passes only {list(DICT_KEYS)} of a dict batch through the stages, but "
                          f"this batch also has {unknown}; drop them in the collator (the model would not see them).")
    ids, labels, mask = batch["input_ids"], batch["labels"], batch.get("attention_mask")
    for name, tensor in (("labels", labels), ("attention_mask", mask)):
        if tensor is not None and (not isinstance(tensor, Tensor) or tensor.shape != ids.shape):
            shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise LayoutError(f"the batch's {name} has shape {shape} but its input_ids {tuple(ids.shape)}; a dict "
                              "batch needs them of one shape [batch, sequence].")
    if ids.dim() != 2:
        raise LayoutError(f"the batch's input_ids have shape {tuple(ids.shape)}; a dict batch holds token ids "
                          "[batch, sequence].")
    targets = next_token_targets(labels)
    if mask is None or bool(mask.bool().all()):
        return ids, targets
    return {"input_ids": ids, "attention_mask": mask}, targets


@contextmanager
def unpacked_batch_errors(batch: Any) -> Generator[None, None, None]:
    """Python's error for ``self.model(**batch)`` on a tuple or list batch names the model by its whole repr (a
    module has no ``__qualname__``): replaced by one line naming the batch forms, on the step's own traceback."""
    try:
        yield
    except TypeError as error:
        if "argument after ** must be a mapping" not in str(error) or not isinstance(batch, (tuple, list)):
            raise
        kinds = ", ".join(type(t).__name__ for t in batch)
        raise TypeError(
            f"the step calls the model with **batch, which needs a dict, but the batch is a {type(batch).__name__} "
            f"of {len(batch)} ({kinds}), e.g. TextDataModule's default (inputs, targets). A Hugging Face model takes "
            "a dict of 'input_ids', 'labels' and optionally 'attention_mask': give --data.batch_format=dict "
            "(TextDataModule(batch_format='dict')), or unpack the pair in the step: inputs, targets = batch."
        ).with_traceback(error.__traceback__) from None
