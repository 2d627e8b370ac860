"""Header-only view of safetensors checkpoints and byte-exact range reads.

Opening a checkpoint reads and validates only the JSON headers; tensor data is read later with
``os.pread`` (never mmap, never whole files), optionally coalescing nearby byte ranges.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import threading
from collections.abc import Iterator, KeysView, Mapping, Sequence
from dataclasses import dataclass

import torch

from loader.errors import CheckpointError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # same limit as the safetensors reference implementation
_HAS_PREADV = hasattr(os, "preadv")
_Meta = dict[str, dict[str, str]]
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)

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


def _err(path: str, message: str, key: str | None = None) -> CheckpointError:
    where = f"{path}: tensor {key!r}: " if key is not None else f"{path}: "
    return CheckpointError(where + message, path=path, key=key)


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


# ----------------------------------------------------------------------------------------------- reading


class FileReader:
    """Holds open read-only file descriptors and reads exact byte ranges with ``pread``.

    Thread-safe: descriptors are opened lazily under a lock and ``pread`` has no shared file position.
    Use as a context manager (or call :meth:`close`) to release the descriptors.

    Attributes:
        bytes_read: Total bytes read from the OS so far (including any coalescing over-read).
        reads: Number of :meth:`pread_into` calls that read at least one byte.
    """

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.reads = 0

    def __enter__(self) -> FileReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every open descriptor. The reader may be reused afterwards (files reopen lazily)."""
        with self._lock:
            fds, self._fds = self._fds, {}
            maps, self._maps = self._maps, {}
        for m in maps.values():
            m.close()
        for fd in fds.values():
            os.close(fd)

    def mapping(self, file: str, end: int) -> mmap.mmap:
        """A read-only memory map of ``file`` that must hold at least ``end`` bytes.

        Used for reads of many small strided runs, copied in one vectorised step. The size is checked first
        (a mapping of a file truncated underneath would fault instead of raising).

        Raises:
            CheckpointError: the file is now shorter than ``end``.
        """
        fd = self.fd(file)
        size = os.fstat(fd).st_size
        if size < end:
            raise _err(file, f"file is {size} bytes, the load needs {end}; file changed underneath?")
        with self._lock:
            m = self._maps.get(file)
            if m is None or len(m) < end:
                m = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                if hasattr(mmap, "MADV_RANDOM"):  # no readahead past what prefetch() asks for
                    m.madvise(mmap.MADV_RANDOM)
                self._maps[file] = m
        return m

    def prefetch(self, file: str, start: int, end: int) -> None:
        """Ask the kernel to read bytes ``[start, end)`` of a mapped file now, in large requests."""
        m = self._maps.get(file)
        if m is None or not hasattr(mmap, "MADV_WILLNEED") or end <= start:
            return
        page = mmap.PAGESIZE
        lo = start - start % page
        m.madvise(mmap.MADV_WILLNEED, lo, min(end, len(m)) - lo)

    def advise_sparse(self, file: str) -> None:
        """Tell the kernel this file is read sparsely: no readahead beyond the ranges asked for."""
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd(file), 0, 0, os.POSIX_FADV_RANDOM)

    def count(self, nbytes: int) -> None:
        """Account ``nbytes`` read by a caller through :meth:`mapping`."""
        with self._lock:
            self.bytes_read += nbytes
            self.reads += 1

    def fd(self, file: str) -> int:
        """Return an open descriptor for ``file``, opening it on first use."""
        fd = self._fds.get(file)
        if fd is None:
            with self._lock:
                fd = self._fds.get(file)
                if fd is None:
                    fd = os.open(file, _OPEN_FLAGS)
                    self._fds[file] = fd
        return fd

    def pread_into(self, file: str, offset: int, out: memoryview | bytearray) -> None:
        """Read exactly ``len(out)`` bytes of ``file`` starting at ``offset`` into ``out``.

        Args:
            file: Path of the file.
            offset: Absolute byte offset to start at.
            out: Writable, C-contiguous buffer; its length is the number of bytes read.

        Raises:
            CheckpointError: The file ended before ``len(out)`` bytes were read.
        """
        view = memoryview(out).cast("B")
        size = len(view)
        if size == 0:
            return
        fd = self.fd(file)
        pos = 0
        while pos < size:
            if _HAS_PREADV:  # reads straight into ``out``, no intermediate bytes object
                n = os.preadv(fd, [view[pos:]], offset + pos)
            else:  # pragma: no cover - platforms without preadv
                chunk = os.pread(fd, size - pos, offset + pos)
                n = len(chunk)
                view[pos : pos + n] = chunk
            if n == 0:
                msg = f"unexpected end of file reading bytes [{offset}, {offset + size}) (got {pos})"
                raise _err(file, msg + "; file changed underneath?")
            pos += n
        with self._lock:
            self.bytes_read += size
            self.reads += 1


