"""The storage interface: where a checkpoint's bytes come from, and nothing about what they mean.

Vocabulary (used identically by every driver and by the layers above):

- a *location* is the full name of one object: an absolute local path or a URL (``s3://bucket/prefix/f``,
  ``https://host/folder/f``, ``hf://org/name/f``); errors name it;
- a *store* (:class:`Store`) knows one checkpoint folder's objects: it joins names to locations, tells whether an
  object exists, lists a folder where it can (a local folder, not an HTTP one), reads an object's *head* (its
  first bytes with its size and *identity*) and small whole objects (an index, a config);
- an *identity* (:class:`~.local.FileIdentity` on disk, :class:`ObjectIdentity` remotely) is what tells that an
  object was replaced or rewritten: recorded when the header is read, checked on every later read;
- a *range reader* (:class:`RangeReader`) reads byte ranges of objects into caller buffers, exactly, counting the
  bytes it fetched and the requests it made; it is told in advance which ranges a file will be read at
  (:meth:`RangeReader.will_read`), so that a remote driver can coalesce and fetch them concurrently, and it reads
  *runs* (equal-length ranges of one block) its own best way (:meth:`RangeReader.read_runs`);
- a *capability* is what a driver can do beyond these two contracts (readahead hints, direct reads, a write side,
  ...): declared and checked in :mod:`.capabilities` only; the write side is :mod:`.writing`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class ObjectIdentity:
    """What identifies one remote object's contents: if any field changes, the object was replaced.

    Attributes:
        size: Bytes in the object.
        etag: The server's entity tag (quotes kept), ``""`` when it sends none.
        version: A version id or last-modified stamp, ``""`` when none.
        head_bytes: How many of the object's first bytes :attr:`head_crc` covers (a safetensors file's length and
            header, as they were read; 0: none).
        head_crc: Their CRC-32: where the server's validators prove little, the first bytes are fetched again
            with a file's last request and compared (:mod:`.remote.reader`).
    """

    size: int
    etag: str = ""
    version: str = ""
    head_bytes: int = field(default=0, compare=False)  # the same object read twice: equal, whatever was hashed
    head_crc: int = field(default=0, compare=False)

    def with_head(self, data: bytes) -> ObjectIdentity:
        """This identity, also bound to the object's first bytes ``data``."""
        return replace(self, head_bytes=len(data), head_crc=zlib.crc32(data))


@dataclass(frozen=True)
class ObjectHead:
    """The first bytes of an object with its size and identity (one read, for a safetensors header).

    Attributes:
        data: The object's first ``min(size, asked)`` bytes.
        size: Bytes in the whole object.
        identity: Its identity (:class:`~.local.FileIdentity` or :class:`ObjectIdentity`).
    """

    data: bytes
    size: int
    identity: object


class Runs(Protocol):
    """Equal-length byte ranges of one object, ascending and disjoint: one block's reads.

    Attributes:
        length: Bytes in each run.
    """

    length: int

    def starts(self) -> np.ndarray:
        """Absolute byte offsets of the runs, ascending (``int64``)."""
        ...

    def spans(self, page: int) -> list[tuple[int, int]]:
        """The runs merged into ``(start, end)`` ranges whose gaps hold no page of ``page`` bytes that no run
        touches: reading a range through its gaps reads no page more than the runs alone would."""
        ...


@runtime_checkable
class RangeReader(Protocol):
    """Reads exact byte ranges of a store's objects into caller buffers (thread-safe; a context manager).

    Attributes:
        bytes_read: Bytes fetched for callers (payload, and gaps read through when coalescing).
        gap_bytes: Of those, bytes read between the ranges callers wanted and discarded.
        reads: Read requests made (system calls locally, HTTP requests remotely).
    """

    bytes_read: int
    gap_bytes: int
    reads: int

    def __enter__(self) -> RangeReader: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def close(self) -> None:
        """Release descriptors, connections and buffers; the reader may be reused afterwards."""
        ...

    def expect(self, location: str, identity: object | None) -> None:
        """Require ``location`` to have ``identity`` from now on (``None``: nothing known)."""
        ...

    def verify(self, location: str) -> None:
        """Raise :class:`~loader.errors.CheckpointError` if ``location`` no longer has its expected identity."""
        ...

    def verify_all(self) -> None:
        """:meth:`verify` every object read so far."""
        ...

    def will_read(self, location: str, ranges: Callable[[], Sequence[tuple[int, int]]], *, sparse: bool) -> None:
        """Hint: ``location`` is about to be read at the ``(start, end)`` ranges ``ranges()`` returns, in about that
        order (called only by drivers that use them); ``sparse``: the ranges are a small part of the object (no
        readahead beyond them)."""
        ...

    def pread_into(self, location: str, offset: int, out: memoryview | bytearray) -> None:
        """Read exactly ``len(out)`` bytes at ``offset`` into ``out``."""
        ...

    def pread_consecutive(self, location: str, offset: int, outs: Sequence[memoryview]) -> None:
        """Read consecutive bytes from ``offset`` into the buffers ``outs``, one after another."""
        ...

    def read_runs(self, location: str, runs: Runs, out: memoryview, base: int, *, wanted: int) -> None:
        """Read every run ``[s, s + runs.length)`` into ``out[s - base:]``; other bytes of ``out`` may be written
        too (gaps read through). ``wanted``: the run bytes (counted in ``bytes_read``)."""
        ...


class Store(Protocol):
    """One checkpoint folder's objects (see the module's vocabulary).

    Attributes:
        root: The folder's location (an absolute path or a URL without a trailing slash).
        remote: Whether bytes come over a network (no listing, no page cache).
    """

    root: str
    remote: bool

    def locate(self, name: str) -> str:
        """The location of the object ``name`` (a relative name, already checked to stay inside the folder)."""
        ...

    def exists(self, location: str) -> bool:
        """Whether the object exists (a link that exists but leads nowhere counts: opening it reports why)."""
        ...

    def list_names(self) -> list[str] | None:
        """Names of the folder's entries, or ``None`` where a folder cannot be listed (HTTP)."""
        ...

    def head(self, location: str, nbytes: int) -> ObjectHead:
        """The object's first ``nbytes`` bytes (fewer if it is shorter), size and identity."""
        ...

    def read_range(self, location: str, start: int, end: int, identity: object) -> bytes:
        """Bytes ``[start, end)`` of the object, which must still have ``identity``."""
        ...

    def read_small(self, location: str, limit: int, what: str) -> bytes:
        """A whole small object (an index, a config), refused before reading when over ``limit`` bytes."""
        ...

    def reader(self, identities: Mapping[str, object] | None = None) -> RangeReader:
        """A new :class:`RangeReader`, told each location's identity."""
        ...


#: ``(offset, destination)``: the bytes ``[offset, offset + len(destination))`` of an object go to ``destination``
Segment = tuple[int, memoryview]


def consecutive(offset: int, outs: Sequence[memoryview]) -> list[Segment]:
    """The non-empty buffers ``outs`` as the segments of consecutive bytes from ``offset``."""
    segments, pos = [], offset
    for o in outs:
        view = memoryview(o).cast("B")
        if len(view):
            segments.append((pos, view))
            pos += len(view)
    return segments
