"""Fit the planner's GPU constants to measured steps, and say how well they hold on the runs a fit did not see.

Reads the JSON lines of the GPU check (``benchmarks/gpu_check.py``, docs/gpu.md): every Lightning step it timed --
the ``lightning`` stage's ZeRO-0 step, eager and compiled, and the ``zero`` stage's ZeRO-1/2/3 and
``bf16-mixed-master`` steps -- with the run's ``env`` figures (an 8192^3 bf16 matmul, causal GQA SDPA at T=8192).
Each step is planned as measured (the example GPT's preset, its batch and sequence, dp = tp = pp = 1, the ZeRO stage,
the precision, ``Runtime(compiled=...)``) on the preset of the device the run named.

The constants, few and physical (:func:`lightning_par.planner.hardware.calibrated`):

- ``attention_efficiency`` per device, **measured, not fitted**: the env stage's SDPA rate over the bf16 peak. The
  kernel computes half of the square under the causal mask, which the trace now counts
  (:func:`lightning_par.planner.trace._attention_share`); the uncalibrated presets priced attention as a full-square
  GEMM of head-size depth at 35% of peak: a third of the 1B GPT's step where the GPU spends a tenth;
- ``matmul_scale``, fitted: one factor on the GEMM efficiency table (fitted to Megatron's A100 table), so that the
  linear layers of a Hopper step cost what they took; capped at the isolated 8192^3 matmul's measured efficiency;
- ``fusion``, fitted: the share of the memory traffic between two GEMMs that ``torch.compile`` removes beyond the
  largest op's own (the uncalibrated model took 1: one kernel per gap, which made compiled steps a third too fast).

Memory bandwidth (80% of the datasheet's), the launch overhead and the optimizer's cost stay as they were: the H100
and the H200 share the GH100 die, so what differs between their steps is their HBM (3.35 vs 4.8 TB/s) and the fit
checks that the datasheet difference explains it. Calibration and validation are kept apart: the constants are fitted
on the H200's runs and the H100's are predicted, and the reverse; the held-out errors of those two fits are the bands
``lightning-par plan`` prints for these devices. The constants committed (``lightning_par/planner/calibration.json``,
read by :mod:`lightning_par.planner.hardware` for the ``h100-sxm`` and ``h200`` presets) are fitted on all the runs.

    PYTHONPATH=. python benchmarks/planner_fit.py          # ~10 s; writes calibration.json, results/planner_fit.json
    PYTHONPATH=. python benchmarks/planner_fit.py --check  # fit again and compare with the committed constants
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_par.planner.hardware import (  # noqa: E402
    BASE_PRESETS,
    CALIBRATION_FILE,
    Hardware,
    calibrated,
    detect_gpu,
)

INPUTS = ("benchmarks/results/gpu_check_h100.jsonl", "benchmarks/results/gpu_check_h200.jsonl",
          "benchmarks/results/gpu_lightning_h100_before_after.jsonl")
RESULTS = "benchmarks/results/planner_fit.json"
#: the GPU check's presets: the example GPT's size, sequences per step, tokens per sequence (gpu_check.PRESETS)
CHECK_PRESETS = {"1b": ("1b", 2, 4096), "tiny": ("tiny", 4, 128)}
#: the zero stage's rows: key -> ZeRO stage
ZERO_ROWS = {"zero1": 1, "zero2": 2, "zero3": 3, "master_zero1": 1, "master_zero2": 2, "master_zero3": 3}


@dataclass(frozen=True)
class Row:
    """One measured Lightning step."""

    file: str
    run_id: str
    device: str  # the planner preset of the device
    name: str  # zero0_eager, zero0_compiled, zero1, master_zero2, ...
    gpt: str
    batch: int
    seq: int
    zero_stage: int
    precision: str  # the planner's name
    compiled: bool
    step_s: float
    max_allocated: float | None

    @property
    def label(self) -> str:
        return f"{self.device} {self.run_id} {self.name}"


def _precision(name: str) -> str:
    return "fp32" if name == "32-true" else name


def read_runs(paths: list[str]) -> tuple[list[Row], dict[str, dict]]:
    """The measured steps of every GPU run in ``paths``, and the env figures per device preset (the mean over the
    env lines of that device, with their run ids)."""
    rows: list[Row] = []
    env: dict[str, dict] = {}
    for path in paths:
        lines = [json.loads(x) for x in (ROOT / path).read_text().splitlines() if x.strip()]
        device_of_run: dict[str, str] = {}
        for line in lines:
            fig = line.get("figures", {})
            if line.get("stage") == "env" and line.get("ok") and fig.get("cuda_available"):
                spec = detect_gpu(fig["device_name"])
                if spec is None:
                    continue
                device_of_run[line["run_id"]] = spec.preset
                e = env.setdefault(spec.preset, {"matmul": [], "attention": [], "runs": [], "peak": 0.0})
                e["peak"] = spec.peak_flops["bf16"]
                e["matmul"].append(fig["bf16_matmul_tflops"] * 1e12 / spec.peak_flops["bf16"])
                e["attention"].append(fig["sdpa_default_tflops"] * 1e12 / spec.peak_flops["bf16"])
                e["runs"].append(line["run_id"])
        for line in lines:
            fig = line.get("figures", {})
            if line.get("device") != "cuda" or line.get("stage") not in ("lightning", "zero"):
                continue
            device = device_of_run.get(line["run_id"]) or _device_of(fig, path, set(device_of_run.values()))
            gpt, batch, seq = CHECK_PRESETS[line.get("preset", "1b")]
            batch, seq = fig.get("batch", batch), fig.get("seq", seq)
            if line["stage"] == "lightning":
                for mode in ("eager", "compiled"):
                    m = fig.get(f"lightning_{mode}", {})
                    if "step_s" in m:
                        rows.append(Row(path, line["run_id"], device, f"zero0_{mode}", gpt, batch, seq, 0,
                                        _precision(fig["precision"]), mode == "compiled", m["step_s"],
                                        m.get("max_allocated_bytes")))
            else:
                for key, stage in ZERO_ROWS.items():
                    m = fig.get(key, {})
                    if "step_s" in m:
                        rows.append(Row(path, line["run_id"], device, key, gpt, batch, seq, stage,
                                        _precision(m["precision"]), False, m["step_s"], m.get("max_allocated_bytes")))
    for e in env.values():
        e["matmul_efficiency"] = statistics.fmean(e.pop("matmul"))
        e["attention_efficiency"] = statistics.fmean(e.pop("attention"))
    return rows, env


def _device_of(fig: dict, path: str, in_file: set[str]) -> str:
    """A run without an env line: its device from the lightning stage's peak source (a device name), else the one
    device the file's env lines name (a rerun of some stages on the same machine)."""
    source = fig.get("peak_source", "")
    spec = detect_gpu(source.split("(")[0]) if source else None
    if spec is not None:
        return spec.preset
    if len(in_file) == 1:
        return next(iter(in_file))
    raise ValueError(f"{path}: a run whose device is named nowhere (no env line, no peak_source)")


