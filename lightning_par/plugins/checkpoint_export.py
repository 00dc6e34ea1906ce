"""Export a checkpoint to the plain model's weights, and start a run from such weights under any layout.

Export (one process, no process group): :func:`read_model_state` reads the whole model state of a lightning-par
checkpoint -- a sharded DCP directory or a single-file Lightning checkpoint -- without unpickling anything but
tensors. :func:`export_safetensors` writes it as one ``.safetensors`` file under the plain model's names;
:func:`export_hf` writes a Hugging Face ``save_pretrained`` directory. Both materialise the full model in the one
exporting process, which is what a one-file export needs anyway. ``lightning-par export --help`` is the command.

Import: :class:`FromPretrained`, a callback, loads such a file or directory into the model after the strategy has
applied its layout, tensor by tensor, each rank keeping only its share (:func:`load_pretrained`).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pickle
import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_par.plugins import checkpoint_files, checkpoint_meta
from lightning_par.plugins.checkpoint_files import CheckpointError
from lightning_par.plugins.sharded_checkpoint import _all_gather, _SafeLoadPlanner, _SafeReader

_MODEL_KEY = "state_dict"  # the model's entries in a checkpoint (DCP flattens them to "state_dict.<fqn>")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
HF_WEIGHTS, HF_INDEX = "model.safetensors", "model.safetensors.index.json"


# -- reading a checkpoint in one process -------------------------------------------------------------------------
def read_model_state(path: str | Path) -> dict[str, Tensor]:
    """The full (unsharded) model state of a lightning-par checkpoint, keyed by the LightningModule's names.

    ``path``: a sharded DCP directory (its manifest is checked first, then only its model entries are read,
    resharded to full tensors by DCP) or a single-file Lightning checkpoint (one process, ZeRO-0). Runs in one
    process and needs no process group; nothing but tensors is unpickled. The whole model is materialised in this
    process's memory (an export needs it whole); to load into a sharded layout, resume with ``ckpt_path=`` instead.
    """
    path = checkpoint_files.resolve(Path(path))
    if path.is_file():
        return dict(_read_single_file(path)[_MODEL_KEY])
    _verify(path)
    reader = _SafeReader(path)
    metadata = reader.read_metadata()  # DCP's pickled metadata, with only DCP's own classes allowed
    planner_paths = getattr(metadata, "planner_data", None) or {}
    state: dict[str, Tensor] = {}
    skipped = []
    for key, entry in metadata.state_dict_metadata.items():
        if not key.startswith(_MODEL_KEY + "."):
            continue  # optimizer states: never read here
        where = planner_paths.get(key)
        if where is not None and (len(where) != 2 or where[0] != _MODEL_KEY):
            raise CheckpointError(f"{path}: the entry {key!r} is nested as {where}, not as a model entry "
                                  f"(state_dict -> parameter name): not a lightning-par model state.")
        if not isinstance(entry, TensorStorageMetadata):
            skipped.append(key)  # a module's pickled extra state: not a tensor, and not unpickled
            continue
        state[key[len(_MODEL_KEY) + 1:]] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not state:
        raise CheckpointError(f"{path} holds no model entries ({_MODEL_KEY}.*): is it a lightning-par checkpoint?")
    if skipped:
        rank_zero_warn(f"{path}: {len(skipped)} non-tensor model entries not exported, e.g. {skipped[:3]}")
    # no_dist: one process reads every shard, even inside a job that has a process group
    with warnings.catch_warnings():  # DCP warns that it assumes one process even when told so
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load({_MODEL_KEY: state}, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=True)
    return state


def read_hyperparameters(path: str | Path) -> dict[str, Any]:
    """The LightningModule hyper-parameters saved in a checkpoint (``{}`` if none), read without running code."""
    path = checkpoint_files.resolve(Path(path))
    if path.is_file():
        checkpoint = _read_single_file(path)
    else:
        _verify(path)
        checkpoint = checkpoint_meta.read(path, weights_only=True)
    return dict(checkpoint.get("hyper_parameters") or {})


def _verify(path: Path) -> None:
    """The whole directory against its manifest (sizes, then checksums), in this process alone: no collectives."""
    files = checkpoint_files.read_manifest(path)
    checkpoint_files.check_sizes(path, files)
    checkpoint_files.check_checksums(path, files, sorted(files))


def _read_single_file(path: Path) -> dict[str, Any]:
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


@dataclass
class ExportReport:
    """What an export wrote."""

    out: Path
    tensors: int
    bytes: int
    prefix: str
    tied: list[list[str]] = field(default_factory=list)

    def describe(self) -> str:
        tied = "".join(f"\n  {' = '.join(g)}: shared storage, each name written with its own copy" for g in self.tied)
        return (f"wrote {self.out}: {self.tensors} tensors, {self.bytes / 2**20:.2f} MiB, names without "
                f"{self.prefix + '.' if self.prefix else 'a prefix'!r}{tied}")


def export_safetensors(ckpt: str | Path, out: str | Path, prefix: str | None = None,
                       dtype: torch.dtype | None = None) -> ExportReport:
    """Write the model of checkpoint ``ckpt`` to one ``.safetensors`` file under the plain model's names, which
    ``model.load_state_dict(safetensors.torch.load_file(out))`` loads. ``prefix``: see :func:`strip_prefix`;
    ``dtype``: cast floating-point tensors (e.g. ``torch.bfloat16``)."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"{out}: the output file must end in .safetensors (or pass --hf for a directory).")
    state, prefix = strip_prefix(read_model_state(ckpt), prefix)
    state = _cast(state, dtype)
    tied = unshare(state)
    state = {k: v.contiguous() for k, v in state.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata={"format": "pt", "exported_from": str(ckpt)})
    return ExportReport(out, len(state), sum(v.numel() * v.element_size() for v in state.values()), prefix, tied)


