"""PipelineStrategy inside Lightning's loop: every schedule matches one process step by step, with data parallel,
gradient accumulation, clipping and tied embeddings; evaluation, prediction and checkpoints; clear errors."""

import json

import pytest
from lightning.pytorch import Trainer

from lightning_par import LayoutError, PipelineStrategy
from tests.conftest import GLOBAL_BATCH, PARITY_STEPS, PIPELINE_SCHEDULES, launch_of, run_cases, steps_of
from tests.harness import launch_cli, max_rel_diff

PARITY_RTOL = 1e-5


def _assert_parity(run, reference, label, steps: int = PARITY_STEPS):
    """The run's losses, train and validation, are the reference's over its ``steps`` (the reference's first)."""
    diff = max_rel_diff(run.losses(), reference.losses(steps=steps))
    val = max_rel_diff(run.losses("val/loss"), reference.losses("val/loss", steps))
    print(f"{label}: max relative per-step train loss difference {diff:.2e} over {steps} steps, val loss {val:.2e}")
    assert len(run.losses()) == steps and diff <= PARITY_RTOL and val <= PARITY_RTOL


@pytest.mark.parametrize("schedule,pp", run_cases([((s, pp), f"pp{pp}_{s}") for pp in (2, 4)
                                                   for s in PIPELINE_SCHEDULES], "single"))
def test_schedule_matches_single_process(runs, pp, schedule):
    _assert_parity(runs(f"pp{pp}_{schedule}"), runs("single"), f"pp={pp} {schedule}")


@launch_of("dp2_pp2_accum_clip", "single_clip")
def test_data_parallel_pipeline_with_accumulation_and_clipping(runs):
    """dp=2 x pp=2 zero-bubble, 2 micro-batches, accumulate 2 batches, clip at 0.5: gradients averaged over the
    replicas, the loss scaled (not the gradients), and the norm clipped by sums every stage, so the run stays on one
    process's trajectory."""
    run = runs("dp2_pp2_accum_clip")  # first: a launch of the full run only
    reference = runs("single_clip")
    assert min(reference.grad_norms()) > 0.5, "clipping must act for this test to mean anything"
    _assert_parity(run, reference, "dp=2 x pp=2 zero_bubble, accumulate 2, clip 0.5", steps_of("dp2_pp2_accum_clip"))
    # the norm clipped by is the whole model's: every stage, averaged over the replicas (strategy.global_grad_norm)
    assert max_rel_diff(run.grad_norms(), reference.grad_norms()) <= 1e-4


@pytest.mark.parametrize("name", run_cases(["pp4_tied_1f1b", "pp2_tied_zbv"], "single_tied"))
def test_tied_embeddings(runs, name):
    """Tied embedding/head: on the first and last of 4 ranks (gradients summed over the pipeline), and on one rank
    holding both ends of a V (one parameter, summed by autograd)."""
    _assert_parity(runs(name), runs("single_tied"), name)


def _timeline(run) -> dict:
    (path,) = run.root.glob("tb/**/pipeline_timeline.json")
    return json.loads(path.read_text())


