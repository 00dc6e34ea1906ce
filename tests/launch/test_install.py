"""What the README's main install (no extras) runs: every strategy it advertises, the pipeline demo included."""

import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib

from tests.harness import REPO, base_env, launch_cli, launching

NO_EXTRAS = REPO / "tests" / "no_extras"  # its sitecustomize makes matplotlib and transformers look absent


def test_extras_are_only_optional_packages():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    main = " ".join(project["dependencies"])
    assert "matplotlib" not in main and "transformers" not in main  # what tests/no_extras simulates missing
    assert (NO_EXTRAS / "sitecustomize.py").read_text().count('BLOCKED = {"matplotlib", "transformers"}') == 1


def test_the_readmes_hugging_face_section_installs_the_extra_it_needs():
    """It names the extra pyproject has, and says what is built (expert parallel was "not there yet")."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    section = (REPO / "README.md").read_text().split("## A Hugging Face model")[1].split("\n## ")[0]
    assert 'pip install -e ".[hf]"' in section and any(r.startswith("transformers") for r in extras["hf"])
    assert "not there yet" not in section and "base_model_ep_plan" in section and "--trainer.strategy=ep2" in section


@pytest.mark.launch(ranks=2, full=True)
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """The wheel ``pip install .`` would install, built from a copy of the package's sources (setuptools, no
    network, no isolation), and that wheel unpacked as site-packages would hold it."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(REPO / "lightning_par", src / "lightning_par", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", build, str(root / "dist")], cwd=src, capture_output=True, text=True,
                         check=True)
    path = root / "dist" / out.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(path) as zf:
        zf.extractall(root / "site")
        names = zf.namelist()
    return names, root / "site"


def test_wheel_holds_the_examples_inside_the_package(wheel):
    names, _ = wheel
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"lightning_par"}  # no top-level example_models (nor tests, benchmarks) in site-packages
    assert {"lightning_par/examples/__init__.py", "lightning_par/examples/lit_gpt.py",
            "lightning_par/examples/hf_causal_lm.py", "lightning_par/_compat.py"} <= set(names)


@pytest.mark.launch(ranks=1)
def test_old_example_class_path_works_from_the_installed_package(wheel, tmp_path, cache_dir):
    """A config written for the old top-level package (``class_path: example_models.lit_gpt.GPTLightningModule``)
    trains from the unpacked wheel alone (no source tree on the path), with one warning naming the new path."""
    _, site = wheel
    (tmp_path / "old.yaml").write_text(
        "model:\n  class_path: example_models.lit_gpt.GPTLightningModule\n  init_args:\n    preset: tiny\n"
        "    n_layers: 2\ndata:\n  class_path: lightning_par.data.TextDataModule\n  init_args:\n    seq_len: 16\n"
        f"    batch_size: 4\n    max_corpus_bytes: 20000\n    cache_dir: {cache_dir}\n")
    env = {**base_env(cache_dir), "PYTHONPATH": str(site)}
    probe = ("import lightning_par, example_models.lit_gpt as old, lightning_par.examples.lit_gpt as new; "
             "print(lightning_par.__file__, old is new)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == [str(site / "lightning_par" / "__init__.py"), "True"]
    launching(1)
    fit = subprocess.run([sys.executable, "-m", "lightning_par.cli", "fit", "--config", "old.yaml",
                          "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_steps=2",
                          "--trainer.enable_checkpointing=false", "--sample_tokens=0",
                          "--trainer.limit_val_batches=0"], cwd=tmp_path, env=env, capture_output=True, text=True)
    log = fit.stdout + fit.stderr
    assert fit.returncode == 0, log[-4000:]
    assert log.count("`example_models` is now `lightning_par.examples`") == 1
    assert "max_steps=2` reached" in log
