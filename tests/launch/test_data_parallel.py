"""Data parallel (ZeroStrategy stage 0) on several CPU ranks: loss parity, sampling, mesh, logging, multi-node."""

import json
import math
import re

import pytest

from tests.conftest import GLOBAL_BATCH, PARITY_STEPS, launch_of, run_cases
from tests.harness import launch_cli, max_rel_diff

PARITY_RTOL = 1e-5


@pytest.mark.parametrize("run_name", [*run_cases([("dp2_run", "dp2")], "single"),
                                      pytest.param("dp4_run", marks=launch_of("single", "dp4", full=True)),
                                      *run_cases([("multinode_run", "multinode")], "single")])
def test_per_step_loss_matches_single_process(request, single_run, run_name):
    run = request.getfixturevalue(run_name)
    reference, losses = single_run.losses(), run.losses()
    assert len(reference) == len(losses) == PARITY_STEPS
    assert reference[-1] < reference[0] - 0.5, "the reference did not learn; parity would prove little"
    diff = max_rel_diff(losses, reference)
    print(f"{run_name}: max relative per-step loss difference {diff:.2e} over {PARITY_STEPS} steps")
    assert diff <= PARITY_RTOL


@launch_of("single", "dp4")
def test_validation_loss_matches_single_process(single_run, dp4_run):
    assert max_rel_diff(dp4_run.losses("val/loss"), single_run.losses("val/loss")) <= PARITY_RTOL


@launch_of("single", "dp4")
def test_ranks_split_each_global_batch_by_data_parallel_rank(single_run, dp4_run):
    reports = {r["global_rank"]: r for r in dp4_run.reports}
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, report in reports.items():
        assert report["sampler"] == {"num_replicas": 4, "rank": rank}
        assert report["coordinates"] == {"pp": 0, "dp": rank, "cp": 0, "tp": 0}
    (reference,) = single_run.reports
    per_sample = 4  # the probe records 4 tokens of each sample
    for step, global_batch in enumerate(reference["first_batches"]):
        samples = {tuple(global_batch[i : i + per_sample]) for i in range(0, len(global_batch), per_sample)}
        seen = [tuple(r["first_batches"][step][i : i + per_sample]) for r in reports.values()
                for i in range(0, GLOBAL_BATCH // 4 * per_sample, per_sample)]
        assert len(seen) == GLOBAL_BATCH and set(seen) == samples


@launch_of("dp4")
def test_mesh_groups_backend_and_wrapper(dp4_run):
    for report in dp4_run.reports:
        rank = report["global_rank"]
        assert report["groups"] == {"pp": [rank], "dp": [0, 1, 2, 3], "tp": [rank]}
        assert report["backend"] == "gloo"
        assert report["cluster_environment"] == "LightningEnvironment"
        assert report["wrapped_model"] == "DistributedDataParallel"  # bucketed all-reduce overlapped with backward


@launch_of("dp2")
def test_tensorboard_holds_what_a_user_watches(dp2_run):
    scalars = dp2_run.scalars()
    for tag in ("train/loss", "train/ppl", "val/loss", "val/ppl", "lr-AdamW/pg1", "train/tokens_per_sec"):
        assert tag in scalars, f"{tag} missing from TensorBoard; found {sorted(scalars)}"
    assert len(scalars["train/loss"]) == PARITY_STEPS
    assert all(v > 0 for v in scalars["train/tokens_per_sec"].values())
    lrs = [scalars["lr-AdamW/pg1"][s] for s in sorted(scalars["lr-AdamW/pg1"])]
    assert len(lrs) == PARITY_STEPS and lrs[0] < max(lrs) and lrs[-1] < max(lrs), "warmup then cosine decay"
    # perplexity is exp(loss): the two logged series must agree where both exist
    loss, ppl = scalars["val/loss"], scalars["val/ppl"]
    step = max(loss)
    assert abs(ppl[step] - math.exp(loss[step])) / ppl[step] < 1e-4


@launch_of("multinode")
def test_two_nodes_through_torchrun(multinode_run):
    reports = sorted(multinode_run.reports, key=lambda r: r["global_rank"])
    assert [(r["node_rank"], r["local_rank"]) for r in reports] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["cluster_environment"] for r in reports} == {"TorchElasticEnvironment"}
    assert all(r["world_size"] == 4 and r["sampler"]["num_replicas"] == 4 for r in reports)


@launch_of("dp2", full=True)
@pytest.mark.parametrize("command,tag", [("validate", "val/loss"), ("test", "test/loss")])
def test_evaluation_from_checkpoint_reproduces_the_fit(tmp_path, cache_dir, dp2_run, command, tag):
    """validate/test under the strategy, restored from the fit's checkpoint, give the fit's final validation loss."""
    checkpoint = dp2_run.checkpoint(step=PARITY_STEPS)
    args = ["--trainer.strategy=zero0", f"--data.batch_size={GLOBAL_BATCH // 2}", "--trainer.limit_val_batches=2",
            "--trainer.limit_test_batches=2", f"--ckpt_path={checkpoint}"]
    run = launch_cli(tmp_path, cache_dir, args, devices=2, command=command).check()
    fit_val = dp2_run.scalars()["val/loss"]
    (value,) = run.scalars()[tag].values()
    assert abs(value - fit_val[max(fit_val)]) / fit_val[max(fit_val)] <= PARITY_RTOL


@launch_of("dp2", full=True)
def test_predict_runs_forward_only_under_the_strategy(tmp_path, cache_dir, dp2_run):
    checkpoint = dp2_run.checkpoint(step=PARITY_STEPS)
    args = ["--trainer.strategy=zero0", f"--ckpt_path={checkpoint}", "--data.batch_size=8",
            "--trainer.callbacks+=tests.probes.PredictionDump", f"--trainer.callbacks.path={tmp_path / 'pred'}"]
    launch_cli(tmp_path, cache_dir, args, devices=2, command="predict").check()
    per_rank = [json.loads((tmp_path / "pred" / f"predictions_rank{r}.json").read_text()) for r in (0, 1)]
    # the predict set is one batch of 8 prompts: each data-parallel rank continues its own half, 32 new tokens each
    assert [len(rows) for rows in per_rank] == [4, 4]
    assert all(len(row) == 32 and all(0 <= t < 256 for t in row) for rows in per_rank for row in rows)


@pytest.mark.launch(ranks=2)
def test_a_dead_rank_does_not_leave_the_others_hanging(tmp_path, cache_dir):
    """Rank 1 dies mid-run; rank 0 must fail fast on its next collective, not wait for the process-group timeout."""
    args = ["--trainer.strategy=zero0", "--trainer.max_steps=1000", "--data.batch_size=4",
            "--trainer.callbacks+=tests.probes.DieAt", "--trainer.callbacks.rank=1", "--trainer.callbacks.step=3"]
    run = launch_cli(tmp_path, cache_dir, args, devices=2, timeout=240)
    assert run.returncode not in (0, -9), "the survivors should exit with an error, not finish or hang"
    assert run.seconds < 180
    # named: by the heartbeat (its /proc check, as soon as rank 0's collective fails) or else by Lightning's launcher
    assert re.search(r"lightning-par: rank 1 \(\S+, pid \d+\) died|\[rank: 1\] Child process with PID \d+ "
                     r"terminated with code 17", run.log)
