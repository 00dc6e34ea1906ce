"""A rank that freezes or dies does not leave the others waiting: they stop within the heartbeat bound, naming it,
and the job resumes from its last checkpoint with the losses of an uninterrupted run.

A frozen rank (SIGSTOP) is the hard case: it holds its sockets open, so the others' collectives neither fail nor
return until the process group's timeout (30 minutes by default). A killed rank's peers' collectives fail at once, and
they name it (the heartbeat finds its process gone) before they stop.
"""

import json
import os
import re
import signal
import time

import pytest

from lightning_par import LayoutError, ZeroStrategy
from lightning_par.parallel.heartbeat import EXIT_CODE
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, job
from tests.harness import launch_cli, max_rel_diff

BOUND = 10.0  # seconds: the heartbeat_timeout of the test (default 60)
ZERO2 = ["--trainer.strategy=lightning_par.ZeroStrategy", "--trainer.strategy.stage=2"]


def test_a_frozen_rank_is_named_and_the_others_stop_within_the_bound_then_the_job_resumes(tmp_path, cache_dir, runs):
    """ZeRO-2 on 2 ranks, heartbeat bound 10 s, epoch-end checkpoints; rank 1 freezes at step 12."""
    frozen = tmp_path / "frozen.json"
    args = [*job(GLOBAL_BATCH // 2), *ZERO2, f"--trainer.strategy.heartbeat_timeout={BOUND}",
            "--trainer.enable_checkpointing=true", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.save_top_k=-1", f"--trainer.callbacks.dirpath={tmp_path / 'run' / 'ckpt'}",
            "--trainer.callbacks+=tests.probes.FreezeAt", "--trainer.callbacks.rank=1", "--trainer.callbacks.step=12",
            f"--trainer.callbacks.path={frozen}"]
    try:
        run = launch_cli(tmp_path / "run", cache_dir, args, devices=2, timeout=180)
        ended = time.time()
    finally:
        if frozen.exists():  # the frozen rank outlives the others (nobody else may kill it): clean up
            pid = json.loads(frozen.read_text())["pid"]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    reaction = ended - json.loads(frozen.read_text())["time"]
    print(f"rank 1 frozen at step 12: rank 0 stopped {reaction:.1f} s later (bound {BOUND:g} s), exit {run.returncode}")
    assert run.returncode == EXIT_CODE, run.log[-3000:]
    assert re.search(r"lightning-par: rank 1 \(\S+, pid \d+\) stopped answering: it sent no heartbeat for", run.log)
    # its last beat came up to one interval (bound / 6) before the freeze; then the watcher needs one interval more
    assert BOUND - BOUND / 6 <= reaction <= BOUND + 10
    # the checkpoint of step 10 (the last one written) continues as if nothing happened
    resumed = launch_cli(tmp_path / "resumed", cache_dir,
                         [*job(GLOBAL_BATCH // 2), *ZERO2, f"--ckpt_path={run.root / 'ckpt' / 'epoch=0-step=10.ckpt'}"],
                         devices=2).check()
    diff = max_rel_diff(resumed.losses(), runs("zero2_dp2").losses()[EPOCH_STEPS:])
    print(f"resumed at step {EPOCH_STEPS}: within {diff:.2e} of the uninterrupted run")
    assert diff <= 1e-6


def test_a_killed_rank_is_named_at_once_and_the_job_resumes(tmp_path, cache_dir, runs):
    """ZeRO-2 on 2 ranks, bound 10 s; rank 1 is SIGKILLed at step 12. Rank 0's collective fails at once; it names
    rank 1 (found dead in /proc on this host; on another host the heartbeat names it within the bound) and stops with
    exit code 75, before Lightning's launcher (which polls its children every 5 s) kills it without a word."""
    killed = tmp_path / "killed.json"
    args = [*job(GLOBAL_BATCH // 2), *ZERO2, f"--trainer.strategy.heartbeat_timeout={BOUND}",
            "--trainer.enable_checkpointing=true", "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
            "--trainer.callbacks.save_top_k=-1", f"--trainer.callbacks.dirpath={tmp_path / 'run' / 'ckpt'}",
            "--trainer.callbacks+=tests.probes.FreezeAt", "--trainer.callbacks.rank=1", "--trainer.callbacks.step=12",
            f"--trainer.callbacks.path={killed}", "--trainer.callbacks.sig=SIGKILL"]
    run = launch_cli(tmp_path / "run", cache_dir, args, devices=2, timeout=180)
    reaction = time.time() - json.loads(killed.read_text())["time"]
    pid = json.loads(killed.read_text())["pid"]
    print(f"rank 1 killed at step 12: rank 0 stopped {reaction:.1f} s later (bound {BOUND:g} s), exit {run.returncode}")
    # the heartbeat looks every bound/6 s, Lightning's launcher every 5 s: whichever comes first names rank 1
    by_heartbeat = re.search(rf"lightning-par: rank 1 \(\S+, pid {pid}\) died \(its process is gone\)", run.log)
    by_launcher = f"[rank: 1] Child process with PID {pid} terminated with code -9" in run.log
    print(f"named by {'the heartbeat' if by_heartbeat else 'the launcher' if by_launcher else 'nobody'}")
    assert (by_heartbeat and run.returncode == EXIT_CODE) or (by_launcher and run.returncode == -9), run.log[-3000:]
    assert reaction <= BOUND / 2  # found at once, not by waiting out the bound (the launcher's wind-down included)
    assert not list((run.root / "ckpt").glob("*.partial")) and sorted(p.name for p in (run.root / "ckpt").iterdir()) \
        == ["epoch=0-step=10.ckpt"]
    resumed = launch_cli(tmp_path / "resumed", cache_dir,
                         [*job(GLOBAL_BATCH // 2), *ZERO2, f"--ckpt_path={run.root / 'ckpt' / 'epoch=0-step=10.ckpt'}"],
                         devices=2).check()
    diff = max_rel_diff(resumed.losses(), runs("zero2_dp2").losses()[EPOCH_STEPS:])
    print(f"resumed at step {EPOCH_STEPS}: within {diff:.2e} of the uninterrupted run")
    assert diff <= 1e-6


def test_the_bound_is_checked():
    with pytest.raises(LayoutError, match=r"heartbeat_timeout=-1 must be a number of seconds > 0, or None/0"):
        ZeroStrategy(stage=2, heartbeat_timeout=-1)
    assert ZeroStrategy(stage=2)._heartbeat_timeout == 60.0
    assert ZeroStrategy(stage=2, heartbeat_timeout=0)._heartbeat_timeout is None
