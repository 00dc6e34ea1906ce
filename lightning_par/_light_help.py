"""Whether this process is the ``lightning-par`` command asked only for the help of ``plan`` or ``export``: then
``import lightning_par`` imports neither torch nor Lightning (about 4 s on a CPU machine) and the help is printed at
once. Every other use of the package -- ``fit --help`` included, which lists Lightning's own Trainer arguments --
imports it whole.

Apart from the console script (:mod:`lightning_par._help`) because the package's ``__init__`` asks it first: this file
imports nothing of the package, the script imports all of it."""

from __future__ import annotations

import os
import sys

#: the subcommands whose help needs no torch and no Lightning (their parsers are plain argparse)
LIGHT_SUBCOMMANDS = ("plan", "export")


def light_help(argv: list[str] | None = None) -> bool:
    """``lightning-par plan --help`` or ``lightning-par export -h`` (the console script; ``python -m
    lightning_par.cli`` imports the package before its arguments are known)."""
    argv = sys.argv if argv is None else argv
    return (len(argv) >= 3 and os.path.basename(argv[0]) == "lightning-par" and argv[1] in LIGHT_SUBCOMMANDS
            and any(a in ("-h", "--help") for a in argv[2:]))
