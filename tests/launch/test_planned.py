"""strategy="planned": the planner picks the layout at launch (lightning_par/strategies/planned.py). One 4-rank launch:
it picks a layout, logs the choice and the runner-up, and trains at plain-SGD parity with one process; nothing that
fits is a clear error naming the smallest candidate's memory and the budget."""

from __future__ import annotations

import re

import pytest

from lightning_par import LayoutError, PlannedStrategy
from lightning_par.strategies.names import strategy_spec
from lightning_par.strategies.planned import Budget, plan_layouts
from tests.conftest import SGD_LR, job
from tests.harness import launch_cli, max_rel_diff

STEPS = 5
BATCH = 2  # sequences per data-parallel replica
SGD = ["--model.optimizer=sgd", f"--model.lr={SGD_LR}", f"--trainer.max_steps={STEPS}"]
PARITY_RTOL = 1e-5  # as the other 4-rank plain-SGD parity tests (tests/launch/test_engine.py)


def _tiny_gpt():
    from lightning_par.examples import GPTLightningModule
    from lightning_par.planner import build_model

    return build_model(GPTLightningModule, dict(preset="tiny", n_layers=8))


def test_the_name_and_its_options():
    spec = strategy_spec("planned")
    assert spec is not None and spec["class_path"].endswith("PlannedStrategy")
    with pytest.raises(TypeError, match="tp"):
        PlannedStrategy(tp=2)  # the plan chooses it
    with pytest.raises(LayoutError, match="gpu_memory"):
        PlannedStrategy(gpu_memory=-1)


def test_nothing_fits_names_the_smallest_candidate_and_the_budget():
    with pytest.raises(LayoutError, match=r"no layout of this model fits 0\.0001 GiB per rank on 4 ranks: the "
                                          r"smallest, dp\d.*, needs [\d.e-]+ GiB per rank"):
        plan_layouts(_tiny_gpt(), Budget(4, 4, 1e-4), batch=BATCH, seq_len=32, precision="32-true", optimizer="sgd")


def test_the_choice_is_the_fastest_that_fits_and_runs():
    choice = plan_layouts(_tiny_gpt(), Budget(4, 4, 8.0), batch=BATCH, seq_len=32, precision="bf16-mixed",
                          optimizer="sgd", zero_stages=(0, 1))
    best, second = choice.best, choice.runner_up
    assert best.fits and best.runs_today and best.candidate.precision == "bf16-mixed"
    assert best.candidate.zero_stage in (0, 1) and best.tokens_per_s >= second.tokens_per_s
    # a budget between the two: the one that fits wins
    tight = plan_layouts(_tiny_gpt(), Budget(4, 4, best.worst.total / 2**30 * 0.999), batch=BATCH, seq_len=32,
                         precision="bf16-mixed", optimizer="sgd", zero_stages=(0, 1))
    assert tight.best.worst.total < best.worst.total


@pytest.mark.launch(ranks=4, full=True)
def test_planned_on_4_ranks_trains_at_parity_with_one_process(tmp_path, cache_dir):
    planned = launch_cli(tmp_path / "planned", cache_dir, [*job(BATCH), *SGD, "--trainer.strategy=planned",
                                                          "--trainer.strategy.optimizer=sgd"], devices=4).check()
    chosen = re.search(r"planned layout \((\d+) estimated, ([\d.]+) GiB per rank\): chosen: dp(\d+) tp(\d+)\S* "
                       r"pp(\d+) z(\d) .*? predicted ([\d.e-]+) GiB per rank, ([\d.]+) ms per step", planned.log)
    assert chosen, planned.log[-3000:]
    runner_up = re.search(r"planned layout: runner-up: dp\d+ .* predicted [\d.e-]+ GiB per rank, [\d.]+ ms per step",
                          planned.log)
    assert runner_up and int(chosen[1]) > 1
    dp, tp, pp = int(chosen[3]), int(chosen[4]), int(chosen[5])
    assert dp * tp * pp == 4
    assert f"dp={dp}" in planned.log and f"pp={pp}" in planned.log  # the engine's own description of its layout
    hparams = next(planned.root.glob("tb/**/hparams.yaml")).read_text()
    assert "planned/layout" in hparams and f"dp{dp} tp{tp}" in hparams
    reference = launch_cli(tmp_path / "single", cache_dir, [*job(BATCH * dp), *SGD, "--trainer.strategy=auto"],
                           devices=1).check()
    losses, expected = planned.losses(), reference.losses()
    diff = max_rel_diff(losses, expected)
    print(f"planned: dp{dp} tp{tp} pp{pp} z{chosen[6]}, max relative per-step loss difference {diff:.2e}")
    assert len(losses) == STEPS and diff <= PARITY_RTOL
    assert expected[0] - expected[-1] > 0.05  # the loss moves: a wrong gradient would show


