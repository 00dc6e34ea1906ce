"""Checkpoints by default, ``--ckpt_path=last``, and automatic restart.

The CLI saves every N steps and at the end, ``last.ckpt`` linking to the newest; ``last`` means the newest COMPLETE
checkpoint of the logger name's runs; a job that torchrun (``--max-restarts``) or SLURM restarts continues by itself
from its newest complete checkpoint, in the same run directory, with the losses of an uninterrupted run.
"""

import json
import os
import re
import time
from pathlib import Path

import pytest

from lightning_par.cli import restart_count
from lightning_par.plugins import checkpoint_files
from lightning_par.plugins.checkpoint_files import newest_complete
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, job
from tests.harness import REPO, launch_command, launch_torchrun, max_rel_diff
from tests.launch.doc_commands import bash_commands


# -- the newest complete checkpoint ----------------------------------------------------------------------------------
def _directory_checkpoint(path: Path, payload: bytes = b"x" * 100) -> Path:
    path.mkdir()
    (path / "data.distcp").write_bytes(payload)
    checkpoint_files.write_manifest(path, checkpoint_files.describe(path, ["data.distcp"]))
    return path


def _aged(path: Path, seconds_ago: float) -> None:
    when = time.time() - seconds_ago
    target = path / checkpoint_files.MANIFEST if path.is_dir() else path
    os.utime(target, (when, when))


def test_newest_complete_never_takes_an_interrupted_save(tmp_path):
    """Of a directory of checkpoints, the newest complete one; a newer one without its manifest, with a truncated
    file, a ``.partial``, a dangling link or a truncated one-file checkpoint is passed over."""
    run0, run1 = tmp_path / "version_0" / "checkpoints", tmp_path / "version_1" / "checkpoints"
    run0.mkdir(parents=True)
    run1.mkdir(parents=True)
    old = _directory_checkpoint(run0 / "epoch=0-step=5.ckpt")
    _aged(old, 100)
    good = _directory_checkpoint(run1 / "epoch=0-step=10.ckpt")
    _aged(good, 50)
    (run1 / "last.ckpt").symlink_to(good.name)
    assert newest_complete([run0, run1]) == good.resolve()

    no_manifest = run1 / "epoch=0-step=15.ckpt"  # a save that never committed (a crash before the rename, by hand)
    no_manifest.mkdir()
    (no_manifest / "data.distcp").write_bytes(b"x")
    truncated = _directory_checkpoint(run1 / "epoch=0-step=20.ckpt")
    (truncated / "data.distcp").write_bytes(b"x" * 10)
    _directory_checkpoint(run1 / "epoch=0-step=25.ckpt.partial")
    (run0 / "last.ckpt").symlink_to("epoch=0-step=30.ckpt")  # dangling
    one_file = run0 / "epoch=0-step=35.ckpt"  # torch.save's zip, cut short, without a sidecar
    import torch

    torch.save({"w": torch.zeros(1000)}, one_file)
    one_file.write_bytes(one_file.read_bytes()[:-200])
    assert newest_complete([run0, run1]) == good.resolve()

    torch.save({"w": torch.zeros(1000)}, one_file)  # whole: the newest complete one now
    assert newest_complete([run0, run1]) == one_file.resolve()
    assert newest_complete([tmp_path / "missing"]) is None


def test_restart_count(monkeypatch):
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert restart_count() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert restart_count() is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert restart_count() == ("SLURM_RESTART_COUNT", 2)


def test_run_checkpoint_saves_every_n_steps_and_the_last_step(tmp_path):
    """Every 3 steps and at the end (step 7, named epoch=2: Lightning has counted the epoch ended); the epoch end at
    step 5 relinks nothing to an older step (a plain ``ModelCheckpoint(save_last="link")`` points ``last`` at step 3
    there, and saves nothing at the end). ``last.ckpt`` links to step 7's checkpoint, the earlier ones are gone."""
    from lightning.pytorch import Trainer
    from lightning.pytorch.demos.boring_classes import BoringModel

    from lightning_par.callbacks import RunCheckpoint

    links = []

    class Watch(RunCheckpoint):
        def _save_last_checkpoint(self, trainer, monitor_candidates):
            super()._save_last_checkpoint(trainer, monitor_candidates)
            links.append((trainer.global_step, Path(self.last_model_path).resolve().name))

    trainer = Trainer(default_root_dir=tmp_path, max_steps=7, limit_train_batches=5, limit_val_batches=1,
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Watch(every_n_train_steps=3)])
    trainer.fit(BoringModel())
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=2-step=7.ckpt", "last.ckpt"]
    assert (ckpts / "last.ckpt").readlink() == Path("epoch=2-step=7.ckpt")
    assert links == [(3, "epoch=0-step=3.ckpt"), (6, "epoch=1-step=6.ckpt"), (7, "epoch=2-step=7.ckpt")]


