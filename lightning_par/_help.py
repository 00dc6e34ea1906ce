"""The ``lightning-par`` console script: the help of ``plan`` and ``export`` without torch and Lightning (see
:mod:`lightning_par._light_help`), anything else by :func:`lightning_par.cli.main`."""

from __future__ import annotations

import sys

from lightning_par._light_help import light_help


def main() -> None:
    """The ``lightning-par`` command: the help of ``plan`` and ``export`` from their parsers alone (plain argparse,
    no torch), anything else by :func:`lightning_par.cli.main`."""
    if light_help():
        if sys.argv[1] == "plan":
            from lightning_par.plan_cli import main as plan

            sys.exit(plan(sys.argv[2:]))
        from lightning_par.plugins.export_args import build_parser

        build_parser().parse_args(sys.argv[2:])  # prints the help and exits
    from lightning_par.cli import main as full

    full()
