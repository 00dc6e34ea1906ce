"""One error, once (issue 27): ``lightning-par fit`` given an input it cannot take ends with one ``error:`` line that
names the cause and the fix, and that line is the last thing printed -- before launch (in the launching process)
and at setup (on every rank: no ``Cannot copy out of meta tensor`` from the teardown after it, no traceback).
``LIGHTNING_PAR_TRACEBACK=1`` gives the traceback instead (docs/cli.md).

The bad inputs of issue 27 that reach ``fit``: a model whose blocks are not in an nn.ModuleList, without
``block_types=``, under ZeRO-3 (launched, default set, ~15 s) and under a pipeline (full set); a model without a
``tp_plan`` under ``megatron_tp2`` (full set); a layout that does not fit the world (in this process). (The refusals
of a fused projection split ``colwise`` and of attention reshaping with the global head count are setup-time
LayoutErrors too, and take the same path.) tests/launch/test_bad_inputs.py's own bad inputs end the same way.
"""

from __future__ import annotations

import pytest

from lightning_par import LayoutError
from lightning_par.cli import TRACEBACK_ENV, main
from tests.harness import launch_command

CPU_JOB = ["--model=lightning_par.examples.GPTLightningModule", "--model.preset=tiny",
           "--data=lightning_par.data.TextDataModule", "--trainer.accelerator=cpu"]
TOO_FEW_RANKS = ["--trainer.devices=2", "--trainer.strategy=lightning_par.LayoutStrategy", "--trainer.strategy.dp=3"]
SAID = ('lightning-par: error: dp=3 x tp=1 x pp=1 = 3, but the world size is 2. Set dp="auto" (it becomes 2) or '
        "change devices x num_nodes to 3.")


def _last_lines(text: str, n: int = 1) -> list[str]:
    return [line for line in text.splitlines() if line.strip()][-n:]


def test_an_error_before_launch_is_one_line(capsys, monkeypatch):
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", *CPU_JOB, *TOO_FEW_RANKS])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert _last_lines(err) == [SAID]
    assert "Traceback" not in err


def test_the_traceback_on_request(monkeypatch):
    monkeypatch.setenv(TRACEBACK_ENV, "1")
    with pytest.raises(LayoutError, match=r"^dp=3 x tp=1 x pp=1 = 3, but the world size is 2\."):
        main(["fit", *CPU_JOB, *TOO_FEW_RANKS])


#: strategy -> the error every rank ends with, for tests.launch.readme_model.SequentialModule (blocks in an
#: nn.Sequential, large enough that configure_model leaves tensors on the meta device); ZeRO-3 alone shards such a
#: model as one unit (tests/launch/test_zero_any_model.py), a pipeline needs its blocks
SETUP_ERRORS = {
    "pipeline2_1f1b": "lightning-par: error: found no repeated blocks in SequentialModule: it declares no "
                      "`pipeline_units()`",
    "megatron_tp2": "lightning-par: error: SequentialModule declares no tensor-parallel plan, so tp=2 cannot split "
                    "it. Add a `tp_plan`",
}


@pytest.mark.parametrize("strategy", [pytest.param(s, marks=pytest.mark.launch(ranks=2, full=s != "pipeline2_1f1b"))
                                      for s in SETUP_ERRORS])  # a launch per bad input: pp2 by default
def test_a_setup_error_is_the_last_line_on_every_rank(strategy, tmp_path, cache_dir):
    argv = ["fit", "--model=tests.launch.readme_model.SequentialModule", "--model.dim=128",
            "--data=lightning_par.data.TextDataModule", "--data.seq_len=16", "--data.max_corpus_bytes=100000",
            f"--data.cache_dir={cache_dir}", "--trainer.accelerator=cpu", "--trainer.devices=2",
            f"--trainer.strategy={strategy}", "--trainer.max_steps=2", "--sample_tokens=0"]
    run = launch_command(tmp_path, cache_dir, argv, timeout=300)
    assert run.returncode == 1, run.log[-3000:]
    last = _last_lines(run.log, 2)
    assert all(line.startswith(SETUP_ERRORS[strategy]) for line in last), run.log[-3000:]  # rank 0 and rank 1
    assert last[0] == last[1]
    if strategy != "megatron_tp2":
        assert "block_types=[YourBlock]" in last[0]  # the fix, named
    assert "meta tensor" not in run.log and "Traceback" not in run.log, run.log[-3000:]


# -- issue 41: a held MASTER_PORT, a non-UTF-8 corpus -------------------------------------------------------------
def test_a_rank_that_reaches_another_jobs_store_stops_before_joining_it(monkeypatch):
    """A rank started by this job's rank 0 (it holds the job id) that reaches another job's store on MASTER_PORT
    stops at once with the one line, having written nothing there; rank 0 on a port another process listens on
    gives the same line, not torch's EADDRINUSE."""
    import os
    import socket
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from lightning_par.run import job_store as js
    from tests.harness import free_port

    port = free_port()
    other = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    other.set(js.JOB_KEY, "4242-the-other-job")
    keys = other.num_keys()
    monkeypatch.setenv(js.JOB_ENV, f"{os.getppid()}-this-job")  # as rank 0 of Lightning's launcher hands it down
    start = time.monotonic()
    with pytest.raises(js.PortInUseError, match=rf"^MASTER_PORT={port} \(rank 1\): the store there is another "
                                                rf"job's .*Pick a free port: MASTER_PORT=.*--master_port.*"
                                                r"--rdzv-endpoint"):
        js.job_store("127.0.0.1", port, 1, 2, timedelta(seconds=60))
    assert time.monotonic() - start < 5
    assert other.num_keys() == keys  # nothing of this job in the other's store
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        assert js.port_in_use(taken) and not js.port_in_use(free_port())
        with pytest.raises(js.PortInUseError, match=rf"^MASTER_PORT={taken} is in use on this machine: another job"):
            js.job_store("127.0.0.1", taken, 0, 2, timedelta(seconds=60))


