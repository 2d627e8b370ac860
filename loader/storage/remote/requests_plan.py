"""Planning one object's requests from the byte ranges a reader will want: pure functions, no I/O.

Vocabulary:

- the *wanted* ranges: ``(start, end)`` byte ranges a caller will read (any order; they may overlap or touch);
- a *span* (:class:`Span`): one contiguous range fetched: wanted ranges merged where they overlap or touch,
  joined across the gap between two of them where reading the gap costs less than not reading it
  (:func:`join_limit`), cut where over ``max_request_bytes``;
- a *request* (:class:`Request`): the spans one backend call fetches: one span, or up to ``max_ranges`` of them
  where the backend takes multi-range requests (``multipart/byteranges``).

The cost model. A gap of ``g`` bytes read through costs ``g / bandwidth`` seconds; not reading it costs another
span. On a backend of single-range requests (S3) another span is another request: ``latency`` seconds, so a gap
is worth reading below ``gap_bytes = latency * bandwidth`` (500 kB with the defaults). On a multi-range backend
(nginx) another span is another part of a request: a part's headers (:data:`PART_BYTES`) and ``1 / max_ranges``
of a request, so the limit is ``gap_bytes / max_ranges + PART_BYTES`` (8 kB with the defaults).

Bytes are also what a node's link is short of when all its ranks read at once, and then every byte read through
is wall time: a gap is joined only where it is also small against the ranges beside it, ``gap <= MAX_OVERREAD *
(left + right) / 2`` bytes, which bounds the bytes fetched by ``(1 + MAX_OVERREAD)`` times the bytes wanted
whatever the layout. The trade-off, on a column (row-parallel) shard of a tensor whose rows are 8 KiB, a rank of
four reading 2 KiB of each row: its 6 KiB gaps are under ``gap_bytes``, and reading them through would fetch
four times its bytes; they are not read. Over HTTP with multi-range requests that costs nothing (64 rows a
request); on S3 it costs a request per row (2 KiB each, ``concurrency`` at a time), the price of fetching a
quarter of the bytes. A layout whose gaps are small against its runs (a few bytes of alignment between tensors,
a 2 KiB gap between 100 KiB rows) is joined into few large requests as the cost model says.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: the bytes read through for fewer requests, at most, as a fraction of the bytes wanted (see the module)
MAX_OVERREAD = 0.05
#: bytes a part of a ``multipart/byteranges`` response costs beyond its payload (boundary and headers)
PART_BYTES = 100
#: a multi-range request carries spans while its bytes stay under this many ``gap_bytes``: by then its latency
#: is under a ninth of its cost, and smaller requests keep ``concurrency`` connections busy at once
GROUP_LATENCIES = 8


@dataclass(frozen=True)
class Span:
    """One contiguous byte range fetched.

    Attributes:
        start: First byte.
        end: One past the last byte.
        wanted: The wanted ranges inside it, ascending and disjoint, the first starting at ``start`` and the last
            ending at ``end`` (the bytes between them are gaps, read through and discarded).
        wanted_bytes: Bytes in ``wanted``.
    """

    start: int
    end: int
    wanted: tuple[tuple[int, int], ...]
    wanted_bytes: int

    @classmethod
    def of(cls, wanted: tuple[tuple[int, int], ...]) -> Span:
        """The span of the ``wanted`` ranges (ascending, disjoint, not empty)."""
        return cls(wanted[0][0], wanted[-1][1], wanted, sum(b - a for a, b in wanted))

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Request:
    """The spans one backend call fetches (ascending, disjoint)."""

    spans: tuple[Span, ...]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        """The ``(start, end)`` ranges to ask the backend for."""
        return [(s.start, s.end) for s in self.spans]

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes the request fetches (gaps read through included)."""
        return sum(s.end - s.start for s in self.spans)

    @functools.cached_property
    def wanted_bytes(self) -> int:
        return sum(s.wanted_bytes for s in self.spans)


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> np.ndarray:
    """The union of ``ranges`` as ascending, disjoint, non-touching ``(start, end)`` rows (an ``(n, 2)`` int64
    array); empty ranges are dropped.

    Raises:
        ValueError: a range has ``start < 0`` or ``end < start``.
    """
    arr = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    if len(arr) and (arr[:, 0].min() < 0 or (arr[:, 1] < arr[:, 0]).any()):
        bad = arr[(arr[:, 0] < 0) | (arr[:, 1] < arr[:, 0])][0]
        raise ValueError(f"invalid byte range ({bad[0]}, {bad[1]})")
    arr = arr[arr[:, 1] > arr[:, 0]]
    if len(arr) == 0:
        return arr
    arr = arr[np.lexsort((arr[:, 1], arr[:, 0]))]
    reach = np.maximum.accumulate(arr[:, 1])  # the furthest end of every range up to each one
    new = np.concatenate(([True], arr[1:, 0] > reach[:-1]))  # starts a run of overlapping or touching ranges
    firsts = np.flatnonzero(new)
    lasts = np.concatenate((firsts[1:] - 1, [len(arr) - 1]))
    return np.stack((arr[firsts, 0], reach[lasts]), axis=1)


