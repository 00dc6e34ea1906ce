"""Pretrained weights read straight into each rank's shards: the fine-tuning workflow, under any layout.

:class:`FromPretrained` (a callback) hands a ``.safetensors`` file or a Hugging Face ``save_pretrained`` directory
(one file, or sharded files with their ``model.safetensors.index.json``) to a lightning-par strategy before it
builds the model. The strategy builds the model deferred, applies the layout on the meta device, checks the file
against the model (:meth:`PretrainedWeights.check`: names, shapes, dtypes, coverage, the same verdict on every
rank, before anything is read), allocates this rank's share without computing the random initialisation of what the
file overwrites, and reads into it only the slices this rank owns (:meth:`PretrainedWeights.load`: safetensors'
``get_slice``, memory-mapped). No rank holds a full tensor it does not own, nor the model. Under another strategy
the callback loads after setup, into whatever the strategy built. A mixture of experts' fused tensors are read from
a directory that holds them one per expert too, by the model's own conversions
(:mod:`~lightning_par.plugins.pretrained_experts`).

Only safetensors are read: a directory with pickled ``.bin`` weights is refused (unpickling runs code).
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

from lightning_par.parallel.materialize import local_piece, local_tensor
from lightning_par.plugins import checkpoint_files
from lightning_par.plugins.checkpoint_files import CheckpointError
from lightning_par.plugins.pretrained_experts import FusedTensor, converted_tensors
from lightning_par.plugins.sharded_checkpoint import _all_gather

__all__ = ["FromPretrained", "PretrainedWeights", "load_pretrained"]

HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class _SafetensorsFile:
    """One ``.safetensors`` file, read with ``pread`` by slices.

    Why not ``safe_open``: it memory-maps the file, and every page a read touches counts in the process's resident
    memory until it is unmapped -- a column slice (a row-parallel weight) touches all of the tensor's pages, so a rank
    would end up holding the whole file. Reading the slice's contiguous runs with ``os.pread`` leaves only the slice
    in memory (the rest stays in the page cache, which the kernel reclaims). The format is a little-endian u64 header
    length, a JSON header (dtype, shape, data_offsets per tensor) and the data.
    """

    def __init__(self, path: Path, stack: ExitStack) -> None:
        import os

        self.fd = os.open(path, os.O_RDONLY)
        stack.callback(os.close, self.fd)
        (length,) = struct.unpack("<Q", os.pread(self.fd, 8, 0))
        header = json.loads(os.pread(self.fd, length, 8))
        header.pop("__metadata__", None)
        self.base = 8 + length
        self.header: dict[str, dict] = header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def dtype(self, name: str) -> torch.dtype | None:
        return _SAFETENSORS_DTYPES.get(self.header[name]["dtype"])

    def read(self, name: str, slices: tuple[slice, ...] | None) -> Tensor:
        import os

        info = self.header[name]
        dtype, shape = _SAFETENSORS_DTYPES[info["dtype"]], list(info["shape"])
        start = self.base + info["data_offsets"][0]
        itemsize = torch.empty((), dtype=dtype).element_size()
        ranges = [range(*s.indices(n)) for s, n in zip(slices, shape, strict=True)] if slices else \
            [range(n) for n in shape]
        out_shape = [len(r) for r in ranges]
        out = torch.empty(out_shape, dtype=dtype)
        if out.numel() == 0:
            return out
        if not shape:
            return torch.frombuffer(bytearray(os.pread(self.fd, itemsize, start)), dtype=dtype).reshape(())
        # the last dimension cut short: everything after it is whole, so each run below is contiguous in the file
        cut = max((d for d, r in enumerate(ranges) if len(r) != shape[d]), default=0)
        inner = math.prod(shape[cut + 1:])
        run = len(ranges[cut]) * inner * itemsize
        flat = out.view(-1).view(torch.uint8)
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        for i, index in enumerate(itertools.product(*ranges[:cut])):
            offset = sum(k * stride for k, stride in zip(index, strides, strict=False)) + ranges[cut].start * inner
            data = os.pread(self.fd, run, start + offset * itemsize)
            flat[i * run:(i + 1) * run] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return out


class _Weights:
    """Tensors of a ``.safetensors`` file or a Hugging Face directory (one file, or shards with their index)."""

    def __init__(self, path: Path, stack: ExitStack) -> None:
        self.path = path
        self.tied: dict[str, str] = {}  # name the file may lack -> the name it is tied to
        files: dict[str, Path] | None = None  # tensor name -> file, for weights sharded over several files
        single = path
        if path.is_dir():
            if (path / checkpoint_files.MANIFEST).is_file():
                raise ValueError(f"{path} is a lightning-par checkpoint: resume it with ckpt_path=, or export its "
                                 f"weights first (lightning-par export {path} OUT.safetensors).")
            if (path / HF_INDEX).is_file():
                weight_map = json.loads((path / HF_INDEX).read_text())["weight_map"]
                files = {name: path / file for name, file in weight_map.items()}
            elif (path / HF_WEIGHTS).is_file():
                single = path / HF_WEIGHTS
            elif any(path.glob("*.bin")):
                raise ValueError(f"{path} holds only pickled .bin weights, which are never read here (unpickling "
                                 "runs code from the file). Convert them once where you trust the file: "
                                 "AutoModelForCausalLM.from_pretrained(path).save_pretrained(out, "
                                 "safe_serialization=True).")
            else:
                raise FileNotFoundError(f"{path} holds neither {HF_WEIGHTS} nor {HF_INDEX}: not a Hugging Face "
                                        "save_pretrained directory.")
            self.tied = _hf_tied_names(path)
        elif path.suffix != ".safetensors" or not path.is_file():
            raise FileNotFoundError(f"{path}: pass a .safetensors file or a Hugging Face save_pretrained directory.")
        if files is None:
            handle = _SafetensorsFile(single, stack)
            self._files = {name: handle for name in handle.header}
        else:
            opened = {file: _SafetensorsFile(file, stack) for file in set(files.values())}
            self._files = {name: opened[file] for name, file in files.items()}
        self._converted: dict[str, FusedTensor | str] = {}  # model name -> the file's tensor(s) it is read from

    def convert(self, converted: dict[str, FusedTensor | str]) -> None:
        """Offer ``converted``'s tensors under the model's names, in place of the file's tensors they are read from
        (another name, or one tensor per expert)."""
        self._converted = converted

    def names(self) -> list[str]:
        taken = {name for c in self._converted.values() for name in ([c] if isinstance(c, str) else c.files())}
        return [name for name in self._files if name not in taken] + list(self._converted)

    def _stored(self, name: str) -> str | FusedTensor:
        return self._converted.get(name, name)

    def shape(self, name: str) -> tuple[int, ...]:
        stored = self._stored(name)
        return stored.shape if isinstance(stored, FusedTensor) else self._files[stored].shape(stored)

    def dtype(self, name: str) -> torch.dtype | None:
        stored = self._stored(name)
        return stored.dtype if isinstance(stored, FusedTensor) else self._files[stored].dtype(stored)

    def piece(self, name: str, slices: tuple[slice, ...] | None) -> Tensor:
        """The tensor ``name``, or only its part ``slices`` (read from the file without the rest)."""
        stored = self._stored(name)
        if isinstance(stored, FusedTensor):
            return stored.read(self.piece, slices)
        return self._files[stored].read(stored, slices)


def _hf_tied_names(path: Path) -> dict[str, str]:
    """The names ``save_pretrained`` leaves out of a tied model (``lm_head.weight`` -> ``model.embed_tokens.weight``),
    from the model class's own declaration when config.json says the embeddings are tied."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return {}
    config = json.loads(config_file.read_text())
    if not config.get("tie_word_embeddings"):
        return {}
    try:
        import transformers

        declared = getattr(transformers, (config.get("architectures") or [""])[0])._tied_weights_keys
    except (ImportError, AttributeError):
        return {}
    return dict(declared) if isinstance(declared, Mapping) else {}


