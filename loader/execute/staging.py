"""Staging buffers between file reads and destination tensors: a small ring of reused host buffers.

The executor reads checkpoint bytes into a buffer of a :class:`StagingRing` and hands each block's values,
a (strided) view of that buffer, to :meth:`StagingRing.deliver`, which writes them into the destination view
(:mod:`.links`: the device side, how a block's values reach a host or device tensor).
For a destination in host memory that is one ``copy_``. For one on a device (CUDA), the buffers are pinned
and the copy to the device is queued with ``non_blocking=True``: the host goes on to read the next batch
into the next buffer while the copy engine drains this one. After a batch, :meth:`StagingRing.release`
records an event per device on the buffer; :meth:`StagingRing.acquire` waits on it before the buffer is
written again (double-buffered with the default two buffers), and :meth:`StagingRing.finish` waits for every
copy. What runs on the device side goes through a :class:`Link`; a test can pass its own (a CPU stand-in with
events that record their order) to run the device path, and its reuse checks, on a machine without a GPU.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from .links import Deliveries, Event, Link

#: default number of staging buffers (double-buffered: read into one while the other is copied)
BUFFERS = 2

#: buffers, spans and pack areas start at multiples of this many bytes (any dtype can be viewed there)
ALIGN = 16

#: a block whose byte span exceeds this many times the bytes it reads is packed on the host before its
#: copy to a device; a denser one is copied whole and gathered on the device
GATHER_OVERREAD = 4


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN`."""
    return -(-n // ALIGN) * ALIGN


@dataclass(eq=False)
class Stage:
    """One staging buffer of a ring.

    Attributes:
        index: its place in the ring (-1: a one-off buffer larger than the ring's).
        data: the buffer, a flat ``uint8`` tensor (pinned when copied to a CUDA device).
        events: events to wait on before the buffer is written again.
        links: links that copied out of the buffer since it was last released.
    """

    index: int
    data: torch.Tensor
    events: list[Event] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)

    @functools.cached_property
    def bytes(self) -> memoryview:
        """The buffer as writable bytes (what reads are read into), made once."""
        return memoryview(self.data.numpy())