# ----------------------------------------------------------------------------------------------------------------------
# Planning the measured steps
# ----------------------------------------------------------------------------------------------------------------------
class Predictor:
    """Plans each measured step on a hardware; the traces (the slow part) are made once and shared."""

    def __init__(self) -> None:
        self._info: dict[str, object] = {}
        self._traces: dict[tuple, dict] = {}

    def estimate(self, row: Row, hw: Hardware):
        from lightning_par.examples import GPTLightningModule
        from lightning_par.planner import Candidate, Planner, Runtime, Workload, build_model, inspect_model

        if row.gpt not in self._info:
            self._info[row.gpt] = inspect_model(build_model(GPTLightningModule, {"preset": row.gpt}))
        planner = Planner(self._info[row.gpt], hw, Workload(row.batch, row.seq, row.batch),
                          runtime=Runtime(compiled=row.compiled))
        planner._traces = self._traces.setdefault((row.gpt, row.batch, row.seq), {})  # shared: shapes only
        return planner.estimate(Candidate(1, 1, 1, row.zero_stage, precision=row.precision))

    def step(self, row: Row, hw: Hardware) -> float:
        return self.estimate(row, hw).step_time


def hardware_for(device: str, constants: dict, env: dict) -> Hardware:
    """The device's preset with ``constants`` (matmul_scale, fusion) and its measured attention efficiency."""
    return calibrated(BASE_PRESETS[device], constants, {"attention_efficiency": env[device]["attention_efficiency"],
                                                         "runs": env[device]["runs"]})


