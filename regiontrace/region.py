"""The index map behind a RegionTensor: a partition of the output into pieces of factored affine maps.

Vocabulary (used identically in code, docstrings and docs):

- **source**: a named checkpoint tensor, read as C-contiguous; a *source offset* is a flat element index.
- **factor** ``(radix, lo, hi, stride)``: one digit of a mixed-radix decomposition. A coordinate's digit
  must lie in ``[lo, hi)`` (the *coverage*) and contributes ``(digit - lo) * stride`` to the source offset.
- **axis** ``(start, factors)``: one output dim of a piece, the interval ``[start, start + prod(radix))``
  decomposed over the factors' radices (:mod:`regiontrace.radix`: factors, axes, their normal form).
- **piece**: a source, a *base* source offset (every digit at its ``lo``), one axis per output dim, and a
  chain of value casts. The pieces of a region partition its output.
- **region**: the index map of a RegionTensor: its shape and the pieces that partition it (never "a part of a
  tensor": that is a *box*, or a piece's elements).
- **box**: half-open ``(start, stop)`` per output dim.

Every op below (and :func:`regiontrace.reshape.reshape`) is a short pure function ``Region -> Region``;
:func:`~regiontrace.radix.normalize_axis` is the one normal form applied after every op. Pieces only split
where an exact affine description demands it, and never beyond :data:`PIECE_BUDGET`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import Untraceable
from .radix import Axis, Factor, normalize_axis, restrict_axis, split_leading

#: Upper bound on the pieces a single op may produce; beyond it tracing raises :class:`Untraceable`.
PIECE_BUDGET = 1 << 16


class Source(NamedTuple):
    """A named checkpoint tensor that pieces read from (C-contiguous)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, slots=True)
class Piece:
    """A box-like part of the output read from one source through a factored affine map."""

    source: Source
    base: int
    axes: tuple[Axis, ...]
    casts: tuple[torch.dtype, ...] = ()

    def with_axes(self, axes: Sequence[Axis], delta: int = 0) -> Piece:
        return Piece(self.source, self.base + delta, tuple(axes), self.casts)


@dataclass(frozen=True, slots=True)
class Region:
    """The whole index map: output shape and the pieces that partition it."""

    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]

    @staticmethod
    def leaf(source: Source) -> Region:
        shape = tuple(source.shape)
        if math.prod(shape) == 0:
            return Region(shape, ())
        strides = contiguous_strides(shape)
        axes = tuple(normalize_axis(Axis(0, (Factor(n, 0, n, s),))) for n, s in zip(shape, strides))
        return Region(shape, (Piece(source, 0, axes),))


# ---------------------------------------------------------------------------------------------------
# normal form


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def normal_piece(piece: Piece, axes: Sequence[Axis], delta: int = 0) -> Piece | None:
    """``piece`` with ``axes`` in normal form and its base moved by ``delta`` (None when an axis covers nothing)."""
    normal = []
    for ax in axes:
        n = normalize_axis(ax)
        if n is None:
            return None
        normal.append(n)
    return piece.with_axes(normal, delta)


def check_piece_budget(count: int, what: str) -> None:
    """Raise :class:`Untraceable` when ``what`` needs more than :data:`PIECE_BUDGET` pieces."""
    if count > PIECE_BUDGET:
        raise Untraceable(
            f"{what} needs {count} pieces, more than the budget of {PIECE_BUDGET}: the index map has no "
            "compact exact form"
        )


