"""One world of rank subprocesses, bounded: start every rank, wait for all within a limit, kill what is left.

Shared by tests/gloo_world.py, tests/vllm/vllm_world.py and bench/vllm_bench.py, which differ only in what
they report; imports nothing but the standard library.
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path


def run_ranks(
    argv: Sequence[Sequence[str]], logs: Sequence[Path], *, cwd: str | Path, env: dict, limit: float
) -> list[int | None]:
    """Run one process per ``argv`` (its output into the matching log) and wait for all of them at most ``limit``
    seconds in all; each rank's exit code, None for a rank still running then (sent ``SIGUSR1`` first, so one that
    registered ``faulthandler`` for it dumps its stacks into its log, then killed)."""
    files = [open(log, "w") for log in logs]
    procs = [subprocess.Popen(a, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT) for a, f in zip(argv, files)]
    try:
        try:
            for p in procs:
                p.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            hung = [p for p in procs if p.poll() is None]
            for p in hung:
                p.send_signal(signal.SIGUSR1)
            try:
                hung[0].wait(timeout=2)
            except subprocess.TimeoutExpired:
                pass
            return [None if p in hung else p.returncode for p in procs]
        return [p.returncode for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in files:
            f.close()
