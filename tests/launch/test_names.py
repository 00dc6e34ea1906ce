"""Strategy names with overrides, generic names, each strategy's own help, ``lightning-par --help`` and
``plan --config`` (issue 19).

All but one test run in this process: the CLI through ``lightning_par.cli.main`` with ``--print_config`` (it stops
after parsing, before any Trainer exists). One tiny 2-rank launch checks that an override after a name reaches the
pipeline: ``pipeline2_zbv`` with ``n_microbatches=8`` runs 8 micro-batches through each of its 4 stages."""

from __future__ import annotations

import inspect
import json
import re
import sys

import pytest
import yaml

from lightning_par import (
    ExpertParallelStrategy,
    Hybrid3DStrategy,
    LayoutError,
    LayoutStrategy,
    MegatronTPStrategy,
    PipelineStrategy,
    ZeroStrategy,
)
from lightning_par.cli import main
from lightning_par.parallel.layout import Layout
from lightning_par.plan_cli import main as plan_main
from lightning_par.strategies.names import registered_names, strategy_spec, unknown_strategy_message
from tests.harness import REPO, launch_cli

CPU_JOB = ["--model=lightning_par.examples.GPTLightningModule", "--model.preset=tiny",
           "--data=lightning_par.data.TextDataModule", "--trainer.accelerator=cpu", "--trainer.devices=2"]


def strategy_of(capsys, *args: str) -> dict:
    """``trainer.strategy`` as ``lightning-par fit ARGS --print_config`` prints it."""
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *CPU_JOB, *args, "--print_config"])
    assert exit_.value.code in (0, None), capsys.readouterr().err[-3000:]
    return yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]


def refused(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *CPU_JOB, *args, "--print_config"])
    assert exit_.value.code == 2
    return capsys.readouterr().err


# -- a registered name takes overrides -----------------------------------------------------------------------------
def test_a_name_takes_an_override_on_the_command_line(capsys):
    spec = strategy_of(capsys, "--trainer.strategy=pipeline2_zbv", "--trainer.strategy.n_microbatches=8")
    assert spec["class_path"].endswith("PipelineStrategy")
    assert (spec["init_args"]["pp"], spec["init_args"]["schedule"], spec["init_args"]["n_microbatches"]) == \
        (2, "zbv", 8)
    # a name alone stays a name (Lightning builds it from its registry, as before)
    assert strategy_of(capsys, "--trainer.strategy=pipeline2_zbv") == "pipeline2_zbv"


@pytest.mark.parametrize("args,cls,expected", [
    (["--trainer.strategy=hybrid3d", "--trainer.strategy.tp=2", "--trainer.strategy.pp=2"], "Hybrid3DStrategy",
     {"tp": 2, "pp": 2, "zero_stage": 1}),
    (["--trainer.strategy=zero", "--trainer.strategy.stage=3"], "ZeroStrategy", {"stage": 3}),
    (["--trainer.strategy=megatron_tp", "--trainer.strategy.tp=4", "--trainer.strategy.sequence_parallel=true"],
     "MegatronTPStrategy", {"tp": 4, "sequence_parallel": True}),
    (["--trainer.strategy=pipeline", "--trainer.strategy.pp=4", "--trainer.strategy.schedule=interleaved_1f1b"],
     "PipelineStrategy", {"pp": 4, "schedule": "interleaved_1f1b"}),
    (["--trainer.strategy=expert_parallel", "--trainer.strategy.ep=4", "--trainer.strategy.stage=3"],
     "ExpertParallelStrategy", {"ep": 4, "stage": 3}),
    (["--trainer.strategy=ep2", "--trainer.strategy.stage=2"], "ExpertParallelStrategy", {"ep": 2, "stage": 2}),
    (["--trainer.strategy=megatron_tp2_zero3", "--trainer.strategy.offload_optimizer=true"], "MegatronTPStrategy",
     {"tp": 2, "zero_stage": 3, "offload_optimizer": True}),
])
def test_generic_names_take_any_size(capsys, args, cls, expected):
    spec = strategy_of(capsys, *args)
    assert spec["class_path"].endswith(cls)
    assert {k: spec["init_args"][k] for k in expected} == expected


