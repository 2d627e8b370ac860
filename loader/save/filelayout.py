"""The file layout of a saved checkpoint, from keys, shapes and dtypes alone.

Every rank computes the same :class:`SaveLayout` without communication: which file each checkpoint tensor goes
to (``huggingface_hub.split_torch_state_dict_into_shards``' rule, as ``save_pretrained`` uses it), each file's
header bytes and every tensor's data offset (safetensors' own serialisation: tensors sorted by dtype alignment,
then name; the JSON header padded with spaces to a multiple of 8 bytes).

Vocabulary: a **file layout** (:class:`SaveLayout`) is where a save's tensors' bytes are placed: each tensor's
file (a **shard** of the sharded checkpoint folder, ``model-00001-of-00004.safetensors``) and its data offset in
it. "Layout" means this placement and, in the algebra's executor, one block's (its read layout); nothing else.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass

import torch

SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
#: binary units, as transformers' ``convert_file_size_to_int`` reads them
BINARY_UNITS = {"TIB": 2**40, "GIB": 2**30, "MIB": 2**20, "KIB": 2**10}

#: the header entry safetensors reserves for the file's metadata: no tensor can have this name
METADATA_KEY = "__metadata__"

#: safetensors' dtype names.
DTYPE_NAMES: dict[torch.dtype, str] = {
    getattr(torch, attr): name
    for name, attr in [
        ("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"), ("I64", "int64"),
        ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"), ("BOOL", "bool"), ("C64", "complex64"),
        ("U64", "uint64"), ("U32", "uint32"), ("U16", "uint16"), ("F8_E4M3", "float8_e4m3fn"),
        ("F8_E5M2", "float8_e5m2"), ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz"),
        ("F8_E8M0", "float8_e8m0fnu"),
    ]
    if hasattr(torch, attr)
}  # fmt: skip

# safetensors writes tensors in descending order of its Dtype enum (largest alignment first), then by name.
_ENUM_ORDER = "BOOL U8 I8 F8_E5M2 F8_E4M3 F8_E8M0 F8_E4M3FNUZ F8_E5M2FNUZ I16 U16 F16 BF16 I32 U32 F32 C64 F64 I64 U64"
_DTYPE_RANK = {name: i for i, name in enumerate(_ENUM_ORDER.split())}


def parse_size(size: int | str) -> int:
    """``max_shard_size`` in bytes: a positive int, or a number and a unit as ``save_pretrained`` reads it
    (``huggingface_hub``'s rule: ``"5GB"`` is 5 * 10**9 bytes, ``"1.5MB"`` 1 500 000; units KB, MB, GB, TB in
    any case), or a binary unit as transformers' ``convert_file_size_to_int`` reads it (``"10GiB"``: 10 * 2**30).

    Raises:
        ValueError: anything else — None, a float, a bool, no or an unknown unit, a number that is not finite
            (``"infGB"``, ``"1e400GB"``), or a size under one byte — naming the argument and its value.
    """
    if isinstance(size, str):
        return _parse_size_text(size)
    if isinstance(size, bool) or not hasattr(size, "__index__"):  # an int, or a numpy integer
        raise _size_error(size, f"a {type(size).__name__}, not an int or a str")
    value = operator.index(size)
    if value < 1:
        raise _size_error(size, "a file holds at least one byte")
    return value


def _parse_size_text(size: str) -> int:
    text = size.strip()
    units = {**BINARY_UNITS, **SIZE_UNITS}
    unit = next((u for u in BINARY_UNITS if text.upper().endswith(u)), text[-2:].upper())
    if unit not in units:
        raise _size_error(size, f"no known unit ({text[-len(unit) :]!r})")
    number = text[: -len(unit)].strip()
    try:
        value = float(number) * units[unit]  # huggingface_hub's arithmetic: the same split as save_pretrained
    except ValueError:
        raise _size_error(size, f"{number!r} is not a number") from None
    if not math.isfinite(value):
        raise _size_error(size, "not a finite number of bytes")
    if int(value) < 1:
        raise _size_error(size, "a file holds at least one byte")
    return int(value)


def _size_error(size: object, why: str) -> ValueError:
    return ValueError(
        f"max_shard_size={size!r} is not a file size ({why}): give an int number of bytes or a number with a "
        'unit ("5GB", "500MB", "10GiB"; units KB, MB, GB, TB, KiB, MiB, GiB, TiB)'
    )


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor to save, in the order ``save_pretrained`` visits it.

    Attributes:
        key: checkpoint key.
        shape: its shape.
        dtype: its dtype.
        storage: tensors with equal (non-None) storage ids share one storage in ``save_pretrained``'s state dict
            (e.g. the experts unbound from one fused tensor): they go to the file of the first one.
        storage_nbytes: the bytes that storage counts for in the file split (default: this tensor's bytes).
    """

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    storage: Hashable | None = None
    storage_nbytes: int | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class TensorPlace:
    """Where one checkpoint tensor's data lies: ``[start, start + nbytes)`` of file ``file``."""

    key: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize


