"""Every shell command the README and docs/ show in ```bash blocks still works as written.

The default set parses each one with the parser of the program it names (``lightning-par fit ... --print_config``,
the planner's and the exporter's own parsers, torchrun's); the full set runs the ones that can run here for real,
at a size that takes seconds (the README's main job alone, through Lightning's launcher; the other fits with their
command lines as written, one launch per rank count: ``ALONE``). ``COMMANDS`` lists every command with what is done
with it, so a command added to the docs without a line there fails ``test_every_command_is_listed``.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness import REPO, Run, launch_command, launch_command_group
from tests.launch.doc_commands import bash_commands

# -- what is done with each command ---------------------------------------------------------------------------------
RUN = "run"  # parsed in the default set, run for real (tiny sizes appended) in the full set
PARSE = "parse"  # parsed in the default set; not run: the reason is the dict value after the colon
#: every command the docs show -> RUN, or "PARSE: why it is not run here"
COMMANDS: dict[str, str] = {
    # README (a) and (b): .ci/run runs (b) verbatim in a fresh clone; (a)'s fit is checked as its own command below
    "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install -q -e . && "
    ".venv/bin/lightning-par fit --config configs/demo.yaml":
        f"{PARSE}: installs into a fresh venv (network); its lightning-par part is parsed",
    "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 && .venv/bin/pip install -q -e \".[dev]\" && "
    ".venv/bin/python -m pytest -q": f"{PARSE}: .ci/run runs it as written in a fresh clone (the whole default set)",
    "lightning-par fit --model=lightning_par.examples.PlainLMLightningModule --data=lightning_par.data.TextDataModule "
    "--trainer.accelerator=cpu --trainer.devices=2 --trainer.strategy=zero2 --trainer.max_steps=20": RUN,
    "lightning-par fit --model=lightning_par.examples.HFCausalLMLightningModule "
    "--data=lightning_par.data.TextDataModule "
    "--trainer.accelerator=cpu --trainer.devices=2 --trainer.max_steps=20 --trainer.strategy=zero3": RUN,
    "lightning-par fit --model=lightning_par.examples.HFLlamaLightningModule --trainer.devices=2 "
    "--trainer.strategy=zero3 "
    "--trainer.callbacks+=lightning_par.FromPretrained --trainer.callbacks.path=hf_out":
        f"{PARSE}: needs hf_out from an export; tests/launch/test_export.py starts runs from a Hugging Face directory",
    "lightning-par fit --config configs/zero.yaml --data.data_files=corpus.jsonl --data.text_field=text "
    "--data.tokenizer=path/to/tokenizer_dir":
        f"{PARSE}: placeholder corpus and tokenizer; tests/launch/test_real_data.py runs it with a tokenizer it makes",
    "lightning-par fit --config configs/demo.yaml --trainer.max_steps=100": RUN,
    "lightning-par fit --config configs/demo.yaml --trainer.devices=1 --trainer.strategy=zero0 "
    "--ckpt_path=lightning_logs/demo/version_0/checkpoints/last.ckpt":
        f"{PARSE}: needs the demo's checkpoint; tests/launch/test_restart.py runs it as written (full set)",
    "lightning-par fit --config configs/demo.yaml --trainer.devices=2 --trainer.strategy=zero2 --ckpt_path=last "
    "--data.batch_size=8":
        f"{PARSE}: needs the demo's checkpoint; tests/launch/test_restart.py runs it as written (full set)",
    "torchrun --nproc_per_node 2 --max-restarts 3 --no-python lightning-par fit --config configs/zero.yaml "
    "--trainer.devices=2 --checkpoint_every_n_steps=50":
        f"{PARSE}: a killed rank and a restart; tests/launch/test_restart.py launches the same under torchrun",
    "lightning-par fit --config configs/demo.yaml --trainer.devices=2 --trainer.strategy=zero3 "
    "--trainer.strategy.compile=true":
        f"{PARSE}: inductor compiles for minutes on 2 CPU cores; tests/launch/test_compile.py runs compiled fits "
        "(full set)",
    "lightning-par plan --config configs/demo.yaml": RUN,
    "lightning-par fit --config configs/demo.yaml --trainer.devices=4 --trainer.strategy=planned "
    "--trainer.strategy.gpu_memory=4":
        f"{PARSE}: 4 ranks on 2 cores; tests/launch/test_planned.py launches strategy=planned on 4 ranks",
    "lightning-par fit --config configs/zero.yaml --trainer.strategy.stage=1 --trainer.precision=bf16-mixed-master":
        RUN,
    # docs/context-parallel.md and the README
    "lightning-par fit --config configs/demo.yaml --trainer.devices=2 --trainer.strategy=context_parallel2": RUN,
    "lightning-par fit --config configs/demo.yaml --trainer.devices=8 --trainer.strategy.cp=2":
        f"{PARSE}: 8 ranks on 2 cores; tests/launch/test_hybrid3d.py trains tp2 x pp2 x cp2 on 8 ranks (full set)",
    "lightning-par fit --model=lightning_par.examples.HFLlamaLightningModule "
    "--data=lightning_par.data.TextDataModule "
    "--data.batch_format=dict --trainer.accelerator=cpu --trainer.devices=4 --trainer.strategy=context_parallel2 "
    "--trainer.strategy.zero_stage=3 --trainer.max_steps=20": RUN,
    "lightning-par plan --model=lightning_par.examples.GPTLightningModule --model.preset=8b --world 8": RUN,
    "lightning-par plan --model=lightning_par.examples.GPTLightningModule --model.preset=1b "
    "--layout dp=2,tp=2,pp=2": RUN,
    "lightning-par export lightning_logs/demo/version_0/checkpoints/last.ckpt model.safetensors":
        f"{PARSE}: needs the demo's checkpoint; tests/launch/test_restart.py runs it as written (full set)",
    "lightning-par export lightning_logs/demo/version_0/checkpoints/last.ckpt model.ckpt":
        f"{PARSE}: needs the demo's checkpoint; tests/launch/test_lightning_contract.py exports a sharded checkpoint "
        "to one Lightning file and loads it with load_from_checkpoint and ddp",
    "lightning-par export last.ckpt hf_out --hf --model-class lightning_par.examples.HFLlamaLightningModule":
        f"{PARSE}: placeholder checkpoint; tests/launch/test_export.py exports Hugging Face directories",
    "lightning-par fit --config configs/zero.yaml --trainer.strategy=zero3": RUN,
    "lightning-par fit --model=lightning_par.examples.HFLlamaLightningModule --data=lightning_par.data.TextDataModule "
    "--trainer.accelerator=cpu --trainer.devices=2 --trainer.strategy=megatron_tp2 --trainer.max_steps=20": RUN,
    "lightning-par fit --config configs/demo.yaml --trainer.strategy=pipeline2_interleaved_1f1b": RUN,
    "lightning-par fit --config configs/demo.yaml": RUN,
    "lightning-par fit --config configs/demo.yaml --trainer.devices=8":
        f"{PARSE}: 8 ranks on 2 cores; tests/launch/test_hybrid3d.py trains dp2 x tp2 x pp2 on 8 ranks (full set)",
    # docs/3d.md
    "lightning-par fit --config configs/demo.yaml --trainer.strategy=hybrid3d_tp2_pp2_sp": RUN,
    # docs/checkpoints.md
    "lightning-par export last.ckpt hf_out --hf --trust-checkpoint-class":
        f"{PARSE}: placeholder checkpoint; tests/launch/test_export.py exports Hugging Face directories",
    "lightning-par export last.ckpt hf_out --hf --trust-checkpoint-class --max-shard-size 500MB":
        f"{PARSE}: placeholder checkpoint; tests/launch/test_export.py exports sharded Hugging Face directories",
    # docs/cli.md
    "lightning-par --help": RUN,
    "lightning-par fit --trainer.strategy.help zero": RUN,
    "lightning-par fit --config configs/demo.yaml --trainer.strategy=pipeline2_zbv "
    "--trainer.strategy.n_microbatches=8": RUN,
    "lightning-par fit --config configs/demo.yaml --trainer.strategy=hybrid3d --trainer.strategy.tp=2 "
    "--trainer.strategy.pp=2": RUN,
    "lightning-par validate --config configs/demo.yaml --ckpt_path "
    "lightning_logs/demo/version_0/checkpoints/last.ckpt":
        f"{PARSE}: needs the demo's checkpoint; tests/launch/test_restart.py runs it as written (full set)",
    # docs/elastic.md
    "torchrun --nnodes=1:2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29400 --rdzv-id=JOB "
    "--max-restarts=3 --no-python lightning-par fit --config configs/zero.yaml --trainer.devices=8 "
    "--checkpoint_every_n_steps=100":
        f"{PARSE}: 16 ranks on two nodes; tests/launch/test_elastic.py launches two agents of 2 ranks the same way",
    "srun lightning-par fit --config configs/zero.yaml --trainer.devices=8 --trainer.num_nodes=4":
        f"{PARSE}: needs SLURM; tests/launch/test_elastic.py sets SLURM's variables for a requeue on another node "
        "count",
    "torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29500 --no-python "
    "lightning-par fit --config configs/demo.yaml --trainer.num_nodes=2 --trainer.devices=2":
        f"{PARSE}: two nodes (the pair of commands); tests/launch/test_data_parallel.py launches 2 nodes x 2 ranks "
        "(full set)",
    "torchrun --nnodes 2 --node_rank 1 --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29500 --no-python "
    "lightning-par fit --config configs/demo.yaml --trainer.num_nodes=2 --trainer.devices=2":
        f"{PARSE}: two nodes (the pair of commands); tests/launch/test_data_parallel.py launches 2 nodes x 2 ranks "
        "(full set)",
    # docs/faults.md
    "lightning-par fit --config configs/zero.yaml --trainer.strategy.heartbeat_timeout=30": RUN,
    "lightning-par fit --config configs/zero.yaml --trainer.strategy.nonfinite=skip "
    "--trainer.strategy.nonfinite_patience=5": RUN,
    # docs/plan.md
    "lightning-par plan --model=lightning_par.examples.GPTLightningModule --model.preset=8b --world 16 --hardware a100 "
    "--gpu-memory 40 --seq 4096 --global-batch 256 --json plan.json": RUN,
    "lightning-par plan --hf-config path/to/config.json --world 8":
        f"{PARSE}: placeholder config; tests/launch/test_planner.py plans Hugging Face configs",
    "lightning-par plan --model=lightning_par.examples.plain_lm.PlainLM --world 4 --hardware cpu": RUN,
    "lightning-par plan --config configs/demo.yaml --write-config planned.yaml": RUN,
    # README
    "lightning-par plan --model=my_pkg.MyModule --world 4 --write-config planned.yaml":
        f"{PARSE}: a placeholder module; tests/unit/test_plan_command.py plans the README's module and writes its "
        "config",
    "lightning-par plan --model=lightning_par.examples.GPTLightningModule --model.preset=8b --world 64 --runtime "
    "megatron-overlap --precision bf16-mixed-master --exposed": RUN,
    # README: mixture of experts
    "lightning-par fit --model=lightning_par.examples.MoEGPTLightningModule --data=lightning_par.data.TextDataModule "
    "--trainer.accelerator=cpu --trainer.devices=2 --trainer.strategy=ep2 --trainer.max_steps=20": RUN,
    "lightning-par plan --model=lightning_par.examples.MoEGPTLightningModule --model.preset=small --hardware cpu "
    "--layout dp=4,ep=2": RUN,
    # docs/precision.md
    "lightning-par fit --config configs/zero.yaml --trainer.precision=bf16-mixed": RUN,
    "pytest tests/launch/test_precision.py": f"{PARSE}: a test file of this suite (default set)",
    "pytest --full tests/launch/test_precision.py": f"{PARSE}: a test file of this suite (full set)",
}

#: appended to a fit that runs in the full set: two steps of a tiny model on a small corpus
TINY_FIT = ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.val_check_interval=2",
            "--trainer.enable_progress_bar=false", "--data.max_corpus_bytes=300000", "--data.seq_len=32",
            "--data.batch_size=8"]
TINY_GPT = ["--model.preset=tiny", "--sample_tokens=0"]  # the configs' GPT


def test_the_docs_show_the_commands_this_test_knows():
    """The finder sees the commands (the README's two set-up lines first) and every command is listed."""
    commands = bash_commands()
    assert commands[0].startswith("python3 -m venv .venv") and commands[0].endswith("fit --config configs/demo.yaml")
    assert commands[1].endswith(".venv/bin/python -m pytest -q")
    ci = (REPO / ".ci" / "run").read_text()
    assert commands[1] in ci  # .ci/run runs the README's second command as written
    unlisted = [c for c in commands if c not in COMMANDS]
    assert not unlisted, "commands in README.md/docs without a line in COMMANDS (RUN, or PARSE with the reason):\n" + \
        "\n".join(unlisted)
    stale = [c for c in COMMANDS if c not in commands]
    assert not stale, "COMMANDS lists commands the docs no longer show:\n" + "\n".join(stale)
    for command, how in COMMANDS.items():
        assert how == RUN or (how.startswith(f"{PARSE}: ") and len(how) > 20), (command, how)


def _lightning_par(argv: list[str]) -> str:
    """Parse ``lightning-par ARGV`` the way the program does, in this process; return what it printed."""
    from lightning_par import cli, plan_cli
    from lightning_par.plugins import checkpoint_export
    from lightning_par.strategies.names import unknown_strategy_message

    out = io.StringIO()
    if argv[0] == "plan":
        rest, model_args = plan_cli._split_model_args(argv[1:])
        args = plan_cli.parser().parse_args(rest)
        assert args.model or args.config or args.hf_config, f"lightning-par {' '.join(argv)} names no model"
        return ""
    if argv[0] == "export":
        checkpoint_export.build_parser().parse_args(argv[1:])
        return ""
    if argv[0] in ("fit", "validate", "test", "predict") and "help" not in " ".join(argv):
        argv = [*argv, "--print_config"]  # parse and resolve every class path, then exit 0 without running
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_, \
            pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["lightning-par"])  # LightningCLI warns when sys.argv and args both hold options
        cli.main(argv)
    assert exit_.value.code in (0, None), f"lightning-par {' '.join(argv)} exited {exit_.value.code}:\n{out.getvalue()}"
    if argv[-1] == "--print_config":  # a strategy name is checked when the Trainer is made: check it here the same way
        strategy = yaml.safe_load(out.getvalue())["trainer"]["strategy"]
        if isinstance(strategy, str):
            assert unknown_strategy_message(strategy) is None, unknown_strategy_message(strategy)
    return out.getvalue()


