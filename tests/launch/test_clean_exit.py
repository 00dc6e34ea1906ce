"""A run that completed exits 0, every time (issue 18): no "terminate called without an active exception" at exit.

That abort is the C++ runtime's answer to a thread that is inside C++ when the interpreter finalizes (see
lightning_par/run/shutdown.py): the first test makes it happen on purpose, with a daemon thread in a c10d store
call, and shows that the engine's exit sequence prevents it. The others repeat short tensor-parallel and 3D runs
through the CLI (two of each in the full run: every checked launch of both sets must exit 0 too, and the full set checks
hundreds)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.harness import REPO, base_env, launch_cli

ABORT = "terminate called without an active exception"

#: a daemon thread waits on a store key that never comes, with a deadline 1.5 s away; the main thread ends at once
STORE_CALL_AT_EXIT = textwrap.dedent("""
    import sys, threading, time
    from datetime import timedelta
    import torch.distributed as dist
    from lightning_par.run import shutdown

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=1.5))

    def wait_for_a_key():
        try:
            client.get("never set")
        except Exception:
            pass

    thread = threading.Thread(target=wait_for_a_key, daemon=True)
    thread.start()
    time.sleep(0.2)
    if sys.argv[1] == "engine":  # what the heartbeat does with a thread that outlives its deadline
        shutdown.straggler(thread)
        shutdown.close_at_exit()
    print("main thread done", flush=True)
""")


@pytest.mark.full  # CLI runs must still exit 0
def test_a_thread_inside_a_store_call_at_exit_aborts_unless_exit_waits_for_it(tmp_path):
    script = tmp_path / "store_call_at_exit.py"
    script.write_text(STORE_CALL_AT_EXIT)
    codes = {}
    for mode in ("plain", "engine"):
        done = subprocess.run([sys.executable, str(script), mode], cwd=REPO, env=base_env(tmp_path),
                              capture_output=True, text=True, timeout=120)
        codes[mode] = (done.returncode, ABORT in done.stderr)
        assert "main thread done" in done.stdout, done.stderr[-2000:]
    assert codes["plain"] == (-6, True), codes  # SIGABRT: the failure this guards against, reproduced
    assert codes["engine"] == (0, False), codes


#: a finished run's exit code (here 75, a preemption's) and a SIGTERM that comes during the exit handler (torchrun
#: sends one to every worker still running once one has exited non-zero); the handler registered first runs last
SIGTERM_AT_EXIT = textwrap.dedent("""
    import atexit, os, signal, sys, time
    import torch.distributed as dist
    from lightning_par.run import shutdown

    atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.2)))
    if sys.argv[1] == "engine":
        dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=0, world_size=1)
        shutdown.close_at_exit()
    sys.exit(75)
""")


def test_a_sigterm_during_exit_keeps_the_runs_exit_code(tmp_path):
    """Seen in benchmarks/preemption_moments.py: after a preemption the first rank exits 75, torchrun SIGTERMs the
    others, still finalizing, and they reported -15. From the engine's exit handler on, SIGTERM is ignored."""
    script = tmp_path / "sigterm_at_exit.py"
    script.write_text(SIGTERM_AT_EXIT)
    codes = {mode: subprocess.run([sys.executable, str(script), mode, str(tmp_path / "store")], cwd=REPO,
                                  env=base_env(tmp_path), capture_output=True, text=True, timeout=120).returncode
             for mode in ("plain", "engine")}
    assert codes == {"plain": -15, "engine": 75}, codes


SHORT = ["--trainer.max_steps=3", "--data.batch_size=8", "--trainer.limit_val_batches=0", "--sample_tokens=0"]
LAYOUTS = {"tp2": (2, "megatron_tp2"), "tp2_pp2": (4, "hybrid3d_tp2_pp2")}


@pytest.mark.launch(ranks=4, full=True)  # the default set's CLI launches end through the same exit
@pytest.mark.parametrize("repeat", range(2))
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_finished_run_exits_0(tmp_path, cache_dir, name, repeat):
    devices, strategy = LAYOUTS[name]
    run = launch_cli(tmp_path, cache_dir, [*SHORT, f"--trainer.strategy={strategy}"], devices=devices)
    assert "`Trainer.fit` stopped: `max_steps=3` reached" in run.log, run.log[-4000:]
    assert ABORT not in run.log, run.log[-4000:]
    assert "not every rank reached the end of the run" not in run.log  # every rank destroyed its group at exit
    assert run.returncode == 0, run.log[-4000:]
    assert len(run.losses()) == 3
