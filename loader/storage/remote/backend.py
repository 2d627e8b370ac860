"""What a remote driver's *backend* does: one request at a time, checked; everything else is the fetcher's.

Vocabulary: a *backend* speaks one protocol (HTTP(S), S3, the Hub, another fsspec filesystem) through the
ecosystem's library for it; it answers :meth:`Backend.stat` (size and identity of an object, ``None`` when it
does not exist) and :meth:`Backend.get` (one request for one or several byte ranges of an object, every response
checked: status 206 with the asked ``Content-Range``, the exact length, the identity unchanged). Planning requests
(coalescing, splitting, multi-range grouping), running them concurrently, retrying and accounting are the
fetcher's (:mod:`.fetch`), identical for every backend, as :class:`~loader.options.RemoteOptions` says (defined
with the other option values in :mod:`loader.options`, re-exported here).

Failures a backend raises: :class:`Transient` for what a retry may cure (a 5xx, a reset connection, a short body,
a timeout); :class:`~loader.errors.CheckpointError` naming the location for what it cannot (404, 403, a server
that ignores ``Range``, an identity that changed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from ...errors import CheckpointError
from ...options import MAX_SECONDS, RemoteOptions
from ..base import ObjectIdentity

__all__ = ["MAX_SECONDS", "Backend", "ErrorMap", "RemoteOptions", "Transient"]


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