class StagingRing:
    """A bounded ring of reused host staging buffers; the copies out of them into destination tensors are its
    :attr:`deliveries` (:class:`~.links.Deliveries`), whose events it waits on before a buffer is reused.

    At most ``count`` buffers of at most ``capacity`` bytes (rounded up to a multiple of :data:`ALIGN`) are
    held; a larger request (a block that could not be split to fit) gets a one-off buffer, dropped after use.
    Buffers are allocated on first use, no larger than the ``hint`` of :meth:`prepare` asks for, and grow
    (doubling, up to the capacity) when a batch needs more.

    Args:
        capacity: bytes per buffer at most (the executor's ``staging_bytes``).
        count: number of buffers (2: double-buffered).
        link: the :class:`Link` every destination is copied through (a test's stand-in device); default
            :class:`~.links.CudaLink` for CUDA destinations and plain ``copy_`` for host ones.

    Attributes:
        counts: how many times each route ran: ``acquire``, ``wait`` (events waited on before a reuse),
            ``host`` (copy into a host tensor), ``straight`` (straight into the destination), ``gather``
            (span to a device temporary, gathered there), ``pack`` (packed on the host first).
    """

    @classmethod
    def for_threads(cls, staging_bytes: int, threads: int) -> StagingRing:
        """A ring for ``threads`` I/O threads within the budget of :data:`BUFFERS` buffers of ``staging_bytes``:
        with one thread that ring; with more, ``threads + 1`` buffers sharing the budget (each thread reads into
        one while the calling thread copies out of another), fewer where the budget holds fewer ``ALIGN`` bytes."""
        budget = BUFFERS * staging_bytes
        count = BUFFERS if threads <= 1 else max(BUFFERS, min(threads + 1, budget // ALIGN))
        return cls(staging_bytes if count == BUFFERS else budget // count // ALIGN * ALIGN, count)

    def __init__(self, capacity: int, count: int = BUFFERS, *, link: Link | None = None) -> None:
        if capacity < 1 or count < 1:
            raise ValueError(f"a staging ring needs capacity >= 1 and count >= 1, got {capacity}, {count}")
        self.capacity, self.count = capacity, count
        self.pin = False
        self.hint = capacity
        self.stages: list[Stage | None] = [None] * count
        self.counts: collections.Counter[str] = collections.Counter()
        self._next = 0
        self.deliveries = Deliveries(link, self.counts)

    @property
    def link(self) -> Link | None:
        """The link every destination is copied through (None: by device); its deliveries hold it."""
        return self.deliveries.link

    @link.setter
    def link(self, link: Link | None) -> None:
        self.deliveries.link = link

    # ------------------------------------------------------------------------------------ buffers

    def prepare(self, devices: Iterable[torch.device], hint: int | None = None) -> None:
        """Get ready to copy into tensors on ``devices``: pin the buffers if one of them is a CUDA device.

        Args:
            devices: the devices of the destinations.
            hint: bytes the coming reads need at most in one buffer (smaller buffers for small loads).
        """
        pin = (self.link.pin if self.link is not None else any(d.type == "cuda" for d in devices)) and (
            torch.cuda.is_available()
        )
        if pin != self.pin:  # buffers of the other kind are dropped (after their copies finished)
            self.finish()
            self.stages = [None] * self.count
            self.pin = pin
        self.hint = self.capacity if hint is None else max(1, min(self.capacity, hint))

    def buffers(self) -> list[torch.Tensor]:
        """The ring's allocated buffers."""
        return [s.data for s in self.stages if s is not None]

    def acquire(self, nbytes: int) -> Stage:
        """The next buffer, once the copies out of it have finished, with at least ``nbytes`` bytes.

        Raises:
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"negative staging size {nbytes}")
        self.counts["acquire"] += 1
        if nbytes > align(self.capacity):  # one block that could not be split to fit: a buffer of its own, unpinned
            self.counts["oversized"] += 1
            return Stage(-1, torch.empty(align(nbytes), dtype=torch.uint8))
        i, self._next = self._next, (self._next + 1) % self.count
        stage = self.stages[i]
        if stage is not None:
            self._wait(stage)
        if stage is None or stage.data.numel() < nbytes:
            grown = self.hint if stage is None else min(self.capacity, 2 * stage.data.numel())
            size = align(max(nbytes, grown))
            stage = self.stages[i] = Stage(i, torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
        return stage

    def release(self, stage: Stage) -> None:
        """Mark the end of the copies out of ``stage`` queued so far: it may be acquired again once they ran."""
        for link in stage.links:
            stage.events.append(link.record())
        stage.links.clear()

    def finish(self) -> None:
        """Wait until every copy queued through the ring has run (the destinations hold their final values)."""
        for stage in self.stages:
            if stage is not None:
                self.release(stage)
                self._wait(stage)
        for link in self.deliveries.links():
            link.synchronize()

    def _wait(self, stage: Stage) -> None:
        for event in stage.events:
            self.counts["wait"] += 1
            event.synchronize()
        stage.events.clear()

    # ------------------------------------------------------------------------------------ copies

    def link_for(self, dest: torch.Tensor) -> Link | None:
        """The link ``dest`` is written through (None: a host tensor, written with a plain ``copy_``)."""
        return self.deliveries.link_for(dest)

    def deliver(
        self,
        stage: Stage,
        src: torch.Tensor,
        flips: Sequence[int],
        dest: torch.Tensor,
        casts: Sequence[torch.dtype] = (),
        pack_at: int | None = None,
    ) -> None:
        """Write ``src``, a view of ``stage``'s buffer, into ``dest``: :meth:`.links.Deliveries.deliver`."""
        self.deliveries.deliver(stage, src, flips, dest, casts, pack_at)
