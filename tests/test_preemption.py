"""Preemption (issue 30): SIGTERM ends the run at the next optimizer step on every rank, with a complete checkpoint of
that step and exit code 75; torchrun --max-restarts starts the next attempt, which resumes from it exactly."""

import json
import re

from lightning_par.parallel.preemption import EXIT_CODE
from tests.conftest import EPOCH_STEPS, GLOBAL_BATCH, PARITY_STEPS, job
from tests.harness import launch_torchrun, max_rel_diff


def test_sigterm_to_one_rank_stops_every_rank_saves_and_torchrun_resumes_exactly(tmp_path, cache_dir, runs):
    """ZeRO-2 on 2 ranks under ``torchrun --max-restarts=1``; rank 1 alone gets SIGTERM inside step 12 of the first
    attempt (between its backward and its optimizer step: rank 0 is then in its own step). Both ranks stop after
    step 12 -- the ranks agree on a flag, so a signal to any one rank stops all -- save ``preempted-...-step=13``
    (no checkpoint of the default every-5-steps was due), exit 75; torchrun restarts the job, which resumes from that
    checkpoint and ends with exit 0 and the uninterrupted run's losses."""
    signalled = tmp_path / "signalled.json"
    args = [*job(GLOBAL_BATCH // 2), "--trainer.strategy=zero2", "--trainer.enable_checkpointing=true",
            "--checkpoint_every_n_steps=5", "--trainer.callbacks+=tests.probes.SignalAt",
            "--trainer.callbacks.rank=1", "--trainer.callbacks.step=12", f"--trainer.callbacks.path={signalled}"]
    run = launch_torchrun(tmp_path / "run", cache_dir, args, nnodes=1, nproc_per_node=2, timeout=300,
                          torchrun_args=("--max-restarts=1",))
    print(f"torchrun with a preemption: {run.seconds:.1f} s, exit {run.returncode}")
    run.check()
    assert json.loads(signalled.read_text())["pid"] > 0
    saved = re.search(r"lightning-par: SIGTERM \(received by rank 1\): stopped after step 13 on every rank; "
                      r"saved (\S+preempted-epoch=1-step=13\.ckpt); exit code " + str(EXIT_CODE), run.log)
    assert saved, run.log[-4000:]
    assert f"exitcode: {EXIT_CODE}" in run.log or f"exit code {EXIT_CODE}" in run.log
    assert re.search(r"lightning-par: restart 1 of this job \(TORCHELASTIC_RESTART_COUNT=1\): resuming from "
                     r"\S+/version_0/checkpoints/preempted-epoch=1-step=13\.ckpt", run.log), run.log[-3000:]
    ckpts = run.root / "tb" / "lightning_logs" / "version_0" / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert not any(name.startswith("preempted") for name in names), names  # removed once newer ones were saved
    losses = run.scalars()["train/loss"]
    reference = runs("zero2_dp2").losses()
    assert len(losses) == len(reference) == PARITY_STEPS, (sorted(losses), len(reference))
    diff = max_rel_diff([losses[s] for s in sorted(losses)[EPOCH_STEPS:]], reference[EPOCH_STEPS:])
    print(f"steps {EPOCH_STEPS}-19 after the preemption: within {diff:.2e} of the uninterrupted run")
    assert diff <= 1e-6