def export_hf(ckpt: str | Path, out_dir: str | Path, model_class: str | None = None,
              dtype: torch.dtype | None = None) -> ExportReport:
    """Write the model of checkpoint ``ckpt`` as a Hugging Face ``save_pretrained`` directory, which
    ``AutoModelForCausalLM.from_pretrained(out_dir)`` loads.

    The LightningModule is rebuilt on the meta device (no memory) from the checkpoint's hyper-parameters: its class
    is ``model_class`` (``"package.Module"``) or the ``_class_path`` the Lightning CLI saves with them. Its child
    that is a ``transformers.PreTrainedModel`` gives the config and the prefix; the weights come from the checkpoint
    (checked name by name and shape by shape against that model).
    """
    from transformers import PreTrainedModel

    hparams = read_hyperparameters(ckpt)
    class_path = model_class or hparams.get("_class_path")
    if not class_path:
        raise ValueError(f"{ckpt} does not say which LightningModule saved it (no _class_path among its "
                         "hyper-parameters: it was not run through the lightning-par CLI). Pass --model-class, e.g. "
                         "--model-class example_models.HFLlamaLightningModule.")
    lm = _build_on_meta(_import_class(class_path), hparams)
    children = [(name, child) for name, child in lm.named_children() if isinstance(child, PreTrainedModel)]
    if len(children) != 1:
        raise ValueError(f"{class_path} holds {len(children)} Hugging Face models after configure_model() "
                         f"({[n for n, _ in children]}); --hf needs exactly one (e.g. self.model = LlamaForCausalLM).")
    prefix, hf_model = children[0]
    state, _ = strip_prefix(read_model_state(ckpt), prefix)
    expected = hf_model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k} {tuple(state[k].shape)} (model: {tuple(expected[k].shape)})"
             for k in expected if k in state and state[k].shape != expected[k].shape]
    if missing or unexpected or wrong:
        raise CheckpointError(f"{ckpt} does not fit {type(hf_model).__name__} built from its hyper-parameters: "
                              f"missing {missing[:3]}, unexpected {unexpected[:3]}, other shapes {wrong[:3]}.")
    state = _cast(state, dtype)
    unshare(state)
    if dtype is not None:
        hf_model.to(dtype)  # on the meta device: only so that save_pretrained writes the dtype into config.json
    out_dir = Path(out_dir)
    # the model is on the meta device: save_pretrained takes its config and its tied-weight rules, the tensors
    # come from `state_dict=` (its documented use for models whose parameters live elsewhere)
    report = ExportReport(out_dir, len(state), sum(v.numel() * v.element_size() for v in state.values()), prefix)
    hf_model.save_pretrained(out_dir, state_dict=dict(state), safe_serialization=True)  # it edits the dict it gets
    return report


def _import_class(class_path: str) -> type:
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"cannot import the LightningModule class {class_path!r}: {err}") from err
    if not (isinstance(cls, type) and issubclass(cls, LightningModule)):
        raise ValueError(f"{class_path} is not a LightningModule class.")
    return cls