def coalesce_ranges(
    ranges: Sequence[tuple[int, int]], *, max_gap: int = 4096, max_overread: float = 2.0
) -> list[tuple[int, int, list[int]]]:
    """Group byte ranges into fewer, larger reads.

    Ranges are sorted by start. The next range joins the current group when it overlaps or touches it,
    when the gap to it is ``<= max_gap``, or when the merged read stays within ``max_overread`` times the
    bytes actually wanted (the union of the member ranges). Empty ranges are left out of every group.

    Args:
        ranges: ``(start, end)`` absolute byte ranges, ``0 <= start <= end``.
        max_gap: Gap in bytes that is always worth reading through.
        max_overread: Largest allowed ratio of bytes read to bytes wanted for a merged read.

    Returns:
        ``(start, end, member_indices)`` per read, in file order; indices point into ``ranges``.

    Raises:
        ValueError: A range has ``start < 0`` or ``end < start``.
    """
    for start, end in ranges:
        if not (0 <= start <= end):
            raise ValueError(f"invalid byte range ({start}, {end})")
    order = sorted((i for i, (s, e) in enumerate(ranges) if e > s), key=lambda i: ranges[i])
    groups: list[tuple[int, int, list[int]]] = []
    g_start = g_end = wanted = 0
    members: list[int] = []
    for i in order:
        s, e = ranges[i]
        if members:
            new_end = max(g_end, e)
            new_wanted = wanted + max(0, e - max(s, g_end))
            if s - g_end <= max_gap or (new_end - g_start) <= max_overread * new_wanted:
                g_end, wanted = new_end, new_wanted
                members.append(i)
                continue
            groups.append((g_start, g_end, members))
        g_start, g_end, wanted, members = s, e, e - s, [i]
    if members:
        groups.append((g_start, g_end, members))
    return groups


def read_ranges(
    file: str,
    ranges: Sequence[tuple[int, int]],
    *,
    max_gap: int = 4096,
    max_overread: float = 2.0,
    reader: FileReader | None = None,
) -> list[memoryview]:
    """Read several absolute byte ranges of one file, coalescing nearby ranges (see :func:`coalesce_ranges`).

    Args:
        file: Path of the file.
        ranges: ``(start, end)`` absolute byte ranges; may overlap and be in any order.
        max_gap, max_overread: Coalescing policy, see :func:`coalesce_ranges`.
        reader: Reader to use (and account ``bytes_read`` on); a temporary one when ``None``.

    Returns:
        One read-only view per input range, in input order. Views of ranges read together share
        one buffer, which stays alive as long as any of them does.

    Raises:
        ValueError: A range is invalid.
        CheckpointError: The file is shorter than a requested range.
    """
    groups = coalesce_ranges(ranges, max_gap=max_gap, max_overread=max_overread)
    out: list[memoryview] = [memoryview(b"")] * len(ranges)
    own = reader is None
    rd = FileReader() if reader is None else reader
    try:
        for g_start, g_end, members in groups:
            buf = bytearray(g_end - g_start)
            rd.pread_into(file, g_start, buf)
            view = memoryview(buf).toreadonly()
            for i in members:
                s, e = ranges[i]
                out[i] = view[s - g_start : e - g_start]
    finally:
        if own:
            rd.close()
    return out


def read_tensor(info: TensorInfo, reader: FileReader | None = None) -> torch.Tensor:
    """Read one whole tensor into a new CPU tensor (bit-identical to ``safetensors.torch.load_file``).

    Args:
        info: Where the tensor lives.
        reader: Reader to use (and account ``bytes_read`` on); a temporary one when ``None``.

    Returns:
        A fresh, writable, contiguous CPU tensor of ``info.dtype`` and ``info.shape``.

    Raises:
        CheckpointError: The file is shorter than the header promised.
    """
    if info.nbytes == 0 or info.numel == 0:
        return torch.empty(info.shape, dtype=info.dtype)
    buf = bytearray(info.nbytes)
    own = reader is None
    rd = FileReader() if reader is None else reader
    try:
        rd.pread_into(info.file, info.data_start, buf)
    finally:
        if own:
            rd.close()
    return torch.frombuffer(buf, dtype=torch.uint8).view(info.dtype).reshape(info.shape)


# ----------------------------------------------------------------------------------------------- headers


