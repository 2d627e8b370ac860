"""The safetensors file format: dtypes, one tensor's place on disk, and header parsing and validation.

Vocabulary: a *header* is the JSON object after the 8-byte length prefix; each *entry* gives a tensor's
``dtype``, ``shape`` and ``data_offsets`` relative to the *data section* that follows the header. A file's
*identity* (device, inode, size, mtime, ctime) is recorded when its header is read, so later reads can tell the
file changed underneath.

Files are read through a :class:`~loader.storage.Store` (locally: regular files only, never blocking). Parsing is
linear in the header size: entries are validated as the JSON parser builds them, so the parsed header never exists as
dicts, the usual in-order layout is checked in the same pass, and each parsed entry is freed as soon as it
becomes a :class:`TensorInfo` (``bench/header_bench.py`` measures time and memory).
"""

from __future__ import annotations

import os
import struct
from operator import attrgetter
from typing import NamedTuple

import torch

from ..storage import FileIdentity, LocalStore, ObjectIdentity, Store
from ..storage.untrusted import DuplicateKeyError, err, gc_paused, loads_json, short, strict_dict
from .chunks import TensorInfo

MAX_HEADER_BYTES = 100_000_000  # same limit as the safetensors reference implementation
_MAX_FAST_NDIM = 64  # longer shapes take the careful path (bounded products)

_DTYPE_NAMES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
    "U64": "uint64", "U32": "uint32", "U16": "uint16", "U8": "uint8", "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}  # fmt: skip
#: safetensors dtype string -> torch dtype, for the dtypes this torch build has. Sub-byte types (F4, F6_*)
#: are not supported: their header shape counts packed elements, which torch shapes do not.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr) for name, attr in _DTYPE_NAMES.items() if hasattr(torch, attr)
}
_ITEMSIZES = {name: dtype.itemsize for name, dtype in DTYPES.items()}


class HeaderFile(NamedTuple):
    """One file's header, as :func:`read_header_file` read it.

    Attributes:
        tensors: ``{key: TensorInfo}`` in header order.
        metadata: The ``__metadata__`` dict (``{}`` if absent).
        identity: The file's identity as its header was read (:class:`~loader.storage.FileIdentity` from the
            ``fstat`` of the descriptor the header was read through, or a remote object's ETag and size).
    """

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    identity: FileIdentity | ObjectIdentity


# ----------------------------------------------------------------------------------------------- entries


class _Object(list):
    """A JSON object as parsed, kept as its ``(key, value)`` pairs so that duplicate keys can be found."""

    __slots__ = ()


def _json_type(value: object) -> str:
    if isinstance(value, (_Object, dict, tuple)):
        return "object"
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _header_hook(pairs: list[tuple[str, object]]) -> object:
    """Turn a well-formed entry into ``(dtype, shape, begin, end)`` as soon as it is parsed.

    Anything else (metadata, a malformed or unusual entry) stays an :class:`_Object` for
    :func:`_parse_entry`, which gives the precise error or accepts it.
    """
    if len(pairs) == 3:
        d = dict(pairs)
        try:
            name, shape, (begin, end) = d["dtype"], d["shape"], d["data_offsets"]
            dtype = DTYPES[name]
        except (KeyError, TypeError, ValueError):
            return _Object(pairs)
        if type(shape) is list and len(shape) <= _MAX_FAST_NDIM and type(begin) is int and type(end) is int:
            numel = 1
            for dim in shape:
                if type(dim) is not int or dim < 0:
                    return _Object(pairs)
                numel *= dim
            if 0 <= begin <= end and end - begin == numel * dtype.itemsize:
                return (dtype, tuple(shape), begin, end)
    return _Object(pairs)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _nbytes_at_most(shape: list[int], itemsize: int, limit: int) -> int:
    """``prod(shape) * itemsize``, or any value above ``limit`` once it is known to exceed it."""
    if 0 in shape:
        return 0
    n = itemsize
    for dim in shape:
        n *= dim
        if n > limit:
            return n
    return n


