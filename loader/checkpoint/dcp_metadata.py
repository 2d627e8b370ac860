"""A torch.distributed.checkpoint (DCP) ``.metadata`` file read without unpickling it: its pickle is run by
:func:`~.pickles.read_pickle` with :data:`DCP_GLOBALS` alone (torch's metadata records become
:class:`~.pickles.PickledObject` records; nothing is imported or run), then checked into plain tables.

Vocabulary: DCP's ``Metadata`` maps each *fqn* (a key) to a ``TensorStorageMetadata`` (dtype, size, and its
*chunks*: ``offsets`` and ``sizes`` per dim) or a ``BytesStorageMetadata`` (bytes, not a tensor); its
``storage_data`` maps each ``MetadataIndex`` (fqn, chunk offsets) to a ``_StorageInfo``: the file
(``relative_path``) and the byte span (``offset``, ``length``) the chunk's ``torch.save`` blob is written at.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..storage.untrusted import err, short
from .header import DTYPES
from .pickles import Global, PickledObject, as_object, read_pickle

_MD = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
#: the records a ``.metadata`` pickle builds (NEWOBJ, then BUILD with its state)
_RECORDS: tuple[Global, ...] = (
    (_MD, "Metadata"),
    (_MD, "TensorStorageMetadata"),
    (_MD, "BytesStorageMetadata"),
    (_MD, "ChunkStorageMetadata"),
    (_MD, "TensorProperties"),
    (_MD, "MetadataIndex"),
    (_MD, "StorageMeta"),
    (_FS, "_StorageInfo"),
)
_Offsets = tuple[int, ...]


def _size(*args: Any) -> tuple[int, ...]:
    """``torch.Size(dims)``: the dims, checked to be non-negative ints."""
    dims = args[0] if len(args) == 1 else None
    if not isinstance(dims, tuple) or not all(type(d) is int and d >= 0 for d in dims):
        raise ValueError(f"torch.Size{short.repr(args)} is not a tuple of non-negative ints")
    return dims


def _named(value: Any) -> Any:
    """A marker a record's state names (``_get_layout('torch.strided')``, ``_MEM_FORMAT_ENCODING(0)``): its value."""
    return value


def _path(*parts: Any) -> str:
    """``pathlib.PosixPath(*parts)`` (the checkpoint id a save recorded): its text."""
    return "/".join(str(p) for p in parts)


