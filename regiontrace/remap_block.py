"""RemapBlock: one strided copy from one source into a box, and which source elements it reads.

A :class:`RemapBlock` walks a block index ``b`` over ``shape``. It reads source element (flat, C-contiguous)
``src_offset + sum(b[j] * src_strides[j])`` and writes the box-local output element whose coordinate in
dim ``dst_dims[j]`` is ``dst_offset[dim] + sum(b[j] * dst_steps[j])``.

Its *read layout* (:class:`ReadLayout`) says where the elements it reads lie (equal contiguous runs, a span, flips)
and how they sit packed in a read buffer; :func:`box_read` describes the read as a box of the source when it is
one. One implementation for every reader: the block's :meth:`~RemapBlock.read_layout`,
:meth:`~RemapBlock.source_runs`, :meth:`~RemapBlock.source_span` and :meth:`~RemapBlock.source_box` are built here,
and so are the loader's executor (staging buffers, span reads) and its plan's byte counts
(:mod:`regiontrace.block_reads`). Compiling a region into blocks is :mod:`regiontrace.compile`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch

from .region import contiguous_strides
from .run_grid import RunGrid

__all__ = ["Box", "ReadLayout", "RemapBlock", "box_read", "read_layout", "source_span"]


#: a box of a tensor: per dim, the half-open interval ``(start, stop)``
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class RemapBlock:
    """Copy strided elements of source ``source`` into strided elements of the output box.

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
        if 0 not in self.src_strides:  # no broadcast dim (almost every block): every element is read once
            return math.prod(self.shape)
        return math.prod(n for n, s in zip(self.shape, self.src_strides) if s != 0 or n == 0)

    def read_layout(self) -> ReadLayout:
        """Where the elements the block reads lie (runs, span, flips) and how they sit in a packed buffer."""
        return read_layout(self)

    def source_runs(self) -> list[tuple[int, int]]:
        """Contiguous runs of source elements the block reads, as sorted ``(start, length)`` pairs.

        Broadcast dims are read once; runs that touch or overlap are merged.
        """
        return read_layout(self).merged_runs()

    def source_span(self) -> tuple[int, int]:
        """The smallest flat interval ``[lo, hi)`` of source elements holding every element read."""
        return source_span(self)

    def source_box(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]] | None:
        """Describe the read as a box of the source, when the elements it reads are exactly one box.

        Returns:
            ``(offsets, lengths, dims)``: the source box, and for each block dim the source dim its first step
            moves along. In a plain (permuted) box read each block dim walks its own source dim with unit step;
            block dims may also split one source dim (heads x rows of ``q`` interleaved into a fused ``qkv``:
            both name that dim) or walk on across whole inner dims. None when the elements read are not one
            box (flips, broadcasts, steps, gaps).
        """
        box = box_read(self)
        return None if box is None else box[:3]

    def box_relative(self) -> RemapBlock | None:
        """The same copy, reading from a tensor that holds only :meth:`source_box` (None when not a box read).

        Read the box (e.g. safetensors' ``get_slice``) into a C-contiguous tensor of the box's lengths, then
        execute the returned block on it: its ``source_shape`` is the box's lengths and its offset and strides
        are relative to the box.
        """
        box = box_read(self)
        if box is None:
            return None
        _, lengths, _, strides = box
        return replace(self, src_offset=0, src_strides=strides, source_shape=lengths)


