"""benchmarks/moe_dispatch.py (issue 29): the token exchange's bytes per step against the planner.

In this process (default set): the stored result's planned figures are what the planner computes today, and the
measured bytes are within the routing's imbalance of them. The full set runs the benchmark afresh on 2 ranks (one
launch, about 20 s)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import REPO, launching

sys.path.insert(0, str(REPO))
from benchmarks.moe_dispatch import RESULT, planned  # noqa: E402


def _options(config: dict):
    import argparse

    return argparse.Namespace(**{k: config[k] for k in ("preset", "batch", "seq", "steps", "warmup")})


def _check(rows: list[dict], config: dict) -> None:
    for row in rows:
        plan = planned(row["world"], _options(config))
        sent = row["all_to_all_bytes_per_step"]
        assert sent["planned"] == plan["sent"] and row["layout"] == plan["label"]
        # balanced routing is the estimate; the busiest rank sends within 15% of it
        assert 0.85 < sent["measured"] / sent["planned"] < 1.15, sent
        if row["world"] == 2:  # one rank's dispatch is the other's combine: both send the same
            assert sent["per_rank"][0] == sent["per_rank"][1]
        assert row["active_params"] == 1_152_128 and row["total_params"] == 2_921_600  # the small preset
        assert row["forward_exchange_s"]["measured"] > 0


def test_the_stored_result_matches_the_planner():
    stored = json.loads(RESULT.read_text())
    assert [r["world"] for r in stored["rows"]] == [2, 4]
    _check(stored["rows"], stored["config"])


@pytest.mark.launch(ranks=2, full=True)
def test_a_fresh_run_matches_the_planner(tmp_path):
    out = tmp_path / "moe_dispatch.json"
    launching(2)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe_dispatch.py"), "--worlds", "2", "--steps",
                           "5", "--warmup", "2", "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    _check(result["rows"], result["config"])
