"""A successful run prints no warning of lightning-par's own: the logs of launches the default set makes anyway
(ZeRO-0 = DDP over dp=2, ZeRO-3 over dp=2, Megatron tp=2), read for Python's warning lines (``FILE.py:LINE: ...``).
The warnings that remain come from Lightning or torch, about their own code; docs/cli.md lists them."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import lightning_par
from tests.conftest import run_cases

#: the start of a warning as Python (and Lightning's rank_zero_warn) print it: the file and line it is attributed to
WARNING_LINE = re.compile(r"^(?P<file>/\S+\.py):\d+: ")
PACKAGE = str(Path(lightning_par.__file__).parent)
#: warnings lightning-par printed before: DDP's deprecated flag, jsonargparse's Path.get_content, torch's LeafSpec
#: (built by Lightning's _pytree, filtered by lightning_par), in every successful multi-rank run
GONE = ("broadcast_buffers", "get_content", "isinstance(treespec, LeafSpec)")


@pytest.mark.parametrize("name", run_cases(["dp2", "zero3_dp2", "tp2"]))
def test_a_successful_run_prints_no_warning_of_lightning_pars_own(runs, name):
    log = runs(name).log
    attributed = [m["file"] for m in map(WARNING_LINE.match, log.splitlines()) if m]
    ours = [f for f in attributed if f.startswith(PACKAGE)]
    assert not ours, f"{name}: warnings attributed to lightning_par: {ours}\n{log}"
    assert not [g for g in GONE if g in log], log
    print(f"{name}: {len(attributed)} warning lines, from {sorted(set(attributed))}")
