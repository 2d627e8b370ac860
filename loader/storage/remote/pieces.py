"""What a remote reader fetched ahead: the planned fetches of its files, the pieces they hold, and the window.

Vocabulary:

- a *fetch* (:class:`Fetch`): one planned request of one object: *queued*, then *submitted* (its future), then
  *released* once every one of its pieces' wanted bytes was served (or its object was dropped);
- a *piece* (:class:`Piece`): one span of a fetch: its bytes once the future is done, and the wanted bytes not
  served yet (:attr:`Piece.unserved`); a piece with none left is freed;
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

    __slots__ = ("location", "request", "pieces", "future", "live", "released")

    def __init__(self, location: str, request: Request) -> None:
        self.location, self.request = location, request
        self.pieces = [Piece(span, self, i) for i, span in enumerate(request.spans)]
        self.future: Future[list[bytes]] | None = None
        self.live = len(self.pieces)
        self.released = False

    @property
    def submitted(self) -> bool:
        return self.future is not None


class Piece:
    """One span of a fetch, with the wanted bytes not served yet (see the module).

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
    """The planned fetches of a reader's objects, their pieces by object, and the window over them."""

    def __init__(self, window_bytes: int) -> None:
        self.window_bytes = window_bytes
        self.held = 0  # bytes of fetches submitted and not released
        self.peak = 0  # the most bytes ever held
        self._queue: deque[Fetch] = deque()
        self._pieces: dict[str, list[Piece]] = {}
        self._starts: dict[str, list[int]] = {}

    def plan(self, location: str, requests: list[Request]) -> list[Future]:
        """Queue ``requests`` of ``location`` (ascending, disjoint), replacing what was planned for it before
        (whose futures are returned, to cancel)."""
        dropped = self.drop(location)
        fetches = [Fetch(location, r) for r in requests]
        pieces = [p for f in fetches for p in f.pieces]
        if pieces:
            self._pieces[location], self._starts[location] = pieces, [p.start for p in pieces]
        self._queue.extend(fetches)
        return dropped

    def overlapping(self, location: str, lo: int, hi: int) -> list[Piece]:
        """The pieces of ``location`` that hold a byte of ``[lo, hi)``, ascending."""
        pieces = self._pieces.get(location)
        if not pieces:
            return []
        starts = self._starts[location]
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        out = []
        while i < len(pieces) and pieces[i].start < hi:
            if pieces[i].end > lo:
                out.append(pieces[i])
            i += 1
        return out

    def fill(self, submit: Callable[[Fetch], Future]) -> None:
        """Submit queued fetches in order while the window allows (fetches whose wanted bytes were all served
        another way are released unfetched)."""
        while self._queue:
            fetch = self._queue[0]
            if fetch.released or all(p.freed for p in fetch.pieces):
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

    def served(self, piece: Piece, lo: int, hi: int) -> None:
        """``[lo, hi)`` of ``piece`` was served: free the piece once nothing wanted is left in it, and release its
        fetch once all its pieces are freed."""
        if piece.freed or not piece.serve(lo, hi) or not piece.freed:
            return
        fetch = piece.fetch
        fetch.live -= 1
        if fetch.live == 0 and fetch.submitted and not fetch.released:
            self._release(fetch)

    def future(
        self, piece: Piece, parts: list[tuple[int, int, object]], submit: Callable[[Fetch], Future]
    ) -> Future | None:
        """The future holding ``piece`` (its fetch submitted now if the window allows), or ``None`` when it is not
        fetched (beyond the window) or was released: its ``parts`` (``(lo, hi, ...)``) then count as served (they
        are fetched directly)."""
        if not piece.fetch.submitted:
            self.fill(submit)
        future = piece.fetch.future
        if future is None:
            for a, b, *_ in parts:
                self.served(piece, a, b)
        return future

    def consumed(self, piece: Piece, parts: list[tuple[int, int, object]], submit: Callable[[Fetch], Future]) -> None:
        """``parts`` of ``piece`` were copied out: mark them served and submit what the window then allows."""
        for a, b, *_ in parts:
            self.served(piece, a, b)
        self.fill(submit)

    def drop(self, location: str) -> list[Future]:
        """Forget ``location``'s fetches: release what was held, return the futures still running (to cancel)."""
        pieces = self._pieces.pop(location, [])
        self._starts.pop(location, None)
        futures = []
        for fetch in dict.fromkeys(p.fetch for p in pieces):
            if fetch.submitted and not fetch.released:
                futures.append(fetch.future)
                self._release(fetch)
            fetch.released = True
        if pieces:
            self._queue = deque(f for f in self._queue if f.location != location)
        return futures

    def clear(self) -> list[Future]:
        """Forget every object's fetches (see :meth:`drop`)."""
        return [f for location in list(self._pieces) for f in self.drop(location)]

    def _release(self, fetch: Fetch) -> None:
        fetch.released = True
        self.held -= fetch.request.nbytes
        fetch.future = None  # the bytes go once no read is copying from them
