"""Parallel reads: a small pool of I/O threads reads independent blocks while the caller plans the next ones.

Vocabulary:

- the *CPU share* of a process: the CPUs it may run on (``os.sched_getaffinity``) divided among the ranks on
  this host (``LOCAL_WORLD_SIZE``; in a process group without it, every rank is counted as local);
- *I/O threads*: threads that issue reads (``preadv`` releases the GIL) and copy into host tensors (torch's
  copies release it too), each with torch's intra-op threads set to its part of the share, so that our threads
  and torch's together never oversubscribe the cores;
- a *job*: one read (into a staging buffer, or straight into model memory) with its copies into host tensors,
  run on an I/O thread; its *finish* runs on the calling thread, in submission order: copies to a device
  through the staging ring's link (one thread queues them all, on one stream), releasing the buffer, progress;
- a *staged* job holds a buffer of the ring from its submission to its finish: at most ``ring.count - 1`` are
  in flight when the next buffer is acquired (:meth:`ReadPool.reserve`), so the buffer handed out is never one a
  thread still reads into, and the ring's memory bound holds.

With one thread a job and its finish run at once, on the calling thread: the sequential executor, unchanged.
A failed job stops the others from starting; :meth:`ReadPool.drain` and leaving the pool's ``with`` block wait
for every running job before the first error propagates, so a rollback runs after the last write.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch

from ..storage import RangeReader
from ..storage.capabilities import ProbesCache, capability
from .staging import Stage, StagingRing

#: most I/O threads the automatic setting picks (more added little on NVMe in the peers' measurements)
MAX_AUTO_THREADS = 8

#: bytes per job of reads straight into model memory with several I/O threads (a shard's tensors, shared out)
DIRECT_CHUNK = 8 << 20

#: jobs in flight per I/O thread at most (unstaged ones: direct reads; enough to keep every thread busy)
QUEUE_PER_THREAD = 4


def local_ranks() -> int:
    """Ranks of this job on this host: ``LOCAL_WORLD_SIZE`` (torchrun), else the process group's size (every rank
    counted as local: the safe guess), else 1."""
    value = os.environ.get("LOCAL_WORLD_SIZE", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


def cpu_share() -> int:
    """CPUs this process may use, divided among the ranks on this host (at least 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // local_ranks())


def resolve_io_threads(io_threads: int | None) -> int:
    """``io_threads``, or for None the CPU share (at most :data:`MAX_AUTO_THREADS`)."""
    return io_threads if io_threads is not None else min(MAX_AUTO_THREADS, cpu_share())


#: blocks whose first byte :func:`in_page_cache` probes
CACHE_PROBES = 8


def in_page_cache(reader: object, checkpoint: Any, reads: Sequence[Any]) -> bool:
    """Whether the checkpoint's bytes look to be in the page cache (a warm load): the first byte of up to
    :data:`CACHE_PROBES` blocks of the first file read, asked without waiting for the disk. Only that file is asked,
    which the reads open first anyway (a changed file is reported where it would be). True where the reader cannot
    tell (a remote store)."""
    probe = capability(reader, ProbesCache)
    if probe is None or not reads:
        return True
    first = checkpoint[reads[0].block.source].file
    infos = ((r, checkpoint[r.block.source]) for r in itertools.islice(reads, 64 * CACHE_PROBES))
    mine = [(r, info) for r, info in infos if info.file == first]
    for r, info in mine[:: max(1, len(mine) // CACHE_PROBES)][:CACHE_PROBES]:
        if probe.cached(first, info.byte_at(r.block.source_span()[0])) is False:
            return False
    return True


def copy_threads(io_threads: int) -> int:
    """torch's intra-op threads for one of ``io_threads`` threads' copies: its part of the CPU share, never more
    than torch is set to."""
    return max(1, min(torch.get_num_threads(), cpu_share() // io_threads))


#: whether ``torch.set_num_threads`` sets the calling thread's count only (OpenMP), not the whole process's
_PER_THREAD = torch.backends.openmp.is_available()


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` on this thread, then put back (where the setting is per thread)."""
    before = torch.get_num_threads()
    if not _PER_THREAD or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def chunks(start: int, views: list[memoryview], size: int) -> Iterable[tuple[int, list[memoryview]]]:
    """Consecutive ``views`` of the bytes from ``start`` on, cut into groups of about ``size`` bytes (a longer view
    cut too): ``(first byte, views)`` per group."""
    group, at, nbytes = [], start, 0
    for view in views:
        while nbytes + view.nbytes > size:
            cut = size - nbytes
            if cut:
                group.append(view[:cut])
            yield at, group
            group, at, nbytes, view = [], at + size, 0, view[cut:]
        if view.nbytes:
            group.append(view)
            nbytes += view.nbytes
    if group:
        yield at, group


class _Stopped(Exception):
    """A job that did not start: another had failed."""


class ReadPool:
    """Runs jobs on ``threads`` I/O threads and their finishes on the calling thread, in submission order.

    Use as a context manager: leaving it waits for every job (after an error, for the running ones only).

    Args:
        threads: I/O threads (1: every job runs at once on the calling thread).
    """

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._pending: collections.deque[tuple[Future | None, Callable[[], None] | None, bool]] = collections.deque()
        self._staged = 0
        self._error: BaseException | None = None
        self._executor: ThreadPoolExecutor | None = None
        if threads > 1:
            n = copy_threads(threads)
            self._executor = ThreadPoolExecutor(threads, "loader-io", initializer=_set_torch_threads, initargs=(n,))

    def __enter__(self) -> ReadPool:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None and self._error is None:
            self._error = _Stopped()  # the caller failed: stop what has not started
        if self._executor is not None:
            self._executor.shutdown(wait=True)  # no job runs after this returns
        self._pending.clear()

    def submit(self, job: Callable[[], None], finish: Callable[[], None] | None = None, *, staged: bool) -> None:
        """Run ``job`` on an I/O thread, then ``finish`` on this thread once every earlier job has finished.

        Args:
            job: the read and its host copies.
            finish: what must run on the calling thread afterwards (device copies, release, progress).
            staged: whether the job holds a staging buffer until its finish.

        Raises:
            BaseException: an earlier job's error (the first to happen), once the running jobs are done.
        """
        if self._executor is None:
            job()
            if finish is not None:
                finish()
            return
        if self._error is not None:
            self.drain()
        self._pending.append((self._executor.submit(self._guarded, job), finish, staged))
        self._staged += staged
        while len(self._pending) > QUEUE_PER_THREAD * self.threads:
            self._retire()

    def reserve(self, staged: int) -> None:
        """Retire the oldest jobs until at most ``staged`` staged jobs are in flight (before acquiring a buffer)."""
        while self._staged > staged:
            self._retire()

    def drain(self) -> None:
        """Wait for every job and run every finish.

        Raises:
            BaseException: the first job error, after every running job finished.
        """
        while self._pending:
            self._retire()

    def _guarded(self, job: Callable[[], None]) -> None:
        if self._error is not None:
            raise _Stopped()
        try:
            job()
        except BaseException as e:
            if self._error is None or isinstance(self._error, _Stopped):
                self._error = e
            raise

    def _retire(self) -> None:
        future, finish, staged = self._pending.popleft()
        self._staged -= staged
        try:
            if future is not None:
                future.result()
            if finish is not None:
                finish()
        except BaseException as e:
            if self._error is None:
                self._error = e
            self._fail()
        if self._error is not None and not isinstance(self._error, _Stopped):
            self._fail()

    def _fail(self) -> None:
        """Wait for the jobs still running, then raise the first error."""
        error = self._error
        for future, _, _ in self._pending:
            if future is not None:
                future.cancel()
        for future, _, _ in self._pending:
            if future is not None and not future.cancelled():
                try:
                    future.result()
                except BaseException:
                    pass
        self._pending.clear()
        self._staged = 0
        assert error is not None
        raise error


def _set_torch_threads(n: int) -> None:
    if _PER_THREAD:
        torch.set_num_threads(n)


# ----------------------------------------------------------------------------------------- the executor's jobs


def acquire(pool: ReadPool, ring: StagingRing, nbytes: int) -> Stage:
    """``ring``'s next buffer, once no I/O thread reads into it: at most ``ring.count - 1`` buffers in flight."""
    pool.reserve(ring.count - 1)
    return ring.acquire(nbytes)


def submit_staged(
    pool: ReadPool,
    ring: StagingRing,
    stage: Stage,
    read: Callable[[], None],
    deliver: Callable[[], None],
    done: Callable[[], None],
    dests: list[torch.Tensor],
) -> None:
    """Read into ``stage`` on an I/O thread and ``deliver`` its blocks: into host tensors on that thread, to a
    device on the calling one (in order, on one stream); then release the buffer and call ``done``."""
    host = all(ring.link_for(d) is None for d in dests)

    def job() -> None:
        read()
        if host:
            deliver()

    def finish() -> None:
        if not host:
            deliver()
        ring.release(stage)
        done()

    pool.submit(job, finish, staged=True)


def submit_consecutive(
    pool: ReadPool,
    reader: RangeReader,
    progress: Callable[[int], None],
    file: str,
    start: int,
    views: list[memoryview],
) -> None:
    """Read consecutive bytes of ``file`` from ``start`` straight into ``views`` (model memory): one job, or with
    several I/O threads jobs of about :data:`DIRECT_CHUNK` bytes; ``progress`` is told each job's bytes."""
    size = DIRECT_CHUNK if pool.threads > 1 else sum(v.nbytes for v in views)
    for at, group in chunks(start, views, size):
        nbytes = sum(v.nbytes for v in group)
        pool.submit(
            lambda at=at, group=group: reader.pread_consecutive(file, at, group),
            lambda nbytes=nbytes: progress(nbytes),
            staged=False,
        )
