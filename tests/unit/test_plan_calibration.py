"""The planner's calibration from measured GPU steps, its validation on published rows, and the bands ``plan``
prints (issue 44): ``benchmarks/planner_fit.py`` reproduces the committed constants from the held JSON lines, with
its held-out errors; ``benchmarks/plan_accuracy.py`` plans every published row; ``lightning-par plan`` prints each
row's band and says when a run is outside anything measured. In this process, no launch (about 50 s in all)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from lightning_par.cli import main
from lightning_par.planner import hardware
from lightning_par.planner.hardware import BASE_PRESETS, CALIBRATION_FILE, PRESETS, calibrated
from tests.harness import REPO

sys.path.insert(0, str(REPO))

COMMITTED = json.loads(CALIBRATION_FILE.read_text())


@pytest.fixture(scope="module")
def fit_result():
    from benchmarks.planner_fit import run

    return run()


def test_the_fit_reproduces_the_committed_constants(fit_result):
    """Fitted again from benchmarks/results/gpu_*.jsonl: the same constants and per-device attention efficiencies
    as calibration.json, from the same runs; the errors on the runs each fit held out (fit on the H200, predict
    the H100, and the reverse) within 5% median and 10% worst, where the uncalibrated presets were a third off."""
    from benchmarks.planner_fit import calibration_file

    new = calibration_file(fit_result)
    assert new["constants"] == COMMITTED["constants"]
    assert new["devices"] == COMMITTED["devices"]
    assert new["bands"] == COMMITTED["bands"]
    assert fit_result["rows"] == 18 and set(fit_result["runs"]) == {
        "ec93a0867d05", "7792e2e311a6", "17dcea9aee6d", "0a469ff172f3", "bae1f923d0c5"}
    held = fit_result["heldout"]
    assert held["n"] == 18 and held["median"] <= 0.05 and held["worst"] <= 0.105, held
    assert fit_result["uncalibrated"]["summary"]["median"] > 0.25  # the A100-fitted presets: 1.32-1.52x
    for fold in fit_result["folds"]:  # calibration and validation apart: no held-out run among the fitted ones
        assert not set(fold["fit_runs"]) & set(fold["heldout_runs"])
        assert fold["validate_on"] not in fold["fit_on"]
    # physical ranges: a step's GEMMs no faster than the best isolated matmul measured, fusion a share
    c = COMMITTED["constants"]
    for device, d in COMMITTED["devices"].items():
        assert BASE_PRESETS[device].efficiency(None) * c["matmul_scale"] <= d["matmul_efficiency_isolated"]
        assert 0.4 < d["attention_efficiency"] < 0.8
    assert 0.0 <= c["fusion"] <= 1.0


def test_the_gpu_presets_are_the_calibrated_ones():
    """h100-sxm and h200 carry the committed constants; the datasheet-only presets stay as they were (a100, cpu
    untouched: no attention efficiency, ideal fusion)."""
    c = COMMITTED["constants"]
    for name in ("h100-sxm", "h200"):
        hw, base = PRESETS[name], BASE_PRESETS[name]
        assert hw.attention_efficiency == COMMITTED["devices"][name]["attention_efficiency"]
        assert hw.fusion == c["fusion"] and base.fusion == 1.0 and base.attention_efficiency == 0.0
        assert hw.efficiency(None) == pytest.approx(base.efficiency(None) * c["matmul_scale"])
        assert hw.memory_bandwidth == base.memory_bandwidth  # the datasheet's HBM: what tells the two apart
        assert hw == calibrated(base, c, COMMITTED["devices"][name])
    for name in ("a100", "cpu"):
        assert PRESETS[name] == BASE_PRESETS[name]
    assert hardware._calibrate(BASE_PRESETS, None) == BASE_PRESETS  # no file: the datasheets'


def test_a_causal_attention_kernel_computes_half_its_counted_square(tiny_info):
    """The trace marks SDPA's kernels, forward and backward, with the share of the counted FLOPs they compute: half
    under the example GPT's causal mask. With an attention efficiency, they cost that share at that rate."""
    from dataclasses import replace

    from lightning_par.planner.trace import trace_model

    trace = trace_model(tiny_info, 1, False, "none", "bf16-mixed", 2, 64)
    block = trace.units[tiny_info.blocks[0]]
    shares = [a for ops in (block.forward, block.backward) for a in ops.attention if a]
    assert shares == [0.5, 0.5]
    fwd = block.forward
    i = next(k for k, a in enumerate(fwd.attention) if a)
    hw = replace(PRESETS["h100-sxm"], op_overhead_s=0.0)
    alone = type(fwd)()
    alone.add(fwd.flops[i], 0.0, True, False, False, fwd.intensity[i], fwd.attention[i])
    assert alone.time(hw) == pytest.approx(fwd.flops[i] * 0.5 / (989e12 * hw.attention_efficiency))


