"""Running planned requests: bounded concurrency, retries with backoff, accounting; the same for every backend.

Vocabulary: a :class:`Fetcher` runs a :class:`~.requests_plan.Request` of one object against a
:class:`~.backend.Backend`, now (:meth:`Fetcher.get`, in the calling thread) or in its pool of
``RemoteOptions.requests_in_flight`` threads (:meth:`Fetcher.submit`); an *attempt* is one backend call, retried after
``backoff * 2**i`` seconds when it fails :class:`~.backend.Transient`, up to ``retries`` times, then a
:class:`~loader.errors.CheckpointError` naming the URL and what failed. :meth:`Fetcher.cancel` stops everything
pending (a failure elsewhere: nothing more is fetched for a load being rolled back).

Accounting: ``reads`` counts attempts (retries included), ``bytes_read`` every byte fetched (gaps included),
``gap_bytes`` the gaps among them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TypeVar

from ...errors import CheckpointError
from ..base import ObjectIdentity
from ..untrusted import err
from .backend import MAX_SECONDS, Backend, RemoteOptions, Transient
from .requests_plan import Request

T = TypeVar("T")


class Cancelled(CheckpointError):
    """A fetch stopped because its reader was cancelled (another read failed, or the reader closed)."""


def with_retries(
    location: str,
    what: str,
    call: Callable[[], T],
    options: RemoteOptions,
    stop: threading.Event | None = None,
    on_attempt: Callable[[], None] | None = None,
) -> T:
    """``call()``, retried on :class:`Transient` after ``backoff * 2**i`` seconds, ``options.retries`` times.

    Args:
        location: The object (named in errors).
        what: What is being done (``"GET bytes [0, 8)"``), named in errors.
        call: One attempt.
        options: Retries and backoff.
        stop: Set to give up (between attempts, and during a backoff).
        on_attempt: Called before each attempt (counts requests).

    Raises:
        CheckpointError: the last attempt failed :class:`Transient` (naming ``location``, ``what`` and why), or
            ``stop`` was set (:class:`Cancelled`); a backend's own CheckpointError as it is.
    """
    attempts = options.retries + 1
    for i in range(attempts):
        if stop is not None and stop.is_set():
            raise Cancelled(f"{location}: {what} cancelled (another read failed or the reader closed)", path=location)
        if on_attempt is not None:
            on_attempt()
        try:
            return call()
        except Transient as e:
            if i == attempts - 1:
                tries = f"{attempts} attempts" if attempts > 1 else "1 attempt"
                raise err(location, f"{what} failed after {tries}: {e}") from e
            delay = min(options.backoff * 2.0 ** min(i, 64), MAX_SECONDS)  # many retries: no overflow
            if stop is not None:
                stop.wait(delay)
            elif delay > 0:
                threading.Event().wait(delay)
    raise AssertionError("unreachable")  # pragma: no cover


def _describe(request: Request) -> str:
    spans = request.spans
    first = f"[{spans[0].start}, {spans[0].end})"
    return f"GET bytes {first}" + (f" and {len(spans) - 1} more ranges" if len(spans) > 1 else "")


class Fetcher:
    """Runs requests of objects against one backend (see the module): thread-safe.

    Args:
        backend: The protocol's backend (thread-safe by contract).
        options: Concurrency, retries, backoff.

    Attributes:
        failure: The first failure of a submitted fetch (until :meth:`close`).
        bytes_read: Bytes fetched (payload and gaps read through).
        gap_bytes: Of those, gap bytes.
        reads: Requests made (attempts, retries included).
    """

    def __init__(self, backend: Backend, options: RemoteOptions) -> None:
        self.backend, self.options = backend, options
        self.bytes_read = self.gap_bytes = self.reads = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool: ThreadPoolExecutor | None = None
        self._pending: set[Future] = set()
        self.failure: BaseException | None = None  # the first failure of a submitted fetch, until close

    def get(self, location: str, request: Request, identity: ObjectIdentity) -> list[bytes]:
        """Fetch ``request`` now, retrying: each span's bytes, exactly.

        Raises:
            CheckpointError: it failed (see :func:`with_retries`), or the backend answered other lengths.
        """
        ranges, what = request.ranges, _describe(request)
        call = lambda: self.backend.get(location, ranges, identity)
        try:
            out = with_retries(location, what, call, self.options, self._stop, self._count_attempt)
        except Cancelled:
            if self.failure is not None:  # stopped by a failure: that is what every read stopped reports
                raise self.failure from None
            raise
        if len(out) != len(ranges) or any(len(d) != b - a for d, (a, b) in zip(out, ranges)):
            got = [len(d) for d in out]
            raise err(location, f"{_describe(request)}: the backend returned {got} bytes for the ranges {ranges}")
        with self._lock:
            self.bytes_read += request.nbytes
            self.gap_bytes += request.nbytes - request.wanted_bytes
        return out

    def submit(self, location: str, request: Request, identity: ObjectIdentity) -> Future[list[bytes]]:
        """Fetch ``request`` in the pool (at most ``concurrency`` at once); the future holds :meth:`get`'s answer.
        The first failure cancels everything pending at once (:meth:`cancel`): the load is stopping."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.options.requests_in_flight, thread_name_prefix="remote-fetch")
            future = self._pool.submit(self._get_or_stop, location, request, identity)
            self._pending.add(future)
        future.add_done_callback(self._done)
        return future

    def result(self, future: Future[list[bytes]], location: str) -> list[bytes]:
        """A submitted fetch's answer, waiting for it; the first failure of this fetcher where it was cancelled
        because of one (the cause, not the cancellation, is what a caller should see)."""
        try:
            return future.result()
        except (CancelledError, Cancelled):
            if self.failure is not None:
                raise self.failure from None
            raise Cancelled(f"{location}: read cancelled (the reader was closed)", path=location) from None

    def _get_or_stop(self, location: str, request: Request, identity: ObjectIdentity) -> list[bytes]:
        try:
            return self.get(location, request, identity)
        except Cancelled:
            raise
        except BaseException as e:
            self.cancel(e)
            raise

    def cancel(self, cause: BaseException | None = None) -> None:
        """Stop: pending requests are cancelled, running ones give up before their next attempt; until
        :meth:`close`, every fetch raises :class:`Cancelled`. ``cause``: the failure that stops the reads (what
        :meth:`result` raises instead of the cancellation), unless one was recorded first."""
        with self._lock:
            self.failure = self.failure or cause
            pending, self._pending = self._pending, set()
        self._stop.set()
        for future in pending:
            future.cancel()

    def close(self) -> None:
        """Cancel everything, wait for the pool's threads, and be ready for new fetches."""
        self.cancel()
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self._stop.clear()
        self.failure = None

    def _count_attempt(self) -> None:
        with self._lock:
            self.reads += 1

    def _done(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)
