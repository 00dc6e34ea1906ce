"""``lightning-par plan`` for the README's LightningModule (no ``forward``): the same estimates as the module with
one, the winner's fit command and ``--write-config`` YAML that the CLI turns into exactly that layout, and the rows
without fp32 master weights marked. In this process, no launch."""

from __future__ import annotations

import json
import shlex

import lightning as L
import torch
import yaml
from torch import nn

from lightning_par.cli import LightningParCLI, main
from lightning_par.examples.plain_lm import PlainLM
from lightning_par.planner.report import NO_MASTERS_NOTE


class ReadmeModule(L.LightningModule):
    """The README's "Your own model", as written there: no forward; the steps call ``self.model``."""

    def configure_model(self):
        if getattr(self, "model", None) is None:
            self.model = PlainLM()

    def loss_fn(self, logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def compute_loss(self, batch):
        inputs, targets = batch
        return self.loss_fn(self.model(inputs), targets)

    def training_step(self, batch, batch_idx):
        return self.compute_loss(batch)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


PLAN = ["--world", "4", "--hardware", "cpu", "--seq", "32", "--precision", "fp32,bf16-true", "--recompute", "none",
        "--schedules", "1f1b", "--zero", "0,1"]


def _plan(capsys, tmp_path, model: str, *extra: str) -> tuple[str, dict]:
    out = tmp_path / "plan.json"
    main(["plan", f"--model={model}", *PLAN, "--json", str(out), *extra])
    return capsys.readouterr().out, json.loads(out.read_text())


def _cli(args: list[str]) -> LightningParCLI:
    return LightningParCLI(L.LightningModule, L.LightningDataModule, subclass_mode_model=True,
                           subclass_mode_data=True, run=False, args=args)


def test_plan_of_a_module_without_forward_gives_the_command_and_yaml_of_its_winner(tmp_path, capsys):
    text, plan = _plan(capsys, tmp_path, f"{__name__}.ReadmeModule")
    # planned from its network (self.model): the very estimates of the example module that has a forward (in fp32:
    # in bf16 the example's loss saves fp32 logits, the README's bf16 ones)
    _, with_forward = _plan(capsys, tmp_path, "lightning_par.examples.PlainLMLightningModule")
    assert len(plan["layouts"]) == len(with_forward["layouts"]) > 4
    fp32 = [[(e["label"], e["step_time_s"], e["bytes_per_rank"]) for e in p["layouts"] if e["label"].endswith("fp32")]
            for p in (plan, with_forward)]
    assert fp32[0] == fp32[1] and len(fp32[0]) > 2

    winner = next(e for e in plan["layouts"] if e["fits"] and e["runs_today"])
    assert f"to train the fastest that fits and runs ({winner['label']}):" in text
    command = next(line for line in text.splitlines() if line.strip().startswith("lightning-par fit"))
    # every row without fp32 masters is marked, and the note says what that costs
    rows = [line.split() for line in text.splitlines() if line.strip()[:1].isdigit() and "yes" in line]
    assert {r[8] for r in rows if r[8].startswith("bf16")} == {"bf16-true*"} and NO_MASTERS_NOTE in text
    if winner["layout"]["precision"] == "bf16-true":
        assert "[no fp32 master weights*]" in text and "fastest with fp32 master weights that runs today:" in text

    config = tmp_path / "won.yaml"
    text, _ = _plan(capsys, tmp_path, f"{__name__}.ReadmeModule", "--write-config", str(config))
    assert f"lightning-par fit --config {config}" in text
    written = yaml.safe_load(config.read_text())
    assert written["model"]["class_path"] == f"{__name__}.ReadmeModule"
    c = winner["layout"]
    batch = plan["workload"]["micro_batch"] * (c["n_microbatches"] if c["pp"] > 1 else 1)
    assert f"with your data module (--data=CLASS, or a data: section) giving {batch} sequence(s) of 32 tokens" in text
    data = ["--data=lightning_par.data.TextDataModule", "--data.seq_len=32", f"--data.batch_size={batch}"]
    # the YAML and the printed command, through the CLI's own parser, build the winner's layout and precision
    for cli in (_cli(["--config", str(config), *data]), _cli([*shlex.split(command)[2:], *data])):
        layout = cli.trainer.strategy.layout
        assert (layout.dp, layout.tp, layout.pp, layout.zero_stage, layout.recompute) == \
            (c["dp"], c["tp"], c["pp"], c["zero_stage"], c["recompute"])
        accumulate = c["n_microbatches"] if c["pp"] == 1 else 1  # a pipeline's are its micro-batches
        assert cli.trainer.num_devices == 4 and cli.trainer.accumulate_grad_batches == accumulate
        assert cli.trainer.precision == {"fp32": "32-true", "bf16-true": "bf16-true"}[c["precision"]]
        if c["pp"] > 1:
            assert layout.stage_plan.n_microbatches == c["n_microbatches"]


class FromTrainer(ReadmeModule):
    """A module whose network reads the trainer's data module in configure_model: the planner has no Trainer."""

    def configure_model(self):
        self.model = PlainLM(self.trainer.datamodule.vocab_size)


def test_a_module_the_planner_cannot_build_or_fit_is_one_line_naming_it(capsys):
    from lightning_par.plan_cli import main as plan

    assert plan([f"--model={__name__}.FromTrainer", "--world", "2", "--hardware", "cpu"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == ("lightning-par plan: FromTrainer.configure_model() failed on the meta device, where the planner "
                    "builds it without a Trainer: RuntimeError: FromTrainer is not attached to a `Trainer`. Build the "
                    "model from init arguments alone (e.g. a vocab_size argument, given as --model.vocab_size=N) "
                    "rather than from self.trainer."), last
    # a plain nn.Module: no fit config to write (said before planning), and the Trainer arguments instead of a command
    plain = ["--model=lightning_par.examples.plain_lm.PlainLM", "--world", "2", "--hardware", "cpu", "--seq", "32",
             "--precision", "fp32", "--recompute", "none", "--zero", "0"]
    assert plan([*plain, "--write-config", "x.yaml"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "lightning-par plan: --write-config x.yaml: PlainLM is not a LightningModule, which a fit config needs; plan "
        "--model=YOUR_LIGHTNING_MODULE.")
    assert plan(plain) == 0
    assert ("from a LightningModule holding PlainLM:\n  Trainer(devices=2, strategy=lightning_par.LayoutStrategy(dp=2, "
            "tp=1, pp=1, zero_stage=0), precision='32-true', accumulate_grad_batches=8), with batches of 1 sequence(s) "
            "of 32 tokens") in capsys.readouterr().out


def test_help_of_plan_and_export_imports_neither_torch_nor_lightning(tmp_path):
    """``lightning-par plan --help`` and ``export --help`` through the console script pyproject.toml declares (written
    here as pip writes it): the help, exit 0, and not one of torch, Lightning, transformers or numpy imported -- a
    bound that holds on a loaded machine (they take about 4 s to import on 2 cores; the help then takes ~0.1 s of
    CPU). Other subcommands' help (fit --help lists the Trainer's own arguments) imports Lightning."""
    import subprocess
    import sys
    from pathlib import Path

    import tomllib

    root = Path(__file__).resolve().parents[2]
    entry = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["lightning-par"]
    module, _, function = entry.partition(":")
    script = tmp_path / "lightning-par"
    script.write_text(f"import atexit, sys\n"
                      f"atexit.register(lambda: print('imported:', sorted(m for m in ('torch', 'lightning', "
                      f"'transformers', 'numpy') if m in sys.modules), file=sys.stderr))\n"
                      f"from {module} import {function}\nsys.exit({function}())\n")
    for subcommand, words in (("plan", "--write-config PATH"), ("export", "--max-shard-size")):
        done = subprocess.run([sys.executable, str(script), subcommand, "--help"], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"usage: lightning-par {subcommand}" in done.stdout and words in done.stdout
        assert done.stderr.strip().splitlines()[-1] == "imported: []", done.stderr