def _parse_entry(path: str, key: str, entry: object) -> tuple[torch.dtype, tuple[int, ...], int, int]:
    """Validate an entry the fast path did not take; return what :func:`_header_hook` would have."""
    if not isinstance(entry, _Object):
        raise err(path, f"header entry must be a JSON object, got {_json_type(entry)}", key)
    try:
        fields = strict_dict(entry)
    except DuplicateKeyError as e:
        raise err(path, f"header entry: {e}", key) from None
    for field in ("dtype", "shape", "data_offsets"):
        if field not in fields:
            raise err(path, f"header entry is missing {field!r}", key)
    name, shape, offsets = fields["dtype"], fields["shape"], fields["data_offsets"]
    if not isinstance(name, str):
        raise err(path, f"dtype must be a string, got {short.repr(name)}", key)
    if name not in DTYPES:
        raise err(path, f"unknown or unsupported dtype {short.repr(name)} (supported: {sorted(DTYPES)})", key)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise err(path, f"shape must be a list of non-negative ints, got {short.repr(shape)}", key)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise err(path, f"data_offsets must be [begin, end] ints, got {short.repr(offsets)}", key)
    begin, end = offsets
    if not (0 <= begin <= end):
        raise err(path, f"data_offsets must satisfy 0 <= begin <= end, got {offsets!r}", key)
    span = end - begin
    limit = max(span, 1 << 64)  # exact for any real size; a hostile shape cannot grow a huge product
    needs = _nbytes_at_most(shape, _ITEMSIZES[name], limit)
    if needs != span:
        amount = f"more than {limit}" if needs > limit else str(needs)
        raise err(path, f"data_offsets span {span} bytes but {name}{short.repr(shape)} needs {amount}", key)
    return DTYPES[name], tuple(shape), begin, end


def _metadata(path: str, value: object) -> dict[str, str]:
    if value is None:
        return {}
    if isinstance(value, _Object):
        try:
            meta = strict_dict(value)
        except DuplicateKeyError as e:
            raise err(path, f"__metadata__: {e}") from None
        bad = next((k for k, v in meta.items() if not isinstance(v, str)), None)
        if bad is None:
            return meta  # type: ignore[return-value]
        got = f"{short.repr(bad)} maps to JSON {_json_type(meta[bad])}"
    else:
        got = f"got JSON {_json_type(value)}"
    raise err(path, f"__metadata__ must map strings to strings; {got}")


def _check_tiling(path: str, tensors: dict[str, TensorInfo], data_base: int, data_size: int) -> None:
    """The tensors' byte ranges must tile the data section exactly, as the safetensors library requires.

    Sorted by ``(begin, end)``, each range begins where the previous one ended, the first at 0 and the last
    ends at the data section's end: no overlap, no gap, no trailing bytes. Empty tensors may sit at any
    boundary.
    """
    pos, holder = data_base, None
    for info in sorted(tensors.values(), key=attrgetter("data_start", "data_end")):
        begin, end = info.data_start - data_base, info.data_end - data_base
        if info.data_start < pos:
            other = short.repr(holder.key if holder is not None else None)
            what = f"byte range [{begin}, {end}) overlaps" if end > begin else f"empty tensor at {begin} lies inside"
            raise err(path, f"{what} that of tensor {other}", info.key)
        if info.data_start > pos:
            msg = f"gap before it: data section bytes [{pos - data_base}, {begin}) belong to no tensor"
            raise err(path, msg, info.key)
        if end > begin:
            pos, holder = info.data_end, info
    if pos != data_base + data_size:
        covered = pos - data_base
        msg = f"{data_size - covered} trailing bytes: tensors cover {covered} of the {data_size}-byte data section"
        raise err(path, msg)


