"""Shared by the benchmarks: launch a job through the ``lightning-par`` CLI by strategy name, read back its
throughput and the per-rank state reports."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from tests.harness import Run, launch_cli  # noqa: E402

#: Lightning's ModelParallelStrategy on the FSDP2-sharded GPT (benchmarks/fsdp2_gpt.py): the reference for ZeRO-3.
FSDP2 = "fsdp2"


def strategy_args(strategy: str, devices: int) -> list[str]:
    """CLI arguments selecting ``strategy``: ``"fsdp2"`` (see :data:`FSDP2`), or any name the CLI accepts
    (Lightning's ``ddp``, lightning-par's ``zero0`` ... ``zero3``)."""
    if strategy == FSDP2:
        return ["--trainer.strategy=lightning.pytorch.strategies.ModelParallelStrategy",
                f"--trainer.strategy.data_parallel_size={devices}", "--trainer.strategy.tensor_parallel_size=1"]
    return [f"--trainer.strategy={strategy}"]


def model_args(strategy: str, preset: str) -> list[str]:
    # the class first: jsonargparse applies --model.* to the class chosen last
    model = "benchmarks.fsdp2_gpt.FSDP2GPT" if strategy == FSDP2 else "lightning_par.examples.GPTLightningModule"
    return [f"--model={model}", f"--model.preset={preset}"]


def launch(root: Path, cache: Path, strategy: str, devices: int, preset: str, extra: list[str],
           timeout: float = 900) -> Run:
    """One fit of the example GPT under ``strategy`` on ``devices`` CPU ranks; not checked (see ``Run.check``)."""
    args = [*strategy_args(strategy, devices), *model_args(strategy, preset), *extra]
    return launch_cli(root, cache, args, devices=devices, timeout=timeout)


def throughput_windows(run: Run, tag: str = "train/tokens_per_sec") -> list[float]:
    """One tokens/s value per logging window, the first (start-up) window dropped.

    The logger repeats a window's value at every step until the next window, so consecutive repeats are folded.
    """
    series = run.scalars()[tag]
    values = [series[s] for s in sorted(series)]
    windows = [v for i, v in enumerate(values) if i == 0 or v != values[i - 1]]
    return windows[1:]


def state_reports(run: Run) -> list[dict]:
    """The ``tests.probes.StateReport`` file of every rank, by rank."""
    files = sorted(run.root.glob("state/state_rank*.json"), key=lambda p: int(p.stem.removeprefix("state_rank")))
    return [json.loads(p.read_text()) for p in files]


def state_report_args(run_root: Path, step: int) -> list[str]:
    """Measure optimizer step ``step`` with ``tests.probes.StateReport``.

    It replaces the callback list (``=``, not ``+=``): the harness's ``RankReport`` reads lightning-par's mesh
    coordinates, which Lightning's ModelParallelStrategy does not have.
    """
    return ["--trainer.callbacks=tests.probes.StateReport", f"--trainer.callbacks.path={run_root / 'state'}",
            f"--trainer.callbacks.step={step}"]


def last_error(run: Run) -> str:
    """The last line of a failed run's log that names an error, for a table cell."""
    lines = [ln.strip() for ln in run.log.splitlines() if "Error" in ln or "error" in ln]
    return (lines[-1] if lines else run.log.strip().splitlines()[-1] if run.log.strip() else "no output")[:200]