def _build_on_meta(cls: type, hparams: dict[str, Any]) -> LightningModule:
    """``cls`` from its saved hyper-parameters, its model built by ``configure_model`` on the meta device."""
    accepted = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    kwargs = {k: v for k, v in hparams.items() if not k.startswith("_") and (takes_any or k in accepted)}
    with torch.device("meta"):
        lm = cls(**kwargs)
        lm.configure_model()
    return lm


# -- starting a run from exported weights ------------------------------------------------------------------------
class _Weights:
    """Tensors of a ``.safetensors`` file or a Hugging Face directory, read one at a time (memory-mapped)."""

    def __init__(self, path: Path, stack: ExitStack) -> None:
        from safetensors import safe_open

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
            else:
                raise FileNotFoundError(f"{path} holds neither {HF_WEIGHTS} nor {HF_INDEX}: not a Hugging Face "
                                        "save_pretrained directory (only safetensors weights are read, never "
                                        "pickled .bin files).")
            self.tied = _hf_tied_names(path)
        elif path.suffix != ".safetensors" or not path.is_file():
            raise FileNotFoundError(f"{path}: pass a .safetensors file or a Hugging Face save_pretrained directory.")

        def open_file(file: Path) -> Any:
            return stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))

        if files is None:
            handle = open_file(single)
            self._handles = {name: handle for name in handle.keys()}  # noqa: SIM118 (a safe_open handle)
        else:
            opened = {file: open_file(file) for file in set(files.values())}
            self._handles = {name: opened[file] for name, file in files.items()}

    def names(self) -> list[str]:
        return list(self._handles)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handles[name].get_slice(name).get_shape())

    def get(self, name: str) -> Tensor:
        return self._handles[name].get_tensor(name)


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


@torch.no_grad()
def load_pretrained(module: nn.Module, path: str | Path, prefix: str | None = None, strict: bool = True) -> int:
    """Copy the weights of a ``.safetensors`` file or a Hugging Face directory into ``module``, on any layout.

    Call it on every rank together once the layout is applied (after the strategy's ``setup``). Each rank reads
    only the tensors its share of the model needs, one at a time: a pipeline stage reads its own stages' tensors,
    and a tensor- or ZeRO-3-sharded parameter (a DTensor) keeps only its shard of the full tensor it read
    (``distribute_tensor`` with ``src_data_rank=None``: every rank holds the full tensor, so no communication).
    The extra memory is the largest single tensor. ``prefix``: the attribute holding the model whose names the file
    uses (``None``: the module's one child with parameters); ``strict``: a missing or unused tensor is an error
    (else a warning). Names, shapes and coverage are checked on every rank before anything is copied, and every
    rank raises the same error. Returns the number of tensors this rank copied.
    """
    path = Path(path)
    lead = prefix if prefix is not None else _model_prefix(module)
    lead = lead + "." if lead else ""
    targets = {name[len(lead):]: t for name, t in module.state_dict(keep_vars=True).items() if name.startswith(lead)}
    aliases: dict[str, list[str]] = {}  # a parameter under several names (tied), from this rank's modules
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if name.startswith(lead):
            by_id.setdefault(id(param), []).append(name[len(lead):])
    for names in by_id.values():
        for name in names:
            aliases[name] = [n for n in names if n != name]
    with ExitStack() as stack:
        weights = _Weights(path, stack)
        available = set(weights.names())
        source: dict[str, str] = {}
        missing, wrong = [], []
        for name, target in targets.items():
            candidates = [name, *aliases.get(name, []), *([weights.tied[name]] if name in weights.tied else [])]
            found = next((c for c in candidates if c in available), None)
            if found is None:
                missing.append(name)
            elif weights.shape(found) != tuple(target.shape):  # a DTensor's shape is the full one
                wrong.append(f"{name}: {weights.shape(found)} in the file, {tuple(target.shape)} in the model")
            else:
                source[name] = found
        verdicts = _all_gather((missing, wrong, sorted(set(source.values()))))
        missing = sorted({n for v in verdicts for n in v[0]})
        wrong = sorted({w for v in verdicts for w in v[1]})
        unused = sorted(available - {n for v in verdicts for n in v[2]})
        problems = []
        if wrong:
            problems.append(f"{len(wrong)} tensors have another shape, e.g. {wrong[:3]} (is the model built with the "
                            "same sizes as the one saved?)")
        if missing:
            problems.append(f"{len(missing)} of the model's tensors are not in the file, e.g. {missing[:3]}")
        if unused:
            problems.append(f"{len(unused)} tensors of the file match nothing in the model, e.g. {unused[:3]}")
        hint = f" The model's names are taken under {lead[:-1]!r}; pass prefix= if they are elsewhere." if lead else ""
        if wrong or (strict and problems):
            raise CheckpointError(f"{path} does not fit {type(module).__name__}: " + "; ".join(problems) + "." + hint)
        if problems:
            rank_zero_warn(f"{path}: " + "; ".join(problems) + " (loaded the rest, strict=False).")
        for name, found in source.items():
            _copy_full(targets[name], weights.get(found))
    return len(source)


