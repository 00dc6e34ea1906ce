"""benchmarks/peers.py: lightning-par beside Lightning's own strategies on the same job (DDP / ZeRO-0, FSDP2 /
ZeRO-3, FSDP2 without resharding after forward / ZeRO-2, a user's TP plan / MegatronTPStrategy).

The default set checks the benchmark's arithmetic; the full set runs it (the 8 variants of a tiny GPT one after another
in one two-rank launch) and asserts that each pair trains to the same per-step losses from the same weights, and
the state bytes each strategy holds (exact: they do not depend on the machine's load)."""

from __future__ import annotations

import json

import pytest

from benchmarks import peers


def _run(step_seconds: list[float], losses: list[list[float]]) -> dict:
    ranks = [{"seconds_per_step": step_seconds, "cpu_seconds_per_step": step_seconds,
              "phase_cpu_seconds": {p: [0.01] * len(step_seconds) for p in peers.PHASES},
              "losses": rank_losses, "state_bytes": {"total": 100, "parameters": 25, "gradients": 25,
                                                     "optimizer_states": 50},
              "rss_before_fit_bytes": 10, "peak_rss_bytes": 30, "numel": 5} for rank_losses in losses]
    return {"ok": True, "ranks": ranks, "seconds": 1.0}


def test_ratios_are_paired_within_rounds_and_losses_compared_rank_by_rank():
    """Round 0: ours 2x the peer; round 1: ours 1x: the ratio is the median of the per-round ratios (1.5), not the
    ratio of the overall medians; the loss difference is the largest over steps and ranks."""
    runs = {"ddp": [_run([1.0, 1.0, 1.0], [[5.0, 4.0], [5.1, 4.1]]), _run([2.0, 2.0, 2.0], [[5.0, 4.0], [5.1, 4.1]])],
            "zero0": [_run([2.0, 2.0, 2.0], [[5.0, 4.0], [5.1, 4.1]]),
                      _run([2.0, 2.0, 2.0], [[5.0, 4.0], [5.1, 4.1 + 3e-3]])]}
    row = peers.summarise("dp", runs)
    assert row["ok"] and row["step_time_ratio_by_round"] == [2.0, 1.0]
    assert row["step_time_ratio"] == pytest.approx(1.5)
    assert row["max_loss_difference"] == pytest.approx(3e-3)
    assert row["state_bytes_ratio"] == 1.0 and row["rss_growth_ratio"] == 1.0
    with pytest.raises(AssertionError, match="different steps"):
        peers.max_loss_difference([[1.0, 2.0]], [[1.0]])
    runs["zero0"][1] = {"ok": False, "error": "boom", "seconds": 1.0}
    failed = peers.summarise("dp", runs)
    assert not failed["ok"] and "zero0: boom" in failed["error"]


@pytest.mark.launch(ranks=2, full=True)
def test_every_pair_trains_alike_and_holds_the_bytes_its_stage_says(tmp_path):
    """Tiny GPT, 2 ranks, 4 steps, one round: per-step losses of each pair within ``LOSS_TOLERANCE`` (same weights,
    same batches: DDP and ZeRO-0 both all-reduce, FSDP2 and ZeRO-3 are the same FSDP2, the hand TP plan and the
    engine's the same Megatron split); state bytes ours / Lightning's: 1 for ZeRO-0, ZeRO-3 and TP, and 10/8 for
    ZeRO-2 (full parameters 4 + gradient and Adam shards 2 + 4 bytes per parameter, where FSDP2 without resharding
    after forward holds its parameters sharded between steps: 2 + 2 + 4)."""
    out = tmp_path / "peers.json"
    result = peers.main(["--preset", "tiny", "--n-layers", "2", "--batch", "4", "--seq", "32", "--warmup", "1",
                         "--steps", "3", "--rounds", "1", "--one-launch", "--json", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    rows = {r["pair"]: r for r in result["rows"]}
    assert set(rows) == set(peers.PAIRS)
    for pair, row in rows.items():
        assert row["ok"], (pair, row.get("error"))
        steps = len(row["our_result"]["losses"][0])
        assert steps == 1 + 3 + 1, (pair, row["our_result"]["losses"])
        assert row["max_loss_difference"] <= peers.LOSS_TOLERANCE, (pair, row["max_loss_difference"])
        assert row["step_time_ratio"] > 0 and row["rss_growth_ratio"] > 0
    for pair in ("dp", "zero3", "tp"):
        assert rows[pair]["state_bytes_ratio"] == pytest.approx(1.0, abs=0.01), rows[pair]["state_bytes_ratio"]
    assert rows["zero2"]["state_bytes_ratio"] == pytest.approx(10 / 8, abs=0.01)
