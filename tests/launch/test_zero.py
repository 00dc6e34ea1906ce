"""ZeroStrategy stages 1-3 (and offload): loss parity with one process, global-norm clipping, gradient
accumulation, sharded checkpoint resume, and clear errors for layouts it cannot build."""

import pytest
from lightning.pytorch import Trainer

from lightning_par import LayoutError, ZeroStrategy
from tests.conftest import EPOCH_STEPS, PARITY_STEPS, launch_of, run_cases, steps_of
from tests.harness import launch_cli, max_rel_diff

PARITY_RTOL = 1e-5


@pytest.mark.parametrize("name", run_cases(["zero1_dp2", "zero2_dp2", "zero3_dp2", "zero2_offload_dp2"], "single"))
def test_stage_matches_single_process(runs, name):
    reference, run = runs("single"), runs(name)
    diff = max_rel_diff(run.losses(), reference.losses())
    print(f"{name}: max relative per-step loss difference {diff:.2e} over {PARITY_STEPS} steps")
    assert len(run.losses()) == PARITY_STEPS and diff <= PARITY_RTOL
    assert max_rel_diff(run.losses("val/loss"), reference.losses("val/loss")) <= PARITY_RTOL


@pytest.mark.parametrize("stage", run_cases([(s, f"zero{s}_dp4_accum_clip") for s in (1, 2, 3)], "single_clip"))
def test_stage_with_accumulation_and_clipping_at_dp4(runs, stage):
    run, reference = runs(f"zero{stage}_dp4_accum_clip"), runs("single_clip")  # (full-run-only first)
    steps = steps_of(f"zero{stage}_dp4_accum_clip")  # one epoch: the reference's first
    diff = max_rel_diff(run.losses(), reference.losses(steps=steps))
    print(f"zero{stage} dp4, accumulate 2, clip: max relative loss difference {diff:.2e} over {steps} steps")
    assert len(run.losses()) == steps and diff <= PARITY_RTOL
    # the norm clipped by is the global one: equal to one process's, and large enough that clipping acts
    norms, reference_norms = run.grad_norms(), reference.grad_norms()
    assert max_rel_diff(norms, reference_norms) <= 1e-4
    assert min(reference_norms) > 0.5


@pytest.mark.parametrize("stage", [2, 3])
@launch_of("zero2_dp2", "zero3_dp2", full=True)
def test_resume_from_sharded_checkpoint_continues_the_same_run(tmp_path, cache_dir, runs, stage):
    from tests.conftest import RUNS

    uninterrupted = runs(f"zero{stage}_dp2")
    checkpoint = uninterrupted.checkpoint(step=EPOCH_STEPS)
    assert checkpoint.is_dir() and (checkpoint / "manifest.json").is_file(), "stages 1-3 write a sharded directory"
    devices, args = RUNS[f"zero{stage}_dp2"]
    resumed = launch_cli(tmp_path, cache_dir, [*args, f"--ckpt_path={checkpoint}"], devices=devices).check()
    tail = uninterrupted.losses()[EPOCH_STEPS:]
    assert len(resumed.losses()) == len(tail) == PARITY_STEPS - EPOCH_STEPS
    assert max_rel_diff(resumed.losses(), tail) <= PARITY_RTOL


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(stage=4), r"zero_stage=4 is not available.*\[0, 1, 2, 3\]"),
        (dict(stage=-1), r"zero_stage=-1 is not available"),
        (dict(stage=2, offload_parameters=True), r"offload_parameters=True needs zero_stage=3 \(got 2\)"),
        (dict(stage=0, offload_optimizer=True), r"offload_optimizer=True needs zero_stage 1, 2 or 3"),
    ],
)
def test_bad_zero_options_fail_when_the_strategy_is_made(kwargs, match):
    with pytest.raises(LayoutError, match=match):
        ZeroStrategy(**kwargs)


def test_registered_zero_names():
    for name, stage in [("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero2_offload", 2)]:
        strategy = Trainer(accelerator="cpu", devices=2, strategy=name, logger=False).strategy
        assert isinstance(strategy, ZeroStrategy) and strategy.stage == stage
    offloaded = Trainer(accelerator="cpu", devices=2, strategy="zero3_offload", logger=False).strategy
    assert offloaded.layout.offload_parameters and offloaded.layout.offload_optimizer


def test_an_optimizer_that_cannot_be_partitioned_is_refused():
    import torch

    from lightning_par.parallel.zero import check_partitionable

    lbfgs = torch.optim.LBFGS([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(LayoutError, match=r"ZeRO stage 2 shards optimizer state element by element.*LBFGS.*AdamW"):
        check_partitionable(lbfgs, 2)
    check_partitionable(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), 2)
