"""How the layouts cut a batch: into micro-batches for a pipeline, along the sequence for context parallel.

:func:`split_batch` cuts nothing itself (the schedule cuts its result into micro-batches); :func:`shard_sequence`
keeps a context-parallel rank's share of every sequence. Both accept the batch forms a LightningModule's dataloader
yields.

A pipeline schedule feeds the model's inputs to the first stage and the targets to the last stage's
``loss_fn(outputs, targets)``, cut along the batch dimension, so the strategy must know which part of a batch is
which. :func:`split_batch` accepts:

* ``(inputs, targets)``: a tuple or list of two tensors [B, ...], as ``lightning_par.data.TextDataModule`` yields;
  returned as they are;
* ``(inputs, targets, position_ids)``: packed documents (``TextDataModule(pack_documents=True)``), each token's
  position in its document; returned as ``({"input_ids": inputs, "position_ids": position_ids}, targets)``, the
  positions cut into micro-batches like the ids and given to every stage (whose attention keeps to documents);
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
from typing import Any, NamedTuple

import torch
from torch import Tensor

from lightning_par.topology import LayoutError

IGNORE_INDEX = -100
ACCEPTED_FORMS = (
    "a tuple (inputs, targets) of two tensors, or (inputs, targets, position_ids) of packed documents",
    "a dict with 'input_ids' and 'labels' tensors and optionally 'attention_mask' and 'position_ids' (Hugging Face "
    "collators)",
)
DICT_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


def _refuse(what: str) -> LayoutError:
    return LayoutError(f"pipeline parallel cannot split {what} into micro-batches: it accepts "
                       f"{' or '.join(ACCEPTED_FORMS)}.")


def next_token_targets(labels: Tensor) -> Tensor:
    """Hugging Face causal-LM labels (aligned with the inputs) as next-token targets: shifted left by one,
    ``-100`` at the last position."""
    pad = torch.full_like(labels[..., :1], IGNORE_INDEX)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def sequence_ids(position_ids: Tensor) -> Tensor | None:
    """Which packed sequence (document) each token of ``position_ids`` [B, T] belongs to, numbered from 0 in each row:
    a new one starts wherever the position does not follow the one before by 1 (transformers' rule,
    ``masking_utils.find_packed_sequence_indices``). None when every row holds one sequence."""
    first = position_ids[..., :1] - 1
    ids = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    return ids if bool((ids[..., -1] > 0).any()) else None


def _check_positions(positions: Any, ids: Tensor) -> None:
    if not isinstance(positions, Tensor) or positions.shape != ids.shape or positions.is_floating_point():
        shape = tuple(positions.shape) if isinstance(positions, Tensor) else type(positions).__name__
        raise LayoutError(f"the batch's position_ids ({shape}) must be integer positions shaped like its token ids "
                          f"{tuple(ids.shape)} [batch, sequence].")


def split_batch(batch: Any) -> tuple[Tensor | dict[str, Tensor], Tensor]:
    """``(inputs, targets)`` of a batch, or a :class:`LayoutError` naming the forms a pipeline accepts.

    ``inputs`` is a tensor, or a dict with ``input_ids`` and what the model needs with them: ``attention_mask`` (a
    dict batch whose mask has zeros), ``position_ids`` (packed documents).
    """
    if isinstance(batch, (tuple, list)):
        if len(batch) == 2 and all(isinstance(t, Tensor) for t in batch):
            return batch[0], batch[1]
        if len(batch) == 3 and all(isinstance(t, Tensor) for t in batch):
            _check_positions(batch[2], batch[0])
            return {"input_ids": batch[0], "position_ids": batch[2]}, batch[1]
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
    positions = batch.get("position_ids")
    for name, tensor in (("labels", labels), ("attention_mask", mask), ("position_ids", positions)):
        if tensor is not None and (not isinstance(tensor, Tensor) or tensor.shape != ids.shape):
            shape = tuple(tensor.shape) if isinstance(tensor, Tensor) else type(tensor).__name__
            raise LayoutError(f"the batch's {name} has shape {shape} but its input_ids {tuple(ids.shape)}; a dict "
                              "batch needs them of one shape [batch, sequence].")
    if ids.dim() != 2:
        raise LayoutError(f"the batch's input_ids have shape {tuple(ids.shape)}; a dict batch holds token ids "
                          "[batch, sequence].")
    targets = next_token_targets(labels)
    extra = {} if positions is None else {"position_ids": positions}
    if mask is None or bool(mask.bool().all()):
        return ({"input_ids": ids, **extra} if extra else ids), targets
    return {"input_ids": ids, "attention_mask": mask, **extra}, targets


def check_sequence_length(seq_len: int, cp: int) -> None:
    """The sequence must cut into ``2 * cp`` equal chunks (causal load balancing)."""
    if seq_len % (2 * cp):
        raise LayoutError(
            f"context parallel cp={cp} cuts each sequence into 2 * cp = {2 * cp} equal chunks (rank i keeps chunks i "
            f"and {2 * cp - 1} - i, balancing the causal attention), but the batch's sequence length is {seq_len}. "
            f"Use a sequence length divisible by {2 * cp} (e.g. {seq_len + (-seq_len) % (2 * cp)}).")


def shard_positions(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> Tensor:
    """The global positions cp rank ``rank`` holds of a sequence of ``seq_len``: chunks ``rank`` and
    ``2 * cp - 1 - rank`` of ``2 * cp``, in that order (every rank as many cheap early queries of the causal
    attention as expensive late ones)."""
    check_sequence_length(seq_len, cp)
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def refuse_padding(mask: Tensor) -> None:
    """Context parallel attends causally over sequence order: a padding ``attention_mask`` (zeros) is refused."""
    if not bool(mask.bool().all()):
        raise LayoutError(
            "context parallel attends over the whole sequence with a causal mask over sequence order; a padding "
            "attention_mask (zeros) is not supported. Pack the sequences to full length (no padding), or train this "
            "data without cp.")


class SequenceShard(NamedTuple):
    """What :func:`shard_sequence` made: the rank's ``batch``, the global ``positions`` of its tokens ([T / cp]; a
    batch's own ``position_ids`` cut, [B, T / cp], for packed documents), and for a dict batch with labels the
    next-token ``targets`` of its share, shifted on the whole sequence."""

    batch: Any
    positions: Tensor
    targets: Tensor | None


def shard_sequence(batch: Any, cp: int, rank: int, padding_checked: bool = False) -> SequenceShard:
    """Context parallel rank ``rank``'s share of ``batch`` (a tuple ``(inputs, targets)`` or a Hugging Face dict),
    each sequence cut into ``2 * cp`` chunks of which it keeps ``rank`` and ``2 * cp - 1 - rank``. A dict's
    ``attention_mask`` is checked for padding unless ``padding_checked`` (on the host already). Anything else is
    refused."""
    if isinstance(batch, (tuple, list)) and len(batch) in (2, 3) and all(isinstance(t, Tensor) for t in batch):
        inputs, targets = batch[:2]
        if inputs.dim() != 2 or targets.shape != inputs.shape:
            raise LayoutError(f"context parallel cuts a batch (inputs, targets) of token ids [batch, sequence]; "
                              f"got shapes {tuple(inputs.shape)} and {tuple(targets.shape)}.")
        index = shard_positions(inputs.size(1), cp, rank, device=inputs.device)
        if len(batch) == 3:  # packed documents: each token's position in its document, cut alike
            _check_positions(batch[2], inputs)
            cut = [t[:, index] for t in batch]
            return SequenceShard(type(batch)(cut), cut[2], None)
        return SequenceShard(type(batch)((inputs[:, index], targets[:, index])), index, None)
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), Tensor):
        return _shard_dict(batch, cp, rank, padding_checked)
    raise LayoutError(
        f"context parallel cuts each sequence of a batch over the cp ranks; it accepts a tuple (inputs, targets) "
        f"of token-id tensors or a Hugging Face dict with 'input_ids' (and 'labels', 'attention_mask', "
        f"'position_ids'), not {type(batch).__name__}.")


def _shard_dict(batch: Mapping[str, Any], cp: int, rank: int, padding_checked: bool) -> SequenceShard:
    ids = batch["input_ids"]
    if ids.dim() != 2:
        raise LayoutError(f"context parallel: input_ids must be [batch, sequence], got {tuple(ids.shape)}.")
    mask = batch.get("attention_mask")
    if isinstance(mask, Tensor) and not padding_checked:
        refuse_padding(mask)  # (on an accelerator this waits for the device)
    labels = batch.get("labels")
    targets = next_token_targets(labels) if isinstance(labels, Tensor) else None
    if targets is not None and ids.size(1) % (2 * cp) == 1:
        # seq_len + 1 tokens (the labels aligned with the inputs): the last token has no target and no earlier
        # token attends to it, so it is dropped, exactly, and the rest cut evenly
        batch = {k: v[:, :-1] if isinstance(v, Tensor) and v.dim() >= 2 and v.shape[:2] == ids.shape else v
                 for k, v in batch.items()}
        ids, targets = batch["input_ids"], targets[:, :-1]
    index = shard_positions(ids.size(1), cp, rank, device=ids.device)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, Tensor) and value.dim() >= 2 and value.shape[:2] == ids.shape:
            out[key] = value[:, index]
        elif isinstance(value, Tensor) and value.dim() >= 1 and value.size(-1) == ids.size(1):
            raise LayoutError(f"context parallel cannot cut the batch's {key!r} of shape {tuple(value.shape)}: "
                              f"only [batch, sequence, ...] tensors shaped like input_ids {tuple(ids.shape)}.")
        else:
            out[key] = value
    positions = index
    if isinstance(out.get("position_ids"), Tensor) and out["position_ids"].dim() == 2:
        positions = out["position_ids"]  # every row's: packed rows differ
    # the model shifts labels inside its loss; shifted above on the whole sequence, then cut
    return SequenceShard(out, positions, targets[:, index] if targets is not None else None)


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