@dataclass(frozen=True)
class FileLayout:
    """One safetensors file: its name, the header bytes (length prefix included), its keys in data order and
    its total size."""

    name: str
    header: bytes
    keys: tuple[str, ...]
    size: int


@dataclass(frozen=True)
class SaveLayout:
    """Every file of a checkpoint and every tensor's place in them.

    Attributes:
        files: the files, in shard order.
        tensors: each key's :class:`TensorPlace`.
        total_size: the index's ``metadata.total_size`` (storage bytes as ``save_pretrained`` counts them).
        index_name: the index file's name (written only when there are several files).
    """

    files: tuple[FileLayout, ...]
    tensors: Mapping[str, TensorPlace]
    total_size: int
    index_name: str = "model.safetensors.index.json"

    @property
    def is_sharded(self) -> bool:
        return len(self.files) > 1

    @property
    def data_bytes(self) -> int:
        """Bytes of tensor data in all files (headers excluded)."""
        return sum(p.nbytes for p in self.tensors.values())

    def index_json(self, total_parameters: int | None = None) -> str | None:
        """The index file's text, exactly as ``save_pretrained`` writes it; None for a single file."""
        if not self.is_sharded:
            return None
        metadata = {"total_size": self.total_size}
        if total_parameters is not None:
            metadata = {"total_parameters": total_parameters, **metadata}
        weight_map = {key: f.name for f in self.files for key in f.keys}
        return json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"

    def digest(self) -> str:
        """A hash of every file name and header: equal layouts, equal digests."""
        h = hashlib.sha256()
        for f in self.files:
            h.update(f.name.encode() + b"\0" + f.header)
        return h.hexdigest()


def split_into_files(
    specs: Iterable[TensorSpec], max_shard_size: int | str, filename_pattern: str = "model{suffix}.safetensors"
) -> tuple[list[tuple[str, list[str]]], int]:
    """Assign keys to files like ``huggingface_hub.split_torch_state_dict_into_shards``.

    Keys are visited in order; a file is closed when the next tensor would take it over ``max_shard_size``; a
    tensor larger than that gets a file of its own; tensors sharing a storage follow the first one's file, and
    the storage is counted once.

    Returns:
        ``([(file name, keys)], total_size)``.
    """
    limit = parse_size(max_shard_size)
    shared: dict[Hashable, list[str]] = {}
    shards: list[dict[str, None]] = []
    current: dict[str, None] = {}
    current_size = total = 0
    for spec in specs:
        if spec.storage is not None:
            if spec.storage in shared:
                shared[spec.storage].append(spec.key)
                continue
            shared[spec.storage] = [spec.key]
        size = spec.nbytes if spec.storage_nbytes is None else spec.storage_nbytes
        if size > limit:
            total += size
            shards.append({spec.key: None})
            continue
        if current_size + size > limit:
            shards.append(current)
            current, current_size = {}, 0
        current[spec.key] = None
        current_size += size
        total += size
    if current:
        shards.append(current)
    for keys in shared.values():
        for shard in shards:
            if keys[0] in shard:
                shard.update(dict.fromkeys(keys))
                break
    if len(shards) == 1:
        return [(filename_pattern.format(suffix=""), list(shards[0]))], total
    n = len(shards)
    return [(filename_pattern.format(suffix=f"-{i + 1:05d}-of-{n:05d}"), list(s)) for i, s in enumerate(shards)], total


