"""Bytes held in memory in front of a reader: a :class:`~.base.RangeReader` that serves some byte ranges of some
files from buffers and reads everything else through the reader it wraps.

Vocabulary:

- a *held span*: a byte range ``[start, end)`` of one file whose bytes lie in a buffer in memory (fetched once and
  exchanged between ranks: :mod:`loader.execute.exchanged`);
- a *buffer*: a ``uint8`` array holding some spans' bytes (a rank's received bytes, and those it fetched itself);
- a *run*: one of a read's equal-length byte ranges (a column shard's row), as :class:`~.base.Runs` gives them.

It is a reader like any other, wrapping one, and knows nothing of ranks: it stays in the storage layer.

Each byte of a read comes from memory where a span holds it, else through the wrapped reader: a read may cross
from held bytes into others (the executor joins touching ranges of two tensors, one shared and one not). A column
shard has a span per row (tens of thousands per rank): the runs of a read that lie inside one span each are copied
in a few numpy calls (:func:`gather`), only the others byte range by byte range.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .base import RangeReader, Runs, Segment, consecutive


def windows(buffer: np.ndarray, size: int) -> np.ndarray:
    """Every ``size``-byte stretch of the ``uint8`` array ``buffer`` as one element: element ``o`` is bytes
    ``[o, o + size)`` (a view, writable where ``buffer`` is; ``size`` at most ``len(buffer)``)."""
    return np.ndarray(shape=(len(buffer) - size + 1,), dtype=np.dtype((np.void, size)), buffer=buffer, strides=(1,))


def gather(dst: np.ndarray, at: np.ndarray, src: np.ndarray, offsets: np.ndarray, size: int) -> None:
    """``dst[at[i]:at[i] + size] = src[offsets[i]:offsets[i] + size]`` for every ``i``, in two numpy calls (the
    destinations disjoint)."""
    if len(at):
        windows(dst, size)[at] = windows(src, size)[offsets]


def _index(sorted_starts: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per offset, the last start at or before it (-1: none)."""
    return np.searchsorted(sorted_starts, offsets, side="right") - 1


