"""What a remote reader fetched ahead: the planned fetches of its files, the spans they fetch, and the window.

Vocabulary:

- a *fetch* (:class:`Fetch`): one planned request of one object: *queued*, then *submitted* (its future), then
  *released* once every one of its spans' wanted bytes was served (or its object was dropped);
- a *fetched span* (:class:`FetchedSpan`): one byte range ``[start, end)`` a fetch's request asks for: its bytes
  once the future is done, and the wanted bytes not served yet (:attr:`FetchedSpan.unserved`); a span with none
  left is freed;
- a *copy*: ``(lo, hi, destination)``, the bytes ``[lo, hi)`` of a fetched span a read copies out;
- the *window*: bytes of fetches submitted and not released: a fetch is submitted only while the window stays
  within ``window_bytes`` (or holds nothing: one fetch larger than the window still goes alone).

Not thread-safe: the reader calls everything here under its lock.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from .requests_plan import Request, Span


class Fetch:
    """One planned request of one object (see the module)."""

    __slots__ = ("location", "request", "spans", "future", "live", "released")

    def __init__(self, location: str, request: Request) -> None:
        self.location, self.request = location, request
        self.spans = [FetchedSpan(span, self, i) for i, span in enumerate(request.spans)]
        self.future: Future[list[bytes]] | None = None
        self.live = len(self.spans)
        self.released = False

    @property
    def submitted(self) -> bool:
        return self.future is not None


class FetchedSpan:
    """One byte range of a fetch, with the wanted bytes not served yet (see the module).

    Attributes:
        start, end: The span.
        fetch: Its fetch.
        index: Its place among the fetch's spans (the backend's answer is one ``bytes`` per span).
        unserved: The wanted ranges not served yet, flat (``[a0, b0, a1, b1, ...]``, ascending).
        left: Bytes in :attr:`unserved`.
    """

    __slots__ = ("start", "end", "fetch", "index", "unserved", "left")

    def __init__(self, span: Span, fetch: Fetch, index: int) -> None:
        self.start, self.end, self.fetch, self.index = span.start, span.end, fetch, index
        self.unserved = list(itertools.chain.from_iterable(span.wanted))
        self.left = span.wanted_bytes

    @property
    def freed(self) -> bool:
        return self.left == 0

    def serve(self, lo: int, hi: int) -> int:
        """Mark ``[lo, hi)`` served: returns how many of its bytes were wanted and not served before."""
        f = self.unserved
        i, j = bisect.bisect_right(f, lo), bisect.bisect_right(f, hi)
        if i % 2 and f[i - 1] == lo:  # lo is a wanted range's start: that range is cut from its start
            i -= 1
        if j % 2 and f[j - 1] == hi:  # hi is a range's start: that range is untouched
            j -= 1
        points = ([lo] if i % 2 else []) + f[i:j] + ([hi] if j % 2 else [])
        served = sum(points[1::2]) - sum(points[0::2])
        f[i:j] = ([lo] if i % 2 else []) + ([hi] if j % 2 else [])
        self.left -= served
        return served


class Window:
    """The planned fetches of a reader's objects, their spans by object, and the window over them."""

    def __init__(self, window_bytes: int) -> None:
        self.window_bytes = window_bytes
        self.held = 0  # bytes of fetches submitted and not released
        self.peak = 0  # the most bytes ever held
        self._queue: deque[Fetch] = deque()
        self._spans: dict[str, list[FetchedSpan]] = {}
        self._starts: dict[str, list[int]] = {}

    def plan(self, location: str, requests: list[Request]) -> list[Future]:
        """Queue ``requests`` of ``location`` (ascending, disjoint), replacing what was planned for it before
        (whose futures are returned, to cancel)."""
        dropped = self.drop(location)
        fetches = [Fetch(location, r) for r in requests]
        spans = [p for f in fetches for p in f.spans]
        if spans:
            self._spans[location], self._starts[location] = spans, [p.start for p in spans]
        self._queue.extend(fetches)
        return dropped

    def overlapping(self, location: str, lo: int, hi: int) -> list[FetchedSpan]:
        """The spans of ``location`` that hold a byte of ``[lo, hi)``, ascending."""
        spans = self._spans.get(location)
        if not spans:
            return []
        starts = self._starts[location]
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        out = []
        while i < len(spans) and spans[i].start < hi:
            if spans[i].end > lo:
                out.append(spans[i])
            i += 1
        return out

    def fill(self, submit: Callable[[Fetch], Future]) -> None:
        """Submit queued fetches in order while the window allows (fetches whose wanted bytes were all served
        another way are released unfetched)."""
        while self._queue:
            fetch = self._queue[0]
            if fetch.released or all(p.freed for p in fetch.spans):
                self._queue.popleft()
                fetch.released = True
                continue
            nbytes = fetch.request.nbytes
            if self.held and self.held + nbytes > self.window_bytes:
                return
            self._queue.popleft()
            fetch.future = submit(fetch)
            self.held += nbytes
            self.peak = max(self.peak, self.held)

    def served(self, span: FetchedSpan, lo: int, hi: int) -> None:
        """``[lo, hi)`` of ``span`` was served: free the span once nothing wanted is left in it, and release its
        fetch once all its spans are freed."""
        if span.freed or not span.serve(lo, hi) or not span.freed:
            return
        fetch = span.fetch
        fetch.live -= 1
        if fetch.live == 0 and fetch.submitted and not fetch.released:
            self._release(fetch)

    def future(
        self, span: FetchedSpan, copies: list[tuple[int, int, object]], submit: Callable[[Fetch], Future]
    ) -> Future | None:
        """The future holding ``span`` (its fetch submitted now if the window allows), or ``None`` when it is not
        fetched (beyond the window) or was released: its ``copies`` (``(lo, hi, ...)``) then count as served (they
        are fetched directly)."""
        if not span.fetch.submitted:
            self.fill(submit)
        future = span.fetch.future
        if future is None:
            for a, b, *_ in copies:
                self.served(span, a, b)
        return future

    def consumed(
        self, span: FetchedSpan, copies: list[tuple[int, int, object]], submit: Callable[[Fetch], Future]
    ) -> None:
        """``copies`` of ``span`` were copied out: mark them served and submit what the window then allows."""
        for a, b, *_ in copies:
            self.served(span, a, b)
        self.fill(submit)

    def drop(self, location: str) -> list[Future]:
        """Forget ``location``'s fetches: release what was held, return the futures still running (to cancel)."""
        spans = self._spans.pop(location, [])
        self._starts.pop(location, None)
        futures = []
        for fetch in dict.fromkeys(p.fetch for p in spans):
            if fetch.submitted and not fetch.released:
                futures.append(fetch.future)
                self._release(fetch)
            fetch.released = True
        if spans:
            self._queue = deque(f for f in self._queue if f.location != location)
        return futures

    def clear(self) -> list[Future]:
        """Forget every object's fetches (see :meth:`drop`)."""
        return [f for location in list(self._spans) for f in self.drop(location)]

    def _release(self, fetch: Fetch) -> None:
        fetch.released = True
        self.held -= fetch.request.nbytes
        fetch.future = None  # the bytes go once no read is copying from them
