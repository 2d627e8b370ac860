"""Reading exact byte ranges of checkpoint files (``pread``), optionally coalescing nearby ranges."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence

import torch

from .header import OPEN_FLAGS, TensorInfo, err

_HAS_PREADV = hasattr(os, "preadv")


class FileReader:
    """Holds open read-only file descriptors and reads exact byte ranges with ``pread``.

    Thread-safe: descriptors are opened lazily under a lock and ``pread`` has no shared file position.
    Use as a context manager (or call :meth:`close`) to release the descriptors.

    Attributes:
        bytes_read: Total bytes read from the OS so far (including any coalescing over-read).
        reads: Number of :meth:`pread_into` calls that read at least one byte.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every open descriptor. The reader may be reused afterwards (files reopen lazily)."""
        with self._lock:
            fds, self._fds = self._fds, {}
            maps, self._maps = self._maps, {}
        for m in maps.values():
            m.close()
        for fd in fds.values():
            os.close(fd)

    def mapping(self, file: str, end: int) -> mmap.mmap:
        """A read-only memory map of ``file`` that must hold at least ``end`` bytes.

        Used for reads of many small strided runs, copied in one vectorised step. The size is checked first
        (a mapping of a file truncated underneath would fault instead of raising).

        Raises:
            CheckpointError: the file is now shorter than ``end``.
        """
        fd = self.fd(file)
        size = os.fstat(fd).st_size
        if size < end:
            raise err(file, f"file is {size} bytes, the load needs {end}; file changed underneath?")
        with self._lock:
            m = self._maps.get(file)
            if m is None or len(m) < end:
                m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                if hasattr(mmap, "MADV_RANDOM"):  # no readahead past what prefetch() asks for
                    m.madvise(mmap.MADV_RANDOM)
                self._maps[file] = m
        return m

    def prefetch(self, file: str, start: int, end: int) -> None:
        """Ask the kernel to read bytes ``[start, end)`` of a mapped file now, in large requests."""
        m = self._maps.get(file)
        if m is None or not hasattr(mmap, "MADV_WILLNEED") or end <= start:
            return
        page = mmap.PAGESIZE
        lo = start - start % page
        m.madvise(mmap.MADV_WILLNEED, lo, min(end, len(m)) - lo)

    def advise_sparse(self, file: str) -> None:
        """Tell the kernel this file is read sparsely: no readahead beyond the ranges asked for."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd(file), 0, 0, os.POSIX_FADV_RANDOM)

    def count(self, nbytes: int) -> None:
        """Account ``nbytes`` read by a caller through :meth:`mapping`."""
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1

    def fd(self, file: str) -> int:
        """Return an open descriptor for ``file``, opening it on first use."""
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = os.open(file, OPEN_FLAGS)
                    self._fds[file] = fd
        return fd

    def pread_into(self, file: str, offset: int, out: memoryview | bytearray) -> None:
        """Read exactly ``len(out)`` bytes of ``file`` starting at ``offset`` into ``out``.

        Args:
            file: Path of the file.
            offset: Absolute byte offset to start at.
            out: Writable, C-contiguous buffer; its length is the number of bytes read.

        Raises:
            CheckpointError: The file ended before ``len(out)`` bytes were read.
        """
        view = memoryview(out).cast("B")
        size = len(view)
        if size == 0:
            return
        fd = self.fd(file)
        pos = 0
        while pos < size:
            if _HAS_PREADV:  # reads straight into ``out``, no intermediate bytes object
                n = os.preadv(fd, [view[pos:]], offset + pos)
            else:  # pragma: no cover - platforms without preadv
                chunk = os.pread(fd, size - pos, offset + pos)
                n = len(chunk)
                view[pos : pos + n] = chunk
            if n == 0:
                msg = f"unexpected end of file reading bytes [{offset}, {offset + size}) (got {pos})"
                raise err(file, msg + "; file changed underneath?")
            pos += n
        with self._lock:
            self.bytes_read += size
            self.reads += 1


