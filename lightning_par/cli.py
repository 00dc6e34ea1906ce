"""``lightning-par``: the Lightning CLI with lightning-par's strategies, TensorBoard logging and throughput.

    lightning-par fit --config configs/demo.yaml
    lightning-par fit --config configs/demo.yaml --trainer.devices=4 --trainer.strategy=zero0
    lightning-par fit --config configs/demo.yaml --trainer.strategy=pipeline2_zbv --trainer.strategy.n_microbatches=8
    lightning-par fit --trainer.strategy.help pipeline      # every option of one strategy (a name or a class)
    lightning-par plan --config configs/demo.yaml     # before launching; or --model=CLASS --world N
    lightning-par export CKPT OUT.safetensors          # or: lightning-par export CKPT OUT_DIR --hf

Checkpoints by default: ``fit`` saves every ``--checkpoint_every_n_steps`` steps and at the end into the logger's run
directory (``lightning_logs/version_N/checkpoints``), ``last.ckpt`` linking to the newest, unless the user passes a
``ModelCheckpoint`` or ``--trainer.enable_checkpointing=false``. ``--ckpt_path=last`` takes the newest complete
checkpoint of every run of the logger's name (``save_dir/name/version_*/checkpoints``, and a ``ModelCheckpoint``'s own
dirpath). Restarted by torchrun (``--max-restarts``) or a SLURM requeue, ``fit`` continues the run it restarts: the
same version directory, from its newest complete checkpoint (:meth:`LightningParCLI.resume`).

Logs by default (:mod:`lightning_par.callbacks`): ``train/tokens_per_sec`` and ``train/mfu``, memory min/mean/max over
ranks, the pipeline timeline; ``log_every_n_steps`` scaled to a short run and no TensorBoard ``hp_metric`` unless the
user sets them; the model summary followed by a line saying what its counts cover.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from jsonargparse import DefaultHelpFormatter, Namespace
from jsonargparse.typing import NonNegativeInt
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.strategies import Strategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par import run_dir
from lightning_par._compat import ActionHelpClassPath, ActionTypeHint, NestedArg
from lightning_par.callbacks import DEFAULTS, ParallelModelSummary, RunCheckpoint
from lightning_par.data import DataError
from lightning_par.plugins.checkpoint_files import CheckpointError, newest_complete
from lightning_par.run import shutdown
from lightning_par.strategies import ALL_STRATEGIES, LayoutStrategy
from lightning_par.strategies.names import registered_names, strategy_spec, unknown_strategy_message
from lightning_par.topology import LayoutError


def strategies_help() -> str:
    """A short catalogue of the strategies for ``--help``: class path and summary line of each."""
    lines = ["lightning-par strategies (pick with --trainer.strategy=NAME or class_path/init_args):"]
    for cls in ALL_STRATEGIES:
        summary = (inspect.getdoc(cls) or "").splitlines()[0]
        lines.append(f"  lightning_par.{cls.__name__}: {summary}")
    generic = [cls.strategy_name for cls in ALL_STRATEGIES[1:]]
    presets = [name for name in registered_names() if name not in generic and name != LayoutStrategy.strategy_name]
    lines.append(f"Names, any size: {', '.join(generic)} -- e.g. --trainer.strategy=hybrid3d --trainer.strategy.tp=2 "
                 "--trainer.strategy.pp=2, or --trainer.strategy=zero --trainer.strategy.stage=3.")
    lines.append(f"Presets: {', '.join(presets)}.")
    lines.append("Every name takes options after it: --trainer.strategy=pipeline2_zbv "
                 "--trainer.strategy.n_microbatches=8 (in YAML: strategy: {class_path: pipeline2_zbv, init_args: "
                 "{n_microbatches: 8}}).")
    lines.append("Every option of one: lightning-par fit --trainer.strategy.help zero (a name or a class: "
                 "lightning_par.ZeroStrategy)")
    lines.append("Precision: --trainer.precision=32-true, bf16-mixed, bf16-true, 16-true, 16-mixed, or lightning-par's "
                 "bf16-mixed-master (Megatron-style: bf16 parameters, fp32 gradients, masters and optimizer states "
                 "sharded by ZeRO 1-3; docs/precision.md)")
    lines.append("Before launching: lightning-par plan --config CONFIG.yaml, or --model=CLASS --world N (bytes per "
                 "rank, traffic, bubble and step time of every layout; lightning-par plan --help)")
    return "\n".join(lines)


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keep the strategy catalogue's line breaks in ``--help``."""