def status_kib(field: str) -> int:
    """A ``/proc/self/status`` field in KiB (``VmRSS``: resident now, ``VmHWM``: the resident high-water mark)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def reset_peak_rss() -> None:
    """Reset this process's resident high-water mark (``VmHWM``) to its resident size now (Linux: ``clear_refs``
    5), so that the next ``status_kib("VmHWM")`` is the peak since; a variant that is not a process's first then
    reads its own peak. Where the kernel refuses, the mark stays the process's."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def launch_variants(tmp: Path, module: str, names: list[str], rnd: int, args: list[str], nproc: int) -> dict[str, dict]:
    """``python -m MODULE --worker --variants NAMES ARGS`` on ``nproc`` ranks of one torchrun agent: the worker fits
    each variant in turn (:func:`fit_variants`). Per variant ``{"ok", "ranks" (its per-rank reports), "seconds"
    (the launch's), "error" / "log_tail" where it failed}``."""
    from tests.harness import launch_matrix

    root = tmp / f"{'+'.join(names)}-{rnd}"
    run = launch_matrix(root, tmp / "cache", module, ["--worker", "--variants", *names, "--root", str(root), *args],
                        nproc=nproc, timeout=900 * len(names))
    results = {}
    for name in names:
        out = root / name / "reports.json"
        if out.exists():
            results[name] = {"ok": True, "ranks": json.loads(out.read_text()), "seconds": run.seconds}
            continue
        tail = "\n".join(run.log.strip().splitlines()[-30:])
        print(f"  {name} round {rnd} failed; the end of its log:\n{tail}", flush=True)
        results[name] = {"ok": False, "error": last_error(run), "seconds": run.seconds, "log_tail": tail}
    return results


def fit_variants(opts, fit) -> None:
    """The worker side of :func:`launch_variants`: for each of ``opts.variants``, ``fit(name, root)`` returns this
    rank's report; the ranks' reports go to ``ROOT/NAME/reports.json``. The peak resident size is reset before
    each variant (:func:`reset_peak_rss`), so a later variant's ``peak_rss_bytes`` is its own -- though it may run
    in memory an earlier one freed to the allocator, so its growth can read lower than in a process of its own."""
    import torch.distributed as dist

    from tests.harness import close_process_group

    for name in opts.variants:
        root = Path(opts.root) / name
        root.mkdir(parents=True, exist_ok=True)
        reset_peak_rss()
        report = fit(name, root)
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report)
        if dist.get_rank() == 0:
            (root / "reports.json").write_text(json.dumps(reports))
    close_process_group()  # a gloo thread outliving its group would abort the process at exit


def add_launch_options(parser) -> None:
    """``--one-launch`` and the worker's hidden options, for :func:`launch_variants` / :func:`fit_variants`."""
    import argparse

    parser.add_argument("--one-launch", action="store_true",
                        help="every variant of a round in one launch (one start-up; memory columns then read each "
                             "variant's peak after the ones before it in the same process)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--variants", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)


class FixedTokens(Dataset):
    """``n`` samples ``(inputs, targets)`` of ``seq`` byte tokens, cycling through ``distinct`` fixed random rows
    drawn from ``seed``: the same data for every strategy of a benchmark, without a corpus."""

    def __init__(self, n: int, seq: int, seed: int, distinct: int = 64) -> None:
        self.tokens = torch.randint(0, 256, (distinct, seq + 1), generator=torch.Generator().manual_seed(seed))
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.tokens[i % len(self.tokens)]
        return row[:-1], row[1:]


class StepMeter(pl.Callback):
    """Per optimizer step after ``warmup``: wall and CPU (``time.process_time``) seconds from one
    ``on_train_batch_start`` to the next; and the bytes of parameters, gradients and optimizer states right after
    optimizer step ``state_step`` (:func:`lightning_par.measure.state_bytes`)."""

    def __init__(self, warmup: int, state_step: int) -> None:
        self.warmup, self.state_step = warmup, state_step
        self.begin: tuple[float, float] | None = None
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.state: dict | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        now = time.perf_counter(), time.process_time()
        if self.begin is not None and batch_idx > self.warmup:  # the previous step, warm-up steps excluded
            self.times.append(now[0] - self.begin[0])
            self.cpu.append(now[1] - self.begin[1])
        self.begin = now

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        from lightning_par.measure import state_bytes

        if trainer.global_step == self.state_step and self.state is None:
            self.state = state_bytes(trainer.strategy.model, trainer.optimizers)
