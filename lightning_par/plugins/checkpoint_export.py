"""Export a checkpoint to the plain model's weights, and start a run from such weights under any layout.

Export (one process, no process group): :class:`CheckpointTensors` reads the model entries of a lightning-par
checkpoint -- a sharded DCP directory of any layout or a single-file Lightning checkpoint -- one tensor at a time,
without unpickling anything but tensors. :func:`export_safetensors` writes them as one ``.safetensors`` file under the
plain model's names; :func:`export_hf` writes a Hugging Face ``save_pretrained`` directory, its weights split into
shard files of at most ``max_shard_size`` with an index, as ``save_pretrained`` splits them. Both stream: every file's
header is planned from the checkpoint's metadata, then each tensor is read, cast and written alone
(:func:`write_safetensors`), so the exporter holds about one tensor, never the model. ``lightning-par export --help``
is the command.

Import: :class:`FromPretrained`, a callback, loads such a file or directory into the model after the strategy has
applied its layout, tensor by tensor, each rank keeping only its share (:func:`load_pretrained`).
"""

from __future__ import annotations

import ctypes
import importlib
import inspect
import io
import json
import math
import mmap
import os
import pickle
import re
import struct
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_par.plugins import checkpoint_files, checkpoint_meta
from lightning_par.plugins.checkpoint_files import CheckpointError
from lightning_par.plugins.export_args import HF_INDEX, HF_MAX_SHARD_SIZE, build_parser, parse_size  # noqa: F401
from lightning_par.plugins.sharded_checkpoint import _SafeLoadPlanner, _SafeReader

_MODEL_KEY = "state_dict"  # the model's entries in a checkpoint (DCP flattens them to "state_dict.<fqn>")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_WEIGHTS = "model.safetensors"
_HF_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


