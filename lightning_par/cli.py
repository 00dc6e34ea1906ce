"""``lightning-par``: the Lightning CLI with lightning-par's strategies, TensorBoard logging and throughput.

    lightning-par fit --config configs/demo.yaml
    lightning-par fit --config configs/demo.yaml --trainer.devices=4 --trainer.strategy=zero0
    lightning-par fit --trainer.strategy.help lightning_par.ZeroStrategy      # every strategy option
    lightning-par plan --model=example_models.GPTLightningModule --model.preset=8b --world 8   # before launching
    lightning-par export CKPT OUT.safetensors          # or: lightning-par export CKPT OUT_DIR --hf
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys

import torch
from jsonargparse import DefaultHelpFormatter
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.rank_zero import rank_zero_only

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.callbacks import MemoryPerRank, PipelineTimeline, TokensPerSecond
from lightning_par.strategies import ALL_STRATEGIES
from lightning_par.strategies.names import registered_names, unknown_strategy_message


def strategies_help() -> str:
    """A short catalogue of the strategies for ``--help``: class path and summary line of each."""
    lines = ["lightning-par strategies (pick with --trainer.strategy=NAME or class_path/init_args):"]
    for cls in ALL_STRATEGIES:
        summary = (inspect.getdoc(cls) or "").splitlines()[0]
        lines.append(f"  lightning_par.{cls.__name__}: {summary}")
    lines.append(f"Registered names: {', '.join(registered_names())}.")
    lines.append("Every option of one: lightning-par fit --trainer.strategy.help lightning_par.ZeroStrategy")
    lines.append("Before launching: lightning-par plan --model=CLASS --world N (bytes per rank, traffic, bubble and "
                 "step time of every layout; lightning-par plan --help)")
    return "\n".join(lines)


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Keep the strategy catalogue's line breaks in ``--help``."""


class LightningParCLI(LightningCLI):
    """LightningCLI with throughput and learning-rate logging always on, and a demo report after ``fit``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_lightning_class_args(TokensPerSecond, "tokens_per_sec")
        parser.add_lightning_class_args(LearningRateMonitor, "lr_monitor")
        parser.add_lightning_class_args(PipelineTimeline, "pipeline_timeline")  # no-op unless pipelined
        parser.add_lightning_class_args(MemoryPerRank, "memory_per_rank")
        parser.set_defaults({"lr_monitor.logging_interval": "step"})
        parser.add_argument("--sample_tokens", type=int, default=240,
                            help="After fit: how many tokens to sample from a model with sample_text(); 0 skips it.")

    def before_instantiate_classes(self) -> None:
        _refuse_unknown_strategy(self._get(self.config, "trainer", {}).get("strategy"))

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
        trainer = self.trainer
        if trainer.logger is not None and trainer.logger.log_dir:
            log_dir = os.path.abspath(trainer.logger.log_dir)
            print(f"\nTensorBoard logs: {log_dir}\nOpen them with:  tensorboard --logdir {log_dir}")


def _refuse_unknown_strategy(strategy: object) -> None:
    """Exit 2 with a did-you-mean over lightning-par's names for a strategy name nobody registered, before the
    Trainer answers with Lightning's generic error (which lists none of them)."""
    message = unknown_strategy_message(strategy)
    if message is not None:
        print(f"lightning-par: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-par`` command."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv and argv[0] == "plan":  # the planner: no Trainer, no LightningCLI
        from lightning_par.planner.cli import main as plan

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
    LightningParCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={"description": strategies_help(), "formatter_class": _HelpFormatter},
        args=args,
    )


if __name__ == "__main__":
    main()
