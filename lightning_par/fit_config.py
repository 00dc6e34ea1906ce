"""``lightning-par plan --config CONFIG.yaml``: what to plan, read from the YAML that ``lightning-par fit`` reads.

From the fit config: the model (``model.class_path`` / ``init_args``), the world size (``trainer.devices`` x
``trainer.num_nodes``), the layout (``trainer.strategy``: a lightning-par class with its ``init_args``, or a registered
name), the precision (``trainer.precision``), the sequence length and batch (``data.init_args.seq_len`` /
``batch_size``, ``trainer.accumulate_grad_batches``), for ``trainer.accelerator: cpu`` the CPU hardware preset, and
the vocabulary of ``data.init_args.tokenizer`` (a model whose ``vocab_size`` is unset takes it, as in a fit).
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_par.topology import LayoutError

#: Lightning's precision flags -> the planner's precisions (others are left to --precision)
_PRECISIONS = {"32": "fp32", "32-true": "fp32", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true",
               "bf16-mixed-master": "bf16-mixed-master"}


@dataclass
class FitPlan:
    """What a fit config says about the run to plan; ``None`` where it says nothing."""

    model: str | None = None
    model_args: dict[str, Any] = field(default_factory=dict)
    world: int | None = None
    layout: dict[str, Any] = field(default_factory=dict)  # planner --layout keys: dp, tp, pp, zero, schedule, ...
    micro_batch: int | None = None
    global_batch: int | None = None
    seq: int | None = None
    hardware: str | None = None
    vocab_size: int | None = None  # the data's tokenizer's (padded) vocabulary; None: byte-level or no tokenizer
    notes: list[str] = field(default_factory=list)  # what was read, for the user


def read_fit_config(path: str | Path) -> FitPlan:
    """Read a ``lightning-par fit`` YAML config into what the planner needs (see the module docstring)."""
    try:
        config = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise LayoutError(f"--config {path}: cannot read it: {err}") from err
    if not isinstance(config, dict):
        raise LayoutError(f"--config {path}: not a fit config (a YAML mapping with model:, trainer:, data:).")
    plan = FitPlan()
    model_class, model_args = _class_and_args(config.get("model"))
    plan.model, plan.model_args = model_class, model_args
    trainer = config.get("trainer") or {}
    plan.world = _world(trainer.get("devices"), trainer.get("num_nodes", 1))
    strategy = _strategy(trainer.get("strategy"))
    if strategy is not None:
        plan.layout = layout_of(strategy)
        plan.notes.append(f"strategy {strategy!r}")
    if plan.layout and plan.world is not None:
        dp = plan.layout.get("dp") or plan.world // (plan.layout["tp"] * plan.layout["pp"])
        if dp == 1:
            plan.layout["zero"] = 0  # one replica: a ZeRO stage has nothing to shard over (the planner's zero=0)
    precision = _PRECISIONS.get(str(trainer.get("precision") or "32-true"))
    if precision is not None:
        plan.layout["precision"] = precision
    if str(trainer.get("accelerator", "")).lower() == "cpu":
        plan.hardware = "cpu"
    data_class, data_args = _class_and_args(config.get("data"))
    plan.vocab_size = _data_vocab_size(data_class, data_args, path)
    if plan.vocab_size is not None and plan.model_args.get("vocab_size") is None and _takes(plan.model, "vocab_size"):
        plan.model_args["vocab_size"] = plan.vocab_size  # what vocab_size_from_data gives the model in a fit
        plan.notes.append(f"vocabulary {plan.vocab_size} from the tokenizer {data_args['tokenizer']}")
    if isinstance(data_args.get("seq_len"), int):
        plan.seq = data_args["seq_len"]
    batch = data_args.get("batch_size")
    if isinstance(batch, int) and batch > 0:  # one data-parallel replica's batch, split into micro-batches under pp
        pp = plan.layout.get("pp", 1)
        micro_batches = plan.layout.get("m") or (2 * pp if pp > 1 else 1)
        plan.micro_batch = max(batch // micro_batches, 1)
        plan.layout.pop("m", None)  # the global batch below says it
        accumulate = int(trainer.get("accumulate_grad_batches") or 1)
        if plan.world is not None:
            dp = plan.layout.get("dp") or plan.world // (plan.layout.get("tp", 1) * pp) or 1
            plan.global_batch = plan.micro_batch * micro_batches * accumulate * dp
    return plan


def layout_of(strategy: Any) -> dict[str, Any]:
    """The planner's ``--layout`` of a lightning-par strategy instance (its :class:`Layout`)."""
    layout = strategy.layout
    out: dict[str, Any] = {"tp": layout.tp, "pp": layout.pp, "zero": layout.zero_stage,
                           "recompute": layout.recompute, "sp": layout.sequence_parallel}
    if layout.dp != "auto":
        out["dp"] = layout.dp
    if layout.ep > 1:
        out["ep"] = layout.ep
    if layout.pp > 1:
        plan = layout.stage_plan
        out["schedule"] = layout.schedule
        out["m"] = plan.n_microbatches
        if plan.virtual_stages > 1:
            out["v"] = plan.virtual_stages
    return out