def _model_prefix(module: nn.Module) -> str:
    """The attribute of ``module`` holding all its parameters (``model`` for ``self.model``)."""
    holders = [name for name, child in module.named_children() if next(child.parameters(), None) is not None]
    if len(holders) != 1:
        raise ValueError(f"{type(module).__name__} holds parameters in {holders}, not in one child module: pass "
                         "prefix= (the attribute the weights belong to, or '' for the module's own names).")
    return holders[0]


def _kinds_differ(saved: torch.dtype | None, target: torch.dtype) -> bool:
    """A floating-point tensor may be read into another floating-point dtype (bf16 weights into an fp32 model);
    anything else must match exactly."""
    if saved is None:
        return False
    return not (saved.is_floating_point and target.is_floating_point) and saved != target


class PretrainedWeights:
    """A ``.safetensors`` file or Hugging Face directory, matched against a module's names and read by slices.

    Args:
        path: the file or directory.
        prefix: the attribute of the module holding the model whose names the file uses (``None``: the module's one
            child with parameters, e.g. ``model``).
        strict: a missing or unused tensor is an error (else a warning; a shape or dtype mismatch is always one).
    """

    def __init__(self, path: str | Path, prefix: str | None = None, strict: bool = True) -> None:
        self.path = Path(path)
        self.prefix = prefix
        self.strict = strict
        self._sources: dict[str, str] = {}  # module name (with the prefix) -> name in the file
        self._converted: dict[str, FusedTensor | str] = {}  # the model's names the file holds otherwise

    def _lead(self, module: nn.Module) -> str:
        lead = self.prefix if self.prefix is not None else _model_prefix(module)
        return lead + "." if lead else ""

    def check(self, module: nn.Module) -> set[str]:
        """Match the file against ``module`` (this rank's part of it; the tensors may still be on the meta device).
        Every rank calls it together and raises the same error, naming the first mismatches, before any tensor is
        read. Returns the names (relative to ``module``) the file fills."""
        lead = self._lead(module)
        targets = {n[len(lead):]: t for n, t in module.state_dict(keep_vars=True).items() if n.startswith(lead)}
        aliases: dict[str, list[str]] = {}  # a parameter under several names (tied), from this rank's modules
        by_id: dict[int, list[str]] = {}
        for name, param in module.named_parameters(remove_duplicate=False):
            if name.startswith(lead):
                by_id.setdefault(id(param), []).append(name[len(lead):])
        for names in by_id.values():
            for name in names:
                aliases[name] = [n for n in names if n != name]
        with ExitStack() as stack:
            weights = _Weights(self.path, stack)
            if not set(targets) <= set(weights.names()):  # e.g. a MoE's fused experts, saved one per expert
                model = module.get_submodule(lead[:-1]) if lead else module
                self._converted = converted_tensors(model, weights.names(), weights.shape, weights.dtype)
                weights.convert(self._converted)
            available = set(weights.names())
            source: dict[str, str] = {}
            missing, wrong = [], []
            for name, target in targets.items():
                candidates = [name, *aliases.get(name, []), *([weights.tied[name]] if name in weights.tied else [])]
                found = next((c for c in candidates if c in available), None)
                if found is None:
                    missing.append(name)
                elif weights.shape(found) != tuple(target.shape):  # a DTensor's shape is the full one
                    wrong.append(f"{name}: shape {list(weights.shape(found))} in the file, {list(target.shape)} in "
                                 "the model")
                elif _kinds_differ(weights.dtype(found), target.dtype):
                    wrong.append(f"{name}: {weights.dtype(found)} in the file, {target.dtype} in the model")
                else:
                    source[name] = found
        verdicts = _all_gather((missing, wrong, sorted(set(source.values()))))
        missing = sorted({n for v in verdicts for n in v[0]})
        wrong = sorted({w for v in verdicts for w in v[1]})
        unused = sorted(available - {n for v in verdicts for n in v[2]})
        problems = []
        if wrong:
            problems.append(f"{len(wrong)} tensors do not match, first {wrong[:3]} (is the model built with the same "
                            "sizes and dtypes as the one saved?)")
        if missing:
            problems.append(f"{len(missing)} of the model's tensors are not in the file, first {missing[:3]}")
        if unused:
            problems.append(f"{len(unused)} tensors of the file match nothing in the model, first {unused[:3]}")
        hint = f" The model's names are taken under {lead[:-1]!r}; pass prefix= if they are elsewhere." if lead else ""
        if missing and unused and self.path.is_dir():
            hint += (" A Hugging Face directory whose tensors transformers converts on load otherwise than by "
                     "stacking experts, joining projections or renaming is not read here: save it in the model's own "
                     "layout (save_pretrained(dir, save_original_format=False)).")
        if wrong or (self.strict and problems):
            raise CheckpointError(f"{self.path} does not fit {type(module).__name__}: " + "; ".join(problems) + "."
                                  + hint)
        if problems:
            rank_zero_warn(f"{self.path}: " + "; ".join(problems) + " (loaded the rest, strict=False).")
        self._sources = {lead + name: found for name, found in source.items()}
        return set(self._sources)

    @torch.no_grad()
    def load(self, module: nn.Module) -> int:
        """Read each checked tensor's slice that this rank owns into ``module`` (after :meth:`check`); returns how
        many tensors were read. The memory beyond the rank's share is one slice at a time."""
        state = module.state_dict(keep_vars=True)
        with ExitStack() as stack:
            weights = _Weights(self.path, stack)
            weights.convert(self._converted)
            for name, found in self._sources.items():
                target = state[name]
                piece = local_piece(target, lambda slices, found=found: weights.piece(found, slices))
                local_tensor(target).copy_(piece)
                del piece
        return len(self._sources)