def _check_parses(command: str) -> None:
    for part in command.split(" && "):
        argv = shlex.split(part)
        program = Path(argv[0]).name
        if program == "lightning-par":
            printed = _lightning_par(argv[1:])
            if argv[1:] == ["--help"]:
                assert all(name in printed for name in ("fit", "validate", "plan", "export")), printed
        elif program == "torchrun":
            from torch.distributed.run import get_args_parser

            args = get_args_parser().parse_args(argv[1:])
            assert args.no_python and args.training_script == "lightning-par", args
            _lightning_par(args.training_script_args)
        elif program == "srun":  # srun [its options] lightning-par ...
            _lightning_par(argv[argv.index("lightning-par") + 1:])
        elif program == "pytest":
            paths = [a for a in argv[1:] if not a.startswith("-")]
            assert all((REPO / p).exists() for p in paths), paths
        elif program in ("python", "python3") or program == "pip":
            assert COMMANDS[command].startswith(PARSE), command  # set-up steps: never run by this test
        else:
            raise AssertionError(f"no check for the program {program!r} in {command!r}")


def _id(command: str) -> str:
    return re.sub(r"[^\w=.,+-]+", "_", command.removeprefix("lightning-par "))[:90]


@pytest.mark.parametrize("command", bash_commands(), ids=_id)
def test_command_parses(command, monkeypatch):
    monkeypatch.chdir(REPO)  # the docs' paths (configs/...) are relative to the repository root
    _check_parses(command)