def _max_scale(devices: list[str], env: dict) -> float:
    """The largest matmul_scale that keeps every device's GEMM table at or below its isolated 8192^3 matmul's
    measured efficiency (a step's GEMMs never beat the best one alone)."""
    return min(env[d]["matmul_efficiency"] / BASE_PRESETS[d].efficiency(None) for d in devices)


def fit(rows: list[Row], env: dict, predictor: Predictor) -> dict:
    """``matmul_scale`` and ``fusion`` minimising the squared log error of the rows' predicted steps (Nelder-Mead
    in the two constants, from the uncalibrated (1, 1), each kept inside its physical range)."""
    devices = sorted({r.device for r in rows})
    hi = _max_scale(devices, env)

    def constants(x: tuple[float, float]) -> dict:
        return {"matmul_scale": min(max(x[0], 0.3), hi), "fusion": min(max(x[1], 0.0), 1.0)}

    def loss(x: tuple[float, float]) -> float:
        c = constants(x)
        hws = {d: hardware_for(d, c, env) for d in devices}
        return sum(math.log(predictor.step(r, hws[r.device]) / r.step_s) ** 2 for r in rows)

    best = nelder_mead(loss, (1.0, 1.0), step=0.2)
    return {k: round(v, 4) for k, v in constants(best).items()}


