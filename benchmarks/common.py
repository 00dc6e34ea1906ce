"""Shared by the benchmarks: launch a job through the ``lightning-par`` CLI by strategy name, read back its
throughput and the per-rank state reports."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

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