@dataclass(frozen=True, slots=True)
class ReadLayout:
    """Where the source elements of a block lie, and how they sit in a read buffer.

    The block reads ``count`` runs of ``run`` contiguous source elements, a :meth:`grid` of them (``outer``
    over ``base``), whose count, span, merged runs and page spans are arithmetic; :attr:`runs` lists their flat
    start offsets in *packed order*: the block dims not inside a run are enumerated, the one of largest source
    stride major. Broadcast dims (stride 0) are read once. Read the runs one after another into a buffer and
    :meth:`packed_view` is the block's read; read the span ``[base, end)`` and :meth:`span_view` is.

    Attributes:
        shape: the block's index space.
        base: lowest flat source element read (block index 0 moved to the far end of every flipped dim).
        end: one past the highest flat source element read (``base`` for an empty block).
        run: elements per contiguous run.
        outer: ``(size, source step)`` of the block dims enumerated into runs, major first.
        strides: per block dim, its stride in the packed buffer (0 for broadcast and size-1 dims).
        steps: per block dim, its stride in a buffer holding the source from ``base`` on (``|src_stride|``).
        flips: block dims (of size > 1) walked backwards in the source.
    """

    shape: tuple[int, ...]
    base: int
    end: int
    run: int
    outer: tuple[tuple[int, int], ...]
    strides: tuple[int, ...]
    steps: tuple[int, ...]
    flips: tuple[int, ...]
    _runs: tuple[int, ...] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def count(self) -> int:
        """Number of runs (without enumerating them)."""
        return 0 if 0 in self.shape else math.prod(n for n, _ in self.outer)

    @property
    def runs(self) -> tuple[int, ...]:
        """Flat source offsets of the runs, in packed order (unsorted and overlapping when block dims overlap).

        Enumerated on first use and kept by this layout (not by the block: a column shard has a run per row).
        """
        runs = self._runs
        if runs is None:
            starts = [] if 0 in self.shape else [self.base]
            for n, s in self.outer:
                starts = [b + i * s for b in starts for i in range(n)]
            runs = tuple(starts)
            object.__setattr__(self, "_runs", runs)
        return runs

    def grid(self, scale: int = 1, offset: int = 0) -> RunGrid:
        """The runs as a :class:`~regiontrace.run_grid.RunGrid` (count, span, merged runs, page spans in closed
        form), in units of ``1 / scale`` of an element from ``offset``: ``grid(itemsize, data_start)`` in bytes."""
        dims = ((0, 1),) if 0 in self.shape else tuple([(n, s * scale) for n, s in self.outer])
        return RunGrid(offset + self.base * scale, self.run * scale, dims)

    def merged_runs(self) -> list[tuple[int, int]]:
        """The runs as sorted ``(start, length)`` pairs, runs that touch or overlap merged."""
        return [(a, b - a) for a, b in self.grid().touching()]

    def packed_view(self, packed: torch.Tensor) -> torch.Tensor:
        """The block's read (block index order) from ``packed``, the runs read one after another."""
        view = torch.as_strided(packed, self.shape, self.strides)
        return view.flip(self.flips) if self.flips else view

    def span_view(self, span: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """The block's read (block index order) from ``span``, holding source element ``base`` at ``offset``."""
        view = torch.as_strided(span, self.shape, self.steps, offset)
        return view.flip(self.flips) if self.flips else view


def source_span(block: RemapBlock) -> tuple[int, int]:
    """The smallest flat interval ``[lo, hi)`` of source elements holding every element ``block`` reads."""
    lo = hi = block.src_offset
    if 0 in block.shape:
        return lo, lo
    for n, s in zip(block.shape, block.src_strides):
        if s < 0:
            lo += (n - 1) * s
        else:
            hi += (n - 1) * s
    return lo, hi + 1


def read_layout(block: RemapBlock) -> ReadLayout:
    """The read layout of ``block``: inner dims that continue one contiguous run kept as runs, the rest enumerated.

    Costs O(ndim); the runs are enumerated on first use of :attr:`ReadLayout.runs`.
    """
    shape, strides = block.shape, block.src_strides
    base, end = source_span(block)
    steps = tuple([abs(s) for s in strides])
    flips = tuple([j for j, s in enumerate(strides) if s < 0 and shape[j] > 1])
    dims = sorted([j for j, s in enumerate(strides) if s != 0 and shape[j] > 1], key=lambda j: -steps[j])
    packed = [0] * len(shape)
    run = 1
    while dims and steps[dims[-1]] == run:
        j = dims.pop()
        packed[j] = run
        run *= shape[j]
    weight = run
    for j in reversed(dims):
        packed[j] = weight
        weight *= shape[j]
    outer = tuple([(shape[j], steps[j]) for j in dims])
    return ReadLayout(shape, base, end, run, outer, tuple(packed), steps, flips)


# ---------------------------------------------------------------------------------------------------
# the read as a box of the source


def box_read(b: RemapBlock) -> tuple[tuple[int, ...], ...] | None:
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
