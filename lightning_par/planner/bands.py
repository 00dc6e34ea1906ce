"""How far to trust a plan: the error band its validation supports for each kind of run.

Three sources, each written by a script in ``benchmarks/`` (docs/plan.md, "Calibration and error bands"):

- ``calibration.json`` (``benchmarks/planner_fit.py``): per GPU preset, the step-time errors on the measured runs
  held out of each fit (one GPU: dp = tp = pp = 1, the precisions and ZeRO stages measured) and the memory errors
  (predicted bytes against ``max_memory_allocated``); and the ``cpu`` preset's errors on the work ratios between
  layouts of ``benchmarks/side_by_side.py`` on this machine's CPU ranks;
- ``accuracy.json`` (``benchmarks/plan_accuracy.py``): per GPU preset and layout family (dp, dp+tp, dp+cp, ...),
  the errors on published per-GPU throughput of other frameworks in bf16 -- the only figures for multi-GPU layouts;
- nothing: a preset, precision or layout none of them covers is said to be outside anything measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from lightning_par.planner.hardware import CALIBRATION_FILE, read_calibration

ACCURACY_FILE = Path(__file__).with_name("accuracy.json")


@dataclass(frozen=True)
class Band:
    """The error band of one kind of run: the median and worst |predicted / measured - 1| of its validation (None
    where it has none), what it rests on, and whether the run is inside what was measured."""

    kind: str
    step: tuple[float, float] | None
    memory: tuple[float, float] | None
    basis: str
    measured: bool

    def describe(self) -> str:
        parts = []
        if self.step:
            parts.append(f"step time within {self.step[0]:.0%} (median), {self.step[1]:.0%} (worst)")
        if self.memory:
            parts.append(f"memory within {self.memory[0]:.0%} (median), {self.memory[1]:.0%} (worst)")
        if not parts:
            return f"{self.kind}: outside anything measured -- {self.basis}"
        return f"{self.kind}: {'; '.join(parts)} -- {self.basis}"


@cache
def _accuracy() -> dict[str, Any] | None:
    try:
        return json.loads(ACCURACY_FILE.read_text())
    except FileNotFoundError:
        return None


@cache
def _calibration() -> dict[str, Any] | None:
    return read_calibration(CALIBRATION_FILE)


def family(tp: int, pp: int, cp: int = 1) -> str:
    """A layout's family for the bands: which of tp, pp, cp it uses beside data parallel."""
    used = [name for name, size in (("tp", tp), ("pp", pp), ("cp", cp)) if size > 1]
    return "+".join(["dp", *used]) if used else "dp"


def band_for(hardware: str, world: int, tp: int, pp: int, cp: int, precision: str) -> Band:
    """The band for a run of ``world`` ranks with this layout and precision on the preset named ``hardware``."""
    calibration = _calibration() or {}
    fam = family(tp, pp, cp)
    kind = f"{hardware}, {precision}, {fam if world > 1 else 'one device'}"
    if hardware == "cpu":
        cpu = calibration.get("cpu")
        if not cpu:
            return Band(kind, None, None, "no CPU comparison in calibration.json", False)
        return Band(kind, (cpu["median"], cpu["worst"]), None,
                    f"the work ratios between {cpu['n']} layouts on 4 CPU ranks (benchmarks/side_by_side.py); "
                    "absolute CPU step times are not held (shared cores)", True)
    bands = calibration.get("bands", {}).get(hardware)
    measured = calibration.get("measured", {})
    if bands and world == 1 and precision in measured.get("precisions", ()):
        step, mem = bands.get("step"), bands.get("memory")
        return Band(kind, (step["median"], step["worst"]) if step else None,
                    (mem["median"], mem["worst"]) if mem else None,
                    f"{step['n'] if step else 0} measured steps held out of the fit (fitted on "
                    f"{', '.join(step['fit_on']) if step else '-'}); memory against max_memory_allocated", True)
    published = ((_accuracy() or {}).get("bands", {}).get(hardware) or {}).get(fam)
    if published and world > 1 and precision.startswith("bf16"):
        return Band(kind, (published["median"], published["worst"]), None,
                    f"never measured here on a GPU: {published['n']} published bf16 rows of other frameworks "
                    "(docs/plan-accuracy.md)", False)
    why = ("no GPU run of this layout was measured, and no published row covers it" if world > 1
           else f"{precision} was never measured on a GPU" if bands else f"{hardware} was never measured")
    return Band(kind, None, None, why, False)
