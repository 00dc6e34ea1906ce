"""Packed documents (``TextDataModule(pack_documents=True)``) under tp2, pp2 and cp2: per-step losses equal the same
documents unpacked in one process. One launch of ``tests/launch/packed_documents_worker.py`` (see its docstring)."""

from __future__ import annotations

import pytest

from tests.harness import launch_reports, max_rel_diff
from tests.launch.packed_documents_worker import CASES

PARITY_RTOL = 1e-5
CROSSING = 1e-3  # packed with attention across documents is this far off at least


@pytest.fixture(scope="module")
def two(tmp_path_factory, cache_dir) -> list[dict]:
    return launch_reports(tmp_path_factory.mktemp("packed_documents"), cache_dir,
                          "tests.launch.packed_documents_worker", tuple(CASES), 2)


@pytest.mark.launch(ranks=2)
@pytest.mark.parametrize("case", list(CASES))
def test_packed_documents_train_as_the_documents_unpacked(two, case):
    reference = two[0][case]
    unpacked = reference["unpacked"]
    one = max_rel_diff(reference["packed"], unpacked)
    crossing = max_rel_diff(reference["crossing"], unpacked)
    print(f"{case}: one process packed vs unpacked {one:.2e}; attention across documents {crossing:.2e}")
    assert one <= PARITY_RTOL and crossing > CROSSING
    for report in two:
        diff = max_rel_diff(report[case]["losses"], unpacked)
        print(f"{case} rank {two.index(report)} packed vs one process unpacked: {diff:.2e} ({report[case]['losses']})")
        assert diff <= PARITY_RTOL