def header_bytes(specs: Iterable[TensorSpec], metadata: Mapping[str, str] | None) -> tuple[bytes, list[TensorSpec]]:
    """A safetensors header for ``specs`` (8-byte length prefix included), and the specs in data order.

    Raises:
        ValueError: a dtype safetensors cannot store, or metadata that is not ``str -> str``.
    """
    ordered = sorted(specs, key=lambda s: (-_DTYPE_RANK[_dtype_name(s)], s.key))
    header: dict[str, object] = {}
    if metadata:
        bad = [k for k, v in metadata.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise ValueError(f"safetensors metadata must map str to str; not so for {bad}")
        header["__metadata__"] = dict(sorted(metadata.items()))
    offset = 0
    for spec in ordered:
        end = offset + spec.nbytes
        header[spec.key] = {"dtype": _dtype_name(spec), "shape": list(spec.shape), "data_offsets": [offset, end]}
        offset += spec.nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text, ordered


def plan_layout(
    specs: Iterable[TensorSpec],
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    filename_pattern: str = "model{suffix}.safetensors",
) -> SaveLayout:
    """The files, headers and data offsets of a checkpoint of ``specs``.

    Args:
        specs: the checkpoint tensors, in ``save_pretrained``'s order.
        max_shard_size: most bytes per file (``"5GB"``, or an int), as ``save_pretrained(max_shard_size=...)``.
        metadata: the safetensors ``__metadata__`` of every file (``{"format": "pt"}`` for transformers).
        filename_pattern: file names, ``{suffix}`` replaced by ``""`` or ``"-0000i-of-0000n"``.

    Raises:
        ValueError: no tensors, a duplicate key, the key ``__metadata__``, an unknown dtype, or a bad
            ``max_shard_size``.
    """
    specs = list(specs)
    if not specs:
        raise ValueError("nothing to save: no tensors")
    if any(s.key == METADATA_KEY for s in specs):
        raise ValueError(
            f"checkpoint key {METADATA_KEY!r} is the header entry safetensors reserves for the file's metadata: a "
            "file holding a tensor of that name cannot be read back; rename the tensor (or map it to another "
            "checkpoint key with the rules)"
        )
    by_key = {s.key: s for s in specs}
    if len(by_key) != len(specs):
        seen: set[str] = set()
        dup = next(s.key for s in specs if s.key in seen or seen.add(s.key))
        raise ValueError(f"checkpoint key {dup!r} is saved twice")
    groups, total = split_into_files(specs, max_shard_size, filename_pattern)
    files, places = [], {}
    for name, keys in groups:
        header, ordered = header_bytes([by_key[k] for k in keys], metadata)
        offset = len(header)
        for spec in ordered:
            places[spec.key] = TensorPlace(spec.key, name, spec.dtype, spec.shape, offset, spec.nbytes)
            offset += spec.nbytes
        files.append(FileLayout(name, header, tuple(s.key for s in ordered), offset))
    return SaveLayout(tuple(files), places, total)


def _dtype_name(spec: TensorSpec) -> str:
    name = DTYPE_NAMES.get(spec.dtype)
    if name is None:
        raise ValueError(f"checkpoint tensor {spec.key!r} has dtype {spec.dtype}, which safetensors cannot store")
    return name
