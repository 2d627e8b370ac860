"""Local files: exact byte ranges read with ``preadv``, checked against each file's identity.

Every read is a system call on a file descriptor, never a memory map: a file that shrinks underneath the
load becomes a short read and a :class:`~loader.errors.CheckpointError` naming the file, never a SIGBUS.
A :class:`FileReader` (the local :class:`~.base.RangeReader`) reads through its open files
(:class:`~.local_files.OpenFiles`: each file's :class:`~.local_files.FileIdentity`, recorded when its header was
read, checked when the file is opened for data and on :meth:`FileReader.verify`): a file replaced or rewritten
since its header was read is refused instead of loading garbage. The local :class:`~.base.Store` is
:class:`~.local_store.LocalStore`.

Vocabulary: a *span* is a byte range ``[start, end)`` of one file; *runs* are one block's equal-length spans
(:class:`~.base.Runs`); *readahead* is the kernel reading a file's pages beyond what was asked.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from .base import Runs
from .local_files import FileIdentity, IdentityChecks, OpenFiles
from .scatter import read_scattered
from .untrusted import err

if TYPE_CHECKING:
    import numpy as np

_HAS_PREADV = hasattr(os, "preadv")
#: buffers per ``preadv`` call (the kernel's limit, IOV_MAX: 1024 on Linux)
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16
#: the page size: the unit in which the kernel reads files into its page cache
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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
            got = os.pread(fd, size - pos, offset + pos)
            n = len(got)
            view[pos : pos + n] = got
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
        batch = views[i : i + IOV_MAX]
        size = sum(len(v) for v in batch)
        n = os.preadv(fd, batch, pos) if _HAS_PREADV else 0
        calls += 1
        if n < size:  # a short read (or no preadv): the rest buffer by buffer, exactly
            at = pos
            for v in batch:
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
    """Reads exact byte ranges of local files with ``preadv``, through its open files (thread-safe: ``preadv``
    has no shared file position). Use as a context manager (or call :meth:`close`) to release the descriptors.

    Declares (:mod:`.capabilities`) readahead hints (:meth:`read_ahead`), scattered reads of runs straight into
    place (:meth:`read_runs_to`) and page-cache probes (:meth:`cached`).

    Args:
        identities: ``{file: FileIdentity}`` each file must still have (see :meth:`expect`).
        files: The open files to read through (shared with a reader composed over this one); default new ones
            told ``identities``.

    Attributes:
        bytes_read: Bytes read from the OS for callers so far (and coalescing over-read: :func:`read_ranges`).
        gap_bytes: Bytes :meth:`read_spans` read between the runs a caller wanted (on pages those runs
            touch anyway) and discarded.
        reads: Number of read requests that read at least one byte.
        sparse_files: Files advised ``POSIX_FADV_RANDOM`` (:meth:`will_read`).
    """

    def __init__(self, identities: Mapping[str, FileIdentity] | None = None, *, files: OpenFiles | None = None) -> None:
        self.files = files if files is not None else OpenFiles(identities)
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
        self.files.close()

    def expect(self, file: str, identity: FileIdentity | None) -> None:
        """:meth:`~.local_files.OpenFiles.expect`."""
        self.files.expect(file, identity)

    def verify(self, file: str) -> None:
        """:meth:`~.local_files.OpenFiles.verify`."""
        self.files.verify(file)

    def verify_all(self) -> None:
        """:meth:`verify` every open file."""
        self.files.verify_all()

    def fd(self, file: str) -> int:
        """:meth:`~.local_files.OpenFiles.fd`."""
        return self.files.fd(file)

    def will_read(self, file: str, ranges: Callable[[], Sequence[tuple[int, int]]], *, sparse: bool) -> None:
        """Hint that ``file`` is about to be read at ``ranges``: when ``sparse`` and not :meth:`read_ahead`, advise
        ``POSIX_FADV_RANDOM`` (no readahead beyond the ranges: it would read what other ranks need)."""
        if sparse and file not in self._read_ahead and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd(file), 0, 0, os.POSIX_FADV_RANDOM)
            self.sparse_files.add(file)

    def read_ahead(self, files: Iterable[str]) -> None:
        """Read ``files`` with readahead even if ``sparse``: this host's ranks read most of them
        (:mod:`loader.execute.host_shared`)."""
        self._read_ahead.update(files)

    def cached(self, file: str, offset: int) -> bool | None:
        """:func:`page_cached` of ``file`` (opened, and its identity checked, if it was not)."""
        return page_cached(self.fd(file), offset)

    def pread_into(self, file: str, offset: int, out: memoryview | bytearray) -> None:
        """Read exactly ``len(out)`` bytes (a writable, C-contiguous buffer) of ``file`` at ``offset`` into ``out``.

        Raises:
            CheckpointError: The file ended before ``len(out)`` bytes were read, or changed underneath.
        """
        view = memoryview(out).cast("B")
        if len(view) == 0:
            return
        read_exact(file, self.fd(file), offset, view, self.files.checks)
        self.count(len(view), 1)

    def pread_consecutive(self, file: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Read consecutive bytes of ``file`` from ``offset`` into the buffers ``outs``, one after another: one
        ``preadv`` call per :data:`IOV_MAX` buffers (many small tensors side by side in the file), not one per buffer.

        Raises:
            CheckpointError: The file ended before the last buffer was filled, or changed underneath.
        """
        views = [v for v in (memoryview(o).cast("B") for o in outs) if len(v)]
        calls = read_consecutive(file, self.fd(file), offset, views, self.files.checks)
        self.count(sum(len(v) for v in views), calls)

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
            read_exact(file, fd, a, view[a - base : b - base], self.files.checks)
            total += b - a
        used = total if wanted is None else wanted
        self.count(used, len(spans), total - used)

    def read_runs(self, file: str, runs: Runs, out: memoryview, base: int, *, wanted: int) -> None:
        """Read ``runs`` into ``out`` (the file from ``base`` on) by their page spans (:meth:`Runs.spans`: gaps on pages
        the runs touch anyway), one call per span. Every span's pages are queued at once (``POSIX_FADV_WILLNEED``)."""
        spans = runs.spans(PAGE)
        _queue_pages(self.fd(file), spans)
        self.read_spans(file, spans, out, base, wanted=wanted)

    def read_runs_to(self, file: str, runs: Runs, to: np.ndarray, spans: list | None = None) -> None:
        """:func:`~.scatter.read_scattered` (``to``: an address per run; ``spans``: ``runs.spans(PAGE)``)."""
        calls, gaps = read_scattered(file, self.fd(file), runs, to, runs.spans(PAGE) if spans is None else spans)
        self.count(len(to) * runs.length, calls, gaps)

    def count(self, nbytes: int, reads: int, gap_bytes: int = 0) -> None:
        """Add a read's figures to the counts."""
        with self._lock:
            self.bytes_read += nbytes
            self.gap_bytes += gap_bytes
            self.reads += reads
