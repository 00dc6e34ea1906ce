"""Sharded checkpoints with torch.distributed.checkpoint (DCP): every rank writes its own shards, in parallel.

A checkpoint is a directory: DCP's files for the model and optimizer states; ``meta.json`` (+ ``meta_values.pt``)
with the rest of Lightning's checkpoint (:mod:`~lightning_par.plugins.checkpoint_meta`); and ``manifest.json``,
written last, with every file's size and CRC-32. It is written as ``NAME.partial`` and takes the name ``NAME`` only
when complete (:mod:`~lightning_par.plugins.checkpoint_files`). Loading checks the manifest before reading anything,
and unpickles only tensors and plain values unless ``weights_only=False``.

A plain single-file Lightning checkpoint (one process, or ZeRO stage 0) loads here too: its model weights into any
layout, its optimizer states where each optimizer holds the model's own parameters (ZeRO-3, tensor parallel).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

from lightning_par._compat import ShardedTensor, set_element
from lightning_par.parallel.param_states import PARAM_STATES, ParamStates, materialize_optimizer_state
from lightning_par.parallel.tensor_parallel import packed_as_slices, restore_packed
from lightning_par.plugins import checkpoint_files, checkpoint_meta
from lightning_par.plugins.checkpoint_files import CheckpointError


def model_state(module: nn.Module) -> dict[str, Any]:
    """The model's state keyed by original parameter names (FQNs), as DTensor shards where it is sharded."""
    return PARAM_STATES.model_state(module)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter FQNs (for optimizers over the module's own parameters)."""
    return PARAM_STATES.optimizer_state(module, optimizer)


def with_param_names(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()`` (keyed by position, as Lightning saves one file) with each group's parameter names
    under torch's own ``param_names`` key: a single file then maps to any layout, pipeline stages included, and
    torch and Lightning load it as before."""
    names = {id(p): name for name, p in module.named_parameters()}
    for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
        if "param_names" not in saved and all(id(p) in names for p in group["params"]):
            saved["param_names"] = [names[id(p)] for p in group["params"]]
    return state


# -- collectives: every rank saves and loads; without a process group this is the only rank ----------------------
def _share(items: list[Any]) -> list[Any]:
    """This rank's share of ``items`` (the same list on every rank), for work split across ranks."""
    if not dist.is_initialized():
        return items
    return items[dist.get_rank()::dist.get_world_size()]


def _all_gather(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# -- save ----------------------------------------------------------------------------------------------------------
def save(checkpoint: dict[str, Any], path: Path, is_writer: bool, barrier: Callable[[], None]) -> None:
    """Write ``checkpoint`` (Lightning's dict, with sharded "state_dict" and "optimizer_states") to ``path``.

    Every rank calls it; ``is_writer`` (one rank) writes the metadata and the manifest and renames the directory.
    ``path`` appears only when the checkpoint is complete; until then, an existing ``path`` stays loadable.
    """
    try:
        partial, sharded = begin(checkpoint, path, is_writer, barrier)
        dcp.save(sharded, checkpoint_id=partial)  # DCP fsyncs each file it writes (FileSystemWriter's sync_files)
        # once dcp.save returns on any rank, every rank's files and DCP's .metadata are written: the ranks list the
        # same files and checksum a share each (the page cache still holds them)
        names = sorted(p.name for p in partial.iterdir() if p.is_file())
        files: dict[str, dict[str, int]] = {}
        for share in _all_gather(checkpoint_files.describe(partial, _share(names))):
            files.update(share)
        if is_writer:
            finish(partial, path, files)
    except (OSError, CheckpointException) as err:  # DCP raises on every rank once any rank's write failed
        raise checkpoint_files.save_failed(path, err, clean=is_writer) from None
    barrier()


def begin(checkpoint: dict[str, Any], path: Path, is_writer: bool,
          barrier: Callable[[], None]) -> tuple[Path, dict[str, Any]]:
    """The first half of a save, every rank: ``NAME.partial`` made and its metadata written (by the writer); returns
    it and the states DCP is to write there."""
    partial = checkpoint_files.partial_path(path)
    sharded = {"state_dict": checkpoint.pop("state_dict")}
    for index, state in enumerate(checkpoint.pop("optimizer_states", [])):
        sharded[f"optimizer_{index}"] = state
    packed_as_slices(sharded)  # packed_colwise parameters (and their states) as one-process tensors
    if is_writer:
        checkpoint_files.prepare(path)
        partial.mkdir(parents=True)
        checkpoint_meta.write(checkpoint, partial)
    barrier()
    return partial, sharded


def finish(partial: Path, path: Path, files: dict[str, dict[str, int]] | None = None) -> None:
    """The last half, on the writer once every rank's files are written: the manifest (``files``, else checksummed
    here), then the commit that gives the checkpoint its name."""
    if files is None:
        files = checkpoint_files.describe(partial, sorted(p.name for p in partial.iterdir() if p.is_file()))
    checkpoint_files.write_manifest(partial, files)
    checkpoint_files.commit(partial, path)


# -- load ----------------------------------------------------------------------------------------------------------
def load(path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] | None,
         states: ParamStates = PARAM_STATES, weights_only: bool | None = None,
         model_params: Sequence[str] = ()) -> dict[str, Any]:
    """Load the shards into ``module`` and ``optimizers`` in place; return the rest of Lightning's checkpoint.

    Every rank calls it, under any layout: states are keyed by parameter name (FQN) with their full shapes, so DCP
    gives each rank the part it holds however the checkpoint was split. ``states``: the data-parallel owner's answers
    (``owner.states``): which tensors to fill, and the refresh after (ZeRO-1/2's optimizers hold bucket shards,
    :class:`~lightning_par.parallel.zero_state.ZeroStates`). ``weights_only`` (``None``
    means ``True``, as in ``torch.load``): unpickle only tensors and plain values; ``False`` trusts the checkpoint
    with arbitrary objects. ``optimizers=None``: the weights alone (a test or predict from a checkpoint: the saved
    optimizer states, if any, are not read). ``model_params``: the unsplit model's parameter names in order, where
    ``module`` holds only some (pipeline stages): a single file without parameter names maps its one group's
    positions to them.
    """
    safe = weights_only is not False
    resolved = checkpoint_files.resolve(path)
    if resolved != path:
        rank_zero_warn(f"{path} is missing, but {resolved.name}, the checkpoint it replaced, was left by a crash "
                       f"during the save: loading {resolved}.")
    if resolved.is_file():
        checkpoint_files.verify_file(path, resolved)  # every rank reads the file, and gets the same verdict
        return _load_single_file(resolved, module, optimizers, states, safe, model_params)
    _verify(resolved)
    # under ZeRO-1/2 the weights load into the optimizer's shards (the fp32 masters under mixed precision)
    optimizers = optimizers or []
    state: dict[str, Any] = {"state_dict": states.model_state(module)}
    for index, optimizer in enumerate(optimizers):
        state[f"optimizer_{index}"] = states.optimizer_target(module, optimizer)
    _check_fits(resolved, state, _saved_shapes(resolved, safe))  # before DCP, whose error names no parameter
    packed = packed_as_slices(state)  # saved as one-process tensors: read as slices, then repacked
    _dcp_load(state, resolved, safe)
    restore_packed(packed)
    states.load_model_state(module, state["state_dict"])
    for index, optimizer in enumerate(optimizers):
        states.load_optimizer_state(module, optimizer, state[f"optimizer_{index}"])
    return checkpoint_meta.read(resolved, weights_only)


def _verify(path: Path) -> None:
    """Check ``path`` against its manifest before any of it is read: sizes on every rank (a ``stat`` each), checksums
    split across the ranks, so detection costs one read of the checkpoint in all. Every rank raises the same error."""
    error = None
    try:
        files = checkpoint_files.read_manifest(path)
        checkpoint_files.check_sizes(path, files)
        checkpoint_files.check_checksums(path, files, _share(sorted(files)))
    except (CheckpointError, OSError) as err:
        error = str(err)
    first = next((e for e in _all_gather(error) if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def _saved_shapes(path: Path, safe: bool) -> dict[str, tuple[int, ...] | None]:
    """Every entry of a DCP checkpoint, as DCP names it (``state_dict.<fqn>``, ``optimizer_0.state.<fqn>.exp_avg``),
    with its full shape (``None``: stored as bytes, not a tensor), from its ``.metadata``."""
    metadata = (_SafeReader(path) if safe else _ConfinedReader(path)).read_metadata()
    return {key: tuple(entry.size) if isinstance(entry, dcp_metadata.TensorStorageMetadata) else None
            for key, entry in metadata.state_dict_metadata.items()}


def _flat_shapes(state: dict[str, Any], prefix: str = "") -> dict[str, tuple[int, ...] | None]:
    """The entries of a state to load, keyed as DCP flattens nested dicts, with the full shapes of the tensors (a
    DTensor's and a ShardedTensor's global ones; ``None`` for other values)."""
    out: dict[str, tuple[int, ...] | None] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(_flat_shapes(value, f"{prefix}{key}."))
        elif isinstance(value, ShardedTensor):
            out[f"{prefix}{key}"] = tuple(value.size())
        else:
            out[f"{prefix}{key}"] = tuple(value.shape) if isinstance(value, torch.Tensor) else None
    return out


def _entry(key: str) -> str:
    """``state_dict.layers.0.w`` -> ``parameter 'layers.0.w'``; ``optimizer_0.state.layers.0.w.exp_avg`` ->
    ``optimizer 0 state 'layers.0.w.exp_avg'``."""
    top, _, rest = key.partition(".")
    if top == "state_dict":
        return f"parameter {rest!r}"
    return f"optimizer {top.removeprefix('optimizer_')} {rest.partition('.')[0]} {rest.partition('.')[2]!r}"


def _check_fits(path: Path, state: dict[str, Any], saved: dict[str, tuple[int, ...] | None],
                extra: bool = True) -> None:
    """Refuse, on every rank with the same one-line :class:`CheckpointError`, a checkpoint of another model: the
    first of this model's tensors (model first, then optimizer states) that the checkpoint lacks or holds in another
    shape, else (``extra``) the first saved model entry that no rank of this model has. Every rank calls it (a
    collective): a pipeline stage, or a ZeRO-1/2 rank, asks for part of the entries."""
    wanted = _flat_shapes(state)
    first = None
    for key, shape in wanted.items():
        if shape is None:  # hyper-parameters, extra state: named by their parameter's tensors, or loaded as bytes
            continue
        if key not in saved:
            first = f"{_entry(key)} (shape {shape}) is not in the checkpoint"
        elif saved[key] is not None and saved[key] != shape:
            first = f"{_entry(key)} has shape {saved[key]} in the checkpoint but {shape} in this model"
        if first is not None:
            break
    gathered = _all_gather((first, [k for k in wanted if k.startswith("state_dict.")]))
    first = next((f for f, _ in gathered if f is not None), None)
    if first is None and extra:
        held = {k for _, keys in gathered for k in keys}  # DCP may flatten a value further: a list into k.0, k.1
        extra = [k for k in saved if k.startswith("state_dict.") and k not in held
                 and not any(k.startswith(f"{h}.") for h in held if k.startswith(h))]
        if extra:
            first = f"the checkpoint's {_entry(extra[0])} (shape {saved[extra[0]]}) is not in this model" + \
                (f" ({len(extra) - 1} more such entries)" if len(extra) > 1 else "")
    if first is not None:
        raise CheckpointError(f"{path} does not fit this model (saved from another model, size or optimizer?): "
                              f"{first}.")


def _dcp_load(state: dict[str, Any], path: Path, safe: bool) -> None:
    try:
        reader = _SafeReader(path) if safe else _ConfinedReader(path)
        reader.read_metadata()  # a crafted .metadata is refused here, on every rank, before DCP's collectives
        dcp.load(state, storage_reader=reader, planner=_SafeLoadPlanner() if safe else None)
    except CheckpointException as err:  # DCP wraps each rank's error; ours says which entry it refused and why
        ours = [exc for exc, _ in err.failures.values() if isinstance(exc, CheckpointError)]
        if ours:
            raise ours[0] from err
        raise


def remove(path: Path) -> None:
    """Delete a checkpoint, file or directory."""
    checkpoint_files.remove(path)


# -- loading without running code: what DCP's reader and planner lack -----------------------------------------------
def _dcp_classes() -> set[tuple[str, str]]:
    """The classes DCP's pickled ``.metadata`` is made of (its metadata dataclasses and enums)."""
    module = dcp_metadata.__name__
    return {(module, name) for name, obj in vars(dcp_metadata).items()
            if isinstance(obj, type) and obj.__module__ == module}


_METADATA_GLOBALS = _dcp_classes() | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # name -> torch.strided etc.
    *((module, name) for module in ("pathlib", "pathlib._local")
      for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),  # the checkpoint_id saved
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, stream: Any, file: Path) -> None:
        super().__init__(stream)
        self.file = file

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointError(f"{self.file} refers to {module}.{name}, which is not part of DCP's metadata: "
                              "refusing to unpickle it (it could run code). Is the checkpoint from a trusted source? "
                              "Then load it with weights_only=False.")


def _confine(metadata: dcp_metadata.Metadata, root: Path) -> dcp_metadata.Metadata:
    """Refuse a ``.metadata`` whose storage paths (the files DCP reads each entry from) lead out of ``root``."""
    for name in {info.relative_path for info in (metadata.storage_data or {}).values()}:  # a few files, many entries
        checkpoint_files.confined(root, name)
    return metadata


class _ConfinedReader(FileSystemReader):
    """DCP's file reader (metadata unpickled as DCP does: ``weights_only=False``), its storage paths confined."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        return _confine(super().read_metadata(*args, **kwargs), Path(self.path))


class _SafeReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` is unpickled with DCP's own metadata classes allowed and nothing else
    (DCP reads it with a plain ``pickle.load``, so a crafted file would run code), its storage paths confined."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        file = Path(self._get_metadata_path(kwargs.get("rank")))
        with self.fs.create_stream(file, "rb") as stream:
            metadata = _MetadataUnpickler(stream, file).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return _confine(metadata, Path(self.path))


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, except that entries stored as pickled bytes rather than tensors (optimizer
    hyper-parameters, ...) are unpickled with ``weights_only=True``; DCP's own uses ``weights_only=False``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise CheckpointError(f"the checkpoint's entry {fqn!r} is an object that loading with weights_only=True "
                                  f"refuses ({checkpoint_files.refused(err)}: unpickling it could run code). Load with "
                                  "weights_only=False only if you trust the checkpoint.") from err
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


# -- a plain single-file Lightning checkpoint into a sharded layout -------------------------------------------------
def _load_single_file(path: Path, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer] | None,
                      states: ParamStates, safe: bool,
                      model_params: Sequence[str] = ()) -> dict[str, Any]:
    """Every rank reads the file (full tensors, as one process saved them) and keeps its own share."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=safe)
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: loading with weights_only=True refuses an object in it "
                              f"({checkpoint_files.refused(err)}: unpickling it could run code). Load with "
                              "weights_only=False only if you trust this file.") from err
    except (RuntimeError, EOFError, OSError) as err:
        raise CheckpointError(f"{path} is not a readable checkpoint file (truncated or corrupted?): {err}") from err
    weights = checkpoint.pop("state_dict")
    own = model_state(module)  # a pipeline stage holds some of the names
    missing = [name for name in own if name not in weights]
    if missing:
        raise CheckpointError(f"{path} lacks {len(missing)} of this model's {len(own)} entries, e.g. {missing[:3]}: "
                              "was it saved from another model?")
    _check_fits(path, {"state_dict": own}, {f"state_dict.{name}": tuple(value.shape) if isinstance(
        value, torch.Tensor) else None for name, value in weights.items()}, extra=False)  # the shapes
    saved = checkpoint.pop("optimizer_states", None) or []
    if optimizers is None:  # the weights alone
        saved, optimizers = [], []
    if saved and len(saved) != len(optimizers):
        raise CheckpointError(f"{path} holds {len(saved)} optimizer states for {len(optimizers)} optimizers.")
    # checked before anything is loaded, so a refused checkpoint leaves the model as it was
    by_name = [_keyed_by_name(module, optimizers[i], state, states, f"{path}: optimizer {i}", model_params)
               for i, state in enumerate(saved)]
    states.load_full_model_state(module, {name: weights[name] for name in own})  # each rank keeps its share
    for optimizer, state in zip(optimizers, by_name, strict=False):
        materialize_optimizer_state(optimizer)  # full tensors go into existing state (its device, its shards)
        states.load_full_optimizer_state(module, optimizer, state)
    return checkpoint


def _keyed_by_name(module: nn.Module, optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                   states: ParamStates, what: str, model_params: Sequence[str] = ()) -> dict[str, Any]:
    """A plain optimizer state (parameters keyed by position) keyed by parameter name instead, for the parameters
    this optimizer holds (a pipeline stage holds some). Positions map to names through the ``param_names`` torch
    saves with each group (lightning-par's one-file saves always add them); without them, only an optimizer holding
    the same parameters in the same groups and order can take it (under ZeRO-1/2, the order its groups had before
    the partitioner replaced them), or -- a pipeline stage, given ``model_params`` -- one group over the whole model's
    parameters in the model's order (``configure_optimizers`` over ``self.parameters()``, as one process saved it):
    checked by group sizes and by every state tensor's shape."""
    names = {id(p): name for name, p in module.named_parameters()}
    groups = states.optimizer_groups(optimizer)
    if any(id(p) not in names for g in groups for p in g):
        raise CheckpointError(f"{what}: this optimizer holds parameters that are not the model's own.")
    held = {names[id(p)]: p for g in groups for p in g}
    saved_groups = saved["param_groups"]
    if all("param_names" in g for g in saved_groups):
        positions = [(g, pos, name) for g in saved_groups for pos, name in zip(g["params"], g["param_names"],
                                                                              strict=True)]
        absent = sorted(set(held) - {name for _, _, name in positions})
        if absent:
            raise CheckpointError(f"{what}: holds no optimizer state for {len(absent)} of this optimizer's "
                                  f"parameters, e.g. {absent[:3]}.")
    elif len(saved_groups) == 1 and len(saved_groups[0]["params"]) == len(model_params) != len(held):
        positions = list(zip([saved_groups[0]] * len(model_params), saved_groups[0]["params"], model_params,
                             strict=True))
    else:
        sizes = [len(g) for g in groups]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise CheckpointError(
                f"{what}: a single-file checkpoint without parameter names keys optimizer state by position (groups "
                f"of {saved_sizes} parameters), and this optimizer holds groups of {sizes} (one pipeline stage's, or "
                "another configure_optimizers); under pipeline stages only one group over all the model's "
                f"parameters ({len(model_params)}) in the model's order maps to names. Resume it under one process, "
                "data parallel, ZeRO or tensor parallel, or save it again there (lightning-par's checkpoints name "
                "their parameters).")
        positions = [(sg, pos, names[id(p)]) for g, sg in zip(groups, saved_groups, strict=True)
                     for pos, p in zip(sg["params"], g, strict=True)]
    state: dict[str, Any] = {}
    named_groups: dict[int, dict[str, Any]] = {}  # the saved groups this optimizer holds parameters of
    for group, position, name in positions:
        if name not in held:
            continue  # another pipeline stage's
        param = held[name]
        entry = saved["state"].get(position, {})
        for key, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise CheckpointError(f"{what}: state {key!r} of {name} (position {position}) has shape "
                                      f"{tuple(value.shape)}, but the parameter here has {tuple(param.shape)}: the "
                                      "optimizer's parameters are in another order, or its state is not per element.")
        if entry:
            state[name] = entry
        hyper = {key: value for key, value in group.items() if key not in ("params", "param_names")}
        named_groups.setdefault(id(group), {**hyper, "params": []})["params"].append(name)
    return {"state": state, "param_groups": list(named_groups.values())}
