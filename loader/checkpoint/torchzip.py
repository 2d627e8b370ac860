"""A ``torch.save`` file (the zip format, ``pytorch_model.bin``), known from its pickle and zip records only.

Vocabulary: the archive holds ``<archive>/data.pkl`` (the pickled state dict), ``<archive>/byteorder`` and one
record ``<archive>/data/<key>`` per *storage* (the bytes tensors view). The pickle is read by
:func:`~.pickles.read_pickle` with :data:`TORCH_GLOBALS` alone: each tensor becomes a :class:`TensorRecord`
(its storage, dtype, offset, size, stride), each storage a :class:`StorageRecord` (its key, dtype and element
count), and nothing is imported or run. A tensor must be a contiguous row-major view inside its storage, whose
record holds at least the storage's bytes; it then becomes a :class:`~.chunks.TensorInfo` whose one chunk is the
view's bytes inside the record, so the planner reads only the bytes each rank needs, as from a safetensors file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..storage import LocalStore, ObjectIdentity, Store
from ..storage.untrusted import err, short
from .chunks import TensorInfo
from .header import DTYPES, HeaderFile
from .pickles import Global, read_pickle
from .ziparchive import Record, read_records

#: a ``data.pkl`` larger than this is refused before it is read (a large model's is well under 1 MiB)
MAX_PICKLE_BYTES = 64 << 20
#: the first bytes a remote file's identity is bound to, at most: its ``data.pkl`` where it comes first
MAX_BOUND_HEAD = 4 << 20
#: a remote file's first request: the local header and pickle of a small checkpoint
REMOTE_HEAD_BYTES = 64 << 10
_STORAGE_DTYPES = {
    "DoubleStorage": torch.float64, "FloatStorage": torch.float32, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "ComplexFloatStorage": torch.complex64,
}  # fmt: skip
#: the dtypes a tensor may have (those a safetensors file may hold)
_READ_DTYPES = frozenset(DTYPES.values())


@dataclass(frozen=True)
class StorageType:
    """A storage class a pickle names (``torch.FloatStorage``, ``torch.UntypedStorage``): the dtype of its
    elements (``torch.uint8`` for untyped bytes)."""

    name: str
    dtype: torch.dtype


@dataclass(frozen=True)
class StorageRecord:
    """A storage a pickle's persistent id names: its record key, element dtype and element count."""

    key: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        """Bytes the storage holds."""
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class TensorRecord:
    """A tensor a pickle rebuilds: a view of ``storage`` (elements of ``dtype`` from ``offset``, with ``size`` and
    ``stride``)."""

    storage: StorageRecord
    dtype: torch.dtype
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class StateDict(dict):
    """A pickled ``OrderedDict`` (a state dict): its items, and the attributes a ``BUILD`` gave it (``_metadata``)."""

    def __setstate__(self, state: Any) -> None:
        self.attributes = state


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise ValueError(f"{what} {short.repr(value)} is not a tuple of non-negative ints")
    return value


def _tensor(storage: object, offset: object, size: object, stride: object, dtype: torch.dtype | None) -> TensorRecord:
    if not isinstance(storage, StorageRecord):
        raise ValueError(f"tensor storage {short.repr(storage)} is not a storage the pickle named")
    if type(offset) is not int or offset < 0:
        raise ValueError(f"storage offset {short.repr(offset)} is not a non-negative int")
    size, stride = _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride):
        raise ValueError(f"size {size} and stride {stride} differ in length")
    return TensorRecord(storage, storage.dtype if dtype is None else dtype, offset, size, stride)


def _rebuild_v2(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None) -> TensorRecord:
    """``torch._utils._rebuild_tensor_v2``: a tensor of its storage's dtype."""
    return _tensor(storage, offset, size, stride, None)


def _rebuild_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None) -> TensorRecord:
    """``torch._utils._rebuild_tensor_v3``: a tensor of the dtype it names, on untyped bytes."""
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype {short.repr(dtype)} is not a torch dtype")
    return _tensor(storage, offset, size, stride, dtype)


def _parameter(data, requires_grad=False, hooks=None, state=None) -> TensorRecord:
    """``torch._utils._rebuild_parameter(_with_state)``: a parameter is read as its tensor."""
    if not isinstance(data, TensorRecord):
        raise ValueError(f"parameter data {short.repr(data)} is not a tensor")
    return data


def _torch_globals() -> dict[Global, Any]:
    allowed: dict[Global, Any] = {
        ("collections", "OrderedDict"): StateDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_v3,
        ("torch._utils", "_rebuild_parameter"): _parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _parameter,
        ("torch", "UntypedStorage"): StorageType("UntypedStorage", torch.uint8),
        ("torch.storage", "UntypedStorage"): StorageType("UntypedStorage", torch.uint8),
    }
    allowed.update({("torch", n): StorageType(n, d) for n, d in _STORAGE_DTYPES.items()})
    allowed.update({("torch", str(d).removeprefix("torch.")): d for d in DTYPES.values()})
    return allowed


#: the globals a ``torch.save`` pickle may name, and what each stands for
TORCH_GLOBALS: dict[Global, Any] = _torch_globals()