CKPT_PATH_HELP = (
    "Checkpoint to start from: a path, or 'last': the newest COMPLETE checkpoint (one whose save was interrupted is "
    "never taken) of every run of this logger name -- save_dir/name/version_*/checkpoints, e.g. "
    "lightning_logs/version_*/checkpoints -- and of a ModelCheckpoint's own dirpath; a new run still gets a new "
    "version directory. Under torchrun --max-restarts or a SLURM requeue (a restart count > 0) fit continues the "
    "run it restarts by itself: the same version directory, from its newest complete checkpoint (if it has none, "
    "from this ckpt_path).")

#: environment variables that count the restarts of a job: torchrun's (--max-restarts), SLURM's (requeue)
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def restart_count() -> tuple[str, int] | None:
    """``(variable, count)`` when this process belongs to a restarted job (a count > 0), else ``None``."""
    for name in RESTART_COUNTS:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return name, int(value)
    return None


def launched_nodes() -> tuple[int, str] | None:
    """``(nodes, where)``: how many nodes the launcher started this attempt on -- torchrun's ``WORLD_SIZE /
    LOCAL_WORLD_SIZE`` (an elastic ``--nnodes=MIN:MAX`` rendezvous may give fewer or more than the last attempt),
    SLURM's ``SLURM_NNODES`` (a requeue may get another count) -- or ``None`` outside them."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    world, local = os.environ.get("WORLD_SIZE", ""), os.environ.get("LOCAL_WORLD_SIZE", "")
    if TorchElasticEnvironment.detect() and world.isdigit() and local.isdigit() and int(local) > 0:
        return int(world) // int(local), f"torchrun: WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local}"
    nnodes = os.environ.get("SLURM_NNODES", "")
    if SLURMEnvironment.detect() and nnodes.isdigit():  # (not under `srun --pty bash`: Lightning ignores SLURM)
        return int(nnodes), f"SLURM_NNODES={nnodes}"
    return None


class LightningParCLI(LightningCLI):
    """LightningCLI with throughput and learning-rate logging always on, and a demo report after ``fit``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        for key, callback in DEFAULTS.items():  # what callbacks.defaults() gives a script
            parser.add_lightning_class_args(callback, key)
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.add_argument("--sample_tokens", type=int, default=240,
                            help="After fit: how many tokens to sample from a model with sample_text(); 0 skips it.")
        parser.add_argument("--checkpoint_every_n_steps", type=NonNegativeInt, default=500,
                            help="fit saves a checkpoint every this many optimizer steps and when it ends (0: only "
                                 "at the end), in the logger's version directory (.../version_N/checkpoints), "
                                 "last.ckpt linking to the newest, the older one deleted -- unless the trainer has "
                                 "its own ModelCheckpoint callback, or --trainer.enable_checkpointing=false.")

    def _add_subcommands(self, parser: LightningArgumentParser, **kwargs: Any) -> None:
        super()._add_subcommands(parser, **kwargs)
        _list_plan_and_export(parser)

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        _accept_strategy_names(parser)
        for action in parser._actions:  # Lightning's own words do not say what 'last' means here
            if action.dest == "ckpt_path":
                action.help = CKPT_PATH_HELP
        return parser

    def instantiate_classes(self) -> None:
        """Lightning's, with the model's or data module's own error raised as it is: jsonargparse wraps an error of
        their constructor (a tokenizer refused, a file not found) in "Does not validate against any of the Union
        subtypes", its last line a dump of the whole config."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError) as err:
            own = _constructor_error(err)
            if own is None:
                raise
            raise own.with_traceback(own.__traceback__) from None

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer, with :class:`~lightning_par.callbacks.RunCheckpoint` unless the user has a ModelCheckpoint or
        turned checkpointing off (outside fit it saves nothing, but Lightning expects it when a checkpoint loads), and
        the logging defaults of :meth:`_logging_defaults` and :meth:`_no_hp_metric`."""
        config = self._get(self.config_init, "trainer", default={})
        callbacks = config.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list | tuple) else [callbacks]
        if (config.get("enable_checkpointing") is not False
                and not any(isinstance(c, ModelCheckpoint) for c in callbacks)):
            every = self._get(self.config_init, "checkpoint_every_n_steps", default=500)
            kwargs["callbacks"] = [*callbacks, RunCheckpoint(every_n_train_steps=every)]
        kwargs.update(self._logging_defaults(config, kwargs.get("callbacks", callbacks)))
        launched = launched_nodes()
        if launched is not None and launched[0] != config.get("num_nodes", 1):
            # an elastic attempt (docs/elastic.md): the ranks there are decide, the layout is re-derived for them
            rank_zero_info(f"lightning-par: this attempt runs on {launched[0]} node(s) ({launched[1]}), not the "
                           f"--trainer.num_nodes={config.get('num_nodes', 1)} given: using {launched[0]}")
            kwargs["num_nodes"] = launched[0]
        trainer = super().instantiate_trainer(**kwargs)
        self._no_hp_metric(trainer)
        return trainer

    # -- what the logs show by default: see log_every_n_steps_for, _no_hp_metric --------------------------------------
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        self._raw_args = sys.argv[1:] if args is None else args  # what the user wrote, for _user_set
        super().parse_arguments(parser, args)

    def _user_set(self, key: str) -> bool:
        """Whether the user named ``key`` on the command line or in a ``--config`` file (a default filled in by
        the parser is not theirs)."""
        texts = [str(getattr(self, "_raw_args", ""))]
        for path in self._get(self.config, "config", default=None) or []:
            try:
                # jsonargparse's Path (read_text; its get_content warns) or a plain one
                texts.append(path.read_text() if hasattr(path, "read_text") else Path(str(path)).read_text())
            except OSError:
                continue
        return any(key in text for text in texts)

    def _logging_defaults(self, config: dict, callbacks: list) -> dict[str, Any]:
        """Trainer arguments the user left unset: ``log_every_n_steps`` scaled to a short run, and the model summary
        that says what its counts cover (:class:`~lightning_par.callbacks.ParallelModelSummary`)."""
        out: dict[str, Any] = {}
        if config.get("log_every_n_steps") is None:
            out["log_every_n_steps"] = log_every_n_steps_for(config.get("max_steps"))
        from lightning.pytorch.callbacks import ModelSummary, RichProgressBar

        if (config.get("enable_model_summary") is not False
                and not any(isinstance(c, ModelSummary | RichProgressBar) for c in callbacks)):
            # Lightning then adds no summary of its own (nor says that it skips one)
            out.update(callbacks=[*callbacks, ParallelModelSummary()], enable_model_summary=False)
        return out

    def _no_hp_metric(self, trainer: Trainer) -> None:
        """TensorBoard's ``hp_metric`` is a placeholder (-1) unless the user logs it: off unless they set
        ``default_hp_metric``."""
        if self._user_set("default_hp_metric"):
            return
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                logger._default_hp_metric = False  # noqa: SLF001 -- what its default_hp_metric argument sets

    # -- which checkpoint to start from ----------------------------------------------------------------------------
    def before_fit(self) -> None:
        self.resume()
        self._hold_run_dir()

    def _hold_run_dir(self) -> None:
        """Global rank 0: claim and lock this run's version directory, and remove the interrupted saves that dead runs
        left in theirs (:mod:`lightning_par.run_dir`)."""
        root = self._logger_root()
        if root is None or rank_zero_only.rank != 0 or "://" in str(self.trainer.loggers[0].save_dir):
            return  # a remote save_dir (s3://...) is left to the logger
        from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

        if isinstance(self.trainer.loggers[0], TensorBoardLogger | CSVLogger):  # they number their versions
            run_dir.claim(self.trainer.loggers[0], root)
        run_dir.sweep_interrupted(root)

    def before_validate(self) -> None:
        self.resume()

    def before_test(self) -> None:
        self.resume()

    def before_predict(self) -> None:
        self.resume()

    def resume(self) -> None:
        """Replace ``ckpt_path`` by the checkpoint to start from (see ``CKPT_PATH_HELP``): on a restart of ``fit``,
        the newest complete checkpoint of the run restarted; for ``last``, the newest complete one of the logger
        name's runs. Every rank decides alike (the same files, before any of them saves)."""
        config = self.config_init[self.subcommand]
        given = config.get("ckpt_path")
        restarted = restart_count() if self.subcommand == "fit" else None
        what = f"restart {restarted[1]} of this job ({restarted[0]}={restarted[1]})" if restarted else ""
        if restarted is None and self.subcommand == "fit" and self._rejoined():
            restarted = ("TORCHELASTIC_RUN_ID", 0)
            what = ("restart of this job after a node joined (torchrun restarts without counting: the run's last "
                    "step was recorded under this TORCHELASTIC_RUN_ID)")
        if restarted is not None:
            run_dirs = self._continue_run()
            found = newest_complete(run_dirs)
            where = " or ".join(str(d) for d in run_dirs) or "(no checkpoint directory)"
            if found is not None:
                rank_zero_info(f"lightning-par: {what}: resuming from {found}, the newest complete checkpoint in "
                               f"{where}")
                config["ckpt_path"] = str(found)
                return
            rank_zero_info(f"lightning-par: {what}: no complete checkpoint in {where} yet; starting from "
                           f"{given or 'scratch'}")
        if given != "last":
            return
        found = newest_complete(self._checkpoint_dirs(every_version=True))
        if found is None:
            searched = ", ".join(str(d) for d in self._checkpoint_dirs(every_version=True, existing=False))
            if self.subcommand != "fit":
                raise SystemExit(f"lightning-par {self.subcommand}: --ckpt_path=last found no complete checkpoint "
                                 f"(searched {searched}).")
            rank_zero_warn(f"--ckpt_path=last: no complete checkpoint in {searched}; starting from scratch.")
            config["ckpt_path"] = None
            return
        rank_zero_info(f"lightning-par: --ckpt_path=last is {found}")
        config["ckpt_path"] = str(found)

    def _rejoined(self) -> bool:
        """A torchrun attempt restarted by a membership change (a node joined; its restart count stays 0): the
        newest version directory's last step was recorded under this job's ``TORCHELASTIC_RUN_ID``."""
        from lightning_par.run.elastic import same_torchelastic_job

        root = self._logger_root()
        if root is None or "TORCHELASTIC_RUN_ID" not in os.environ:
            return False
        numbered = (re.fullmatch(r"version_(\d+)", d.name) for d in root.glob("version_*") if d.is_dir())
        versions = [int(m.group(1)) for m in numbered if m]
        return bool(versions) and same_torchelastic_job(root / f"version_{max(versions)}")

    def _continue_run(self) -> list[Path]:
        """On a restart: write into the newest version directory of the logger name (the run this job started,
        which made it at start) rather than a new one; return the checkpoint directories of that run."""
        logger = self.trainer.logger
        root = self._logger_root()
        if logger is not None and root is not None and getattr(logger, "_version", 0) is None:
            numbered = (re.fullmatch(r"version_(\d+)", d.name) for d in root.glob("version_*") if d.is_dir())
            versions = [int(m.group(1)) for m in numbered if m]
            if versions:
                logger._version = max(versions)  # noqa: SLF001 -- Lightning's loggers read it before choosing one
        return self._checkpoint_dirs(every_version=False)

    def _logger_root(self) -> Path | None:
        """``save_dir/name`` of the first logger, where its version directories are (``None`` without one)."""
        trainer = self.trainer
        if not trainer.loggers:
            return None
        logger = trainer.loggers[0]
        return Path(logger.save_dir or trainer.default_root_dir) / str(logger.name)

    def _checkpoint_dirs(self, every_version: bool, existing: bool = True) -> list[Path]:
        """Where checkpoints of this job are: a ModelCheckpoint's own dirpath, and the run directories Lightning
        gives the others -- ``save_dir/name/VERSION/checkpoints`` of every version (``every_version``) or of this
        run's, or ``default_root_dir/checkpoints`` without a logger."""
        trainer = self.trainer
        dirs = [Path(cb.dirpath) for cb in trainer.checkpoint_callbacks
                if isinstance(cb, ModelCheckpoint) and cb.dirpath]
        root = self._logger_root()
        if root is None:
            dirs.append(Path(trainer.default_root_dir) / "checkpoints")
        elif every_version:
            dirs += sorted(root.glob("*/checkpoints")) if existing else [root / "*" / "checkpoints"]
        else:
            version = trainer.loggers[0].version
            dirs.append(root / (version if isinstance(version, str) else f"version_{version}") / "checkpoints")
        return [d for d in dict.fromkeys(dirs) if not existing or d.is_dir()]

    def before_instantiate_classes(self) -> None:
        strategy = self._get(self.config, "trainer", {}).get("strategy")
        _refuse_unknown_strategy(strategy)
        _check_strategy_options(strategy)

    def after_fit(self) -> None:
        trainer, model = self.trainer, self.model
        if trainer.interrupted:
            return
        tokens = self.config[self.subcommand].get("sample_tokens", 240)
        if tokens > 0 and hasattr(model, "sample_text") and getattr(model, "model", None) is not None:
            # every rank samples (a sharded model needs all of them for each forward), the same seed on each
            torch.manual_seed(0)
            text = model.sample_text("def ", max_new_tokens=tokens)
            if trainer.is_global_zero:
                print("\nSampled from the trained model:\n" + "-" * 60 + f"\n{text}\n" + "-" * 60)
        self._print_log_dir()

    @rank_zero_only
    def _print_log_dir(self) -> None:
        """Where the run's logs and checkpoints are (the checkpoint that resumes it: ``--ckpt_path``)."""
        trainer = self.trainer
        if trainer.logger is not None and trainer.logger.log_dir:
            log_dir = os.path.abspath(trainer.logger.log_dir)
            print(f"\nTensorBoard logs: {log_dir}\nOpen them with:  tensorboard --logdir {log_dir}")
        for callback in trainer.checkpoint_callbacks:
            newest = getattr(callback, "last_model_path", "") or getattr(callback, "best_model_path", "")
            if newest:
                newest = os.path.abspath(newest)
                print(f"Checkpoints: {os.path.dirname(newest)}\nResume with:  --ckpt_path={newest}  (or "
                      "--ckpt_path=last: the newest complete one)")