# -- reading a checkpoint in one process, one tensor at a time ------------------------------------------------------
class CheckpointTensors:
    """The model entries of a lightning-par checkpoint, read in one process, one tensor at a time.

    ``path``: a sharded DCP directory written by any layout (its manifest is checked first; then each tensor is read
    alone, assembled to its full shape by DCP from however many shards hold it) or a single-file Lightning checkpoint
    (memory-mapped). Needs no process group; nothing but tensors is unpickled; optimizer states are never read.
    :attr:`entries` holds every model tensor's name (the LightningModule's), shape and dtype before any is read, so an
    export plans its files first and then holds one tensor at a time (:meth:`tensor`).
    """

    def __init__(self, path: str | Path) -> None:
        requested = Path(path)
        self.path = checkpoint_files.resolve(requested)
        self.entries: dict[str, tuple[torch.Size, torch.dtype]] = {}
        self._mapped: dict[str, Tensor] = {}  # a single file's tensors, memory-mapped: nothing read yet
        self._file_ranges: list[tuple[int, int]] = []  # where this process maps that file
        self._reader: _SafeReader | None = None
        skipped = []
        if self.path.is_file():
            for name, value in _read_single_file(requested, self.path)[_MODEL_KEY].items():
                if isinstance(value, Tensor):
                    self._mapped[name] = value
                else:
                    skipped.append(name)
            self.entries = {name: (tensor.shape, tensor.dtype) for name, tensor in self._mapped.items()}
            self._file_ranges = _mapped_ranges(self.path)
        else:
            _verify(self.path)
            self._reader = _OneMetadataReader(self.path)
            metadata = self._reader.read_metadata()  # DCP's pickled metadata, with only DCP's own classes allowed
            planner_paths = getattr(metadata, "planner_data", None) or {}
            for key, entry in metadata.state_dict_metadata.items():
                if not key.startswith(_MODEL_KEY + "."):
                    continue  # optimizer states: never read here
                where = planner_paths.get(key)
                if where is not None and (len(where) != 2 or where[0] != _MODEL_KEY):
                    raise CheckpointError(f"{self.path}: the entry {key!r} is nested as {where}, not as a model entry "
                                          f"(state_dict -> parameter name): not a lightning-par model state.")
                if not isinstance(entry, TensorStorageMetadata):
                    skipped.append(key)  # a module's pickled extra state: not a tensor, and not unpickled
                    continue
                self.entries[key[len(_MODEL_KEY) + 1:]] = (torch.Size(entry.size), entry.properties.dtype)
        if not self.entries:
            raise CheckpointError(f"{self.path} holds no model tensors ({_MODEL_KEY}.*): is it a lightning-par "
                                  "checkpoint?")
        if skipped:
            rank_zero_warn(f"{self.path}: {len(skipped)} non-tensor model entries not exported, e.g. {skipped[:3]}")

    def read(self, names: Iterable[str]) -> dict[str, Tensor]:
        """The full tensors ``names`` (a single file's stay memory-mapped; a directory's are read by one DCP load, so
        this holds them all at once: :meth:`tensor` holds one)."""
        names = list(names)
        if self._reader is None:
            return {name: self._mapped[name] for name in names}
        state = {name: torch.empty(self.entries[name][0], dtype=self.entries[name][1]) for name in names}
        # no_dist: one process reads every shard, even inside a job that has a process group
        with warnings.catch_warnings():  # DCP warns that it assumes one process even when told so
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load({_MODEL_KEY: state}, storage_reader=self._reader, planner=_SafeLoadPlanner(), no_dist=True)
        return state

    @contextmanager
    def tensor(self, name: str) -> Iterator[Tensor]:
        """The full tensor ``name``, released when the block ends: the one read is dropped, and a memory-mapped one's
        pages leave this process's resident memory (the kernel maps them back from the file if they are touched
        again), else a single-file export would end up with the whole file resident."""
        tensor = None if self._reader is None else self._read_stored_whole(name)
        if tensor is None:
            tensor = self.read([name])[name]
        try:
            yield tensor
        finally:
            if self._reader is None:
                _drop_pages(tensor, self._file_ranges)

    def _read_stored_whole(self, name: str) -> Tensor | None:
        """``name`` read straight from its file where DCP stored it in one piece (saved by one process, or
        replicated): the tensor ``torch.load`` gives is the full one, where DCP's read would copy it into another
        (twice the memory). ``None`` for a tensor stored in shards, or stored transformed: DCP reads those."""
        key = f"{_MODEL_KEY}.{name}"
        metadata = self._reader.read_metadata()
        entry = metadata.state_dict_metadata[key]
        if len(entry.chunks) != 1 or tuple(entry.chunks[0].sizes) != tuple(entry.size):
            return None
        info = metadata.storage_data.get(dcp_metadata.MetadataIndex(key, entry.chunks[0].offsets))
        if info is None or getattr(info, "transform_descriptors", None):
            return None
        with open(self.path / info.relative_path, "rb") as file:
            try:
                tensor = torch.load(_FileSlice(file, info.offset, info.length), map_location="cpu", weights_only=True)
            except pickle.UnpicklingError as err:
                raise CheckpointError(f"{self.path}: loading the entry {key!r} with weights_only=True refuses an "
                                      f"object in it ({checkpoint_files.refused(err)}: unpickling it could run "
                                      "code).") from err
        if not isinstance(tensor, Tensor) or (tensor.shape, tensor.dtype) != self.entries[name]:
            raise CheckpointError(f"{self.path}: the entry {key!r} holds {type(tensor).__name__} "
                                  f"{tuple(getattr(tensor, 'shape', ()))}, not the {tuple(self.entries[name][0])} "
                                  f"{self.entries[name][1]} tensor its metadata describes.")
        return tensor

    def tied(self) -> list[list[str]]:
        """The groups of names stored once (a single file keeps tied weights as one storage; DCP stores each name)."""
        by_storage: dict[int, list[str]] = {}
        for name, tensor in self._mapped.items():
            if tensor.numel():
                by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
        return [names for names in by_storage.values() if len(names) > 1]


class _OneMetadataReader(_SafeReader):
    """:class:`_SafeReader` that unpickles ``.metadata`` once for the many one-tensor loads of an export."""

    _metadata: dcp_metadata.Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata


class _FileSlice(io.RawIOBase):
    """Bytes ``offset`` to ``offset + length`` of an open file, as a seekable file of their own (what one DCP item
    is: a ``torch.save`` of its tensor), read into the reader's buffer without an intermediate copy."""

    def __init__(self, file: Any, offset: int, length: int) -> None:
        super().__init__()
        self.file, self.offset, self.length, self.pos = file, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.length}[whence]
        self.pos = min(max(base + pos, 0), self.length)
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")[:max(self.length - self.pos, 0)]
        self.file.seek(self.offset + self.pos)
        n = self.file.readinto(view) or 0
        self.pos += n
        return n


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """The address ranges where this process maps ``path`` (Linux; empty elsewhere)."""
    target = os.path.realpath(path)
    ranges = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].rstrip("\n") == target:
                    start, end = (int(x, 16) for x in fields[0].split("-"))
                    ranges.append((start, end))
    except OSError:
        return []
    return ranges


