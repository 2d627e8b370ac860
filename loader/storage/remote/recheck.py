"""A file's header fetched again with its last request, where the server's validators prove little.

An HTTP server's identity of an object may not change when the object does: no ETag and no Last-Modified, one
ETag for every version, a weak ETag beside an unchanged Last-Modified, nginx's ETag (the modification time in
seconds and the size) for a rewrite within the same second at the same size. Every response is still checked
against the sizes known from the header (its ``Content-Range`` total, its length); and, for such backends
(``recheck_heads``), the file's first bytes — its length and header, as :attr:`ObjectIdentity.head_crc` recorded
them — are asked again as one more range of the file's last planned request where the server answers several
ranges at once (no request more: a part's headers more), else with one request of their own once its reads are
done (:meth:`HeadChecks.verify`). A header that
differs then fails the load naming the file. Those header bytes (and the requests of their own) are not counted
as the load's reads (:attr:`HeadChecks.bytes`, :attr:`HeadChecks.requests`), as the header's first read is not.
A rewrite that keeps the header byte for byte (the same tensors,
other values) is not told apart: only a strong validator (or a content hash) tells that.
"""

from __future__ import annotations

import threading
import zlib
from concurrent.futures import Future, InvalidStateError

from ..base import ObjectIdentity
from ..capabilities import multi_range, rechecks_heads
from .checks import changed
from .fetch import Fetcher
from .requests_plan import Request, Span


def head_request(identity: ObjectIdentity) -> Request:
    """One request of the object's first :attr:`~ObjectIdentity.head_bytes` bytes."""
    return Request((Span.of(((0, identity.head_bytes),)),))


def compare(location: str, identity: ObjectIdentity, data: bytes) -> None:
    """Raise when ``data`` (the object's first bytes, fetched again) are not those the identity recorded."""
    if zlib.crc32(data) != identity.head_crc:
        why = "its header, fetched again with its last request, differs from the one the load was planned with"
        raise changed(location, why)


class HeadChecks:
    """Which request of each file carries its header's bytes again, and which files were checked (thread-safe).

    Args:
        backend: The reader's backend: its ``recheck_heads`` (whether its answers need this) and ``multi_range``
            (whether one request may carry one range more), looked at as they are now.
        max_ranges: Ranges one request carries at most.

    Attributes:
        bytes: Header bytes fetched again (the reader leaves them out of its ``bytes_read``).
        requests: Requests of their own made for them (left out of its ``reads``).
    """

    def __init__(self, backend: object, max_ranges: int) -> None:
        self.backend, self.max_ranges = backend, max_ranges
        self.on = rechecks_heads(backend)
        self.bytes = self.requests = 0
        self._carriers: dict[str, Request] = {}
        self._checked: set[str] = set()
        self._lock = threading.Lock()

    def plan(self, location: str, identity: ObjectIdentity, requests: list[Request]) -> None:
        """``requests`` are the file's plan: its last one carries the header again where it can."""
        if not self.on or not identity.head_bytes:
            return
        last = requests[-1] if requests else None
        fits = last is not None and multi_range(self.backend) and len(last.spans) < self.max_ranges
        with self._lock:
            if fits and last.spans[0].start >= identity.head_bytes:
                self._carriers[location] = last
            else:
                self._carriers.pop(location, None)

    def submit(self, fetcher: Fetcher, location: str, request: Request, identity: ObjectIdentity) -> Future:
        """``fetcher.submit`` of ``request``; for the file's carrier, with the header's bytes as a first range,
        compared once fetched (the future holds the request's own spans' bytes, or the failure)."""
        with self._lock:
            carrier = self._carriers.get(location) is request
        if not carrier:
            return fetcher.submit(location, request, identity)
        inner = fetcher.submit(location, Request(head_request(identity).spans + request.spans), identity)
        out: Future = Future()

        def done(f: Future) -> None:
            if f.cancelled():
                out.cancel()
                return
            error, data = f.exception(), None
            if error is None:
                data = f.result()
                try:
                    with self._lock:
                        self.bytes += len(data[0])
                    compare(location, identity, data[0])
                    with self._lock:
                        self._checked.add(location)
                except Exception as e:
                    error = e
            try:
                out.set_exception(error) if error is not None else out.set_result(data[1:])
            except InvalidStateError:  # cancelled meanwhile: nobody waits for it
                pass

        inner.add_done_callback(done)
        return out

    def verify(self, fetcher: Fetcher, location: str, identity: ObjectIdentity | None) -> None:
        """Once the file's reads are done: its header compared, fetched now if no carrier brought it."""
        if not self.on or identity is None or not identity.head_bytes:
            return
        with self._lock:
            if location in self._checked:
                return
        (data,) = fetcher.get(location, head_request(identity), identity)
        with self._lock:
            self.bytes += len(data)
            self.requests += 1
        compare(location, identity, data)
        with self._lock:
            self._checked.add(location)
