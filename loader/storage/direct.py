"""Direct I/O: local reads with ``O_DIRECT``, bypassing the page cache (a cold load of a checkpoint read once, or
one larger than the cache), as InstantTensor reads.

Vocabulary:

- the *alignment* of a file: the logical block size of its device (sysfs; 4096 where unknown). An ``O_DIRECT``
  read starts and ends on it and lands in memory aligned on it;
- a *window*: the aligned byte range ``[offset rounded down, end rounded up)`` a read of ``[offset, end)`` reads;
  the bytes outside ``[offset, end)`` are discarded (counted as gap bytes);
- a *bounce buffer*: page-aligned memory (an anonymous mapping, :data:`BOUNCE_BYTES`, one per reading thread)
  a window is read into, :data:`BOUNCE_BYTES` at a time, then copied into the caller's buffers;
- *refused*: a filesystem without ``O_DIRECT`` (tmpfs before Linux 6.6 refuses the open, others the first
  read, with ``EINVAL``): the file is then read through the page cache, with a log line.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from collections.abc import Callable, Mapping, Sequence

from ..errors import CheckpointError
from .base import Runs
from .local import PAGE, FileReader
from .local_files import FileIdentity, OpenFiles
from .untrusted import OPEN_FLAGS, err

log = logging.getLogger("loader")

#: bytes of one bounce buffer (one per thread reading with ``O_DIRECT``)
BOUNCE_BYTES = 4 << 20
#: the alignment where the device's logical block size cannot be found
DEFAULT_ALIGN = 4096
#: whether this platform has ``O_DIRECT``
HAS_DIRECT = hasattr(os, "O_DIRECT")


class Refused(Exception):
    """The filesystem refused an ``O_DIRECT`` read (``EINVAL``): read the file through the page cache."""


def logical_block_size(device: int) -> int:
    """The logical block size of the block device ``device`` (``st_dev``), from sysfs (a partition's is its disk's);
    :data:`DEFAULT_ALIGN` where there is none (overlay, network and memory filesystems)."""
    base = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}"
    for path in (f"{base}/queue/logical_block_size", f"{base}/../queue/logical_block_size"):
        try:
            with open(path) as f:
                size = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if size > 0 and size & (size - 1) == 0 and size <= mmap.PAGESIZE:
            return size
    return DEFAULT_ALIGN


def open_direct(file: str, fd: int) -> int:
    """A second descriptor on ``file`` (open as ``fd``, its identity checked) with ``O_DIRECT``.

    Raises:
        Refused: the platform or the filesystem has no ``O_DIRECT``.
        CheckpointError: the path is no longer the file ``fd`` is open on (replaced in between), or cannot be opened.
    """
    if not HAS_DIRECT:
        raise Refused("no O_DIRECT on this platform")
    try:
        dfd = os.open(file, OPEN_FLAGS | os.O_DIRECT)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise Refused(str(e)) from e
        raise err(file, f"cannot open for direct I/O: {e.strerror or e}") from e
    st, want = os.fstat(dfd), os.fstat(fd)
    if (st.st_dev, st.st_ino) != (want.st_dev, want.st_ino):
        os.close(dfd)
        raise err(file, "file replaced underneath between two opens")
    return dfd


def bounce_buffer() -> memoryview:
    """A new page-aligned buffer of :data:`BOUNCE_BYTES`."""
    return memoryview(mmap.mmap(-1, BOUNCE_BYTES))


def read_direct(
    file: str, fd: int, offset: int, views: Sequence[memoryview], align: int, bounce: memoryview
) -> tuple[int, int]:
    """Read the bytes from ``offset`` on into the consecutive ``views`` through ``bounce``, by aligned windows.

    Returns:
        ``(read calls, bytes read and discarded)``.

    Raises:
        Refused: the filesystem refused the read (before any byte was read).
        CheckpointError: the file ended before the last view was filled (the caller checks its identity first).
    """
    end = offset + sum(len(v) for v in views)
    pos, stop = offset // align * align, -(-end // align) * align
    out = _Scatter(views, offset)
    calls = discarded = 0
    while pos < stop:
        size = min(len(bounce), stop - pos)
        try:
            n = os.preadv(fd, [bounce[:size]], pos)
        except OSError as e:
            if e.errno == errno.EINVAL and calls == 0:
                raise Refused(str(e)) from e
            raise err(file, f"direct read of bytes [{pos}, {pos + size}) failed: {e.strerror or e}") from e
        calls += 1
        valid = min(n, end - pos)
        if valid > out.at - pos:
            out.write(bounce[out.at - pos : valid], pos + valid)
        discarded += n - max(0, valid - max(0, offset - pos))
        if pos + n >= end:
            return calls, discarded
        if n == 0 or n % align:
            msg = f"unexpected end of file reading bytes [{offset}, {end}) (got {out.at - offset})"
            raise err(file, msg + "; file changed underneath?")
        pos += n
    return calls, discarded


class _Scatter:
    """Copies consecutive bytes into consecutive views: ``at`` is the file offset of the next byte to place."""

    __slots__ = ("at", "index", "inside", "views")

    def __init__(self, views: Sequence[memoryview], offset: int) -> None:
        self.views, self.at, self.index, self.inside = views, offset, 0, 0

    def write(self, data: memoryview, upto: int) -> None:
        """Place ``data``, the file bytes ``[at, upto)``."""
        done = 0
        while done < len(data):
            view = self.views[self.index]
            k = min(len(view) - self.inside, len(data) - done)
            view[self.inside : self.inside + k] = data[done : done + k]
            done += k
            self.inside += k
            if self.inside == len(view):
                self.index, self.inside = self.index + 1, 0
        self.at = upto


class DirectFileReader:
    """A local :class:`~.base.RangeReader` that reads with ``O_DIRECT`` (see the module): by aligned windows through
    a bounce buffer per thread, the alignment overread counted in ``gap_bytes``. A file whose filesystem refuses
    ``O_DIRECT`` is read through the page cache (one log line per reader), by a :class:`~.local.FileReader` over
    the same open files, which also keeps the counts.

    It declares no readahead, scattered runs nor page-cache probes (:mod:`.capabilities`): no page cache to share
    with the host's other ranks, and runs are read by aligned windows, never scattered into place.
    """

    def __init__(self, identities: Mapping[str, FileIdentity] | None = None) -> None:
        self._files = OpenFiles(identities)
        self._buffered = FileReader(files=self._files)  # refused files, and the counts
        self._lock = threading.Lock()
        self._direct: dict[str, tuple[int, int] | None] = {}  # file -> (descriptor, alignment); None: refused
        self._refused: list[int] = []  # descriptors of files refused after opening, closed with the others
        self._local = threading.local()
        self._warned = False

    bytes_read: property = property(lambda self: self._buffered.bytes_read)
    gap_bytes: property = property(lambda self: self._buffered.gap_bytes)
    reads: property = property(lambda self: self._buffered.reads)

    def __enter__(self) -> DirectFileReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every descriptor, direct and buffered, and drop the bounce buffers (the reader may be reused)."""
        with self._lock:
            fds = [d[0] for d in self._direct.values() if d is not None] + self._refused
            self._direct, self._refused = {}, []
        for fd in fds:
            os.close(fd)
        self._local = threading.local()  # the bounce buffers go with it
        self._files.close()

    def expect(self, file: str, identity: FileIdentity | None) -> None:
        self._files.expect(file, identity)

    def verify(self, file: str) -> None:
        self._files.verify(file)

    def verify_all(self) -> None:
        self._files.verify_all()

    def will_read(self, file: str, ranges: Callable[[], Sequence[tuple[int, int]]], *, sparse: bool) -> None:
        self._buffered.will_read(file, ranges, sparse=sparse)

    def pread_into(self, file: str, offset: int, out: memoryview | bytearray) -> None:
        view = memoryview(out).cast("B")
        if not view or not self._counted(file, offset, [view]):
            self._buffered.pread_into(file, offset, out)

    def pread_consecutive(self, file: str, offset: int, outs: Sequence[memoryview]) -> None:
        views = [v for v in (memoryview(o).cast("B") for o in outs) if len(v)]
        if not views or not self._counted(file, offset, views):
            self._buffered.pread_consecutive(file, offset, outs)

    def read_spans(
        self, file: str, spans: Sequence[tuple[int, int]], out: memoryview, base: int, *, wanted: int | None = None
    ) -> None:
        """:meth:`~.local.FileReader.read_spans` with ``O_DIRECT``."""
        view = memoryview(out).cast("B")
        total = calls = discarded = 0
        for i, (a, b) in enumerate(spans):
            done = self._read(file, a, [view[a - base : b - base]])
            if done is None:  # refused: the rest through the page cache
                self._buffered.read_spans(file, spans[i:], out, base, wanted=None if wanted is None else 0)
                break
            calls, discarded, total = calls + done[0], discarded + done[1], total + b - a
        used = total if wanted is None else wanted
        self._buffered.count(used, calls, total - used + discarded)

    def read_runs(self, file: str, runs: Runs, out: memoryview, base: int, *, wanted: int) -> None:
        if self._descriptor(file) is None:
            self._buffered.read_runs(file, runs, out, base, wanted=wanted)
        else:  # no pages queued: they would be read into the page cache
            self.read_spans(file, runs.spans(PAGE), out, base, wanted=wanted)

    def _counted(self, file: str, offset: int, views: list[memoryview]) -> bool:
        done = self._read(file, offset, views)
        if done is not None:
            self._buffered.count(sum(len(v) for v in views), done[0], done[1])
        return done is not None

    def _read(self, file: str, offset: int, views: list[memoryview]) -> tuple[int, int] | None:
        """Read with ``O_DIRECT``: ``(read calls, bytes discarded)``, or None where the filesystem refuses it."""
        direct = self._descriptor(file)
        if direct is None:
            return None
        fd, align = direct
        bounce = getattr(self._local, "bounce", None)
        if bounce is None:
            bounce = self._local.bounce = bounce_buffer()
        try:
            return read_direct(file, fd, offset, views, align, bounce)
        except Refused as e:
            with self._lock:
                if self._direct.get(file) is not None:
                    self._refused.append(fd)
                    self._direct[file] = None
            self._refuse(file, e)
            return None
        except CheckpointError:
            self._files.checks.check(file, fd)  # a file replaced or rewritten says so first
            raise

    def _descriptor(self, file: str) -> tuple[int, int] | None:
        if file in self._direct:
            return self._direct[file]
        fd = self._files.fd(file)
        with self._lock:
            if file in self._direct:
                return self._direct[file]
            try:
                direct = (open_direct(file, fd), logical_block_size(os.fstat(fd).st_dev))
            except Refused as e:
                direct = None
                self._refuse(file, e)
            self._direct[file] = direct
        return direct

    def _refuse(self, file: str, e: Exception) -> None:
        level, self._warned = logging.DEBUG if self._warned else logging.WARNING, True
        log.log(level, "%s: direct_io: O_DIRECT refused (%s); reading through the page cache", file, e)
