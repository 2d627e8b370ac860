"""A torch.distributed.checkpoint (DCP) folder as a source: ``.metadata`` plus the ``__<rank>_<n>.distcp`` files
``dcp.save`` (``FileSystemWriter``) writes, known from the metadata and each chunk's zip records and pickle only.

Each chunk of a key is one ``torch.save`` blob (a zip archive) at ``[offset, offset + length)`` of its file, as
``FileSystemWriter`` writes tensors; its records are read by range inside that span (:mod:`.ziparchive`, offsets
relative to the blob), its pickle by :mod:`.torchzip`'s allow-list, and the chunk becomes a
:class:`~.chunks.Chunk` at the absolute place of its storage bytes: a key of several chunks is a cat of chunk
sources, so each rank reads only the sub-boxes of chunks it needs. Chunks that do not tile their key, a blob
outside its file, a tensor blob of another dtype or shape than the metadata says, a non-contiguous view, a chunk
written through transforms: a :class:`~loader.errors.CheckpointError` naming the file and the key.

Opening reads a few hundred bytes at each blob's two ends (its end records, directory, local headers and pickle),
in every file, also for the chunks a rank will not read. In a local folder they are read as a remote archive's (the
end records in a small tail first) through one descriptor per file, without readahead, a page at a time and each
page once (:class:`_Pages`): the open reads from disk only the pages at the blobs' boundaries, not the stretch of
tensor data that readahead after them would bring in (the pages another rank's chunks fill).
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping

from ..errors import CheckpointNotFoundError, redact_url
from ..options import StorageOptions
from ..storage import PAGE, FileIdentity, LocalStore, Store, is_url, open_store
from ..storage.untrusted import err, open_regular_file, pread_exact, short
from .chunks import Chunk, TensorInfo
from .dcp_metadata import DcpMetadata, DcpStorage, DcpTensor, dcp_storage, read_dcp_metadata
from .pickles import read_pickle
from .protocol import TableCheckpoint
from .torchzip import MAX_PICKLE_BYTES, TORCH_GLOBALS, storages, tensor_info
from .ziparchive import Record, read_records

METADATA_NAME = ".metadata"
#: a ``.metadata`` larger than this is refused before it is read
MAX_METADATA_BYTES = 256 << 20
#: the file names a ``storage_data`` entry may give: a plain name in the folder
_FILE_NAME = re.compile(r"[^/\\\0]+")


class _Pages:
    """The pages of one local file read for its blobs' records: one descriptor, readahead off, each page read
    once (a run of pages missing at once in one call), checked to be the file of ``identity``."""

    def __init__(self, location: str, size: int, identity: object) -> None:
        self.location, self.size = location, size
        self.fd, st = open_regular_file(location)
        self.pages: dict[int, bytes] = {}
        self.lock = threading.Lock()  # the headers of a blob read as a remote archive's may be read at once
        if identity is not None and FileIdentity.of(st) != identity:
            os.close(self.fd)
            raise err(location, "file changed underneath since its size was read")
        if hasattr(os, "posix_fadvise"):  # the bytes after a record are another chunk's: not read ahead
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)

    def read(self, start: int, end: int) -> bytes:
        with self.lock:
            return self._read(start, end)

    def _read(self, start: int, end: int) -> bytes:
        first, last = start // PAGE, -(-end // PAGE)
        missing = [p for p in range(first, last) if p not in self.pages]
        while missing:
            run = 1
            while run < len(missing) and missing[run] == missing[0] + run:
                run += 1
            a, b = missing[0] * PAGE, min(self.size, (missing[0] + run) * PAGE)
            data = pread_exact(self.fd, self.location, b - a, a)
            for i in range(run):
                self.pages[missing[i]] = data[i * PAGE : (i + 1) * PAGE]
            missing = missing[run:]
        data = b"".join(self.pages[p] for p in range(first, last))
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


def is_dcp_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a local DCP folder (holding ``.metadata``) or that ``.metadata`` file."""
    text = os.fspath(path)
    if is_url(text):
        return text.partition("?")[0].rstrip("/").endswith("/" + METADATA_NAME)
    if os.path.basename(text) == METADATA_NAME:
        return os.path.isfile(text)
    return os.path.isdir(text) and os.path.isfile(os.path.join(text, METADATA_NAME))


def _store(path: str | os.PathLike[str], storage: StorageOptions) -> Store:
    text = os.fspath(path)
    if is_url(text):
        base = text.partition("?")[0].rstrip("/").removesuffix("/" + METADATA_NAME)
        return open_store(base, storage)
    if storage.for_urls_only:
        raise ValueError(f"storage options (backend, remote) apply to URLs only, not to the local path {text!r}")
    folder = os.path.dirname(text) if os.path.basename(text) == METADATA_NAME else text
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(f"{text}: not a DCP checkpoint folder", path=text)
    return LocalStore(folder)


