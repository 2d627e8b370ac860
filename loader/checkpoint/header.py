"""The safetensors file format: dtypes, one tensor's place on disk, and header parsing and validation.

Vocabulary: a *header* is the JSON object after the 8-byte length prefix; each *entry* gives a tensor's
``dtype``, ``shape`` and ``data_offsets`` relative to the *data section* that follows the header. A file's
*identity* (device, inode, size, mtime) is recorded when its header is read, so later reads can tell the
file changed underneath.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass

import torch

from loader.errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000  # same limit as the safetensors reference implementation
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)

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


def err(path: str, message: str, key: str | None = None) -> CheckpointError:
    where = f"{path}: tensor {key!r}: " if key is not None else f"{path}: "
    return CheckpointError(where + message, path=path, key=key)


@dataclass(frozen=True)
class FileIdentity:
    """What identifies one file's contents: if any field changes, the file was replaced or rewritten.

    Attributes:
        device: ``st_dev``.
        inode: ``st_ino``.
        size: ``st_size`` in bytes.
        mtime_ns: ``st_mtime_ns``.
    """

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        """The identity of a ``stat``/``fstat`` result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives on disk.

    Attributes:
        key: Tensor name in the checkpoint.
        file: Absolute path of the file holding it.
        dtype: Torch dtype of the elements.
        shape: Tensor shape.
        data_start: Absolute byte offset of the first byte in ``file`` (``8 + header_len + begin``).
        data_end: Absolute byte offset one past the last byte.
    """

    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_start: int
    data_end: int

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (``data_end - data_start``)."""
        return self.data_end - self.data_start


def _pread_exact(fd: int, path: str, size: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            raise err(path, f"truncated: expected {size} bytes at offset {offset}, got {got}")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def no_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate JSON key {k!r}")
        out[k] = v
    return out


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _parse_entry(path: str, key: str, entry: object, data_base: int, data_size: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise err(path, f"header entry must be a JSON object, got {type(entry).__name__}", key)
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise err(path, f"header entry is missing {field!r}", key)
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype_name, str):
        raise err(path, f"dtype must be a string, got {dtype_name!r}", key)
    if dtype_name not in DTYPES:
        raise err(path, f"unknown or unsupported dtype {dtype_name!r} (supported: {sorted(DTYPES)})", key)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise err(path, f"shape must be a list of non-negative ints, got {shape!r}", key)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise err(path, f"data_offsets must be [begin, end] ints, got {offsets!r}", key)
    begin, end = offsets
    if not (0 <= begin <= end):
        raise err(path, f"data_offsets must satisfy 0 <= begin <= end, got {offsets!r}", key)
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        msg = f"data_offsets span {end - begin} bytes but {dtype_name}{shape} needs {expected}"
        raise err(path, msg, key)
    if end > data_size:
        raise err(path, f"data_offsets {offsets!r} run past the data section ({data_size} bytes)", key)
    return TensorInfo(key, path, dtype, tuple(shape), data_base + begin, data_base + end)


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Read and validate the header of one safetensors file (no tensor data is read).

    Args:
        path: Path of the ``.safetensors`` file; stored as given in :attr:`TensorInfo.file`.

    Returns:
        ``(tensors, metadata)``: tensors in header order, and the ``__metadata__`` dict (``{}`` if absent).

    Raises:
        CheckpointError: The file is truncated, the header is malformed or entries are inconsistent.
        OSError: The file cannot be opened.
    """
    fd = os.open(path, OPEN_FLAGS)
    if hasattr(os, "posix_fadvise"):  # a header read must not pull the data after it into the page cache
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    try:
        file_size = os.fstat(fd).st_size
        if file_size < 8:
            raise err(path, f"truncated: {file_size} bytes, too short for the 8-byte header length")
        (header_len,) = struct.unpack("<Q", _pread_exact(fd, path, 8, 0))
        if header_len > file_size - 8:
            raise err(path, f"header length {header_len} runs past the end of the file ({file_size} bytes)")
        if header_len > MAX_HEADER_BYTES:
            raise err(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
        raw = _pread_exact(fd, path, header_len, 8)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=no_duplicate_keys)
    except (UnicodeDecodeError, ValueError) as e:
        raise err(path, f"header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise err(path, f"header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise err(path, f"__metadata__ must map strings to strings, got {metadata!r}")
    data_base, data_size = 8 + header_len, file_size - 8 - header_len
    tensors = {key: _parse_entry(path, key, entry, data_base, data_size) for key, entry in header.items()}
    spans = sorted((t.data_start, t.data_end, t.key) for t in tensors.values() if t.nbytes > 0)
    for (_, prev_end, prev_key), (start, _, key) in zip(spans, spans[1:]):
        if start < prev_end:
            raise err(path, f"byte range overlaps that of tensor {prev_key!r}", key)
    return tensors, metadata
