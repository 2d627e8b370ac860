"""Runs read straight into place: one ``preadv`` per page span, an iovec per run (into its destination) and per gap
between runs (into a small sink), so that a column shard's rows land in the model tensor without a staging copy.

Vocabulary: a block's *runs* (:class:`~.base.Runs`) are merged into *page spans* (ranges whose gaps hold no page
the runs do not touch); a span is read by one call through its gaps. Read into a staging buffer, every byte of the
span is written there and the runs are then copied out (the *span read*); read *scattered*, each run goes to its
own address and each gap to the sink, overwritten again and again, and nothing is copied after. The iovec arrays
are built with numpy and handed to libc's ``preadv`` through ctypes (which releases the GIL): no Python object per
run.

Which is faster depends on the run length: the kernel spends about :data:`SEGMENT_SECONDS` on every fragment of a
page an iovec ends in, and the span read spends :data:`COPY_BYTES_PER_SECOND` on copying the runs out.
:func:`scatter_pays` compares the two for a block; :func:`calibrate` measures both constants on this machine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time

import numpy as np

from .base import Runs
from .untrusted import err

#: the page size (the unit the kernel copies out of its page cache)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: iovecs per ``preadv`` call (the kernel's limit, IOV_MAX: 1024 on Linux)
IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 16
#: seconds the kernel spends on each extra fragment of a page an iovec boundary makes (:func:`calibrate` on a 2-CPU AMD
#: EPYC VM: 28-40 ns; 1 MiB read in 1024 iovecs of 1 KiB against one)
SEGMENT_SECONDS = 30e-9
#: bytes per second of the strided copy out of a warm staging buffer into the destination, one torch thread
#: (:func:`calibrate` on the same machine: 64-69 GB/s; 45 GB/s for rows of 64 B to 8 KiB out of 1-4 MiB spans)
COPY_BYTES_PER_SECOND = 60e9


def _libc_preadv():
    """libc's ``preadv`` through ctypes (None where there is none: the span read is used)."""
    if not hasattr(os, "preadv") or ctypes.sizeof(ctypes.c_void_p) != 8:
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).preadv
    except (OSError, AttributeError):  # pragma: no cover - no libc preadv
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    fn.restype = ctypes.c_ssize_t
    return fn


_PREADV = _libc_preadv()
#: whether scattered reads are available here
SCATTER = _PREADV is not None


def scatter_pays(runs: int, spans: int, span_bytes: int, wanted: int) -> bool:
    """Whether reading ``runs`` runs (``wanted`` bytes, merged into ``spans`` page spans of ``span_bytes`` in all)
    scattered beats the span read: the fragments of pages the iovecs cut (``2 * runs - spans`` iovecs over
    ``span_bytes / PAGE`` pages) against copying ``wanted`` bytes out of staging."""
    fragments = max(0, 2 * runs - spans - span_bytes // PAGE)
    return SCATTER and fragments * SEGMENT_SECONDS < wanted / COPY_BYTES_PER_SECOND


def read_scattered(
    file: str, fd: int, runs: Runs, targets: np.ndarray, spans: list[tuple[int, int]]
) -> tuple[int, int]:
    """Read every run of ``runs`` (bytes of ``fd``, open on ``file``) to its address in ``targets`` (one per run,
    in ascending file order: memory the caller keeps alive and writable), one ``preadv`` per page span of
    ``spans`` (``runs.spans(PAGE)``; per :data:`IOV_MAX` iovecs), the gaps inside a span into a sink; every span's
    pages are queued first (``POSIX_FADV_WILLNEED``: a cold read asks for them all at once).

    Returns:
        ``(read calls, gap bytes read)``.

    Raises:
        CheckpointError: the file ended before a span's end (naming it); OSError: the read failed.
    """
    starts = runs.starts()
    length, n = runs.length, len(starts)
    if n == 0:
        return 0, 0
    if len(spans) > 1 and hasattr(os, "posix_fadvise"):  # every span's pages queued at once, not one after another
        for a, b in spans:
            os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_WILLNEED)
    first = np.searchsorted(starts, np.array([a for a, _ in spans], dtype=np.int64))  # each span's first run
    gaps = starts[1:] - starts[:-1] - length  # the gap after each run but the last
    joined = np.ones(n - 1, dtype=bool)
    joined[first[1:] - 1] = False  # the gap after a span's last run is not read
    before = np.concatenate(([0], np.cumsum(joined)))  # joined gaps before each run
    at = np.arange(n) + before  # each run's iovec
    iov = np.empty((n + int(before[-1]), 2), dtype=np.uint64)
    iov[at, 0], iov[at, 1] = targets, length
    sink = np.empty(max(2 * PAGE, int(gaps[joined].max()) if joined.any() else 0), dtype=np.uint8)
    iov[at[:-1][joined] + 1, 0], iov[at[:-1][joined] + 1, 1] = sink.ctypes.data, gaps[joined]
    bounds = np.append(at[first], len(iov)).tolist()
    address, calls = iov.ctypes.data, 0
    for k, (a, b) in enumerate(spans):  # a few integer operations per span: a column shard may have one per row
        lo, hi, offset = bounds[k], bounds[k + 1], a
        while lo < hi:
            count = min(IOV_MAX, hi - lo)
            want = b - offset if count == hi - lo else int(iov[lo : lo + count, 1].sum())
            got = _PREADV(fd, address + 16 * lo, count, offset)
            calls += 1
            if got < 0:
                code = ctypes.get_errno()
                raise OSError(code, os.strerror(code), file)
            if got < want:  # a short read: the rest of this call's iovecs one after another
                _finish(file, fd, iov[lo : lo + count], offset, got)
                calls += 1
            lo, offset = lo + count, offset + want
    return calls, int(gaps[joined].sum())


