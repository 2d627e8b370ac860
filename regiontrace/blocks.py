"""Compiling a region, for a box of its output, into RemapBlocks: strided copies from one source each.

A :class:`RemapBlock` walks a block index ``b`` over ``shape``. It reads source element (flat, C-contiguous)
``src_offset + sum(b[j] * src_strides[j])`` and writes the box-local output element whose coordinate in
dim ``dst_dims[j]`` is ``dst_offset[dim] + sum(b[j] * dst_steps[j])``. Readers turn the source side into byte
ranges with :meth:`RemapBlock.source_runs` (or :meth:`RemapBlock.source_box` when the block reads a box).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from .region import Factor, Region, _weights, box_ranges, contiguous_strides, interval_boxes

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class RemapBlock:
    """Copy one strided region of source ``source`` into a strided region of the output box.

    Attributes:
        source: name of the source tensor.
        shape: the block's index space.
        src_offset: flat element offset (C-contiguous source) of block index 0.
        src_strides: source element stride per block dim (0 for broadcast, negative for flips).
        dst_offset: box-local output coordinate of block index 0, per output dim.
        dst_dims: the output dim each block dim walks.
        dst_steps: the step along that output dim (positive).
        source_shape: shape of the source tensor.
        source_dtype: dtype of the source tensor.
        casts: value casts applied, in order, between reading and writing.
    """

    source: str
    shape: tuple[int, ...]
    src_offset: int
    src_strides: tuple[int, ...]
    dst_offset: tuple[int, ...]
    dst_dims: tuple[int, ...]
    dst_steps: tuple[int, ...]
    source_shape: tuple[int, ...]
    source_dtype: torch.dtype
    casts: tuple[torch.dtype, ...] = ()

    @property
    def numel(self) -> int:
        """Number of output elements the block writes."""
        return math.prod(self.shape)

    @property
    def read_numel(self) -> int:
        """Number of distinct source elements the block reads (broadcast dims read once)."""
        return math.prod(n for n, s in zip(self.shape, self.src_strides) if s != 0)

    def source_runs(self) -> list[tuple[int, int]]:
        """Contiguous runs of source elements the block reads, as sorted ``(start, length)`` pairs.

        Broadcast dims are read once; runs that touch or overlap are merged.
        """
        dims = sorted(
            ((n, abs(s)) for n, s in zip(self.shape, self.src_strides) if s != 0 and n > 1),
            key=lambda t: -t[1],
        )
        start = self.src_offset + sum((n - 1) * s for n, s in zip(self.shape, self.src_strides) if s < 0)
        run = 1
        while dims and dims[-1][1] == run:
            run *= dims.pop()[0]
        starts = [start]
        for n, s in dims:
            starts = [b + i * s for b in starts for i in range(n)]
        starts.sort()
        runs: list[tuple[int, int]] = []
        for b in starts:
            if runs and runs[-1][0] + runs[-1][1] >= b:
                a, length = runs[-1]
                runs[-1] = (a, max(length, b + run - a))
            else:
                runs.append((b, run))
        return runs

    def source_span(self) -> tuple[int, int]:
        """The smallest flat interval ``[lo, hi)`` of source elements holding every element read."""
        lo = self.src_offset + sum((n - 1) * s for n, s in zip(self.shape, self.src_strides) if s < 0)
        hi = self.src_offset + sum((n - 1) * s for n, s in zip(self.shape, self.src_strides) if s > 0)
        return lo, hi + 1

    def source_box(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
        """Describe the read as a box of the source, when the elements it reads are exactly one box.

        Returns:
            ``(offsets, lengths, dims)``: the source box, and for each block dim the source dim its first step
            moves along. In a plain (permuted) box read each block dim walks its own source dim with unit step;
            block dims may also split one source dim (heads x rows of ``q`` interleaved into a fused ``qkv``:
            both name that dim) or walk on across whole inner dims. None when the elements read are not one
            box (flips, broadcasts, steps, gaps).
        """
        box = _box_read(self)
        return None if box is None else box[:3]

    def box_relative(self) -> RemapBlock | None:
        """The same copy, reading from a tensor that holds only :meth:`source_box` (None when not a box read).

        Read the box (e.g. safetensors' ``get_slice``) into a C-contiguous tensor of the box's lengths, then
        execute the returned block on it: its ``source_shape`` is the box's lengths and its offset and strides
        are relative to the box.
        """
        box = _box_read(self)
        if box is None:
            return None
        _, lengths, _, strides = box
        return replace(self, src_offset=0, src_strides=strides, source_shape=lengths)


def _box_read(b: RemapBlock) -> tuple[tuple[int, ...], ...] | None:
    """``(offsets, lengths, dims, strides within the box)`` when ``b`` reads exactly one box of its source."""
    src_shape = b.source_shape
    strides = contiguous_strides(src_shape)
    offsets, rem = [], b.src_offset
    for st, n in zip(strides, src_shape):
        offsets.append(rem // st if n else 0)
        rem = rem % st if n else rem
    plain = _permuted_box(b, strides, offsets)
    if plain is not None:
        lengths, dims = plain
        within = contiguous_strides(lengths)
        return tuple(offsets), lengths, dims, tuple(within[d] for d in dims)
    if b.numel == 0 or any(s <= 0 for s in b.src_strides):
        return None
    # runs: block dims that continue each other in the source, merged (smallest stride first)
    runs: list[list] = []  # [base stride, length, member block dims]
    for s, n, j in sorted((s, n, j) for j, (n, s) in enumerate(zip(b.shape, b.src_strides)) if n > 1):
        if runs and s == runs[-1][0] * runs[-1][1]:
            runs[-1][1] *= n
            runs[-1][2].append(j)
        else:
            runs.append([s, n, [j]])
    lengths = [1] * len(src_shape)
    first: list[int] = []  # per run, the source dim it starts in
    for base, n, _ in runs:
        d = _sized_dim(strides, src_shape, base)
        first.append(d)
        while True:  # a run longer than its dim's room covers whole dims, then goes on in the next outer one
            if d is None or lengths[d] != 1:  # no such dim, or one an earlier run walks
                return None
            room = src_shape[d] - offsets[d]
            if n <= room:
                lengths[d] = n
                break
            if offsets[d] != 0 or n % src_shape[d]:
                return None
            lengths[d], n = src_shape[d], n // src_shape[d]
            d = _sized_dim(strides, src_shape, strides[d] * src_shape[d])
    if math.prod(lengths) != math.prod(n for n in b.shape if n > 1):
        return None
    within = contiguous_strides(lengths)
    dims, box_strides = [0] * len(b.shape), [0] * len(b.shape)
    for r, (base, _, members) in enumerate(runs):
        for j in members:
            k, d = b.src_strides[j] // base, first[r]
            box_strides[j] = k * within[d]
            while k >= lengths[d]:  # the run went on past whole dims: find the one this step lands in
                k //= lengths[d]
                d = _sized_dim(strides, src_shape, strides[d] * src_shape[d])
            dims[j] = d
    for j, (n, s) in enumerate(zip(b.shape, b.src_strides)):
        if n == 1:  # size-1 block dims read nothing more: name the dim of their stride, as a plain read does
            d = _sized_dim(strides, src_shape, s)
            if d is None:
                return None
            dims[j], box_strides[j] = d, within[d]
    return tuple(offsets), tuple(lengths), tuple(dims), tuple(box_strides)


def _permuted_box(b: RemapBlock, strides: tuple[int, ...], offsets: list[int]) -> tuple[tuple, tuple] | None:
    """``(lengths, dims)`` when each block dim walks its own source dim with unit step, else None."""
    lengths = [1] * len(b.source_shape)
    dims: list[int] = []
    for n, s in zip(b.shape, b.src_strides):
        if s <= 0 or s not in strides:
            return None
        d = strides.index(s)
        # dims sharing a stride are one dim of any size followed by size-1 dims: walk the sized one
        while d + 1 < len(strides) and strides[d + 1] == s and b.source_shape[d] == 1:
            d += 1
        if lengths[d] != 1 or offsets[d] + n > b.source_shape[d] or d in dims:
            return None
        lengths[d] = n
        dims.append(d)
    return tuple(lengths), tuple(dims)


def _sized_dim(strides: tuple[int, ...], shape: tuple[int, ...], stride: int) -> int | None:
    """The source dim of more than one element whose stride is ``stride`` (None if there is none)."""
    for d, (s, n) in enumerate(zip(strides, shape)):
        if s == stride and n > 1:
            return d
    return None


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
    weights = _weights(factors)
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
        src.name, tuple(shape), piece.base + delta, tuple(src_strides), tuple(dst_offset), tuple(dst_dims),
        tuple(dst_steps), tuple(src.shape), src.dtype, piece.casts,
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
    return (j, b.source, src_offset, dst_offset, b.shape[:j] + b.shape[j + 1 :], b.src_strides, b.dst_dims,
            b.dst_steps, b.casts)


def _end(a: RemapBlock, j: int) -> tuple[int, tuple[int, ...]]:
    n = a.shape[j]
    dst = list(a.dst_offset)
    dst[a.dst_dims[j]] += n * a.dst_steps[j]
    return a.src_offset + n * a.src_strides[j], tuple(dst)