@dataclass(frozen=True)
class HeldFile:
    """One file's held spans, ascending, disjoint: the bytes ``[starts[i], ends[i])`` are
    ``buffers[buffer_of[i]][offsets[i]:offsets[i] + ends[i] - starts[i]]`` (``int64`` arrays; ``uint8`` buffers:
    what a rank received, and what it fetched itself)."""

    starts: np.ndarray
    ends: np.ndarray
    buffer_of: np.ndarray
    offsets: np.ndarray
    buffers: tuple[np.ndarray, ...]

    def span(self, i: int) -> np.ndarray:
        """The bytes of span ``i``."""
        o = int(self.offsets[i])
        return self.buffers[int(self.buffer_of[i])][o : o + int(self.ends[i] - self.starts[i])]

    def within(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Per range ``[starts[j], ends[j])`` (non-empty), the span holding all of it, or -1."""
        if not len(self.starts):
            return np.full(len(starts), -1, dtype=np.int64)
        k = _index(self.starts, starts)
        return np.where((k >= 0) & (ends <= self.ends[np.maximum(k, 0)]), k, -1)

    def touched(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """Per range ``[starts[j], ends[j])``, whether some byte of it is held."""
        if not len(self.starts):
            return np.zeros(len(starts), dtype=bool)
        k = np.searchsorted(self.ends, starts, side="right")  # the first span ending after the range's start
        return (k < len(self.starts)) & (self.starts[np.minimum(k, len(self.starts) - 1)] < ends)

    def holds(self, offset: int) -> int:
        """The span holding byte ``offset``, or -1."""
        return int(self.within(np.array([offset]), np.array([offset + 1]))[0])

    def overlaps(self, start: int, end: int) -> bool:
        """Whether some byte of ``[start, end)`` is held."""
        return bool(self.touched(np.array([start]), np.array([end]))[0])

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        """The parts of ``[start, end)`` no span holds, ascending."""
        lo, hi = np.searchsorted(self.ends, start, side="right"), np.searchsorted(self.starts, end)
        out, pos = [], start
        for a, b in zip(self.starts[lo:hi].tolist(), self.ends[lo:hi].tolist()):
            if a > pos:
                out.append((pos, a))
            pos = max(pos, b)
        if pos < end:
            out.append((pos, end))
        return out

    def next_start(self, offset: int) -> int | None:
        """The first span start after ``offset``, or None."""
        i = int(np.searchsorted(self.starts, offset, side="right"))
        return int(self.starts[i]) if i < len(self.starts) else None

    def copy(self, i: int, offset: int, dst: memoryview) -> int:
        """Copy held bytes from ``offset`` (in span ``i``) into ``dst``, across touching spans, up to the end of
        ``dst`` or the first byte not held; returns the bytes copied."""
        pos, end, at = offset, offset + len(dst), 0
        while pos < end and i < len(self.starts) and self.starts[i] <= pos < self.ends[i]:
            first = int(self.starts[i])
            n = min(end, int(self.ends[i])) - pos
            dst[at : at + n] = self.span(i)[pos - first : pos - first + n]
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

        def not_held() -> list[tuple[int, int]]:
            r = np.fromiter(itertools.chain.from_iterable(ranges()), dtype=np.int64).reshape(-1, 2)
            r = r[(r[:, 1] > r[:, 0]) & (held.within(r[:, 0], r[:, 1]) < 0)]  # those in one span: dropped at once
            return [m for a, b in r.tolist() for m in held.missing(a, b)]

        self.inner.will_read(location, not_held, sparse=sparse)

    def pread_into(self, location: str, offset: int, out: memoryview | bytearray) -> None:
        view = memoryview(out).cast("B")
        if len(view):
            self._read(location, [(offset, view)], lambda: self.inner.pread_into(location, offset, out))

    def pread_consecutive(self, location: str, offset: int, outs: Sequence[memoryview]) -> None:
        segments = consecutive(offset, outs)
        if segments:
            self._read(location, segments, lambda: self.inner.pread_consecutive(location, offset, outs))

    def read_runs(self, location: str, runs: Runs, out: memoryview, base: int, *, wanted: int) -> None:
        """Runs inside one held span copied from memory at once per buffer, the others each byte from where it is
        (all through ``inner``'s own ``read_runs`` when no run touches held bytes)."""
        held = self.held.get(location)
        if held is not None:
            starts = runs.starts()
            if held.touched(starts, starts + runs.length).any():
                self._runs(location, held, starts, runs.length, memoryview(out).cast("B"), base)
                return
        self.inner.read_runs(location, runs, out, base, wanted=wanted)

    def _runs(self, location: str, held: HeldFile, starts: np.ndarray, n: int, view: memoryview, base: int) -> None:
        """The runs ``[starts[j], starts[j] + n)`` into ``view`` (at ``starts[j] - base``), some held."""
        k = held.within(starts, starts + n)
        inside = k >= 0
        dst = np.frombuffer(view, dtype=np.uint8)
        for b, buffer in enumerate(held.buffers):
            m = inside & (held.buffer_of[np.maximum(k, 0)] == b)
            if m.any():
                i = k[m]
                gather(dst, starts[m] - base, buffer, held.offsets[i] + starts[m] - held.starts[i], n)
        self.served += int(inside.sum()) * n
        self._serve(location, held, [(a, view[a - base : a - base + n]) for a in starts[~inside].tolist()])

    def _read(self, location: str, segments: list[Segment], whole: Callable[[], None]) -> None:
        """Serve the held bytes of ``segments``, the others through ``inner``: all at once (``whole``) when no
        segment overlaps held bytes."""
        held = self.held.get(location)
        if held is None or not any(held.overlaps(a, a + len(dst)) for a, dst in segments):
            whole()
            return
        self._serve(location, held, segments)

    def _serve(self, location: str, held: HeldFile, segments: list[Segment]) -> None:
        """Each byte of ``segments`` from the span holding it, else through ``inner`` (up to the next held byte)."""
        for a, dst in segments:
            at = 0
            while at < len(dst):
                i = held.holds(a + at)
                if i >= 0:
                    n = held.copy(i, a + at, dst[at:])
                    self.served += n
                else:
                    nxt = held.next_start(a + at)
                    n = len(dst) - at if nxt is None else min(len(dst) - at, nxt - a - at)
                    self.inner.pread_into(location, a + at, dst[at : at + n])
                at += n
