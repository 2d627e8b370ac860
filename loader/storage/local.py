"""Local files: exact byte ranges read with ``preadv``, checked against each file's identity.

Every read is a system call on a file descriptor, never a memory map: a file that shrinks underneath the
load becomes a short read and a :class:`~loader.errors.CheckpointError` naming the file, never a SIGBUS.
A :class:`FileReader` (the local :class:`~.base.RangeReader`) told a file's :class:`FileIdentity` (recorded when
its header was read) checks it (:class:`IdentityChecks`) when the file is opened for data and on
:meth:`FileReader.verify`: a file replaced or rewritten since its header was read is refused instead of loading
garbage. :class:`LocalStore` is the local :class:`~.base.Store`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import ObjectHead, Runs
from .scatter import read_scattered
from .untrusted import err, open_regular_file, pread_exact

if TYPE_CHECKING:
    import numpy as np

_HAS_PREADV = hasattr(os, "preadv")
#: buffers per ``preadv`` call (the kernel's limit, IOV_MAX: 1024 on Linux)
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16
#: the page size: the unit in which the kernel reads files into its page cache
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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
    """The :class:`~.header.FileIdentity` each file must still have, checked against an open descriptor."""

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


def read_exact(file: str, fd: int, offset: int, view: memoryview, checks: IdentityChecks) -> None:
    """Read exactly ``len(view)`` bytes of ``fd`` (open on ``file``) from ``offset`` into ``view``.

    Raises:
        CheckpointError: the file ended first (a replaced or shrunk file says so first, see ``checks``).
    """
    size, pos = len(view), 0
    while pos < size:
        if _HAS_PREADV:  # reads straight into ``view``, no intermediate bytes object
            n = os.preadv(fd, [view[pos:]], offset + pos)
        else:  # pragma: no cover - platforms without preadv
            chunk = os.pread(fd, size - pos, offset + pos)
            n = len(chunk)
            view[pos : pos + n] = chunk
        if n == 0:
            checks.check(file, fd)
            msg = f"unexpected end of file reading bytes [{offset}, {offset + size}) (got {pos})"
            raise err(file, msg + "; file changed underneath?")
        pos += n


def read_consecutive(file: str, fd: int, offset: int, views: Sequence[memoryview], checks: IdentityChecks) -> int:
    """Read consecutive bytes of ``fd`` from ``offset`` into the non-empty ``views``, one ``preadv`` call per
    :data:`IOV_MAX` buffers, then buffer by buffer where a call read short. Returns the number of read calls."""
    pos, calls = offset, 0
    for i in range(0, len(views), IOV_MAX):
        chunk = views[i : i + IOV_MAX]
        size = sum(len(v) for v in chunk)
        n = os.preadv(fd, chunk, pos) if _HAS_PREADV else 0
        calls += 1
        if n < size:  # a short read (or no preadv): the rest buffer by buffer, exactly
            at = pos
            for v in chunk:
                if n >= len(v):
                    n -= len(v)
                else:
                    read_exact(file, fd, at + n, v[n:], checks)
                    calls, n = calls + 1, 0
                at += len(v)
        pos += size
    return calls


def _queue_pages(fd: int, spans: Sequence[tuple[int, int]]) -> None:
    """Ask the kernel to read every span's pages now, asynchronously, rather than one synchronous read after another."""
    if len(spans) > 1 and hasattr(os, "posix_fadvise"):
        for a, b in spans:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)


def page_cached(fd: int, offset: int) -> bool | None:
    """Whether the byte at ``offset`` of the open file ``fd`` is in the page cache: a one-byte ``RWF_NOWAIT`` read
    answers without waiting for the disk, or refuses to; None where the kernel cannot tell."""
    try:
        os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        return False
    except (AttributeError, OSError):  # no RWF_NOWAIT here (EOPNOTSUPP, EINVAL): unknown
        return None
    return True


