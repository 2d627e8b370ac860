"""Local files held open for reading, each checked against its identity.

Vocabulary:

- a file's *identity* (:class:`FileIdentity`): its device, inode, size, mtime and ctime, recorded when its header
  was read; a file whose identity changed was replaced or rewritten;
- *checks* (:class:`IdentityChecks`): the identity each file must still have, compared with an open descriptor;
- the *open files* (:class:`OpenFiles`): a reader's descriptors, opened lazily (checked on open) and shared by the
  readers composed over them (:class:`~.local.FileReader`, :class:`~.direct.DirectFileReader`).
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from .untrusted import err, open_regular_file


@dataclass(frozen=True)
class FileIdentity:
    """What identifies one file's contents: if any field changes, the file was replaced or rewritten.

    Attributes:
        device: ``st_dev``.
        inode: ``st_ino``.
        size: ``st_size`` in bytes.
        mtime_ns: ``st_mtime_ns``.
        ctime_ns: ``st_ctime_ns``: the kernel sets it on every write, rename or ``utime``, and no user-space call
            can set it back, so a file rewritten in place with its mtime restored (``os.utime``), or replaced by
            a new file that reuses the inode number, still differs.
    """

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        """The identity of a ``stat``/``fstat`` result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class IdentityChecks:
    """The :class:`FileIdentity` each file must still have, checked against an open descriptor."""

    __slots__ = ("_expected",)

    def __init__(self, identities: Mapping[str, FileIdentity] | None = None) -> None:
        self._expected: dict[str, FileIdentity] = dict(identities or {})

    def expect(self, file: str, identity: FileIdentity) -> None:
        """Require ``file`` to be ``identity`` from now on."""
        self._expected[file] = identity

    def check(self, file: str, fd: int) -> None:
        """Raise :class:`~loader.errors.CheckpointError` when ``fd`` (open on ``file``) is no longer the identity
        ``file`` is expected to have (a change of inode, size, mtime or ctime); nothing when none is expected."""
        want = self._expected.get(file)
        if want is None:
            return
        got = FileIdentity.of(os.fstat(fd))
        if got != want:
            changed = ", ".join(
                f"{f.name} {getattr(want, f.name)} -> {getattr(got, f.name)}"
                for f in dataclasses.fields(want)
                if getattr(want, f.name) != getattr(got, f.name)
            )
            raise err(file, f"file changed underneath since its header was read ({changed})")


def open_checked(file: str, checks: IdentityChecks) -> int:
    """Open ``file`` for reading (a FIFO swapped in cannot block the open) and check its identity."""
    fd, _ = open_regular_file(file)
    try:
        checks.check(file, fd)
    except BaseException:
        os.close(fd)
        raise
    return fd


class OpenFiles:
    """Read-only descriptors of files, opened lazily under a lock and checked against their expected identities.

    Args:
        identities: ``{file: FileIdentity}`` each file must still have (see :meth:`expect`).

    Attributes:
        checks: The expected identities.
        lock: Guards the descriptors (and what the readers composed over them guard with it).
    """

    __slots__ = ("_fds", "checks", "lock")

    def __init__(self, identities: Mapping[str, FileIdentity] | None = None) -> None:
        self._fds: dict[str, int] = {}
        self.checks = IdentityChecks(identities)
        self.lock = threading.Lock()

    def fd(self, file: str) -> int:
        """An open descriptor for ``file``, opened (and its identity checked) on first use.

        Raises:
            CheckpointError: the file is not the identity :meth:`expect` was told.
        """
        fd = self._fds.get(file)
        if fd is None:
            with self.lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = self._fds[file] = open_checked(file, self.checks)
        return fd

    def close(self) -> None:
        """Close every descriptor (files reopen lazily)."""
        with self.lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def expect(self, file: str, identity: FileIdentity | None) -> None:
        """Require ``file`` to be ``identity`` from now on: checked now if it is open, else when it is opened
        (``None`` is ignored: nothing is known about the file).

        Raises:
            CheckpointError: the open file is no longer ``identity``.
        """
        if identity is None:
            return
        with self.lock:
            self.checks.expect(file, identity)
            fd = self._fds.get(file)
        if fd is not None:
            self.checks.check(file, fd)

    def verify(self, file: str) -> None:
        """Check that ``file``, if open and expected, still has its expected identity.

        Raises:
            CheckpointError: it was replaced, resized or rewritten (a change of inode, size, mtime or ctime).
        """
        fd = self._fds.get(file)
        if fd is not None:
            self.checks.check(file, fd)

    def verify_all(self) -> None:
        """:meth:`verify` every open file."""
        for file in list(self._fds):
            self.verify(file)
