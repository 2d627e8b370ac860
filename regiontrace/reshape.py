"""Reshape of a region: exact, splitting pieces only where no affine form exists.

``view_groups`` pairs groups of old and new dims with equal products (size-1 dims aside). Within a group
each piece's axes are extended to their full dims and concatenated into one flat axis
(:func:`extend_full`), then cut into the new dims (:func:`_split_axis`), refining one factor where a cut
falls inside it (:func:`_cut`). A cut that no factorization allows splits the piece along its leading
digits, down to single-factor intervals, which always split into at most ``2m - 1`` boxes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from .radix import Axis, Factor, interval_boxes, normalize_axis, split_leading
from .region import Piece, Region, check_piece_budget, finish_region, normal_piece


def view_groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair groups of dims of ``old`` and ``new`` (size-1 dims excluded) with equal products."""
    groups, i, j = [], 0, 0
    while i < len(old) or j < len(new):
        gi, gj = [i], [j]
        pi, pj = old[i], new[j]
        i, j = i + 1, j + 1
        while pi != pj:
            if pi < pj:
                gi.append(i)
                pi *= old[i]
                i += 1
            else:
                gj.append(j)
                pj *= new[j]
                j += 1
        groups.append((gi, gj))
    return groups


def reshape(region: Region, shape: Sequence[int]) -> Region:
    shape = tuple(shape)
    if shape == region.shape:
        return region
    if math.prod(shape) == 0:
        return Region(shape, ())
    keep_in = [d for d, n in enumerate(region.shape) if n != 1]
    keep_out = [d for d, n in enumerate(shape) if n != 1]
    groups = view_groups([region.shape[d] for d in keep_in], [shape[d] for d in keep_out])
    pieces: list[Piece] = []
    for p in region.pieces:
        options = []
        for gi, gj in groups:
            axes = [p.axes[keep_in[i]] for i in gi]
            sizes_in, sizes_out = [region.shape[keep_in[i]] for i in gi], [shape[keep_out[j]] for j in gj]
            options.append(_reshape_group(axes, sizes_in, sizes_out))
        check_piece_budget(len(pieces) + math.prod(len(o) for o in options), f"reshape {region.shape} -> {shape}")
        for combo in itertools.product(*options):
            out_axes = [Axis(0, ())] * len(shape)
            delta = 0
            for (_, gj), (d, axes) in zip(groups, combo):
                delta += d
                for j, a in zip(gj, axes):
                    out_axes[keep_out[j]] = a
            new = normal_piece(p, out_axes, delta)
            if new is not None:
                pieces.append(new)
    return finish_region(shape, pieces, f"reshape {region.shape} -> {shape}")


def _reshape_group(axes: list[Axis], sizes: list[int], out_sizes: list[int]) -> list[tuple[int, tuple[Axis, ...]]]:
    if len(sizes) == 1 and len(out_sizes) == 1:
        return [(0, (axes[0],))]
    out = []
    for parts in itertools.product(*(extend_full(a, n) for a, n in zip(axes, sizes))):
        delta = sum(d for d, _ in parts)
        flat = normalize_axis(Axis(0, tuple(f for _, fs in parts for f in fs)))
        if flat is None:
            continue
        out.extend((delta + d2, axs) for d2, axs in _split_axis(flat, out_sizes))
        check_piece_budget(len(out), "reshape")
    return out


