"""How the conformance matrix (benchmarks/hf_matrix.py) names a cell: a float32 miss is run again in float64, and only
a cell at parity there counts as rounding; one off in float64 too stays a failure."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
hf_matrix = pytest.importorskip("benchmarks.hf_matrix")

REF = [5.0, 4.0, 3.5, 3.0]


def _row(float32: list[float], float64: list[float] | None) -> dict:
    row = {"reference": REF, "raw": {"tp2": {"losses": float32, "error": None}}}
    if float64 is not None:
        row["reference64"] = REF
        row["raw64"] = {"tp2": {"losses": float64, "error": None}}
    return row


def test_a_float32_miss_at_parity_in_float64_is_named_rounding():
    cell = hf_matrix.verdict(_row([5.0, 4.0, 3.5, 3.003], [5.0, 4.0, 3.5, 3.0 + 1e-9]), "tp2")
    assert cell.startswith("float64 parity: in float32 loss off by 1.0e-03"), cell
    assert cell.endswith("in float64 parity"), cell


def test_a_miss_that_stays_in_float64_is_a_failure():
    cell = hf_matrix.verdict(_row([5.0, 4.0, 3.5, 3.003], [5.0, 4.0, 3.5, 3.003]), "tp2")
    assert cell == "fails: loss off by 1.0e-03 (relative); in float64 loss off by 1.0e-03 (relative)"


def test_parity_and_crashes_are_not_run_again():
    assert hf_matrix.verdict(_row(REF, None), "tp2") == "parity"
    crash = {"reference": REF, "raw": {"tp2": {"error": "rank 0: RuntimeError: boom"}},
             "reference64": REF, "raw64": {"tp2": {"losses": REF, "error": None}}}
    assert hf_matrix.verdict(crash, "tp2") == "fails: RuntimeError: boom"