class _StrategyOption(ActionTypeHint):
    """``--trainer.strategy`` (Lightning's ``str | Strategy``) where lightning-par's registered names take options:
    an option after a name (``--trainer.strategy=pipeline2_zbv --trainer.strategy.n_microbatches=8``, or YAML
    ``init_args`` under a name given before) first turns the name into its class and options; ``class_path:`` may
    be a name too (``{class_path: pipeline2_zbv, init_args: {n_microbatches: 8}}``). A name alone stays a name."""

    def _check_type(self, value: Any, append: bool = False, cfg: Any = None, mode: Any = None) -> Any:
        value = _expand_strategy_name(value, cfg, self.dest)
        try:
            return super()._check_type(value, append=append, cfg=cfg, mode=mode)
        except TypeError as err:  # jsonargparse's "Does not validate against any of the Union subtypes"
            problem = _option_after_name_problem(value, cfg, self.dest)
            if problem is None:
                raise
            raise TypeError(f'Parser key "{self.dest}": {problem}') from err


#: the subcommands :func:`main` runs before (and without) LightningCLI, and their one-line help
OTHER_SUBCOMMANDS = {
    "plan": "Plan a layout before launching: bytes per rank, traffic, bubble and step time of every layout "
            "(lightning-par plan --help; --config CONFIG.yaml reads a fit config)",
    "export": "Export a checkpoint of any layout to safetensors or a Hugging Face directory "
              "(lightning-par export --help)",
}