def finish_region(shape: Sequence[int], pieces: Sequence[Piece], what: str) -> Region:
    """The region of ``shape`` made of ``pieces`` (within the budget), pieces that continue each other merged."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return Region(shape, ())
    check_piece_budget(len(pieces), what)
    return Region(shape, merge_pieces(pieces))


def merge_pieces(pieces: Sequence[Piece]) -> tuple[Piece, ...]:
    """Merge pieces of one source that continue each other along one dim (e.g. ``cat(x.chunk(2))``)."""
    if len(pieces) < 2:
        return tuple(pieces)
    ndim = len(pieces[0].axes)
    current = list(pieces)
    for d in range(ndim):
        groups: dict[tuple, list[Piece]] = {}
        order: list[tuple] = []
        for p in current:
            ax = p.axes[d]
            single = len(ax.factors) == 1
            key = (p.source, p.casts, p.axes[:d], p.axes[d + 1 :], ax.factors[0].stride if single else None)
            if not single:
                key = key + (id(p),)
            if key not in groups:
                groups[key] = []
                order.append(key)
            groups[key].append(p)
        merged: list[Piece] = []
        for key in order:
            group = groups[key]
            if len(group) == 1:
                merged.extend(group)
                continue
            group.sort(key=lambda p: p.axes[d].start)
            run = group[0]
            for p in group[1:]:
                a, b = run.axes[d], p.axes[d]
                stride = a.factors[0].stride
                if b.start == a.start + a.length and p.base == run.base + a.length * stride:
                    n = a.length + b.length
                    axes = list(run.axes)
                    axes[d] = Axis(a.start, (Factor(n, 0, n, stride),))
                    run = run.with_axes(axes)
                else:
                    merged.append(run)
                    run = p
            merged.append(run)
        current = merged
    return tuple(current)


# ---------------------------------------------------------------------------------------------------
# movement ops: each a short pure function Region -> Region


def permute(region: Region, dims: Sequence[int]) -> Region:
    shape = tuple(region.shape[d] for d in dims)
    pieces = [p.with_axes([p.axes[d] for d in dims]) for p in region.pieces]
    return Region(shape, tuple(pieces))


def unsqueeze(region: Region, dim: int) -> Region:
    shape = region.shape[:dim] + (1,) + region.shape[dim:]
    pieces = [p.with_axes(p.axes[:dim] + (Axis(0, ()),) + p.axes[dim:]) for p in region.pieces]
    return Region(shape, tuple(pieces))


def squeeze(region: Region, dims: Sequence[int]) -> Region:
    drop = {d for d in dims if region.shape[d] == 1}
    shape = tuple(n for d, n in enumerate(region.shape) if d not in drop)
    pieces = [p.with_axes([a for d, a in enumerate(p.axes) if d not in drop]) for p in region.pieces]
    return Region(shape, tuple(pieces))


def expand(region: Region, shape: Sequence[int]) -> Region:
    """Broadcast size-1 dims (and new leading dims) to ``shape``; broadcast factors have stride 0."""
    shape = tuple(shape)
    lead = len(shape) - len(region.shape)
    if math.prod(shape) == 0:
        return Region(shape, ())

    def bcast(n: int) -> Axis:
        return normalize_axis(Axis(0, (Factor(n, 0, n, 0),)))

    pieces = []
    for p in region.pieces:
        axes = [bcast(n) for n in shape[:lead]]
        for d, a in enumerate(p.axes):
            n = shape[lead + d]
            axes.append(bcast(n) if region.shape[d] == 1 and n != 1 else a)
        pieces.append(p.with_axes(axes))
    return Region(shape, tuple(pieces))


def flip(region: Region, dims: Sequence[int]) -> Region:
    pieces = []
    for p in region.pieces:
        axes, delta = list(p.axes), 0
        for d in dims:
            a = axes[d]
            factors = []
            for f in a.factors:
                delta += (f.hi - f.lo - 1) * f.stride
                factors.append(Factor(f.radix, f.radix - f.hi, f.radix - f.lo, -f.stride))
            axes[d] = normalize_axis(Axis(region.shape[d] - a.start - a.length, tuple(factors)))
        pieces.append(p.with_axes(axes, delta))
    return Region(region.shape, tuple(pieces))


def narrow(region: Region, dim: int, start: int, stop: int, step: int = 1) -> Region:
    """Slice ``[start:stop:step]`` of ``dim`` (bounds already clamped like ATen, ``step >= 1``)."""
    stop = max(stop, start)
    size = -(-(stop - start) // step)
    shape = region.shape[:dim] + (size,) + region.shape[dim + 1 :]
    pieces: list[Piece] = []
    for p in region.pieces:
        ax = p.axes[dim]
        for delta, sub in restrict_axis(ax, start - ax.start, stop - ax.start):
            sub = normalize_axis(sub.shifted(-start))
            if sub is None:
                continue
            for delta2, sub2 in _step_axis(sub, step):
                axes = list(p.axes)
                axes[dim] = sub2
                new = normal_piece(p, axes, delta + delta2)
                if new is not None:
                    pieces.append(new)
        check_piece_budget(len(pieces), f"slicing dim {dim}")
    return finish_region(shape, pieces, f"slicing dim {dim}")


def _step_axis(axis: Axis, step: int) -> list[tuple[int, Axis]]:
    """Keep coordinates ``y`` with ``y % step == 0`` and renumber them ``y // step``."""
    if step == 1:
        return [(0, axis)]
    if len(axis.factors) > 1:
        out = []
        for delta, sub in split_leading(axis):
            sub = normalize_axis(sub)
            if sub is not None:
                out.extend((delta + d2, a) for d2, a in _step_axis(sub, step))
        return out
    s, length = axis.start, axis.length
    y0, y1 = -(-s // step), -(-(s + length) // step)
    if y0 >= y1:
        return []
    stride = axis.factors[0].stride if axis.factors else 0
    n = y1 - y0
    return [((y0 * step - s) * stride, Axis(y0, (Factor(n, 0, n, stride * step),)))]


def cat(regions: Sequence[Region], dim: int, shape: Sequence[int]) -> Region:
    pieces: list[Piece] = []
    offset = 0
    for r in regions:
        for p in r.pieces:
            axes = list(p.axes)
            axes[dim] = axes[dim].shifted(offset)
            pieces.append(p.with_axes(axes))
        offset += r.shape[dim]
    return finish_region(shape, pieces, "cat")


def cast(region: Region, dtype: torch.dtype) -> Region:
    """Record a value cast to ``dtype`` on every piece (applied on copy)."""
    pieces = [Piece(p.source, p.base, p.axes, append_cast(p.source.dtype, p.casts, dtype)) for p in region.pieces]
    return Region(region.shape, merge_pieces(pieces) if len(pieces) > 1 else tuple(pieces))


#: casts that keep every value exactly (a later cast may skip them; they invert)
EXACT_WIDENINGS = {
    (torch.bfloat16, torch.float32),
    (torch.bfloat16, torch.float64),
    (torch.float16, torch.float32),
    (torch.float16, torch.float64),
    (torch.float32, torch.float64),
    (torch.int8, torch.int16),
    (torch.int8, torch.int32),
    (torch.int8, torch.int64),
    (torch.int16, torch.int32),
    (torch.int16, torch.int64),
    (torch.int32, torch.int64),
    (torch.uint8, torch.int16),
    (torch.uint8, torch.int32),
    (torch.uint8, torch.int64),
}


def append_cast(src: torch.dtype, casts: tuple[torch.dtype, ...], dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The cast chain of a source of dtype ``src`` read through ``casts``, then cast to ``dtype`` (simplified)."""
    chain = (src,) + casts
    if chain[-1] == dtype:
        return casts
    # a previous cast that widened exactly loses nothing: cast straight from the dtype before it
    while len(chain) > 1 and (chain[-2], chain[-1]) in EXACT_WIDENINGS:
        chain = chain[:-1]
    if chain[-1] != dtype:
        chain = chain + (dtype,)
    return chain[1:]