def _finish(file: str, fd: int, iov: np.ndarray, offset: int, done: int) -> None:
    """Complete a ``preadv`` of ``iov`` at ``offset`` that read ``done`` bytes, exactly, or raise at the file's end."""
    for base, size in iov.tolist():
        if done >= size:
            done, offset = done - size, offset + size
            continue
        view = memoryview((ctypes.c_char * (size - done)).from_address(base + done)).cast("B")
        pos = 0
        while pos < len(view):
            n = os.preadv(fd, [view[pos:]], offset + done + pos)
            if n == 0:
                raise err(file, f"unexpected end of file reading bytes [{offset}, {offset + size}); file changed?")
            pos += n
        done, offset = 0, offset + size


def calibrate(file: str, seconds: float = 0.5) -> tuple[float, float]:
    """Measure :data:`SEGMENT_SECONDS` and :data:`COPY_BYTES_PER_SECOND` on this machine (``file``: any file of at
    least 1 MiB, read warm): ``preadv`` of 1 MiB in 1024 iovecs of 1 KiB against one, and a strided copy of 1024
    rows of 512 B out of rows of 2 KiB (torch, this thread's torch threads). Returns
    ``(segment seconds, copy bytes per second)``."""
    import torch

    n, size = IOV_MAX, (1 << 20) // IOV_MAX
    fd = os.open(file, os.O_RDONLY)
    try:
        buf = np.empty(1 << 20, dtype=np.uint8)
        one = np.array([[buf.ctypes.data, 1 << 20]], dtype=np.uint64)
        many = np.empty((n, 2), dtype=np.uint64)
        many[:, 0], many[:, 1] = buf.ctypes.data + np.arange(n, dtype=np.uint64) * size, size
        t_one = _best(lambda: _PREADV(fd, one.ctypes.data, 1, 0), seconds / 3)
        t_many = _best(lambda: _PREADV(fd, many.ctypes.data, n, 0), seconds / 3)
    finally:
        os.close(fd)
    staging, dest = torch.empty(1024 * 2048, dtype=torch.uint8), torch.empty(1024, 512, dtype=torch.uint8)
    rows = torch.as_strided(staging, (1024, 512), (2048, 1))
    t_copy = _best(lambda: dest.copy_(rows), seconds / 3)
    fragments = max(1, n - (1 << 20) // PAGE)
    return max(0.0, t_many - t_one) / fragments, dest.numel() / t_copy


def _best(fn, seconds: float) -> float:
    """The fastest of repeated calls of ``fn`` over about ``seconds`` (at least 20, after one to warm up)."""
    fn()
    best, end, calls = float("inf"), time.perf_counter() + seconds, 0
    while calls < 20 or time.perf_counter() < end:
        calls += 1
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best