def _file(store: Store, meta_path: str, key: str, name: str) -> str:
    if not _FILE_NAME.fullmatch(name) or name in (".", "..") or (store.remote and ("?" in name or "#" in name)):
        raise err(meta_path, f"storage file name {short.repr(name)} is not a plain file name in the folder", key)
    return store.locate(name)


def _byteorder(location: str, blob: _Blob, records: dict[str, Record], prefix: str, identity: object) -> None:
    record = records.get(f"{prefix}byteorder")
    if record is None:
        return
    order = blob.read_range(location, record.data_start, record.data_end, identity) if record.size <= 16 else b"?"
    if order != b"little":
        raise err(location, f"record {prefix}byteorder says {short.repr(order)}: only little-endian blobs are read")


def _chunk_place(
    store: Store, location: str, key: str, place: DcpStorage, head: tuple[int, object, _Pages | None], expect: tuple
) -> int:
    """The absolute byte offset of the chunk's elements in ``location``: its blob's one tensor, checked to be of
    ``expect`` ``(dtype, sizes)``, contiguous, inside its storage record, inside the blob, inside the file."""
    size, identity, pages = head
    where = f"chunk blob [{place.offset}, {place.offset + place.length})"
    if place.offset + place.length > size:
        raise err(location, f"{where} lies outside the file ({size} bytes)", key)
    blob = _Blob(store, location, place.offset, place.length, pages)
    records = read_records(location, blob, place.length, identity)  # type: ignore[arg-type]
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
    return place.offset + info.data_start  # type: ignore[operator]


def _tensor_info(store: Store, meta: DcpMetadata, meta_path: str, tensor: DcpTensor, heads: dict) -> TensorInfo:
    chunks = []
    for c in tensor.chunks:
        place = dcp_storage(meta, meta_path, tensor.key, c.offsets)
        location = _file(store, meta_path, tensor.key, place.relative_path)
        if location not in heads:
            if not store.remote and not store.exists(location):
                raise err(meta_path, f"names missing file {location}", tensor.key)
            found = store.head(location, 0)
            pages = None if store.remote else _Pages(location, found.size, found.identity)
            heads[location] = (found.size, found.identity, pages)
        offset = _chunk_place(store, location, tensor.key, place, heads[location], (tensor.dtype, c.sizes))
        box = tuple((a, a + n) for a, n in zip(c.offsets, c.sizes))
        chunks.append(Chunk(box, location, offset))
    return TensorInfo.of_chunks(tensor.key, tensor.dtype, tensor.size, chunks)


class DcpCheckpoint(TableCheckpoint):
    """A DCP checkpoint folder (``.metadata`` and ``*.distcp``): the :class:`~.protocol.Checkpoint` whose keys are
    stored as the chunks ``dcp.save`` wrote (plain encoding). Attributes as
    :class:`~.folder.SafetensorsCheckpoint`'s (``metadata`` ``{}`` per file; ``identities`` each ``.distcp``
    file's as its chunks' records were read); :attr:`byte_items` the fqns of non-tensor items (not loaded);
    :attr:`opened_pages` the pages (``offset // PAGE``) of each local file that opening it read (none remotely)."""

    byte_items: tuple[str, ...] = ()
    opened_pages: Mapping[str, frozenset[int]] = {}

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        storage: StorageOptions | None = None,
        identities: Mapping[str, object] | None = None,
    ) -> DcpCheckpoint:
        """Open a DCP folder (or its ``.metadata``; a local path or a URL), reading its metadata and each chunk's
        zip records and pickle (no tensor data).

        Raises:
            CheckpointNotFoundError: no folder with a ``.metadata`` there.
            CheckpointError: the metadata or a chunk's blob is malformed or refused (:mod:`.dcp_metadata`, see the
                module), naming the file and the key.
        """
        store = _store(path, storage or StorageOptions())
        if identities and store.remote:
            store.pin(identities)  # type: ignore[attr-defined]
        meta_path = store.locate(METADATA_NAME)
        if not store.remote and not store.exists(meta_path):
            raise CheckpointNotFoundError(f"{store.root}: no {METADATA_NAME} (not a DCP checkpoint)", path=store.root)
        meta = read_dcp_metadata(meta_path, store.read_small(meta_path, MAX_METADATA_BYTES, "DCP metadata"))
        heads: dict[str, tuple[int, object, _Pages | None]] = {}
        try:
            tensors = {k: _tensor_info(store, meta, meta_path, t, heads) for k, t in meta.tensors.items()}
        finally:
            for _, _, pages in heads.values():
                if pages is not None:
                    pages.close()
        checkpoint = cls(tensors, None, None, {f: identity for f, (_, identity, _) in heads.items()}, store)
        checkpoint.byte_items = meta.byte_items
        checkpoint.opened_pages = {f: frozenset(p.pages) for f, (_, _, p) in heads.items() if p is not None}
        return checkpoint

    def __repr__(self) -> str:
        return f"DcpCheckpoint({redact_url(self.root)!r}, files={len(self.files)}, tensors={len(self.tensors)})"
