"""The ``regiontrace`` console script (also ``python -m loader``): ``demo``, ``trace``, ``check`` and ``plan``.

``trace`` and ``check`` are the algebra's own commands (:mod:`regiontrace.cli`, also ``python -m
regiontrace``); ``plan`` and ``demo`` need the loader and live here. Each command is a module with
``add_parser(subparsers)`` and ``run(args) -> exit status``. Exit status: 0 yes, 1 "the answer is no" (not
traceable, a counterexample, a check that failed), 2 the command could not answer (a wrong command line,
argparse's convention, or any other error). Errors are one line on stderr; ``-v`` shows the traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from regiontrace.cli import build_parser as _build_parser
from regiontrace.cli import check_cmd, run_command_line, trace_cmd

from . import demo, plan_cmd

COMMANDS = (demo, trace_cmd, check_cmd, plan_cmd)
EPILOG = "`regiontrace COMMAND --help` for each command; docs: docs/cli.md"


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command."""
    return _build_parser(COMMANDS, epilog=EPILOG)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line (default ``sys.argv[1:]``); returns the exit status."""
    return run_command_line(build_parser(), argv)