# -- the README's commands, as written ---------------------------------------------------------------------------
#: appended to the README's commands: the demo at a size that runs in seconds
TINY_DEMO = ["--model.preset=tiny", "--data.seq_len=32", "--data.batch_size=8", "--data.max_corpus_bytes=300000",
             "--trainer.limit_val_batches=2", "--trainer.enable_progress_bar=false", "--sample_tokens=0"]
DEMO = f"--config={REPO / 'configs' / 'demo.yaml'}"
LAST0 = "lightning_logs/demo/version_0/checkpoints/last.ckpt"


def _tiny(argv: list[str]) -> list[str]:
    """``argv`` at the tiny demo's size. TINY_DEMO's batch is half the demo's (8 of 16), so a batch the command sets
    itself (to keep the global batch across layouts) is halved too, and TINY_DEMO's is then left out."""
    own = [a for a in argv if a.startswith("--data.batch_size=")]
    if not own:
        return [*argv, *TINY_DEMO]
    halved = [f"--data.batch_size={int(a.split('=')[1]) // 2}" if a in own else a for a in argv]
    return [*halved, *(a for a in TINY_DEMO if not a.startswith("--data.batch_size="))]


def _readme_commands() -> list[str]:
    """The command lines of README.md and docs/ that name a checkpoint of the demo (``.../checkpoints/last.ckpt``),
    each once, in reading order (README first)."""
    lines = bash_commands()
    return [line for line in lines if LAST0 in line or line.startswith("lightning-par") and "--ckpt_path=last" in line]


@pytest.mark.launch(ranks=2, full=True)  # 5 launches, 2-3 min
def test_the_readme_checkpoint_commands_work_as_written(tmp_path, cache_dir):
    """fit the demo (3D, 4 ranks) for 4 steps; then, as the README writes them: resume its ``last.ckpt`` on one
    process (ZeRO stage 0), resume ``--ckpt_path=last`` under ZeRO-2 -- the newest complete checkpoint, the one-process
    run's in version_1 --, export version_0's (to .safetensors and to a one-file Lightning .ckpt), validate it under the
    demo's 3D layout."""
    commands = _readme_commands()
    assert [c.split()[1] for c in commands] == ["fit", "fit", "export", "export", "validate"], commands
    data = [f"--data.cache_dir={cache_dir}"]
    fit = launch_command(tmp_path, cache_dir, ["fit", DEMO, "--trainer.max_steps=4", *TINY_DEMO, *data]).check()
    ckpts = tmp_path / "lightning_logs" / "demo" / "version_0" / "checkpoints"
    step4, last = sorted(p.name for p in ckpts.iterdir())  # saved at the end of fit (every 500 steps by default)
    assert re.fullmatch(r"epoch=\d+-step=4\.ckpt", step4) and last == "last.ckpt", fit.log[-2000:]
    assert (ckpts / "last.ckpt").readlink() == Path(step4)
    for command in commands:
        argv = command.removeprefix("lightning-par ").replace("--config configs/demo.yaml", DEMO)
        argv = argv.replace("--config=configs/demo.yaml", DEMO).split()
        if argv[0] == "export":
            launch_command(tmp_path, cache_dir, argv).check()
            assert (tmp_path / argv[2]).stat().st_size > 0
            continue
        if "--ckpt_path=last" in argv:  # from version_1's step 6 (the newest) to step 8, in version_2
            run = launch_command(tmp_path, cache_dir, [*_tiny(argv), "--trainer.max_steps=8", *data]).check()
            assert re.search(r"--ckpt_path=last is \S+/version_1/checkpoints/epoch=\d+-step=6\.ckpt", run.log), \
                run.log[-2000:]
            last = tmp_path / "lightning_logs" / "demo" / "version_2" / "checkpoints" / "last.ckpt"
            assert re.fullmatch(r"epoch=\d+-step=8\.ckpt", last.resolve().name)
            continue
        extra = ["--trainer.max_steps=6"] if argv[0] == "fit" else []  # version_0's step 4 to step 6, in version_1
        run = launch_command(tmp_path, cache_dir, [*_tiny(argv), *extra, *data]).check()
        if argv[0] == "fit":
            assert f"Restored all states from the checkpoint at {LAST0}" in run.log, run.log[-2000:]
            last = tmp_path / "lightning_logs" / "demo" / "version_1" / "checkpoints" / "last.ckpt"
            assert re.fullmatch(r"epoch=\d+-step=6\.ckpt", last.resolve().name)
        else:
            assert re.search(r"val/loss\s+\S+\s+\d", run.log), run.log[-2000:]


