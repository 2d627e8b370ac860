"""One output dim of a piece as a mixed-radix number: factors, axes, their normal form, and intervals of them.

Vocabulary (as in :mod:`regiontrace.region`):

- **factor** ``(radix, lo, hi, stride)``: one digit of a mixed-radix decomposition. A coordinate's digit
  must lie in ``[lo, hi)`` (the *coverage*) and contributes ``(digit - lo) * stride`` to the source offset.
- **axis** ``(start, factors)``: one output dim of a piece. It spans the interval
  ``[start, start + prod(radix))`` of the output dim; ``y - start`` is decomposed exactly over the radices
  (major first). Coverage per factor lets a piece cover an *interleaved* set (e.g. every other row).

:func:`normalize_axis` is the one normal form; :func:`interval_boxes` and :func:`restrict_axis` cut an axis to an
interval of its coordinates exactly (at most ``2m - 1`` parts for ``m`` factors).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple


class Factor(NamedTuple):
    """One mixed-radix digit: coverage ``[lo, hi)`` of ``[0, radix)``, source ``stride`` per digit."""

    radix: int
    lo: int
    hi: int
    stride: int


@dataclass(frozen=True, slots=True)
class Axis:
    """One output dim of a piece: the interval ``[start, start + length)`` and its factors (major first)."""

    start: int
    factors: tuple[Factor, ...]

    @property
    def length(self) -> int:
        return math.prod(f.radix for f in self.factors)

    @property
    def radices(self) -> tuple[int, ...]:
        return tuple(f.radix for f in self.factors)

    def shifted(self, by: int) -> Axis:
        return Axis(self.start + by, self.factors)


# ---------------------------------------------------------------------------------------------------
# normal form


def _merge_pair(a: Factor, b: Factor) -> Factor | None:
    """Merge major factor ``a`` with minor factor ``b`` when the pair is one affine digit."""
    if b.lo == 0 and b.hi == b.radix and a.stride == b.stride * b.radix:
        return Factor(a.radix * b.radix, a.lo * b.radix, a.hi * b.radix, b.stride)
    if a.hi - a.lo == 1:
        return Factor(a.radix * b.radix, a.lo * b.radix + b.lo, a.lo * b.radix + b.hi, b.stride)
    return None


def normalize_axis(axis: Axis) -> Axis | None:
    """The normal form of an axis, or None when it covers nothing.

    Drops radix-1 factors, merges adjacent factors that form one affine digit, and shrinks the interval
    so the leading factor is fully covered. A single-digit coverage gets stride 0 (its stride is unused).
    """
    stack: list[Factor] = []
    for f in axis.factors:
        if f.hi <= f.lo:
            return None
        if f.radix == 1:
            continue
        while stack:
            merged = _merge_pair(stack[-1], f)
            if merged is None:
                break
            stack.pop()
            f = merged
        stack.append(Factor(f.radix, f.lo, f.hi, 0) if f.hi - f.lo == 1 else f)
    start = axis.start
    while stack and (stack[0].lo != 0 or stack[0].hi != stack[0].radix):
        f = stack[0]
        start += f.lo * math.prod(g.radix for g in stack[1:])
        if f.hi - f.lo == 1:
            stack.pop(0)
        else:
            stack[0] = Factor(f.hi - f.lo, 0, f.hi - f.lo, f.stride)
    if stack and stack[0].radix == 1:
        stack.pop(0)
    return Axis(start, tuple(stack))


# ---------------------------------------------------------------------------------------------------
# mixed-radix intervals


def interval_boxes(a0: int, a1: int, radices: Sequence[int]) -> list[tuple[tuple[int, ...], int, int]]:
    """Decompose the interval ``[a0, a1)`` of a mixed-radix space into at most ``2m - 1`` boxes.

    Returns:
        ``(prefix, lo, hi)`` triples: the leading digits are fixed to ``prefix``, the next digit ranges
        over ``[lo, hi)`` and every later digit is full.
    """
    out: list[tuple[tuple[int, ...], int, int]] = []
    _interval_boxes(a0, a1, tuple(radices), (), out)
    return out


def _interval_boxes(a0: int, a1: int, radices: tuple[int, ...], prefix: tuple, out: list) -> None:
    if a0 >= a1:
        return
    w = math.prod(radices[1:])
    if a0 % w == 0 and a1 % w == 0:
        out.append((prefix, a0 // w, a1 // w))
        return
    d0, d1 = a0 // w, (a1 - 1) // w
    if d0 == d1:
        _interval_boxes(a0 - d0 * w, a1 - d0 * w, radices[1:], prefix + (d0,), out)
        return
    lo = d0
    if a0 % w:
        _interval_boxes(a0 % w, w, radices[1:], prefix + (d0,), out)
        lo = d0 + 1
    hi = d1 + 1 if a1 % w == 0 else d1
    if hi > lo:
        out.append((prefix, lo, hi))
    if a1 % w:
        _interval_boxes(0, a1 % w, radices[1:], prefix + (d1,), out)


def box_ranges(factors: Sequence[Factor], prefix: Sequence[int], lo: int, hi: int) -> list[tuple[int, int]] | None:
    """Digit ranges of an :func:`interval_boxes` box intersected with the factors' coverage (None: empty)."""
    ranges = []
    k = len(prefix)
    for j, f in enumerate(factors):
        if j < k:
            a, b = prefix[j], prefix[j] + 1
        elif j == k:
            a, b = lo, hi
        else:
            a, b = 0, f.radix
        a, b = max(a, f.lo), min(b, f.hi)
        if a >= b:
            return None
        ranges.append((a, b))
    return ranges


def restrict_axis(axis: Axis, a0: int, a1: int) -> list[tuple[int, Axis]]:
    """Split ``axis`` restricted to the axis-local interval ``[a0, a1)`` into exact sub-axes.

    Returns:
        ``(delta, axis)`` pairs: the sub-axis (same coordinates as ``axis``) and its base-offset change.
    """
    if a0 <= 0 and a1 >= axis.length:
        return [(0, axis)]
    if not axis.factors:
        return [(0, axis)] if a0 <= 0 < a1 else []
    out = []
    fs = axis.factors
    weights = digit_weights(fs)
    for prefix, lo, hi in interval_boxes(max(a0, 0), min(a1, axis.length), axis.radices):
        ranges = box_ranges(fs, prefix, lo, hi)
        if ranges is None:
            continue
        k = len(prefix)
        delta = sum((ranges[j][0] - fs[j].lo) * fs[j].stride for j in range(k + 1))
        offset = sum(prefix[j] * weights[j] for j in range(k)) + lo * weights[k]
        a, b = ranges[k]
        head = Factor(hi - lo, a - lo, b - lo, fs[k].stride)
        out.append((delta, Axis(axis.start + offset, (head,) + fs[k + 1 :])))
    return out


def digit_weights(factors: Sequence[Factor]) -> list[int]:
    weights, acc = [], 1
    for f in reversed(factors):
        weights.append(acc)
        acc *= f.radix
    return weights[::-1]


def split_leading(axis: Axis) -> Iterator[tuple[int, Axis]]:
    """Enumerate the covered leading digits of a multi-factor axis, one sub-axis each."""
    f0, rest = axis.factors[0], axis.factors[1:]
    w = math.prod(f.radix for f in rest)
    for d in range(f0.lo, f0.hi):
        yield (d - f0.lo) * f0.stride, Axis(axis.start + d * w, rest)
