"""Launch multi-rank runs the way users do -- the ``lightning-par`` CLI or torchrun, in a subprocess -- and read
back what they wrote (TensorBoard scalars, per-rank reports), so one launch can be checked for many things."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: A small, fast, deterministic training job: tiny GPT on the embedded corpus, no shuffling so a single process
#: with batch B and N ranks with batch B/N see the same global batches.
TINY_JOB = [
    "--seed_everything=1234",
    "--model=lightning_par.examples.GPTLightningModule",
    "--model.preset=tiny",
    "--model.n_layers=8",  # the blocks hold ~92% of the parameters, as in a real model
    "--data=lightning_par.data.TextDataModule",
    "--data.seq_len=32",
    "--data.max_corpus_bytes=300000",
    "--data.shuffle=false",
    "--trainer.accelerator=cpu",
    "--trainer.log_every_n_steps=1",
    "--trainer.enable_checkpointing=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
]


#: set by tests/conftest.py while a test runs: called with the number of ranks a launch is about to start, it fails
#: the test unless it carries ``@pytest.mark.launch(ranks=N)`` with N at least that (None outside pytest: workers)
launch_guard: Callable[[int], None] | None = None


def launching(ranks: int) -> None:
    """Say that the running test is about to start ``ranks`` processes; every launch below calls it first, and so
    must a test that starts ranks itself (``mp.spawn``, a ``Popen`` of torchrun)."""
    if launch_guard is not None:
        launch_guard(ranks)


def _ranks_in(argv: list[str]) -> int:
    """The processes a ``lightning-par`` command line starts: ``--trainer.devices`` x ``--trainer.num_nodes`` (1 each
    when not given on the command line)."""
    def last(flag: str) -> int:
        values = [a.split("=", 1)[1] for a in argv if a.startswith(flag + "=")]
        return int(values[-1]) if values and values[-1].isdigit() else 1

    return last("--trainer.devices") * last("--trainer.num_nodes")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: variables a launcher or an in-process Trainer sets for its ranks: a launch that inherited LOCAL_RANK would be taken
#: by Lightning for an already-started rank (it starts no peer and waits for it at "Initializing distributed")
LAUNCHER_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                      "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


def base_env(cache_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        # One thread per rank: several ranks share 2 cores, and a fixed thread count keeps float reductions
        # identical between the single-process reference and the parallel runs.
        OMP_NUM_THREADS="1",
        HF_HOME=str(cache_dir / "hf_home"),
        HF_DATASETS_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    return env


@dataclass
class Run:
    """What one launch left behind."""

    root: Path
    returncode: int
    log: str
    seconds: float
    reports: list[dict] = field(default_factory=list)

    def check(self) -> Run:
        assert self.returncode == 0, f"launch failed (exit {self.returncode}); last output:\n{self.log[-6000:]}"
        return self

    def scalars(self) -> dict[str, dict[int, float]]:
        """Every TensorBoard scalar the run logged: ``{tag: {step: value}}``."""
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        out: dict[str, dict[int, float]] = {}
        for event_file in sorted(self.root.glob("tb/**/events.out.tfevents.*")):
            acc = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
            acc.Reload()
            for tag in acc.Tags()["scalars"]:
                out.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
        return out

    def state_reports(self) -> list[dict]:
        """Per-rank traffic and state-bytes reports of the StateReport probe, by rank."""
        files = sorted(self.root.glob("reports/state_rank*.json"), key=lambda p: int(p.stem.removeprefix("state_rank")))
        return [json.loads(p.read_text()) for p in files]

    def grad_norms(self) -> list[float]:
        """Global gradient norms (before clipping) of the first optimizer steps, as rank 0 saw them."""
        return json.loads((self.root / "reports" / "norms_rank0.json").read_text())

    def checkpoint(self, step: int) -> Path:
        """The checkpoint written at optimizer step ``step`` (file, or directory for sharded strategies)."""
        (path,) = sorted(self.root.glob(f"ckpt/*step={step}.ckpt"))
        return path

    def losses(self, tag: str = "train/loss", steps: int | None = None) -> list[float]:
        """The values of ``tag`` in step order; ``steps``: only those of the first ``steps`` optimizer steps (a
        reference's start, against a run of fewer steps)."""
        series = self.scalars()[tag]
        return [series[s] for s in sorted(series) if steps is None or s < steps]


def _finish(root: Path, procs: list[subprocess.Popen], logs: list[Path], start: float, timeout: float) -> Run:
    deadline = start + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.time(), 1)))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            codes.append(-9)
    log = "\n".join(p.read_text(errors="replace") for p in logs)
    return Run(root, next((c for c in codes if c), 0), log, time.time() - start, _rank_reports(root))


