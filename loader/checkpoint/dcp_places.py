"""Where a DCP chunk's elements lie in its file, found when the chunk is first needed: its ``torch.save`` blob's
zip records and pickle read then, and checked, before any byte of it is used.

Vocabulary: a chunk's *blob* is the ``torch.save`` archive ``[offset, offset + length)`` of its file that
``dcp.save`` wrote it as; its *place* is the absolute byte offset of its elements there (the blob's one tensor's
storage bytes). A :class:`DcpChunk` (a :class:`~.chunks.Chunk`) and a :class:`DcpTensorInfo` (a key of one chunk)
know their box or shape from the metadata alone and ask :class:`ChunkPlaces` for their place on the first read of
``offset`` / ``data_start``; a chunk no rank's plan reads is never opened. Finding a place checks the blob: inside
its file, a zip archive :mod:`.ziparchive` reads, one ``data.pkl`` :mod:`.torchzip`'s allow-list reads, little-endian,
one contiguous tensor of the dtype and shape the metadata says, inside its storage record; else a
:class:`~loader.errors.CheckpointError` naming the file and the key.

In a local folder a blob is read as a remote archive's (the end records in a small tail first) through one
descriptor per file, without readahead, a page at a time, each page once while a bounded cache holds it
(:class:`_Pages`): only the pages at a needed blob's boundaries are read, not the stretch of tensor data that
readahead after them would bring in (the pages another rank's chunks fill). The pages read are recorded
(:attr:`ChunkPlaces.pages_read`).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..storage import PAGE, FileIdentity, Store
from ..storage.untrusted import err, open_regular_file, pread_exact, short
from .chunks import Chunk, TensorInfo
from .dcp_metadata import DcpStorage
from .pickles import read_pickle
from .torchzip import MAX_PICKLE_BYTES, TORCH_GLOBALS, storages, tensor_info
from .ziparchive import Record, read_records

#: pages of local files a checkpoint keeps read (a page two blobs share is read once while it is kept)
KEPT_PAGES = 1024


class _Pages:
    """One local file's pages: read through a descriptor opened (and checked to be the file of ``identity``) for
    one place at a time, readahead off, a run of missing pages in one call; read pages are kept in ``cache``."""

    def __init__(self, location: str, size: int, identity: object, cache: OrderedDict) -> None:
        self.location, self.size, self.cache = location, size, cache
        self.fd, st = open_regular_file(location)
        if identity is not None and FileIdentity.of(st) != identity:
            os.close(self.fd)
            raise err(location, "file changed underneath since its size was read")
        if hasattr(os, "posix_fadvise"):  # the bytes after a record are another chunk's: not read ahead
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.read_here: set[int] = set()

    def read(self, start: int, end: int) -> bytes:
        first, last = start // PAGE, -(-end // PAGE)
        missing = [p for p in range(first, last) if (self.location, p) not in self.cache]
        while missing:
            run = 1
            while run < len(missing) and missing[run] == missing[0] + run:
                run += 1
            a, b = missing[0] * PAGE, min(self.size, (missing[0] + run) * PAGE)
            data = pread_exact(self.fd, self.location, b - a, a)
            for i in range(run):
                self.cache[(self.location, missing[i])] = data[i * PAGE : (i + 1) * PAGE]
                self.read_here.add(missing[i])
            missing = missing[run:]
        pages = []
        for p in range(first, last):
            self.cache.move_to_end((self.location, p))
            pages.append(self.cache[(self.location, p)])
        data = b"".join(pages)
        return data[start - first * PAGE : end - first * PAGE]

    def close(self) -> None:
        os.close(self.fd)


class _Blob:
    """The bytes ``[base, base + size)`` of one file of a store, read as a file of their own (a chunk's blob):
    through the file's :class:`_Pages` where it is local, read as a remote archive's (small reads first)."""

    def __init__(self, store: Store, location: str, base: int, size: int, pages: _Pages | None) -> None:
        self.store, self.location, self.base, self.size, self.pages = store, location, base, size, pages
        self.remote = store.remote or pages is not None

    def read_range(self, location: str, start: int, end: int, identity: object) -> bytes:
        if not 0 <= start <= end <= self.size:
            raise err(location, f"read [{start}, {end}) outside the {self.size}-byte torch.save blob at {self.base}")
        if self.pages is not None:
            return self.pages.read(self.base + start, self.base + end)
        return self.store.read_range(self.location, self.base + start, self.base + end, identity)


def _byteorder(location: str, blob: _Blob, records: dict[str, Record], prefix: str, identity: object) -> None:
    record = records.get(f"{prefix}byteorder")
    if record is None:
        return
    order = blob.read_range(location, record.data_start, record.data_end, identity) if record.size <= 16 else b"?"
    if order != b"little":
        raise err(location, f"record {prefix}byteorder says {short.repr(order)}: only little-endian blobs are read")


def _place(blob: _Blob, key: str, identity: object, expect: tuple) -> int:
    """The absolute byte offset of the chunk's elements: its blob's one tensor, checked to be of ``expect``
    ``(dtype, sizes)``, contiguous, inside its storage record, inside the blob."""
    location = blob.location
    where = f"chunk blob [{blob.base}, {blob.base + blob.size})"
    records = read_records(location, blob, blob.size, identity, threads=blob.store.remote)  # type: ignore[arg-type]
    found = [n for n in records if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(found) != 1:
        raise err(location, f"{where} is not a torch.save archive (its data.pkl records: {found[:3]})", key)
    prefix = found[0].removesuffix("data.pkl")
    pickle = records[found[0]]
    if pickle.size > MAX_PICKLE_BYTES:
        raise err(location, f"{where}: data.pkl of {pickle.size} bytes exceeds the {MAX_PICKLE_BYTES}-byte limit", key)
    _byteorder(location, blob, records, prefix, identity)
    data = blob.read_range(location, pickle.data_start, pickle.data_end, identity)
    persistent = storages(location, records, prefix)
    tensor = read_pickle(data, allowed=TORCH_GLOBALS, persistent_load=persistent, name=location)
    info = tensor_info(location, key, tensor, records, prefix)
    if (info.dtype, info.shape) != expect:
        got, want = f"{info.dtype} {list(info.shape)}", f"{expect[0]} {list(expect[1])}"
        raise err(location, f"{where} holds a tensor of {got}, the metadata says its chunk is {want}", key)
    return blob.base + info.data_start  # type: ignore[operator]


@dataclass(eq=False)
class ChunkSpec:
    """What finding one chunk's place needs: its key, file, blob and the ``(dtype, sizes)`` the metadata says;
    ``offset`` once found."""

    key: str
    location: str
    blob: DcpStorage
    expect: tuple[torch.dtype, tuple[int, ...]]
    places: ChunkPlaces
    offset: int | None = None

    def place(self) -> int:
        return self.offset if self.offset is not None else self.places.find(self)


class ChunkPlaces:
    """Finds chunks' places in the files of ``store`` (each file's ``(size, identity)`` in ``heads``, as it was
    found when the checkpoint was opened), one blob at a time, each once.

    Attributes:
        pages_read: the pages (``offset // PAGE``) of each local file read so far (none remotely).
    """

    def __init__(self, store: Store, heads: dict[str, tuple[int, object]]) -> None:
        self.store, self.heads = store, heads
        self.pages_read: dict[str, set[int]] = {}
        self._cache: OrderedDict[tuple[str, int], bytes] = OrderedDict()
        self._lock = threading.Lock()  # places asked for from several threads: each blob read once

    def find(self, spec: ChunkSpec) -> int:
        """``spec``'s place, its blob read and checked now (see the module).

        Raises:
            CheckpointError: the blob is refused, naming the file and the key.
        """
        with self._lock:
            if spec.offset is None:
                spec.offset = self._find(spec)
            return spec.offset

    def _find(self, spec: ChunkSpec) -> int:
        size, identity = self.heads[spec.location]
        pages = None
        try:
            if not self.store.remote:
                pages = _Pages(spec.location, size, identity, self._cache)
            blob = _Blob(self.store, spec.location, spec.blob.offset, spec.blob.length, pages)
            return _place(blob, spec.key, identity, spec.expect)
        except CheckpointError as e:  # the archive's own errors (its records, its pickle): named by the key too
            if e.key is not None:
                raise
            message = str(e).removeprefix(f"{e.path}: ")
            where = f"chunk blob [{spec.blob.offset}, {spec.blob.offset + spec.blob.length}): "
            raise err(spec.location, where + message, spec.key) from e
        finally:
            if pages is not None:
                pages.close()
                self.pages_read.setdefault(spec.location, set()).update(pages.read_here)
                while len(self._cache) > KEPT_PAGES:
                    self._cache.popitem(last=False)


class DcpChunk(Chunk):
    """A :class:`~.chunks.Chunk` of a DCP key whose ``offset`` is found on its first read (:class:`ChunkPlaces`).

    Equal to another such chunk of the same box, file and blob (the file's identity is the checkpoint's)."""

    __slots__ = ("spec",)

    def __init__(self, box: Any, spec: ChunkSpec) -> None:
        object.__setattr__(self, "spec", spec)
        super().__init__(box, spec.location, -1)

    @property  # type: ignore[override]
    def offset(self) -> int:
        return self.spec.place()

    @offset.setter
    def offset(self, value: int) -> None:  # Chunk's __init__: the place is the spec's
        pass

    @property
    def found(self) -> bool:
        """Whether its place was found (its blob read)."""
        return self.spec.offset is not None

    def _key(self) -> tuple:
        return self.box, self.location, self.spec.blob

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DcpChunk) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        at = self.spec.offset if self.found else f"in blob {self.spec.blob.offset}+{self.spec.blob.length}"
        return f"DcpChunk(box={self.box}, location={self.location!r}, offset={at})"


class DcpTensorInfo(TensorInfo):
    """A DCP key stored in one chunk of its whole shape: a plain :class:`~.chunks.TensorInfo` whose
    ``data_start`` (and ``data_end``) are found on their first read (:class:`ChunkPlaces`)."""

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...], spec: ChunkSpec) -> None:
        object.__setattr__(self, "spec", spec)
        super().__init__(key, spec.location, dtype, shape, None, None)

    @property  # type: ignore[override]
    def data_start(self) -> int:
        return self.spec.place()

    @data_start.setter
    def data_start(self, value: int | None) -> None:  # TensorInfo's __init__: the place is the spec's
        pass

    @property  # type: ignore[override]
    def data_end(self) -> int:
        return self.spec.place() + self.nbytes

    @data_end.setter
    def data_end(self, value: int | None) -> None:
        pass

    @property
    def nbytes(self) -> int:
        """Bytes of its elements (known without its place)."""
        return self.numel * self.dtype.itemsize

    @property
    def found(self) -> bool:
        """Whether its place was found (its blob read)."""
        return self.spec.offset is not None

    def _key(self) -> tuple:
        return self.key, self.file, self.dtype, self.shape, self.spec.blob

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DcpTensorInfo) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        at = self.spec.offset if self.found else f"in blob {self.spec.blob.offset}+{self.spec.blob.length}"
        return f"DcpTensorInfo({self.key!r}, {self.file!r}, {self.dtype}, {self.shape}, data_start={at})"
