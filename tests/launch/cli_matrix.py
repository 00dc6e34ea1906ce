"""Several ``lightning-par`` command lines, one after another in the same process (or the same torchrun ranks).

What one CLI launch per run would give, minus the repeated start-up (python, torch, Lightning: most of a short run's
time on 2 cores). Each run's output goes to its own ``ROOT/launch.log``, as a launch of its own would write it, so
:class:`tests.harness.Run` reads each as before. ``python -m tests.launch.cli_matrix SPEC`` with SPEC a JSON list of
``[root, argv]`` (:func:`tests.harness.launch_command_group` writes it); under torchrun for runs of several ranks.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

from lightning_par.cli import main as cli_main


def run(root: Path, argv: list[str]) -> None:
    """``lightning-par ARGV`` in ``root``, this process's stdout and stderr appended to ``root/launch.log``."""
    root.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2), os.getcwd(), sys.argv
    log = os.open(root / "launch.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.chdir(root)
    sys.argv = ["lightning-par", *argv]  # the command line as typed (LightningCLI warns when args differ from it)
    try:
        # a fresh registry of shown warnings: each run's log shows its warnings, as its own process would
        # (tests/launch/test_warnings.py reads them)
        with warnings.catch_warnings():
            cli_main()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.chdir(saved[2])
        sys.argv = saved[3]
        for fd in (log, *saved[:2]):
            os.close(fd)


def main() -> None:
    for root, argv in json.loads(Path(sys.argv[1]).read_text()):
        print(f"cli_matrix: {' '.join(argv[:1])} in {root}", flush=True)
        run(Path(root), argv)


if __name__ == "__main__":
    main()