def _drop_pages(tensor: Tensor, file_ranges: list[tuple[int, int]]) -> None:
    """Drop the whole pages of ``tensor``'s storage from this process's resident set (``madvise(MADV_DONTNEED)``),
    only where they lie inside a mapping of the checkpoint file: there they are the file's pages, read again from it
    if touched; anonymous memory would lose its contents."""
    advice = getattr(mmap, "MADV_DONTNEED", None)
    storage = tensor.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    if advice is None or not storage.nbytes() or not any(lo <= start and end <= hi for lo, hi in file_ranges):
        return
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), ctypes.c_int(advice))


def read_model_state(path: str | Path) -> dict[str, Tensor]:
    """The full (unsharded) model state of a lightning-par checkpoint, keyed by the LightningModule's names, all at
    once (see :class:`CheckpointTensors`, which reads one tensor at a time). To load into a sharded layout, resume
    with ``ckpt_path=`` instead."""
    tensors = CheckpointTensors(path)
    return tensors.read(tensors.entries)


def read_hyperparameters(path: str | Path) -> dict[str, Any]:
    """The LightningModule hyper-parameters saved in a checkpoint (``{}`` if none), read without running code."""
    return dict(_read_entries(path).get("hyper_parameters") or {})


def read_tokenizer_files(path: str | Path) -> dict[str, str | bytes] | None:
    """The tokenizer files a checkpoint's data module saved in its state (``TextDataModule`` with a tokenizer:
    see :data:`lightning_par.data.TOKENIZER_STATE`), or ``None``; read without running code."""
    from lightning_par.data import TOKENIZER_STATE

    for value in _read_entries(path).values():
        if isinstance(value, Mapping) and isinstance(value.get(TOKENIZER_STATE), Mapping):
            return dict(value[TOKENIZER_STATE])
    return None


def _read_entries(path: str | Path) -> dict[str, Any]:
    """The checkpoint's entries other than sharded states (a single file's tensors stay memory-mapped)."""
    requested, path = Path(path), checkpoint_files.resolve(Path(path))
    if path.is_file():
        return _read_single_file(requested, path)
    _verify(path)
    return checkpoint_meta.read(path, weights_only=True)


def _verify(path: Path) -> None:
    """The whole directory against its manifest (sizes, then checksums), in this process alone: no collectives."""
    files = checkpoint_files.read_manifest(path)
    checkpoint_files.check_sizes(path, files)
    checkpoint_files.check_checksums(path, files, sorted(files))


def _read_single_file(requested: Path, path: Path) -> dict[str, Any]:
    """One-file checkpoint ``path`` (``requested``, or what a crash left in its place), its checksum checked first."""
    checkpoint_files.verify_file(requested, path)
    try:
        # mmap: tensors stay on disk until touched, so the exporter holds one copy, not two
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: loading with weights_only=True refuses an object in it "
                              f"({checkpoint_files.refused(err)}: unpickling it could run code).") from err
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"{path} is not a readable checkpoint file (truncated or corrupted?): {err}") from err
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get(_MODEL_KEY), Mapping):
        raise CheckpointError(f"{path} is not a Lightning checkpoint: it has no {_MODEL_KEY!r} dict.")
    return checkpoint


# -- from the LightningModule's names to the plain model's -------------------------------------------------------
def strip_prefix(state: Mapping[str, Tensor], prefix: str | None = None) -> tuple[dict[str, Tensor], str]:
    """``state`` under the plain model's names, and the prefix removed.

    ``prefix``: the LightningModule attribute holding the model, e.g. ``"model"``; ``None`` finds it: the first name
    component shared by every entry (a LightningModule with one child module holding all the state, as
    ``self.model``). ``""`` keeps the LightningModule's names. Entries outside the prefix are an error.
    """
    if prefix is None:
        heads = sorted({name.split(".", 1)[0] for name in state})
        if len(heads) != 1 or all("." not in name for name in state):
            raise ValueError(f"the checkpoint's model entries start with {heads}, not with one module attribute: "
                             "pass the prefix to strip (--prefix NAME), or --prefix '' to keep the names as they are.")
        prefix = heads[0]
    lead = prefix + "." if prefix else ""
    outside = [name for name in state if not name.startswith(lead)]
    if outside:
        raise ValueError(f"{len(outside)} entries are not under {prefix!r}, e.g. {outside[:3]}: pass another --prefix.")
    return {name[len(lead):]: tensor for name, tensor in state.items()}, prefix


