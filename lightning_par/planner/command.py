"""The winner of ``lightning-par plan`` as something to run: the ``lightning-par fit`` command line, and with
``--write-config PATH`` a fit config (YAML) that trains that layout.

Everything the estimate assumed is written: the ranks (``trainer.devices`` x ``num_nodes``), the layout as
``lightning_par.LayoutStrategy`` options, the precision, and the batch -- each data-parallel replica's
``data.batch_size`` (micro-batch x pipeline micro-batches) and ``trainer.accumulate_grad_batches`` (the micro-batches
of a layout without a pipeline) -- so the run's global batch is the one planned. Planned from ``--config``, the
config's other settings are kept; planned from ``--model``, the data module is the user's to add.
"""

from __future__ import annotations

import copy
import shlex
from pathlib import Path
from typing import Any

import yaml

from lightning_par.planner.plan import Candidate, Workload

#: the planner's precisions -> ``--trainer.precision`` (bf16-mixed-master is lightning-par's LayoutPrecision plugin)
TRAINER_PRECISION = {"fp32": "32-true", "bf16-mixed": "bf16-mixed", "bf16-true": "bf16-true",
                     "bf16-mixed-master": "bf16-mixed-master"}


def strategy_args(c: Candidate) -> dict[str, Any]:
    """``LayoutStrategy`` init arguments of a candidate (the defaults left out)."""
    out: dict[str, Any] = {"dp": c.dp, "tp": c.tp, "pp": c.pp, "zero_stage": c.zero_stage}
    if c.ep > 1:
        out["ep"] = c.ep
    if c.pp > 1:
        out.update(schedule=c.schedule, n_microbatches=c.n_microbatches)
        if c.virtual_stages > 1:
            out["virtual_stages"] = c.virtual_stages
    if c.sequence_parallel:
        out["sequence_parallel"] = True
    if c.recompute != "none":
        out["recompute"] = c.recompute
    return out


def trainer_precision(c: Candidate) -> str:
    """``Trainer(precision=...)`` of a candidate (bf16-mixed-master: lightning-par's CLI takes it there; a script
    passes ``plugins=[LayoutPrecision("bf16-mixed-master")]``)."""
    return TRAINER_PRECISION[c.precision]


def batch_settings(c: Candidate, work: Workload) -> tuple[int, int]:
    """``(data.batch_size, trainer.accumulate_grad_batches)`` that give the planned step: a pipeline splits one
    replica's batch into its micro-batches; without one, the micro-batches are accumulated."""
    if c.pp > 1:
        return work.micro_batch * c.n_microbatches, 1
    return work.micro_batch, c.n_microbatches


def fit_config(c: Candidate, work: Workload, base: dict[str, Any] | None = None,
               model: str | None = None, model_args: dict[str, str] | None = None) -> dict[str, Any]:
    """A fit config that trains candidate ``c``: ``base`` (a fit config read from YAML) with its trainer and batch
    set to the plan's, or a new one for ``model`` and its ``model_args``."""
    config = copy.deepcopy(base) if base else {}
    if model is not None and not (base and base.get("model")):
        config["model"] = {"class_path": model, "init_args": dict(model_args or {})}
    trainer = config.setdefault("trainer", {}) or {}
    config["trainer"] = trainer
    nodes = int(trainer.get("num_nodes") or 1)
    trainer["devices"] = c.world // nodes if c.world % nodes == 0 else c.world
    if c.world % nodes:
        trainer["num_nodes"] = 1
    trainer["strategy"] = {"class_path": "lightning_par.LayoutStrategy", "init_args": strategy_args(c)}
    plugins = [p for p in _as_list(trainer.get("plugins"))
               if not (isinstance(p, dict) and str(p.get("class_path", "")).endswith("LayoutPrecision"))]
    if c.precision == "bf16-mixed-master":  # lightning-par's own mode: a plugin, not a Trainer flag
        trainer.pop("precision", None)
        plugins.append({"class_path": "lightning_par.LayoutPrecision", "init_args": {"precision": c.precision}})
    else:
        trainer["precision"] = TRAINER_PRECISION[c.precision]
    if plugins:
        trainer["plugins"] = plugins
    else:
        trainer.pop("plugins", None)
    batch, accumulate = batch_settings(c, work)
    if accumulate > 1:
        trainer["accumulate_grad_batches"] = accumulate
    else:
        trainer.pop("accumulate_grad_batches", None)
    data = config.get("data")
    if isinstance(data, dict):
        args = data.setdefault("init_args", {}) or {}
        data["init_args"] = args
        args["batch_size"] = batch
        if "seq_len" in args:
            args["seq_len"] = work.seq_len
    return config


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def fit_command(c: Candidate, work: Workload, config_path: str | None = None, model: str | None = None,
                model_args: dict[str, str] | None = None) -> str:
    """The ``lightning-par fit`` command line that trains candidate ``c`` (see the module docstring); without a
    ``config_path`` it has no ``--data``: the caller says what batch the data module must give."""
    words = ["lightning-par", "fit"]
    base: dict[str, Any] = {}
    if config_path:
        words += ["--config", str(config_path)]
        base = yaml.safe_load(Path(config_path).read_text()) or {}
    else:
        words.append(f"--model={model}")
        words += [f"--model.{k}={v}" for k, v in (model_args or {}).items()]
    nodes = int((base.get("trainer") or {}).get("num_nodes") or 1)
    data_args = (base.get("data") or {}).get("init_args") or {} if isinstance(base.get("data"), dict) else {}
    words.append(f"--trainer.devices={c.world // nodes if c.world % nodes == 0 else c.world}")
    if nodes > 1 and c.world % nodes:
        words.append("--trainer.num_nodes=1")
    words.append("--trainer.strategy=lightning_par.LayoutStrategy")
    words += [f"--trainer.strategy.{k}={_flag(v)}" for k, v in strategy_args(c).items()]
    words.append(f"--trainer.precision={TRAINER_PRECISION[c.precision]}")
    batch, accumulate = batch_settings(c, work)
    if accumulate > 1:
        words.append(f"--trainer.accumulate_grad_batches={accumulate}")
    if base.get("data"):
        words.append(f"--data.batch_size={batch}")
        if "seq_len" in data_args:
            words.append(f"--data.seq_len={work.seq_len}")
    return " ".join(shlex.quote(w) for w in words)


def _flag(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def write_fit_config(path: str | Path, config: dict[str, Any], label: str) -> None:
    """Write ``config`` as YAML to ``path``, headed by what it is."""
    text = yaml.safe_dump(config, sort_keys=False)
    Path(path).write_text(f"# written by lightning-par plan: the fastest layout that fits and runs, {label}\n"
                          f"# run it with: lightning-par fit --config {path}\n{text}")