def _list_plan_and_export(parser: LightningArgumentParser) -> None:
    """List ``plan`` and ``export`` in ``lightning-par --help`` beside fit, validate, test and predict; :func:`main`
    runs them itself, so their parsers here are placeholders that never parse."""
    subcommands = parser._subcommands_action  # noqa: SLF001
    for name, summary in OTHER_SUBCOMMANDS.items():
        subcommands.add_subcommand(name, LightningArgumentParser(description=summary), help=summary)


class _StrategyHelp(ActionHelpClassPath):
    """``--trainer.strategy.help``: a class, or one of lightning-par's names (``pipeline``: PipelineStrategy)."""

    def resolve_help_type(self, value: Any, option_string: str) -> type:
        spec = strategy_spec(value)
        return super().resolve_help_type(spec["class_path"] if spec else value, option_string)


def _accept_strategy_names(parser: LightningArgumentParser) -> None:
    """Let the subcommand's ``--trainer.strategy`` take options after lightning-par's names (:class:`_StrategyOption`),
    and its ``--trainer.strategy.help`` take them too (:class:`_StrategyHelp`)."""
    for option, plain, ours, words in (
        ("--trainer.strategy", ActionTypeHint, _StrategyOption,
         "A name -- lightning-par's zero, pipeline, megatron_tp, hybrid3d or a preset such as pipeline2_zbv, or "
         "Lightning's own -- where lightning-par's take options after it (--trainer.strategy=zero "
         "--trainer.strategy.stage=2); or a Strategy class with its options. Default: auto."),
        ("--trainer.strategy.help", ActionHelpClassPath, _StrategyHelp,
         "Show the options of a strategy (a class, or one of lightning-par's names) and exit."),
    ):
        action = parser._option_string_actions.get(option)  # noqa: SLF001
        if type(action) is plain:
            action.__class__ = ours
            action.help = words


