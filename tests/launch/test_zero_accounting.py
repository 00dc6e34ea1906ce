"""Memory and traffic of every ZeRO stage, measured on the parity runs and held to the ZeRO paper's formulas.

Bytes are read per rank right after optimizer step 3 (parameters, gradients, optimizer states, each storage
counted once); traffic is every collective issued during that whole optimizer step, as elements sent per rank.
The dp=4 runs accumulate 2 micro-batches per step: traffic equal to the formula also shows that the non-final
micro-batch communicated nothing.
"""

import pytest

from lightning_par.measure import traffic_formula, zero_formula
from tests.conftest import run_cases

TOLERANCE = 0.05
CASES = [(0, "dp2", 2), (0, "dp4", 4)] + [
    (stage, name, n) for stage in (1, 2, 3) for name, n in ((f"zero{stage}_dp2", 2), (f"zero{stage}_dp4_accum_clip", 4))
]


@pytest.mark.parametrize("stage,name,n", run_cases([(c, c[1]) for c in CASES]), ids=[c[1] for c in CASES])
def test_state_bytes_per_rank_follow_the_zero_formula(runs, stage, name, n):
    reports = runs(name).state_reports()
    assert len(reports) == n
    for report in reports:
        assert report["stage"] == stage and report["dp"] == n
        predicted = zero_formula(stage, report["numel"], n)
        for category in ("parameters", "gradients", "optimizer_states"):
            measured = report["bytes"][category]
            rank = report["global_rank"]
            print(f"{name} rank {rank} {category}: {measured} bytes, formula {predicted[category]:.0f}")
            assert abs(measured / predicted[category] - 1) <= TOLERANCE, (category, measured, predicted[category])


@pytest.mark.parametrize("stage,name,n", run_cases([(c, c[1]) for c in CASES]), ids=[c[1] for c in CASES])
def test_elements_sent_per_step_follow_the_zero_formula(runs, stage, name, n):
    micro_batches = 2 if "accum" in name else 1
    for report in runs(name).state_reports():
        sent = sum(report["sent"].values())
        predicted = traffic_formula(stage, report["numel"], n)
        if stage == 3:
            # ZeRO-3 gathers parameters for every micro-batch's forward and backward; gradients are
            # reduce-scattered once per optimizer step: (2k + 1) Psi (N-1)/N for k micro-batches
            one_pass = report["numel"] * (n - 1) / n
            predicted += 2 * (micro_batches - 1) * one_pass
            assert abs(report["sent"]["reduce_scatter"] / one_pass - 1) <= TOLERANCE
        rank = report["global_rank"]
        print(f"{name} rank {rank}: sent {sent:.0f} elements {report['sent']}, formula {predicted:.0f}")
        assert abs(sent / predicted - 1) <= TOLERANCE
        if stage in (1, 2):
            assert set(k for k, v in report["sent"].items() if v > 1000) == {"reduce_scatter", "all_gather"}
        if stage == 0:
            assert set(k for k, v in report["sent"].items() if v > 1000) == {"all_reduce"}
