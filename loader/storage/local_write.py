"""The local driver's write side (:mod:`.writing`): a staging folder beside the target folder, files created at
their full size, positioned writes with ``pwrite``, and the commit (:mod:`.local_commit`).

Vocabulary: the *target* is the folder a save commits to (a symlink to a folder: the folder it names,
:func:`~.local_commit.destination`); the *staging folder* ``<target>.tmp-XXXXXXXX`` is made beside it (the same
filesystem, so that a rename commits it) with the permissions ``os.makedirs`` would give.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

from .local_carry import check_no_mounts
from .local_commit import commit_folder, destination


class LocalObjectWriter:
    """Positioned writes into one local file (opened write-only; see :class:`~.writing.ObjectWriter`)."""

    __slots__ = ("_fd", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)

    def __enter__(self) -> LocalObjectWriter:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def pwrite(self, offset: int, data: memoryview) -> None:
        write_all(self._fd, data, offset)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class LocalStaging:
    """A staging folder publishing over a local folder (see :class:`~.writing.Staging`).

    Args:
        location: The staging folder (made by :meth:`beside`, perhaps on another rank).
        target: The folder :meth:`commit` publishes over (resolved by :func:`~.local_commit.destination`).
    """

    def __init__(self, location: str, target: str) -> None:
        self.location = self.folder = location
        self.target = destination(target) if target else target

    def __repr__(self) -> str:
        return f"LocalStaging({self.location!r} -> {self.target!r})"

    @classmethod
    def beside(cls, target: str) -> LocalStaging:
        """A new, empty staging folder beside ``target``.

        Raises:
            ValueError: ``target`` is a file, a mount point or holds one (nothing created).
        """
        path = destination(target)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"cannot save to {path!r}: it is a file, not a folder")
        check_no_mounts(path)
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        folder = tempfile.mkdtemp(prefix=os.path.basename(path) + ".tmp-", dir=parent)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(folder, 0o777 & ~umask)
        return cls(folder, path)

    def create(self, name: str, size: int, head: bytes) -> None:
        fd = os.open(os.path.join(self.location, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
        try:
            os.ftruncate(fd, size)
            if size > len(head) and hasattr(os, "posix_fallocate"):
                with contextlib.suppress(OSError):  # not supported here (EOPNOTSUPP, EINVAL): stays sparse
                    os.posix_fallocate(fd, len(head), size - len(head))
            write_all(fd, memoryview(head), 0)
        finally:
            os.close(fd)

    def open(self, name: str) -> LocalObjectWriter:
        return LocalObjectWriter(os.path.join(self.location, name))

    def put(self, name: str, data: bytes) -> None:
        with open(os.path.join(self.location, name), "wb") as f:
            f.write(data)

    def commit(self, timeout: float | None = None) -> None:
        """:func:`~.local_commit.commit_folder`: under the target's lock, its user files carried over, one swap."""
        commit_folder(self.location, self.target, timeout)

    def abort(self) -> None:
        shutil.rmtree(self.location, ignore_errors=True)


def write_all(fd: int, data: memoryview, offset: int) -> None:
    """``pwrite`` all of ``data`` at ``offset`` (short writes continued)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n