@pytest.fixture(scope="module")
def tiny_info():
    from lightning_par.examples import GPTLightningModule
    from lightning_par.planner import build_model, inspect_model

    return inspect_model(build_model(GPTLightningModule, {"preset": "tiny"}))


def test_every_published_row_is_planned():
    """Each row of benchmarks/data/published_throughput.json is planned (none dropped), with its source, a finite
    prediction and error; an fp8 row names fp8 among what is not modelled; the committed docs/plan-accuracy.md and
    accuracy.json are what the script writes now."""
    from benchmarks.plan_accuracy import BANDS, DATA, DOC, markdown, run

    data = json.loads((REPO / DATA).read_text())
    result = run()
    assert [r["id"] for r in result["rows"]] == [r["id"] for r in data["rows"]] and len(result["rows"]) >= 25
    for r in result["rows"]:
        assert r["source"].startswith("https://") and math.isfinite(r["error"]) and r["predicted_step_s"] > 0
        assert r["precision"].startswith("fp8") == any(n.startswith("fp8") for n in r["not_modelled"])
    assert (REPO / DOC).read_text() == markdown(result)
    committed = json.loads((REPO / BANDS).read_text())["bands"]
    assert committed == {d: {f: {k: round(v, 4) if isinstance(v, float) else v for k, v in b.items()}
                             for f, b in fams.items()} for d, fams in result["bands"].items()}
    # async TP (the planner's tp overlap) is faster than vanilla TP, as published
    by_id = {r["id"]: r for r in result["rows"]}
    for size in ("70b-fsdp32", "8b-fsdp8"):
        assert by_id[f"torchtitan-{size}-tp8-async-bf16"]["predicted_tokens_per_s_per_gpu"] > \
            by_id[f"torchtitan-{size}-tp8-vanilla-bf16"]["predicted_tokens_per_s_per_gpu"]


def _plan(capsys, *args: str) -> str:
    main(["plan", "--model=lightning_par.examples.GPTLightningModule", "--model.preset=tiny", "--seq", "64",
          "--recompute", "none", *args])
    return capsys.readouterr().out


def test_plan_prints_the_band_of_each_row(capsys):
    """One H100, bf16-mixed: the held-out band of the measured steps (step and memory), as calibration.json holds
    it; a pipeline on two H100s: outside anything measured; the cpu preset: its side-by-side band."""
    bands = COMMITTED["bands"]["h100-sxm"]
    out = _plan(capsys, "--layout", "dp=1,tp=1,pp=1,zero=0,precision=bf16-mixed", "--hardware", "h100-sxm")
    step, mem = bands["step"], bands["memory"]
    assert f"step time within {step['median']:.0%} (median), {step['worst']:.0%} (worst)" in out
    assert f"memory within {mem['median']:.0%} (median), {mem['worst']:.0%} (worst)" in out
    assert f"(+-{step['median']:.0%} median, +-{step['worst']:.0%} worst)" in out  # the fastest's step time
    header = next(line for line in out.splitlines() if line.lstrip().startswith("#"))
    assert header.split()[-1] == "band"

    out = _plan(capsys, "--layout", "dp=1,tp=1,pp=2,zero=0,precision=bf16-mixed,schedule=1f1b",
                "--hardware", "h100-sxm", "--global-batch", "4")
    assert "outside anything measured" in out and "no GPU run of this layout was measured" in out

    out = _plan(capsys, "--layout", "dp=2,tp=1,pp=1,zero=0,precision=fp32", "--hardware", "cpu")
    cpu = COMMITTED["cpu"]
    assert f"step time within {cpu['median']:.0%} (median), {cpu['worst']:.0%} (worst)" in out
    assert "work ratios between 4 layouts" in out


def test_datasheet_presets_agree_with_the_gpu_table():
    """h100-pcie and b200: the peaks of the GPU table (GPUS, what train/mfu divides by), their datasheets' memory
    bandwidth at the presets' 80%, uncalibrated; plan says they are outside anything measured."""
    from lightning_par.planner.bands import band_for
    from lightning_par.planner.hardware import GPUS

    for name, spec, bandwidth in (("h100-pcie", "h100-pcie", 2.0e12), ("b200", "b200", 8.0e12)):
        hw = PRESETS[name]
        assert hw.peak_flops["bf16"] == GPUS[spec].peak_flops["bf16"]
        assert hw.peak_flops["fp32"] == GPUS[spec].peak_flops["fp32"]
        assert hw.memory_bandwidth == pytest.approx(0.8 * bandwidth)
        assert hw.attention_efficiency == 0.0 and hw.fusion == 1.0
        band = band_for(name, 1, 1, 1, 1, "bf16-mixed")
        assert band.step is None and not band.measured and "outside anything measured" in band.describe()
    assert PRESETS["b200"].peak_flops["bf16"] / PRESETS["h200"].peak_flops["bf16"] == pytest.approx(2.275, rel=1e-3)
    assert PRESETS["h100-pcie"].intra_node_bandwidth < PRESETS["h100-sxm"].intra_node_bandwidth
