"""The demo's work in a child process under a deadline: ``--timeout`` stops it from outside, never by raising
inside whatever code it is running (an import, a write, a wait).

The child is forked (the parent has only imported and parsed its command line) and starts its own session, so
that it, the fork server it starts and every rank form one process group; at the deadline, on Ctrl-C or on
SIGTERM the parent kills that group as a whole. The child reports the stage it enters and its outcome through
a pipe.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from regiontrace.cli.common import CLIError

#: how long a child that has sent its outcome may take to exit before it is killed
EXIT_GRACE_S = 10.0


@dataclass(frozen=True)
class Outcome:
    """How the child ended.

    Attributes:
        status: its exit status (``None`` when it timed out, was interrupted or died).
        error: a :class:`CLIError`'s message, or ``Type: message`` of another exception ("" when none).
        traceback: the traceback of such another exception ("" otherwise).
        stage: the last stage it entered.
        timed_out: the deadline passed first.
        interrupted: Ctrl-C, SIGTERM or SIGHUP stopped it.
    """

    status: int | None
    error: str = ""
    traceback: str = ""
    stage: str = "starting"
    timed_out: bool = False
    interrupted: bool = False


class Stages:
    """What the child tells the parent: the stage it enters (for the timeout's message), and the time left."""

    def __init__(self, conn: Connection | None, end: float) -> None:
        self._conn = conn
        self.end = end

    def enter(self, stage: str) -> None:
        """Record the stage the work enters."""
        if self._conn is not None:
            self._conn.send(("stage", stage))

    def left(self) -> float:
        """Seconds to the deadline (negative once passed)."""
        return self.end - time.monotonic()


def run_in_child(work: Callable[[Stages], int], end: float) -> Outcome:
    """Run ``work(stages)`` in a forked child until it returns, or until ``end`` (``time.monotonic()``), when
    the child's whole process group is killed; returns how it ended. ``work`` raising :class:`CLIError` is an
    outcome like a return (its message and status); any other exception is reported with its traceback."""
    ctx = multiprocessing.get_context("fork")
    _multiprocessing_temp_dir()
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(work, send, end), name="regiontrace-demo")
    stage, result, stopped, timed_out = "starting", None, threading.Event(), False
    with _stopping_on_signals(proc, stopped):
        try:
            proc.start()
            send.close()
            while result is None and not stopped.is_set():
                left = end - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                ready = wait([receive, proc.sentinel], timeout=left)
                if receive in ready:
                    try:
                        kind, value = receive.recv()
                    except EOFError:  # the child is gone without an outcome
                        break
                    stage, result = (value, None) if kind == "stage" else (stage, value)
                elif ready and not receive.poll():
                    break
            if result is not None:
                wait([proc.sentinel], timeout=EXIT_GRACE_S)
        finally:
            _kill(proc)
            if proc.pid is not None:
                proc.join()
            receive.close()
    if result is not None:
        return Outcome(*result, stage=stage)
    if stopped.is_set():
        return Outcome(None, stage=stage, interrupted=True)
    if timed_out:
        return Outcome(None, stage=stage, timed_out=True)
    return Outcome(None, error=f"the demo's process died ({_exit_text(proc.exitcode)}) while {stage}", stage=stage)


#: the longest path of a Unix socket (``sun_path``: 108 bytes on Linux, 104 on macOS, with its NUL)
SOCKET_PATH_MAX = 103
#: what multiprocessing appends to the temporary directory for its fork server's socket
_SOCKET_SUFFIX = len("/pymp-xxxxxxxx/listener-xxxxxxxx")


def _multiprocessing_temp_dir() -> str:
    """Make multiprocessing's own temporary folder (the fork server's socket) here, so that it is removed at this
    process's exit, not left behind by a killed child; where the temporary directory's path is too long for a
    socket's (a deep ``TMPDIR``: the fork server fails with "AF_UNIX path too long"), it is made in ``/tmp``."""
    if len(tempfile.gettempdir()) + _SOCKET_SUFFIX <= SOCKET_PATH_MAX or not os.access("/tmp", os.W_OK):
        return multiprocessing.util.get_temp_dir()
    previous, tempfile.tempdir = tempfile.tempdir, "/tmp"
    try:
        return multiprocessing.util.get_temp_dir()
    finally:
        tempfile.tempdir = previous


def remove_tree(path: str, attempts: int = 50) -> None:
    """Remove ``path`` and everything under it; retried a little while processes just killed finish dying."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            return
        time.sleep(0.1)


def _child(work: Callable[[Stages], int], conn: Connection, end: float) -> None:
    os.setsid()  # one process group with everything it starts, killed as a whole; no Ctrl-C from the terminal
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)  # what it printed survives a kill
    try:
        outcome: tuple = (int(work(Stages(conn, end)) or 0), "", "")
    except CLIError as e:
        outcome = (e.status, str(e), "")
    except BaseException as e:
        outcome = (2, f"{type(e).__name__}: {' '.join(str(e).split())}", traceback.format_exc())
    conn.send(("outcome", outcome))
    conn.close()


def _kill(proc: Any) -> None:
    """SIGKILL the child's process group (its session's: the fork server, the ranks) and the child itself
    (killed before its ``setsid``, it leads no group yet). Called before the child is reaped, so that its pid,
    and the group's id, cannot have been reused."""
    if proc.pid is None:  # not started yet
        return
    for kill, target in ((os.killpg, proc.pid), (os.kill, proc.pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@contextmanager
def _stopping_on_signals(proc: Any, stopped: threading.Event) -> Iterator[None]:
    """While waiting: Ctrl-C, SIGTERM and SIGHUP kill the child's group and set ``stopped`` (no exception
    raised inside the wait); outside the main thread, signals are left alone."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        stopped.set()
        _kill(proc)

    names = ("SIGINT", "SIGTERM", "SIGHUP")
    previous = {s: signal.signal(s, stop) for s in (getattr(signal, n) for n in names if hasattr(signal, n))}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "no exit status"
    return f"killed by signal {-code}" if code < 0 else f"exit status {code}"
