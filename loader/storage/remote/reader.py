"""The remote :class:`~loader.storage.base.RangeReader`: a file's wanted ranges fetched ahead, reads served from them.

:meth:`RemoteReader.will_read` plans a file's requests (:func:`~.requests_plan.plan_requests`) and submits them in
order while the window allows (:class:`~.window.Window`: at most ``window_bytes`` fetched and not yet consumed);
a read copies its bytes out of the fetched spans, waiting for them, span by span, freeing each span once its
wanted bytes were all served and submitting the next fetches as the window empties; bytes no span holds (no
:meth:`~RemoteReader.will_read`, a read ahead of the window, bytes served before from a span since freed) are
fetched directly (:func:`fetch_direct`). A failure cancels every pending fetch and propagates.

Identity: :meth:`RemoteReader.expect` records the :class:`~loader.storage.ObjectIdentity` every request is made
against; the backend checks it on every response (ETag, version, size), so every byte served comes from that
object. :meth:`RemoteReader.verify` therefore makes no request: a re-stat after the last read would prove
nothing about the bytes already read, which their responses proved one by one; it releases what was fetched
ahead for the file instead (the executor calls it after the file's last read) — and, where the backend's
validators prove little (HTTP), compares the file's header as its last request fetched it again (:mod:`.recheck`).

Heads: a file's first bytes, fetched with its header (``heads``, from :meth:`~.store.RemoteStore.reader`), serve the
reads of those bytes (:mod:`.heads`): they are neither planned nor fetched again.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

from ..base import ObjectIdentity, Runs, Segment, consecutive
from ..capabilities import multi_range
from ..untrusted import err
from .backend import Backend, RemoteOptions
from .fetch import Fetcher
from .heads import Heads
from .identities import Identities
from .recheck import HeadChecks
from .requests_plan import Request, plan_requests
from .window import Fetch, FetchedSpan, Window


def cover(
    segments: Sequence[Segment], spans: Sequence[FetchedSpan]
) -> tuple[list[tuple[FetchedSpan, list]], list[Segment]]:
    """Which span serves which part of ``segments`` (ascending, disjoint), and the bytes no span holds.

    Returns:
        ``[(span, [(lo, hi, destination), ...]), ...]`` in the spans' order, and the missing segments.
    """
    served: list[tuple[FetchedSpan, list]] = []
    missing: list[Segment] = []
    k = 0
    for off, view in segments:
        pos, end = off, off + len(view)
        while k < len(spans) and spans[k].end <= pos:
            k += 1
        j = k
        while pos < end and j < len(spans) and spans[j].start < end:
            p = spans[j]
            if p.start > pos:
                missing.append((pos, view[pos - off : p.start - off]))
                pos = p.start
            hi = min(end, p.end)
            if not served or served[-1][0] is not p:
                served.append((p, []))
            served[-1][1].append((pos, hi, view[pos - off : hi - off]))
            pos = hi
            j += 1
        if pos < end:
            missing.append((pos, view[pos - off :]))
    return served, missing


class RemoteReader:
    """Reads exact byte ranges of remote objects (see the module; the surface of :class:`~loader.storage.FileReader`).

    Thread-safe. A context manager: :meth:`close` cancels what is pending and frees what was fetched ahead.

    Args:
        backend, options: The store's backend (shared, thread-safe); concurrency, retries, cost model, window.
        identities: ``{location: ObjectIdentity}`` each object must still have.
        heads: ``{location: (identity, its first bytes)}`` already fetched (see the module).

    Attributes:
        bytes_read: Bytes fetched (payload, gaps read through, fetched ahead and never read; heads' as reads use them).
        gap_bytes, reads: Of those, the gaps between wanted ranges; the requests made (retries included).
        peak_bytes: The most bytes ever fetched ahead and not yet consumed (the window's bound, measured).
    """

    def __init__(
        self,
        backend: Backend,
        options: RemoteOptions,
        identities: Mapping[str, object] | None = None,
        heads: Mapping[str, tuple[ObjectIdentity, bytes]] | None = None,
    ) -> None:
        self.backend, self.options = backend, options
        self._fetcher = Fetcher(backend, options)
        self._heads = Heads(heads)
        self._identities = Identities(backend, options, self._heads)
        self._window = Window(options.fetch_ahead_bytes)
        self._checks = HeadChecks(backend, options.costs.max_ranges)  # headers fetched again (see .recheck)
        self._lock = threading.Lock()
        for location, identity in (identities or {}).items():
            self._identities.expect(location, identity)

    bytes_read: property = property(lambda self: self._fetcher.bytes_read + self._heads.used - self._checks.bytes)
    gap_bytes: property = property(lambda self: self._fetcher.gap_bytes)
    reads: property = property(lambda self: self._fetcher.reads - self._checks.requests)
    peak_bytes: property = property(lambda self: self._window.peak)

    def __enter__(self) -> RemoteReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Cancel pending fetches and free what was fetched ahead; the reader may be reused (counts are kept)."""
        self._fail()
        self._fetcher.close()

    def expect(self, location: str, identity: object | None) -> None:
        """Require ``location`` to have ``identity`` (:meth:`.identities.Identities.expect`)."""
        self._identities.expect(location, identity)

    def verify(self, location: str) -> None:
        """Frees what was fetched ahead for ``location`` and not read; checks nothing (see the module) but, where the
        backend's validators prove little, its header (:mod:`.recheck`: a ``CheckpointError`` if it changed)."""
        with self._lock:
            futures = self._window.drop(location)
        for f in futures:
            f.cancel()
        self._checks.verify(self._fetcher, location, self._identities.known(location))

    def verify_all(self) -> None:
        """Nothing to check (see :meth:`verify`)."""

    def will_read(self, location: str, ranges: Callable[[], Sequence[tuple[int, int]]], *, sparse: bool) -> None:
        """Plan ``location``'s requests for ``ranges()`` and start fetching them in order, within the window
        (``sparse`` changes nothing: nothing is read ahead beyond the ranges anyway)."""
        identity = self._identities.of(location)  # known before any fetch is submitted (stat'ed now if not expected)
        wanted = self._heads.clip(location, identity, ranges())  # what a head holds is not fetched again
        requests = plan(self.backend, self.options, wanted)
        self._checks.plan(location, self._identities.of(location), requests)
        with self._lock:
            stale = self._window.plan(location, requests)
            self._window.fill(self._submit)
        for f in stale:
            f.cancel()

    def pread_into(self, location: str, offset: int, out: memoryview | bytearray) -> None:
        """Read exactly ``len(out)`` bytes at ``offset`` into ``out``.

        Raises:
            CheckpointError: the bytes lie past the object's end, or a request failed (naming the URL).
        """
        view = memoryview(out).cast("B")
        if len(view):
            self._read(location, [(offset, view)])

    def pread_consecutive(self, location: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Read consecutive bytes from ``offset`` into the buffers ``outs``, one after another."""
        segments = consecutive(offset, outs)
        if segments:
            self._read(location, segments)

    def read_runs(self, location: str, runs: Runs, out: memoryview, base: int, *, wanted: int) -> None:
        """Read every run into ``out[s - base:]``: runs only (touching ones together), gaps not fetched unless
        the plan read them through; ``wanted`` is not needed (the fetcher counts what it fetched)."""
        view = memoryview(out).cast("B")
        segments = [(a, view[a - base : b - base]) for a, b in runs.spans(1)]  # page 1: touching runs merged
        if segments:
            self._read(location, segments)

    # -- reading -----------------------------------------------------------------------------------------------

    def _read(self, location: str, segments: list[Segment]) -> None:
        identity = self._identities.of(location)
        lo, hi = segments[0][0], segments[-1][0] + len(segments[-1][1])
        if lo < 0 or hi > identity.size:
            raise err(location, f"bytes [{lo}, {hi}) lie outside the object ({identity.size} bytes)")
        segments = self._heads.serve(location, identity, segments)  # what a head holds is copied from it
        if not segments:
            return
        submit = self._submit
        try:
            with self._lock:
                spans = self._window.overlapping(location, lo, hi)
            served, missing = cover(segments, spans)
            for span, copies in served:
                with self._lock:
                    future = self._window.future(span, copies, submit)
                if future is None:  # not fetched (beyond the window) or freed: fetched directly
                    missing.extend((a, dst) for a, _, dst in copies)
                    continue
                data = memoryview(self._fetcher.result(future, location)[span.index])  # slices copy nothing
                for a, b, dst in copies:
                    dst[:] = data[a - span.start : b - span.start]
                with self._lock:
                    self._window.consumed(span, copies, submit)
            if missing:
                requests = plan(self.backend, self.options, [(a, a + len(v)) for a, v in missing])
                fetch_direct(self._fetcher, location, identity, requests, sorted(missing, key=lambda s: s[0]))
        except BaseException as e:
            self._fail(e)
            raise

    def _submit(self, fetch: Fetch) -> Future[list[bytes]]:
        """Submit a planned fetch (called under the lock; its object's identity is known since :meth:`will_read`)."""
        return self._checks.submit(self._fetcher, fetch.location, fetch.request, self._identities.of(fetch.location))

    def _fail(self, cause: BaseException | None = None) -> None:
        """Cancel everything pending: a read failed (``cause``, what other waiting reads raise too), or the reader
        is closing."""
        with self._lock:
            futures = self._window.clear()
        self._fetcher.cancel(cause)
        for f in futures:
            f.cancel()


def plan(backend: Backend, options: RemoteOptions, ranges: Sequence[tuple[int, int]]) -> list[Request]:
    """The requests fetching ``ranges`` of one object through ``backend`` (:func:`~.requests_plan.plan_requests`)."""
    return plan_requests(
        ranges,
        gap_bytes=options.costs.gap_bytes,
        max_request_bytes=options.costs.max_request_bytes,
        multi_range=multi_range(backend),
        max_ranges=options.costs.max_ranges,
        max_overread=options.costs.max_overread,
    )


def fetch_direct(
    fetcher: Fetcher, location: str, identity: ObjectIdentity, requests: list[Request], segments: list[Segment]
) -> None:
    """Fetch ``requests`` now (planned for the ``segments``, ascending and disjoint), in order with at most
    ``window_bytes`` in flight, each span copied into the segments it holds."""
    starts = [a for a, _ in segments]
    if len(requests) == 1:
        _scatter(requests[0], fetcher.get(location, requests[0], identity), segments, starts)
        return
    window, inflight = fetcher.options.fetch_ahead_bytes, deque()
    held, i = 0, 0
    while i < len(requests) or inflight:
        while i < len(requests) and (not inflight or held + requests[i].nbytes <= window):
            inflight.append((requests[i], fetcher.submit(location, requests[i], identity)))
            held += requests[i].nbytes
            i += 1
        request, future = inflight.popleft()
        _scatter(request, fetcher.result(future, location), segments, starts)
        held -= request.nbytes


def _scatter(request: Request, data: list[bytes], segments: list[Segment], starts: list[int]) -> None:
    """Copy each span's bytes into the ``segments`` (ascending by ``starts``) it overlaps."""
    for span, got in zip(request.spans, map(memoryview, data)):
        i = max(bisect.bisect_right(starts, span.start) - 1, 0)
        while i < len(segments) and starts[i] < span.end:
            a, dst = segments[i]
            lo, hi = max(a, span.start), min(a + len(dst), span.end)
            if lo < hi:
                dst[lo - a : hi - a] = got[lo - span.start : hi - span.start]
            i += 1
