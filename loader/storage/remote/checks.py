"""Checks every backend makes of an answer: its status, its ``Content-Range``, its length; and the URL as errors
name it. A :class:`~.backend.Transient` says what failed, not where: the fetcher names the location when it gives
up. Only the standard library (the S3 backend uses these without ``requests``)."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Iterable

from ...errors import CheckpointError
from .backend import Transient

_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")
#: statuses a retry may cure
TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def redact(url: str) -> str:
    """``url`` without user info and query string, for messages."""
    parts = urllib.parse.urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "..." if parts.query else "", ""))


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
        raise CheckpointError(f"{name}: access refused (HTTP {status}); check the credentials", path=name)
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
