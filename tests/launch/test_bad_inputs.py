"""Bad inputs are refused early with one clear message (issue 18): numeric strategy options that Python would let
through (``True`` is an int, ``1.0 == 1``, ``inf`` passes every lower bound), a mistyped strategy name, a planner
world of 0, and a checkpoint of another model -- named by its first mismatching parameter before DCP is entered.

Everything here runs in this process: the CLI through ``lightning_par.cli.main`` (it stops while parsing, before any
Trainer or rank exists), checkpoints through DCP without a process group (one rank)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_par import (
    Hybrid3DStrategy,
    LayoutError,
    LayoutStrategy,
    MegatronTPStrategy,
    PipelineStrategy,
    ZeroStrategy,
)
from lightning_par.cli import main
from lightning_par.plugins import sharded_checkpoint
from lightning_par.plugins.checkpoint_files import CheckpointError
from lightning_par.run.heartbeat import check_timeout
from lightning_par.strategies.names import registered_names, unknown_strategy_message
from lightning_par.topology import is_number

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # DCP warns that no process group is initialised

CPU_JOB = ["--model=lightning_par.examples.GPTLightningModule", "--model.preset=tiny",
           "--data=lightning_par.data.TextDataModule", "--trainer.accelerator=cpu", "--trainer.devices=1"]


# -- numeric options: one rule (lightning_par.topology.is_number) --------------------------------------------------
def test_the_number_rule():
    assert is_number(3, integer=True, minimum=1) and is_number(2.5, above=0) and is_number(0, minimum=0)
    assert is_number(10**400, integer=True, minimum=1)  # an int too large for a float is still an int
    for value in (True, False, 1.0, "1", None, 0, -2):
        assert not is_number(value, integer=True, minimum=1), value
    for value in (True, math.inf, -math.inf, math.nan, 0, -1.0, "25"):
        assert not is_number(value, above=0), value


@pytest.mark.parametrize("make,value,match", [
    (lambda v: ZeroStrategy(stage=v), True, r"zero_stage=True is not available.*integers \[0, 1, 2, 3\]"),
    (lambda v: ZeroStrategy(stage=v), 1.0, r"zero_stage=1\.0 is not available"),
    (lambda v: LayoutStrategy(zero_stage=v), False, r"zero_stage=False is not available"),
    (lambda v: Hybrid3DStrategy(zero_stage=v), 2.0, r"zero_stage=2\.0 is not available"),
    (lambda v: MegatronTPStrategy(bucket_cap_mb=v), True, r"bucket_cap_mb=True is not valid: use a positive, finite"),
    (lambda v: ZeroStrategy(stage=1, bucket_cap_mb=v), math.inf, r"bucket_cap_mb=inf is not valid"),
    (lambda v: LayoutStrategy(bucket_cap_mb=v), math.nan, r"bucket_cap_mb=nan is not valid"),
    (lambda v: LayoutStrategy(bucket_cap_mb=v), 0, r"bucket_cap_mb=0 is not valid"),
    (lambda v: Hybrid3DStrategy(bucket_cap_mb=v), -4.0, r"bucket_cap_mb=-4\.0 is not valid"),
    (lambda v: LayoutStrategy(tp=v), True, r"tp=True is not a valid size: use a positive integer"),
    (lambda v: LayoutStrategy(dp=v), 2.0, r"dp=2\.0 is not a valid size"),
    (lambda v: PipelineStrategy(pp=2, n_microbatches=v), True, r"n_microbatches=True is not valid"),
    (lambda v: LayoutStrategy(n_microbatches=v), 4.0, r"n_microbatches=4\.0 is not valid"),  # even at pp = 1
    (lambda v: LayoutStrategy(heartbeat_timeout=v), True, r"heartbeat_timeout=True must be a number"),
    (lambda v: LayoutStrategy(heartbeat_timeout=v), math.inf, r"heartbeat_timeout=inf must be a number"),
])
def test_numeric_options_refuse_bools_floats_and_non_finite_values(make, value, match):
    with pytest.raises(LayoutError, match=match):
        make(value)


@pytest.mark.parametrize("make", [lambda v: ZeroStrategy(stage=1, aux_loss_scope=v),
                                  lambda v: Hybrid3DStrategy(tp=2, pp=2, aux_loss_scope=v)])
def test_an_unknown_load_balancing_scope_lists_the_scopes(make):
    with pytest.raises(LayoutError, match=r"aux_loss_scope='global_batch' is not a scope of the load-balancing loss: "
                                          r"use one of 'micro_batch', 'global', or None"):
        make("global_batch")
    assert make("global").layout.aux_loss_scope == "global"


def test_the_good_values_still_pass():
    assert ZeroStrategy(stage=2, bucket_cap_mb=0.5).layout.bucket_cap_mb == 0.5
    assert LayoutStrategy(zero_stage=3, bucket_cap_mb=25).layout.zero_stage == 3
    assert check_timeout(0) is None and check_timeout(None) is None and check_timeout(2) == 2.0


def test_the_cli_refuses_them_too(capsys, monkeypatch):
    """What jsonargparse lets through (YAML's .inf, 0) reaches the strategy and is refused there, when the CLI
    builds it: one ``error:`` line naming the option, the last printed, before any Trainer (exit 1; not jsonargparse's
    Union message quoting it); a bool or a float for an int option jsonargparse refuses itself while parsing (exit
    2, naming the option)."""
    from lightning_par.cli import TRACEBACK_ENV

    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    zero = [*CPU_JOB, "--trainer.strategy=lightning_par.ZeroStrategy"]
    for option, said in [("--trainer.strategy.bucket_cap_mb=.inf", "bucket_cap_mb=inf is not valid: use a positive"),
                         ("--trainer.strategy.bucket_cap_mb=0", "bucket_cap_mb=0.0 is not valid: use a positive")]:
        with pytest.raises(SystemExit) as exit_:
            main(["fit", *zero, option])
        assert exit_.value.code == 1, option
        err = capsys.readouterr().err.strip()
        assert err.splitlines()[-1].startswith(f"lightning-par: error: {said}"), err[-2000:]
        assert "Traceback" not in err and "Union" not in err, err[-2000:]
    for option, said in [("--trainer.strategy.stage=true", "Expected a <class 'int'>. Got value: True"),
                         ("--trainer.strategy.stage=1.0", "Expected a <class 'int'>. Got value: 1.0")]:
        with pytest.raises(SystemExit) as exit_:
            main(["fit", *zero, option])
        assert exit_.value.code == 2, option
        assert said in capsys.readouterr().err, option


# -- strategy names ------------------------------------------------------------------------------------------------
def test_a_mistyped_strategy_name_gets_a_did_you_mean():
    message = unknown_strategy_message("zer2")
    assert message.startswith("unknown strategy name 'zer2'. Did you mean 'zero2'")
    assert "hybrid3d_tp2_pp2" in message and "megatron_tp2" in message  # lightning-par's names, listed
    assert "Did you mean 'hybrid3d_tp2_pp2'" in unknown_strategy_message("hybrid3d_tp2_pp22")
    assert "Did you mean 'ddp'" in unknown_strategy_message("dpp")  # none of ours is close: Lightning's own
    assert "Did you mean" not in unknown_strategy_message("qwertyuiop")
    for fine in ("zero2", "ZERO2", "auto", "ddp", None, ZeroStrategy):
        assert unknown_strategy_message(fine) is None
    assert {"zero0", "megatron_tp2", "hybrid3d_tp2_pp2", "pipeline2_1f1b"} <= set(registered_names())


def test_the_cli_says_it_before_the_trainer_is_built(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *CPU_JOB, "--trainer.strategy=zer2"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "lightning-par: error: unknown strategy name 'zer2'. Did you mean 'zero2'" in err
    assert "You selected an invalid strategy name" not in err  # Lightning's generic error is never reached


# -- the planner ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,said", [
    (["--world", "0"], "argument --world: 0 is not valid: use a positive integer"),
    (["--world", "-4"], "argument --world: -4 is not valid: use a positive integer"),
    (["--world", "2", "--micro-batch", "0"], "argument --micro-batch: 0 is not valid"),
    (["--world", "2", "--gpu-memory", "nan"], "argument --gpu-memory: nan is not valid: use a positive finite"),
    (["--layout", "dp=0,tp=2"], "--layout dp=0 is not valid: use a positive integer"),
])
def test_plan_refuses_a_world_of_zero(args, said, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["plan", "--model=lightning_par.examples.GPTLightningModule", "--model.preset=tiny", *args])
    assert exit_.value.code == 2
    assert said in capsys.readouterr().err


# -- a checkpoint of another model ---------------------------------------------------------------------------------
def _model(width: int = 16, depth: int = 2) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.LayerNorm(width), *(nn.Linear(width, width) for _ in range(depth)))


def _save(path, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(2, model[-1].in_features)).square().sum().backward()
    optimizer.step()
    state = {"state_dict": model.state_dict(),
             "optimizer_states": [sharded_checkpoint.optimizer_state(model, optimizer)], "global_step": 1}
    sharded_checkpoint.save(state, path, is_writer=True, barrier=lambda: None)


def _load(path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
    optimizer = optimizer or torch.optim.AdamW(model.parameters())
    sharded_checkpoint.load(path, model, [optimizer])


@pytest.mark.parametrize("other,match", [
    (lambda: _model(width=8), r"parameter '0\.weight' has shape \(16,\) in the checkpoint but \(8,\) in this "
                              r"model\.$"),
    (lambda: _model(depth=3), r"parameter '3\.weight' \(shape \(16, 16\)\) is not in the checkpoint\.$"),
    (lambda: _model(depth=1), r"the checkpoint's parameter '2\.weight' \(shape \(16, 16\)\) is not in this model "
                              r"\(1 more such entries\)\.$"),
])
def test_a_checkpoint_of_another_model_names_its_first_mismatching_parameter(tmp_path, other, match):
    path = tmp_path / "a.ckpt"
    saved = _model()
    _save(path, saved, torch.optim.AdamW(saved.parameters()))
    model = other()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"a\.ckpt does not fit this model \(saved from another model, size or "
                                              r"optimizer\?\): " + match) as error:
        _load(path, model)
    assert "\n" not in str(error.value)  # one line, not DCP's traceback of "Missing key" per rank
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "refused before anything loaded"
    _load(path, _model())  # the same model loads


def test_another_optimizer_is_named_too(tmp_path):
    path = tmp_path / "a.ckpt"
    saved = _model()
    _save(path, saved, torch.optim.SGD(saved.parameters(), lr=0.1))  # no per-parameter state
    with pytest.raises(CheckpointError, match=r"optimizer 0 state '0\.weight\.step' \(shape \(\)\) is not in "
                                              r"the checkpoint\.$"):
        _load(path, _model())


def test_a_one_file_checkpoint_of_another_size_is_named_too(tmp_path):
    path = tmp_path / "a.ckpt"
    torch.save({"state_dict": _model().state_dict(), "global_step": 1}, path)
    with pytest.raises(CheckpointError, match=r"parameter '0\.weight' has shape \(16,\) in the checkpoint but "
                                              r"\(8,\) in this model\.$"):
        sharded_checkpoint.load(path, _model(width=8), [])


@pytest.mark.launch(ranks=2, full=True)
def test_every_pipeline_rank_names_the_same_parameter(tmp_path, cache_dir, request):
    """Launched (full run): pipeline stages ask for different entries, so the entries no rank of this model has are
    found over all of them -- an 8-block checkpoint into 4 blocks would otherwise load its first 4 blocks silently."""
    from tests.harness import launch_cli

    short = ["--trainer.max_steps=2", "--data.batch_size=8", "--trainer.limit_val_batches=0", "--sample_tokens=0",
             "--trainer.strategy=pipeline2_1f1b"]
    launch_cli(tmp_path / "a", cache_dir, [*short, "--trainer.enable_checkpointing=true",
                                           "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                                           f"--trainer.callbacks.dirpath={tmp_path / 'ckpt'}"], devices=2).check()
    (path,) = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    run = launch_cli(tmp_path / "b", cache_dir, [*short, "--model.n_layers=4", f"--ckpt_path={path}"], devices=2)
    said = ("does not fit this model (saved from another model, size or optimizer?): the checkpoint's parameter "
            "'model.layers.4.attn_norm.weight' (shape (64,)) is not in this model (35 more such entries).")
    assert run.returncode != 0
    assert run.log.count(said) >= 2, run.log[-4000:]  # rank 0 and rank 1, the same line
    assert "Missing key" not in run.log


# -- a Hugging Face step given (inputs, targets) batches -------------------------------------------------------------
@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_a_hugging_face_step_given_tuple_batches_gets_one_short_line(one_process_group, stage):
    """``self.model(**batch).loss`` on TextDataModule's default (inputs, targets) batches: Python's own TypeError
    names the model by its whole repr (dozens of lines); under a lightning-par strategy it is one line naming the
    dict the model takes and the data module's option, on the step's own traceback (in-process, one rank)."""
    import traceback

    import lightning.pytorch as pl

    from lightning_par.examples import HFCausalLMLightningModule

    class Mine(HFCausalLMLightningModule):
        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def validation_step(self, batch, batch_idx):
            return self.model(**batch).loss

    ids = torch.zeros(8, dtype=torch.long)
    data = torch.utils.data.DataLoader([(ids, ids)] * 4, batch_size=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=0), max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    model = Mine(vocab_size=64, hidden_size=16, n_layers=1, n_heads=2, n_kv_heads=1, intermediate_size=32)
    with pytest.raises(TypeError) as failure:
        getattr(trainer, stage)(model, data)
    message = str(failure.value)
    assert "\n" not in message and len(message) < 400 and "LlamaForCausalLM" not in message, message
    assert message.startswith("the step calls the model with **batch, which needs a dict, but the batch is a list "
                              "of 2 (Tensor, Tensor)") and "--data.batch_format=dict" in message
    where = traceback.extract_tb(failure.value.__traceback__)[-1]
    assert where.name == {"fit": "training_step", "validate": "validation_step"}[stage]
    assert "self.model(**batch)" in where.line


def test_a_data_position_outside_the_epoch_is_refused_naming_the_checkpoint():
    """A checkpoint whose manifest is consistent but whose data position is past the epoch (consumed_samples=1e9)
    would give the sampler nothing: the epoch silently skipped. Refused, naming the checkpoint."""
    from types import SimpleNamespace

    from lightning_par.run.data_order import DataParallelSampler
    from lightning_par.run.data_position import DataPosition

    sampler = DataParallelSampler(range(100), num_replicas=2, rank=0, shuffle=False)
    trainer = SimpleNamespace(ckpt_path="/runs/version_0/checkpoints/last.ckpt", strategy=None, world_size=2,
                              global_step=3, is_global_zero=False, accumulate_grad_batches=1, loggers=[])
    position = DataPosition(trainer, sampler, batch_size=4)
    state = {"epoch": 0, "consumed_samples": 24, "epoch_ended": False, "global_batch": 8, "seed": 0,
             "shuffle": False, "dataset_length": 100}
    position.load_state_dict(state)
    assert list(sampler)[:2] == [24, 26]  # a position inside the epoch: resumed there
    for consumed in (10**9, 100, -8):
        with pytest.raises(ValueError, match=rf"^/runs/version_0/checkpoints/last\.ckpt: its data position, "
                                             rf"{consumed} samples into epoch 0, is not inside an epoch of this data "
                                             r"\(100 samples\): the checkpoint is damaged or from other data\. "
                                             r"Resume from another checkpoint\.$"):
            position.load_state_dict({**state, "consumed_samples": consumed})


def test_a_training_loader_without_a_batch_is_refused():
    """A per-rank batch larger than the rank's share of the data, with drop_last: Lightning alone ends with "No
    training batches" and exit code 0; every lightning-par strategy's training loader is refused in one line."""
    from types import SimpleNamespace

    from torch.utils.data import DataLoader, TensorDataset

    from lightning_par.run.data_order import DataParallelSampler
    from lightning_par.run.data_position import resumable_train_loader

    data = TensorDataset(torch.ones(10, 1))
    trainer = SimpleNamespace(fit_loop=None)
    sampler = DataParallelSampler(data, num_replicas=4, rank=0, shuffle=False)  # 3 samples a rank
    with pytest.raises(ValueError, match=r"^the training DataLoader gives no batch: 3 samples on each of 4 "
                                         r"data-parallel ranks, fewer than its batch_size=4 \(drop_last=True\)\."):
        resumable_train_loader(DataLoader(data, batch_size=4, sampler=sampler, drop_last=True), trainer)
    assert len(resumable_train_loader(DataLoader(data, batch_size=3, sampler=sampler, drop_last=True), trainer)) == 1
    assert len(resumable_train_loader(DataLoader(data, batch_size=4, sampler=sampler), trainer)) == 1  # kept short


def test_the_cli_raises_the_data_modules_own_error_last(tmp_path):
    """An error of the data module's constructor is the CLI's last line, not jsonargparse's "Does not validate
    against any of the Union subtypes" followed by a dump of the config."""
    custom = tmp_path / "custom_tokenizer"
    custom.mkdir()
    (custom / "tokenizer_config.json").write_text('{"auto_map": {"AutoTokenizer": [null, "code.Tok"]}}')
    for tokenizer, error, match in (
            (custom, ValueError, rf"^tokenizer='{custom}': {custom}/tokenizer_config\.json names custom code "
                                 r"\(code\.Tok\) that loading it would run: refused\. Pass --data\.trust_remote_code"),
            (tmp_path / "none", FileNotFoundError, r"^tokenizer='.*none' is not a directory")):
        with pytest.raises(error, match=match) as raised:
            main(["fit", *CPU_JOB, f"--data.tokenizer={tokenizer}"])
        assert raised.value.__suppress_context__  # printed alone, no chained jsonargparse error