def test_a_name_after_a_config_replaces_its_strategy(capsys):
    """demo.yaml's Hybrid3DStrategy(tp=2, pp=2, ...) is replaced, none of its options carried into ZeroStrategy."""
    spec = strategy_of(capsys, f"--config={REPO / 'configs/demo.yaml'}", "--trainer.strategy=zero",
                       "--trainer.strategy.stage=3")
    assert spec["class_path"].endswith("ZeroStrategy") and spec["init_args"]["stage"] == 3
    assert "tp" not in spec["init_args"] and "n_microbatches" not in spec["init_args"]


def test_yaml_names_with_overrides(capsys, tmp_path):
    as_class_path = tmp_path / "a.yaml"
    as_class_path.write_text("trainer:\n  strategy:\n    class_path: pipeline2_zbv\n    init_args:\n"
                             "      n_microbatches: 8\n")
    spec = strategy_of(capsys, f"--config={as_class_path}")
    assert spec["class_path"].endswith("PipelineStrategy")
    assert (spec["init_args"]["pp"], spec["init_args"]["schedule"], spec["init_args"]["n_microbatches"]) == \
        (2, "zbv", 8)

    named = tmp_path / "b.yaml"
    named.write_text("trainer:\n  strategy: pipeline4_1f1b\n")
    spec = strategy_of(capsys, f"--config={named}", "--trainer.strategy.n_microbatches=8")
    assert (spec["init_args"]["pp"], spec["init_args"]["n_microbatches"]) == (4, 8)

    override = tmp_path / "c.yaml"  # a second config's init_args under the first one's name
    override.write_text("trainer:\n  strategy:\n    init_args:\n      n_microbatches: 16\n")
    spec = strategy_of(capsys, f"--config={named}", f"--config={override}")
    assert (spec["init_args"]["pp"], spec["init_args"]["schedule"], spec["init_args"]["n_microbatches"]) == \
        (4, "1f1b", 16)


def test_a_config_saved_with_a_presets_old_module_path_still_loads(capsys, tmp_path):
    """Configs saved before the presets moved into strategies/presets.py hold ``lightning_par.strategies.zero...``:
    the class is the same one, with one FutureWarning naming the new module; a name now saves the public path."""
    old = tmp_path / "old.yaml"
    old.write_text("trainer:\n  strategy:\n    class_path: lightning_par.strategies.zero.ZeroStrategy\n"
                   "    init_args:\n      stage: 2\n")
    sys.modules.pop("lightning_par.strategies.zero", None)
    with pytest.warns(FutureWarning, match="`lightning_par.strategies.zero` is now `lightning_par.strategies.presets`"):
        spec = strategy_of(capsys, f"--config={old}")
    assert spec["class_path"].endswith("ZeroStrategy") and spec["init_args"]["stage"] == 2
    assert strategy_of(capsys, "--trainer.strategy=zero", "--trainer.strategy.stage=3")["class_path"] == \
        "lightning_par.ZeroStrategy"


def test_overrides_after_a_name_that_takes_none_are_refused_clearly(capsys):
    err = refused(capsys, "--trainer.strategy=pipelin2_zbv", "--trainer.strategy.n_microbatches=8")
    assert "--trainer.strategy.n_microbatches after --trainer.strategy=pipelin2_zbv" in err
    assert "Did you mean 'pipeline2_zbv'" in err and "Does not validate against any of the Union" not in err
    err = refused(capsys, "--trainer.strategy=ddp", "--trainer.strategy.n_microbatches=8")
    assert "'ddp' is a name of Lightning's" in err
    err = refused(capsys, "--trainer.strategy.stage=3")
    assert "no strategy given before it: name one first, e.g. --trainer.strategy=zero" in err
    err = refused(capsys, "--trainer.strategy=zero2", "--trainer.strategy.tp=2")  # ZeroStrategy has no tp
    assert "Option 'tp' is not accepted" in err


