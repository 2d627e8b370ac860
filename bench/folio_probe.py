"""Probe: how each way of filling the page cache sizes its folios, what it reads from the disk, and how fast a
warm read then copies out of the cache.

    python bench/folio_probe.py [--dir DIR] [--size MiB] [--repeats N] [--markdown]

Why it exists: a warm load copies every page it needs out of the page cache, and the kernel copies out of large
folios (16 KiB - 2 MiB, what readahead allocates) much faster than out of 4 KiB ones. Which folios hold a file is
decided by whoever read it first. This probe writes one file (``--size`` MiB of random bytes in ``--dir``, a
temporary folder on the checkpoints' file system by default) and wants a rank-like set of byte ranges of it:
1.25 MiB of every 3 MiB, at offsets that are page-aligned but not aligned to 2 MiB (as one tensor-parallel rank of
bench/tp_bench.py wants whole 1 MiB column-shard tensors and a quarter of the row-shard tensors beside them).

For each way of filling the cache, the file is dropped from the cache (``POSIX_FADV_DONTNEED``), the wanted ranges
are read that way, and the probe reports:

- *physical*: bytes read from the block device (``read_bytes`` of ``/proc/self/io``) / the wanted ranges' pages;
- *large folios*: the fraction of the wanted pages held in folios larger than a page (``/proc/kpageflags``
  through ``/proc/self/pagemap``; readable by root only, else "n/a");
- *warm copy*: the wanted ranges read again with ``preadv``, each into one reused buffer (as into a staging buffer),
  best of ``--repeats``, in GB/s.

Ways of filling: ``pread_random`` (what ``loader`` does for a file it reads sparsely: the descriptor advised
``POSIX_FADV_RANDOM``, one ``preadv`` per range), ``pread`` (no advice), ``mmap_touch`` (what memory-mapping
readers such as safetensors' ``safe_open`` do: the ranges copied out of a mapping with the default advice, so the
kernel reads around each fault), ``mmap_random`` (a mapping advised ``MADV_RANDOM``, the ranges populated with
``MADV_POPULATE_READ``: no read-around), ``mmap_hugepage`` (a mapping advised ``MADV_HUGEPAGE`` and ``MADV_RANDOM``, the
ranges populated with ``MADV_POPULATE_READ``: whole 2 MiB folios) and ``whole_file`` (the whole file read in
order, as ``cat`` or a download leaves it).
"""

from __future__ import annotations

import argparse
import mmap
import os
import struct
import sys
import tempfile
import time

import numpy as np
from common import drop_cache, read_bytes

PAGE = os.sysconf("SC_PAGE_SIZE")
MIB = 1 << 20
PERIOD, WANTED, SKEW = 3 * MIB, MIB + MIB // 4, 768 * 1024  # 1.25 MiB of every 3 MiB, from 768 KiB in
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
KPF_COMPOUND_HEAD, KPF_COMPOUND_TAIL = 1 << 15, 1 << 16


def wanted_ranges(size: int) -> list[tuple[int, int]]:
    """The byte ranges a rank-like reader wants of a file of ``size`` bytes."""
    return [(a + SKEW, a + SKEW + WANTED) for a in range(0, size - PERIOD + 1, PERIOD)]


def _preadv_ranges(fd: int, ranges: list[tuple[int, int]], buf: memoryview) -> None:
    """Read each range into the start of ``buf`` (one reused buffer, as a staging buffer is)."""
    for a, b in ranges:
        n, got = b - a, 0
        while got < n:
            got += os.preadv(fd, [buf[got:n]], a + got)


def fill_pread(path: str, ranges: list[tuple[int, int]], random: bool) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        if random:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        _preadv_ranges(fd, ranges, memoryview(bytearray(max(b - a for a, b in ranges))))
    finally:
        os.close(fd)


def fill_mmap(path: str, ranges: list[tuple[int, int]], hugepage: bool, populate: bool = False) -> None:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        if hugepage or populate:
            if hugepage:
                m.madvise(mmap.MADV_HUGEPAGE)
            m.madvise(mmap.MADV_RANDOM)
            for a, b in ranges:
                start = a - a % PAGE
                m.madvise(MADV_POPULATE_READ, start, b - start)
            return
        sink = 0
        for a, b in ranges:
            sink ^= len(m[a:b])  # copied out of the mapping, as a memory-mapping reader's narrow and copy do


def fill_whole(path: str, ranges: list[tuple[int, int]]) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.read(8 * MIB):
            pass