def unshare(state: dict[str, Tensor]) -> list[list[str]]:
    """Give every tensor its own storage, in place; return the groups of names that shared one.

    safetensors refuses tensors sharing memory: a tied embedding and head, or views of one flat buffer. Both names
    are kept, each with its own copy, so ``load_state_dict(strict=True)`` of the plain model accepts the file (for a
    tied model the second copy loads into the same parameter with the same values); a tied matrix is stored twice.
    """
    by_storage: dict[int, list[str]] = {}
    for name, tensor in state.items():
        if tensor.numel():
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(name)
    groups = [names for names in by_storage.values() if len(names) > 1]
    for names in groups:
        for name in names:
            state[name] = state[name].clone()
    return groups


def _cast(state: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    if dtype is None:
        return state
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _out_dtype(saved: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor saved as ``saved`` is exported in: ``dtype`` for floating-point ones."""
    return dtype if dtype is not None and saved.is_floating_point else saved


# -- writing safetensors one tensor at a time ------------------------------------------------------------------------
_SAFETENSORS_DTYPES = {getattr(torch, name): code for code, name in (
    ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
    ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("U64", "uint64"),
    ("U32", "uint32"), ("U16", "uint16"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
    ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"), ("C64", "complex64"),
) if hasattr(torch, name)}
_CAST_PIECE = 16 << 20  # bytes of a tensor cast at a time while it is written


def _nbytes(shape: Iterable[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def write_safetensors(out: Path, tensors: Mapping[str, tuple[torch.Size, torch.dtype]],
                      tensor: Callable[[str], AbstractContextManager[Tensor]], metadata: dict[str, str]) -> int:
    """Write a ``.safetensors`` file holding ``tensors`` (name -> shape, dtype) one tensor at a time; return its bytes
    of tensor data.

    The header (each tensor's dtype, shape and byte range) is known before any tensor is read, so it is written
    first; then each tensor's bytes, from ``tensor(name)`` (a context manager giving the tensor, released after it is
    written), in the header's order: by element size, then name, as ``safetensors`` orders them, so every tensor's data
    is aligned to its element size. A floating-point tensor is cast to the dtype of ``tensors`` piece by piece as it is
    written (16 MiB at a time), so no cast copy of the whole tensor is made. The file is written as ``OUT.partial``
    and renamed when complete.
    """
    if sys.byteorder != "little":
        raise ValueError("safetensors files are little-endian; writing them from a big-endian machine is not supported")
    order = sorted(tensors, key=lambda name: (-tensors[name][1].itemsize, name))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name in order:
        shape, dtype = tensors[name]
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: safetensors has no dtype {dtype}")
        end = offset + _nbytes(shape, dtype)
        header[name] = {"dtype": _SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # padded as safetensors pads it: the data starts 8-byte aligned
    partial = out.with_name(out.name + ".partial")
    try:
        _write_data(partial, blob, order, tensors, tensor)
    except BaseException:
        partial.unlink(missing_ok=True)  # never a half-written file, e.g. after a non-finite tensor was refused
        raise
    os.replace(partial, out)
    return offset


def _write_data(partial: Path, blob: bytes, order: list[str], tensors: Mapping[str, tuple[torch.Size, torch.dtype]],
                tensor: Callable[[str], AbstractContextManager[Tensor]]) -> None:
    with open(partial, "wb") as file:
        file.write(struct.pack("<Q", len(blob)))
        file.write(blob)
        for name in order:
            shape, dtype = tensors[name]
            with tensor(name) as value:
                if value.shape != shape or (value.dtype != dtype and not (
                        value.is_floating_point() and dtype.is_floating_point)):
                    raise CheckpointError(f"{name}: read as {tuple(value.shape)} {value.dtype}, to be written as "
                                          f"{tuple(shape)} {dtype}.")
                flat = value.detach().contiguous().reshape(-1)
                step = max(1, flat.numel() if value.dtype == dtype else _CAST_PIECE // value.element_size())
                for start in range(0, flat.numel(), step):
                    piece = flat[start:start + step]
                    if piece.is_floating_point() and not _all_finite(piece):
                        raise CheckpointError(
                            f"{name} holds non-finite values ({int(flat.isnan().sum())} NaN, "
                            f"{int(flat.isinf().sum())} inf of {flat.numel()}): refused to export it. The run that "
                            "saved this checkpoint diverged; export an earlier checkpoint (lightning-par never saves "
                            "non-finite weights over the last finite ones, see docs/faults.md).")
                    file.write(piece.to(dtype).view(torch.uint8).numpy())
                del value, flat  # before the next tensor is read


@dataclass
class ExportReport:
    """What an export wrote."""

    out: Path
    tensors: int
    bytes: int
    prefix: str
    tied: list[list[str]] = field(default_factory=list)
    files: int = 1  # weight files (shards of an --hf export)
    tokenizer: list[str] = field(default_factory=list)  # the tokenizer files an --hf export wrote
    tokenizer_note: str | None = None  # how AutoTokenizer differs from the tokenizer written (auto_tokenizer_differs)

    def describe(self) -> str:
        tied = "".join(f"\n  {' = '.join(g)}: shared storage, each name written with its own copy" for g in self.tied)
        files = f" in {self.files} shard files + {HF_INDEX}" if self.files > 1 else ""
        tokenizer = f"\n  the data module's tokenizer: {', '.join(self.tokenizer)}" if self.tokenizer else ""
        if self.tokenizer_note:
            tokenizer += f"\n  note: {self.tokenizer_note}"
        return (f"wrote {self.out}: {self.tensors} tensors, {self.bytes / 2**20:.2f} MiB{files}, names without "
                f"{self.prefix + '.' if self.prefix else 'a prefix'!r}{tied}{tokenizer}")


def export_safetensors(ckpt: str | Path, out: str | Path, prefix: str | None = None,
                       dtype: torch.dtype | None = None) -> ExportReport:
    """Write the model of checkpoint ``ckpt`` to one ``.safetensors`` file under the plain model's names, which
    ``model.load_state_dict(safetensors.torch.load_file(out))`` loads. ``prefix``: see :func:`strip_prefix`;
    ``dtype``: cast floating-point tensors (e.g. ``torch.bfloat16``). Streams: one tensor held at a time."""
    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"{out}: the output file must end in .safetensors (or pass --hf for a directory).")
    source = CheckpointTensors(ckpt)
    entries, prefix = strip_prefix(source.entries, prefix)
    lead = prefix + "." if prefix else ""
    # tied weights stored once in a single file are written under each name (safetensors refuses shared storage, and
    # a strict load_state_dict wants both names); DCP stores every name on its own
    tied = [[name[len(lead):] for name in group] for group in source.tied()]
    out.parent.mkdir(parents=True, exist_ok=True)
    planned = {name: (shape, _out_dtype(saved, dtype)) for name, (shape, saved) in entries.items()}
    written = write_safetensors(out, planned, lambda name: source.tensor(lead + name),
                                {"format": "pt", "exported_from": str(ckpt)})
    return ExportReport(out, len(entries), written, prefix, tied)


#: what a one-file export keeps besides the weights: enough for ``LightningModule.load_from_checkpoint`` and for
#: evaluation with ``ckpt_path=`` under any strategy (no optimizer, loop or data state: not a resume point)
LIGHTNING_KEYS = ("epoch", "global_step", "pytorch-lightning_version", "hyper_parameters", "hparams_name",
                  "datamodule_hyper_parameters", "datamodule_hparams_name")


def export_lightning(ckpt: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> ExportReport:
    """Write checkpoint ``ckpt`` (of any layout) as one Lightning ``.ckpt`` file of its weights, which
    ``MyModule.load_from_checkpoint(out)``, a stock Lightning strategy and ``trainer.validate/test/predict(
    ckpt_path=out)`` read: the whole ``state_dict`` under the LightningModule's names, the hyper-parameters and the
    epoch and step (``LIGHTNING_KEYS``); optimizer states are left out, as with ``save_weights_only=True``. The
    file is written whole in memory (the model, once), atomically, with its checksum sidecar."""
    out = Path(out)
    if out.suffix != ".ckpt":
        raise ValueError(f"{out}: a Lightning checkpoint file must end in .ckpt.")
    entries = _read_entries(ckpt)
    checkpoint = {key: entries[key] for key in LIGHTNING_KEYS if key in entries}
    checkpoint[_MODEL_KEY] = _cast(read_model_state(ckpt), dtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = checkpoint_files.partial_path(out)
    with partial.open("wb") as file:
        torch.save(checkpoint, file)
        file.flush()
        os.fsync(file.fileno())
    checkpoint_files.commit_file(partial, out)
    state = checkpoint[_MODEL_KEY]
    return ExportReport(out, len(state), out.stat().st_size, "", [])


def export_hf(ckpt: str | Path, out_dir: str | Path, model_class: str | None = None,
              dtype: torch.dtype | None = None, max_shard_size: int | str = HF_MAX_SHARD_SIZE,
              trust_checkpoint_class: bool = False, original_format: bool = False) -> ExportReport:
    """Write the model of checkpoint ``ckpt`` as a Hugging Face ``save_pretrained`` directory, which
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads.

    The LightningModule is rebuilt on the meta device (no memory) from the checkpoint's hyper-parameters: its class
    is ``model_class`` (``"package.Module"``), or with ``trust_checkpoint_class`` the ``_class_path`` the Lightning CLI
    saves with them (importing a module runs its code: a class named by the checkpoint alone is refused). Its child
    that is a ``transformers.PreTrainedModel`` gives the config and the prefix; the weights come from the checkpoint
    (checked name by name and shape by shape against that model). ``save_pretrained`` writes the config files; the
    weights are written here as it would write them -- the same names (a tied weight's alias and the keys the model
    ignores on save left out), split in its order into files of at most ``max_shard_size`` bytes (``"5GB"``,
    ``"500MB"`` or bytes; a larger tensor gets a file of its own), ``model-00001-of-0000N.safetensors`` with
    ``model.safetensors.index.json``, or one ``model.safetensors`` if they fit in one -- but one tensor at a time,
    straight from the checkpoint. The tensors are the model's own (a mixture of experts' fused ``gate_up_proj
    [E, 2f, d]``, the experts' shards of any layout put together), which transformers 5 loads as they are; with
    ``original_format`` a model that converts its weights on save (transformers' weight conversions: one tensor per
    expert, renamed tensors) is handed whole to ``save_pretrained``, which converts them, with a warning. When the
    checkpoint's
    data module had a Hugging Face tokenizer (``TextDataModule(tokenizer=...)`` saves its files in the checkpoint),
    its files are written beside the model, so ``AutoTokenizer.from_pretrained(out_dir)`` loads it.
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    max_shard_size = parse_size(max_shard_size)
    hparams = read_hyperparameters(ckpt)
    class_path = model_class or _checkpoint_class(ckpt, hparams, trust_checkpoint_class)
    cls = _import_class(class_path)
    source = CheckpointTensors(ckpt)
    try:
        lm = _build_on_meta(cls, hparams)
    except Exception as err:  # noqa: BLE001 -- e.g. a configure_model that reads trainer.datamodule.vocab_size
        from lightning_par.data import VOCAB_SIZE

        try:  # the byte-level data module's vocabulary for now: the checkpoint's is known once the embedding's name is
            lm = _build_on_meta(cls, hparams, vocab=VOCAB_SIZE)
        except Exception:  # noqa: BLE001
            raise err from None
    prefix, hf_model = _hf_child(lm, class_path)
    vocab = _checkpoint_vocab(source, prefix, hf_model)
    if vocab is not None and vocab != hf_model.get_input_embeddings().num_embeddings:
        # the model took its vocabulary from the data module in the run (a hyper-parameter need not record it): build
        # it again as it was trained, seeing a data module of the checkpoint's vocabulary
        prefix, hf_model = _hf_child(_build_on_meta(cls, hparams, vocab), class_path)
    entries, _ = strip_prefix(source.entries, prefix)
    expected = hf_model.state_dict()
    missing = sorted(set(expected) - set(entries))
    unexpected = sorted(set(entries) - set(expected))
    wrong = [f"{k} {tuple(entries[k][0])} (model: {tuple(expected[k].shape)})"
             for k in expected if k in entries and entries[k][0] != expected[k].shape]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{ckpt} does not fit {type(hf_model).__name__} built from its hyper-parameters: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {wrong[:3]}.")
    if dtype is not None:
        hf_model.to(dtype)  # on the meta device: only so that save_pretrained writes the dtype into config.json
    out_dir = Path(out_dir)
    if out_dir.is_file():
        raise ValueError(f"{out_dir} is a file: --hf writes a directory.")
    # the model is on the meta device: save_pretrained writes config.json (+ generation_config.json ...) and, given
    # no tensors, no weights; a former export's weight files are removed (a stale model.safetensors would shadow an
    # index)
    hf_model.save_pretrained(out_dir, state_dict={})
    for file in out_dir.iterdir():
        if file.name in (HF_WEIGHTS, HF_INDEX) or _HF_SHARD.fullmatch(file.name.removesuffix(".partial")):
            file.unlink()
    lead = prefix + "."
    # the tensors in the model's order, as save_pretrained gets them from model.state_dict()
    planned = {name: (entries[name][0], _out_dtype(entries[name][1], dtype)) for name in expected}
    names = _hf_saved_names(hf_model, planned, original_format)
    if names is None:
        rank_zero_warn(f"{type(hf_model).__name__} converts its weights when saving: save_pretrained writes them from "
                       "the whole model, held in memory here.")
        state = _cast({name[len(lead):]: t for name, t in source.read(lead + n for n in expected).items()}, dtype)
        unshare(state)
        hf_model.save_pretrained(out_dir, state_dict=state, max_shard_size=max_shard_size)
        return _with_tokenizer(ExportReport(out_dir, len(expected), sum(_nbytes(*planned[n]) for n in expected),
                                            prefix), ckpt)
    split = split_state_dict_into_shards_factory(
        {name: _nbytes(*planned[name]) for name in names}, get_storage_size=lambda size: size,
        filename_pattern=HF_WEIGHTS.replace(".safetensors", "{suffix}.safetensors"), max_shard_size=max_shard_size)
    written = 0
    for filename, shard in split.filename_to_tensors.items():
        written += write_safetensors(out_dir / filename, {name: planned[name] for name in shard},
                                     lambda name: source.tensor(lead + name), {"format": "pt"})
    if split.is_sharded:  # the index save_pretrained writes
        index = {"metadata": {"total_parameters": hf_model.num_parameters(), **split.metadata},
                 "weight_map": split.tensor_to_filename}
        (out_dir / HF_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return _with_tokenizer(ExportReport(out_dir, len(names), written, prefix,
                                        files=len(split.filename_to_tensors)), ckpt)


def _hf_child(lm: LightningModule, class_path: str) -> tuple[str, nn.Module]:
    """The one child of ``lm`` that is a ``transformers.PreTrainedModel``, and its attribute name."""
    from transformers import PreTrainedModel

    children = [(name, child) for name, child in lm.named_children() if isinstance(child, PreTrainedModel)]
    if len(children) != 1:
        raise ValueError(f"{class_path} holds {len(children)} Hugging Face models after configure_model() "
                         f"({[n for n, _ in children]}); --hf needs exactly one (e.g. self.model = LlamaForCausalLM).")
    return children[0]


def _checkpoint_vocab(source: CheckpointTensors, prefix: str, hf_model: nn.Module) -> int | None:
    """The vocabulary the checkpoint was trained with: the rows of its input embedding (``None`` if it has none)."""
    embedding = hf_model.get_input_embeddings()
    name = next((n for n, m in hf_model.named_modules() if m is embedding), None)
    entry = source.entries.get(f"{prefix}.{name}.weight") if name is not None else None
    return int(entry[0][0]) if entry is not None and len(entry[0]) == 2 else None


def _with_tokenizer(report: ExportReport, ckpt: str | Path) -> ExportReport:
    """``report`` once the checkpoint's tokenizer (if any) is written beside the model and checked as loaded back."""
    report.tokenizer = _write_tokenizer(ckpt, report.out)
    if report.tokenizer:
        report.tokenizer_note = auto_tokenizer_differs(report.out)
    return report


def _write_tokenizer(ckpt: str | Path, out_dir: Path) -> list[str]:
    """Write the tokenizer the checkpoint carries (if any) into ``out_dir``; returns the file names written."""
    from lightning_par.data import write_tokenizer_files

    files = read_tokenizer_files(ckpt)
    return write_tokenizer_files(files, out_dir) if files else []


def auto_tokenizer_differs(out_dir: str | Path) -> str | None:
    """What is wrong with ``AutoTokenizer.from_pretrained(out_dir)`` where it is not the tokenizer ``out_dir``'s files
    describe (:func:`lightning_par.data.as_written`: another vocabulary size, or other ids on any line of
    ``TOKENIZER_PROBE``); ``None`` when it is the same."""
    from transformers import AutoTokenizer

    from lightning_par.data import TOKENIZER_PROBE, load_tokenizer

    auto, written = AutoTokenizer.from_pretrained(out_dir), load_tokenizer(out_dir)
    differ = sum(auto(line)["input_ids"] != written(line)["input_ids"] for line in TOKENIZER_PROBE)
    if not differ and len(auto) == len(written):
        return None
    return (f"AutoTokenizer.from_pretrained({str(out_dir)!r}) builds {type(auto).__name__}, transformers' own class "
            f"for this model family, which re-derives the splitting rules instead of reading tokenizer.json: "
            f"{len(auto)} tokens (trained: {len(written)}), other ids on {differ} of {len(TOKENIZER_PROBE)} probe "
            f"lines. Load it as trained with transformers.PreTrainedTokenizerFast.from_pretrained(dir) "
            f"(lightning-par's --data.tokenizer=DIR does).")


def _checkpoint_class(ckpt: str | Path, hparams: dict[str, Any], trusted: bool) -> str:
    """The LightningModule class the checkpoint names (the CLI's ``_class_path``), if the user trusts it: importing
    it runs the code of a module that whoever wrote the checkpoint chose."""
    named = hparams.get("_class_path")
    if not named:
        raise ValueError(f"{ckpt} does not say which LightningModule saved it (no _class_path among its "
                         "hyper-parameters: it was not run through the lightning-par CLI). Pass --model-class, e.g. "
                         "--model-class lightning_par.examples.HFLlamaLightningModule.")
    if not trusted:
        raise ValueError(f"{ckpt} names its LightningModule class {named!r}; importing it runs that module's code, "
                         f"so --hf imports no class on the checkpoint's word alone. Pass --model-class {named} if "
                         "that is the class you expect, or --trust-checkpoint-class to import the class the "
                         "checkpoint names.")
    return named


def _hf_saved_names(hf_model: nn.Module, planned: Mapping[str, tuple[torch.Size, torch.dtype]],
                    original_format: bool = False) -> list[str] | None:
    """The names ``hf_model.save_pretrained(save_original_format=original_format)`` writes of a state with these
    names: without the keys the model ignores on save, and without the aliases of a tied weight (transformers' own
    rule, applied to meta tensors: it finds ties through the model's parameters). ``None`` when ``original_format``
    and the model converts weights on save, which only save_pretrained does."""
    state = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in planned.items()}
    for key in getattr(hf_model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    try:
        from transformers.modeling_utils import remove_tied_weights_from_state_dict
    except ImportError:  # transformers 4: every name is written, tied ones each with their copy
        return list(state)
    state = remove_tied_weights_from_state_dict(state, hf_model)
    if not original_format:
        return list(state)
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return list(state)
    try:
        reverted = revert_weight_conversion(hf_model, dict(state))
    except Exception:  # noqa: BLE001 (a conversion that cannot run on meta tensors: let save_pretrained do it)
        return None
    if set(reverted) != set(state) or any(reverted[name] is not tensor for name, tensor in state.items()):
        return None
    return list(state)


def _import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"cannot import the LightningModule class {class_path!r}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise ValueError(f"{class_path} is not a LightningModule class.")
    return cls


def _build_on_meta(cls: type, hparams: dict[str, Any], vocab: int | None = None) -> LightningModule:
    """``cls`` from its saved hyper-parameters, its model built by ``configure_model`` on the meta device. With
    ``vocab``, ``configure_model`` sees a trainer whose data module has that vocabulary (``trainer.datamodule
    .vocab_size``), as a model that takes its vocabulary from the data did in the run."""
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in hparams.items() if not k.startswith("_") and (takes_any or k in accepted)}
    with torch.device("meta"):
        lm = cls(**kwargs)
        if vocab is not None:
            lm.trainer = SimpleNamespace(datamodule=SimpleNamespace(vocab_size=vocab, token_vocab_size=vocab))
        try:
            lm.configure_model()
        finally:
            lm.trainer = None
    return lm


# -- starting a run from exported weights ------------------------------------------------------------------------
# Import (FromPretrained, load_pretrained) lives in lightning_par.plugins.pretrained; the names stay importable here
# for the command lines and configs that name them under this module.
from lightning_par.plugins.pretrained import FromPretrained, load_pretrained  # noqa: E402,F401


def _all_finite(tensor: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """Whether every element is finite, checked a chunk at a time: ``isfinite`` makes a bool tensor of its input's
    size, which on a whole tensor would add a quarter of the largest fp32 tensor to the export's peak."""
    return all(bool(torch.isfinite(tensor[i:i + chunk]).all()) for i in range(0, tensor.numel(), chunk))


# -- the command ----------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``lightning-par export``: returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.hf and args.prefix is not None:
        parser.error("--prefix applies without --hf; with --hf the prefix is the attribute holding the HF model.")
    if not args.hf and (args.model_class or args.trust_checkpoint_class):
        parser.error("--model-class and --trust-checkpoint-class apply with --hf.")
    if not args.hf and args.hf_original_format:
        parser.error("--hf-original-format applies with --hf.")
    if not args.hf and args.max_shard_size is not None:
        parser.error("--max-shard-size applies with --hf; without it the weights go to one .safetensors file.")
    try:
        if args.hf:
            report = export_hf(args.checkpoint, args.out, args.model_class, dtype,
                               args.max_shard_size or HF_MAX_SHARD_SIZE, args.trust_checkpoint_class,
                               args.hf_original_format)
        elif args.out.endswith(".ckpt"):
            if args.prefix is not None:
                parser.error("--prefix applies to .safetensors; a .ckpt keeps the LightningModule's names.")
            report = export_lightning(args.checkpoint, args.out, dtype)
        else:
            report = export_safetensors(args.checkpoint, args.out, args.prefix, dtype)
    except (CheckpointError, ValueError, FileNotFoundError) as err:
        print(f"lightning-par export: error: {err}")
        return 2
    print(report.describe())
    return 0

