"""Expert parallel inside every pipeline schedule (pp2 x ep2) on the example MoE GPT, against one process.

Launches of ``tests/launch/expert_pipeline_worker.py`` (see its docstring): on 4 ranks (pp2 x dp2, each stage's
experts over ep2 of its data-parallel ranks) plain SGD under 1F1B and ZBV, the example MoE's load-balancing loss
inside ZBV (global scope; tests/launch/test_router_pipeline.py's case, checked with its functions), then the refusal
of a dense model in the default set; the other cases (AdamW, GPipe, interleaved 1F1B, looped BFS, interleaved
zero bubble, DualPipeV, ZeRO-1/2/3, accumulated batches, a validation before the fit, cp2 x pp2 x ep2) in a second
launch, and dp2 x tp2 x pp2 with ep2 under ZeRO-1 on 8 ranks, in the full run. The tests read every rank's report.
"""

from __future__ import annotations

import pytest

from tests.harness import launch_reports, max_rel_diff
from tests.launch.expert_pipeline_worker import CASES, PER_RANK, REFUSALS, STEPS
from tests.launch.test_router_pipeline import DEFAULT as BALANCED
from tests.launch.test_router_pipeline import check_parity, check_wrong_scale

PARITY_RTOL = 1e-5  # per-step loss against one process
NORM_RTOL = 1e-5  # the pre-step global gradient norm: each expert counted once, over both stages
EP, LAYERS = 2, 4
DEFAULT = ("zbv_sgd",)  # the default set: ZBV (1F1B with the others, in the full set: the default set's budget)
OTHERS = tuple(c for c in CASES if c not in DEFAULT and CASES[c].get("world", 4) == 4)
EIGHT = tuple(c for c in CASES if CASES[c].get("world") == 8)
#: the other weights' gradient owner (the deferring ZeRO-0 one unless named)
OWNER = {"zero1_adamw": "zero1", "zero2_sgd": "zero2", "zero3_adamw": "fsdp2_shard_stages", "tp2_zero1": "zero1"}
#: one stage's expert bytes: its 2 of the 4 layers x 3 weights of 4 experts x 64 x 96, fp32
STAGE_EXPERT_BYTES = 2 * 3 * 4 * 64 * 96 * 4


def _launch(tmp_path_factory, cache_dir, ranks: int, cases: tuple[str, ...]) -> list[dict]:
    root = tmp_path_factory.mktemp(f"expert_pipeline_{ranks}")
    return launch_reports(root, cache_dir, "tests.launch.expert_pipeline_worker", cases, ranks)


@pytest.fixture(scope="module")
def default(tmp_path_factory, cache_dir) -> list[dict]:
    return _launch(tmp_path_factory, cache_dir, 4, (*DEFAULT, BALANCED, *REFUSALS))  # (the refusals after the fits)


@pytest.fixture(scope="module")
def others(tmp_path_factory, cache_dir) -> list[dict]:
    return _launch(tmp_path_factory, cache_dir, 4, OTHERS)


@pytest.fixture(scope="module")
def eight(tmp_path_factory, cache_dir) -> list[dict]:
    return _launch(tmp_path_factory, cache_dir, 8, EIGHT)


LAUNCHES = [pytest.param("default", DEFAULT, marks=pytest.mark.launch(ranks=4), id="default"),
            pytest.param("others", OTHERS, marks=pytest.mark.launch(ranks=4, full=True), id="others"),
            pytest.param("eight", EIGHT, marks=pytest.mark.launch(ranks=8, full=True), id="eight")]