def test_did_you_mean_covers_the_generic_names(capsys):
    assert {"zero", "pipeline", "megatron_tp", "hybrid3d"} <= set(registered_names())
    assert "Did you mean 'hybrid3d'" in unknown_strategy_message("hybrid")
    assert "Did you mean 'pipeline'" in unknown_strategy_message("pipline")
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *CPU_JOB, "--trainer.strategy=megatron"])
    assert exit_.value.code == 2
    assert "Did you mean 'megatron_tp'" in capsys.readouterr().err


@pytest.mark.launch(ranks=2)
def test_an_override_after_a_name_reaches_the_pipeline(tmp_path, cache_dir):
    """``pipeline2_zbv`` runs 2 stages per rank in a V (4 stages); with ``n_microbatches=8`` each stage runs 8
    forwards, one per micro-batch 0..7, in the step the PipelineTimeline records."""
    args = ["--trainer.strategy=pipeline2_zbv", "--trainer.strategy.n_microbatches=8", "--data.batch_size=8",
            "--model.n_layers=4", "--trainer.max_steps=1", "--pipeline_timeline.step=0", "--sample_tokens=0",
            "--trainer.limit_val_batches=0"]
    run = launch_cli(tmp_path, cache_dir, args, devices=2, timeout=240).check()
    [timeline] = tmp_path.glob("**/pipeline_timeline.json")
    summary = json.loads(timeline.read_text())
    assert (summary["schedule"], summary["pp"], summary["n_microbatches"]) == ("zbv", 2, 8)
    forwards = [(r["stage"], r["microbatch"]) for r in summary["records"] if r["kind"] == "F"]
    assert sorted(forwards) == [(s, m) for s in range(4) for m in range(8)], forwards
    assert "8 micro-batches" in run.log


# -- each strategy's help lists its own options --------------------------------------------------------------------
FOREIGN = {  # options another strategy has that this one must not list
    ZeroStrategy: {"tp", "pp", "dp", "schedule", "n_microbatches", "virtual_stages", "sequence_parallel",
                   "stage_costs", "zero_stage", "accelerator", "parallel_devices", "cluster_environment"},
    PipelineStrategy: {"tp", "sequence_parallel", "stage", "accelerator"},
    MegatronTPStrategy: {"pp", "schedule", "n_microbatches", "virtual_stages", "stage_costs", "stage", "accelerator"},
    Hybrid3DStrategy: {"stage", "accelerator", "parallel_devices"},
    ExpertParallelStrategy: {"tp", "pp", "dp", "schedule", "n_microbatches", "virtual_stages", "sequence_parallel",
                             "stage_costs", "zero_stage", "offload_optimizer", "offload_parameters", "accelerator"},
}


@pytest.mark.parametrize("by", ["class", "name"])
@pytest.mark.parametrize("cls", list(FOREIGN), ids=lambda c: c.__name__)
def test_each_strategy_help_lists_its_own_options(capsys, cls, by):
    with pytest.raises(SystemExit):
        name = f"lightning_par.{cls.__name__}" if by == "class" else cls.strategy_name
        main(["fit", "--trainer.strategy.help", name])
    text = capsys.readouterr().out
    listed = re.findall(r"^  --trainer\.strategy\.(\w+)", text, flags=re.MULTILINE)
    own = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    assert listed == own, (listed, own)
    assert not FOREIGN[cls] & set(listed)
    undocumented = re.findall(r"^  --trainer\.strategy\.(\w+).*\n\s+\(type:", text, flags=re.MULTILINE)
    assert not undocumented, f"options without a description: {undocumented}"
    assert "table above" not in text and "as in the table" not in text


