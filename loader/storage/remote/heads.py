"""Objects' first bytes, fetched with their safetensors header (:meth:`~.store.RemoteStore.head`), serving the reads
of those bytes: a file's first data bytes are not fetched again (:class:`~.reader.RemoteReader` holds one
:class:`Heads`). Only while the object's identity is the one they were fetched with; each byte a read takes from them
counts once in the reader's ``bytes_read`` (fetched, and used)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence

from ..base import ObjectIdentity, Segment


class Heads:
    """``{location: (identity, first bytes)}`` serving reads (see the module); thread-safe."""

    def __init__(self, heads: Mapping[str, tuple[ObjectIdentity, bytes]] | None = None) -> None:
        self._heads = dict(heads or {})
        self._used: dict[str, bytearray] = {}  # per location, which bytes of its head reads took (1: taken)
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Bytes reads took from the heads (each once)."""
        with self._lock:
            return sum(u.count(1) for u in self._used.values())

    def identity(self, location: str) -> ObjectIdentity | None:
        """The identity ``location``'s head was fetched with (``None``: no head)."""
        known = self._heads.get(location)
        return None if known is None else known[0]

    def of(self, location: str, identity: ObjectIdentity) -> bytes:
        """``location``'s head, if it was fetched from ``identity`` (else none)."""
        known = self._heads.get(location)
        return known[1] if known is not None and known[0] == identity else b""

    def clip(self, location: str, identity: ObjectIdentity, ranges: Sequence[tuple[int, int]]) -> list:
        """``ranges`` less what the head holds (to plan the requests of the rest)."""
        n = len(self.of(location, identity))
        return [(max(a, n), b) for a, b in ranges if b > n] if n else list(ranges)

    def serve(self, location: str, identity: ObjectIdentity, segments: list[Segment]) -> list[Segment]:
        """Copy the bytes of ``segments`` (ascending) that ``location``'s head (fetched from ``identity``) holds; the
        parts it does not hold, ascending (all of ``segments`` when it holds none)."""
        head = self.of(location, identity)
        if not head or segments[0][0] >= len(head):
            return segments
        rest: list[Segment] = []
        data = memoryview(head)
        with self._lock:
            used = self._used.setdefault(location, bytearray(len(head)))
        for off, view in segments:
            n = max(0, min(len(view), len(head) - off))
            if n:
                view[:n] = data[off : off + n]
                used[off : off + n] = b"\x01" * n
            if n < len(view):
                rest.append((off + n, view[n:]))
        return rest
