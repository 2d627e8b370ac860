"""Compiling a region, for a box of its output, into RemapBlocks: strided copies from one source each.

:class:`~regiontrace.remap_block.RemapBlock` and its read side (runs, span, box) live in
:mod:`regiontrace.remap_block`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import replace

from .radix import Factor, box_ranges, digit_weights, interval_boxes
from .region import Region
from .remap_block import Box, RemapBlock

__all__ = ["check_box", "compile_blocks"]


def check_box(shape: Sequence[int], box: Sequence[Sequence[int]] | None) -> Box:
    """Validate a box against ``shape``; None means the whole shape.

    Raises:
        ValueError: the box has the wrong rank or lies outside the shape.
    """
    if box is None:
        return tuple((0, n) for n in shape)
    box = tuple((int(a), int(b)) for a, b in box)
    if len(box) != len(shape):
        raise ValueError(f"box {box} has {len(box)} dims, the tensor has {len(shape)} (shape {tuple(shape)})")
    for d, ((a, b), n) in enumerate(zip(box, shape)):
        if not 0 <= a <= b <= n:
            raise ValueError(f"box {box} lies outside shape {tuple(shape)} in dim {d}")
    return box


def compile_blocks(region: Region, box: Sequence[Sequence[int]] | None = None) -> tuple[RemapBlock, ...]:
    """Compile the pieces of ``region`` that meet ``box`` into blocks partitioning the box.

    Cost grows with the pieces touched, never with element count.
    """
    box = check_box(region.shape, box)
    if any(a == b for a, b in box):
        return ()
    blocks: list[RemapBlock] = []
    for piece in region.pieces:
        per_dim = []
        for (b0, b1), ax in zip(box, piece.axes):
            lo, hi = max(b0, ax.start), min(b1, ax.start + ax.length)
            if lo >= hi:
                break
            per_dim.append(_dim_parts(ax.factors, lo - ax.start, hi - ax.start, ax.start - b0))
            if not per_dim[-1]:
                break
        else:
            for combo in itertools.product(*per_dim):
                blocks.append(_block(piece, combo, len(box)))
    return tuple(_merge_blocks(blocks))


def _dim_parts(factors: tuple[Factor, ...], a0: int, a1: int, shift: int) -> list[tuple]:
    """Per-dim parts of one piece inside ``[a0, a1)``: (dst start, src delta, [(n, src stride, dst step)])."""
    if not factors:
        return [(shift, 0, [])]
    weights = digit_weights(factors)
    parts = []
    for prefix, lo, hi in interval_boxes(a0, a1, [f.radix for f in factors]):
        ranges = box_ranges(factors, prefix, lo, hi)
        if ranges is None:
            continue
        start = shift + sum(r[0] * w for r, w in zip(ranges, weights))
        delta = sum((r[0] - f.lo) * f.stride for r, f in zip(ranges, factors))
        dims = [(r[1] - r[0], f.stride, w) for r, f, w in zip(ranges, factors, weights) if r[1] - r[0] > 1]
        parts.append((start, delta, _fold(dims)))
    return parts


def _fold(dims: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge adjacent block dims that are one strided dim on both sides."""
    out: list[tuple[int, int, int]] = []
    for n, s, w in dims:
        if out:
            n0, s0, w0 = out[-1]
            if s0 == s * n and w0 == w * n:
                out[-1] = (n0 * n, s, w)
                continue
        out.append((n, s, w))
    return out


def _block(piece, combo, ndim: int) -> RemapBlock:
    shape, src_strides, dst_dims, dst_steps = [], [], [], []
    dst_offset, delta = [], 0
    for d, (start, dd, dims) in enumerate(combo):
        dst_offset.append(start)
        delta += dd
        for n, s, w in dims:
            shape.append(n)
            src_strides.append(s)
            dst_dims.append(d)
            dst_steps.append(w)
    src = piece.source
    return RemapBlock(
        source=src.name,
        shape=tuple(shape),
        src_offset=piece.base + delta,
        src_strides=tuple(src_strides),
        dst_offset=tuple(dst_offset),
        dst_dims=tuple(dst_dims),
        dst_steps=tuple(dst_steps),
        source_shape=tuple(src.shape),
        source_dtype=src.dtype,
        casts=piece.casts,
    )


def _merge_blocks(blocks: list[RemapBlock]) -> list[RemapBlock]:
    """Merge blocks that continue each other on both sides along one block dim."""
    if len(blocks) < 2:
        return blocks
    for j in range(max(len(b.shape) for b in blocks)):
        starts = {_key(b, j, b.src_offset, b.dst_offset): i for i, b in enumerate(blocks) if j < len(b.shape)}
        out, alive = list(blocks), [True] * len(blocks)
        for i in range(len(out)):
            while alive[i] and j < len(out[i].shape):
                a = out[i]
                k = starts.get(_key(a, j, *_end(a, j)))
                if k is None or k == i or not alive[k]:
                    break
                shape = list(a.shape)
                shape[j] += out[k].shape[j]
                out[i] = replace(a, shape=tuple(shape))
                alive[k] = False
        blocks = [b for b, ok in zip(out, alive) if ok]
    return blocks


def _key(b: RemapBlock, j: int, src_offset: int, dst_offset: tuple[int, ...]) -> tuple:
    return (
        j,
        b.source,
        src_offset,
        dst_offset,
        b.shape[:j] + b.shape[j + 1 :],
        b.src_strides,
        b.dst_dims,
        b.dst_steps,
        b.casts,
    )


def _end(a: RemapBlock, j: int) -> tuple[int, tuple[int, ...]]:
    n = a.shape[j]
    dst = list(a.dst_offset)
    dst[a.dst_dims[j]] += n * a.dst_steps[j]
    return a.src_offset + n * a.src_strides[j], tuple(dst)