def _rank_reports(root: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.glob("reports/rank*.json"))]


def _report_args(root: Path) -> list[str]:
    return [
        "--trainer.callbacks+=tests.probes.RankReport",
        f"--trainer.callbacks.path={root / 'reports'}",
        f"--trainer.logger.save_dir={root / 'tb'}",
        f"--trainer.default_root_dir={root}",
    ]


def cli_argv(root: Path, cache_dir: Path, args: list[str], devices: int, command: str = "fit") -> list[str]:
    """The command line of a test job in ``root``: the tiny job, TensorBoard and rank reports, then ``args``."""
    return [command, *TINY_JOB, f"--trainer.devices={devices}", "--trainer.logger=TensorBoardLogger",
            *_report_args(root), f"--data.cache_dir={cache_dir}", *args]


def launch_cli(
    root: Path, cache_dir: Path, args: list[str], devices: int, timeout: float = 300, command: str = "fit"
) -> Run:
    """``lightning-par COMMAND`` on ``devices`` CPU processes through Lightning's own subprocess launcher."""
    return launch_command(root, cache_dir, cli_argv(root, cache_dir, args, devices, command), timeout,
                          log_name="launch.log")


def launch_cli_group(root: Path, cache_dir: Path, jobs: dict[str, list[str]], devices: int,
                     timeout: float = 900) -> dict[str, Run]:
    """The fits ``jobs`` (name -> arguments, as :func:`launch_cli` takes them), all of ``devices`` ranks, one after
    another in one launch (:func:`launch_command_group`)."""
    return launch_command_group(root, cache_dir, {name: cli_argv(root / name, cache_dir, args, devices)
                                                  for name, args in jobs.items()}, devices, timeout)


def launch_command_group(root: Path, cache_dir: Path, commands: dict[str, list[str]], devices: int,
                         timeout: float = 900) -> dict[str, Run]:
    """``lightning-par ARGV`` for each of ``commands`` (name -> ARGV, exactly as given), all of ``devices`` ranks,
    one after another in one launch of :mod:`tests.launch.cli_matrix` (one process, or one torchrun agent): one
    start-up for all. Each run is in ``root/NAME`` with its own ``launch.log``; the launch fails if one of them
    fails."""
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "jobs.json"
    spec.write_text(json.dumps([[str(root / name), argv] for name, argv in commands.items()]))
    if devices > 1:
        group = launch_matrix(root, cache_dir, "tests.launch.cli_matrix", [str(spec)], nproc=devices, timeout=timeout)
    else:
        group = launch_command_module(root, cache_dir, "tests.launch.cli_matrix", [str(spec)], timeout=timeout)
    group.check()
    return {name: Run(root / name, 0, (root / name / "launch.log").read_text(errors="replace"), group.seconds,
                      _rank_reports(root / name)) for name in commands}


def launch_torchrun(
    root: Path, cache_dir: Path, args: list[str], nnodes: int, nproc_per_node: int, timeout: float = 300,
    torchrun_args: tuple[str, ...] = (),
) -> Run:
    """One torchrun agent per node, all on this machine over loopback: the multi-node path users take.
    ``torchrun_args``: more of torchrun's options (``--max-restarts=1``)."""
    launching(nnodes * nproc_per_node)
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    cli = ["-m", "lightning_par.cli", "fit", *TINY_JOB, f"--trainer.devices={nproc_per_node}"]
    cli += [f"--trainer.num_nodes={nnodes}", "--trainer.logger=TensorBoardLogger", *_report_args(root)]
    cli += [f"--data.cache_dir={cache_dir}", *args]
    procs, logs = [], []
    start = time.time()
    for node in range(nnodes):
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--node_rank={node}"]
        cmd += [f"--nproc_per_node={nproc_per_node}", "--master_addr=127.0.0.1", f"--master_port={port}"]
        cmd += [*torchrun_args, "--no-python", sys.executable, *cli]
        logs.append(root / f"node{node}.log")
        procs.append(subprocess.Popen(cmd, cwd=root, env=base_env(cache_dir), stdout=logs[-1].open("w"),
                                      stderr=subprocess.STDOUT))
    return _finish(root, procs, logs, start, timeout)


