"""What the README's main install (no extras) runs: every strategy it advertises, the pipeline demo included."""

import os

import tomllib

from tests.harness import REPO, launch_cli

NO_EXTRAS = REPO / "tests" / "no_extras"  # its sitecustomize makes matplotlib and transformers look absent


def test_extras_are_only_optional_packages():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    main = " ".join(project["dependencies"])
    assert "matplotlib" not in main and "transformers" not in main  # what tests/no_extras simulates missing
    assert (NO_EXTRAS / "sitecustomize.py").read_text().count('BLOCKED = {"matplotlib", "transformers"}') == 1


def test_pipeline_demo_runs_without_the_extras(tmp_path, cache_dir, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(NO_EXTRAS), os.environ.get("PYTHONPATH", "")]))
    args = ["--trainer.strategy=pipeline2_1f1b", "--trainer.max_steps=5", "--data.batch_size=8",
            "--pipeline_timeline.step=3", "--sample_tokens=0", "--trainer.limit_val_batches=1"]
    run = launch_cli(tmp_path, cache_dir, args, devices=2).check()
    assert "pipeline timeline: no figure" in run.log and "pip install matplotlib" in run.log
    scalars = run.scalars()
    (bubble,) = scalars["pipeline/bubble_fraction"].values()  # the numbers are logged all the same
    assert 0.0 < bubble < 1.0
    assert len(scalars["train/loss"]) == 5
    assert (tmp_path / "tb").exists() and list(tmp_path.rglob("pipeline_timeline.json"))
