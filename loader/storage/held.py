"""Bytes held in memory in front of a reader: a :class:`~.base.RangeReader` that serves some byte ranges of some
files from buffers (bytes fetched once and shared between ranks: :mod:`loader.distributed.exchange_reads`) and
reads everything else through the reader it wraps.

A read is served from memory when its first byte is held; held bytes are pieces, and a read that starts in one must
end in held bytes too (the pieces are cut from whole wanted ranges): anything else is an error, never a short copy.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .base import RangeReader, Runs

#: ``(offset, destination)``: the bytes ``[offset, offset + len(destination))`` of a file go to ``destination``
Segment = tuple[int, memoryview]


@dataclass(frozen=True)
class HeldFile:
    """One file's held pieces: the bytes ``[starts[i], ends[i])`` are ``views[i]``; ascending, disjoint."""

    starts: list[int]
    ends: list[int]
    views: list[memoryview]

    def holds(self, offset: int) -> int:
        """The piece holding byte ``offset``, or -1."""
        i = bisect.bisect_right(self.starts, offset) - 1
        return i if i >= 0 and offset < self.ends[i] else -1

    def copy(self, i: int, offset: int, dst: memoryview, location: str) -> None:
        """Copy the held bytes from ``offset`` (in piece ``i``) into ``dst``, across touching pieces."""
        pos, end, at = offset, offset + len(dst), 0
        while pos < end:
            if i >= len(self.starts) or not self.starts[i] <= pos < self.ends[i]:
                raise RuntimeError(f"{location}: bytes [{pos}, {end}) read from held bytes are not all held")
            n = min(end, self.ends[i]) - pos
            src = self.views[i]
            dst[at : at + n] = src[pos - self.starts[i] : pos - self.starts[i] + n]
            pos, at, i = pos + n, at + n, i + 1


class HeldReader:
    """Serves the :class:`HeldFile` bytes of ``held`` from memory and reads the rest through ``inner`` (see the
    module). Counts are ``inner``'s; closing it leaves ``inner`` open (its owner closes it).

    Args:
        inner: the reader of everything not held.
        held: ``{location: HeldFile}``.

    Attributes:
        served: bytes served from memory.
    """

    def __init__(self, inner: RangeReader, held: Mapping[str, HeldFile]) -> None:
        self.inner, self.held = inner, dict(held)
        self.served = 0

    @property
    def bytes_read(self) -> int:
        return self.inner.bytes_read

    @property
    def gap_bytes(self) -> int:
        return self.inner.gap_bytes

    @property
    def reads(self) -> int:
        return self.inner.reads

    def __enter__(self) -> HeldReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Drop the held bytes (``inner`` stays open)."""
        self.held.clear()

    def expect(self, location: str, identity: object | None) -> None:
        self.inner.expect(location, identity)

    def verify(self, location: str) -> None:
        self.inner.verify(location)

    def verify_all(self) -> None:
        self.inner.verify_all()

    def will_read(self, location: str, ranges: Callable[[], Sequence[tuple[int, int]]], *, sparse: bool) -> None:
        """``inner`` is told the ranges that are not held."""
        held = self.held.get(location)
        if held is None:
            self.inner.will_read(location, ranges, sparse=sparse)
            return
        self.inner.will_read(location, lambda: [r for r in ranges() if held.holds(r[0]) < 0], sparse=sparse)

    def pread_into(self, location: str, offset: int, out: memoryview | bytearray) -> None:
        view = memoryview(out).cast("B")
        if len(view):
            self._read(location, [(offset, view)], lambda: self.inner.pread_into(location, offset, out))

    def pread_consecutive(self, location: str, offset: int, outs: Sequence[memoryview]) -> None:
        segments, pos = [], offset
        for o in outs:
            view = memoryview(o).cast("B")
            if len(view):
                segments.append((pos, view))
                pos += len(view)
        if segments:
            self._read(location, segments, lambda: self.inner.pread_consecutive(location, offset, outs))

    def read_runs(self, location: str, runs: Runs, out: memoryview, base: int, *, wanted: int) -> None:
        """Held runs copied from memory (touching runs together), the others read through ``inner``."""
        if location not in self.held:
            self.inner.read_runs(location, runs, out, base, wanted=wanted)
            return
        view = memoryview(out).cast("B")
        segments = [(a, view[a - base : b - base]) for a, b in runs.spans(1)]
        if segments:
            self._read(location, segments, lambda: self.inner.read_runs(location, runs, out, base, wanted=wanted))

    def _read(self, location: str, segments: list[Segment], whole: Callable[[], None]) -> None:
        """Serve the held segments; the others through ``inner``: all of them at once (``whole``) when none is
        held, else one by one."""
        held = self.held.get(location)
        found = [held.holds(a) for a, _ in segments] if held is not None else [-1] * len(segments)
        if all(i < 0 for i in found):
            whole()
            return
        assert held is not None
        for (a, dst), i in zip(segments, found):
            if i < 0:
                self.inner.pread_into(location, a, dst)
            else:
                held.copy(i, a, dst, location)
                self.served += len(dst)
