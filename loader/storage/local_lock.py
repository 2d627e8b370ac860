"""The lock a local commit holds: one commit into a folder at a time.

Vocabulary: the *lock file* is ``<parent>/.<name>.lock`` beside the folder ``<name>``; *holding* it is an exclusive
``fcntl.flock`` on it, opened without following a symlink (nor creating through one); the holder removes the file
on release, and a waiter that wakes on a removed file locks the new one.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("loader")


@contextlib.contextmanager
def locked(path: str, timeout: float | None, step: Callable[[str], None]) -> Iterator[None]:
    """Hold ``<parent>/.<name>.lock`` (``flock``), waiting at most ``timeout`` seconds (None: no limit). The lock
    file is removed on release; a waiter that wakes on a removed file tries again. ``step`` is called with
    ``"lock"`` before each try and ``"wait"`` before waiting (the commit's step hook)."""
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    lock_path = os.path.join(parent, f".{name}.lock")
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        step("lock")
        fd = _open_lock(lock_path)
        try:
            _flock(fd, path, deadline, step)
            st = os.fstat(fd)
            try:
                same = os.stat(lock_path)
            except FileNotFoundError:
                same = None
            if same is not None and (same.st_dev, same.st_ino) == (st.st_dev, st.st_ino):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # the holder before us removed the file: lock the new one
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_path)
        os.close(fd)


def _open_lock(lock_path: str) -> int:
    """The lock file, created where missing; a symlink is not followed (nor created through), and anything but a
    regular file is refused."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(
                errno.ELOOP, "cannot lock the commit: the lock path is a symlink (not followed; remove it)", lock_path
            ) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EEXIST, "cannot lock the commit: the lock path is not a regular file", lock_path)
    return fd


def _flock(fd: int, path: str, deadline: float | None, step: Callable[[str], None]) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    step("wait")
    log.info("another save into %s is committing: waiting for it", path)
    if deadline is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    pause = 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"cannot commit the checkpoint to {path}: another save into it held its lock "
                    f"{os.path.join(os.path.dirname(path), '.' + os.path.basename(path) + '.lock')} past the timeout"
                ) from None
            time.sleep(pause)
            pause = min(pause * 2, 0.1)