def _copy_full(target: Tensor, full: Tensor) -> None:
    """Copy the full tensor ``full`` into ``target``, or into this rank's shard of it when it is a DTensor."""
    full = full.to(device=target.device, dtype=target.dtype)
    if isinstance(target, DTensor):
        # the same placements as the target: each rank's local piece of `full`, cut here without communication
        local = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        target.to_local().copy_(local)
    else:
        target.copy_(full)


class FromPretrained(Callback):
    """Start training (or evaluation) from pretrained weights, under any layout: the fine-tuning workflow.

    Loads a ``.safetensors`` file (``lightning-par export CKPT OUT.safetensors``) or a Hugging Face
    ``save_pretrained`` directory into the model after the strategy has laid it out, each rank reading only its
    share (see :func:`load_pretrained`). The LightningModule builds the same architecture as usual in
    ``configure_model``; this replaces its initial weights. A run resumed with ``ckpt_path=`` keeps the checkpoint's
    weights and skips this.

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

    def _load(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._loaded:
            return
        self._loaded = True
        if trainer.ckpt_path is not None:
            rank_zero_info(f"FromPretrained: resuming from {trainer.ckpt_path}; {self.path} is not loaded.")
            return
        n = load_pretrained(pl_module, self.path, self.prefix, self.strict)
        # ZeRO-1/2 optimizers hold copies (shards) of the parameters: they take the loaded values
        sync = getattr(trainer.strategy, "gradient_sync", None)
        if sync is not None:
            sync.after_load()
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


# -- the command ----------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lightning-par export",
        description="Export a lightning-par checkpoint (a sharded directory of any layout, or a single-file "
                    "checkpoint) to the plain model's weights: one .safetensors file, or with --hf a Hugging Face "
                    "save_pretrained directory. Runs in one process; the whole model is held in memory.",
        epilog="Start a run from the result under any layout: lightning-par fit ... "
               "--trainer.callbacks+=lightning_par.plugins.checkpoint_export.FromPretrained "
               "--trainer.callbacks.path=OUT",
    )
    parser.add_argument("checkpoint", help="the checkpoint: a directory (sharded layouts) or a .ckpt file")
    parser.add_argument("out", help="OUT.safetensors, or with --hf the directory to write")
    parser.add_argument("--hf", action="store_true",
                        help="write a Hugging Face save_pretrained directory (config.json + model.safetensors) that "
                             "AutoModelForCausalLM.from_pretrained loads; for a LightningModule holding one "
                             "transformers model")
    parser.add_argument("--prefix", default=None,
                        help="the LightningModule attribute to strip from the names (default: the one first name "
                             "component all entries share, e.g. 'model'); '' keeps the names. Without --hf only.")
    parser.add_argument("--model-class", default=None,
                        help="with --hf: the LightningModule class (e.g. example_models.HFLlamaLightningModule); "
                             "default: the class the Lightning CLI saved with the hyper-parameters")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="cast floating-point weights to this dtype (default: as saved)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``lightning-par export``: returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    dtype = DTYPES[args.dtype] if args.dtype else None
    if args.hf and args.prefix is not None:
        parser.error("--prefix applies without --hf; with --hf the prefix is the attribute holding the HF model.")
    try:
        if args.hf:
            report = export_hf(args.checkpoint, args.out, args.model_class, dtype)
        else:
            report = export_safetensors(args.checkpoint, args.out, args.prefix, dtype)
    except (CheckpointError, ValueError, FileNotFoundError) as err:
        print(f"lightning-par export: error: {err}")
        return 2
    print(report.describe())
    return 0