def coalesce_ranges(
    ranges: Sequence[tuple[int, int]], *, max_gap: int = 4096, max_overread: float = 2.0
) -> list[tuple[int, int, list[int]]]:
    """Group byte ranges into fewer, larger reads.

    Ranges are sorted by start. The next range joins the current group when it overlaps or touches it,
    when the gap to it is ``<= max_gap``, or when the merged read stays within ``max_overread`` times the
    bytes actually wanted (the union of the member ranges). Empty ranges are left out of every group.

    Args:
        ranges: ``(start, end)`` absolute byte ranges, ``0 <= start <= end``.
        max_gap: Gap in bytes that is always worth reading through.
        max_overread: Largest allowed ratio of bytes read to bytes wanted for a merged read.

    Returns:
        ``(start, end, member_indices)`` per read, in file order; indices point into ``ranges``.

    Raises:
        ValueError: A range has ``start < 0`` or ``end < start``.
    """
    for start, end in ranges:
        if not (0 <= start <= end):
            raise ValueError(f"invalid byte range ({start}, {end})")
    order = sorted((i for i, (s, e) in enumerate(ranges) if e > s), key=lambda i: ranges[i])
    groups: list[tuple[int, int, list[int]]] = []
    g_start = g_end = wanted = 0
    members: list[int] = []
    for i in order:
        s, e = ranges[i]
        if members:
            new_end = max(g_end, e)
            new_wanted = wanted + max(0, e - max(s, g_end))
            if s - g_end <= max_gap or (new_end - g_start) <= max_overread * new_wanted:
                g_end, wanted = new_end, new_wanted
                members.append(i)
                continue
            groups.append((g_start, g_end, members))
        g_start, g_end, wanted, members = s, e, e - s, [i]
    if members:
        groups.append((g_start, g_end, members))
    return groups


def read_ranges(
    file: str,
    ranges: Sequence[tuple[int, int]],
    *,
    max_gap: int = 4096,
    max_overread: float = 2.0,
    reader: FileReader | None = None,
) -> list[memoryview]:
    """Read several absolute byte ranges of one file, coalescing nearby ranges (see :func:`coalesce_ranges`).

    Args:
        file: Path of the file.
        ranges: ``(start, end)`` absolute byte ranges; may overlap and be in any order.
        max_gap, max_overread: Coalescing policy, see :func:`coalesce_ranges`.
        reader: Reader to use (and account ``bytes_read`` on); a temporary one when ``None``.

    Returns:
        One read-only view per input range, in input order. Views of ranges read together share
        one buffer, which stays alive as long as any of them does.

    Raises:
        ValueError: A range is invalid.
        CheckpointError: The file is shorter than a requested range.
    """
    groups = coalesce_ranges(ranges, max_gap=max_gap, max_overread=max_overread)
    out: list[memoryview] = [memoryview(b"")] * len(ranges)
    own = reader is None
    rd = FileReader() if reader is None else reader
    try:
        for g_start, g_end, members in groups:
            buf = bytearray(g_end - g_start)
            rd.pread_into(file, g_start, buf)
            view = memoryview(buf).toreadonly()
            for i in members:
                s, e = ranges[i]
                out[i] = view[s - g_start : e - g_start]
    finally:
        if own:
            rd.close()
    return out


def read_tensor(info: TensorInfo, reader: FileReader | None = None) -> torch.Tensor:
    """Read one whole tensor into a new CPU tensor (bit-identical to ``safetensors.torch.load_file``).

    Args:
        info: Where the tensor lives.
        reader: Reader to use (and account ``bytes_read`` on); a temporary one when ``None``.

    Returns:
        A fresh, writable, contiguous CPU tensor of ``info.dtype`` and ``info.shape``.

    Raises:
        CheckpointError: The file is shorter than the header promised.
    """
    if info.nbytes == 0 or info.numel == 0:
        return torch.empty(info.shape, dtype=info.dtype)
    buf = bytearray(info.nbytes)
    own = reader is None
    rd = FileReader() if reader is None else reader
    try:
        rd.pread_into(info.file, info.data_start, buf)
    finally:
        if own:
            rd.close()
    return torch.frombuffer(buf, dtype=torch.uint8).view(info.dtype).reshape(info.shape)