@launch_of("pp4_zero_bubble")
def test_timeline_png_json_and_tensorboard(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = runs("pp4_zero_bubble")
    summary = _timeline(run)
    kinds = {r["kind"] for r in summary["records"]}
    assert kinds == {"F", "B", "W"}, "zero bubble splits backward into input (B) and weight (W) gradients"
    assert {r["rank"] for r in summary["records"]} == {0, 1, 2, 3}
    assert 0 < summary["bubble_fraction"] < 1
    assert next(run.root.glob("tb/**/pipeline_timeline.png")).stat().st_size > 10_000
    scalars = run.scalars()
    assert {"pipeline/bubble_fraction", "pipeline/peak_activation_MiB"} <= set(scalars)
    (events,) = run.root.glob("tb/**/events.out.tfevents.*")
    acc = EventAccumulator(str(events), size_guidance={"images": 0})
    acc.Reload()
    assert "pipeline/timeline" in acc.Tags()["images"]


@launch_of("pp4_gpipe", "pp4_1f1b")
def test_activation_memory_gpipe_holds_m_microbatches_1f1b_at_most_p(runs):
    """p=4, m=8: GPipe's stage 0 holds all 8 micro-batches' activations, 1F1B's at most 4 -- counted from the
    executed schedule and measured in bytes autograd saved."""
    gpipe, one_f_one_b = _timeline(runs("pp4_gpipe")), _timeline(runs("pp4_1f1b"))
    assert gpipe["peak_in_flight"] == {"0": 8, "1": 8, "2": 8, "3": 8}
    assert one_f_one_b["peak_in_flight"] == {"0": 4, "1": 3, "2": 2, "3": 1}
    ratios = [g / o for g, o in zip(gpipe["peak_activation_bytes"], one_f_one_b["peak_activation_bytes"],
                                    strict=True)]
    print(f"peak activation bytes per rank, gpipe: {gpipe['peak_activation_bytes']}, "
          f"1f1b: {one_f_one_b['peak_activation_bytes']}, ratio {[round(r, 3) for r in ratios]}")
    for rank, ratio in enumerate(ratios):  # 8 / (4 - rank) micro-batches in flight
        assert ratio == pytest.approx(8 / (4 - rank), rel=0.05)


@launch_of("pp2_1f1b", full=True)
def test_resume_from_pipeline_checkpoint_continues_the_same_run(tmp_path, cache_dir, runs):
    from tests.conftest import EPOCH_STEPS, RUNS

    uninterrupted = runs("pp2_1f1b")
    checkpoint = uninterrupted.checkpoint(step=EPOCH_STEPS)
    assert (checkpoint / "manifest.json").is_file(), "each pipeline rank writes its own stages: a sharded directory"
    devices, args = RUNS["pp2_1f1b"]
    resumed = launch_cli(tmp_path, cache_dir, [*args, f"--ckpt_path={checkpoint}"], devices=devices).check()
    assert max_rel_diff(resumed.losses(), uninterrupted.losses()[EPOCH_STEPS:]) <= PARITY_RTOL


@launch_of("pp2_1f1b", ranks=4, full=True)
def test_checkpoint_reshards_to_another_pipeline_size(tmp_path, cache_dir, runs):
    """A pp=2 checkpoint validated under pp=4 with another schedule gives the fit's final validation loss."""
    fit = runs("pp2_1f1b")
    args = ["--trainer.strategy=pipeline4_interleaved_1f1b", f"--data.batch_size={GLOBAL_BATCH}",
            "--trainer.limit_val_batches=2", f"--ckpt_path={fit.checkpoint(step=PARITY_STEPS)}"]
    run = launch_cli(tmp_path, cache_dir, args, devices=4, command="validate").check()
    fit_val = fit.scalars()["val/loss"]
    (value,) = run.scalars()["val/loss"].values()
    assert abs(value - fit_val[max(fit_val)]) / fit_val[max(fit_val)] <= PARITY_RTOL


@launch_of("pp2_1f1b", ranks=2)
def test_predict_generates_through_the_pipeline(tmp_path, cache_dir, runs):
    checkpoint = runs("pp2_1f1b").checkpoint(step=PARITY_STEPS)
    args = ["--trainer.strategy=pipeline2_gpipe", f"--ckpt_path={checkpoint}", "--data.batch_size=8",
            "--trainer.callbacks+=tests.probes.PredictionDump", f"--trainer.callbacks.path={tmp_path / 'pred'}"]
    launch_cli(tmp_path, cache_dir, args, devices=2, command="predict").check()
    per_rank = [json.loads((tmp_path / "pred" / f"predictions_rank{r}.json").read_text()) for r in (0, 1)]
    # both pipeline ranks belong to one replica: the same 8 prompts, the same 32 sampled tokens each
    assert per_rank[0] == per_rank[1]
    assert len(per_rank[0]) == 8 and all(len(row) == 32 and all(0 <= t < 256 for t in row) for row in per_rank[0])


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(schedule="pipedream"), r"unknown pipeline schedule 'pipedream'; valid schedules: 'gpipe'.*'dualpipev'"),
        (dict(schedule="1f1b", n_microbatches=1), r"1f1b needs at least as many micro-batches as pipeline stages"),
        (dict(schedule="zbv", virtual_stages=3), r"'zbv' runs exactly 2 stage\(s\) per rank, got virtual_stages=3"),
        (dict(schedule="gpipe", virtual_stages=2), r"'gpipe' runs exactly 1 .*use interleaved_1f1b or zero_bubble"),
        (dict(schedule="dualpipev", n_microbatches=2), r"dualpipev needs n_microbatches >= 2 \* pp = 4, got 2"),
        (dict(schedule="interleaved_1f1b", n_microbatches=5), r"not a multiple of its 2 rounds.*e.g. 4"),
        (dict(n_microbatches=0), r"n_microbatches=0 is not valid"),
    ],
)
def test_bad_pipeline_options_fail_before_launch(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        Trainer(accelerator="cpu", devices=2, strategy=PipelineStrategy(pp=2, **kwargs), logger=False)


@pytest.mark.launch(ranks=2, full=True)
def test_a_batch_that_does_not_split_into_microbatches_fails_clearly(tmp_path, cache_dir):
    args = ["--trainer.strategy=lightning_par.PipelineStrategy", "--trainer.strategy.pp=2",
            "--trainer.strategy.n_microbatches=4", "--data.batch_size=6", "--trainer.max_steps=2"]
    run = launch_cli(tmp_path, cache_dir, args, devices=2, timeout=200)
    assert run.returncode != 0 and run.seconds < 150
    assert "the batch of 6 samples does not split into n_microbatches=4 equal micro-batches" in run.log


def test_a_model_without_blocks_is_refused_with_how_to_declare_them():
    from torch import nn

    from lightning_par.parallel.blocks import find_blocks

    with pytest.raises(LayoutError, match=r"found no repeated blocks in Sequential.*block_types=\[YourBlock\]"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))


@launch_of("single", ranks=2, full=True)
def test_bf16_true_trains_through_the_pipeline(tmp_path, cache_dir, runs):
    """bf16-true makes bf16 the default dtype inside steps: every rank must still exchange the same bytes (a
    regression: the loss broadcast once mixed 2-byte and 4-byte scalars and gloo aborted)."""
    args = ["--trainer.strategy=pipeline2_zbv", "--trainer.precision=bf16-true", "--trainer.max_steps=4",
            f"--data.batch_size={GLOBAL_BATCH}", "--trainer.limit_val_batches=1", "--trainer.gradient_clip_val=0.5"]
    run = launch_cli(tmp_path, cache_dir, args, devices=2).check()
    reference = runs("single").losses()[:4]
    print(f"bf16-true pp=2 zbv losses {run.losses()} vs fp32 single process {reference}")
    assert max_rel_diff(run.losses(), reference) < 0.03  # bf16 weights and activations: agreement to ~1%