def parse_header(path: str, raw: bytes, data_base: int, data_size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate a header's JSON bytes.

    Args:
        path: The file, stored in :attr:`TensorInfo.file` and named in errors.
        raw: The header bytes (after the 8-byte length).
        data_base: Absolute offset of the data section (``8 + len(raw)``).
        data_size: Bytes in the data section.

    Returns:
        ``(tensors, metadata)`` as :func:`read_header`.

    Raises:
        CheckpointError: The JSON or an entry is malformed, or the entries do not tile the data section.
    """
    top = loads_json(path, raw, "header", hook=_header_hook)
    if not isinstance(top, _Object):
        raise err(path, f"header must be a JSON object, got {_json_type(top)}")
    tensors: dict[str, TensorInfo] = {}
    metadata: object = None
    seen_metadata = False
    pos = 0  # where the data covered so far ends, while the entries come in file order (they usually do)
    with gc_paused():
        for i, (key, value) in enumerate(top):
            top[i] = None  # free each parsed entry as soon as it is converted: peak memory stays near one copy
            if key in tensors or (key == "__metadata__" and seen_metadata):
                raise err(path, f"duplicate JSON key {short.repr(key)} in the header")
            if key == "__metadata__":
                metadata, seen_metadata = value, True
                continue
            dtype, shape, begin, end = value if type(value) is tuple else _parse_entry(path, key, value)
            if end > data_size:
                msg = f"data_offsets [{begin}, {end}] run past the data section ({data_size} bytes)"
                raise err(path, msg, key)
            pos = end if begin == pos else -1
            tensors[key] = TensorInfo(key, path, dtype, shape, data_base + begin, data_base + end)
        if pos != data_size:  # out of order, or a gap, overlap or trailing bytes: sort to tell which
            _check_tiling(path, tensors, data_base, data_size)
    return tensors, _metadata(path, metadata)


# ----------------------------------------------------------------------------------------------- files


#: bytes of a remote object's first request: the length and the header of small files (a few dozen tensors), and
#: little else a rank may not want; a longer header costs a second request of exactly its remaining bytes
REMOTE_HEAD_BYTES = 4 << 10


def read_header_file(path: str, store: Store | None = None) -> HeaderFile:
    """Read and validate the header of one safetensors file (no tensor data is read), with its identity.

    Locally the 8-byte length is read, then the header; remotely the first :data:`REMOTE_HEAD_BYTES` in one
    request (which also tells the size and identity: no ``HEAD``), and exactly the rest of a longer header in a
    second; the store keeps the first request's bytes, so the data bytes it held are not fetched again.

    Args:
        path: The file's location (a path, symlinks followed, or a URL of ``store``); stored as given in
            :attr:`TensorInfo.file`.
        store: The store it is in; default: the local folder holding ``path``.

    Returns:
        The tensors, metadata and the identity of the file the header was read from.

    Raises:
        CheckpointError: The file cannot be opened or is not a regular file, is truncated, the header is
            malformed, or its entries are inconsistent or do not tile the data section.
    """
    store = store if store is not None else LocalStore(os.path.dirname(path) or ".")
    head = store.head(path, REMOTE_HEAD_BYTES if store.remote else 8)
    size = head.size
    if size < 8:
        raise err(path, f"truncated: {size} bytes, too short for the 8-byte header length")
    (header_len,) = struct.unpack("<Q", head.data[:8])
    if header_len > size - 8:
        raise err(path, f"header length {header_len} runs past the end of the file ({size} bytes)")
    if header_len > MAX_HEADER_BYTES:
        raise err(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
    raw = head.data[8 : 8 + header_len]
    if len(raw) < header_len:
        raw += store.read_range(path, 8 + len(raw), 8 + header_len, head.identity)
    data_base = 8 + header_len
    tensors, metadata = parse_header(path, raw, data_base, size - data_base)
    identity = head.identity
    if isinstance(identity, ObjectIdentity):  # bound to the header as read: checked again by the last request
        identity = identity.with_head(head.data[:8] + raw)
    return HeaderFile(tensors, metadata, identity)


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Read and validate the header of one safetensors file (no tensor data is read).

    Args:
        path: Path of the ``.safetensors`` file; stored as given in :attr:`TensorInfo.file`.

    Returns:
        ``(tensors, metadata)``: tensors in header order, and the ``__metadata__`` dict (``{}`` if absent).

    Raises:
        CheckpointError: As :func:`read_header_file`.
    """
    header = read_header_file(path)
    return header.tensors, header.metadata
