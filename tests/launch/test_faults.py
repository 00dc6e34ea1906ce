"""A rank that freezes or dies does not leave the others waiting: they stop within the heartbeat bound, naming it,
and the job resumes from its last checkpoint with the losses of an uninterrupted run.

A frozen rank (SIGSTOP) is the hard case: it holds its sockets open, so the others' collectives neither fail nor
return until the process group's timeout (30 minutes by default). A killed rank's peers' collectives fail at once, and
they name it (the heartbeat finds its process gone) before they stop.
"""

import json
import math
import os
import re
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from lightning_par import LayoutError, ZeroStrategy
from lightning_par.run.heartbeat import EXIT_CODE, Heartbeat
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, job, launch_of
from tests.harness import free_port, launch_cli, max_rel_diff

BOUND = 10.0  # seconds: the heartbeat_timeout of the test (default 60)
ZERO2 = ["--trainer.strategy=lightning_par.ZeroStrategy", "--trainer.strategy.stage=2"]


@launch_of("zero2_dp2")
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


@launch_of("zero2_dp2", full=True)
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


@pytest.mark.launch(ranks=2, full=True)
def test_a_frozen_rank_0_is_named_and_the_others_stop_within_the_bound(tmp_path, cache_dir):
    """ZeRO-2 on 2 ranks, bound 10 s; rank 0 -- whose process hosts the job's store, so the store freezes with it --
    freezes at step 3. Rank 1's store calls then block for good; its watch thread, which makes none, names rank 0
    when the store has not answered for the bound. Rank 0 is the launcher's main process and rank 1 its child: rank 1's
    exit is seen in /proc (a zombie its frozen parent cannot reap, with its exit status)."""
    frozen = tmp_path / "frozen.json"
    args = [*job(GLOBAL_BATCH // 2), *ZERO2, f"--trainer.strategy.heartbeat_timeout={BOUND}",
            "--trainer.callbacks+=tests.probes.FreezeAt", "--trainer.callbacks.rank=0", "--trainer.callbacks.step=3",
            f"--trainer.callbacks.path={frozen}"]
    launched: dict = {}
    launcher = threading.Thread(target=lambda: launched.update(
        run=launch_cli(tmp_path / "run", cache_dir, args, devices=2, timeout=180)))
    launcher.start()
    rank1 = status = stopped = None
    try:
        while launcher.is_alive() and not frozen.exists():
            time.sleep(0.1)
        time.sleep(0.2)  # the file is written before the freeze; let the write finish
        info = json.loads(frozen.read_text())
        (rank1,) = [child for child in _children(info["pid"]) if "lightning_par.cli" in _cmdline(child)]
        while time.time() < info["time"] + BOUND + 30:
            stat = _stat(rank1)
            if stat is None or stat[0] in "ZX":
                stopped, status = time.time(), stat and int(stat[-1])  # exit status as waitpid reports it
                break
            time.sleep(0.1)
    finally:
        if frozen.exists():  # nobody else may end the frozen rank 0: SIGKILL ends its launch (and any child left)
            for pid in (json.loads(frozen.read_text())["pid"], rank1):
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, TypeError):
                    pass
        launcher.join()
    run = launched["run"]
    assert stopped is not None, f"rank 1 still running {BOUND + 30:g} s after rank 0 froze:\n{run.log[-3000:]}"
    reaction = stopped - info["time"]
    print(f"rank 0 frozen at step 3: rank 1 stopped {reaction:.1f} s later (bound {BOUND:g} s), "
          f"exit {status and status >> 8}")
    assert status is not None and status >> 8 == EXIT_CODE, run.log[-3000:]
    assert re.search(rf"\[rank 1\] lightning-par: rank 0 \(\S+, pid {info['pid']}\), which hosts the job's store at "
                     r"\S+, stopped answering: the store has not answered for \d+ s", run.log), run.log[-3000:]
    # its last answer came at most one exchange before the freeze; then the watcher needs up to one interval more
    assert BOUND - BOUND / 6 <= reaction <= BOUND + 5


def _children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat from the state on (the last one: the exit status of a zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None


def test_the_bound_is_checked():
    """A bound shorter than three beats (or not a number) is refused where the strategy is made."""
    for bad in (-1, 0.01, 1, True, "10", math.inf, math.nan):
        with pytest.raises(LayoutError, match=r"heartbeat_timeout=.* must be a number of seconds >= 1.5 \(at least "
                                              r"three beats"):
            ZeroStrategy(stage=2, heartbeat_timeout=bad)
    assert ZeroStrategy(stage=2)._heartbeat_timeout == 60.0
    assert ZeroStrategy(stage=2, heartbeat_timeout=1.5)._heartbeat_timeout == 1.5
    assert ZeroStrategy(stage=2, heartbeat_timeout=0)._heartbeat_timeout is None
    assert ZeroStrategy(stage=2, heartbeat_timeout=None)._heartbeat_timeout is None


def test_a_forged_verdict_is_ignored_and_a_verdict_is_printed_without_control_characters(one_process_group,
                                                                                         monkeypatch, capfd):
    """Rank 1's heartbeat against a TCPStore in this process (rank 0 never beats; its bound of 30 s outlasts the
    test). Another client writes a verdict and "rank 0 failed" under the key names used before the per-run token:
    nothing happens. The run's own verdict key (known here from the object) is read, and its text printed clean."""
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    heartbeat = Heartbeat(rank=1, world_size=2, host="127.0.0.1", port=port, timeout=30, interval=0.1)
    exits: list[int] = []

    def exit_(code: int) -> None:  # instead of ending pytest: record, and end the heartbeat's threads
        exits.append(code)
        heartbeat._stop.set()

    monkeypatch.setattr(heartbeat, "_exit", exit_)
    heartbeat.start()
    try:
        assert re.fullmatch(r"lightning_par/heartbeat/[0-9a-f]{32}/", heartbeat.prefix)
        stranger = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=10))
        for prefix in ("lightning_par/heartbeat/0/", "lightning_par/heartbeat/1/", "lightning_par/heartbeat/"):
            stranger.set(f"{prefix}verdict", b"\x1b[2J\x1b[31mthe job is over")
            stranger.set(f"{prefix}0", b"failed")
        time.sleep(1.0)  # ten exchanges
        assert not exits, capfd.readouterr().err
        stranger.set(heartbeat._verdict_key(), b"rank 0 froze\x1b[31m\r\nforged line\x07" + b"x" * 2000)
        deadline = time.monotonic() + 5
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exits == [EXIT_CODE]
        err = capfd.readouterr().err
        (line,) = [line for line in err.splitlines() if "lightning-par:" in line]  # one line: no newline let in
        assert not re.search(r"[\x00-\x1f\x7f]", err.replace("\n", ""))
        verdict = line.split("lightning-par: ", 1)[1].split(". Stopping this rank")[0]
        assert verdict.startswith("rank 0 froze [31m  forged line xxx") and verdict.endswith("x...")
        assert len(verdict) == 500  # capped
    finally:
        heartbeat.stop()
        del server
