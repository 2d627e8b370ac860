"""A torch.distributed.checkpoint (DCP) folder as a source: ``.metadata`` plus the ``__<rank>_<n>.distcp`` files
``dcp.save`` (``FileSystemWriter``) writes, known from the metadata and each needed chunk's zip records and pickle.

Each chunk of a key is one ``torch.save`` blob (a zip archive) at ``[offset, offset + length)`` of its file, as
``FileSystemWriter`` writes tensors, and becomes a :class:`~.chunks.Chunk` at the absolute place of its storage
bytes: a key of several chunks is a cat of chunk sources, so each rank reads only the sub-boxes of chunks it needs.
Opening reads the metadata and each file's size and identity, and refuses what they tell: a chunk written through
transforms, chunks that do not tile their key, a blob outside its file. A chunk's place is found when it is first
needed (:mod:`.dcp_places`): its blob's records are read by range inside its span (:mod:`.ziparchive`, offsets
relative to the blob), its pickle by :mod:`.torchzip`'s allow-list, and a blob that is not such an archive, a
tensor of another dtype or shape than the metadata says, a non-contiguous view is refused then, before a byte of
it is read. Each refusal is a :class:`~loader.errors.CheckpointError` naming the file and the key. A rank opens no
blob it needs nothing of.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping

from ..errors import CheckpointNotFoundError, redact_url
from ..options import StorageOptions
from ..storage import LocalStore, Store, is_url, open_store
from ..storage.untrusted import err, short
from .chunks import PLAIN, Chunk, StoredTensorInfo, TensorInfo
from .dcp_metadata import DcpMetadata, DcpTensor, dcp_storage, read_dcp_metadata
from .dcp_places import ChunkPlaces, ChunkSpec, DcpChunk, DcpTensorInfo
from .protocol import TableCheckpoint

METADATA_NAME = ".metadata"
#: a ``.metadata`` larger than this is refused before it is read
MAX_METADATA_BYTES = 256 << 20
#: the file names a ``storage_data`` entry may give: a plain name in the folder
_FILE_NAME = re.compile(r"[^/\\\0]+")


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


def _tensor_info(store: Store, meta: DcpMetadata, meta_path: str, tensor: DcpTensor, places: ChunkPlaces) -> TensorInfo:
    """The key's :class:`~.chunks.TensorInfo` from the metadata alone: its chunks checked to tile it and their
    blobs to lie inside their files, their places found when first read (:mod:`.dcp_places`)."""
    specs, heads = [], places.heads
    for c in tensor.chunks:
        place = dcp_storage(meta, meta_path, tensor.key, c.offsets)
        location = _file(store, meta_path, tensor.key, place.relative_path)
        if location not in heads:
            if not store.remote and not store.exists(location):
                raise err(meta_path, f"names missing file {location}", tensor.key)
            found = store.head(location, 0)
            heads[location] = (found.size, found.identity)
        if place.offset + place.length > heads[location][0]:
            where = f"chunk blob [{place.offset}, {place.offset + place.length})"
            raise err(location, f"{where} lies outside the file ({heads[location][0]} bytes)", tensor.key)
        box = tuple((a, a + n) for a, n in zip(c.offsets, c.sizes))
        specs.append((box, ChunkSpec(tensor.key, location, place, (tensor.dtype, c.sizes), places)))
    # tiling checked on the boxes alone (no place is read): a key of one chunk of its whole shape is a plain info
    checked = TensorInfo.of_chunks(tensor.key, tensor.dtype, tensor.size, [Chunk(b, s.location, 0) for b, s in specs])
    if not checked.split and checked.encoding == PLAIN:
        return DcpTensorInfo(tensor.key, tensor.dtype, tensor.size, specs[0][1])
    chunks = [DcpChunk(b, s) for b, s in specs]
    return StoredTensorInfo(tensor.key, None, tensor.dtype, tensor.size, None, None, PLAIN, tuple(chunks))


class DcpCheckpoint(TableCheckpoint):
    """A DCP checkpoint folder (``.metadata`` and ``*.distcp``): the :class:`~.protocol.Checkpoint` whose keys are
    stored as the chunks ``dcp.save`` wrote (plain encoding). Attributes as
    :class:`~.folder.SafetensorsCheckpoint`'s (``metadata`` ``{}`` per file; ``identities`` each ``.distcp``
    file's as it was found when opened: every blob read later is checked against it); :attr:`byte_items` the fqns
    of non-tensor items (not loaded).

    A chunk's place is found when it is first looked up (``checkpoint[source]``, its ``offset``, a one-chunk key's
    ``data_start``) or asked for (:meth:`resolve`), its blob's records and pickle read and checked then
    (:mod:`.dcp_places`): a rank reads nothing of a blob it needs nothing of."""

    byte_items: tuple[str, ...] = ()
    places: ChunkPlaces

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        storage: StorageOptions | None = None,
        identities: Mapping[str, object] | None = None,
    ) -> DcpCheckpoint:
        """Open a DCP folder (or its ``.metadata``; a local path or a URL), reading its metadata and each file's
        size and identity (no blob: each chunk's is read when its place is first needed).

        Raises:
            CheckpointNotFoundError: no folder with a ``.metadata`` there.
            CheckpointError: the metadata is malformed or refused (:mod:`.dcp_metadata`), a chunk's blob lies
                outside its file, or the chunks do not tile their key, naming the file and the key.
        """
        store = _store(path, storage or StorageOptions())
        if identities and store.remote:
            store.pin(identities)  # type: ignore[attr-defined]
        meta_path = store.locate(METADATA_NAME)
        if not store.remote and not store.exists(meta_path):
            raise CheckpointNotFoundError(f"{store.root}: no {METADATA_NAME} (not a DCP checkpoint)", path=store.root)
        meta = read_dcp_metadata(meta_path, store.read_small(meta_path, MAX_METADATA_BYTES, "DCP metadata"))
        places = ChunkPlaces(store, {})
        tensors = {k: _tensor_info(store, meta, meta_path, t, places) for k, t in meta.tensors.items()}
        checkpoint = cls(tensors, None, None, {f: identity for f, (_, identity) in places.heads.items()}, store)
        checkpoint.byte_items = meta.byte_items
        checkpoint.places = places
        return checkpoint

    def __getitem__(self, name: str) -> TensorInfo:
        """A key's :class:`~.chunks.TensorInfo` (a key of one chunk: its place found now), or a chunk source's
        (its place found now).

        Raises:
            KeyError: no such key or chunk source.
            CheckpointError: the chunk's blob is refused (:mod:`.dcp_places`), naming the file and the key.
        """
        info = super().__getitem__(name)
        if isinstance(info, DcpTensorInfo):
            _ = info.data_start  # found and checked before the info is used
        return info

    def resolve(self, names: Iterable[str]) -> None:
        """Find the places of the sources ``names`` (keys or chunk sources; a key of several chunks: all of them)
        now, so that a blob is refused before a byte is read.

        Raises:
            KeyError: a name that is neither a key nor a chunk source.
            CheckpointError: a blob is refused, naming the file and the key.
        """
        for name in names:
            info = self.tensors.get(name)
            if info is not None and info.split:
                for c in info.split:
                    _ = c.offset
            else:
                _ = self[name]

    @property
    def opened_pages(self) -> Mapping[str, frozenset[int]]:
        """The pages (``offset // PAGE``) of each local file read so far to find chunks' places (none remotely,
        none at open): the pages at the boundaries of the blobs looked up (:mod:`.dcp_places`)."""
        return {f: frozenset(p) for f, p in self.places.pages_read.items()}

    def __repr__(self) -> str:
        return f"DcpCheckpoint({redact_url(self.root)!r}, files={len(self.files)}, tensors={len(self.tensors)})"
