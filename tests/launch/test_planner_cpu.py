"""The planner's ``cpu`` preset against the side-by-side benchmark measured on this machine.

``benchmarks/side_by_side.py`` trains the five layouts (dp, ZeRO-3, tp, pp, 3D) of the same GPT on 4 CPU ranks
and stores, per layout, the median CPU seconds per step summed over the ranks -- the work. The planner predicts each
layout's busy seconds per rank (``Estimate.busy``: its step time less the pipeline's idle share, plus the pipeline
receives); all five layouts have 4 ranks, so its ratio to dp's is the predicted work ratio.
Wall time is not held to the planner: the 4 ranks share 2 cores with whatever else runs, and its ratios moved by
up to 50% between two runs (docs/plan.md, "predicted vs measured on this machine").
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.harness import REPO, launching

sys.path.insert(0, str(REPO))
from benchmarks.side_by_side import LAYOUTS, predict  # noqa: E402

STORED = REPO / "benchmarks" / "results" / "side_by_side.json"
#: the predicted work ratio of each layout to dp's within this fraction of the stored measurement's
STORED_TOLERANCE = 0.20
#: ... and of a fresh short run's: see test_a_fresh_run_of_the_benchmark_agrees_with_the_planner
FRESH_TOLERANCE = 0.40


def _compare(result: dict, tolerance: float) -> None:
    pred = predict(result["preset"], result["n_layers"], result["n_kv_heads"], result["batch"], result["seq"])
    rows = {r["layout"]: r for r in result["rows"]}
    assert set(rows) == set(LAYOUTS) and all(r["ok"] for r in rows.values()), "every layout measured"
    errors = {name: pred[name]["work_ratio_vs_dp"] / rows[name]["ratios_vs_dp"]["cpu_time"] - 1 for name in LAYOUTS}
    table = "; ".join(f"{n}: predicted {pred[n]['work_ratio_vs_dp']:.2f}, measured "
                      f"{rows[n]['ratios_vs_dp']['cpu_time']:.2f} ({errors[n]:+.0%})" for n in LAYOUTS)
    assert all(abs(e) <= tolerance for e in errors.values()), table


def test_the_cpu_preset_predicts_the_stored_side_by_side_ratios():
    """The planner's work ratios (to dp) of the five layouts within 20% of the stored run's.

    The measurement is a stored run, ``benchmarks/results/side_by_side.json`` (5 layouts x 8 timed steps, one
    round, on this 2-core machine); the planner is run here, so the test fails when the planner changes. Refresh
    the measurement with ``python benchmarks/side_by_side.py`` (about 3-5 minutes; it also writes the planner's
    predictions beside each row), or only the stored predictions with ``--predict-only``.
    """
    _compare(json.loads(STORED.read_text()), STORED_TOLERANCE)


@pytest.mark.launch(ranks=4, full=True)  # the benchmark's 5 layouts
def test_a_fresh_run_of_the_benchmark_agrees_with_the_planner(tmp_path):
    """A short fresh run (5 layouts in one launch, 3 timed steps after 2, one round: about 35 s) against the planner,
    within 40% per layout: two full runs of the benchmark on this shared machine (load 26 and 7.5) gave CPU ratios
    that differ by 17% (ZeRO-3), 33% (tp), 32% (pp) and 36% (3D), and the planner is -18%, -33%, -15% and -26% from
    the loaded one; one short run at load 7 came within +13%, -1%, -3% and +4%. Full run only (``pytest --full``)."""
    import subprocess

    out = tmp_path / "side_by_side.json"
    launching(4)  # the benchmark's own launch of its layouts
    subprocess.run([sys.executable, str(REPO / "benchmarks" / "side_by_side.py"), "--steps", "3", "--warmup", "2",
                    "--one-launch", "--json", str(out)], cwd=REPO, check=True, timeout=1200)
    _compare(json.loads(out.read_text()), FRESH_TOLERANCE)