# -- automatic restart ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [pytest.param(1, marks=pytest.mark.launch(ranks=2)),
                                  pytest.param(0, marks=pytest.mark.launch(ranks=2, full=True))])
def test_torchrun_restarts_a_killed_rank_and_the_job_resumes_by_itself(tmp_path, cache_dir, runs, rank):
    """ZeRO-1 on 2 ranks under ``torchrun --max-restarts=1``, the CLI's default checkpoints every 5 steps (10-step
    epochs); rank 1 (rank 0, the logging rank, in the full run) is SIGKILLed at step 12 of the first attempt. torchrun
    restarts both ranks, the CLI resumes from the step-10 checkpoint in the same run directory, and the job ends with
    exit 0 and the uninterrupted losses."""
    killed = tmp_path / "killed.json"
    args = [*job(GLOBAL_BATCH // 2), "--trainer.strategy=zero1", "--trainer.enable_checkpointing=true",
            "--checkpoint_every_n_steps=5", "--trainer.callbacks+=tests.probes.FreezeAt",
            f"--trainer.callbacks.rank={rank}",
            "--trainer.callbacks.step=12", f"--trainer.callbacks.path={killed}", "--trainer.callbacks.sig=SIGKILL",
            "--trainer.callbacks.attempt=0"]
    run = launch_torchrun(tmp_path / "run", cache_dir, args, nnodes=1, nproc_per_node=2, timeout=240,
                          torchrun_args=("--max-restarts=1",))
    print(f"torchrun with a restart: {run.seconds:.1f} s, exit {run.returncode}")
    run.check()
    assert json.loads(killed.read_text())["pid"] > 0  # the first attempt's rank was killed
    versions = run.root / "tb" / "lightning_logs"
    assert sorted(p.name for p in versions.iterdir()) == ["version_0"]  # the restart continued the same run
    assert re.search(r"lightning-par: restart 1 of this job \(TORCHELASTIC_RESTART_COUNT=1\): resuming from "
                     r"\S+/version_0/checkpoints/epoch=0-step=10\.ckpt", run.log), run.log[-3000:]
    # the survivor is torn down at once (the heartbeat finds its peer's process gone), not after the heartbeat's
    # 60 s bound: the second attempt's logger starts within seconds of the kill (torchrun's teardown, a fresh start)
    first, second = sorted(versions.glob("version_0/events.out.tfevents.*"), key=lambda p: int(p.name.split(".")[3]))
    restarted = int(second.name.split(".")[3]) - json.loads(killed.read_text())["time"]
    print(f"the second attempt logged from {restarted:.0f} s after the kill")
    assert restarted < 45
    ckpts = versions / "version_0" / "checkpoints"
    # step 10 is kept (Lightning never deletes the checkpoint a run resumed from), step 15 gave way to step 20
    assert sorted(p.name for p in ckpts.iterdir()) == ["epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "last.ckpt"]
    assert (ckpts / "last.ckpt").readlink() == Path("epoch=1-step=20.ckpt")
    losses = run.scalars()["train/loss"]  # the second attempt's event file is read last: its steps 10-19
    reference = runs("zero1_dp2").losses()
    assert len(losses) == len(reference)
    diff = max_rel_diff([losses[s] for s in sorted(losses)[EPOCH_STEPS:]], reference[EPOCH_STEPS:])
    print(f"steps {EPOCH_STEPS}-19 after the restart: within {diff:.2e} of the uninterrupted run")
    assert diff <= 1e-6
