"""Checks every backend makes of an answer: its status, its ``Content-Range``, its length, the parts of a
multi-range one (:func:`assemble`), how long its body takes (:func:`read_within`). A :class:`~.backend.Transient`
says what failed, not where: the fetcher names the location when it gives up. Only the standard library (the S3
backend uses these without ``requests``)."""

from __future__ import annotations

import bisect
import itertools
import re
import time
from collections.abc import Callable, Iterable, Sequence

from ...errors import CheckpointError
from .backend import Transient

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
#: statuses a retry may cure
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})
#: bytes asked of the connection at once while a body streams in (:func:`read_within`)
READ_BYTES = 1 << 20


def range_header(ranges: Iterable[tuple[int, int]]) -> str:
    """The ``Range`` header for ``(start, end)`` ranges (``end`` exclusive)."""
    return "bytes=" + ",".join(f"{a}-{b - 1}" for a, b in ranges)


def parse_content_range(value: str | None) -> tuple[int, int, int | None] | None:
    """``(start, end, total)`` of a ``Content-Range: bytes a-b/total`` value (``end`` exclusive, ``total`` None
    for ``*``); ``None`` when absent or malformed."""
    match = _CONTENT_RANGE.fullmatch((value or "").strip())
    if match is None:
        return None
    return int(match[1]), int(match[2]) + 1, None if match[3] == "*" else int(match[3])


class AccessRefused(CheckpointError):
    """A 401 or 403: the credentials (or a presigned URL's signature) do not open this object."""


def changed(name: str, why: str) -> CheckpointError:
    return CheckpointError(f"{name}: the object changed while it was being read ({why}); load it again", path=name)


def check_status(name: str, status: int) -> None:
    """Raise what a status other than 200/206 means (see the module's table)."""
    if status in (200, 206):
        return
    if status in TRANSIENT_STATUS or status >= 500:
        raise Transient(f"HTTP {status}")
    if status in (404, 410):
        raise CheckpointError(f"{name}: not found (HTTP {status})", path=name)
    if status in (401, 403):
        raise AccessRefused(f"{name}: access refused (HTTP {status}); check the credentials", path=name)
    if status == 412:
        raise changed(name, "its ETag no longer matches: HTTP 412")
    if status == 416:
        raise CheckpointError(f"{name}: range not satisfiable (HTTP 416): the object is shorter than read", path=name)
    raise CheckpointError(f"{name}: unexpected HTTP {status}", path=name)


def check_part(name: str, content_range: str | None, start: int, end: int, size: int, body: bytes) -> bytes:
    """``body`` if it is bytes ``[start, end)`` of an object of ``size`` bytes as ``content_range`` says."""
    got = parse_content_range(content_range)
    if got is None:
        raise CheckpointError(f"{name}: a 206 answer without a valid Content-Range ({content_range!r})", path=name)
    if got[2] is not None and got[2] != size:
        raise changed(name, f"{got[2]} bytes now, {size} when first read")
    if got[:2] != (start, end):
        raise CheckpointError(f"{name}: asked bytes {start}-{end - 1}, the server sent {content_range!r}", path=name)
    if len(body) != end - start:
        raise Transient(f"{len(body)} bytes received of bytes {start}-{end - 1}")
    return body


def assemble(
    name: str, parts: Sequence[tuple[str | None, bytes]], ranges: Sequence[tuple[int, int]], size: int
) -> list[bytes]:
    """The bytes of each asked range from the ``(Content-Range, payload)`` parts of a multi-range answer: parts in
    any order, one part covering several asked ranges (RFC 9110 lets a server coalesce them).

    Raises:
        CheckpointError: a part without a valid Content-Range, one past the object's end or holding no asked byte,
            an asked range no part covers, another total size (the object changed).
        Transient: a part shorter than its Content-Range.
    """
    spans = []
    for content_range, payload in parts:
        got = parse_content_range(content_range)
        if got is None:
            raise CheckpointError(f"{name}: a part without a valid Content-Range ({content_range!r})", path=name)
        start, end, total = got
        if total is not None and total != size:
            raise changed(name, f"{total} bytes now, {size} when first read")
        if len(payload) != end - start:
            raise Transient(f"{len(payload)} bytes received of bytes {start}-{end - 1}")
        spans.append((start, end, payload))
    if [(a, b) for a, b, _ in spans] == [tuple(r) for r in ranges]:  # as asked (nginx): no slicing
        return [p for _, _, p in spans]
    spans.sort(key=lambda s: s[0])
    starts, asked_starts = [s[0] for s in spans], [a for a, _ in ranges]
    for start, end, _ in spans:
        i = bisect.bisect_left(asked_starts, end) - 1  # the last asked range starting before the part's end
        if end > size or i < 0 or ranges[i][1] <= start:
            raise CheckpointError(f"{name}: the server sent bytes {start}-{end - 1}, which were not asked", path=name)
    reach = list(itertools.accumulate(range(len(spans)), lambda i, j: j if spans[j][1] > spans[i][1] else i))
    out = []
    for a, b in ranges:
        i = bisect.bisect_right(starts, a) - 1
        if i < 0 or spans[reach[i]][1] < b:  # reach[i]: of the parts starting at or before a, the longest-reaching
            raise CheckpointError(f"{name}: asked bytes {a}-{b - 1}, which no part of the answer covers", path=name)
        start, _, payload = spans[reach[i]]
        out.append(payload[a - start : b - start])
    return out


def read_within(read1: Callable[[int], bytes], deadline: float, bound: Callable[[], str]) -> bytes:
    """A body read as it arrives (``read1(n)``: the bytes there, up to ``n``; ``b""`` at its end) until its end,
    or until ``time.monotonic()`` passes ``deadline``: then a :class:`Transient` saying ``bound()``."""
    reads = []
    while True:
        if time.monotonic() > deadline:
            got = sum(map(len, reads))
            raise Transient(f"too slow: {got} bytes received when the request's time was up ({bound()})")
        data = read1(READ_BYTES)
        if not data:
            return b"".join(reads)
        reads.append(data)
