"""The device side of staging: how a block's values in a staging buffer reach their destination tensor.

Vocabulary: a **link** (:class:`Link`) is the host-to-device side of one destination device (queues copies,
records events; :class:`CudaLink` for a CUDA device, a test's stand-in elsewhere); a **delivery** is one block's
values written from a staging buffer into its destination view (:meth:`Deliveries.deliver`):

* into a host tensor: one ``copy_`` (with the block's flips and casts);
* its values lie packed in the buffer (one contiguous run, same dtype, no casts or flips) and the destination
  view is contiguous: one copy straight into the destination, no device temporary (``straight``);
* its byte span is at most ``GATHER_OVERREAD`` times the bytes it reads: the span is copied to a device
  temporary and gathered (strided copy, flips, casts) on the device, off the host's critical path (``gather``);
* a sparser block (a column shard: short runs far apart) is first packed on the host into the pack area of
  its buffer (one strided copy), so that only the bytes it needs cross the bus (``pack``).

The buffers themselves, and waiting on a link's events before one is written again, are
:class:`~.staging.StagingRing`'s.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import Protocol

import torch

from regiontrace.executor import copy_cast


class Event(Protocol):
    """Marks the point of a device stream after the copies queued so far."""

    def synchronize(self) -> None: ...


class Link(Protocol):
    """The host-to-device side of a :class:`StagingRing`: queues copies and records events.

    Attributes:
        pin: whether host buffers copied through this link should be pinned.
    """

    pin: bool

    def copy(self, dest: torch.Tensor, host: torch.Tensor) -> None:
        """Queue ``dest.copy_(host)`` (same shape and dtype, ``host`` contiguous in a staging buffer)."""

    def record(self) -> Event:
        """An event that completes once everything queued so far has run."""

    def synchronize(self) -> None:
        """Wait until everything queued so far has run."""


class CudaLink:
    """:class:`Link` to one CUDA device, on its current stream.

    Args:
        device: the CUDA device.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pin = True

    def copy(self, dest: torch.Tensor, host: torch.Tensor) -> None:
        dest.copy_(host, non_blocking=True)

    def record(self) -> Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()


class Buffer(Protocol):
    """A staging buffer a delivery copies out of (:class:`~.staging.Stage`)."""

    data: torch.Tensor
    links: list[Link]


class Deliveries:
    """The copies out of staging buffers into destination tensors, each through the link its device needs.

    Args:
        link: the :class:`Link` every destination is copied through (a test's stand-in device); default
            :class:`CudaLink` for CUDA destinations and plain ``copy_`` for host ones.
        counts: where each delivery's route is counted (``host``, ``straight``, ``gather``, ``pack``).
    """

    def __init__(self, link: Link | None, counts: collections.Counter[str]) -> None:
        self.link, self.counts = link, counts
        self._links: dict[torch.device, Link] = {}
        self._lock = threading.Lock()

    def links(self) -> list[Link]:
        """Every link copies went through."""
        return [*self._links.values(), *([self.link] if self.link is not None else [])]

    def link_for(self, dest: torch.Tensor) -> Link | None:
        """The link ``dest`` is written through (None: a host tensor, written with a plain ``copy_``)."""
        if self.link is not None:
            return self.link
        if not dest.is_cuda:
            return None
        link = self._links.get(dest.device)
        if link is None:
            link = self._links[dest.device] = CudaLink(dest.device)
        return link

    def deliver(
        self,
        stage: Buffer,
        src: torch.Tensor,
        flips: Sequence[int],
        dest: torch.Tensor,
        casts: Sequence[torch.dtype] = (),
        pack_at: int | None = None,
    ) -> None:
        """Write ``src`` (flipped along ``flips``, cast through ``casts``) into ``dest``.

        Args:
            stage: the buffer ``src`` is a view of.
            src: the block's values: a view of ``stage.data`` (any non-negative strides), block-shaped.
            flips: dims of ``src`` to reverse.
            dest: the destination view, of ``src``'s shape.
            casts: value casts applied in order before writing.
            pack_at: byte offset in ``stage.data`` of ``src.nbytes`` free bytes to pack ``src`` into before a
                copy to a device (None: copy its span whole and gather on the device).
        """
        link = self.link_for(dest)
        if link is None:  # I/O threads copy into host tensors at once: the count under a lock
            with self._lock:
                self.counts["host"] += 1
            copy_cast(dest, src.flip(list(flips)) if flips else src, casts)
            return
        if src.numel() == 0:
            return
        if link not in stage.links:
            stage.links.append(link)
        host = src
        if pack_at is not None and not src.is_contiguous():
            self.counts["pack"] += 1
            host = pack(stage.data, src, pack_at)
        if not flips and not casts and host.is_contiguous() and dest.is_contiguous() and host.dtype == dest.dtype:
            self.counts["straight"] += 1
            link.copy(dest, host)
            return
        self.counts["gather"] += 1
        gather_on_device(link, stage.data, host, flips, dest, casts)


def pack(data: torch.Tensor, src: torch.Tensor, at: int) -> torch.Tensor:
    """``src`` copied into ``data`` (a staging buffer) from byte ``at`` on, C-contiguous: the packed view."""
    host = data[at : at + src.numel() * src.element_size()].view(src.dtype).view(src.shape)
    host.copy_(src)
    return host


def gather_on_device(
    link: Link,
    data: torch.Tensor,
    host: torch.Tensor,
    flips: Sequence[int],
    dest: torch.Tensor,
    casts: Sequence[torch.dtype],
) -> None:
    """Copy the byte span of ``host`` (a view of the staging buffer ``data``) to a temporary on ``dest``'s device
    through ``link``, and gather it there into ``dest``: strided copy, flips along ``flips``, ``casts``."""
    item = host.element_size()
    first = host.storage_offset()
    last = first + sum((n - 1) * s for n, s in zip(host.shape, host.stride())) + 1
    temp = torch.empty((last - first) * item, dtype=torch.uint8, device=dest.device)
    link.copy(temp, data[first * item : last * item])
    values = torch.as_strided(temp.view(host.dtype), host.shape, host.stride(), 0)
    copy_cast(dest, values.flip(list(flips)) if flips else values, casts)
