"""Bytes held in memory in front of a reader: a :class:`~.base.RangeReader` that serves some byte ranges of some
files from buffers (bytes fetched once and shared between ranks: :mod:`loader.distributed.exchange_reads`) and
reads everything else through the reader it wraps.

Each byte of a read comes from memory where a piece holds it, else through the wrapped reader: a read may cross
from held bytes into others (the executor joins touching ranges of two tensors, one shared and one not).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from .base import RangeReader, Runs, Segment, consecutive


class PieceViews(Sequence[memoryview]):
    """Pieces' bytes as slices of a few buffers, each made when asked for (a column shard has a piece per row):
    piece ``i`` is ``buffers[buffer_of[i]][offsets[i]:offsets[i] + sizes[i]]``."""

    def __init__(
        self, buffers: Sequence[memoryview], buffer_of: Sequence[int], offsets: Sequence[int], sizes: Sequence[int]
    ) -> None:
        self.buffers, self.buffer_of, self.offsets, self.sizes = buffers, buffer_of, offsets, sizes

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        o = self.offsets[i]
        return self.buffers[self.buffer_of[i]][o : o + self.sizes[i]]


@dataclass(frozen=True)
class HeldFile:
    """One file's held pieces: the bytes ``[starts[i], ends[i])`` are ``views[i]``; ascending, disjoint."""

    starts: list[int]
    ends: list[int]
    views: Sequence[memoryview]

    def holds(self, offset: int) -> int:
        """The piece holding byte ``offset``, or -1."""
        i = bisect.bisect_right(self.starts, offset) - 1
        return i if i >= 0 and offset < self.ends[i] else -1

    def overlaps(self, start: int, end: int) -> bool:
        """Whether some byte of ``[start, end)`` is held."""
        if self.holds(start) >= 0:
            return True
        nxt = self.next_start(start)
        return nxt is not None and nxt < end

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` no piece holds, ascending."""
        out, pos = [], start
        while pos < end:
            i = self.holds(pos)
            if i >= 0:
                pos = min(end, self.ends[i])
                continue
            nxt = self.next_start(pos)
            stop = end if nxt is None else min(end, nxt)
            out.append((pos, stop))
            pos = stop
        return out

    def next_start(self, offset: int) -> int | None:
        """The first piece start after ``offset``, or None."""
        i = bisect.bisect_right(self.starts, offset)
        return self.starts[i] if i < len(self.starts) else None

    def copy(self, i: int, offset: int, dst: memoryview) -> int:
        """Copy held bytes from ``offset`` (in piece ``i``) into ``dst``, across touching pieces, up to the end of
        ``dst`` or the first byte not held; returns the bytes copied."""
        pos, end, at = offset, offset + len(dst), 0
        while pos < end and i < len(self.starts) and self.starts[i] <= pos < self.ends[i]:
            n = min(end, self.ends[i]) - pos
            src = self.views[i]
            dst[at : at + n] = src[pos - self.starts[i] : pos - self.starts[i] + n]
            pos, at, i = pos + n, at + n, i + 1
        return at


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
        """``inner`` is told the parts of ``ranges()`` that are not held."""
        held = self.held.get(location)
        if held is None:
            self.inner.will_read(location, ranges, sparse=sparse)
            return
        self.inner.will_read(location, lambda: [m for a, b in ranges() for m in held.missing(a, b)], sparse=sparse)

    def pread_into(self, location: str, offset: int, out: memoryview | bytearray) -> None:
        view = memoryview(out).cast("B")
        if len(view):
            self._read(location, [(offset, view)], lambda: self.inner.pread_into(location, offset, out))

    def pread_consecutive(self, location: str, offset: int, outs: Sequence[memoryview]) -> None:
        segments = consecutive(offset, outs)
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
        """Serve the held bytes of ``segments``, the others through ``inner``: all at once (``whole``) when no
        segment overlaps held bytes."""
        held = self.held.get(location)
        if held is None or not any(held.overlaps(a, a + len(dst)) for a, dst in segments):
            whole()
            return
        for a, dst in segments:
            at = 0
            while at < len(dst):
                i = held.holds(a + at)
                if i >= 0:
                    n = held.copy(i, a + at, dst[at:])
                    self.served += n
                else:  # up to the next held byte, through the reader
                    nxt = held.next_start(a + at)
                    n = len(dst) - at if nxt is None else min(len(dst) - at, nxt - a - at)
                    self.inner.pread_into(location, a + at, dst[at : at + n])
                at += n
