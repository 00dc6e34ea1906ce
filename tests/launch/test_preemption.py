"""Preemption (issue 30): SIGTERM ends the run at the next optimizer step on every rank, with a complete checkpoint of
that step and exit code 75; torchrun --max-restarts starts the next attempt, which resumes from it exactly."""

import json
import re
import time

import pytest

from lightning_par.run.preemption import EXIT_CODE
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS, job
from tests.harness import launch_torchrun, max_rel_diff, preempted_at, restarted_from, torchrun_first_failure

#: name -> (ranks, strategy arguments, per-rank batch, reference run, signalled rank, step, moment, saved step, rtol)
CASES = {
    # rank 1 alone, inside step 12 (between its backward and its optimizer step; rank 0 is in its own step)
    "zero2_mid_step": (2, ["--trainer.strategy=zero2"], GLOBAL_BATCH // 2, "zero2_dp2", 1, 12, "step", 13, 1e-6),
    # rank 0 inside the step-10 save (the others are writing theirs or wait at its barrier)
    "zero2_mid_sync_save": (2, ["--trainer.strategy=zero2"], GLOBAL_BATCH // 2, "zero2_dp2", 0, 10, "save", 10,
                            1e-6),
    # rank 1 at the start of the step after an async save, still being written
    "zero2_mid_async_save": (2, ["--trainer.strategy=zero2", "--trainer.strategy.async_save=true"], GLOBAL_BATCH // 2,
                             "zero2_dp2", 1, 10, "after_save", 11, 1e-6),
    # the last pipeline stage, inside step 12
    "pp2_mid_step": (2, ["--trainer.strategy=pipeline2_1f1b"], GLOBAL_BATCH, "pp2_1f1b", 1, 12, "step", 13, 1e-6),
    # tp2 x pp2 on 4 ranks, rank 2 inside the step-10 save; against one process (the 3D parity tolerance)
    "tp2_pp2_mid_sync_save": (4, ["--trainer.strategy=hybrid3d", "--trainer.strategy.tp=2",
                                  "--trainer.strategy.pp=2"], GLOBAL_BATCH, "single", 2, 10, "save", 10, 1e-5),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.launch(ranks=ranks, full=c != "zero2_mid_step"))
                                  for c, (ranks, *_) in CASES.items()])
def test_sigterm_stops_every_rank_saves_and_torchrun_resumes_exactly(tmp_path, cache_dir, runs, case):
    """Under ``torchrun --max-restarts=1`` (checkpoints every 5 steps, 10-step epochs), one rank gets SIGTERM at the
    case's moment of the first attempt. Every rank stops after the same step -- the ranks agree on a flag, so a
    signal to any one rank stops all -- saves ``preempted-...-step=N``, exits 75; torchrun restarts the job, which
    resumes from that checkpoint in the same run directory, removes it once it saved a newer one, and ends with exit
    0 and the uninterrupted run's losses. ``zero2_mid_step`` in the default run, the others with ``--full``."""
    ranks, strategy, batch, reference_name, rank, step, moment, saved_step, rtol = CASES[case]
    signalled = tmp_path / "signalled.json"
    args = [*job(batch), *strategy, "--trainer.enable_checkpointing=true", "--checkpoint_every_n_steps=5",
            "--trainer.callbacks+=tests.probes.SignalAt", f"--trainer.callbacks.rank={rank}",
            f"--trainer.callbacks.step={step}", f"--trainer.callbacks.moment={moment}",
            f"--trainer.callbacks.path={signalled}"]
    run = launch_torchrun(tmp_path / "run", cache_dir, args, nnodes=1, nproc_per_node=ranks, timeout=420,
                          torchrun_args=("--max-restarts=1",))
    print(f"{case}: torchrun with a preemption: {run.seconds:.1f} s, exit {run.returncode}")
    run.check()
    sent = json.loads(signalled.read_text())["time"]
    epoch = (saved_step - 1) // EPOCH_STEPS
    name = rf"preempted-epoch={epoch}-step={saved_step}\.ckpt"
    stopped = preempted_at(run.log)
    assert stopped is not None and stopped[:2] == (rank, saved_step), run.log[-4000:]
    assert re.search(rf"/version_0/checkpoints/{name}$", stopped[2]), stopped
    assert f"exit code {EXIT_CODE}, so torchrun" in run.log
    assert torchrun_first_failure(run.log) == EXIT_CODE, run.log[-4000:]  # torchrun saw the restartable code
    assert restarted_from(run.log) == stopped[2], run.log[-3000:]
    versions = run.root / "tb" / "lightning_logs"
    first, second = sorted(versions.glob("version_0/events.out.tfevents.*"), key=lambda p: int(p.name.split(".")[3]))
    restarted = int(second.name.split(".")[3]) - sent
    print(f"{case}: the second attempt logged from {restarted:.0f} s after the signal")
    names = sorted(p.name for p in (versions / "version_0" / "checkpoints").iterdir())
    assert not any(n.startswith("preempted") for n in names), names  # removed once newer ones were saved
    losses = run.scalars()["train/loss"]
    reference = runs(reference_name).losses()
    assert len(losses) == len(reference) == PARITY_STEPS, (sorted(losses), len(reference))
    diff = max_rel_diff([losses[s] for s in sorted(losses)], reference)
    print(f"{case}: steps 0-19 with the preemption at step {saved_step}: within {diff:.2e} of the uninterrupted run")
    assert diff <= rtol


