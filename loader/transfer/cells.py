"""The cells of a transfer's source: each source tensor cut by the grid of every rank's boxes of it, and which
holder of a cell sends it to a destination rank.

Vocabulary (as in :mod:`loader.transfer.plan`):

- **cell**: a box of a source tensor that a fixed set of ranks (its **owners**) hold whole, named
  ``"<tensor>@<index>"`` (the index in the grid, row-major).
- **sender**: the owner of a cell that sends it to a destination rank: the destination itself when it owns the
  cell, else ``owners[(index + destination) % len(owners)]`` (:func:`sender`). A function of the cell and the
  destination only, with no running state, so that a rank planning only its own moves chooses the same senders
  as the whole world's plan; consecutive destination ranks are dealt to the owners in turn (each owner sends a
  cell to one destination in every ``len(owners)`` consecutive ones), and the turn starts at another owner for
  each cell.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from regiontrace import Box

#: one rank's slot of one model tensor: global shape, dtype, and its ``(global box, local box)`` pairs
Slot = tuple[tuple[int, ...], torch.dtype, tuple[tuple[Box, Box], ...]]
#: one rank's slots of one model's tensors, by name (empty when the rank holds nothing of the model)
Slots = Mapping[str, Slot]


@dataclass(frozen=True)
class Cell:
    """A box of source tensor ``tensor`` held whole by each of ``owners``: ``(rank, the box in its local
    shard)``, in rank order; ``index``: its place in the tensor's grid (row-major)."""

    tensor: str
    box: Box
    owners: tuple[tuple[int, Box], ...]
    index: int = 0


def numel(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def sender(cell: Cell, dst: int) -> int:
    """The owner of ``cell`` that sends it to destination rank ``dst`` (see the module's vocabulary)."""
    ranks = [r for r, _ in cell.owners]
    if dst in ranks:
        return dst
    return ranks[(cell.index + dst) % len(ranks)]


def tensor_cells(
    name: str, shape: Sequence[int], src_parts: Sequence[Slots], cache: dict[Hashable, tuple[int, list[Cell]]]
) -> tuple[int, list[Cell]]:
    """Source tensor ``name`` (of global ``shape``) cut into cells, each with the ranks holding it whole, and the
    number of its grid: equal for tensors of one shape held alike (the layers of one model share them).

    ``cache``: the grids already cut, by shape and holders' boxes, with their numbers (filled here).

    Raises:
        ValueError: no rank holds a (non-empty) cell.
    """
    held = tuple((r, g, lb) for r, parts in enumerate(src_parts) if name in parts for g, lb in parts[name][2])
    held = tuple(h for h in held if numel(h[1]))
    signature = (tuple(shape), held)
    number, cut = cache.get(signature) or (len(cache), None)
    if cut is None:
        cut = _cut(shape, held)
        cache[signature] = number, cut
    for box, own in ((c.box, c.owners) for c in cut):
        if not own and numel(box):
            raise ValueError(f"no rank holds elements {box} of source model tensor {name!r}")
    return number, [Cell(name, c.box, c.owners, c.index) for c in cut]


def _cut(shape: Sequence[int], held: Sequence[tuple[int, Box, Box]]) -> list[Cell]:
    """The grid of the ``(rank, global box, local box)`` ``held``, as unnamed cells."""
    cuts = [sorted({0, int(n), *(x for _, g, _ in held for x in g[d])}) for d, n in enumerate(shape)]
    grid = [list(zip(c, c[1:])) for c in cuts]
    boxes = list(itertools.product(*grid))
    strides = [math.prod(len(g) for g in grid[d + 1 :]) for d in range(len(grid))]
    owners: list[list[tuple[int, Box]]] = [[] for _ in boxes]
    for r, g, lb in held:
        ranges = [range(bisect.bisect_left(c, a), bisect.bisect_left(c, b)) for c, (a, b) in zip(cuts, g)]
        for idx in itertools.product(*ranges):
            i = sum(k * s for k, s in zip(idx, strides))
            local = tuple((lb[d][0] + a - g[d][0], lb[d][0] + b - g[d][0]) for d, (a, b) in enumerate(boxes[i]))
            owners[i].append((r, local))
    return [Cell("", tuple(box), tuple(own), i) for i, (box, own) in enumerate(zip(boxes, owners))]
