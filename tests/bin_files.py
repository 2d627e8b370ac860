"""``torch.save`` checkpoints for the ``.bin`` tests: a model's original checkpoint layout as ``pytorch_model.bin``
(or shards and their index, as ``save_pretrained(safe_serialization=False)`` wrote them before transformers 5), and
a zip writer of our own that lays an archive's records out as asked (zip64 fields, compression, sizes), to build
the archives ``torch.save`` never writes."""

from __future__ import annotations

import collections
import io
import json
import os
import shutil
import struct
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hf_models import read_checkpoint, save

SHARD = "pytorch_model-{:05d}-of-{:05d}.bin"


def save_bin(model: torch.nn.Module, folder, dtype: torch.dtype | None = None, max_shard_bytes: int | None = None):
    """Write ``model``'s checkpoint (the layout ``save_pretrained`` writes, of a ``dtype`` copy) as ``torch.save``
    files in ``folder``: ``pytorch_model.bin``, or shards of at most ``max_shard_bytes`` and their index; with
    its ``config.json``. Returns the state dict written, in order."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as st:
        save(model, st, dtype)
        state = read_checkpoint(st)
        for name in os.listdir(st):
            if name.endswith(".json") and "index" not in name:
                shutil.copy(os.path.join(st, name), folder / name)
    if max_shard_bytes is None:
        torch.save(collections.OrderedDict(state), folder / "pytorch_model.bin")
        return state
    shards: list[dict] = [{}]
    for key, t in state.items():
        if shards[-1] and sum(v.nbytes for v in shards[-1].values()) + t.nbytes > max_shard_bytes:
            shards.append({})
        shards[-1][key] = t
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        name = SHARD.format(i, len(shards))
        torch.save(collections.OrderedDict(shard), folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(t.nbytes for t in state.values())}, "weight_map": weight_map}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index, indent=2))
    return state


def torch_bytes(state: dict) -> bytes:
    """``torch.save(state)``'s bytes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def members(archive: bytes) -> list[tuple[str, bytes]]:
    """An archive's records, in order: ``(name, data)``."""
    with zipfile.ZipFile(io.BytesIO(archive)) as z:
        return [(i.filename, z.read(i)) for i in z.infolist()]


@dataclass
class Member:
    """One record as :func:`write_zip` lays it out: its bytes, and what its headers claim about them."""

    name: str
    data: bytes
    method: int = 0
    claimed_size: int | None = None  # what the central directory says (None: the true size)
    local_name: str | None = None  # the local header's name (None: the same)
    header_offset: int | None = None  # what the central directory says (None: where it is)
    extra: dict = field(default_factory=dict)


def write_zip(items: list[Member], *, zip64: bool = False, entries: int | None = None, cd_size_delta: int = 0) -> bytes:
    """An archive of ``items`` with data aligned to 64 bytes as ``torch.save`` aligns it; ``zip64``: every
    central size and offset at its sentinel, the values in zip64 extra fields, a zip64 end record and locator
    (``entries`` / ``cd_size_delta``: what the end records claim, when forged)."""
    out, central = bytearray(), bytearray()
    for m in items:
        offset, name = len(out), m.name.encode()
        local_name = (m.local_name or m.name).encode()
        size = len(m.data)
        pad = (-(len(out) + 30 + len(local_name) + 4)) % 64
        extra = struct.pack("<HH", 0x4246, pad) + b"\0" * pad  # the alignment padding torch writes ("FB")
        crc = zipfile.crc32(m.data)
        out += struct.pack(
            "<IHHHHHIIIHH", 0x04034B50, 45, 0x800, m.method, 0, 0, crc, size, size, len(local_name), len(extra)
        )
        out += local_name + extra + m.data
        claimed = size if m.claimed_size is None else m.claimed_size
        at = offset if m.header_offset is None else m.header_offset
        cextra = b""
        fields = (claimed, claimed, at)
        if zip64:
            cextra = struct.pack("<HH", 1, 24) + struct.pack("<QQQ", *fields)
            fields = (0xFFFFFFFF,) * 3
        central += struct.pack(
            "<IHHHHHHIIIHHHHHII", 0x02014B50, 45, 45, 0x800, m.method, 0, 0, crc, fields[1], fields[0],
            len(name), len(cextra), 0, 0, 0, 0, fields[2],
        )  # fmt: skip
        central += name + cextra
    cd_offset, cd_size, count = len(out), len(central) + cd_size_delta, len(items) if entries is None else entries
    out += central
    if zip64:
        eocd64 = len(out)
        out += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, cd_offset)
        out += struct.pack("<IIQI", 0x07064B50, 0, eocd64, 1)
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    else:
        out += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, cd_offset, 0)
    return bytes(out)


def rewrite(archive: bytes, **options) -> bytes:
    """``archive``'s records written again by :func:`write_zip`."""
    return write_zip([Member(n, d) for n, d in members(archive)], **options)
