"""What a checkpoint is to the loader: the :class:`Checkpoint` protocol every format implements.

Vocabulary: a **checkpoint** maps each *key* to its :class:`~.chunks.TensorInfo` (dtype, shape, encoding,
chunks) and says where its bytes are (``store``, ``files``, each file's ``identity`` as it was found); a compiled
block reads a *source* (a key, or one chunk of a key stored in several: :mod:`.chunks`), which ``checkpoint[name]``
resolves as well. Formats implement it: the safetensors file or folder
(:class:`~.folder.SafetensorsCheckpoint`), the save's and the transfer's stand-in without bytes
(:class:`~loader.plan.traces.StandInCheckpoint`), and a new one (a DCP checkpoint, several chunks per key) by
subclassing :class:`TableCheckpoint` with its tensor table, or by providing the members below.
"""

from __future__ import annotations

from collections.abc import Iterator, KeysView, Mapping
from typing import Protocol, runtime_checkable

from ..storage import RangeReader, Store, open_reader
from .chunks import TensorInfo, chunk_source, source_info


@runtime_checkable
class Checkpoint(Protocol):
    """A checkpoint the loader plans against and reads: a read-only mapping key -> :class:`TensorInfo`.

    Attributes:
        root: Its folder (a path or URL; ``""`` when it has none).
        files: The locations its chunks are in, in order.
        tensors: ``{key: TensorInfo}``, in checkpoint order.
        metadata: ``{file: metadata dict}`` (``{}`` each when the format has none).
        identities: ``{file: identity}`` as each file was found (what reads are checked against); empty when
            none was recorded.
        store: Where the bytes are (None: a checkpoint without bytes).
    """

    root: str
    files: tuple[str, ...]
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, Mapping[str, str]]
    identities: Mapping[str, object]
    store: Store | None

    def reader(self, *, direct_io: bool = False) -> RangeReader:
        """A new reader of its files, told each file's identity."""
        ...

    def __getitem__(self, name: str) -> TensorInfo:
        """A key's :class:`TensorInfo`, or a chunk source's (:func:`~.chunks.chunk_source`)."""
        ...

    def __contains__(self, key: object) -> bool: ...

    def __iter__(self) -> Iterator[str]: ...

    def __len__(self) -> int: ...

    def keys(self) -> KeysView[str]: ...


class TableCheckpoint(Mapping[str, TensorInfo]):
    """A :class:`Checkpoint` from its tensor table: the mapping, source lookup and readers every format shares.

    Args:
        tensors: ``{key: TensorInfo}``; each info's ``key`` its mapping key.
        files: the locations its chunks are in; default: the infos' chunk locations in first-seen order.
        metadata: ``{file: metadata}``; default ``{}`` per file.
        identities: ``{file: identity}``; default none.
        store: where the bytes are.
        root: reported as :attr:`root`; default: the store's.
    """

    def __init__(
        self,
        tensors: dict[str, TensorInfo],
        files: tuple[str, ...] | None = None,
        metadata: dict[str, dict[str, str]] | None = None,
        identities: Mapping[str, object] | None = None,
        store: Store | None = None,
        root: str | None = None,
    ) -> None:
        self.store = store
        self.root = root if root is not None else (store.root if store is not None else "")
        self.tensors = tensors
        self.files = tuple(files) if files is not None else chunk_files(tensors)
        self.metadata = metadata if metadata is not None else {f: {} for f in self.files}
        self.identities: dict[str, object] = dict(identities or {})
        self._sources: dict[str, TensorInfo] = {}

    def reader(self, *, direct_io: bool = False) -> RangeReader:
        """A new :class:`~loader.storage.RangeReader` of this checkpoint's files, told each file's identity.

        Raises:
            ValueError: the checkpoint has no bytes (no store).
        """
        if self.store is None:
            raise ValueError(f"{self!r} holds no bytes to read (no store)")
        return open_reader(self.store, self.identities, direct_io=direct_io)

    def __getitem__(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            return source_info(self.tensors, name, self._sources)

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self) -> KeysView[str]:
        """Tensor keys, in checkpoint order."""
        return self.tensors.keys()

    def sources(self) -> Iterator[TensorInfo]:
        """Every source's :class:`TensorInfo` (one chunk each): a key stored in one chunk, else its chunks'."""
        for info in self.tensors.values():
            if info.split:
                yield from (self[chunk_source(info.key, j)] for j in range(len(info.split)))
            else:
                yield info

    @property
    def total_bytes(self) -> int:
        """Sum of all tensors' data bytes."""
        return sum(info.nbytes for info in self.tensors.values())

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.root!r}, files={len(self.files)}, tensors={len(self.tensors)})"


def chunk_files(tensors: Mapping[str, TensorInfo]) -> tuple[str, ...]:
    """The locations the tensors' chunks are in, in first-seen order."""
    files: dict[str, None] = {}
    for info in tensors.values():
        if info.split:
            files.update((c.location, None) for c in info.split)
        elif info.file is not None:
            files[info.file] = None
    return tuple(files)