def _dcp_globals() -> dict[Global, Any]:
    allowed: dict[Global, Any] = {name: as_object(name) for name in _RECORDS}
    allowed[("torch", "Size")] = _size
    allowed[("torch.serialization", "_get_layout")] = _named
    allowed[(_MD, "_MEM_FORMAT_ENCODING")] = _named
    allowed.update({("pathlib", n): _path for n in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")})
    allowed.update({("torch", str(d).removeprefix("torch.")): d for d in DTYPES.values()})
    return allowed


#: the globals a ``.metadata`` pickle may name, and what each stands for
DCP_GLOBALS: dict[Global, Any] = _dcp_globals()


@dataclass(frozen=True)
class DcpChunk:
    """One chunk of a DCP tensor: its offsets and sizes per dim."""

    offsets: _Offsets
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class DcpTensor:
    """A DCP tensor: its fqn, dtype, size and chunks."""

    key: str
    dtype: torch.dtype
    size: tuple[int, ...]
    chunks: tuple[DcpChunk, ...]


@dataclass(frozen=True)
class DcpStorage:
    """Where a chunk's ``torch.save`` blob is: its file's name in the folder and its byte span there."""

    relative_path: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpMetadata:
    """A ``.metadata`` file's tables: ``tensors`` in its order, the fqns of its bytes items, and ``storage``
    ``{(fqn, chunk offsets): DcpStorage}``."""

    tensors: dict[str, DcpTensor]
    byte_items: tuple[str, ...]
    storage: dict[tuple[str, _Offsets], DcpStorage]


def _record(path: str, value: object, name: str, what: str, key: str | None = None) -> Any:
    """The state of ``value``, a record of ``(module, name)``'s class."""
    if not isinstance(value, PickledObject) or value.name[1] != name or value.args or value.kwargs:
        raise err(path, f"{what} is {short.repr(value)}, not a {name} record", key)
    return value.state


def _fields(path: str, state: object, fields: tuple[str, ...], what: str, key: str | None = None) -> tuple:
    if not isinstance(state, dict) or not all(f in state for f in fields):
        raise err(path, f"{what} state {short.repr(state)} lacks one of {fields}", key)
    return tuple(state[f] for f in fields)


def _ints(path: str, value: object, what: str, key: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise err(path, f"{what} {short.repr(value)} is not a tuple of non-negative ints", key)
    return value


def _tensor(path: str, key: str, state: object) -> DcpTensor:
    properties, size, chunks = _fields(path, state, ("properties", "size", "chunks"), "TensorStorageMetadata", key)
    props = _record(path, properties, "TensorProperties", "its properties", key)
    if not isinstance(props, tuple) or len(props) != 5:
        raise err(path, f"TensorProperties state {short.repr(props)} is not (dtype, layout, grad, format, pin)", key)
    dtype, layout = props[0], props[1]
    if dtype not in DTYPES.values():
        raise err(path, f"dtype {short.repr(dtype)} is not one the loader reads", key)
    if layout != "torch.strided":
        raise err(path, f"layout {short.repr(layout)} is not torch.strided", key)
    size = _ints(path, size, "size", key)
    if not isinstance(chunks, list):
        raise err(path, f"chunks {short.repr(chunks)} is not a list", key)
    out = []
    for chunk in chunks:
        offsets, sizes = _fields(
            path, _record(path, chunk, "ChunkStorageMetadata", "a chunk", key), ("offsets", "sizes"), "chunk", key
        )
        offsets, sizes = _ints(path, offsets, "chunk offsets", key), _ints(path, sizes, "chunk sizes", key)
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise err(
                path, f"chunk offsets {offsets} and sizes {sizes} do not have the {len(size)} dims of {size}", key
            )
        out.append(DcpChunk(offsets, sizes))
    return DcpTensor(key, dtype, size, tuple(out))


def _storage(path: str, index: object, info: object) -> tuple[tuple[str, _Offsets], DcpStorage]:
    key_state = _record(path, index, "MetadataIndex", "a storage_data key")
    (fqn,) = _fields(path, key_state, ("fqn",), "MetadataIndex")
    offset = key_state.get("offset")  # a non-tensor item's key (a step, a dict) is pickled without one
    if not isinstance(fqn, str):
        raise err(path, f"storage_data key fqn {short.repr(fqn)} is not a str")
    offsets = () if offset is None else _ints(path, offset, "storage_data offsets", fqn)
    state = _record(path, info, "_StorageInfo", "a storage_data value", fqn)
    rel, start, length = _fields(path, state, ("relative_path", "offset", "length"), "_StorageInfo", fqn)
    if state.get("transform_descriptors"):
        what = short.repr(state["transform_descriptors"])
        raise err(
            path, f"chunk at {offsets} is written through transforms {what} (compressed?): not read in place", fqn
        )
    if not isinstance(rel, str) or type(start) is not int or type(length) is not int or start < 0 or length < 0:
        raise err(path, f"storage {short.repr((rel, start, length))} is not (file name, offset, length)", fqn)
    return (fqn, offsets), DcpStorage(rel, start, length)


def read_dcp_metadata(path: str, data: bytes) -> DcpMetadata:
    """The tables of the ``.metadata`` pickle ``data`` (read from ``path``).

    Raises:
        CheckpointError: a global off :data:`DCP_GLOBALS` or an opcode :func:`~.pickles.read_pickle` refuses; a
            record not of the shape torch writes; a dtype the loader does not read; a chunk written through
            transforms (a compressing extension).
    """
    top = read_pickle(data, allowed=DCP_GLOBALS, name=path)
    sd_meta, storage_data = _fields(
        path, _record(path, top, "Metadata", "the pickle"), ("state_dict_metadata", "storage_data"), "Metadata"
    )
    if not isinstance(sd_meta, dict) or not isinstance(storage_data, dict):
        raise err(path, "state_dict_metadata and storage_data must be dicts")
    tensors: dict[str, DcpTensor] = {}
    byte_items: list[str] = []
    for key, item in sd_meta.items():
        if not isinstance(key, str):
            raise err(path, f"state_dict_metadata key {short.repr(key)} is not a str")
        if isinstance(item, PickledObject) and item.name[1] == "BytesStorageMetadata":
            byte_items.append(key)
            continue
        tensors[key] = _tensor(path, key, _record(path, item, "TensorStorageMetadata", "its metadata", key))
    storage: dict[tuple[str, _Offsets], DcpStorage] = {}
    for index, info in storage_data.items():
        where, place = _storage(path, index, info)
        storage[where] = place
    return DcpMetadata(tensors, tuple(byte_items), storage)


def dcp_storage(meta: DcpMetadata, path: str, key: str, offsets: _Offsets) -> DcpStorage:
    """Where chunk ``offsets`` of ``key`` is stored.

    Raises:
        CheckpointError: ``storage_data`` has no entry for it.
    """
    found = meta.storage.get((key, offsets))
    if found is None:
        raise err(path, f"storage_data has no entry for the chunk at offsets {offsets}", key)
    return found
