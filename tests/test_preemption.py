"""Preemption (issue 30): SIGTERM ends the run at the next optimizer step on every rank, with a complete checkpoint of
that step and exit code 75; torchrun --max-restarts starts the next attempt, which resumes from it exactly."""

import json
import re

import pytest

from lightning_par.parallel.preemption import EXIT_CODE
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS, job
from tests.harness import launch_torchrun, max_rel_diff

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
    assert re.search(rf"lightning-par: SIGTERM \(received by rank {rank}\): stopped after step {saved_step} on every "
                     rf"rank; saved \S+/version_0/checkpoints/{name}; exit code {EXIT_CODE}", run.log), run.log[-4000:]
    assert f"exitcode: {EXIT_CODE}" in run.log, run.log[-4000:]  # torchrun saw the restartable code
    assert re.search(r"lightning-par: restart 1 of this job \(TORCHELASTIC_RESTART_COUNT=1\): resuming from "
                     rf"\S+/version_0/checkpoints/{name}", run.log), run.log[-3000:]
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
