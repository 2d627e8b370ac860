"""Reading byte ranges of a checkpoint's files through a :class:`~loader.storage.RangeReader`: several ranges
coalesced (:func:`read_ranges`), or one whole tensor (:func:`read_tensor`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..storage import FileReader, RangeReader
from .chunks import TensorInfo, check_encodings


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
    reader: RangeReader | None = None,
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


def read_tensor(info: TensorInfo, reader: RangeReader | None = None) -> torch.Tensor:
    """Read one whole tensor into a new CPU tensor (bit-identical to ``safetensors.torch.load_file``); a tensor
    stored as several chunks is assembled from them.

    Args:
        info: Where the tensor lives.
        reader: Reader to use (and account ``bytes_read`` on); a temporary one when ``None``.

    Returns:
        A fresh, writable, contiguous CPU tensor of ``info.dtype`` and ``info.shape``.

    Raises:
        CheckpointError: The file is shorter than the header promised, or changed underneath; the tensor's
            encoding is not one the loader reads.
    """
    check_encodings((info,))
    if info.nbytes == 0 or info.numel == 0:
        return torch.empty(info.shape, dtype=info.dtype)
    own = reader is None
    rd = FileReader() if reader is None else reader
    try:
        if not info.split:
            return _read_chunk(rd, info)
        out = torch.empty(info.shape, dtype=info.dtype)
        for j, chunk in enumerate(info.split):
            view = out
            for d, (a, b) in enumerate(chunk.box):
                view = view.narrow(d, a, b - a)
            if chunk.numel:
                view.copy_(_read_chunk(rd, info.chunk_info(j)))
        return out
    finally:
        if own:
            rd.close()


def _read_chunk(reader: RangeReader, info: TensorInfo) -> torch.Tensor:
    """One chunk's tensor (``info`` one chunk), verified against its file's identity."""
    buf = bytearray(info.nbytes)
    reader.pread_into(info.file, info.data_start, buf)
    reader.verify(info.file)  # a file rewritten during the read (see FileReader.expect)
    return torch.frombuffer(buf, dtype=torch.uint8).view(info.dtype).reshape(info.shape)
