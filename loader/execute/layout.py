"""Read layouts of RemapBlocks: which contiguous runs a block reads, how they sit packed in a staging buffer,
and how a block splits to fit a bounded buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

import regiontrace as rt

from ..checkpoint.files import PAGE


@dataclass(frozen=True)
class ReadLayout:
    """How a block's source elements sit in a packed staging buffer.

    ``runs`` are the flat element offsets of equal-length contiguous runs (``run`` elements each), read one
    after another; ``strides`` view the packed buffer in block index order (before ``flips``).
    """

    runs: tuple[int, ...]
    run: int
    strides: tuple[int, ...]
    flips: tuple[int, ...]


def read_layout(block: rt.RemapBlock) -> ReadLayout:
    """The packed read layout of ``block``: outer dims enumerated, inner contiguous dims kept as runs."""
    shape, strides = block.shape, block.src_strides
    flips = tuple(j for j, s in enumerate(strides) if s < 0 and shape[j] > 1)
    base = block.src_offset + sum((shape[j] - 1) * strides[j] for j in flips)
    dims = sorted((j for j in range(len(shape)) if strides[j] != 0 and shape[j] > 1), key=lambda j: -abs(strides[j]))
    packed = [0] * len(shape)
    run = 1
    while dims and abs(strides[dims[-1]]) == run:
        j = dims.pop()
        packed[j] = run
        run *= shape[j]
    weight = run
    for j in reversed(dims):
        packed[j] = weight
        weight *= shape[j]
    starts = [base]
    for j in dims:
        s = abs(strides[j])
        starts = [b + i * s for b in starts for i in range(shape[j])]
    return ReadLayout(tuple(starts), run, tuple(packed), flips)


def split_block(block: rt.RemapBlock, max_elems: int) -> list[rt.RemapBlock]:
    """Split ``block`` along its outermost source dim so each part reads at most ``max_elems`` elements."""
    if block.read_numel <= max_elems:
        return [block]
    dims = sorted((j for j in range(len(block.shape)) if block.shape[j] > 1), key=lambda j: -abs(block.src_strides[j]))
    j = dims[0]
    inner = block.numel // block.shape[j]
    step = max(1, max_elems // max(inner, 1))
    parts = []
    for a in range(0, block.shape[j], step):
        n = min(step, block.shape[j] - a)
        shape = block.shape[:j] + (n,) + block.shape[j + 1 :]
        dst = list(block.dst_offset)
        dst[block.dst_dims[j]] += a * block.dst_steps[j]
        offset = block.src_offset + a * block.src_strides[j]
        part = replace(block, shape=shape, src_offset=offset, dst_offset=tuple(dst))
        parts.extend(split_block(part, max_elems) if n == 1 and len(dims) > 1 else [part])
    return parts


def split_span(block: rt.RemapBlock, max_elems: int) -> list[rt.RemapBlock]:
    """:func:`split_block`, then split again each part whose source span exceeds ``max_elems`` (where it can)."""
    parts = []
    for part in split_block(block, max_elems):
        lo, hi = part.source_span()
        if hi - lo <= max_elems or part.read_numel <= 1:
            parts.append(part)
            continue
        sub = split_block(part, max(1, part.read_numel * max_elems // (hi - lo)))
        parts.extend([part] if len(sub) == 1 else [p for q in sub for p in split_span(q, max_elems)])
    return parts


def page_spans(starts: np.ndarray, length: int, page: int = PAGE) -> list[tuple[int, int]]:
    """Byte runs ``[s, s + length)`` merged into ranges whose gaps hold no page that no run touches.

    Reading such a range through its gaps reads no page more than the runs alone would.
    """
    starts = np.sort(starts)
    ends = starts + length
    cut = np.flatnonzero(starts[1:] // page - (ends[:-1] - 1) // page > 1) + 1
    firsts = np.concatenate(([0], cut))
    lasts = np.concatenate((cut - 1, [len(starts) - 1]))
    return list(zip(starts[firsts].tolist(), ends[lasts].tolist()))