def _expand_strategy_name(value: Any, cfg: Any, dest: str) -> Any:
    """``value`` with a registered name as ``class_path`` replaced by its class and options (the given ones win);
    for an option (or bare ``init_args``) after a registered name, that name in ``cfg`` replaced likewise."""
    if isinstance(value, dict | Namespace) and "class_path" in value:
        spec = strategy_spec(value["class_path"])
        if spec is None:
            return value
        given = value.get("init_args") or {}
        given = given.as_dict() if isinstance(given, Namespace) else dict(given)
        return {**dict(value), "class_path": spec["class_path"], "init_args": {**spec["init_args"], **given}}
    name = _name_before(value, cfg, dest)
    spec = strategy_spec(name)
    if spec is not None:
        cfg[dest] = Namespace(class_path=spec["class_path"], init_args=Namespace(**spec["init_args"]))
    return value


def _name_before(value: Any, cfg: Any, dest: str) -> str | None:
    """The strategy name an option (or bare ``init_args``) ``value`` comes after, if a name (not a class) came."""
    if not isinstance(value, NestedArg | dict | Namespace) or cfg is None:
        return None
    name = cfg.get(dest)
    if not isinstance(name, str) or "." in name or name in _strategy_class_names():
        return None  # a class (a path, or a Strategy subclass's name) is jsonargparse's
    return name


