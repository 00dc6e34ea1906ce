"""Byte-level text data for the GPT: tokenizer, default corpus and a Lightning data module.

The corpus is read with Hugging Face ``datasets`` (one example per document), split into train and
validation by whole documents, tokenized to UTF-8 bytes and packed into fixed-length blocks. Every
step goes through ``Dataset.map`` so the result is fingerprinted and cached on disk: the first run
(``prepare_data`` on local rank 0) does the work, every later load (``setup`` on each rank) reads
the cache.
"""

from __future__ import annotations

import contextlib
import glob
import math
import os
import sysconfig
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_par.parallel.data_order import DataParallelSampler
from lightning_par.strategies.data_position import resumable_train_loader

VOCAB_SIZE = 256
# Byte written after every document when documents are concatenated; NUL never occurs in normal text,
# so the model can learn it as an end-of-document marker.
DOC_SEPARATOR = 0
# Documents packed together per ``map`` batch; the tail shorter than one block is dropped per batch.
_PACK_DOCS_PER_BATCH = 1000


class ByteTokenizer:
    """Tokenizer whose tokens are the UTF-8 bytes of the text (vocabulary of 256)."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Return the UTF-8 bytes of ``text`` as a list of ints in ``[0, 256)``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Any) -> str:
        """Turn byte ids (list, tensor or array) back into text; invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")


def default_corpus_files(max_bytes: int) -> list[str]:
    """Return the embedded default corpus: the Python standard library's top-level ``*.py`` files.

    They are real text present on every machine with Python, so training needs no download. Files are
    taken in name order (for determinism) until their total size reaches ``max_bytes``.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    stdlib = sysconfig.get_paths()["stdlib"]
    try:
        names = sorted(name for name in os.listdir(stdlib) if name.endswith(".py"))
    except OSError as err:
        raise FileNotFoundError(f"cannot list the Python standard library at {stdlib!r}: {err}") from err
    files: list[str] = []
    total = 0
    for name in names:
        path = os.path.join(stdlib, name)
        if not os.path.isfile(path):
            continue
        files.append(path)
        total += os.path.getsize(path)
        if total >= max_bytes:
            break
    if not files:
        raise FileNotFoundError(
            f"no *.py files found in the Python standard library at {stdlib!r}; pass data_files=... instead"
        )
    return files


def _resolve_data_files(data_files: str | list[str]) -> list[str]:
    """Expand paths, globs and directories into a sorted, de-duplicated list of existing files."""
    patterns = [data_files] if isinstance(data_files, str) else list(data_files)
    if not patterns:
        raise ValueError("data_files is empty")
    files: set[str] = set()
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        matches = glob.glob(pattern, recursive=True) if glob.has_magic(pattern) else [pattern]
        found = False
        for match in matches:
            if os.path.isdir(match):
                for root, _, names in os.walk(match):
                    for name in names:
                        files.add(os.path.abspath(os.path.join(root, name)))
                        found = True
            elif os.path.isfile(match):
                files.add(os.path.abspath(match))
                found = True
        if not found:
            raise FileNotFoundError(f"data_files entry {pattern!r} matches no file")
    return sorted(files)


def _import_datasets(offline: bool) -> Any:
    """Import ``datasets``, first switching it to offline mode when only local files are needed.

    ``datasets`` reads ``HF_DATASETS_OFFLINE`` once, at import time, so it must be set before the first
    import. A value the user set is left alone.
    """
    if offline:
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    return datasets


@contextlib.contextmanager
def _quiet(datasets: Any) -> Iterator[None]:
    """Hide ``datasets`` progress bars for the duration, restoring the previous setting afterwards."""
    if datasets.are_progress_bars_disabled():
        yield
        return
    with warnings.catch_warnings():  # an env var override makes this a warned no-op
        warnings.simplefilter("ignore")
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            datasets.enable_progress_bars()


def _pack_documents(batch: dict[str, list], text_column: str, block_size: int) -> dict[str, np.ndarray]:
    """``Dataset.map`` function: concatenate documents as bytes and cut them into ``block_size`` blocks."""
    buffer = bytearray()
    for text in batch[text_column]:
        if text:
            buffer += text.encode("utf-8")
            buffer.append(DOC_SEPARATOR)
    usable = len(buffer) // block_size * block_size
    blocks = np.frombuffer(bytes(buffer[:usable]), dtype=np.uint8).reshape(-1, block_size)
    return {"input_ids": blocks}


class NextByteDataset(Dataset):
    """Map-style dataset of ``(inputs, targets)`` pairs, targets being inputs shifted left by one byte.

    Args:
        blocks: a Hugging Face dataset with an ``input_ids`` column of ``seq_len + 1`` bytes per row,
            formatted as torch.
    """

    def __init__(self, blocks: Any) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.blocks[int(index)]["input_ids"].long()
        return block[:-1], block[1:]


def collate_pairs(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``(inputs, targets)`` pairs into a ``(inputs [B, T], targets [B, T])`` tuple.

    Torch's default collate would return a list here, not a tuple.
    """
    inputs, targets = zip(*batch, strict=True)
    return torch.stack(inputs), torch.stack(targets)