def join_limit(gap_bytes: int, multi_range: bool, max_ranges: int) -> int:
    """The largest gap worth reading through on its own (the module's cost model): ``gap_bytes`` where another
    span is another request, ``gap_bytes / max_ranges + PART_BYTES`` where it is another part of one."""
    if multi_range and max_ranges > 1:
        return gap_bytes // max_ranges + PART_BYTES
    return gap_bytes


def join_gaps(merged: np.ndarray, limit: int, max_overread: float = MAX_OVERREAD) -> list[Span]:
    """Join the ranges of :func:`merge_ranges` into spans across each gap ``g`` with ``g <= limit`` and
    ``g <= max_overread * (left + right) / 2`` (the ranges either side): every range counts in two gaps at
    most, half each time, so the gaps read through total at most ``max_overread`` times the bytes wanted."""
    if len(merged) == 0:
        return []
    starts, ends = merged[:, 0], merged[:, 1]
    sizes = ends - starts
    gaps = starts[1:] - ends[:-1]
    join = (gaps <= limit) & (gaps * 2 <= max_overread * (sizes[:-1] + sizes[1:]))
    cuts = np.flatnonzero(~join) + 1
    bounds = np.concatenate(([0], cuts, [len(merged)]))
    wanted = np.concatenate(([0], np.cumsum(sizes)))[bounds]
    rows = list(zip(starts.tolist(), ends.tolist()))
    bounds, wanted = bounds.tolist(), np.diff(wanted).tolist()
    return [Span(rows[i][0], rows[j - 1][1], tuple(rows[i:j]), n) for i, j, n in zip(bounds[:-1], bounds[1:], wanted)]


def split_span(span: Span, max_bytes: int) -> list[Span]:
    """``span`` cut into near-equal parts of at most ``max_bytes`` (fetched in parallel), each part trimmed to its
    wanted bytes (a part holding none is dropped)."""
    if span.nbytes <= max_bytes:
        return [span]
    count = -(-span.nbytes // max_bytes)
    step = -(-span.nbytes // count)
    out = []
    for lo in range(span.start, span.end, step):
        hi = min(lo + step, span.end)
        inside = tuple((max(a, lo), min(b, hi)) for a, b in span.wanted if a < hi and b > lo)
        if inside:
            out.append(Span.of(inside))
    return out


def group_spans(spans: Sequence[Span], max_ranges: int, max_bytes: int) -> list[Request]:
    """Consecutive spans grouped into requests of at most ``max_ranges`` spans and ``max_bytes`` bytes (a span
    alone may reach ``max_bytes``), in order."""
    out: list[Request] = []
    group: list[Span] = []
    nbytes = 0
    for span in spans:
        if group and (len(group) >= max_ranges or nbytes + span.nbytes > max_bytes):
            out.append(Request(tuple(group)))
            group, nbytes = [], 0
        group.append(span)
        nbytes += span.nbytes
    if group:
        out.append(Request(tuple(group)))
    return out


def plan_requests(
    ranges: Sequence[tuple[int, int]],
    *,
    gap_bytes: int,
    max_request_bytes: int,
    multi_range: bool,
    max_ranges: int,
    max_overread: float = MAX_OVERREAD,
) -> list[Request]:
    """The requests fetching the wanted ``ranges`` of one object, ascending (see the module's cost model).

    Every wanted byte lies in exactly one span; no span is over ``max_request_bytes``; a request carries one
    span, or up to ``max_ranges`` where ``multi_range``, and at most ``max_request_bytes`` (and, grouping several,
    ``GROUP_LATENCIES * gap_bytes``); the bytes fetched are at most ``1 + max_overread`` times the bytes wanted.

    Raises:
        ValueError: a range has ``start < 0`` or ``end < start``, or a limit is not positive.
    """
    if max_request_bytes <= 0 or max_ranges <= 0 or gap_bytes < 0:
        raise ValueError(f"limits must be positive: max_request_bytes={max_request_bytes}, max_ranges={max_ranges}")
    merged = merge_ranges(ranges)
    spans = join_gaps(merged, join_limit(gap_bytes, multi_range, max_ranges), max_overread)
    if any(s.end - s.start > max_request_bytes for s in spans):
        spans = [part for span in spans for part in split_span(span, max_request_bytes)]
    if not multi_range or max_ranges == 1:
        return [Request((s,)) for s in spans]
    return group_spans(spans, max_ranges, min(max_request_bytes, max(1, GROUP_LATENCIES * gap_bytes)))