# -- what a preempted torchrun job printed (lightning_par/run/preemption.py, lightning_par/cli.py) -------------
def preempted_at(log: str) -> tuple[int, int, str] | None:
    """The preemption line: ``(rank that received the signal, step stopped after, checkpoint saved)``, or None."""
    found = re.search(r"lightning-par: SIG\w+ \(received by rank (\d+)\): stopped after step (\d+) on every rank; "
                      r"saved (\S+); exit code", log)
    return (int(found[1]), int(found[2]), found[3]) if found else None


def restarted_from(log: str) -> str | None:
    """The checkpoint the job's restart 1 (``torchrun --max-restarts``) resumed from, or None."""
    found = re.search(r"lightning-par: restart 1 of this job \(TORCHELASTIC_RESTART_COUNT=1\): "
                      r"resuming from (\S+?),?(?:\s|$)", log)
    return found[1] if found else None


def torchrun_first_failure(log: str) -> int | None:
    """The exit code torchrun reported for the first attempt's first failed worker, or None."""
    found = re.search(r"failed \(exitcode: (-?\d+)\)", log)
    return int(found[1]) if found else None


def launch_command(root: Path, cache_dir: Path, argv: list[str], timeout: float = 300,
                   log_name: str | None = None, ranks: int | None = None) -> Run:
    """``lightning-par ARGV`` exactly as given (no job arguments added), in ``root``, as a user types it; its
    output in ``root/LOG_NAME`` (default: the next ``commandN.log``). ``ranks``: the processes it starts, where the
    command line does not say (a config file)."""
    launching(ranks or _ranks_in(argv))
    root.mkdir(parents=True, exist_ok=True)
    env = base_env(cache_dir)
    env["MASTER_PORT"] = str(free_port())
    log = root / (log_name or f"command{len(list(root.glob('command*.log')))}.log")
    start = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "lightning_par.cli", *argv], cwd=root, env=env, stdout=out,
                                stderr=subprocess.STDOUT)
        return _finish(root, [proc], [log], start, timeout)


def launch_command_module(root: Path, cache_dir: Path, module: str, args: list[str], timeout: float = 600) -> Run:
    """``python -m MODULE ARGS`` in one process (no torchrun: a single-process group of runs)."""
    launching(1)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "launch.log"
    start = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=root, env=base_env(cache_dir), stdout=out,
                                stderr=subprocess.STDOUT)
        return _finish(root, [proc], [log], start, timeout)


def launch_matrix(root: Path, cache_dir: Path, module: str, args: list[str], nproc: int,
                  timeout: float = 600) -> Run:
    """``python -m MODULE ARGS`` on ``nproc`` ranks of one torchrun agent: for scripts that run several fits."""
    launching(nproc)
    root.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, *args]
    log = root / "launch.log"
    start = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=base_env(cache_dir), stdout=out, stderr=subprocess.STDOUT)
        return _finish(root, [proc], [log], start, timeout)



def launch_reports(root: Path, cache_dir: Path, module: str, cases: tuple[str, ...], nproc: int) -> list[dict]:
    """Launch the worker ``module`` on ``nproc`` ranks for ``cases`` (its arguments after its output folder) and read
    each rank's report, ``out/rank<r>.json``."""
    run = launch_matrix(root, cache_dir, module, [str(root / "out"), *cases], nproc=nproc, timeout=900).check()
    print(f"{module} on {nproc} ranks ({', '.join(cases)}): {run.seconds:.1f} s")
    return [json.loads((root / "out" / f"rank{r}.json").read_text()) for r in range(nproc)]