def _pread_exact(fd: int, path: str, size: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < size:
        chunk = os.pread(fd, size - got, offset + got)
        if not chunk:
            raise _err(path, f"truncated: expected {size} bytes at offset {offset}, got {got}")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
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
        raise _err(path, f"header entry must be a JSON object, got {type(entry).__name__}", key)
    for field in ("dtype", "shape", "data_offsets"):
        if field not in entry:
            raise _err(path, f"header entry is missing {field!r}", key)
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype_name, str):
        raise _err(path, f"dtype must be a string, got {dtype_name!r}", key)
    if dtype_name not in DTYPES:
        raise _err(path, f"unknown or unsupported dtype {dtype_name!r} (supported: {sorted(DTYPES)})", key)
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _err(path, f"shape must be a list of non-negative ints, got {shape!r}", key)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
        raise _err(path, f"data_offsets must be [begin, end] ints, got {offsets!r}", key)
    begin, end = offsets
    if not (0 <= begin <= end):
        raise _err(path, f"data_offsets must satisfy 0 <= begin <= end, got {offsets!r}", key)
    dtype = DTYPES[dtype_name]
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        msg = f"data_offsets span {end - begin} bytes but {dtype_name}{shape} needs {expected}"
        raise _err(path, msg, key)
    if end > data_size:
        raise _err(path, f"data_offsets {offsets!r} run past the data section ({data_size} bytes)", key)
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
    fd = os.open(path, _OPEN_FLAGS)
    if hasattr(os, "posix_fadvise"):  # a header read must not pull the data after it into the page cache
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    try:
        file_size = os.fstat(fd).st_size
        if file_size < 8:
            raise _err(path, f"truncated: {file_size} bytes, too short for the 8-byte header length")
        (header_len,) = struct.unpack("<Q", _pread_exact(fd, path, 8, 0))
        if header_len > file_size - 8:
            raise _err(path, f"header length {header_len} runs past the end of the file ({file_size} bytes)")
        if header_len > MAX_HEADER_BYTES:
            raise _err(path, f"header length {header_len} exceeds the {MAX_HEADER_BYTES}-byte limit")
        raw = _pread_exact(fd, path, header_len, 8)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise _err(path, f"header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise _err(path, f"header must be a JSON object, got {type(header).__name__}")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _err(path, f"__metadata__ must map strings to strings, got {metadata!r}")
    data_base, data_size = 8 + header_len, file_size - 8 - header_len
    tensors = {key: _parse_entry(path, key, entry, data_base, data_size) for key, entry in header.items()}
    spans = sorted((t.data_start, t.data_end, t.key) for t in tensors.values() if t.nbytes > 0)
    for (_, prev_end, prev_key), (start, _, key) in zip(spans, spans[1:]):
        if start < prev_end:
            raise _err(path, f"byte range overlaps that of tensor {prev_key!r}", key)
    return tensors, metadata


# ----------------------------------------------------------------------------------------------- checkpoint


def _index_files(root: str, index_path: str, allow_external_symlinks: bool) -> dict[str, list[str]]:
    """Parse an index file; return ``{absolute shard path: [keys]}`` in sorted shard order."""
    try:
        with open(index_path, "rb") as f:
            index = json.loads(f.read().decode("utf-8"), object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise _err(index_path, f"index is not valid UTF-8 JSON: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise _err(index_path, "index must be a JSON object with a 'weight_map' object")
    real_root = os.path.realpath(root)
    by_file: dict[str, list[str]] = {}
    checked: dict[str, str] = {}  # file name -> path: each distinct name is validated once
    for key, name in weight_map.items():
        path = checked.get(name) if isinstance(name, str) else None
        if path is None:
            if not isinstance(name, str) or not name:
                raise _err(index_path, f"weight_map value must be a file name, got {name!r}", key)
            norm = os.path.normpath(name)
            if os.path.isabs(name) or norm == ".." or norm.startswith(".." + os.sep):
                raise _err(index_path, f"file {name!r} escapes the checkpoint folder {root}", key)
            path = os.path.join(root, norm)
            if not allow_external_symlinks:
                real = os.path.realpath(path)
                if os.path.commonpath([real, real_root]) != real_root:
                    raise _err(index_path, f"file {name!r} resolves to {real}, outside {real_root}", key)
            checked[name] = path
        by_file.setdefault(path, []).append(key)
    for path in by_file:
        if not os.path.isfile(path):
            raise _err(index_path, f"names missing file {path}", by_file[path][0])
    return {path: by_file[path] for path in sorted(by_file)}


class SafetensorsCheckpoint(Mapping[str, TensorInfo]):
    """A safetensors checkpoint (one file or a sharded folder), known from its headers only.

    A read-only mapping from tensor key to :class:`TensorInfo`.

    Attributes:
        root: Absolute folder of the checkpoint.
        files: Absolute paths of the files in use, in order.
        tensors: ``{key: TensorInfo}``.
        metadata: ``{file: __metadata__ dict}`` for every file in ``files``.
    """

    def __init__(
        self, root: str, files: Sequence[str], tensors: dict[str, TensorInfo], metadata: _Meta | None = None
    ) -> None:
        self.root = os.path.abspath(root)
        self.files = tuple(files)
        self.tensors = tensors
        self.metadata = metadata if metadata is not None else {f: {} for f in self.files}

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], *, allow_external_symlinks: bool = False
    ) -> SafetensorsCheckpoint:
        """Open a checkpoint, reading and validating only its headers.

        ``path`` may be a ``.safetensors`` file, a ``model.safetensors.index.json`` file, or a folder. In
        a folder the index is used if present (exactly the files and keys it names; keys a shard has
        beyond the index are ignored), else ``model.safetensors``, else every ``*.safetensors`` (sorted).

        Args:
            path: File or folder.
            allow_external_symlinks: Accept index entries that are symlinks resolving outside the folder
                (needed for Hugging Face hub cache snapshots, whose files link into ``../../blobs``).

        Returns:
            The opened checkpoint.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            CheckpointError: A file or the index is malformed, names missing files/keys, escapes the
                folder, or two files hold the same key.
        """
        path = os.path.abspath(os.fspath(path))
        if not os.path.exists(path):
            raise FileNotFoundError(f"no checkpoint at {path}")
        if os.path.isfile(path) and os.path.basename(path) != INDEX_NAME:
            tensors, meta = read_header(path)
            return cls(os.path.dirname(path), (path,), tensors, {path: meta})
        root = os.path.dirname(path) if os.path.isfile(path) else path
        index_path = os.path.join(root, INDEX_NAME)
        if os.path.isfile(index_path):
            wanted: dict[str, list[str]] | None = _index_files(root, index_path, allow_external_symlinks)
            files = list(wanted)
        elif os.path.isfile(os.path.join(root, SINGLE_NAME)):
            wanted, files = None, [os.path.join(root, SINGLE_NAME)]
        else:
            wanted = None
            files = sorted(
                os.path.join(root, n)
                for n in os.listdir(root)
                if n.endswith(".safetensors") and os.path.isfile(os.path.join(root, n))
            )
            if not files:
                raise _err(root, "folder holds no .safetensors files")
        tensors: dict[str, TensorInfo] = {}
        metadata: _Meta = {}
        for file in files:
            header, metadata[file] = read_header(file)
            if wanted is not None:
                for key in wanted[file]:
                    if key not in header:
                        raise _err(index_path, f"index places it in {file}, whose header lacks it", key)
                    tensors[key] = header[key]
                continue
            for key, info in header.items():
                if key in tensors:
                    other = os.path.basename(tensors[key].file)
                    raise _err(file, f"key {key!r} in both {other} and {os.path.basename(file)}", key)
                tensors[key] = info
        return cls(root, files, tensors, metadata)

    @classmethod
    def from_infos(cls, infos: Mapping[str, TensorInfo], root: str = ".") -> SafetensorsCheckpoint:
        """Build a checkpoint from tensor metadata alone (no files touched), e.g. for planning simulations.

        Args:
            infos: ``{key: TensorInfo}``; each info's ``key`` must match its mapping key.
            root: Folder to report as :attr:`root`.

        Returns:
            The checkpoint; ``files`` lists the infos' files in first-seen order, ``metadata`` is empty.

        Raises:
            ValueError: A mapping key differs from its info's ``key``.
        """
        for key, info in infos.items():
            if info.key != key:
                raise ValueError(f"mapping key {key!r} holds TensorInfo for {info.key!r}")
        files = tuple(dict.fromkeys(info.file for info in infos.values()))
        return cls(root, files, dict(infos))

    def __getitem__(self, key: str) -> TensorInfo:
        return self.tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors

    def __iter__(self) -> Iterator[str]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def keys(self) -> KeysView[str]:
        """Tensor keys, in checkpoint order."""
        return self.tensors.keys()

    @property
    def total_bytes(self) -> int:
        """Sum of all tensors' data bytes."""
        return sum(info.nbytes for info in self.tensors.values())

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({self.root!r}, files={len(self.files)}, tensors={len(self.tensors)})"