class FileReader:
    """Holds open read-only file descriptors and reads exact byte ranges with ``preadv``.

    Thread-safe: descriptors are opened lazily under a lock and ``preadv`` has no shared file position.
    Use as a context manager (or call :meth:`close`) to release the descriptors.

    Args:
        identities: ``{file: FileIdentity}`` each file must still have (see :meth:`expect`).

    Attributes:
        bytes_read: Bytes read from the OS for callers so far (and coalescing over-read: :func:`read_ranges`).
        gap_bytes: Bytes :meth:`read_spans` read between the runs a caller wanted (on pages those runs
            touch anyway) and discarded.
        reads: Number of read requests that read at least one byte.
        sparse_files: Files advised ``POSIX_FADV_RANDOM`` (:meth:`will_read`).
    """

    def __init__(self, identities: Mapping[str, FileIdentity] | None = None) -> None:
        self._fds: dict[str, int] = {}
        self._checks = IdentityChecks(identities)
        self._lock = threading.Lock()
        self._read_ahead: set[str] = set()
        self.sparse_files: set[str] = set()
        self.bytes_read = 0
        self.gap_bytes = 0
        self.reads = 0

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every open descriptor (the reader may be reused: files reopen lazily)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def expect(self, file: str, identity: FileIdentity | None) -> None:
        """Require ``file`` to be ``identity`` from now on: checked now if it is open, else when it is opened.

        ``None`` is ignored (nothing is known about the file).

        Raises:
            CheckpointError: the open file is no longer ``identity``.
        """
        if identity is None:
            return
        with self._lock:
            self._checks.expect(file, identity)
            fd = self._fds.get(file)
        if fd is not None:
            self._checks.check(file, fd)

    def verify(self, file: str) -> None:
        """Check that ``file``, if open and expected, is still the identity it was expected to be.

        Raises:
            CheckpointError: it was replaced, resized or rewritten (a change of inode, size, mtime or ctime).
        """
        fd = self._fds.get(file)
        if fd is not None:
            self._checks.check(file, fd)

    def verify_all(self) -> None:
        """:meth:`verify` every open file."""
        for file in list(self._fds):
            self.verify(file)

    def will_read(self, file: str, ranges: Callable[[], Sequence[tuple[int, int]]], *, sparse: bool) -> None:
        """Hint that ``file`` is about to be read at ``ranges``: when ``sparse`` and not :meth:`read_ahead`, advise
        ``POSIX_FADV_RANDOM`` (no readahead beyond the ranges: it would read what other ranks need)."""
        if sparse and file not in self._read_ahead and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd(file), 0, 0, os.POSIX_FADV_RANDOM)
            self.sparse_files.add(file)

    def read_ahead(self, files: Iterable[str]) -> None:
        """Read ``files`` with readahead even if ``sparse``: this host's ranks read most of them (``host_reads``)."""
        self._read_ahead.update(files)

    def cached(self, file: str, offset: int) -> bool | None:
        """:func:`page_cached` of ``file`` (opened, and its identity checked, if it was not)."""
        return page_cached(self.fd(file), offset)

    def fd(self, file: str) -> int:
        """Return an open descriptor for ``file``, opening it (and checking its identity) on first use.

        Raises:
            CheckpointError: the file is not the identity :meth:`expect` was told.
        """
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = self._fds[file] = open_checked(file, self._checks)
        return fd

    def pread_into(self, file: str, offset: int, out: memoryview | bytearray) -> None:
        """Read exactly ``len(out)`` bytes (a writable, C-contiguous buffer) of ``file`` at ``offset`` into ``out``.

        Raises:
            CheckpointError: The file ended before ``len(out)`` bytes were read, or changed underneath.
        """
        view = memoryview(out).cast("B")
        if len(view) == 0:
            return
        read_exact(file, self.fd(file), offset, view, self._checks)
        self._count(len(view), 1)

    def pread_consecutive(self, file: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Read consecutive bytes of ``file`` from ``offset`` into the buffers ``outs``, one after another: one
        ``preadv`` call per :data:`IOV_MAX` buffers (many small tensors side by side in the file), not one per buffer.

        Raises:
            CheckpointError: The file ended before the last buffer was filled, or changed underneath.
        """
        views = [v for v in (memoryview(o).cast("B") for o in outs) if len(v)]
        calls = read_consecutive(file, self.fd(file), offset, views, self._checks)
        self._count(sum(len(v) for v in views), calls)

    def read_spans(
        self, file: str, spans: Sequence[tuple[int, int]], out: memoryview, base: int, *, wanted: int | None = None
    ) -> None:
        """Read each byte range ``[a, b)`` of ``file`` (absolute, non-empty, within ``[base, base + len(out))``) into
        ``out[a - base : b - base]``, one call per range (a range holding several runs reads their gaps too;
        :meth:`read_runs_to` reads the runs straight into place). ``wanted``: bytes of the spans the caller uses
        (counted in ``bytes_read``; the rest in ``gap_bytes``); default all of them.

        Raises:
            CheckpointError: The file ended before a range's end, or changed underneath.
        """
        view = memoryview(out).cast("B")
        fd = self.fd(file)
        total = 0
        for a, b in spans:
            read_exact(file, fd, a, view[a - base : b - base], self._checks)
            total += b - a
        used = total if wanted is None else wanted
        self._count(used, len(spans), total - used)

    def read_runs(self, file: str, runs: Runs, out: memoryview, base: int, *, wanted: int) -> None:
        """Read ``runs`` into ``out`` (the file from ``base`` on) by their page spans (:meth:`Runs.spans`: gaps on pages
        the runs touch anyway), one call per span. Every span's pages are queued at once (``POSIX_FADV_WILLNEED``)."""
        spans = runs.spans(PAGE)
        _queue_pages(self.fd(file), spans)
        self.read_spans(file, spans, out, base, wanted=wanted)

    def read_runs_to(self, file: str, runs: Runs, to: np.ndarray, spans: list | None = None) -> None:
        """:func:`~.scatter.read_scattered` (``to``: an address per run; ``spans``: ``runs.spans(PAGE)``)."""
        calls, gaps = read_scattered(file, self.fd(file), runs, to, runs.spans(PAGE) if spans is None else spans)
        self._count(len(to) * runs.length, calls, gaps)

    def _count(self, nbytes: int, reads: int, gap_bytes: int = 0) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.gap_bytes += gap_bytes
            self.reads += reads


class LocalStore:
    """A local checkpoint folder (see :class:`~.base.Store`): locations are absolute paths."""

    remote = False

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def locate(self, name: str) -> str:
        return os.path.join(self.root, name)

    def exists(self, location: str) -> bool:
        return os.path.lexists(location)

    def list_names(self) -> list[str] | None:
        try:
            return os.listdir(self.root)
        except OSError as e:
            raise err(self.root, f"cannot list the folder: {e.strerror or e}") from e

    def head(self, location: str, nbytes: int) -> ObjectHead:
        fd, st = open_regular_file(location)
        try:
            if hasattr(os, "posix_fadvise"):  # a header read must not pull the data after it into the page cache
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            data = pread_exact(fd, location, min(nbytes, st.st_size), 0)
        finally:
            os.close(fd)
        return ObjectHead(data, st.st_size, FileIdentity.of(st))

    def read_range(self, location: str, start: int, end: int, identity: object) -> bytes:
        fd = open_checked(location, IdentityChecks({location: identity} if identity is not None else None))
        try:
            return pread_exact(fd, location, end - start, start)
        finally:
            os.close(fd)

    def read_small(self, location: str, limit: int, what: str) -> bytes:
        fd, st = open_regular_file(location)
        try:
            if st.st_size > limit:
                raise err(location, f"{what} is {st.st_size} bytes, over the {limit}-byte limit")
            return pread_exact(fd, location, st.st_size, 0)
        finally:
            os.close(fd)

    def reader(self, identities: Mapping[str, object] | None = None) -> FileReader:
        return FileReader(identities)  # type: ignore[arg-type]