def collate_hf_dict(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack ``(inputs, targets)`` pairs into a batch as Hugging Face collators make it for causal LMs:
    ``{"input_ids", "labels", "attention_mask"}`` of shape ``[B, seq_len + 1]``.

    ``input_ids`` and ``labels`` are the whole block (inputs plus the last target byte), since a Hugging Face model
    shifts the labels itself: the loss covers the same ``seq_len`` next-byte targets as the tuple form.
    """
    inputs, targets = collate_pairs(batch)
    blocks = torch.cat([inputs, targets[:, -1:]], dim=1)
    return {"input_ids": blocks, "labels": blocks.clone(), "attention_mask": torch.ones_like(blocks)}


BATCH_FORMATS = {"tuple": collate_pairs, "dict": collate_hf_dict}


class TextDataModule(L.LightningDataModule):
    """Byte-level language-modelling data: documents packed into fixed-length blocks of bytes.

    Batches are tuples ``(inputs, targets)`` of int64 tensors of shape ``[batch_size, seq_len]`` where
    ``targets`` is ``inputs`` shifted by one byte; with ``batch_format="dict"``, dicts as Hugging Face collators
    make them (see :func:`collate_hf_dict`). Validation documents are held out whole (the last
    ``ceil(val_fraction * n)`` documents), so no text is shared between the splits; a corpus of a single
    document is split by blocks instead (the last blocks form the validation split).

    Args:
        data_files: Local text file(s), glob pattern(s) or directories, one document per file. ``None``
            (with no ``dataset_name``) uses the embedded default corpus: the Python standard library's
            own source files, which needs no download.
        dataset_name: Name of a Hugging Face Hub dataset (needs network access); its ``train`` split is
            used, one row per document. Mutually exclusive with ``data_files``.
        text_column: Column holding the text in a Hub dataset.
        seq_len: Number of tokens (bytes) per training example.
        batch_size: Examples per batch on each data-parallel rank.
        val_fraction: Fraction of documents held out for validation, in ``(0, 1)``; at least one.
        max_corpus_bytes: Approximate size of the default corpus in bytes (ignored otherwise).
        shuffle: Shuffle the training examples each epoch.
        num_workers: DataLoader worker processes.
        cache_dir: Where ``datasets`` caches the loaded and packed data; ``None`` uses its default
            (``~/.cache/huggingface/datasets`` or ``$HF_DATASETS_CACHE``).
        batch_format: ``"tuple"``: ``(inputs, targets)``; ``"dict"``: ``{"input_ids", "labels",
            "attention_mask"}`` with labels in Hugging Face's convention (the model shifts them).
    """

    def __init__(
        self,
        data_files: str | list[str] | None = None,
        dataset_name: str | None = None,
        text_column: str = "text",
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_corpus_bytes: int = 2_000_000,
        shuffle: bool = True,
        num_workers: int = 0,
        cache_dir: str | None = None,
        batch_format: str = "tuple",
    ) -> None:
        super().__init__()
        if batch_format not in BATCH_FORMATS:
            raise ValueError(f"batch_format must be one of {sorted(BATCH_FORMATS)}, got {batch_format!r}")
        if data_files is not None and dataset_name is not None:
            raise ValueError("pass either data_files or dataset_name, not both")
        if seq_len <= 0:
            raise ValueError(f"seq_len must be positive, got {seq_len}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if max_corpus_bytes <= 0:
            raise ValueError(f"max_corpus_bytes must be positive, got {max_corpus_bytes}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.save_hyperparameters()
        self.data_files = data_files
        self.dataset_name = dataset_name
        self.text_column = text_column
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_corpus_bytes = max_corpus_bytes
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.cache_dir = cache_dir
        self.batch_format = batch_format
        self.tokenizer = ByteTokenizer()
        # Resolve local files now so a typo fails at construction, not after the trainer has started.
        self.files: list[str] | None = None
        if dataset_name is None:
            if data_files is None:
                self.files = default_corpus_files(max_corpus_bytes)
            else:
                self.files = _resolve_data_files(data_files)
        self.train_dataset: NextByteDataset | None = None
        self.val_dataset: NextByteDataset | None = None

    @property
    def vocab_size(self) -> int:
        """Number of distinct tokens (256 bytes)."""
        return VOCAB_SIZE

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch on one data-parallel rank."""
        return self.batch_size * self.seq_len

    def _load_documents(self, datasets: Any) -> Any:
        """Load the corpus as a ``datasets.Dataset`` with one row per document."""
        if self.files is not None:
            # Text builder, one example per file; "replace" keeps a stray non-UTF-8 byte from aborting.
            return datasets.load_dataset(
                "text",
                data_files=self.files,
                sample_by="document",
                encoding_errors="replace",
                split="train",
                cache_dir=self.cache_dir,
            )
        docs = datasets.load_dataset(self.dataset_name, split="train", cache_dir=self.cache_dir)
        if self.text_column not in docs.column_names:
            raise ValueError(
                f"dataset {self.dataset_name!r} has no column {self.text_column!r}; "
                f"columns are {docs.column_names}; set text_column"
            )
        return docs

    def _pack(self, docs: Any, datasets: Any, split: str) -> Any:
        block_size = self.seq_len + 1
        features = datasets.Features({"input_ids": datasets.List(datasets.Value("uint8"), length=block_size)})
        return docs.map(
            _pack_documents,
            batched=True,
            batch_size=_PACK_DOCS_PER_BATCH,
            remove_columns=docs.column_names,
            features=features,
            fn_kwargs={"text_column": self.text_column, "block_size": block_size},
            desc=f"Packing {split} bytes",
        )

    def _build(self) -> tuple[Any, Any]:
        """Load, split and pack the corpus; returns ``(train_blocks, val_blocks)`` (cached by ``datasets``)."""
        datasets = _import_datasets(offline=self.files is not None)
        with _quiet(datasets):
            docs = self._load_documents(datasets)
            n_docs = len(docs)
            if n_docs == 0:
                raise ValueError("the corpus contains no documents")
            if n_docs >= 2:
                n_val = min(max(1, math.ceil(self.val_fraction * n_docs)), n_docs - 1)
                train = self._pack(docs.select(range(n_docs - n_val)), datasets, "train")
                val = self._pack(docs.select(range(n_docs - n_val, n_docs)), datasets, "validation")
            else:
                # One document cannot be split by document: hold out its last blocks instead.
                blocks = self._pack(docs, datasets, "all")
                n_blocks = len(blocks)
                if n_blocks < 2:
                    raise ValueError(
                        f"the single document gives {n_blocks} block(s) of {self.seq_len + 1} bytes; "
                        "need at least 2 to split into train and validation"
                    )
                n_val = min(max(1, math.ceil(self.val_fraction * n_blocks)), n_blocks - 1)
                train = blocks.select(range(n_blocks - n_val))
                val = blocks.select(range(n_blocks - n_val, n_blocks))
        for name, split in (("train", train), ("validation", val)):
            if len(split) == 0:
                raise ValueError(
                    f"the {name} split holds no block of {self.seq_len + 1} bytes; "
                    "use more or longer documents, a smaller seq_len or a different val_fraction"
                )
        return train.with_format("torch"), val.with_format("torch")

    def prepare_data(self) -> None:
        """Load, tokenize and pack once (local rank 0), filling the ``datasets`` cache."""
        self._build()

    def setup(self, stage: str | None = None) -> None:
        """Load both splits (from the cache when ``prepare_data`` ran)."""
        if self.train_dataset is None or self.val_dataset is None:
            train, val = self._build()
            self.train_dataset = NextByteDataset(train)
            self.val_dataset = NextByteDataset(val)

    def _loader(self, dataset: Dataset | None, shuffle: bool, drop_last: bool,
                sampler: DataParallelSampler | None = None) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before requesting a dataloader")
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle if sampler is None else False,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            collate_fn=BATCH_FORMATS[self.batch_format],
        )

    def _data_parallel_sampler(self, dataset: Dataset) -> DataParallelSampler | None:
        """The training sampler: this data-parallel rank's share of one global order, resumable mid-epoch.

        The order depends only on the seed (``PL_GLOBAL_SEED``, set by ``seed_everything``), the epoch and the
        dataset, not on the layout: one process and any number of data-parallel ranks see the same global batches.
        Built here for every trainer, one process included, so ``shuffle=False`` stays meaningful (Lightning would
        inject a shuffling sampler under a distributed strategy) and the position is saved in checkpoints
        (:func:`~lightning_par.strategies.data_position.resumable_train_loader`). The split is by data-parallel
        rank, from the strategy's ``distributed_sampler_kwargs``. ``None`` where the Trainer has
        ``use_distributed_sampler=False`` under a distributed strategy: the user shards the data then.
        """
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        if kwargs and not trainer._accelerator_connector.use_distributed_sampler:
            return None
        seed = int(os.getenv("PL_GLOBAL_SEED", "0"))
        return DataParallelSampler(dataset, shuffle=self.shuffle, seed=seed, **(kwargs or {}))

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise RuntimeError("call setup() before requesting a dataloader")
        sampler = self._data_parallel_sampler(self.train_dataset)
        loader = self._loader(self.train_dataset, shuffle=self.shuffle, drop_last=True, sampler=sampler)
        if sampler is not None and self.trainer is not None:
            loader = resumable_train_loader(loader, self.trainer)
        return loader

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False, drop_last=False)

    def test_dataloader(self) -> DataLoader:
        """The validation split (the corpus has no separate test split)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """One batch of the first validation examples."""
        if self.val_dataset is None:
            raise RuntimeError("call setup() before requesting a dataloader")
        count = min(self.batch_size, len(self.val_dataset))
        subset = torch.utils.data.Subset(self.val_dataset, range(count))
        return self._loader(subset, shuffle=False, drop_last=False)