@pytest.mark.parametrize("argv", [
    ["fit", "--config", "configs/demo.yaml", "--trainer.strategy=zer2"],  # a mistyped strategy name
    ["fit", "--config", "configs/demo.yaml", "--trainer.max_stepz=2"],  # an option Trainer does not have
    ["fit", "--model=lightning_par.examples.NoSuchModule"],  # a class path that does not import
    ["plan", "--model=lightning_par.examples.GPTLightningModule", "--wrld", "8"],
    ["export", "last.ckpt"],  # no output path
], ids=lambda argv: " ".join(argv)[:60])
def test_a_wrong_command_fails_the_check(argv, monkeypatch, capsys):
    """The parse check is not a formality: what a user would get an error for fails it."""
    monkeypatch.chdir(REPO)
    with pytest.raises((AssertionError, SystemExit)) as failure:
        _lightning_par(argv)
    assert failure.type is AssertionError or failure.value.code not in (0, None)


#: the README's main job runs alone, through Lightning's own launcher as a user types it; every other fit shares one
#: launch with the fits of its rank count (tests/launch/cli_matrix.py: the same command lines, one start-up for all)
ALONE = {"lightning-par fit --config configs/demo.yaml"}


def _real_argv(command: str, cache_dir: Path) -> list[str]:
    """The command's arguments as run here: its relative paths' root made absolute, a fit's tiny sizes appended."""
    argv = [a.replace("configs/", f"{REPO / 'configs'}/") for a in shlex.split(command)[1:]]
    if argv[0] != "fit" or "--trainer.strategy.help" in argv:
        return argv
    extra = [*TINY_FIT, f"--data.cache_dir={cache_dir}"]
    if "--config" in argv or any("GPTLightningModule" in a for a in argv):
        extra += TINY_GPT
    return [*argv, *extra]