def _strategy_class_names() -> set[str]:
    found, todo = set(), [Strategy]
    while todo:
        cls = todo.pop()
        found.add(cls.__name__)
        todo += cls.__subclasses__()
    return found


def _option_after_name_problem(value: Any, cfg: Any, dest: str) -> str | None:
    """What to say when an option follows a name that takes none: ``auto``, Lightning's own, a mistyped one."""
    name = _name_before(value, cfg, dest)
    if name is None:
        return None
    option = f"--trainer.strategy.{value.key}" if isinstance(value, NestedArg) else "init_args"
    if name.lower() == "auto":
        problem = ("no strategy given before it: name one first, e.g. --trainer.strategy=zero "
                   "--trainer.strategy.stage=2 (or a class: --trainer.strategy=lightning_par.ZeroStrategy)")
    else:
        problem = unknown_strategy_message(name) or (
            f"{name!r} is a name of Lightning's, not lightning-par's: options after it need a class "
            f"(--trainer.strategy=CLASS_PATH {option}=...)")
    return f"{option} after --trainer.strategy={name}: {problem}"


def _constructor_error(error: BaseException) -> BaseException | None:
    """The first error in ``error``'s chain raised outside jsonargparse and Lightning's CLI (by the class being
    instantiated), or ``None`` when jsonargparse's own validation raised it."""
    seen: list[BaseException] = []
    while error is not None and error not in seen:
        seen.append(error)
        error = error.__cause__ or error.__context__
    for found in reversed(seen):  # the innermost first
        frames = traceback.extract_tb(found.__traceback__)
        if frames and "jsonargparse" not in frames[-1].filename and not frames[-1].filename.endswith(
                os.path.join("pytorch", "cli.py")):
            return found
    return None


