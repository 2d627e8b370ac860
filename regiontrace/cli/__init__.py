"""The ``regiontrace`` command line: ``demo``, ``trace``, ``check`` and ``plan``.

Each command lives in its own module with ``add_parser(subparsers)`` and ``run(args) -> exit status``.
Exit status: 0 yes, 1 "the answer is no" (not traceable, a counterexample, a check that failed), 2 the command
could not answer (a wrong command line, argparse's convention, or any other error). Errors are one line on
stderr; ``-v`` shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from . import check_cmd, demo, plan_cmd, trace_cmd
from .common import CLIError, HelpFormatter

DESCRIPTION = """\
regiontrace: trace checkpoint conversions as exact index mappings; load only the bytes each rank needs."""
EPILOG = "`regiontrace COMMAND --help` for each command; docs: docs/cli.md"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="regiontrace", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=HelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="show tracebacks and library logs")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in (demo, trace_cmd, check_cmd, plan_cmd):
        module.add_parser(sub)
    for command in sub.choices.values():  # every command's --help shows its defaults
        command.formatter_class = HelpFormatter
    return parser


def _version() -> str:
    from .. import __version__

    return f"regiontrace {__version__}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # -v may come after the command too
    verbose = any(a in ("-v", "--verbose") for a in argv)
    argv = [a for a in argv if a not in ("-v", "--verbose")]
    parser = build_parser()
    args = parser.parse_args(argv)
    args.verbose = verbose
    if args.command is None:
        parser.print_help()
        return 2
    if verbose:
        import logging

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
    except Exception as e:  # noqa: BLE001 — every error is one line unless -v
        if verbose:
            raise
        print(f"regiontrace {args.command}: error: {type(e).__name__}: {_one_line(e)} (-v for the traceback)",
              file=sys.stderr)
        return 2  # an error is no answer: 1 is reserved for "no"


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 600 else text[:597] + "..."