def load_pretrained(module: nn.Module, path: str | Path, prefix: str | None = None, strict: bool = True) -> int:
    """Copy the weights of a ``.safetensors`` file or a Hugging Face directory into ``module``, on any layout, after
    the layout is applied; every rank calls it together (see :class:`PretrainedWeights`). Returns the number of
    tensors this rank read."""
    weights = PretrainedWeights(path, prefix, strict)
    weights.check(module)
    return weights.load(module)


class FromPretrained(Callback):
    """Start training (or evaluation) from pretrained weights, under any layout: the fine-tuning workflow.

    Reads a ``.safetensors`` file (``lightning-par export CKPT OUT.safetensors``) or a Hugging Face
    ``save_pretrained`` directory (one file or sharded, with its index) into the model. The LightningModule builds
    the same architecture as usual in ``configure_model``. Under a lightning-par strategy the weights go straight into
    each rank's shards while the layout is applied (the random initialisation they replace is never computed, and no
    rank reads more than its own slices); under another strategy they are loaded after its setup. A run resumed with
    ``ckpt_path=`` ends up with the checkpoint's weights.

    Args:
        path: the ``.safetensors`` file or the Hugging Face directory.
        prefix: the LightningModule attribute holding the model the file's names belong to; default: its one child
            module with parameters (``self.model``).
        strict: a tensor missing from the file, or a tensor of the file the model lacks, is an error; ``False``
            warns and loads the rest.
    """

    def __init__(self, path: str, prefix: str | None = None, strict: bool = True) -> None:
        self.path = Path(path)
        self.prefix = prefix
        self.strict = strict
        if not self.path.exists():
            raise FileNotFoundError(f"FromPretrained: {self.path} does not exist.")
        self._loaded = False

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        # before configure_model and the strategy's setup: a lightning-par strategy reads the weights into the
        # shards it materialises
        if hasattr(trainer.strategy, "pretrained"):
            trainer.strategy.pretrained = PretrainedWeights(self.path, self.prefix, self.strict)
            self._loaded = True

    def _load(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.ckpt_path is not None:
            rank_zero_info(f"FromPretrained: resuming from {trainer.ckpt_path}; its weights replace {self.path}.")
            self._loaded = True
        if self._loaded:
            return
        self._loaded = True
        n = load_pretrained(pl_module, self.path, self.prefix, self.strict)
        rank_zero_info(f"FromPretrained: loaded {n} tensors from {self.path} (rank 0's share)")

    # after the strategy's setup (the layout is applied) and before the first step of each kind of run
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._load(trainer, pl_module)

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._load(trainer, pl_module)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._loaded = False