@pytest.mark.launch(ranks=4, full=True)
def test_a_second_job_on_a_held_port_fails_in_seconds_and_the_first_trains_on(tmp_path, cache_dir):
    """Two 2-rank fits with the same MASTER_PORT: the second ends within seconds with the one line (exit 1, no
    traceback, no rank left behind); the first, already holding the port, finishes with exit 0."""
    import os
    import subprocess
    import sys
    import time

    from tests.harness import base_env, free_port, launching

    launching(4)
    port = str(free_port())
    argv = [sys.executable, "-m", "lightning_par.cli", "fit", *CPU_JOB, "--data.seq_len=16",
            "--data.max_corpus_bytes=100000", f"--data.cache_dir={cache_dir}", "--trainer.devices=2",
            "--trainer.strategy=zero2", "--sample_tokens=0", "--trainer.enable_checkpointing=false"]
    env = {**base_env(cache_dir), "MASTER_PORT": port}
    first_log = tmp_path / "first.log"
    first = subprocess.Popen([*argv, "--trainer.max_steps=40"], cwd=tmp_path, env=env, stdout=first_log.open("w"),
                             stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240
    while "Initializing distributed: GLOBAL_RANK: 1" not in first_log.read_text() and time.monotonic() < deadline:
        time.sleep(0.5)  # (rank 1 of the first job has joined its store)
    start = time.monotonic()
    second = subprocess.run([*argv, "--trainer.max_steps=2"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=120)
    seconds = time.monotonic() - start
    print(f"the second job ended after {seconds:.1f} s")
    out = second.stdout + second.stderr
    assert second.returncode == 1 and "Traceback" not in out and "EADDRINUSE" not in out, out[-3000:]
    assert _last_lines(out) == [f"lightning-par: error: MASTER_PORT={port} is in use on this machine: another job "
                                "holds this port (its process group's store), and this job's ranks must not join "
                                "it. Pick a free port: MASTER_PORT=<free port> (or leave MASTER_PORT unset: "
                                "Lightning then picks a free one); under torchrun, --master_port=<free port> or "
                                "--rdzv-endpoint=<host>:<free port>."]
    assert seconds < 60
    assert first.wait(timeout=400) == 0, first_log.read_text()[-3000:]
    assert os.environ.get("MASTER_PORT") != port


def test_a_corpus_that_is_not_utf8_stops_every_rank_with_the_same_line(tmp_path, capsys, monkeypatch):
    """Under a multi-rank Trainer, rank 0's ``prepare_data`` keeps the error for ``setup`` (the other ranks wait at
    Lightning's barrier after it), where every rank's own look at the files finds the same one: each rank raises the
    same DataError, which ``lightning-par`` prints as one line -- no rank blames rank 0 in a traceback. Two data
    modules stand for rank 0 and rank 1."""
    from types import SimpleNamespace

    from lightning_par.data import DataError, TextDataModule

    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "fine text here"}\n' * 20 + b'{"text": "caf\xe9 au lait"}\n')
    said = []
    for rank in (0, 1):
        module = TextDataModule(data_files=str(latin), seq_len=8, cache_dir=str(tmp_path / "cache"))
        module.trainer = SimpleNamespace(world_size=2)
        if rank == 0:
            module.prepare_data()  # kept: rank 1 is at the barrier after this hook
        with pytest.raises(DataError) as failure:
            module.setup("fit")
        said.append(str(failure.value))
    assert said[0] == said[1] == (f"{latin}, line 21, column 14: byte 0xe9 is not UTF-8, which JSON and CSV files "
                                  "must be; convert the file (e.g. iconv -f latin1 -t utf-8) or fix that line")
    monkeypatch.delenv(TRACEBACK_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--model=lightning_par.examples.GPTLightningModule", "--model.preset=tiny",
              "--data=lightning_par.data.TextDataModule", f"--data.data_files={latin}", "--data.seq_len=8",
              f"--data.cache_dir={tmp_path / 'cache'}", "--trainer.accelerator=cpu", "--trainer.devices=1",
              "--trainer.max_steps=1", "--sample_tokens=0", "--trainer.logger=false",
              "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert _last_lines(err) == [f"lightning-par: error: {said[0]}"] and "Traceback" not in err


def _join_without_a_job_id(rank: int, world: int, port: int, out: str) -> None:
    """Rank 0 through lightning-par's own store, the other rank through torch's env:// rendezvous (a SLURM task, a
    rank of another machine: no job id), then one all-reduce."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    from lightning_par.run.job_store import JOB_ENV, job_store

    os.environ.pop(JOB_ENV, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    timeout = datetime.timedelta(seconds=30)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout,
                            **job_store("127.0.0.1", port, rank, world, timeout))
    total = torch.ones(1) * (rank + 1)
    dist.all_reduce(total)
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(str(total.item()))
    dist.destroy_process_group()


@pytest.mark.launch(ranks=2)
def test_rank_zeros_store_meets_ranks_that_rendezvous_by_env(tmp_path):
    """Ranks without a job id join through torch's env:// rendezvous, which puts the group's keys under a prefix; rank
    0's own store must give them the same (without it every rank waited in gloo's connection: the SLURM requeue of
    tests/launch/test_elastic.py hung)."""
    from tests.harness import free_port, spawn

    spawn(_join_without_a_job_id, (2, free_port(), str(tmp_path)), 2)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["3.0", "3.0"]