FILLS = {
    "pread_random": lambda p, r: fill_pread(p, r, True),
    "pread": lambda p, r: fill_pread(p, r, False),
    "mmap_random": lambda p, r: fill_mmap(p, r, False, populate=True),
    "mmap_touch": lambda p, r: fill_mmap(p, r, False),
    "mmap_hugepage": lambda p, r: fill_mmap(p, r, True),
    "whole_file": fill_whole,
}


def large_folio_fraction(path: str, ranges: list[tuple[int, int]]) -> float | None:
    """The fraction of the ranges' (cached) pages that belong to a folio larger than a page, or None where
    ``/proc/kpageflags`` cannot be read. Maps the file advised ``MADV_RANDOM`` and touches each cached page."""
    try:
        flags = os.open("/proc/kpageflags", os.O_RDONLY)
    except OSError:
        return None
    pagemap = os.open("/proc/self/pagemap", os.O_RDONLY)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            m.madvise(mmap.MADV_RANDOM)
            view = np.frombuffer(m, dtype=np.uint8)
            base, large, pages = view.ctypes.data, 0, 0
            for a, b in ranges:
                for off in range(a - a % PAGE, b, PAGE):
                    int(view[off])  # map the (cached) page
                    entry = struct.unpack("<Q", os.pread(pagemap, 8, (base + off) // PAGE * 8))[0]
                    pfn = entry & ((1 << 55) - 1)
                    if not entry >> 63 or not pfn:  # not present, or PFNs hidden from this process
                        return None
                    bits = struct.unpack("<Q", os.pread(flags, 8, pfn * 8))[0]
                    pages += 1
                    large += bool(bits & (KPF_COMPOUND_HEAD | KPF_COMPOUND_TAIL))
            del view
        return large / pages if pages else None
    finally:
        os.close(pagemap)
        os.close(flags)


def warm_copy(path: str, ranges: list[tuple[int, int]], repeats: int) -> float:
    """Bytes per second of reading ``ranges`` again with ``preadv`` (a descriptor advised ``POSIX_FADV_RANDOM``,
    so no pages beyond them are added), best of ``repeats``."""
    total = sum(b - a for a, b in ranges)
    buf = memoryview(bytearray(max(b - a for a, b in ranges)))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            _preadv_ranges(fd, ranges, buf)
            best = min(best, time.perf_counter() - t)
    finally:
        os.close(fd)
    return total / best


def probe(path: str, repeats: int) -> list[dict]:
    ranges = wanted_ranges(os.path.getsize(path))
    pages = sum((b + PAGE - 1) // PAGE - a // PAGE for a, b in ranges) * PAGE
    rows = []
    for name, fill in FILLS.items():
        drop_cache([path])
        before = read_bytes()
        t = time.perf_counter()
        fill(path, ranges)
        seconds = time.perf_counter() - t
        physical = read_bytes() - before
        rows.append(
            {
                "fill": name,
                "physical": physical / pages,
                "cold_seconds": seconds,
                "large": large_folio_fraction(path, ranges),
                "warm": warm_copy(path, ranges, repeats),
            }
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", help="folder for the probe's file (default: a temporary folder)")
    parser.add_argument("--size", type=int, default=96, help="the file's size in MiB (default 96)")
    parser.add_argument("--repeats", type=int, default=7, help="warm reads per fill, best taken (default 7)")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/benchmarks.md holds")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import mdtable

    watch = mdtable.LoadWatch()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = os.path.join(tmp, "probe.bin")
        with open(path, "wb") as f:
            for _ in range(args.size):
                f.write(np.random.bytes(MIB))
            f.flush()
            os.fsync(f.fileno())
        rows = probe(path, args.repeats)
    load = watch.stop()
    wanted = sum(b - a for a, b in wanted_ranges(args.size * MIB))
    headers = ["fill", "physical ÷ wanted pages", "large-folio pages", "cold fill", "warm copy (preadv)"]
    table = [
        [
            f"`{r['fill']}`",
            f"{r['physical']:.3f}x",
            "n/a" if r["large"] is None else f"{r['large']:.0%}",
            f"{r['cold_seconds']:.3f} s",
            f"{r['warm'] / 1e9:.2f} GB/s",
        ]
        for r in rows
    ]
    if not args.markdown:
        print(f"file {args.size} MiB, wanted {wanted / MIB:.1f} MiB in {len(wanted_ranges(args.size * MIB))} ranges")
    mdtable.emit(args.markdown, load, headers, table, packages=("torch",))
    return 0


if __name__ == "__main__":
    sys.exit(main())