def test_after_a_preemption_a_second_sigterm_is_only_recorded():
    """Once the run raises :class:`Preempted`, the flag-only handler stays through Lightning's teardown (where an
    async save still commits): a second SIGTERM -- the scheduler again, torchrun closing the ranks -- never runs
    Lightning's handler, which broadcasts over the process group from inside the handler. Any other exception puts
    back the handler that was there before."""
    import os
    import signal
    from types import SimpleNamespace

    from lightning_par.run.preemption import Preempted, PreemptionCheckpoint

    trainer = SimpleNamespace(checkpoint_callback=None)
    before = signal.getsignal(signal.SIGTERM)
    lightnings = lambda signum, frame: None  # noqa: E731 -- stands for Lightning's handler
    try:
        for exception in ("preempted", "other"):
            signal.signal(signal.SIGTERM, lightnings)
            callback = PreemptionCheckpoint()
            callback.on_train_start(trainer, None)
            callback._pending = Preempted("stopped", None)
            raised = callback._pending if exception == "preempted" else RuntimeError("boom")
            callback.on_exception(trainer, None, raised)
            if exception == "preempted":
                assert signal.getsignal(signal.SIGTERM) == callback._handler
                os.kill(os.getpid(), signal.SIGTERM)  # recorded, nothing else
                assert callback.received is not None and callback.received[0] == signal.SIGTERM
            else:
                assert signal.getsignal(signal.SIGTERM) is lightnings
    finally:
        signal.signal(signal.SIGTERM, before)


def test_the_moments_cover_every_layout_and_kind_and_the_agreed_step_follows_the_signal():
    """benchmarks/preemption_moments.py draws its moments so that any 9 in a row hold every (layout, kind) pair once
    and the first 3 every layout and every kind; a signal inside a step stops after that step, one in a batch's end
    hooks after that step or the next (if every rank had agreed there already)."""
    from benchmarks import preemption_moments as pm

    moments = pm.draw(20, seed=30)
    assert moments == pm.draw(20, seed=30)
    pairs = [(m["layout"], m["kind"]) for m in moments]
    assert len(set(pairs[:9])) == len(set(pairs[9:18])) == len(pm.LAYOUTS) * len(pm.KINDS)
    assert {p[0] for p in pairs[:3]} == set(pm.LAYOUTS) and {p[1] for p in pairs[:3]} == set(pm.KINDS)
    for m in moments:  # a save that is not the first, or a step with one before it; never the run's last
        assert m["step"] in (pm.SIGNALLED_SAVES if m["kind"] != "mid_step" else range(2, pm.MAX_STEPS - 2))
        assert 0 <= m["fraction"] < 1
    assert pm.expected_steps({"step_started": 7, "phase": "step"}) == [8]
    assert pm.expected_steps({"step_started": 7, "phase": "boundary"}) == [8, 9]


