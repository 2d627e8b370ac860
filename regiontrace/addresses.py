"""Addresses: where a view of a destination lies in its storage, read and overwritten as regions.

Vocabulary (as in :mod:`regiontrace.writes`, plus):

- **address**: ``(shape, stride, storage offset)`` of a view's meta tensor, over the destination's flat storage.
- **levels**: an address whose strides, sorted, each divide the next without a carry is a box of the content
  reshaped to mixed-radix levels (one per stride group, plus gap digits, major first); reading and writing it
  are ``narrow``, ``reshape``, ``permute`` and ``cat`` of regions. An address whose strides do not chain is split
  along its dim of fewest elements, one part per element: exact, less compact.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from . import region as R
from .constants import constant_region
from .errors import Untraceable
from .reshape import reshape

__all__ = ["Address", "Level", "address", "box_of", "levels", "overwrite", "read"]


Address = tuple[tuple[int, ...], tuple[int, ...], int]
#: one level, major first: (radix, lo, count, the view dims it walks, major first)
Level = tuple[int, int, int, tuple[int, ...]]


def address(meta: torch.Tensor) -> Address:
    """The address of a view: ``(shape, stride, storage offset)`` of its meta tensor."""
    return tuple(meta.shape), tuple(meta.stride()), meta.storage_offset()


def levels(addr: Address, numel: int) -> tuple[int, list[Level]] | None:
    """``(start, levels)``: the address's elements are ``start`` plus mixed-radix digits over the levels; None
    when the strides do not chain (a carry, a stride that does not divide the next).

    Raises:
        Untraceable: a broadcast (stride 0), or an address past the destination's end.
    """
    shape, stride, offset = addr
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    for s, n, d in sorted((s, n, d) for d, (n, s) in enumerate(zip(shape, stride)) if n > 1):
        if s <= 0:
            raise Untraceable(f"an address with stride {s} (a broadcast) is not a box of the destination")
        if groups and groups[-1][0] * groups[-1][1] == s:
            groups[-1] = (groups[-1][0], groups[-1][1] * n, (d,) + groups[-1][2])
        else:
            groups.append((s, n, (d,)))
    if offset + sum((n - 1) * s for n, s in zip(shape, stride) if n) >= numel:
        raise Untraceable(f"the view {shape} with strides {stride} reaches past the destination")
    if not groups:
        return offset, [(1, 0, 1, ())]
    out: list[Level] = [(groups[0][0], offset % groups[0][0], 1, ())] if groups[0][0] > 1 else []
    for (s, n, dims), nxt in zip(groups, groups[1:]):
        radix, lo = nxt[0] // s, (offset // s) % (nxt[0] // s)
        if nxt[0] % s or lo + n > radix:
            return None
        out.append((radix, lo, n, dims))
    top, n, dims = groups[-1]
    start = offset // top * top
    return start, [(n, 0, n, dims)] + out[::-1]


def _leveled(content: R.Region, start: int, lv: list[Level]) -> R.Region:
    """``content``'s elements from ``start`` on as the levels' shape; past its end (the top level's last digit
    may overhang: elements the address never reaches) a filler constant."""
    numel, span = math.prod(content.shape), math.prod(r for r, *_ in lv)
    flat = reshape(content, (numel,))
    if start + span > numel:
        filler = constant_region(0, (start + span - numel,), torch.int64)
        flat = R.cat([flat, filler], 0, (start + span,))
    return reshape(R.narrow(flat, 0, start, start + span), [r for r, *_ in lv])


def read(content: R.Region, base: tuple[int, ...], addr: Address) -> R.Region:
    """The region a view at ``addr`` reads from ``content`` (of the destination's shape ``base``)."""
    shape, stride, offset = addr
    if math.prod(shape) == 0:
        return R.Region(shape, ())
    if shape == base and stride == R.contiguous_strides(base) and offset == 0:
        return content
    sizes = tuple(1 if s == 0 else n for n, s in zip(shape, stride))
    chained = levels((sizes, stride, offset), math.prod(base))
    if chained is None:  # split the dim of fewest elements, one part per element: exact, less compact
        d = _split_dim(sizes)
        parts = [read(content, base, _part((sizes, stride, offset), d, i)) for i in range(sizes[d])]
        R.check_piece_budget(sum(len(p.pieces) for p in parts), "a view whose strides do not chain")
        x = R.cat(parts, d, sizes)
        return R.expand(x, shape) if sizes != shape else x
    start, lv = chained
    x = _leveled(content, start, lv)
    for d, (r, lo, n, _) in enumerate(lv):
        if n != r:
            x = R.narrow(x, d, lo, lo + n)
    order = [d for *_, dims in lv for d in dims]
    x = reshape(x, [sizes[d] for d in order])
    x = reshape(R.permute(x, [order.index(d) for d in sorted(order)]), sizes)
    return R.expand(x, shape) if sizes != shape else x


def overwrite(content: R.Region, base: tuple[int, ...], addr: Address, value: R.Region) -> R.Region:
    """``content`` with the view at ``addr`` replaced by ``value`` (of the view's shape)."""
    shape = addr[0]
    if math.prod(shape) == 0:
        return content
    _check_no_overlap(addr)
    boxed = box_of(addr, base)
    if boxed is not None:  # a box of the destination's own shape: overlaid there, no flattening of the content
        box, order = boxed
        walks = [k for k, n in enumerate(shape) if n > 1]  # the view's dims of more than one element
        v = R.permute(reshape(value, [shape[k] for k in walks]), [walks.index(k) for k in order])
        return _overlay(content, reshape(v, [hi - lo for lo, hi in box]), box)
    chained = levels(addr, math.prod(base))
    if chained is None:  # split the dim of fewest elements, one write per element
        d = _split_dim(shape)
        for i in range(shape[d]):
            content = overwrite(content, base, _part(addr, d, i), R.narrow(value, d, i, i + 1))
        R.check_piece_budget(len(content.pieces), "a write whose strides do not chain")
        return content
    start, lv = chained
    numel, span = math.prod(base), math.prod(r for r, *_ in lv)
    order = [d for *_, dims in lv for d in dims]
    v = reshape(value, [shape[d] for d in sorted(order)])
    v = reshape(R.permute(v, [sorted(order).index(d) for d in order]), [n for _, _, n, _ in lv])
    x = _overlay(_leveled(content, start, lv), v, [(lo, lo + n) for _, lo, n, _ in lv])
    flat = reshape(content, (numel,))
    mid = R.narrow(reshape(x, (span,)), 0, 0, min(span, numel - start))
    parts = [R.narrow(flat, 0, 0, start), mid, R.narrow(flat, 0, min(start + span, numel), numel)]
    return reshape(R.cat(parts, 0, (numel,)), base)


def box_of(addr: Address, base: tuple[int, ...]) -> tuple[list[tuple[int, int]], list[int]] | None:
    """``(box, order)`` when the view at ``addr`` is a box of the destination's shape ``base`` (each of its dims of
    more than one element walks a distinct dim of ``base`` at that dim's contiguous stride): the box's bounds per
    dim of ``base``, and the view's dims of more than one element in the order of the dims they walk; else None."""
    shape, stride, offset = addr
    strides = R.contiguous_strides(base)
    numel = math.prod(base)
    if not 0 <= offset < max(numel, 1):
        return None
    start = [(offset // s) % n if n else 0 for s, n in zip(strides, base)]
    size = [1] * len(base)
    walked: dict[int, int] = {}  # base dim -> view dim
    for k, (n, s) in enumerate(zip(shape, stride)):
        if n == 1:
            continue
        dims = [d for d in range(len(base)) if strides[d] == s and base[d] > 1 and d not in walked]
        if len(dims) != 1:
            return None
        walked[dims[0]] = k
        size[dims[0]] = n
    if any(start[d] + size[d] > base[d] for d in range(len(base))):
        return None
    return [(a, a + n) for a, n in zip(start, size)], [walked[d] for d in sorted(walked)]


def _split_dim(shape: Sequence[int]) -> int:
    return min((n, d) for d, n in enumerate(shape) if n > 1)[1]


def _part(addr: Address, d: int, i: int) -> Address:
    """Element ``i`` of dim ``d`` of the view at ``addr`` (kept as a size-1 dim)."""
    shape, stride, offset = addr
    return shape[:d] + (1,) + shape[d + 1 :], stride, offset + i * stride[d]


def _check_no_overlap(addr: Address) -> None:
    """Refuse a write through a view whose elements may share storage (torch refuses such writes too)."""
    reach = 0
    for s, n in sorted((s, n) for n, s in zip(addr[0], addr[1]) if n > 1):
        if s <= reach:
            what = " (a broadcast)" if s == 0 else ""
            raise Untraceable(f"a write through the view {addr[0]} with strides {addr[1]}: its elements overlap{what}")
        reach += (n - 1) * s


def _overlay(old: R.Region, new: R.Region, box: Sequence[tuple[int, int]], d: int = 0) -> R.Region:
    """``old`` with the box replaced by ``new`` (of the box's shape)."""
    if d == len(box):
        return new
    lo, hi = box[d]
    if (lo, hi) == (0, old.shape[d]):
        return _overlay(old, new, box, d + 1) if d + 1 < len(box) else new
    mid = _overlay(R.narrow(old, d, lo, hi), new, box, d + 1)
    return R.cat([R.narrow(old, d, 0, lo), mid, R.narrow(old, d, hi, old.shape[d])], d, old.shape)
