"""The algebra's command line (``python -m regiontrace``): ``trace`` and ``check``.

Each command lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> exit status``; the
``regiontrace`` console script (:mod:`loader.cli`) adds the loader's ``plan`` and ``demo`` to these with the
same :func:`build_parser` and :func:`run_command_line`.
Exit status: 0 yes, 1 "the answer is no" (not traceable, a counterexample, a check that failed), 2 the command
could not answer (a wrong command line, argparse's convention, or any other error). Errors are one line on
stderr; ``-v`` shows the traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

from .. import __version__
from . import check_cmd, trace_cmd
from .common import CLIError, HelpFormatter

__all__ = [
    "COMMANDS",
    "DESCRIPTION",
    "EPILOG",
    "LOADER_COMMANDS",
    "build_parser",
    "check_cmd",
    "main",
    "run_command_line",
    "trace_cmd",
]

COMMANDS: tuple[ModuleType, ...] = (trace_cmd, check_cmd)
LOADER_COMMANDS = ("demo", "plan")  # provided by the loader's command line (loader.cli)
DESCRIPTION = """\
regiontrace: trace checkpoint conversions as exact index mappings; load only the bytes each rank needs."""
EPILOG = """\
`regiontrace COMMAND --help` for each command; docs: docs/cli.md
`plan` and `demo` come with the loader: the `regiontrace` console script, or `python -m loader`."""


def build_parser(
    commands: Sequence[ModuleType] = COMMANDS, *, epilog: str = EPILOG, prog: str = "regiontrace"
) -> argparse.ArgumentParser:
    """The argument parser with ``commands`` (modules with ``add_parser(subparsers)``), in that order."""
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, epilog=epilog, formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and library logs")
    parser.add_argument("--version", action="version", version=f"regiontrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in commands:
        module.add_parser(sub)
    for command in sub.choices.values():  # every command's --help shows its defaults
        command.formatter_class = HelpFormatter
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``trace`` or ``check``; returns the exit status (``plan``/``demo``: a one-line pointer, status 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    if command in LOADER_COMMANDS:
        print(
            f"regiontrace {command}: error: `{command}` needs the loader: run the `regiontrace` console script "
            f"or `python -m loader {command} ...`",
            file=sys.stderr,
        )
        return 2
    return run_command_line(build_parser(), argv)


def run_command_line(parser: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``) with ``parser`` and run the chosen command: errors become one
    line on stderr and an exit status (``-v``, anywhere on the line, shows the traceback instead)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in ("-v", "--verbose") for a in argv)
    argv = [a for a in argv if a not in ("-v", "--verbose")]
    args = parser.parse_args(argv)
    args.verbose = verbose
    if args.command is None:
        parser.print_help()
        return 2
    if verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    try:
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except CLIError as e:
        if verbose:
            raise
        print(f"regiontrace {args.command}: error: {e}", file=sys.stderr)
        return e.status
    except Exception as e:
        if verbose:
            raise
        print(
            f"regiontrace {args.command}: error: {type(e).__name__}: {_one_line(e)} (-v for the traceback)",
            file=sys.stderr,
        )
        return 2  # an error is no answer: 1 is reserved for "no"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 600 else text[:597] + "..."