def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"different number of steps: {len(a)} vs {len(b)}"
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def every_ranks_error(call: Callable[[], object]) -> list[str]:
    """Run ``call`` on every rank of the default group and gather what each raised: ``"Type: message"``, with
    ``[chained: Type: message]`` when it was raised from another exception (a refusal must be one clear error),
    or ``"no error"``. A collective: every rank calls it."""
    import torch.distributed as dist

    error = "no error"
    try:
        call()
    except Exception as err:  # noqa: BLE001 -- what each rank raised is the result
        chained = err.__cause__ or err.__context__
        error = f"{type(err).__name__}: {err}" + (f" [chained: {type(chained).__name__}: {chained}]" if chained else "")
    errors: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return errors


def case_or_error(call: Callable[[], object]) -> tuple[object, str | None]:
    """One case of a shared launch on every rank: ``(its value, None)``, or ``(None, the error)`` when any rank raised
    (the first such rank's ``"rank r: Type: message"``), so the launch goes on to its other cases and only the tests
    reading this one fail. A collective after the call: every rank calls it (an error that leaves another rank
    waiting in a collective still hangs the launch, which its timeout ends)."""
    import torch.distributed as dist

    value, error = None, None
    try:
        value = call()
    except Exception as err:  # noqa: BLE001 -- the case's result is its error
        error = f"{type(err).__name__}: {err}"
        traceback.print_exc()  # (into the launch's log, where the case's error is read in full)
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next(((r, e) for r, e in enumerate(errors) if e is not None), None)
    return (value, None) if first is None else (None, f"rank {first[0]}: {first[1]}")


def close_process_group() -> None:
    """End a worker's process group: collect the DDP / FSDP2 objects that still hold it (often in reference cycles)
    and let every rank finish first -- a gloo thread that outlives its group aborts the process at exit ("terminate
    called without an active exception").

    Then drop DTensor's sharding-propagation caches, which are process-wide and outlive the group: their cached
    output specs hold the DeviceMesh objects of this group (and through their root mesh, its process groups). A
    DeviceMesh compares and hashes by ranks, layout and dimension names only, so a later group's DTensor op on an
    equal mesh (``nn.Parameter(DTensor)`` runs ``aten.detach``) is handed the old mesh object back, with the old root
    mesh: a test of the same process would then see meshes of a group already destroyed (``_get_root_mesh()`` of
    the previous test's ``(dp, tp)`` mesh instead of its own)."""
    import gc

    import torch.distributed as dist
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    _clear_sharding_prop_cache()


def checkpoint_worker_main(fit) -> None:
    """The command line of a worker that fits named cases, some from checkpoints made elsewhere
    (``--root --cache --cases A B --source NAME=PATH``): ``fit(root, cache, case, sources)`` per case."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--cache", required=True)
    parser.add_argument("--cases", nargs="+", required=True)
    parser.add_argument("--source", action="append", default=[], help="NAME=PATH: a checkpoint made elsewhere")
    args = parser.parse_args()
    sources = {name: Path(path) for name, path in (s.split("=", 1) for s in args.source)}
    for name in args.cases:
        fit(Path(args.root), args.cache, name, sources)


def spawn_reports(worker, root: Path, nprocs: int = 2) -> list[dict]:
    """Run ``worker(rank, world, store_path, out_dir)`` on ``nprocs`` spawned ranks (one thread each); return the
    ``rank{r}.json`` report each wrote into ``root``."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn(worker, (nprocs, str(root / "store"), str(root)), nprocs)
    return [json.loads((root / f"rank{r}.json").read_text()) for r in range(nprocs)]


def spawn(worker, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(worker, args, nprocs)``, joined, after :func:`launching`."""
    import torch.multiprocessing as mp

    launching(nprocs)
    mp.spawn(worker, args=args, nprocs=nprocs, join=True)


@contextlib.contextmanager
def gloo_rank(rank: int, world: int, store: str, out: str) -> Iterator[dict]:
    """A spawned worker's rank (see :func:`spawn_reports`): one thread, a gloo group over a file store, and a report
    dict written to ``out/rank{rank}.json`` when the body ends without an error (the group closed either way)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    report: dict = {}
    try:
        yield report
    finally:
        close_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
