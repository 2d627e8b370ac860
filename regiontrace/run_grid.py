"""A grid of equal runs: where a strided block's reads lie, in closed form.

Vocabulary:

- a **run grid** (:class:`RunGrid`) is the runs ``[first + sum(i[k] * step[k]), + length)`` for every index ``i``
  of ``dims = ((n[0], step[0]), …)``, major first, steps positive: what a block reads (in elements, or in bytes
  once scaled by its itemsize, :meth:`~regiontrace.executor.ReadLayout.grid`);
- the **extent** of dim ``k``: the span of one of its sub-grids (one index of dim ``k``, every index inside it);
- the grid is **nested** when every dim's step reaches past the extent of the dim inside it: its runs are then
  disjoint and in source order, and the **gap** between consecutive sub-grids of dim ``k`` (the last run of one,
  the first of the next) is one number per dim;
- runs **join** along dim ``k`` when that gap is read through: the runs merged that way are again arithmetic on
  the dims, one decision per dim, so the count, span, touching runs and page spans of a column shard of 1024
  rows cost a few integer operations, not a walk over its rows. Only :meth:`RunGrid.starts` lists the runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["RunGrid"]

Spans = list[tuple[int, int]]


@dataclass(frozen=True, slots=True)
class RunGrid:
    """Runs of ``length`` at ``first + sum(i[k] * step[k])`` for every index ``i`` of ``dims``.

    Attributes:
        first: the lowest run's start.
        length: the length of each run (positive).
        dims: ``(n, step)`` per grid dim, major first, ``step > 0``; a dim of size 0 makes the grid empty.
    """

    first: int
    length: int
    dims: tuple[tuple[int, int], ...] = ()

    @property
    def count(self) -> int:
        """Number of runs."""
        return math.prod(n for n, _ in self.dims)

    @property
    def end(self) -> int:
        """One past the last byte (element) of the highest run; ``first`` when the grid is empty."""
        if self.count == 0:
            return self.first
        return self.first + sum((n - 1) * s for n, s in self.dims) + self.length

    @property
    def gaps(self) -> tuple[int, ...] | None:
        """Per dim, the gap between consecutive sub-grids (0 where they touch); None when not nested."""
        extent, out = self.length, []
        for n, s in reversed(self.dims):
            if s < extent:
                return None
            out.append(s - extent)
            extent += (n - 1) * s
        return tuple(reversed(out))

    def starts(self) -> np.ndarray:
        """The run starts, ascending (``int64``): the one place the runs are listed."""
        starts = np.array([self.first], dtype=np.int64)
        for n, s in self.dims:
            starts = (starts[:, None] + np.arange(n, dtype=np.int64) * s).reshape(-1)
        return starts if self.gaps is not None else np.sort(starts)

    def touching(self) -> Spans:
        """The runs as ``(start, end)`` ranges, runs that touch or overlap merged, ascending."""
        gaps = self.gaps
        if gaps is None:
            return _merge(self.starts(), self.length, lambda ends, starts: starts <= ends)
        return self.joined([g == 0 for g in gaps])

    def spans(self, page: int) -> Spans:
        """The runs merged into ``(start, end)`` ranges whose gaps hold no aligned ``page`` that no run touches:
        reading a range through its gaps reads no page more than the runs alone would.

        One decision per dim where it does not depend on where the gap falls: a gap of at most ``page - 1``
        never holds a whole page, one of at least ``2 * page - 1`` always does, and between the two the
        decision is the same for every gap of a dim whose step (and every outer dim's) is a multiple of
        ``page``. Otherwise, and for grids that are not nested, the runs are listed (:meth:`starts`).
        """
        if self.count == 0:
            return []
        gaps = self.gaps
        joins = None if gaps is None else _page_joins(self, gaps, page)
        if joins is None:
            return _merge(self.starts(), self.length, lambda ends, starts: starts // page - (ends - 1) // page <= 1)
        return self.joined(joins)

    def joined(self, joins: Sequence[bool]) -> Spans:
        """The runs of a nested grid as ``(start, end)`` ranges, ascending, joined along each dim ``k`` where
        ``joins[k]``: the last run of each sub-grid read together with the first run of the next."""
        if self.count == 0:
            return []
        starts = ends = None  # the spans of one sub-grid, relative to its first run: arrays once there are several
        hi = self.length
        for (n, s), join in zip(reversed(self.dims), reversed(joins)):
            if starts is None and join:
                hi += (n - 1) * s  # one span, stretched over the dim
                continue
            if starts is None:
                starts, ends = np.zeros(1, dtype=np.int64), np.array([hi], dtype=np.int64)
            shift = np.arange(n, dtype=np.int64)[:, None] * s
            starts, ends = starts[None, :] + shift, ends[None, :] + shift
            if join:  # each sub-grid's last span runs on into the next one's first
                starts = np.concatenate((starts[:1, :], starts[1:, 1:]), axis=None) if n > 1 else starts
                ends = np.concatenate((ends[:-1, :-1], ends[-1:, :]), axis=None) if n > 1 else ends
            starts, ends = starts.reshape(-1), ends.reshape(-1)
        if starts is None:
            return [(self.first, self.first + hi)]
        return list(zip((starts + self.first).tolist(), (ends + self.first).tolist()))


def _page_joins(grid: RunGrid, gaps: tuple[int, ...], page: int) -> list[bool] | None:
    """Per dim, whether its gaps hold no whole page — when that is the same for all of them — else None."""
    joins = []
    extent, extents = grid.length, []
    for n, s in reversed(grid.dims):
        extents.append(extent)
        extent += (n - 1) * s
    extents.reverse()
    for k, gap in enumerate(gaps):
        if gap < page:
            joins.append(True)
        elif gap >= 2 * page - 1:
            joins.append(False)
        elif all(s % page == 0 for _, s in grid.dims[: k + 1]):  # every such gap ends at one offset in its page
            end = grid.first + extents[k]  # the end of the first sub-grid of dim k
            joins.append((end + gap) // page - (end - 1) // page <= 1)
        else:
            return None
    return joins


def _merge(starts: np.ndarray, length: int, joins) -> Spans:
    """Sorted runs of ``length`` at ``starts`` merged where ``joins(end of one, start of the next)``."""
    if len(starts) == 0:
        return []
    ends = starts + length  # ascending too: the runs are of one length
    cut = np.flatnonzero(~joins(ends[:-1], starts[1:])) + 1
    firsts = np.concatenate(([0], cut))
    lasts = np.concatenate((cut - 1, [len(starts) - 1]))
    return list(zip(starts[firsts].tolist(), ends[lasts].tolist()))