def _devices(argv: list[str]) -> int:
    """The ranks a fit starts: ``--trainer.devices`` on the command line, else its config's (1 when neither says)."""
    given = [a.split("=", 1)[1] for a in argv if a.startswith("--trainer.devices=")]
    if given:
        return int(given[-1])
    if "--config" in argv:
        return int(yaml.safe_load(Path(argv[argv.index("--config") + 1]).read_text())["trainer"].get("devices", 1))
    return 1


def _grouped(command: str) -> bool:
    return COMMANDS.get(command) == RUN and command not in ALONE and command.startswith("lightning-par fit ") \
        and "--trainer.strategy.help" not in command


@pytest.fixture(scope="module")
def grouped_fits(tmp_path_factory, cache_dir):
    """``get(command)``: the finished run of a grouped fit; the fits of its rank count launched together on the first
    request of any."""
    done: dict[str, Run] = {}

    def get(command: str) -> Run:
        if command not in done:
            devices = _devices(_real_argv(command, cache_dir))
            members = [c for c in bash_commands() if _grouped(c) and _devices(_real_argv(c, cache_dir)) == devices]
            root = tmp_path_factory.mktemp(f"docs_fits_{devices}")
            names = {c: f"fit{i}" for i, c in enumerate(members)}
            runs = launch_command_group(root, cache_dir, {names[c]: _real_argv(c, cache_dir) for c in members},
                                        devices, timeout=300 * len(members))
            print(f"{len(members)} fits of {devices} rank(s) in one launch: {next(iter(runs.values())).seconds:.0f} s")
            done.update({c: runs[names[c]] for c in members})
        return done[command]

    return get


@pytest.mark.launch(ranks=4, full=True)
@pytest.mark.parametrize("command", [c for c in bash_commands() if COMMANDS.get(c) == RUN], ids=_id)
def test_command_runs(command, tmp_path, cache_dir, grouped_fits):
    """The full set: the command for real, from a copy of its relative paths' root, at a size of seconds."""
    argv = _real_argv(command, cache_dir)
    run = grouped_fits(command) if _grouped(command) else launch_command(tmp_path, cache_dir, argv, timeout=300).check()
    if argv[0] == "fit" and "--trainer.strategy.help" not in argv:
        # two optimizer steps trained: the CLI's checkpoint at the end of fit names step 2
        assert [p.name for p in run.root.rglob("*-step=2.ckpt")], run.log[-2000:]
    if argv[0] == "plan":
        assert "layouts planned" in run.log or "rank" in run.log, run.log[-2000:]
        if "--json" in argv:
            assert (tmp_path / argv[argv.index("--json") + 1]).stat().st_size > 0
