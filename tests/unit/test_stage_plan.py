"""StagePlan (checked once, when built) and the runner interface pp = 1 shares with the pipeline runtime."""

import pytest

from lightning_par.parallel.layout import Layout
from lightning_par.parallel.pipeline.runtime import PipelineRuntime
from lightning_par.parallel.runners import SingleRunner
from lightning_par.parallel.stage_plan import SCHEDULES, StagePlan
from lightning_par.topology import LayoutError


def test_layout_builds_its_plan_once():
    assert Layout().stage_plan == StagePlan.single() == StagePlan(1, 1, "loop", None, 1)
    plan = Layout(pp=2, schedule="zbv").stage_plan
    assert (plan.pp, plan.virtual_stages, plan.style, plan.schedule, plan.n_microbatches) == (2, 2, "v", "zbv", 4)
    assert plan.spec is SCHEDULES["zbv"] and plan.n_stages == 4
    assert Layout(pp=1, schedule="zbv", virtual_stages=3).stage_plan == StagePlan.single(), "pp = 1: no schedule"


@pytest.mark.parametrize(("pp", "v", "style"), [(1, 1, "loop"), (4, 1, "loop"), (3, 4, "loop"), (5, 2, "v"),
                                                (3, 6, "v")])
def test_stages_of_and_rank_of_are_inverse(pp, v, style):
    plan = StagePlan(pp, v, style)
    held = [plan.stages_of(r) for r in range(pp)]
    assert sorted(s for stages in held for s in stages) == list(range(pp * v)), "every stage on exactly one rank"
    assert all(plan.rank_of(s) == r for r, stages in enumerate(held) for s in stages)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(pp=0), r"pp=0 is not valid: use a positive integer"),
    (dict(style="zigzag"), r"unknown stage style 'zigzag'"),
    (dict(pp=2, virtual_stages=3, style="v"), r"style='v' needs an even virtual_stages"),
    (dict(pp=2, virtual_stages=2, style="loop", schedule="zbv", n_microbatches=4),
     r"schedule 'zbv' places its stages in style 'v', got style='loop'"),
    (dict(pp=2, virtual_stages=1, schedule="1f1b", n_microbatches=1), r"1f1b needs at least as many micro-batches"),
])
def test_a_plan_that_exists_is_valid(kwargs, message):
    with pytest.raises(LayoutError, match=message):
        StagePlan(**kwargs)


def test_single_runner_answers_the_pipeline_hooks():
    runner = SingleRunner()
    assert not runner.takes_over_step and PipelineRuntime.takes_over_step
    assert runner.group is None and runner.counted_elsewhere() == set() and runner.plan == StagePlan.single()
    runner.make_tied_copies_equal()
    runner.sum_tied_gradients()
    assert "one stage" in runner.stage_table()
    with pytest.raises(RuntimeError, match="Lightning's loop runs the step"):
        runner.train_step(None, None)