@pytest.mark.parametrize("launch,cases", LAUNCHES)
def test_losses_and_gradient_norms_match_one_process_under_every_schedule(request, launch, cases):
    ranks = request.getfixturevalue(launch)
    for case in cases:
        reference = ranks[0][case]["reference"]
        for report in ranks:
            run = report[case]
            loss_diff = max_rel_diff(run["losses"], reference["losses"])
            norm_diff = max_rel_diff(run["norms"], reference["norms"])
            print(f"{case} rank {report['rank']}: loss {loss_diff:.2e}, gradient norm {norm_diff:.2e} (max relative "
                  f"over {len(run['losses'])} steps)")
            assert len(run["losses"]) == len(reference["losses"]) == STEPS
            assert loss_diff <= PARITY_RTOL and norm_diff <= NORM_RTOL, case
        assert reference["losses"][-1] < reference["losses"][0] - 0.3, case  # it trains: not a flat line's parity
        if "validation_loss" in reference:  # the forward-only passes of trainer.validate, before the fit
            diff = max(abs(r[case]["validation_loss"] / reference["validation_loss"] - 1) for r in ranks)
            print(f"{case}: validation loss {diff:.2e} (max relative over the ranks)")
            assert diff <= PARITY_RTOL, case


@pytest.mark.parametrize("launch,cases", LAUNCHES)
def test_each_rank_holds_and_steps_one_ep_th_of_its_stages_experts(request, launch, cases):
    ranks = request.getfixturevalue(launch)
    for case in cases:
        held = [report[case] for report in ranks]
        for report in held:
            assert report["expert_bytes_total"] == STAGE_EXPERT_BYTES, (case, report)
            assert report["expert_bytes"] * EP == STAGE_EXPERT_BYTES, (case, report)
            # AdamW's two moments of its experts; SGD keeps none
            assert report["expert_state_bytes"] == (2 * report["expert_bytes"] if "adamw" in case else 0), case
            assert report["slices_match"]  # its experts' rows of the weights one process drew
            assert report["gradient_sync"] == OWNER.get(case, "pipeline_allreduce"), case
            assert len(report["expert_names"]) == 2 * 3  # its stages' 2 expert layers
            # built deferred: it materialised its experts and its stages' other weights, never another's
            assert report["expert_bytes"] <= report["materialized"] <= report["expert_bytes"] + report["other_bytes"]
        # the two pipeline ranks hold the 4 layers' experts between them, each layer's split over ep
        layers = {name.split(".mlp.")[0] for report in held for name in report["expert_names"]}
        assert layers == {f"model.layers.{i}" for i in range(LAYERS)}, (case, layers)


@pytest.mark.parametrize("launch,cases", LAUNCHES)
def test_the_ranks_of_an_ep_group_exchange_tokens_in_the_same_order(request, launch, cases):
    ranks = request.getfixturevalue(launch)
    for case in cases:
        held = {report["rank"]: report[case] for report in ranks}
        for rank, report in held.items():
            log = report["exchanges"]
            # one batch of micro-batches: each of the rank's 2 expert layers exchanges once forward, once backward
            micro = PER_RANK // CASES[case].get("accumulate", 1)
            assert sorted(set(log)) == sorted({f"{d} {n.removesuffix('.w_gate')}" for d in "FB"
                                               for n in report["expert_names"] if n.endswith(".w_gate")}), case
            assert all(log.count(entry) == micro for entry in set(log)), (case, log)
            for other in report["ep_group"]:
                assert held[other]["exchanges"] == log, (case, rank, other)


@pytest.mark.launch(ranks=4)
def test_the_load_balancing_loss_trains_inside_zbv_as_one_process(default):
    check_parity(default, (BALANCED,))
    check_wrong_scale(default, (BALANCED,))


@pytest.mark.launch(ranks=4)
@pytest.mark.parametrize("name", REFUSALS)
def test_what_cannot_run_under_pp_with_ep_is_refused_on_every_rank(default, name):
    errors = default[0]["refused"][name]
    assert len(errors) == 4 and len(set(errors)) == 1, errors  # every rank, alike (before any collective)
    assert errors[0].startswith("LayoutError: ") and REFUSALS[name][1] in errors[0], errors[0]
    assert "[chained" not in errors[0]  # one clear error