def storages(path: str, records: dict[str, Record], prefix: str) -> Callable[[Any], StorageRecord]:
    """The ``persistent_load`` of a file's pickle: ``('storage', type, key, location, numel)`` to its record."""
    seen: dict[str, StorageRecord] = {}

    def persistent_load(pid: Any) -> StorageRecord:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise err(path, f"persistent id {short.repr(pid)} is not ('storage', type, key, location, numel)")
        _, kind, key, _, numel = pid
        if not isinstance(kind, StorageType) or not isinstance(key, str) or type(numel) is not int or numel < 0:
            raise err(path, f"persistent id {short.repr(pid)} is not ('storage', type, key, location, numel)")
        storage = StorageRecord(key, kind.dtype, numel)
        if seen.setdefault(key, storage) != storage:
            raise err(path, f"storage {key!r} is named as {seen[key]} and as {storage}")
        name = f"{prefix}data/{key}"
        record = records.get(name)
        if record is None:
            raise err(path, f"the pickle names storage {key!r}, but the archive has no record {name!r}")
        if record.size < storage.nbytes:
            raise err(path, f"record {name!r} holds {record.size} bytes, fewer than its storage's {storage.nbytes}")
        return storage

    return persistent_load


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expected = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def tensor_info(path: str, key: str, tensor: object, records: dict[str, Record], prefix: str) -> TensorInfo:
    """The :class:`TensorInfo` of the state dict's entry ``key``: its view's bytes inside its storage's record.

    Raises:
        CheckpointError: not a tensor, a dtype the loader does not read, a view that is not contiguous row-major or
            runs past its storage.
    """
    if not isinstance(tensor, TensorRecord):
        raise err(path, f"state dict entry is {short.repr(tensor)}, not a tensor", key)
    storage, dtype, numel = tensor.storage, tensor.dtype, math.prod(tensor.size)
    if dtype not in _READ_DTYPES:
        raise err(path, f"dtype {dtype} is not one the loader reads (supported: {sorted(map(str, _READ_DTYPES))})", key)
    if numel and not _contiguous(tensor.size, tensor.stride):
        view = f"size {tensor.size}, stride {tensor.stride}"
        raise err(
            path, f"is a non-contiguous view ({view}) of storage {storage.key!r}: only row-major views are read", key
        )
    start, nbytes = tensor.offset * dtype.itemsize, numel * dtype.itemsize
    if numel and start + nbytes > storage.nbytes:
        span = f"bytes [{start}, {start + nbytes})"
        raise err(path, f"view {span} runs past its storage {storage.key!r} ({storage.nbytes} bytes)", key)
    record = records[f"{prefix}data/{storage.key}"]
    begin = record.data_start + (start if numel else 0)
    return TensorInfo(key, path, dtype, tuple(tensor.size), begin, begin + nbytes)


def _prefix(path: str, records: dict[str, Record]) -> str:
    """``<archive>/``: the folder of the archive's one ``data.pkl``."""
    found = [n for n in records if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(found) != 1:
        what = f"{len(found)} of them ({', '.join(map(repr, found[:3]))})" if found else "none"
        raise err(path, f"not a torch.save archive: wants one '<archive>/data.pkl' record, holds {what}")
    return found[0].removesuffix("data.pkl")


def _byteorder(path: str, store: Store, records: dict[str, Record], prefix: str, identity: object) -> None:
    record = records.get(f"{prefix}byteorder")
    if record is None:
        return  # written since torch 1.9; before, always little-endian
    order = store.read_range(path, record.data_start, record.data_end, identity) if record.size <= 16 else b"?"
    if order != b"little":
        raise err(path, f"record {prefix}byteorder says {short.repr(order)}: only little-endian files are read")


def read_torch_file(path: str, store: Store | None = None) -> HeaderFile:
    """Read and validate one ``torch.save`` zip file's records and pickle (no tensor data is read).

    Args:
        path: The file's location (a path or a URL of ``store``); stored as given in :attr:`TensorInfo.file`.
        store: The store it is in; default: the local folder holding ``path``.

    Returns:
        The tensors (in the state dict's order), ``{}`` as metadata, and the file's identity.

    Raises:
        CheckpointError: not a zip archive or one :mod:`.ziparchive` refuses; a pickle naming anything but
            :data:`TORCH_GLOBALS`; a storage record smaller than its storage; a tensor view that is not row-major
            inside its storage; a dtype the loader does not read; a state dict that is not ``{key: tensor}``.
    """
    store = store if store is not None else LocalStore(os.path.dirname(path) or ".")
    head = store.head(path, REMOTE_HEAD_BYTES if store.remote else 0)
    records = read_records(path, store, head.size, head.identity)
    prefix = _prefix(path, records)
    pickle = records[f"{prefix}data.pkl"]
    if pickle.size > MAX_PICKLE_BYTES:
        raise err(path, f"record {prefix}data.pkl of {pickle.size} bytes exceeds the {MAX_PICKLE_BYTES}-byte limit")
    _byteorder(path, store, records, prefix, head.identity)
    data = store.read_range(path, pickle.data_start, pickle.data_end, head.identity)
    state = read_pickle(data, allowed=TORCH_GLOBALS, persistent_load=storages(path, records, prefix), name=path)
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise err(path, f"{prefix}data.pkl holds {type(state).__name__}, not a state dict of str keys to tensors")
    tensors = {k: tensor_info(path, k, t, records, prefix) for k, t in state.items()}
    identity = head.identity
    if isinstance(identity, ObjectIdentity) and pickle.header == 0 and pickle.data_end <= MAX_BOUND_HEAD:
        first = store.read_range(path, 0, pickle.data_end, identity)
        identity = identity.with_head(first)  # bound to the pickle as read: checked again by the last request
    return HeaderFile(tensors, {}, identity)