def extend_full(axis: Axis, n: int) -> list[tuple[int, tuple[Factor, ...]]]:
    """Re-express ``axis`` over the full dim ``[0, n)``, splitting it where no exact form exists."""
    s, fs = axis.start, axis.factors
    length = axis.length
    if length == n:
        return [(0, fs)]
    if not fs:
        return [(0, (Factor(n, s, s + 1, 0),))]
    f0 = fs[0]
    w = length // f0.radix
    if s % w == 0 and n % w == 0:
        return [(0, (Factor(n // w, s // w + f0.lo, s // w + f0.hi, f0.stride),) + fs[1:])]
    out = []
    for delta, sub in split_leading(axis):
        out.extend((delta + d2, f) for d2, f in extend_full(sub, n))
    return out


def _split_axis(axis: Axis, out_sizes: list[int]) -> list[tuple[int, tuple[Axis, ...]]]:
    """Split one flat axis into axes over ``out_sizes`` (row-major), exactly."""
    if len(out_sizes) == 1:
        return [(0, (axis,))]
    m = math.prod(out_sizes[1:])
    s, fs, length = axis.start, axis.factors, axis.length
    out: list[tuple[int, tuple[Axis, ...]]] = []
    if s % m == 0 and length % m == 0:
        cuts = _cut(fs, m)
        if cuts is not None:
            for delta, major, minor in cuts:
                head, tail = normalize_axis(Axis(s // m, major)), normalize_axis(Axis(0, minor))
                if head is None or tail is None:
                    continue
                out.extend((delta + d2, (head,) + rest) for d2, rest in _split_axis(tail, out_sizes[1:]))
            return out
    if s // m == (s + length - 1) // m:
        inner = Axis(s % m, fs)
        return [(d2, (Axis(s // m, ()),) + rest) for d2, rest in _split_axis(inner, out_sizes[1:])]
    if len(fs) > 1:
        for delta, sub in split_leading(axis):
            sub = normalize_axis(sub)
            if sub is not None:
                out.extend((delta + d2, axs) for d2, axs in _split_axis(sub, out_sizes))
            check_piece_budget(len(out), "reshape")
        return out
    stride = fs[0].stride
    weights = [math.prod(out_sizes[k + 1 :]) for k in range(len(out_sizes))]
    for prefix, lo, hi in interval_boxes(s, s + length, out_sizes):
        k = len(prefix)
        axes = [Axis(p, ()) for p in prefix]
        axes.append(Axis(lo, (Factor(hi - lo, 0, hi - lo, stride * weights[k]),)))
        axes += [Axis(0, (Factor(n, 0, n, stride * weights[j]),)) for j, n in enumerate(out_sizes) if j > k]
        flat = sum(p * w for p, w in zip(prefix, weights)) + lo * weights[k]
        out.append(((flat - s) * stride, tuple(normalize_axis(a) for a in axes)))
    return out


def _cut(fs: tuple[Factor, ...], m: int) -> list[tuple[int, tuple[Factor, ...], tuple[Factor, ...]]] | None:
    """Cut factors so the minor part has exactly ``m`` positions; refine one factor if needed."""
    t = 1
    for k in range(len(fs) - 1, -1, -1):
        if t == m:
            return [(0, fs[: k + 1], fs[k + 1 :])]
        f = fs[k]
        if t < m < t * f.radix:
            if m % t or (t * f.radix) % m:
                return None
            a = m // t
            b = f.radix // a
            if f.lo % a == 0 and f.hi % a == 0:
                parts = [(Factor(b, f.lo // a, f.hi // a, a * f.stride), Factor(a, 0, a, f.stride))]
            elif f.lo // a == (f.hi - 1) // a:
                major = Factor(b, f.lo // a, f.lo // a + 1, 0)
                parts = [(major, Factor(a, f.lo % a, (f.hi - 1) % a + 1, f.stride))]
            else:
                parts = []
                for prefix, lo, hi in interval_boxes(f.lo, f.hi, (b, a)):
                    if prefix:
                        parts.append((Factor(b, prefix[0], prefix[0] + 1, 0), Factor(a, lo, hi, f.stride)))
                    else:
                        parts.append((Factor(b, lo, hi, a * f.stride), Factor(a, 0, a, f.stride)))
            out = []
            for major, minor in parts:
                first = major.lo * a + minor.lo
                out.append(((first - f.lo) * f.stride, fs[:k] + (major,), (minor,) + fs[k + 1 :]))
            return out
        t *= f.radix
    if t == m:
        return [(0, (), fs)]
    return None