@pytest.mark.launch(ranks=4, full=True)
def test_sigterm_to_every_rank_at_random_moments(tmp_path):
    """SIGTERM to every rank, as a scheduler preempting the job sends it, at 3 moments of
    ``benchmarks/preemption_moments.py`` (one per layout and per kind: ZeRO-2 inside a step, pp2 inside a sync save,
    tp2 x pp2 inside an async save), each under ``torchrun --max-restarts=1``: every rank exits 75 within the
    heartbeat bound, the checkpoint is at the step the signal landed in and complete, torchrun restarts the job,
    which ends with exit 0 and the losses of an uninterrupted run (plain SGD). 6 launches, ``--full`` only; the 20
    moments' figures: docs/faults.md."""
    from benchmarks import preemption_moments as pm

    out = tmp_path / "moments.json"
    pm.main(["--moments", "3", "--dir", str(tmp_path), "--out", str(out)])
    result = json.loads(out.read_text())
    moments = result["moments"]
    assert {m["layout"] for m in moments} == set(pm.LAYOUTS) and {m["kind"] for m in moments} == set(pm.KINDS)
    for m in moments:
        print(f"{m['layout']} {m['kind']}: signal to exit {m.get('signal_to_exit_s')} s, checkpoint step "
              f"{m.get('checkpoint_step')} of {m.get('expected_steps')}, losses within {m.get('max_abs_loss_diff')}")
        assert m["ok"], (m["failed"], m.get("log_tail"))
        assert m["torchrun_first_failure"] == EXIT_CODE
        assert all(code in (EXIT_CODE, None) for code in m["first_attempt_exit_codes"])
        assert m["signal_to_exit_s"] <= pm.HEARTBEAT_S
        assert m["checkpoint_step"] in m["expected_steps"] and m["checkpoint_complete"]
        assert m["restarted"] and m["resumed_at_step"] == m["checkpoint_step"] and m["exit_code"] == 0
        assert m["max_abs_loss_diff"] <= 1e-5
    assert result["all_ok"]


def _group_child(ready: int, result: int) -> None:
    """A "rank" as torchrun starts it (a session of its own), with the preemption callback's sentinel."""
    import os
    import signal
    import time

    from lightning_par.run.preemption import GroupSignal

    os.setsid()
    os.environ["TORCHELASTIC_RUN_ID"] = "test"
    got = []
    signal.signal(signal.SIGTERM, lambda *args: got.append(1))
    group = GroupSignal()
    group.start()
    os.write(ready, b"r")
    while not got:
        time.sleep(0.01)
    os.write(result, str(group.reached_group(wait=2)).encode())
    group.stop()


@pytest.mark.launch(ranks=2)
def test_a_sigterm_to_the_whole_process_group_is_told_from_one_to_the_rank_only():
    """torchrun's agent, stopped itself, sends SIGTERM to each worker's process group (its own session) and restarts
    nothing; a scheduler or a user signalling a rank reaches that process only, and the agent restarts the job. Two
    "ranks" in a new session each (forked): one gets ``kill(pid)``, one ``killpg(pid)``; the sentinel of
    :class:`GroupSignal` tells them apart (issue 41)."""
    import os
    import signal

    from tests.harness import launching

    launching(2)
    said = {}
    for kill in ("kill", "killpg"):
        ready, result = os.pipe(), os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                _group_child(ready[1], result[1])
            finally:
                os._exit(0)
        assert os.read(ready[0], 1) == b"r"
        time.sleep(0.2)  # the sentinel runs
        (os.kill if kill == "kill" else os.killpg)(pid, signal.SIGTERM)
        said[kill] = os.read(result[0], 16).decode()
        os.waitpid(pid, 0)
    assert said == {"kill": "False", "killpg": "True"}, said


def test_the_preemption_line_says_whether_a_restart_follows(monkeypatch, tmp_path):
    """The line's promise follows what will happen: torchrun restarts a job whose agent is up and has restarts left;
    an agent that got the SIGTERM itself (it is going down), or one at its last restart, restarts nothing, and
    neither does Lightning's launcher: the line names the checkpoint to resume from with ``--ckpt_path``."""
    from lightning_par.run.preemption import restart_outlook

    path = tmp_path / "preempted-epoch=1-step=13.ckpt"
    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    by_hand = f"start the job again with --ckpt_path={path} to resume from it"
    assert restart_outlook(path, None) == f"nothing restarts this launch: {by_hand}"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    assert restart_outlook(path, False) == "so torchrun --max-restarts starts the next attempt, which resumes from it"
    agent_down = restart_outlook(path, True)
    assert "the agent is going down and restarts nothing" in agent_down and agent_down.endswith(by_hand)
    assert "starts the next attempt" not in agent_down
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    last = restart_outlook(path, False)
    assert "no restart left (restart 1 of --max-restarts=1)" in last and last.endswith(by_hand)
