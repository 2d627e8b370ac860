"""What a remote driver's *backend* does: one request at a time, checked; everything else is the fetcher's.

Vocabulary: a *backend* speaks one protocol (HTTP(S), S3, the Hub, another fsspec filesystem) through the
ecosystem's library for it; it answers :meth:`Backend.stat` (size and identity of an object, ``None`` when it
does not exist) and :meth:`Backend.get` (one request for one or several byte ranges of an object, every response
checked: status 206 with the asked ``Content-Range``, the exact length, the identity unchanged). Planning requests
(coalescing, splitting, multi-range grouping), running them concurrently, retrying and accounting are the
fetcher's (:mod:`.fetch`), identical for every backend.

Failures a backend raises: :class:`Transient` for what a retry may cure (a 5xx, a reset connection, a short body,
a timeout); :class:`~loader.errors.CheckpointError` naming the location for what it cannot (404, 403, a server
that ignores ``Range``, an identity that changed).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from ...errors import CheckpointError
from ..base import ObjectIdentity

#: the most seconds a seconds-valued option may be (about 11 days; ``inf`` overflows the clocks' timeouts)
MAX_SECONDS = 1e6
#: our options that are seconds
_SECONDS = ("timeout", "backoff", "latency")


class Transient(Exception):
    """A request failed in a way a retry may cure (5xx, a reset, a short body, a timeout)."""


class ErrorMap:
    """A context manager: a library's exceptions raised as :class:`Transient` or a ``CheckpointError`` naming
    ``name``, by :meth:`translate` (what it does not translate propagates as it is)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type | None, error: BaseException | None, _tb: object) -> None:
        if error is not None and not isinstance(error, (CheckpointError, Transient)):
            self.translate(error)

    def translate(self, error: BaseException) -> None:
        """Raise what ``error`` stands for; return to let it propagate."""


@dataclass(frozen=True)
class RemoteOptions:
    """How a remote store reads: the keys of ``storage_options`` that are ours (the rest go to the backend).

    Attributes:
        concurrency: Requests in flight at once, per reader.
        timeout: Seconds a request may wait for the server (connect, and between bytes); a server that hangs
            fails the request after this (then retried, then a :class:`~loader.errors.CheckpointError`).
        min_rate: Bytes per second a request's body must arrive at, on average: an HTTP(S) or ``hf://`` request
            lasts ``timeout + bytes / min_rate`` seconds at most (a server that trickles fails it; then retried).
        retries: Attempts after the first for a :class:`Transient` failure, with exponential backoff.
        backoff: Seconds before the first retry (doubled each time).
        latency: Seconds a request costs beyond its bytes (the cost model: a gap is read through when reading it
            costs less than another request: ``gap < latency * bandwidth``).
        bandwidth: Bytes per second of one connection (the cost model's other half).
        max_request_bytes: A range larger than this is split into several requests (fetched in parallel).
        max_ranges: Ranges one multi-range request may carry (where the backend supports them; 1: never).
        window_bytes: Bytes fetched ahead of the reads at most (bounds the reader's memory).
        max_overread: Gap bytes read through for fewer requests, at most, as a fraction of the bytes wanted
            (:mod:`.requests_plan`): 0.05 keeps a column shard's bytes within 1.05x, at one request per row on a
            store without multi-range requests (S3); raise it where requests cost more than bytes (a fast link to
            a distant store): the cost model then reads small gaps through.
    """

    concurrency: int = 8
    timeout: float = 30.0
    min_rate: float = 32e3
    retries: int = 4
    backoff: float = 0.2
    latency: float = 0.002
    bandwidth: float = 250e6
    max_request_bytes: int = 64 << 20
    max_ranges: int = 64
    window_bytes: int = 512 << 20
    max_overread: float = 0.05

    @classmethod
    def split(cls, storage_options: Mapping[str, object]) -> tuple[RemoteOptions, dict[str, object]]:
        """``(ours, the backend's)`` from a ``storage_options`` dict.

        Raises:
            ValueError: one of ours has a value of the wrong type or out of range (not finite: ``inf`` is no
                setting; seconds over :data:`MAX_SECONDS`).
        """
        names = {f.name: f for f in dataclasses.fields(cls)}
        ours = {k: v for k, v in storage_options.items() if k in names}
        rest = {k: v for k, v in storage_options.items() if k not in names}
        for k, v in ours.items():
            kind = float if names[k].type == "float" else int
            if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
                raise ValueError(f"storage_options[{k!r}] must be a {kind.__name__}, got {v!r}")
            if v <= 0 and k not in ("retries", "backoff", "latency", "max_overread"):
                raise ValueError(f"storage_options[{k!r}] must be positive, got {v!r}")
            if v < 0:
                raise ValueError(f"storage_options[{k!r}] must not be negative, got {v!r}")
            if not math.isfinite(v):
                raise ValueError(f"storage_options[{k!r}] must be a finite number, got {v!r}")
            if k in _SECONDS and v > MAX_SECONDS:
                raise ValueError(f"storage_options[{k!r}] is seconds, at most {MAX_SECONDS:g}; got {v!r}")
        return cls(**ours), rest

    @property
    def gap_bytes(self) -> int:
        """The largest gap worth reading through rather than paying another request for."""
        return int(self.latency * self.bandwidth)


class Backend(Protocol):
    """One protocol's requests (see the module's vocabulary).

    Attributes:
        multi_range: Whether one request may carry several ranges (HTTP ``multipart/byteranges``; not S3).
    """

    multi_range: bool

    def stat(self, location: str) -> ObjectIdentity | None:
        """The object's size and identity; ``None`` when it does not exist (404).

        Raises:
            Transient: a failure a retry may cure. CheckpointError: any other failure (403, ...), naming it.
        """
        ...

    def get(self, location: str, ranges: Sequence[tuple[int, int]], identity: ObjectIdentity) -> list[bytes]:
        """One request for ``ranges`` (ascending, disjoint, non-empty ``(start, end)``; several only where
        :attr:`multi_range`) of an object that must still have ``identity``: the bytes of each range, exactly.

        Raises:
            Transient: a failure a retry may cure (5xx, reset, short body, timeout).
            CheckpointError: the object changed (another identity), the server ignored ``Range`` (200) or answered
                other ranges, 404, 403, ...; naming the location.
        """
        ...

    def close(self) -> None:
        """Release connections."""
        ...