def log_every_n_steps_for(max_steps: int | None) -> int:
    """The CLI's ``log_every_n_steps`` where the user gives none: Lightning's 50, or for a run of ``max_steps`` under
    1000 steps, ``max_steps // 20`` (at least 1): about 20 points, so a 20-step run logs every step."""
    if max_steps is None or max_steps < 0:
        return 50
    return min(50, max(1, max_steps // 20))


def _refuse_unknown_strategy(strategy: object) -> None:
    """Exit 2 with a did-you-mean over lightning-par's names for a strategy name nobody registered, before the
    Trainer answers with Lightning's generic error (which lists none of them)."""
    message = unknown_strategy_message(strategy)
    if message is not None:
        print(f"lightning-par: error: {message}", file=sys.stderr)
        raise SystemExit(2)


#: precisions of lightning-par's own that Lightning's ``--trainer.precision`` does not accept
_PLUGIN_PRECISIONS = ("bf16-mixed-master",)


def _check_strategy_options(strategy: object) -> None:
    """Build a lightning-par strategy from its options once before jsonargparse does, so that an option it refuses
    raises its own LayoutError (one line, see :func:`main`) instead of jsonargparse's many-line Union message that
    quotes it. Options that are classes themselves (``checkpoint_io``) are left to jsonargparse."""
    if not isinstance(strategy, Namespace) or not isinstance(strategy.get("class_path"), str):
        return
    module, _, name = strategy["class_path"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return  # jsonargparse names it
    init_args = strategy.get("init_args") or Namespace()
    options = init_args.as_dict() if isinstance(init_args, Namespace) else dict(init_args)
    if isinstance(cls, type) and issubclass(cls, LayoutStrategy) and not any(
            isinstance(v, dict) and "class_path" in v for v in options.values()):
        cls(**options)


def _precision_as_plugin(argv: list[str]) -> list[str]:
    """``--trainer.precision=bf16-mixed-master`` (or ``--trainer.precision bf16-mixed-master``) -> the
    LayoutPrecision plugin with that mode, since Lightning's Trainer refuses flags not its own."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        value = arg.partition("=")[2] if arg.startswith("--trainer.precision=") else (
            argv[i + 1] if arg == "--trainer.precision" and i + 1 < len(argv) else None)
        if value in _PLUGIN_PRECISIONS:
            out += ["--trainer.plugins+=lightning_par.LayoutPrecision", f"--trainer.plugins.precision={value}"]
            i += 1 if "=" in arg else 2
            continue
        out.append(arg)
        i += 1
    return out


#: set to 1 for the traceback of an error that ``lightning-par`` otherwise prints as one ``error:`` line
TRACEBACK_ENV = "LIGHTNING_PAR_TRACEBACK"


#: options whose value is a class path the CLI imports (a value without a dot is a registered short name)
CLASS_PATH_OPTIONS = ("--model", "--data", "--model.class_path", "--data.class_path", "--trainer.callbacks",
                      "--trainer.callbacks+", "--trainer.logger")


def _with_working_directory() -> None:
    """The current directory on ``sys.path``, as ``python -m`` puts it (a console script's is its own folder):
    ``--model=mymodule.MyModel`` finds ``./mymodule.py``. Appended, so a file there shadows no installed package."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _class_path_problem(argv: list[str]) -> str | None:
    """The first class path given on the command line (:data:`CLASS_PATH_OPTIONS`) whose module cannot be imported
    or lacks the class, in one line with the fix -- jsonargparse would print its usage and every subtype it tried."""
    given = []
    for i, arg in enumerate(argv):
        option, eq, value = arg.partition("=")
        if option in CLASS_PATH_OPTIONS:
            if not eq and i + 1 < len(argv):
                value = argv[i + 1]
            given.append((option, value))
    for option, value in given:
        module, _, name = value.rpartition(".")
        if (not module or not name or not re.fullmatch(r"[A-Za-z_][\w.]*", value) or os.path.exists(value)
                or value.endswith((".yaml", ".yml", ".json"))):
            continue  # a short name, a config file, a dict: jsonargparse's
        try:
            imported = importlib.import_module(module)
        except ModuleNotFoundError as error:
            missing = error.name or module
            if missing != module and not module.startswith(missing + "."):  # the module imports something missing
                return f"{option}={value}: importing {module} failed: {error} (a module it imports: install it)."
            parent, _, last = missing.rpartition(".")
            if parent and _imports(parent) and hasattr(sys.modules[parent], last):
                continue  # a nested class (module.Outer.Inner): jsonargparse's
            return (f"{option}={value}: no module named {missing!r}, neither in the current directory "
                    f"({os.getcwd()}) nor on PYTHONPATH. Run lightning-par from the folder that holds "
                    f"{missing.split('.')[0]}.py (or its package), or add that folder to PYTHONPATH: "
                    f"PYTHONPATH=/path/to/folder lightning-par ...")
        if not hasattr(imported, name):
            where = getattr(imported, "__file__", None) or module
            return f"{option}={value}: {module} ({where}) has no {name!r}."
    return None


def _imports(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-par`` command."""
    argv = sys.argv[1:] if args is None else list(args)
    _with_working_directory()
    if any(a.startswith("--trainer.precision") for a in argv):
        argv = _precision_as_plugin(argv)
        if args is None:
            sys.argv[1:] = argv  # LightningCLI reads sys.argv (and warns when args differs from it)
        else:
            args = argv
    if argv and argv[0] == "plan":  # the planner: no Trainer, no LightningCLI
        from lightning_par.plan_cli import main as plan

        code = plan(argv[1:])
        if code:
            raise SystemExit(code)
        return
    if argv and argv[0] == "export":  # checkpoint -> safetensors / Hugging Face directory, in one process
        from lightning_par.plugins.checkpoint_export import main as export

        code = export(argv[1:])
        if code:
            raise SystemExit(code)
        return
    problem = _class_path_problem(argv)
    if problem is not None:
        print(f"lightning-par: error: {problem}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    try:
        LightningParCLI(
            LightningModule,
            LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={"description": strategies_help(), "formatter_class": _HelpFormatter},
            args=args,
        )
    except (LayoutError, CheckpointError, DataError) as error:
        if os.environ.get(TRACEBACK_ENV, "0") not in ("", "0"):
            raise
        # a layout, model or checkpoint the run cannot take, before launch or at setup on each rank: the message
        # names the cause and the fix; the traceback only says where it was found (TRACEBACK_ENV=1 shows it)
        print(f"lightning-par: error: {error}", file=sys.stderr, flush=True)
        shutdown.wait_for_launched_ranks()  # rank 0: the other ranks' same line comes before the shell's prompt
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
