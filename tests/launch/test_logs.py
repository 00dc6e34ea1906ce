"""Logs that tell: the CLI's logging defaults, train/mfu, memory over ranks, the model summary's line, the pipeline
timeline's labels. One 2-rank pipeline launch as a user runs it (no logging options) and the shared tp2 launch;
the rest in process."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from lightning_par.callbacks import MemoryPerRank, describe_counts
from lightning_par.cli import log_every_n_steps_for
from lightning_par.utilization import (
    ParameterCounts,
    estimated_flops_per_token,
    gpu_preset,
    model_flops_per_token,
    peak_flops,
    planner_flops_per_token,
)
from tests.conftest import launch_of
from tests.harness import TINY_JOB, Run, launch_command

SEQ = 32


def _tiny_gpt():
    from lightning_par.examples import GPTLightningModule

    return GPTLightningModule(preset="tiny", n_layers=8)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- the CLI's defaults --------------------------------------------------------------------------------------------
def test_log_every_n_steps_scales_with_a_short_run():
    assert [log_every_n_steps_for(n) for n in (1, 20, 200, 999, 1000, 100_000)] == [1, 1, 10, 49, 50, 50]
    assert log_every_n_steps_for(None) == log_every_n_steps_for(-1) == 50  # no max_steps: Lightning's


def _cli(tmp_path, *extra):
    from lightning.pytorch import LightningDataModule, LightningModule

    from lightning_par.cli import LightningParCLI

    return LightningParCLI(LightningModule, LightningDataModule, subclass_mode_model=True, subclass_mode_data=True,
                           run=False, args=["--model=lightning_par.examples.GPTLightningModule", "--model.preset=tiny",
                                            "--data=lightning_par.data.TextDataModule", "--trainer.accelerator=cpu",
                                            "--trainer.devices=1", "--trainer.logger=TensorBoardLogger",
                                            f"--trainer.logger.save_dir={tmp_path}", *extra]).trainer


def test_cli_defaults_and_the_users_own_values(tmp_path):
    from lightning.pytorch.callbacks import ModelSummary

    from lightning_par.callbacks import ParallelModelSummary

    trainer = _cli(tmp_path, "--trainer.max_steps=20")
    assert trainer.log_every_n_steps == 1
    assert trainer.logger._default_hp_metric is False
    assert [type(c) for c in trainer.callbacks if isinstance(c, ModelSummary)] == [ParallelModelSummary]
    trainer = _cli(tmp_path, "--trainer.max_steps=20", "--trainer.log_every_n_steps=7",
                   "--trainer.logger.default_hp_metric=true", "--trainer.enable_model_summary=false")
    assert trainer.log_every_n_steps == 7
    assert trainer.logger._default_hp_metric is True
    assert not any(isinstance(c, ModelSummary) for c in trainer.callbacks)


# -- FLOPs per token and peak FLOP/s -------------------------------------------------------------------------------
def test_planner_flops_of_the_example_gpt_match_the_closed_form():
    """The planner's count: 6 x the matmul weights (the embedding is a lookup, not counted) + attention, 12 L d s
    with a flash backward of 2.5 forwards (so 14 L d s): the fallback 6 N + 12 L d s is 2.7% off for this model."""
    module = _tiny_gpt()
    flops, how = planner_flops_per_token(module, SEQ)
    assert "planner" in how
    module.configure_model()
    matmul = sum(p.numel() for n, p in module.named_parameters() if p.dim() == 2 and "embed" not in n)
    layers, dim = 8, 64
    assert flops == pytest.approx(6 * matmul + 14 * layers * dim * SEQ, rel=1e-9)
    estimate, _ = estimated_flops_per_token(module, _numel(module), SEQ)
    assert estimate == 6 * _numel(module) + 12 * layers * dim * SEQ
    assert abs(estimate - flops) / flops > 0.02, "the planner's count is not the fallback estimate"


def test_a_model_the_planner_cannot_describe_falls_back_to_6n_and_says_why():
    plain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))  # no blocks, no hyperparameters
    flops, how = model_flops_per_token(plain, _numel(plain), SEQ)
    assert flops == 6 * _numel(plain)
    assert "attention not counted" in how and "planner could not describe Sequential" in how
    plain.config = type("Config", (), {"num_hidden_layers": 3, "hidden_size": 16})()
    flops, how = model_flops_per_token(plain, _numel(plain), SEQ)
    assert flops == 6 * _numel(plain) + 12 * 3 * 16 * SEQ


def test_peak_flops(tmp_path, monkeypatch):
    """A CPU's peak is measured once per machine and kept: a later launch divides by the same figure (no new
    measurement) and says where it comes from; another dtype is measured on its own."""
    from lightning_par import utilization

    given = peak_flops(torch.device("cpu"), "32-true", world_size=4, local_ranks=4, num_nodes=1, per_device=1e12)
    assert given.flops == 4e12
    assert 1e8 < utilization.measure_matmul_flops(torch.float32, budget_s=0.05) < 1e14  # the real one, briefly
    kept = tmp_path / "cpu_peak.json"
    monkeypatch.setenv(utilization.CPU_PEAK_FILE, str(kept))
    measured = []
    monkeypatch.setattr(utilization, "measure_matmul_flops",
                        lambda dtype, budget_s: measured.append((dtype, torch.get_num_threads())) or 3e10)
    cpu = peak_flops(torch.device("cpu"), "32-true", world_size=2, local_ranks=2, num_nodes=1)
    cores = min(utilization.usable_cores(), 2 * torch.get_num_threads())
    assert measured == [(torch.float32, 1)] and cpu.flops == 3e10 * cores  # one core's rate x the cores in use
    assert f"30.0 GFLOP/s per core (float32 matmul, one thread; measured now, kept in {kept})" in cpu.source
    again = peak_flops(torch.device("cpu"), "32-true", world_size=2, local_ranks=2, num_nodes=1)
    assert len(measured) == 1 and again.flops == cpu.flops and f"kept in {kept}" in again.source
    assert "measured 20" in again.source and utilization.cpu_name() in again.source
    peak_flops(torch.device("cpu"), "bf16-true", world_size=1, local_ranks=1, num_nodes=1)
    assert [d for d, _ in measured] == [torch.float32, torch.bfloat16]
    assert gpu_preset("NVIDIA H100 80GB HBM3") == "h100-sxm" and gpu_preset("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_preset("Tesla T4") is None


# -- memory, summary line, timeline labels -------------------------------------------------------------------------
def test_memory_metrics_over_ranks():
    mib = 2**20
    metrics = MemoryPerRank.metrics([100 * mib, 300 * mib, 200 * mib])
    assert metrics == {"memory/min_MiB": 100, "memory/mean_MiB": 200, "memory/max_MiB": 300, "memory/max_rank": 1}
    assert MemoryPerRank.metrics([mib, 2 * mib], per_rank=True)["memory/rank1_MiB"] == 2


def test_summary_line_wording():
    pp2 = describe_counts(ParameterCounts(whole=1000, here=600, summary=600), pp=2, stages=(0, 3), n_stages=4)
    assert pp2 == ("Model summary: its parameter counts cover pipeline rank 0's stages 0, 3 of 4 (600); the whole "
                   "model has 1,000 parameters, global rank 0 holds 600 (pipeline stages 0, 3).")
    tp2 = describe_counts(ParameterCounts(whole=1000, here=500, summary=1000), tp=2)
    assert tp2 == ("Model summary: its parameter counts cover the whole model (1,000); the whole model has 1,000 "
                   "parameters, global rank 0 holds 500 (a 1/2 tensor-parallel slice).")
    three_d = describe_counts(ParameterCounts(whole=1000, here=150, summary=600), pp=2, stages=(0,), n_stages=2,
                              tp=2, zero3_dp=2)
    assert "cover pipeline rank 0's stage 0 of 2 at full tensor-parallel width (600)" in three_d
    assert three_d.endswith("holds 150 (pipeline stage 0, a 1/2 tensor-parallel slice, a 1/2 ZeRO-3 shard).")


def test_timeline_labels_name_pipeline_rank_and_stage():
    pytest.importorskip("matplotlib")
    from lightning_par.parallel.pipeline.timeline import ComputeRecord, draw_timeline

    # a V on 2 pipeline ranks: rank 0 holds stages 0 and 3, rank 1 stages 1 and 2
    rows = [(0, 0, 0, 1), (1, 1, 1, 2), (1, 2, 2, 3), (0, 3, 3, 4)]
    records = [ComputeRecord(rank, "F", stage, 0, start, end) for rank, stage, start, end in rows]
    fig = draw_timeline(records, None, "zbv")
    (ax,) = fig.axes
    rows = [t.get_text() for t in ax.get_yticklabels()]
    assert rows == ["pp rank 0\nstages 0, 3\nidle 50%", "pp rank 1\nstages 1, 2\nidle 50%"]
    assert sorted(t.get_text() for t in ax.texts) == ["0\ns0", "0\ns1", "0\ns2", "0\ns3"]
    one_stage = draw_timeline([ComputeRecord(0, "F", 0, 5, 0, 1), ComputeRecord(1, "F", 1, 5, 1, 2)], None)
    assert [t.get_text() for t in one_stage.axes[0].texts] == ["5", "5"]  # one stage per rank: the micro-batch
    assert one_stage.axes[0].get_yticklabels()[1].get_text().startswith("pp rank 1\nstage 1\n")


# -- a launch as a user runs it: no logging options ------------------------------------------------------------------
STEPS = 20
USER_SET = ("--trainer.log_every_n_steps", "--trainer.enable_model_summary", "--trainer.enable_checkpointing")


@pytest.fixture(scope="module")
def pp2_default_logging(tmp_path_factory, cache_dir) -> Run:
    """2 pipeline ranks (ZBV: two stages per rank), 20 steps, the CLI's logging and checkpoint defaults and a
    TensorBoardLogger without default_hp_metric."""
    root = tmp_path_factory.mktemp("pp2_default_logging")
    job = [a for a in TINY_JOB if not a.startswith(USER_SET)]
    argv = ["fit", *job, "--trainer.devices=2", "--trainer.strategy=pipeline2_zbv", f"--trainer.max_steps={STEPS}",
            "--data.batch_size=8", "--trainer.limit_val_batches=0", "--sample_tokens=0",
            "--trainer.logger=TensorBoardLogger", f"--trainer.logger.save_dir={root / 'tb'}",
            f"--data.cache_dir={cache_dir}", "--pipeline_timeline.step=50"]
    return launch_command(root, cache_dir, argv, 300, log_name="launch.log").check()


@pytest.mark.launch(ranks=2)
def test_a_short_run_logs_loss_and_mfu_and_no_hp_metric(pp2_default_logging):
    run = pp2_default_logging
    scalars = run.scalars()
    assert "hp_metric" not in scalars
    assert sorted(scalars["train/loss"]) == list(range(STEPS)), "log_every_n_steps 1 for a 20-step run"
    assert sorted(scalars["train/mfu"]) == sorted(scalars["train/tokens_per_sec"]) == [10, 20]  # window 10
    mfu, tps = scalars["train/mfu"], scalars["train/tokens_per_sec"]
    assert all(0 < v < 1 for v in mfu.values()), mfu
    # mfu = FLOPs per token x tokens/s / peak, with the planner's count and the peak the run printed
    found = re.search(r"train/mfu: ([\d.]+) MFLOP per token .* from the planner's count .*; peak ([\d.]+) GFLOP/s",
                      run.log)
    assert found, run.log[-3000:]
    mflop, peak = float(found.group(1)), float(found.group(2))
    assert mflop * 1e6 == pytest.approx(planner_flops_per_token(_tiny_gpt(), SEQ)[0], rel=1e-3)
    for step in mfu:
        assert mfu[step] == pytest.approx(tps[step] * mflop * 1e6 / (peak * 1e9), rel=2e-3)
    print(f"pp2 zbv: mfu {mfu}, tokens/s {tps}, {mflop} MFLOP/token, peak {peak} GFLOP/s")


@pytest.mark.launch(ranks=2)
def test_the_run_ends_saying_where_its_logs_and_checkpoints_are(pp2_default_logging):
    """The CLI's last lines: the TensorBoard directory and the checkpoints', with the --ckpt_path that resumes; the
    checkpoint of the max_steps stop, 20 steps into the first epoch, is numbered with that epoch (Lightning alone
    names it epoch=1)."""
    run = pp2_default_logging
    version = run.root / "tb" / "lightning_logs" / "version_0"
    assert sorted(p.name for p in (version / "checkpoints").iterdir()) == ["epoch=0-step=20.ckpt", "last.ckpt"]
    tail = run.log.strip().splitlines()[-4:]
    assert tail == [f"TensorBoard logs: {version}", f"Open them with:  tensorboard --logdir {version}",
                    f"Checkpoints: {version / 'checkpoints'}",
                    f"Resume with:  --ckpt_path={version / 'checkpoints' / 'last.ckpt'}  (or --ckpt_path=last: the "
                    "newest complete one)"], run.log[-2000:]


@pytest.mark.launch(ranks=2)
def test_memory_over_ranks_from_a_two_rank_run(pp2_default_logging):
    scalars = pp2_default_logging.scalars()
    assert not any(re.fullmatch(r"memory/rank\d+_MiB", tag) for tag in scalars), "per-rank tags are off by default"
    low, mean, high = (scalars[f"memory/{k}_MiB"] for k in ("min", "mean", "max"))
    assert sorted(low) == [10, 20]
    for step in low:
        assert 0 < low[step] <= mean[step] <= high[step]
        assert mean[step] == pytest.approx((low[step] + high[step]) / 2, rel=1e-6)  # two ranks
        assert scalars["memory/max_rank"][step] in (0, 1)


@pytest.mark.launch(ranks=2)
def test_summary_line_under_pp2(pp2_default_logging):
    module = _tiny_gpt()
    module.configure_model()
    whole = _numel(module)
    found = re.search(r"Model summary: its parameter counts cover pipeline rank 0's stages 0, 3 of 4 \(([\d,]+)\); "
                      r"the whole model has ([\d,]+) parameters, global rank 0 holds ([\d,]+) \(pipeline stages 0, "
                      r"3\)\.", pp2_default_logging.log)
    assert found, pp2_default_logging.log[-3000:]
    covered, total, held = (int(g.replace(",", "")) for g in found.groups())
    assert total == whole and covered == held < whole
    table = re.search(r"([\d.]+) K\s+Total params", pp2_default_logging.log)  # Lightning's table: the same stages
    assert table and math.isclose(float(table.group(1)) * 1e3, covered, rel_tol=5e-3)


@launch_of("tp2")
def test_summary_line_under_tp2(runs):
    run = runs("tp2")
    module = _tiny_gpt()
    module.configure_model()
    whole = _numel(module)
    found = re.search(r"Model summary: its parameter counts cover the whole model \(([\d,]+)\); the whole model has "
                      r"([\d,]+) parameters, global rank 0 holds ([\d,]+) \(a 1/2 tensor-parallel slice\)\.", run.log)
    assert found, run.log[-3000:]
    covered, total, held = (int(g.replace(",", "")) for g in found.groups())
    assert covered == total == whole
    assert whole / 2 < held < whole  # the split weights halved, norms and biases replicated
