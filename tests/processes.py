"""Servers as child processes: each in its own process group, started on a free port, waited for, and stopped
whole (the polite signal, then SIGKILL) when the block ends; none outlives the test process, even killed by SIGKILL
(:func:`guard`, :func:`exit_with_parent`). Standard library only: :mod:`fault_server` imports it too."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

HOST = "127.0.0.1"
START_TIMEOUT = 30.0  # seconds a server may take to answer (moto imports for a few seconds on a busy machine)
STOP_TIMEOUT = 5.0  # seconds between the polite signal and SIGKILL


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the server binds it next; a lost race is retried)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _answers(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=0.5):
            return True
    except OSError:
        return False


def _stop(proc: subprocess.Popen, polite: int) -> None:
    """Signal the child's process group ``polite``, then SIGKILL whatever is left; reap the child."""
    for sig in (polite, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(STOP_TIMEOUT)
            if sig == signal.SIGKILL or not _group_alive(proc.pid):
                return
        except subprocess.TimeoutExpired:
            continue


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


@contextlib.contextmanager
def child(
    argv: list[str], port: int, log: Path, *, env: dict | None = None, polite: int = signal.SIGTERM
) -> Iterator[int]:
    """Run ``argv`` (which must listen on ``port``) in its own process group until the block ends; yields its pid.

    Waits until the port accepts connections; a child that exits first raises ``RuntimeError`` with the end of
    its ``log`` (``PortTaken`` when it says the address is in use, so the caller can retry on another port).
    """
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _answers(port) or proc.poll() is not None:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:]
                kind = PortTaken if "in use" in tail else RuntimeError
                raise kind(f"{argv[0]} did not start on port {port} (exit {proc.poll()}):\n{tail}")
            time.sleep(0.05)
        yield proc.pid
    finally:
        _stop(proc, polite)


class PortTaken(RuntimeError):
    """The child could not bind its port (another process took it after :func:`free_port`)."""


@contextlib.contextmanager
def on_free_port(start: Callable[[int], contextlib.AbstractContextManager[int]]) -> Iterator[tuple[int, int]]:
    """``(port, pid)``: ``start(port)`` on a free port, up to three ports when another process takes the first."""
    for attempt in range(3):
        port = free_port()
        with contextlib.ExitStack() as stack:
            try:
                pid = stack.enter_context(start(port))
            except PortTaken:
                if attempt == 2:
                    raise
                continue
            yield port, pid
            return


def guard(argv: list[str]) -> int:
    """Run ``argv`` (nginx); if this process's parent dies, even by SIGKILL, kill this process group (nginx too).

    ``python processes.py PROGRAM ARGS...``: :func:`child` starts it in a new process group; the Python servers
    watch their parent themselves (:func:`exit_with_parent`).
    """
    parent = os.getppid()
    signal.signal(signal.SIGQUIT, lambda *_: None)  # nginx's graceful stop is for nginx; a handler, not SIG_IGN,
    # since ignored signals stay ignored across exec
    proc = subprocess.Popen(argv)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, daemon=True).start()
    return proc.wait()


def exit_with_parent() -> None:
    """Exit when the process that started this one is gone, even killed by SIGKILL: no orphaned server."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    sys.exit(guard(sys.argv[1:]))
