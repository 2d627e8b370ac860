"""The coverage certificate of a traced write program, read off a destination's regions (never counted).

Vocabulary (as in :mod:`regiontrace.writes`, plus):

- **Coverage**: per write, the boxes whose final value it wrote (a later write wins); the boxes no write reached
  (*unwritten*) and, among them, those holding the destination's prior contents rather than a constant
  (*undefined*); the boxes written more than once (*overwritten*); the boxes whose final value is a constant.
- **complete**: no element undefined. **exact**: complete, and no element written twice.

Each set is the output boxes of the pieces of one region that read one source: the destination keeps, as regions,
which write last wrote each element and which write an element's writer found there (:mod:`regiontrace.writes`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from . import region as R
from .constants import is_constant
from .radix import Axis
from .remap_block import Box
from .tensor import RegionTensor
from .writes import UNWRITTEN, Destination, Write, write_marker

__all__ = ["Coverage", "coverage", "piece_boxes", "region_boxes"]


@dataclass(frozen=True)
class Coverage:
    """Which elements of a destination were written, by which write, twice, or never (boxes, merged and sorted).

    Attributes:
        shape: the destination's shape.
        writes: the writes, in program order.
        written: per write (same order), the boxes whose final value it wrote.
        unwritten: boxes no write reached.
        undefined: unwritten boxes that hold the destination's prior contents (not a ``fill`` constant).
        overwritten: boxes written by more than one write (the last one's value is what they hold).
        constant: boxes whose final value is a constant (``fill_``, ``zero_``, padding, a ``fill``).
    """

    shape: tuple[int, ...]
    writes: tuple[Write, ...]
    written: tuple[tuple[Box, ...], ...]
    unwritten: tuple[Box, ...]
    undefined: tuple[Box, ...]
    overwritten: tuple[Box, ...]
    constant: tuple[Box, ...]

    @property
    def complete(self) -> bool:
        """Whether every element holds a written value or a constant."""
        return not self.undefined

    @property
    def exact(self) -> bool:
        """Whether every element is defined and none was written twice."""
        return self.complete and not self.overwritten


def coverage(tensor: RegionTensor) -> Coverage:
    """The coverage certificate of ``tensor``: a destination's writes, or a traced tensor (every element defined
    once, by the code that made it).

    Args:
        tensor: a :class:`~regiontrace.writes.Destination` (any view of it: the certificate is the whole
            destination's) or any index-mapped RegionTensor.
    """
    if not isinstance(tensor, Destination):
        region = tensor.region
        const = tuple(b for p in region.pieces if is_constant(p.source) for b in piece_boxes(p))
        return Coverage(region.shape, (), (), (), (), (), _merge(const))
    state = tensor._state
    writes = tuple(state.writes)
    written = tuple(region_boxes(state.last, write_marker(w.index).name) for w in writes)
    unwritten = region_boxes(state.last, UNWRITTEN.name)
    undefined = unwritten if state.prior is not None else ()  # unwritten elements hold the prior contents
    overwritten = _merge(b for w in writes for b in region_boxes(state.earlier, write_marker(w.index).name))
    const = _merge(b for p in state.content.pieces if is_constant(p.source) for b in piece_boxes(p))
    return Coverage(state.shape, writes, written, unwritten, undefined, overwritten, const)


def region_boxes(region: R.Region, source: str) -> tuple[Box, ...]:
    """The output boxes of ``region``'s pieces that read ``source`` (merged, sorted)."""
    return _merge(b for p in region.pieces if p.source.name == source for b in piece_boxes(p))


def piece_boxes(piece: R.Piece) -> list[Box]:
    """The output elements of ``piece`` as boxes: one interval per axis, or a few where a factor skips digits."""
    per_axis = [_intervals(ax) for ax in piece.axes]
    R.check_piece_budget(math.prod(len(i) for i in per_axis), "listing a piece's boxes")
    return [tuple(combo) for combo in itertools.product(*per_axis)]


def _intervals(axis: Axis) -> list[tuple[int, int]]:
    """The covered coordinates of ``axis`` as sorted intervals."""
    fs = list(axis.factors)
    inner = 1
    while fs and fs[-1].lo == 0 and fs[-1].hi == fs[-1].radix:  # full minor factors: one contiguous run
        inner *= fs.pop().radix
    lo, hi = 0, inner
    if fs:
        f = fs.pop()
        lo, hi = f.lo * inner, f.hi * inner
        inner *= f.radix
    out: list[tuple[int, int]] = []
    weights = [math.prod(g.radix for g in fs[k + 1 :]) * inner for k in range(len(fs))]
    for digits in itertools.product(*[range(g.lo, g.hi) for g in fs]):
        base = axis.start + sum(d * w for d, w in zip(digits, weights))
        out.append((base + lo, base + hi))
    return out


def _merge(boxes) -> tuple[Box, ...]:
    """Boxes that continue each other along one dim (all other dims equal) merged; sorted."""
    current = sorted(set(boxes))
    changed = True
    while changed and len(current) > 1:
        changed = False
        for d in range(len(current[0])):
            key = lambda b, d=d: (b[:d] + b[d + 1 :], b[d])
            merged: list[Box] = []
            for b in sorted(current, key=key):
                last = merged[-1] if merged else None
                if last is not None and key(last)[0] == key(b)[0] and last[d][1] == b[d][0]:
                    merged[-1] = last[:d] + ((last[d][0], b[d][1]),) + last[d + 1 :]
                    changed = True
                else:
                    merged.append(b)
            current = merged
    return tuple(sorted(current))
