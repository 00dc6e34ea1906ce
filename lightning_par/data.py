"""Text data for language models: a Lightning data module over local files, byte-level or with a Hugging Face tokenizer.

The corpus is read with Hugging Face ``datasets`` (one example per document: a text file, or a record of JSON
lines / JSON / parquet / CSV / Arrow files), split into train and validation by whole documents, tokenized --
to UTF-8 bytes by default, or by a Hugging Face tokenizer with the end-of-sequence token after every document --
and packed into fixed-length blocks. Every step goes through ``Dataset.map`` so the result is fingerprinted and
cached on disk (memory-mapped Arrow): the first run (``prepare_data`` on local rank 0 of each node) does the work,
every later load (``setup`` on each rank, after Lightning's barrier) reads the cache.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import inspect
import json
import math
import os
import sysconfig
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_par._compat import uses_distributed_sampler
from lightning_par.run.data_order import DataParallelSampler
from lightning_par.run.data_position import resumable_train_loader

VOCAB_SIZE = 256
# Byte written after every document when documents are concatenated; NUL never occurs in normal text,
# so the model can learn it as an end-of-document marker.
DOC_SEPARATOR = 0
# Documents packed together per ``map`` batch; the tail shorter than one block is dropped per batch.
_PACK_DOCS_PER_BATCH = 1000
#: ``datasets`` builders by file suffix (after a compression suffix); any other file is one text document
_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst", ".lz4")
#: the data module's checkpoint state: the tokenizer's files, so the checkpoint carries its tokenizer
#: (``lightning-par export --hf`` writes them beside the model)
TOKENIZER_STATE = "tokenizer_files"


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


def load_tokenizer(tokenizer: Any, trust_remote_code: bool = False) -> Any:
    """A Hugging Face tokenizer: ``tokenizer`` itself, or ``AutoTokenizer.from_pretrained`` of a local directory.

    It must have an end-of-sequence token (written after every document) and a length (its vocabulary, added
    tokens included). A directory whose configuration names its own Python classes (``auto_map``) is refused unless
    ``trust_remote_code``: transformers would run that code (left to itself, it asks "[y/N]" on every rank).
    """
    if isinstance(tokenizer, str | os.PathLike):
        path = os.path.expanduser(os.fspath(tokenizer))
        if not os.path.isdir(path):
            raise FileNotFoundError(f"tokenizer={path!r} is not a directory: pass a local directory written by "
                                    "save_pretrained (tokenizer.json, tokenizer_config.json ...) or a tokenizer object")
        try:
            from transformers import AutoTokenizer
        except ImportError as err:  # an optional dependency: the byte-level default needs none
            raise ImportError(f"tokenizer={path!r} is loaded with transformers' AutoTokenizer, which is not installed: "
                              "pip install 'lightning-par[hf]' (or transformers)") from err

        if not trust_remote_code:
            refuse_remote_code(path, "tokenizer", "--data.trust_remote_code=true")
        try:
            tokenizer = as_written(AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code), path)
        except ValueError as err:  # custom code found where refuse_remote_code did not look: one line, not three
            if "trust_remote_code" not in str(err):
                raise
            raise ValueError(f"tokenizer={path!r} needs custom code to load, which is not run unless asked for: pass "
                             "--data.trust_remote_code=true (TextDataModule(trust_remote_code=True)) if you trust "
                             "that directory.") from None
    if not callable(tokenizer) or not hasattr(tokenizer, "__len__"):
        raise TypeError(f"tokenizer must be a Hugging Face tokenizer or a directory path, got {type(tokenizer)!r}")
    if getattr(tokenizer, "eos_token_id", None) is None:
        raise ValueError(f"the tokenizer ({type(tokenizer).__name__}) has no eos_token, which is written after every "
                         "document; set one (tokenizer.eos_token = '...') and save it again")
    return tokenizer


def as_written(tokenizer: Any, path: str | os.PathLike) -> Any:
    """``tokenizer`` (what ``AutoTokenizer.from_pretrained(path)`` gave), or the tokenizer ``path/tokenizer.json``
    describes where they differ.

    transformers 5 gives some families their own class whatever the directory's tokenizer_config.json names (a
    directory whose config.json is a Qwen2 model gets Qwen2Tokenizer), and such a class rebuilds its normalizer and
    pre-tokenizer from the family's rules, keeping only the vocabulary and merges: a tokenizer trained with other
    rules then splits the same text into other tokens. A directory that ``lightning-par export --hf`` wrote is such a
    case; its files are loaded as written (``PreTrainedTokenizerFast``), so a run from it tokenizes as the run that
    trained it."""
    file = os.path.join(os.fspath(path), "tokenizer.json")
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not os.path.isfile(file):
        return tokenizer
    with open(file, encoding="utf-8") as handle:
        written = json.load(handle)
    loaded = json.loads(backend.to_str())
    if all(loaded.get(key) == written.get(key) for key in ("normalizer", "pre_tokenizer", "added_tokens")):
        return tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(os.fspath(path))


#: lines a tokenizer is checked on (export --hf): words, digits, punctuation, contractions, spaces, newlines, Unicode
TOKENIZER_PROBE = (
    "def f(x): return x**2 + 10.5  # it's 2024, isn't it?",
    "Hello, World! THE quick brown fox -- jumps over 123 lazy dogs.\n\n\tIndented line;  two  spaces",
    "Ünïcödé café naïve 東京 😀 ... \"quoted\" [brackets] {braces} <angle> I'M YOU'LL WE'VE",
)


def refuse_remote_code(path: str | os.PathLike, what: str, option: str) -> None:
    """Refuse the local Hugging Face directory ``path`` when its configuration names Python code of its own
    (``auto_map`` in ``tokenizer_config.json`` or ``config.json``), which loading it would run; ``option`` is how the
    user allows it."""
    for name in ("tokenizer_config.json", "config.json"):
        file = os.path.join(path, name)
        try:
            with open(file, encoding="utf-8") as stream:
                code = json.load(stream).get("auto_map")
        except (OSError, ValueError, AttributeError):
            continue  # absent or unreadable: transformers' own loading says what is wrong with it
        if code:
            classes = sorted({c for v in code.values() for c in (v if isinstance(v, list) else [v]) if c})
            raise ValueError(f"{what}={os.fspath(path)!r}: {file} names custom code ({', '.join(classes)}) that "
                             f"loading it would run: refused. Pass {option} if you trust that directory.")


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what the tokenizer does (its vocabulary, rules and special tokens), not of where it was loaded
    from: the key of the tokenized cache."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    probe = tokenizer("Probe: the tokenizer's own framing of a document.")["input_ids"]
    parts = [type(tokenizer).__name__, rules, str(len(tokenizer)), str(tokenizer.eos_token_id), str(probe)]
    return hashlib.sha256("\0".join(parts).encode("utf-8")).hexdigest()[:16]


def tokenizer_files(tokenizer: Any) -> dict[str, str | bytes]:
    """The files ``tokenizer.save_pretrained`` writes, by name: text as ``str``, anything else as ``bytes``."""
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        files: dict[str, str | bytes] = {}
        for root, _, names in os.walk(folder):
            for name in sorted(names):
                path = os.path.join(root, name)
                data = open(path, "rb").read()  # noqa: SIM115 -- read at once, closed by refcount
                try:
                    files[os.path.relpath(path, folder)] = data.decode("utf-8")
                except UnicodeDecodeError:
                    files[os.path.relpath(path, folder)] = data
    return files


def write_tokenizer_files(files: dict[str, str | bytes], out_dir: str | os.PathLike) -> list[str]:
    """Write :func:`tokenizer_files` into ``out_dir`` (which ``AutoTokenizer.from_pretrained`` then loads)."""
    written = []
    for name, data in sorted(files.items()):
        path = os.path.join(out_dir, name)
        if os.path.isabs(name) or os.pardir in name.replace("\\", "/").split("/"):
            raise ValueError(f"refusing the tokenizer file name {name!r}: not a plain relative name")
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w" if isinstance(data, str) else "wb", **({"encoding": "utf-8"} if isinstance(data, str)
                                                                   else {})) as file:
            file.write(data)
        written.append(name)
    return written


def padded_vocab_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


def tokenizer_vocab_size(tokenizer: Any, pad_vocab_to: int) -> int:
    """The vocabulary a model of a tokenizer's data needs: the tokenizer's length (added tokens included) rounded up
    to a multiple of ``pad_vocab_to`` (``TextDataModule.vocab_size``; the planner reads a fit config's with it)."""
    return padded_vocab_size(len(tokenizer), pad_vocab_to)


def vocab_size_from_data(module: L.LightningModule, given: int | None, default: int = VOCAB_SIZE) -> int:
    """The vocabulary a model builds: ``given``, else its trainer's data module's ``vocab_size``, else ``default``.

    For the example models' ``vocab_size=None``: called in ``configure_model`` (Lightning runs it after the data
    module's ``setup``), so the model follows the data's tokenizer. A ``given`` size smaller than the data's
    token ids (``token_vocab_size``, or ``vocab_size``) is refused: those tokens would index past the embedding.
    """
    trainer = getattr(module, "_trainer", None)
    data = getattr(trainer, "datamodule", None) if trainer is not None else None
    data_size = getattr(data, "vocab_size", None)
    if given is None:
        return int(data_size) if data_size is not None else default
    needed = getattr(data, "token_vocab_size", data_size)
    if needed is not None and given < needed:
        raise ValueError(f"the model's vocab_size={given} is smaller than the data's vocabulary ({needed} token ids, "
                         f"from {type(data).__name__}); leave vocab_size unset to take the data's ({data_size})")
    return given


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


def _pack_tokens(batch: dict[str, list], text_column: str, block_size: int, tokenizer: Any, eos_id: int,
                 dtype: str) -> dict[str, np.ndarray]:
    """``Dataset.map`` function: tokenize documents (with the tokenizer's own special tokens, e.g. a BOS), end each
    with EOS, concatenate and cut into ``block_size`` blocks (the tail shorter than a block is dropped)."""
    texts = [text for text in batch[text_column] if text]
    ids: list[int] = []
    for doc in tokenizer(texts)["input_ids"] if texts else []:
        ids += doc
        if not doc or doc[-1] != eos_id:
            ids.append(eos_id)
    usable = len(ids) // block_size * block_size
    return {"input_ids": np.asarray(ids[:usable], dtype=dtype).reshape(-1, block_size)}


def _builder(files: list[str]) -> str:
    """The ``datasets`` builder of local files, by suffix: json, parquet, csv, arrow, else text (a file per
    document); one builder for all of them."""
    def kind(path: str) -> str:
        name = path.lower()
        for suffix in _COMPRESSION:
            name = name.removesuffix(suffix)
        return _BUILDERS.get(os.path.splitext(name)[1], "text")

    kinds = {kind(path): path for path in files}
    if len(kinds) > 1:
        raise ValueError("data_files mixes formats: " + ", ".join(f"{k} ({v})" for k, v in sorted(kinds.items()))
                         + "; pass files of one format")
    return next(iter(kinds))


class DataError(ValueError):
    """A data file the run cannot read; the message names the file, where in it, and the fix. Every rank raises the
    same one (``lightning-par`` prints it as one ``error:`` line)."""


def _bad_file(files: list[str], builder: str) -> str | None:
    """What makes one of ``files`` unreadable by ``builder``, naming it: empty (no record), or, for the record
    formats read as UTF-8 (JSON, CSV), a byte that is not UTF-8 (its line and column). ``None``: none of that."""
    for file in files:
        compressed = file.lower().endswith(_COMPRESSION)  # not looked into: datasets decompresses them itself
        if os.path.getsize(file) == 0 or (not compressed and builder in ("json", "csv") and _blank(file)):
            return (f"{file} is empty: it holds no {'record' if builder != 'text' else 'text'}; remove it from "
                    "data_files or fill it")
        if compressed or builder not in ("json", "csv"):
            continue
        with open(file, "rb") as stream:
            for number, line in enumerate(stream, start=1):
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as err:
                    return (f"{file}, line {number}, column {err.start + 1}: byte 0x{line[err.start]:02x} is not "
                            "UTF-8, which JSON and CSV files must be; convert the file (e.g. iconv -f latin1 -t "
                            "utf-8) or fix that line")
    return None


def _blank(file: str) -> bool:
    with open(file, "rb") as stream:
        return all(not chunk.strip() for chunk in iter(lambda: stream.read(1 << 20), b""))


class NextTokenDataset(Dataset):
    """Map-style dataset of ``(inputs, targets)`` pairs, targets being inputs shifted left by one token.

    Args:
        blocks: a Hugging Face dataset with an ``input_ids`` column of ``seq_len + 1`` tokens per row,
            formatted as torch.
    """

    def __init__(self, blocks: Any) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.blocks[int(index)]["input_ids"].long()
        return block[:-1], block[1:]


NextByteDataset = NextTokenDataset  # its name when tokens were only bytes

#: the target of a token that ends a document (what follows is another document): not counted
IGNORE_INDEX = -100


def document_positions(block: torch.Tensor, separator: int) -> torch.Tensor:
    """Each token's position in its document, for a block of packed documents: 0 at the block's first token and
    after every ``separator`` (the token that ends each document), counting up from there."""
    index = torch.arange(block.size(-1), device=block.device)
    starts = torch.ones_like(block, dtype=torch.bool)
    starts[..., 1:] = block[..., :-1] == separator
    return index - torch.cummax(torch.where(starts, index, 0), dim=-1).values


class PackedDocuments(Dataset):
    """Map-style dataset of ``(block, position_ids)`` of packed documents: a block of ``seq_len + 1`` tokens and each
    token's position in its document (:func:`document_positions`); :data:`PACKED_BATCH_FORMATS` makes the batches.

    Args:
        blocks: as :class:`NextTokenDataset` takes them.
        separator: the token that ends every document (NUL bytes, or the tokenizer's EOS).
    """

    def __init__(self, blocks: Any, separator: int) -> None:
        self.blocks = blocks
        self.separator = separator

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.blocks[int(index)]["input_ids"].long()
        return block, document_positions(block, self.separator)


class _StreamedPairs(IterableDataset):
    """``(inputs, targets)`` pairs of a streamed (``datasets.IterableDataset``) corpus of packed blocks, its shuffle
    drawn anew each epoch (the trainer's epoch, read when an iteration starts)."""

    def __init__(self, blocks: Any, trainer: Any = None, limit: int | None = None,
                 separator: int | None = None) -> None:
        self.blocks = blocks
        self.trainer = trainer
        self.limit = limit
        self.separator = separator  # packed documents: yield (block, position_ids) as PackedDocuments does

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.trainer is not None:
            self.blocks.set_epoch(self.trainer.current_epoch)
        for count, row in enumerate(self.blocks):
            if self.limit is not None and count >= self.limit:
                return
            block = torch.as_tensor(row["input_ids"]).long()
            if self.separator is not None:
                yield block, document_positions(block, self.separator)
            else:
                yield block[:-1], block[1:]


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


def collate_packed(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack :class:`PackedDocuments` items into ``(inputs, targets, position_ids)`` [B, seq_len]: the target of a
    document's last token (the first token of the next document) is ``-100``, so each document's loss is what it
    would be on its own."""
    blocks, positions = (torch.stack(t) for t in zip(*batch, strict=True))
    targets = blocks[:, 1:].masked_fill(positions[:, 1:] == 0, IGNORE_INDEX)
    return blocks[:, :-1], targets, positions[:, :-1]


def collate_packed_hf_dict(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack :class:`PackedDocuments` items as transformers' ``DataCollatorWithFlattening`` makes packed batches:
    ``{"input_ids", "labels", "position_ids"}`` [B, seq_len + 1], labels ``-100`` at each document's first token, and
    no ``attention_mask`` (transformers finds the documents from the positions only without one)."""
    blocks, positions = (torch.stack(t) for t in zip(*batch, strict=True))
    labels = blocks.masked_fill(positions == 0, IGNORE_INDEX)
    labels[:, 0] = blocks[:, 0]  # (never a target: the model shifts the labels)
    return {"input_ids": blocks, "labels": labels, "position_ids": positions}


PACKED_BATCH_FORMATS = {"tuple": collate_packed, "dict": collate_packed_hf_dict}


class TextDataModule(L.LightningDataModule):
    """Language-modelling data: documents tokenized and packed into fixed-length blocks of tokens.

    Batches are tuples ``(inputs, targets)`` of int64 tensors of shape ``[batch_size, seq_len]`` where
    ``targets`` is ``inputs`` shifted by one token; with ``batch_format="dict"``, dicts as Hugging Face collators
    make them (see :func:`collate_hf_dict`). Validation documents are held out whole (the last
    ``ceil(val_fraction * n)`` documents), so no text is shared between the splits; a corpus of a single
    document is split by blocks instead (the last blocks form the validation split).

    Without ``tokenizer`` the tokens are UTF-8 bytes (vocabulary 256) and a NUL byte ends each document. With one
    (a Hugging Face tokenizer, or the directory ``AutoTokenizer.from_pretrained`` loads) each document is tokenized
    with the tokenizer's own special tokens (e.g. Llama's BOS) and ends with its EOS token; ``vocab_size`` is the
    tokenizer's length rounded up to ``pad_vocab_to`` (tensor parallelism needs tp to divide it), which the example
    models take when their ``vocab_size`` is left unset. The tokenizer's files are saved in checkpoints, so
    ``lightning-par export --hf`` writes them beside the model.

    Tokenizing runs once: in ``prepare_data`` (local rank 0 of each node; the others wait at Lightning's barrier),
    cached by ``datasets`` (memory-mapped Arrow files under ``cache_dir``) under a key of the files (paths, sizes
    and modification times), the tokenizer's rules, ``seq_len`` and the split; ``setup`` on every rank reads that
    cache; nodes that share one filesystem tokenize once in all with ``prepare_data_per_node = False`` (Lightning's
    data module attribute). The training order is :class:`~lightning_par.run.data_order.DataParallelSampler`'s:
    the same global batches under any data-parallel size, and a checkpoint saved mid-epoch resumes exactly.

    ``streaming=True`` reads the files as they are iterated (``datasets``' IterableDataset), for corpora larger than
    memory or disk cache: nothing is cached, documents are tokenized on the fly, and the training split is sharded
    over the data-parallel ranks by ``datasets.distributed.split_dataset_by_node``: whole files per rank (each rank
    tokenizes and packs its own files) when the number of files divides by the data-parallel size, else every rank
    reads and packs every file and keeps every ``dp``-th block. Shuffling is approximate (a buffer of
    ``shuffle_buffer`` blocks, reseeded each epoch). The validation split is the last ``ceil(val_fraction *
    n_files)`` files (streaming needs at least two files). A streamed epoch has no length, so set ``max_steps``; and
    it has no position: a resumed run starts the epoch's stream again from its beginning (a warning says so) -- use
    the map-style default when a resume must continue exactly.

    Args:
        data_files: Local file(s), glob pattern(s) or directories. JSON lines / JSON / parquet / CSV / Arrow files
            hold one document per record (its ``text_field``); any other file is one text document. ``None``
            (with no ``dataset_name``) uses the embedded default corpus: the Python standard library's
            own source files, which needs no download.
        dataset_name: Name of a Hugging Face Hub dataset (needs network access); its ``train`` split is
            used, one row per document. Mutually exclusive with ``data_files``.
        text_field: The field (column) holding the text in records and Hub datasets.
        tokenizer: A Hugging Face tokenizer, or the path of a local directory that
            ``transformers.AutoTokenizer.from_pretrained`` loads; ``None``: UTF-8 bytes.
        seq_len: Number of tokens per training example.
        batch_size: Examples per batch on each data-parallel rank.
        val_fraction: Fraction of documents held out for validation, in ``(0, 1)``; at least one.
        max_corpus_bytes: Approximate size of the default corpus in bytes (ignored otherwise).
        shuffle: Shuffle the training examples each epoch.
        num_workers: DataLoader worker processes.
        cache_dir: Where ``datasets`` caches the loaded and packed data; ``None`` uses its default
            (``~/.cache/huggingface/datasets`` or ``$HF_DATASETS_CACHE``).
        batch_format: ``"tuple"``: ``(inputs, targets)``; ``"dict"``: ``{"input_ids", "labels",
            "attention_mask"}`` with labels in Hugging Face's convention (the model shifts them).
        pad_vocab_to: With a tokenizer, ``vocab_size`` is its length rounded up to a multiple of this (64: any
            power-of-two tp up to 64 divides it); 1 keeps the tokenizer's length.
        streaming: Read the corpus as a stream (see above) instead of caching it.
        shuffle_buffer: Blocks in the streaming shuffle buffer.
        num_proc: Processes that tokenize the corpus in ``prepare_data`` (``None``: this one).
        trust_remote_code: Load a tokenizer directory that ships its own Python code (``auto_map``), running that
            code on every rank; refused by default.
        pack_documents: Keep attention within each document of a packed block: batches carry each token's position
            in its document (restarting after every NUL byte / EOS token and at the block's start), as
            ``(inputs, targets, position_ids)`` (dict: ``{"input_ids", "labels", "position_ids"}``, no
            ``attention_mask``), and the target that would cross into the next document is ``-100``: each
            document's loss is what it would be alone. The model must take them (the example models do; another
            LightningModule is refused at setup unless it sets ``takes_position_ids = True``).
    """

    def __init__(
        self,
        data_files: str | list[str] | None = None,
        dataset_name: str | None = None,
        text_field: str = "text",
        tokenizer: Any = None,
        seq_len: int = 128,
        batch_size: int = 8,
        val_fraction: float = 0.05,
        max_corpus_bytes: int = 2_000_000,
        shuffle: bool = True,
        num_workers: int = 0,
        cache_dir: str | None = None,
        batch_format: str = "tuple",
        pad_vocab_to: int = 64,
        streaming: bool = False,
        shuffle_buffer: int = 10_000,
        num_proc: int | None = None,
        trust_remote_code: bool = False,
        pack_documents: bool = False,
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
        if pad_vocab_to < 1:
            raise ValueError(f"pad_vocab_to must be >= 1, got {pad_vocab_to}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1, got {shuffle_buffer}")
        if num_proc is not None and num_proc < 1:
            raise ValueError(f"num_proc must be None or >= 1, got {num_proc}")
        if streaming and dataset_name is not None:
            raise ValueError("streaming reads local data_files; a Hub dataset is loaded and cached (streaming=False)")
        # a tokenizer object is not a hyper-parameter a checkpoint can hold (its files are in the state instead)
        self.save_hyperparameters(ignore=["tokenizer"])
        self.hparams["tokenizer"] = os.fspath(tokenizer) if isinstance(tokenizer, str | os.PathLike) else None
        self.data_files = data_files
        self.dataset_name = dataset_name
        self.text_field = text_field
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.max_corpus_bytes = max_corpus_bytes
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.cache_dir = cache_dir
        self.batch_format = batch_format
        self.pad_vocab_to = pad_vocab_to
        self.streaming = streaming
        self.shuffle_buffer = shuffle_buffer
        self.num_proc = num_proc
        self.pack_documents = pack_documents
        # loaded now, so a wrong path or a tokenizer without EOS fails at construction
        self.tokenizer = ByteTokenizer() if tokenizer is None else load_tokenizer(tokenizer, trust_remote_code)
        self._tokenizer_key = None if tokenizer is None else tokenizer_fingerprint(self.tokenizer)
        self._saved_tokenizer: dict[str, str | bytes] | None = None  # its files, made on the first checkpoint
        # Resolve local files now so a typo fails at construction, not after the trainer has started.
        self.files: list[str] | None = None
        if dataset_name is None:
            if data_files is None:
                self.files = default_corpus_files(max_corpus_bytes)
            else:
                self.files = _resolve_data_files(data_files)
            if streaming and len(self.files) < 2:
                raise ValueError("streaming splits train and validation by file and needs at least two files; got "
                                 f"{self.files}: split the corpus into files, or use streaming=False")
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None

    @property
    def byte_level(self) -> bool:
        return self._tokenizer_key is None

    @property
    def token_vocab_size(self) -> int:
        """Token ids in the data are below this: the tokenizer's length (added tokens included), or 256."""
        return VOCAB_SIZE if self.byte_level else len(self.tokenizer)

    @property
    def vocab_size(self) -> int:
        """The vocabulary a model of this data needs: 256 bytes, or the tokenizer's length padded to a multiple of
        ``pad_vocab_to``."""
        if self.byte_level:
            return VOCAB_SIZE
        return tokenizer_vocab_size(self.tokenizer, self.pad_vocab_to)

    @property
    def document_separator(self) -> int:
        """The token that ends every document: the NUL byte, or the tokenizer's EOS."""
        return DOC_SEPARATOR if self.byte_level else int(self.tokenizer.eos_token_id)

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens in one batch on one data-parallel rank."""
        return self.batch_size * self.seq_len

    def _builder_and_column(self) -> tuple[str, str]:
        builder = _builder(self.files)
        return builder, ("text" if builder == "text" else self.text_field)

    def _load_documents(self, datasets: Any, files: list[str] | None = None, streaming: bool = False) -> Any:
        """Load the corpus (or ``files`` of it) as a ``datasets`` dataset with one row per document."""
        if self.files is not None:
            builder, column = self._builder_and_column()
            # Text builder, one example per file; "replace" keeps a stray non-UTF-8 byte from aborting.
            options = {"sample_by": "document", "encoding_errors": "replace"} if builder == "text" else {}
            docs = datasets.load_dataset(builder, data_files=files or self.files, split="train",
                                         cache_dir=self.cache_dir, streaming=streaming, **options)
            what = f"the {builder} files ({(files or self.files)[0]} ...)"
        else:
            column = self.text_field
            docs = datasets.load_dataset(self.dataset_name, split="train", cache_dir=self.cache_dir)
            what = f"dataset {self.dataset_name!r}"
        columns = docs.column_names if docs.column_names is not None else list(docs.features or {})
        if column not in columns:
            raise ValueError(f"{what} have no field {column!r}; their fields are {columns}; set text_field")
        return docs

    def _pack_function(self) -> tuple[Any, dict[str, Any], Any]:
        """``(function, fn_kwargs, features)`` of the packing ``map``."""
        datasets = _import_datasets(offline=self.files is not None)
        block_size = self.seq_len + 1
        column = self._builder_and_column()[1] if self.files is not None else self.text_field
        if self.byte_level:
            dtype = "uint8"
            function, kwargs = _pack_documents, {"text_column": column, "block_size": block_size}
        else:
            dtype = "uint16" if self.token_vocab_size <= 2**16 else "int32"
            function, kwargs = _pack_tokens, {"text_column": column, "block_size": block_size,
                                              "tokenizer": self.tokenizer, "eos_id": int(self.tokenizer.eos_token_id),
                                              "dtype": dtype}
        features = datasets.Features({"input_ids": datasets.List(datasets.Value(dtype), length=block_size)})
        return function, kwargs, features

    def _pack(self, docs: Any, datasets: Any, split: str) -> Any:
        function, kwargs, features = self._pack_function()
        options: dict[str, Any] = {}
        if not self.byte_level:
            # datasets cannot hash a tokenizer reliably (its fingerprint would change from run to run, and nothing
            # would be cached): the key is the documents' own fingerprint (files, split), the tokenizer's rules and
            # the block size
            key = f"{docs._fingerprint}-{self._tokenizer_key}-{self.seq_len}-{split}"
            options["new_fingerprint"] = hashlib.sha256(key.encode()).hexdigest()[:16]
        return docs.map(
            function,
            batched=True,
            batch_size=_PACK_DOCS_PER_BATCH,
            remove_columns=docs.column_names,
            features=features,
            fn_kwargs=kwargs,
            num_proc=self.num_proc if len(docs) >= 2 * (self.num_proc or 1) else None,
            desc=f"Packing {split} {'bytes' if self.byte_level else 'tokens'}",
            **options,
        )

    def _build(self) -> tuple[Any, Any]:
        """Load, split and pack the corpus; returns ``(train_blocks, val_blocks)`` (cached by ``datasets``)."""
        try:
            return self._build_splits()
        except Exception:
            # datasets' own errors name no file (an empty one ends in a bare StopIteration): look for the file
            # only once something failed, so a good corpus is never read twice
            problem = _bad_file(self.files, self._builder_and_column()[0]) if self.files is not None else None
            if problem is None:
                raise
            raise DataError(problem) from None

    def _build_splits(self) -> tuple[Any, Any]:
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
                        f"the single document gives {n_blocks} block(s) of {self.seq_len + 1} tokens; "
                        "need at least 2 to split into train and validation"
                    )
                n_val = min(max(1, math.ceil(self.val_fraction * n_blocks)), n_blocks - 1)
                train = blocks.select(range(n_blocks - n_val))
                val = blocks.select(range(n_blocks - n_val, n_blocks))
        for name, split in (("train", train), ("validation", val)):
            if len(split) == 0:
                raise ValueError(
                    f"the {name} split holds no block of {self.seq_len + 1} tokens; "
                    "use more or longer documents, a smaller seq_len or a different val_fraction"
                )
        return train.with_format("torch"), val.with_format("torch")

    def _stream(self, files: list[str], train: bool) -> Any:
        """Streamed packed blocks of ``files``: for training, this data-parallel rank's share, shuffled."""
        datasets = _import_datasets(offline=True)
        docs = self._load_documents(datasets, files, streaming=True)
        columns = docs.column_names
        ranks = self.trainer.distributed_sampler_kwargs if train and self.trainer is not None else None
        if ranks:  # by files when they divide among the ranks; else datasets keeps every dp-th packed block
            from datasets.distributed import split_dataset_by_node

            docs = split_dataset_by_node(docs, rank=ranks["rank"], world_size=ranks["num_replicas"])
        function, kwargs, features = self._pack_function()
        blocks = docs.map(function, batched=True, batch_size=_PACK_DOCS_PER_BATCH, remove_columns=columns,
                          features=features, fn_kwargs=kwargs)
        if train and self.shuffle:
            blocks = blocks.shuffle(seed=int(os.getenv("PL_GLOBAL_SEED", "0")), buffer_size=self.shuffle_buffer)
        return blocks

    def prepare_data(self) -> None:
        """Load, tokenize and pack once (local rank 0), filling the ``datasets`` cache."""
        if not self.streaming:
            try:
                self._build()
            except DataError as error:
                trainer = getattr(self, "trainer", None)
                if trainer is None or trainer.world_size <= 1:
                    raise
                # the other ranks wait at Lightning's barrier after this hook: raised in `setup`, after it, where
                # every rank's own `_build` finds the same file -- one line on every rank, none blaming rank 0
                self._prepare_error = error

    def setup(self, stage: str | None = None) -> None:
        """Load both splits (from the cache when ``prepare_data`` ran)."""
        if self.train_dataset is not None and self.val_dataset is not None:
            return
        error, self._prepare_error = getattr(self, "_prepare_error", None), None
        if error is not None:
            raise error
        separator = self.document_separator if self.pack_documents else None
        if self.streaming:
            n_val = min(max(1, math.ceil(self.val_fraction * len(self.files))), len(self.files) - 1)
            self.train_dataset = _StreamedPairs(self._stream(self.files[:-n_val], train=True), self.trainer,
                                                separator=separator)
            self.val_dataset = _StreamedPairs(self._stream(self.files[-n_val:], train=False), separator=separator)
            return
        train, val = self._build()
        self.train_dataset = NextTokenDataset(train) if separator is None else PackedDocuments(train, separator)
        self.val_dataset = NextTokenDataset(val) if separator is None else PackedDocuments(val, separator)

    def state_dict(self) -> dict[str, Any]:
        """With a tokenizer: its files (and key), so a checkpoint carries the tokenizer its model was trained with.
        Byte-level: nothing."""
        if self.byte_level:
            return {}
        if self._saved_tokenizer is None:
            self._saved_tokenizer = tokenizer_files(self.tokenizer)
        return {TOKENIZER_STATE: self._saved_tokenizer, "tokenizer_key": self._tokenizer_key}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """On a resume: warn when the checkpoint was trained with another tokenizer, or when a stream restarts."""
        saved = state.get("tokenizer_key")
        if saved != self._tokenizer_key:
            rank_zero_warn(f"The checkpoint's data was tokenized with {'bytes' if saved is None else 'a tokenizer'} "
                           f"(key {saved}); this run's data module uses "
                           f"{'bytes' if self.byte_level else 'another tokenizer'} (key {self._tokenizer_key}): the "
                           "token ids mean other things now.")
        if self.streaming:
            rank_zero_warn("TextDataModule(streaming=True) keeps no position in its stream: the resumed run reads "
                           "the training files again from the start of the epoch's stream. Use streaming=False for "
                           "an exact mid-epoch resume.")

    def _loader(self, dataset: Dataset | None, shuffle: bool, drop_last: bool,
                sampler: DataParallelSampler | None = None) -> DataLoader:
        if dataset is None:
            raise RuntimeError("call setup() before requesting a dataloader")
        self._check_position_ids_taken()
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle if sampler is None else False,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            collate_fn=(PACKED_BATCH_FORMATS if self.pack_documents else BATCH_FORMATS)[self.batch_format],
        )

    def _check_position_ids_taken(self) -> None:
        """Refuse, before the first batch, packed documents for a LightningModule that does not say it gives the
        batch's position_ids to its model: its attention would silently cross documents."""
        module = getattr(self.trainer, "lightning_module", None) if self.trainer is not None else None
        if not self.pack_documents or module is None:
            return
        name = type(module).__name__
        fix = ("Give the batch's position_ids to a model whose forward takes them (as lightning_par.examples.GPT "
               "and Hugging Face models do) and set takes_position_ids = True, or train with "
               "--data.pack_documents=false.")
        if not getattr(module, "takes_position_ids", False):
            raise ValueError(f"TextDataModule(pack_documents=True) gives every batch its documents' position_ids, "
                             f"which keep attention within each document, but {name} does not declare that its "
                             f"model gets them (takes_position_ids = True), so it would attend across documents. "
                             + fix)
        model = getattr(module, "model", None)
        forward = getattr(type(model), "forward", None) if isinstance(model, torch.nn.Module) else None
        if forward is not None and "position_ids" not in inspect.signature(forward).parameters:
            raise ValueError(f"TextDataModule(pack_documents=True): {name}.model ({type(model).__name__}) takes no "
                             "position_ids, so its attention would cross documents. " + fix)
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False):
            # transformers builds the per-document mask from restarting position_ids only without a cache, and a
            # call that does not pass use_cache=False gets one (a training step never reads it)
            config.use_cache = False
            rank_zero_info(f"packed documents: {type(model).__name__}.config.use_cache set to False, so transformers "
                           "keeps attention within each document whatever the step passes.")

    def _data_parallel_sampler(self, dataset: Dataset) -> DataParallelSampler | None:
        """The training sampler: this data-parallel rank's share of one global order, resumable mid-epoch.

        The order depends only on the seed (``PL_GLOBAL_SEED``, set by ``seed_everything``), the epoch and the
        dataset, not on the layout: one process and any number of data-parallel ranks see the same global batches.
        Built here for every trainer, one process included, so ``shuffle=False`` stays meaningful (Lightning would
        inject a shuffling sampler under a distributed strategy) and the position is saved in checkpoints
        (:func:`~lightning_par.run.data_position.resumable_train_loader`). The split is by data-parallel
        rank, from the strategy's ``distributed_sampler_kwargs``. ``None`` where the Trainer has
        ``use_distributed_sampler=False`` under a distributed strategy: the user shards the data then.
        """
        trainer = self.trainer
        kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
        if kwargs and not uses_distributed_sampler(trainer):
            return None
        seed = int(os.getenv("PL_GLOBAL_SEED", "0"))
        return DataParallelSampler(dataset, shuffle=self.shuffle, seed=seed, **(kwargs or {}))

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise RuntimeError("call setup() before requesting a dataloader")
        if self.streaming:  # sharded and shuffled by the stream itself; no position to save (see the class doc)
            return self._loader(self.train_dataset, shuffle=False, drop_last=True)
        sampler = self._data_parallel_sampler(self.train_dataset)
        per_rank = len(sampler) if sampler is not None else len(self.train_dataset)
        if per_rank < self.batch_size:  # drop_last: Lightning would end with "No training batches" and exit 0
            ranks = sampler.num_replicas if sampler is not None else 1
            replicas = f" ({per_rank} on each of {ranks} data-parallel ranks)" if ranks > 1 else ""
            raise ValueError(f"the training split has {len(self.train_dataset)} blocks of {self.seq_len + 1} tokens"
                             f"{replicas}, fewer than batch_size={self.batch_size}: no full batch to train on. Use "
                             "a smaller --data.batch_size or --data.seq_len, or more data.")
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
        if self.streaming:
            first = _StreamedPairs(self.val_dataset.blocks, limit=self.batch_size, separator=self.val_dataset.separator)
            return self._loader(first, shuffle=False, drop_last=False)
        count = min(self.batch_size, len(self.val_dataset))
        subset = torch.utils.data.Subset(self.val_dataset, range(count))
        return self._loader(subset, shuffle=False, drop_last=False)
