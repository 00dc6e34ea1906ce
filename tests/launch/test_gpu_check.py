"""benchmarks/gpu_check.py rehearsed on the CPU (tiny preset): every stage runs and its figures hold.

One run of all six stages (about a minute of CPU, each stage its own process), read back from its JSON lines. The GPU
run of docs/gpu.md is the same script with ``--device cuda --preset 1b``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import launching

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.launch(ranks=1, full=True)  # the GPU check's CPU rehearsal, ~90 s (docs/gpu.md)
STAGES = ["env", "lightning", "zero", "offload", "checkpoint", "planner"]


@pytest.fixture(scope="module")
def lines(tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu_check.jsonl"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    launching(1)
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--device", "cpu",
                           "--preset", "tiny", "--out", str(out)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)
    print(proc.stdout, proc.stderr)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["stage"] for r in rows] == STAGES
    assert len({r["run_id"] for r in rows}) == 1
    return {r["stage"]: r for r in rows}


def _ok(line: dict) -> dict:
    assert line["ok"], line["error"]
    assert line["seconds"] > 0
    return line["figures"]


def _finite(values) -> bool:
    return len(values) > 0 and all(math.isfinite(v) for v in values)


def test_env(lines):
    f = _ok(lines["env"])
    assert f["torch"] and f["device_name"] == "cpu" and f["process_group_backend"] == "gloo"
    assert f["bf16_matmul_tflops"] > 0
    assert f["sdpa_backends"]["math"]["ok"]  # the math kernel takes any input
    assert any("scaled_dot_product" in op for op in f["sdpa_default_ops"])
    assert f["sdpa_default_seconds"] > 0 and f["cp_seconds"] > 0
    # the context-parallel attention on one rank is plain SDPA with a causal boolean mask: fp32 agrees closely
    assert f["cp_rel_diff_out"] < 1e-5 and f["cp_rel_diff_grads"] < 1e-5


def test_plain_vs_lightning(lines):
    f = _ok(lines["lightning"])
    assert f["params"] == 131392 and f["tokens_per_step"] == 4 * 128 and f["flops_per_token"] > 6 * f["params"]
    for key in ("plain_eager", "lightning_eager", "plain_compiled", "lightning_compiled"):
        row = f[key]
        assert row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1 and row["peak_rss_bytes"] > 0
        assert _finite(row["losses"]) and len(row["losses"]) == f["warmup_steps"] + f["timed_steps"]
        assert row["last_loss"] < row["first_loss"] - 0.1  # AdamW on one repeated sequence: the loss falls
    for mode in ("eager", "compiled"):
        assert f[f"lightning_over_plain_{mode}"] > 0
        # same seed, same data, same ops: the Lightning run's losses are the plain loop's
        assert f[f"lightning_{mode}"]["losses"] == pytest.approx(f[f"plain_{mode}"]["losses"], abs=1e-5)


def test_zero_and_deferred_init(lines):
    f = _ok(lines["zero"])
    for key in ("zero1", "zero2", "zero3", "master_zero1", "master_zero2", "master_zero3"):
        assert f[key]["finite"] and _finite(f[key]["losses"]) and f[key]["step_s"] > 0
    for key in ("zero2", "zero3"):  # fp32: one model, one data, three owners of the gradients
        assert f[key]["losses"] == pytest.approx(f["zero1"]["losses"], abs=1e-5)
    for key in ("master_zero1", "master_zero2", "master_zero3"):  # bf16 compute: close, not equal
        assert f[key]["first_loss_diff_vs_zero1"] < 0.05
    d = f["deferred_init"]
    assert d["deferred_tensors"] > 0 and d["deferred_mismatched"] == 0 and d["deferred_max_abs_diff"] == 0
    assert d["largest_tensor_bytes"] > 0 and d["model_bytes"] >= d["largest_tensor_bytes"]


def test_offload_exact(lines):
    f = _ok(lines["offload"])
    assert f["sgd_moved_loss"] > 0  # the weights moved, so equal weights mean equal steps
    for stage in (1, 2):
        assert f[f"zero{stage}_offload_max_abs_diff"] <= f["tolerance"]
    assert f["zero3_offload_max_abs_diff"] <= f["tolerance"]  # FSDP2 offload (it pinned host memory on CPU before)
    for key in ("zero1_offload", "zero2_offload"):
        assert f[key]["losses"] == f[key.removesuffix("_offload")]["losses"]


def test_checkpoint_stall(lines):
    f = _ok(lines["checkpoint"])
    for mode in ("sync", "async"):
        assert f[mode]["blocking_s"] > 0 and f[mode]["bytes_saved"] > 0 and f[mode]["baseline_step_s"] > 0
    assert f["async_over_sync_blocking"] > 0


def test_planner_beside_measured(lines):
    f = _ok(lines["planner"])
    assert f["hardware"] == "cpu"
    assert {"zero0_eager", "zero0_compiled", "zero1", "zero2", "zero3"} <= set(f["rows"])
    for row in f["rows"].values():
        assert row["predicted_step_s"] > 0 and math.isfinite(row["predicted_over_measured"])
        assert row["predicted_over_measured"] > 0