def test_the_python_signatures_are_the_options():
    assert ZeroStrategy(stage=2).stage == 2 and PipelineStrategy(pp=2, n_microbatches=8).layout.n_microbatches == 8
    assert MegatronTPStrategy(tp=2, zero_stage=3).layout.zero_stage == 3
    assert Hybrid3DStrategy(tp=2, pp=2, offload_optimizer=True).layout.offload_optimizer
    with pytest.raises(TypeError, match="schedule"):
        ZeroStrategy(stage=0, schedule="zbv")  # once accepted and ignored by the layout's dp-only run
    with pytest.raises(TypeError, match="tp"):
        PipelineStrategy(pp=2, tp=2)
    assert "tp" in inspect.signature(LayoutStrategy).parameters  # the engine keeps every option


def test_expert_parallel_names_and_options_and_the_layouts_refusals():
    assert ExpertParallelStrategy(ep=4).layout.ep == 4 and ExpertParallelStrategy().layout.zero_stage == 1
    assert list(inspect.signature(ExpertParallelStrategy.__init__).parameters)[1:3] == ["ep", "stage"]
    for name, cls, args in (("ep2", "ExpertParallelStrategy", {"ep": 2}), ("ep8", "ExpertParallelStrategy", {"ep": 8}),
                            ("zero1_ep2", "ZeroStrategy", {"stage": 1, "ep": 2}),
                            ("zero3_ep4", "ZeroStrategy", {"stage": 3, "ep": 4})):
        assert strategy_spec(name) == {"class_path": f"lightning_par.{cls}", "init_args": args}
    assert MegatronTPStrategy(tp=2, ep=2, zero_stage=1).layout.ep == 2
    # every preset's ep composes (pp, tp under any ZeRO stage); a bad ep is refused by the layout itself, in its words
    assert Hybrid3DStrategy(tp=2, pp=2, ep=2).layout.ep == 2 and MegatronTPStrategy(tp=2, ep=2).layout.ep == 2
    for preset, kwargs in ((lambda: Hybrid3DStrategy(tp=2, pp=2, ep=0), {"tp": 2, "pp": 2, "ep": 0, "zero_stage": 1}),
                           (lambda: MegatronTPStrategy(tp=2, ep=-1), {"tp": 2, "ep": -1})):
        with pytest.raises(LayoutError) as from_layout:
            Layout(**kwargs)
        with pytest.raises(LayoutError) as from_preset:
            preset()
        assert str(from_preset.value) == str(from_layout.value)


# -- lightning-par --help and plan --config ------------------------------------------------------------------------
def test_the_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code in (0, None)
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict,plan,export}" in out
    for name in ("fit", "validate", "test", "predict", "plan", "export"):
        assert re.search(rf"^    {name}\s+\S", out, flags=re.MULTILINE), name
    assert "Names, any size: zero, pipeline, megatron_tp, hybrid3d" in out


def test_plan_reads_the_fit_config(capsys):
    assert plan_main(["--config", str(REPO / "configs/demo.yaml")]) == 0
    captured = capsys.readouterr()
    assert "GPTLightningModule" in captured.out
    assert "hardware: cpu" in captured.out  # trainer.accelerator: cpu
    assert "workload: global batch 16 x 128 tokens, micro-batch 4" in captured.out  # batch 16 in 4 micro-batches
    assert "dp=1 x tp=2 x pp=2 (world 4" in captured.out  # devices 4, Hybrid3DStrategy(tp=2, pp=2)
    row = re.search(r"^1\s+1\s+2\s+2\s+0\s+1f1b\s+-\s+none\s+fp32\s+4\s", captured.out, flags=re.MULTILINE)
    assert row, captured.out
    assert "1 layouts planned" in captured.out

    assert plan_main(["--config", str(REPO / "configs/zero.yaml")]) == 0
    out = capsys.readouterr().out
    assert "dp=2 x tp=1 x pp=1 (world 2" in out and "global batch 32 x 128 tokens, micro-batch 16" in out
    assert plan_main(["--config", str(REPO / "configs/zero.yaml"), "--world", "8", "--layout", "dp=8"]) == 0
    assert "dp=8 x tp=1 x pp=1 (world 8" in capsys.readouterr().out  # the command line wins
