"""The example MoE's load-balancing loss inside pipeline schedules, against one process.

Launches of ``tests/launch/router_pipeline_worker.py`` (see its docstring): pp2 (2 ranks) and pp2 x ep2 (4 ranks),
1F1B and ZBV, plain SGD, ``aux_loss_coef=0.1``, scopes ``micro_batch`` and ``global``, in the full set. The default
set runs one 4-rank case (pp2 x ep2, ZBV, global scope: the split backward and the statistics summed over the
data-parallel ranks) inside tests/launch/test_expert_pipeline.py's default launch, checked there with
:func:`check_parity` and :func:`check_wrong_scale`.
"""

from __future__ import annotations

import pytest

from tests.harness import launch_reports, max_rel_diff
from tests.launch.router_pipeline_worker import CASES, STEPS

PARITY_RTOL = 1e-5  # per-step loss and pre-step global gradient norm against one process
WRONG_SCALE = 1e-3  # a load-balancing loss scaled by 1/2 or 2 moves the gradient norm and the loss more than this
DEFAULT = "pp2_ep2_zbv_global"  # (in tests/launch/test_expert_pipeline.py's default launch)
FOUR = tuple(c for c in CASES if CASES[c]["ep"] == 2 and c not in DEFAULT)
TWO = tuple(c for c in CASES if CASES[c]["ep"] == 1)


def _launch(tmp_path_factory, cache_dir, ranks: int, cases: tuple[str, ...]) -> list[dict]:
    root = tmp_path_factory.mktemp(f"router_pipeline_{ranks}")
    return launch_reports(root, cache_dir, "tests.launch.router_pipeline_worker", cases, ranks)


@pytest.fixture(scope="module")
def four(tmp_path_factory, cache_dir) -> list[dict]:
    return _launch(tmp_path_factory, cache_dir, 4, FOUR)


@pytest.fixture(scope="module")
def two(tmp_path_factory, cache_dir) -> list[dict]:
    return _launch(tmp_path_factory, cache_dir, 2, TWO)


LAUNCHES = [pytest.param("four", FOUR, marks=pytest.mark.launch(ranks=4, full=True), id="pp2_ep2"),
            pytest.param("two", TWO, marks=pytest.mark.launch(ranks=2, full=True), id="pp2")]


def check_parity(ranks: list[dict], cases: tuple[str, ...]) -> None:
    """Every rank's per-step loss and pre-step gradient norm within ``PARITY_RTOL`` of one process's."""
    for case in cases:
        reference = ranks[0][case]["reference"]
        for report in ranks:
            run = report[case]
            loss_diff = max_rel_diff(run["losses"], reference["losses"])
            norm_diff = max_rel_diff(run["norms"], reference["norms"])
            print(f"{case} rank {report['rank']}: loss {loss_diff:.2e}, gradient norm {norm_diff:.2e} (max relative "
                  f"over {len(run['losses'])} steps)")
            assert len(run["losses"]) == len(reference["losses"]) == STEPS
            assert loss_diff <= PARITY_RTOL and norm_diff <= PARITY_RTOL, case
            # the log says so: each rank holds 2 of the 4 layers
            assert "the load-balancing losses of 2 router layers started from their outputs" in run["described"]
        assert reference["losses"][-1] < reference["losses"][0] - 0.3, case  # it trains: not a flat line's parity


def check_wrong_scale(ranks: list[dict], cases: tuple[str, ...]) -> None:
    """The parity sees the load-balancing loss's scale: one process with it halved or doubled is far from the run
    (the gradient norms of the first two steps, the second step's loss)."""
    for case in cases:
        run = ranks[0][case]
        for wrong in ("halved", "doubled"):
            norm_diff = max_rel_diff(run["norms"][:2], run[wrong]["norms"])
            loss_diff = abs(run["losses"][1] / run[wrong]["losses"][1] - 1)
            print(f"{case} against {wrong}: gradient norm {norm_diff:.2e}, second loss {loss_diff:.2e}")
            assert norm_diff > WRONG_SCALE and loss_diff > WRONG_SCALE, (case, wrong)


@pytest.mark.parametrize("launch,cases", LAUNCHES)
def test_each_micro_batchs_load_balancing_loss_trains_its_stages_routers_as_one_process(request, launch, cases):
    check_parity(request.getfixturevalue(launch), cases)


@pytest.mark.parametrize("launch,cases", LAUNCHES)
def test_a_halved_or_doubled_load_balancing_loss_would_fail_the_parity(request, launch, cases):
    check_wrong_scale(request.getfixturevalue(launch), cases)