def nelder_mead(f, x0: tuple[float, ...], step: float = 0.1, tol: float = 1e-7, max_iter: int = 200):
    """The minimum of ``f`` near ``x0`` by the Nelder-Mead simplex (deterministic: the same points each run)."""
    n = len(x0)
    simplex = [tuple(x0)] + [tuple(x0[j] + (step if j == i else 0.0) for j in range(n)) for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(max_iter):
        order = sorted(range(n + 1), key=values.__getitem__)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = tuple(sum(x[j] for x in simplex[:-1]) / n for j in range(n))
        worst = simplex[-1]

        def toward(t: float, centroid=centroid, worst=worst) -> tuple[float, ...]:
            return tuple(c + t * (w - c) for c, w in zip(centroid, worst, strict=True))

        reflected = toward(-1.0)
        fr = f(reflected)
        if fr < values[0]:
            expanded = toward(-2.0)
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = toward(0.5)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:  # shrink toward the best point
                simplex = [simplex[0]] + [tuple(b + 0.5 * (x - b) for b, x in zip(simplex[0], p, strict=True))
                                          for p in simplex[1:]]
                values = [values[0]] + [f(p) for p in simplex[1:]]
    return simplex[min(range(n + 1), key=values.__getitem__)]


def errors(rows: list[Row], constants: dict | None, env: dict, predictor: Predictor) -> list[dict]:
    """Each row planned with ``constants`` (None: the uncalibrated preset): predicted, measured, error."""
    out = []
    for r in rows:
        hw = BASE_PRESETS[r.device] if constants is None else hardware_for(r.device, constants, env)
        e = predictor.estimate(r, hw)
        out.append({"run_id": r.run_id, "device": r.device, "row": r.name, "precision": r.precision,
                    "zero_stage": r.zero_stage, "compiled": r.compiled, "measured_step_s": r.step_s,
                    "predicted_step_s": e.step_time, "error": e.step_time / r.step_s - 1,
                    "measured_max_allocated": r.max_allocated, "predicted_bytes": e.worst.total,
                    "memory_error": (e.worst.total / r.max_allocated - 1) if r.max_allocated else None})
    return out


def summary(errs: list[dict], key: str = "error") -> dict:
    values = [abs(e[key]) for e in errs if e[key] is not None]
    return {"n": len(values), "median": statistics.median(values), "worst": max(values),
            "mean_signed": statistics.fmean(e[key] for e in errs if e[key] is not None)}


def run(paths: list[str] = INPUTS) -> dict:
    """Everything the script writes: the constants fitted on all rows, the two cross fits and their held-out errors,
    the uncalibrated errors, and the memory comparison."""
    rows, env = read_runs(list(paths))
    predictor = Predictor()
    devices = sorted({r.device for r in rows})
    folds = []
    for held in devices:
        train = [r for r in rows if r.device != held]
        test = [r for r in rows if r.device == held]
        if not train or not test:
            continue
        c = fit(train, env, predictor)
        errs = errors(test, c, env, predictor)
        folds.append({"fit_on": sorted({r.device for r in train}), "validate_on": held, "constants": c,
                      "fit_runs": sorted({r.run_id for r in train}), "heldout_runs": sorted({r.run_id for r in test}),
                      "heldout": summary(errs), "rows": errs})
    constants = fit(rows, env, predictor)
    fitted = errors(rows, constants, env, predictor)
    before = errors(rows, None, env, predictor)
    heldout = [e for f in folds for e in f["rows"]]
    return {
        "inputs": list(paths), "constants": constants, "env": env,
        "runs": sorted({r.run_id for r in rows}), "rows": len(rows),
        "folds": folds, "heldout": summary(heldout) if heldout else None,
        "uncalibrated": {"summary": summary(before), "rows": before},
        "fitted_all": {"summary": summary(fitted), "rows": fitted},
        "memory": summary(fitted, "memory_error"),
    }


def cpu_band() -> dict | None:
    """The ``cpu`` preset's errors on the stored side-by-side run (benchmarks/results/side_by_side.json): each
    layout's predicted work ratio to dp's against the measured CPU-time ratio, as tests/launch/test_planner_cpu.py
    holds them (within 20%)."""
    path = ROOT / "benchmarks" / "results" / "side_by_side.json"
    if not path.exists():
        return None
    from benchmarks.side_by_side import LAYOUTS, predict

    stored = json.loads(path.read_text())
    pred = predict(stored["preset"], stored["n_layers"], stored["n_kv_heads"], stored["batch"], stored["seq"])
    rows = {r["layout"]: r for r in stored["rows"]}
    errs = [pred[n]["work_ratio_vs_dp"] / rows[n]["ratios_vs_dp"]["cpu_time"] - 1 for n in LAYOUTS if n != "dp"]
    return {"n": len(errs), "median": round(statistics.median(abs(e) for e in errs), 4),
            "worst": round(max(abs(e) for e in errs), 4), "layouts": [n for n in LAYOUTS if n != "dp"],
            "of": "work ratio to dp, 4 CPU ranks (benchmarks/side_by_side.py)"}


def calibration_file(result: dict) -> dict:
    """What ``lightning_par/planner/calibration.json`` holds: the constants, each device's measured attention
    efficiency and runs, and the bands the held-out errors support (read by ``lightning-par plan``)."""
    by_device: dict[str, dict] = {}
    for fold in result["folds"]:
        s = fold["heldout"]
        by_device[fold["validate_on"]] = {"step": {"median": round(s["median"], 4), "worst": round(s["worst"], 4),
                                                   "n": s["n"], "fit_on": fold["fit_on"]}}
    for device, mem in _memory_by_device(result).items():
        by_device.setdefault(device, {})["memory"] = mem
    return {
        "written_by": "benchmarks/planner_fit.py (do not edit by hand: run it again)",
        "inputs": result["inputs"],
        "constants": result["constants"],
        "devices": {d: {"attention_efficiency": round(e["attention_efficiency"], 4),
                        "matmul_efficiency_isolated": round(e["matmul_efficiency"], 4), "env_runs": e["runs"],
                        "runs": sorted({r["run_id"] for r in result["fitted_all"]["rows"] if r["device"] == d})}
                    for d, e in sorted(result["env"].items())},
        "fitted_on_runs": result["runs"],
        # what was measured: one GPU (dp = tp = pp = 1), the example GPT's 1b preset, bf16-mixed and
        # bf16-mixed-master, ZeRO 0-3, eager and compiled; plan says when a run is outside this
        "measured": {"world": 1, "tp": 1, "pp": 1, "cp": 1, "precisions": ["bf16-mixed", "bf16-mixed-master"],
                     "zero_stages": [0, 1, 2, 3]},
        "bands": by_device,
        "cpu": cpu_band(),
    }


def _memory_by_device(result: dict) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for device in sorted({e["device"] for e in result["fitted_all"]["rows"]}):
        errs = [e for e in result["fitted_all"]["rows"] if e["device"] == device and e["memory_error"] is not None]
        if errs:
            s = summary(errs, "memory_error")
            out[device] = {"median": round(s["median"], 4), "worst": round(s["worst"], 4), "n": s["n"],
                           "under": round(min(0.0, min(e["memory_error"] for e in errs)), 4)}
    return out


def format_report(result: dict) -> str:
    lines = [f"{result['rows']} measured steps from runs {', '.join(result['runs'])}"]
    c = result["constants"]
    lines.append(f"constants fitted on all of them: matmul_scale {c['matmul_scale']}, fusion {c['fusion']}")
    for device, e in sorted(result["env"].items()):
        lines.append(f"  {device}: attention_efficiency {e['attention_efficiency']:.3f} (measured SDPA over the "
                     f"peak), isolated 8192^3 matmul {e['matmul_efficiency']:.3f} of the peak")
    u = result["uncalibrated"]["summary"]
    lines.append(f"uncalibrated presets: median |error| {u['median']:.1%}, worst {u['worst']:.1%}")
    for f in result["folds"]:
        s = f["heldout"]
        lines.append(f"fit on {'+'.join(f['fit_on'])} ({f['constants']}), validate on {f['validate_on']}: "
                     f"median |error| {s['median']:.1%}, worst {s['worst']:.1%} over {s['n']} steps")
        for e in f["rows"]:
            lines.append(f"    {e['run_id']} {e['row']:>15s}  measured {e['measured_step_s']:.4f} s  predicted "
                         f"{e['predicted_step_s']:.4f} s  {e['error']:+.1%}")
    if result["heldout"]:
        h = result["heldout"]
        lines.append(f"held out, both folds: median |error| {h['median']:.1%}, worst {h['worst']:.1%}")
    m = result["memory"]
    lines.append(f"memory (predicted bytes vs max_memory_allocated, not fitted): median |error| {m['median']:.1%}, "
                 f"worst {m['worst']:.1%}, mean {m['mean_signed']:+.1%}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="*", default=list(INPUTS), help="GPU check JSON lines (repo-relative)")
    parser.add_argument("--json", default=RESULTS)
    parser.add_argument("--calibration", default=str(CALIBRATION_FILE))
    parser.add_argument("--check", action="store_true", help="compare with the committed constants; write nothing")
    args = parser.parse_args()
    result = run(args.inputs)
    print(format_report(result))
    new = calibration_file(result)
    if args.check:
        old = json.loads(Path(args.calibration).read_text())
        same = old["constants"] == new["constants"] and old["devices"] == new["devices"]
        print("the committed constants are reproduced" if same else f"DIFFERENT: committed {old['constants']}")
        sys.exit(0 if same else 1)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    Path(args.calibration).write_text(json.dumps(new, indent=1) + "\n")


if __name__ == "__main__":
    main()