def _data_vocab_size(class_path: str | None, args: dict[str, Any], path: str | Path) -> int | None:
    """The vocabulary a fit config's TextDataModule gives the model: its ``tokenizer`` directory loaded as the data
    module loads it, padded as it pads it (the corpus is not read). ``None`` without a tokenizer or for another data
    module."""
    from lightning_par.data import TextDataModule, load_tokenizer, tokenizer_vocab_size

    tokenizer = args.get("tokenizer")
    if not isinstance(tokenizer, str):
        return None
    if class_path and "." not in class_path:  # a short name, as jsonargparse accepts it
        class_path = f"lightning_par.data.{class_path}"
    cls = _import(class_path) if class_path else TextDataModule
    if not (isinstance(cls, type) and issubclass(cls, TextDataModule)):
        return None
    pad = args.get("pad_vocab_to", inspect.signature(cls).parameters["pad_vocab_to"].default)
    try:
        return tokenizer_vocab_size(load_tokenizer(tokenizer, args.get("trust_remote_code") is True), int(pad))
    except (OSError, ValueError, ImportError, TypeError) as err:
        raise LayoutError(f"--config {path}: data.init_args.tokenizer={tokenizer!r}: {err}") from err


def _takes(class_path: str | None, name: str) -> bool:
    """Whether the class at ``class_path`` takes an init argument ``name``."""
    cls = _import(class_path) if class_path else None
    return isinstance(cls, type) and name in inspect.signature(cls).parameters


def _import(class_path: str) -> Any:
    module, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _class_and_args(spec: Any) -> tuple[str | None, dict[str, Any]]:
    if isinstance(spec, str):
        return spec, {}
    if isinstance(spec, dict):
        return spec.get("class_path"), dict(spec.get("init_args") or {})
    return None, {}


def _world(devices: Any, num_nodes: Any) -> int | None:
    """``devices`` x ``num_nodes``; ``None`` where devices is ``auto`` / -1 (then ``--world`` says it)."""
    if isinstance(devices, list | tuple):
        count = len(devices)
    elif isinstance(devices, int) or (isinstance(devices, str) and devices.strip().isdigit()):
        count = int(devices)
    else:
        return None
    return count * int(num_nodes or 1) if count > 0 else None


def _strategy(spec: Any) -> Any:
    """The lightning-par strategy a fit config's ``trainer.strategy`` makes (a name, or class_path + init_args);
    ``None`` for ``auto``, a missing one, or one that is not lightning-par's (every layout is planned then)."""
    from lightning_par.strategies import ALL_STRATEGIES
    from lightning_par.strategies.names import strategy_spec

    if spec is None or spec == "auto":
        return None
    class_path, init_args = _class_and_args(spec)
    named = strategy_spec(class_path)
    if named is not None:  # a registered name, as trainer.strategy or as class_path
        class_path, init_args = named["class_path"], {**named["init_args"], **init_args}
    if not isinstance(class_path, str):
        return None
    if "." not in class_path:
        class_path = f"lightning_par.{class_path}"
    cls = _import(class_path)
    if cls not in ALL_STRATEGIES:
        return None
    return cls(**init_args)
