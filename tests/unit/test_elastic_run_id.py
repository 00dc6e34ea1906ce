"""A torchrun job continues a run after a node joins only when the run was recorded under its own run id: torchrun's
default ``--rdzv-id`` (``none``) is every job's, so a second job without its own starts its own run, with a warning."""

from __future__ import annotations

import json

import pytest


@pytest.mark.parametrize(("recorded", "job", "continues"), [("job-a", "job-a", True), ("job-a", "job-b", False),
                                                             ("none", "none", False)])
def test_only_the_same_named_job_continues_a_run(tmp_path, monkeypatch, recorded, job, continues):
    from lightning_par.run.elastic import PROGRESS_FILE, same_torchelastic_job

    (tmp_path / PROGRESS_FILE).write_text(json.dumps({"step": 44, "time": 0.0, "world_size": 2,
                                                      "torchelastic_run_id": recorded}))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", job)
    if job == "none":
        with pytest.warns(UserWarning, match=r"no run id of its own \(--rdzv-id defaults to 'none' for every job\).*"
                                             r"starts its own run"):
            assert same_torchelastic_job(tmp_path) is continues
    else:
        assert same_torchelastic_job(tmp_path) is continues