# ----------------------------------------------------------------------------------------------------------------------
# a mixture-of-experts model: the plan may choose expert parallel (checkpoints are written under ep)
# ----------------------------------------------------------------------------------------------------------------------
MOE = {"preset": "tiny", "n_layers": 2}
MOE_ARGS = ["--model=lightning_par.examples.MoEGPTLightningModule", *(f"--model.{k}={v}" for k, v in MOE.items())]


def _ep4_budget_gib() -> float:
    """Just the memory the planner predicts for dp4 x ep4 at ZeRO-0 without recompute (SGD, the CLI's 32-token
    sequences): dp4 without ep needs more, recompute would make room for it."""
    from lightning_par.examples import MoEGPTLightningModule
    from lightning_par.planner import Planner, Workload, build_model, inspect_model, load_hardware
    from lightning_par.planner.plan import Candidate

    info = inspect_model(build_model(MoEGPTLightningModule, MOE))
    planner = Planner(info, load_hardware("cpu"), Workload(BATCH, 32, 4 * BATCH), "sgd")
    return planner.estimate(Candidate(4, 1, 1, 0, precision="fp32", ep=4)).worst.total * 1.0001 / 2**30


def test_the_plan_chooses_expert_parallel_where_only_it_fits():
    from lightning_par.examples import MoEGPTLightningModule
    from lightning_par.planner import build_model

    model = build_model(MoEGPTLightningModule, MOE)
    roomy = plan_layouts(model, Budget(4, 4, 8.0), batch=BATCH, seq_len=32, precision="32-true", optimizer="sgd",
                         zero_stages=(0,), recompute=("none",))
    assert roomy.best.candidate.ep == 1  # the exchange costs time: with room, no ep
    tight = plan_layouts(model, Budget(4, 4, _ep4_budget_gib()), batch=BATCH, seq_len=32, precision="32-true",
                         optimizer="sgd", zero_stages=(0,), recompute=("none",))
    assert tight.best.candidate.ep == 4 and tight.best.runs_today and tight.considered > roomy.considered / 2


@pytest.mark.launch(ranks=4, full=True)
def test_planned_expert_parallel_trains_at_parity_with_one_process(tmp_path, cache_dir):
    planned = launch_cli(tmp_path / "planned", cache_dir, [
        *job(BATCH), *SGD, *MOE_ARGS, "--trainer.strategy=planned", "--trainer.strategy.optimizer=sgd",
        "--trainer.strategy.zero_stages=[0]", "--trainer.strategy.recompute=[none]",
        f"--trainer.strategy.gpu_memory={_ep4_budget_gib()}"], devices=4).check()
    assert re.search(r"planned layout \(\d+ estimated, [\d.e-]+ GiB per rank\): chosen: dp4 ep4 tp1 pp1 z0",
                     planned.log), planned.log[-3000:]
    reference = launch_cli(tmp_path / "single", cache_dir, [*job(BATCH * 4), *SGD, *MOE_ARGS,
                                                            "--trainer.strategy=auto"], devices=1).check()
    losses, expected = planned.losses(), reference.losses()
    diff = max_rel_diff(losses, expected)
    print(f"planned dp4 ep4 (MoE): max relative per-step loss difference {diff:.2e}")
    assert len(losses) == STEPS and diff <= PARITY_RTOL
    assert expected[0] - expected[-1] > 0.05
