"""Routes: how the executor reads each block, decided once per plan and reused by every later load of it.

Vocabulary:

- a block's *route* (:class:`Route`) is the way :class:`~.reads.BlockExecutor` reads it: ``DIRECT`` (one
  contiguous run read straight into the model tensor), ``SCATTER`` (each run read straight into its destination
  row, :mod:`loader.storage.scatter`), ``SPAN`` (its byte span read into a staging buffer, one strided copy out)
  or ``STAGED`` (read with the blocks beside it into a staging buffer, batched per load);
- a route follows from its *key*: the block read, where its source lies in the file (``data_start``, item
  size), the destination tensor's geometry (dtype, shape, strides, storage offset, device), whether the
  block's bytes overlap another block's, the staging capacity, whether the destination is written through a
  device link, and whether the reader reads scattered. It holds no tensor: its destination view is a geometry
  (sizes, strides, storage offset) applied to the tensor this load passes with one ``as_strided``.

The executor keeps the routes, per plan (:func:`routes_of`; the plan is a value and holds none): every binding of a
reused plan (:meth:`~loader.plan.RankPlan.rebound`) finds the routes its first load decided, so a second load of
the same model and checkpoint decides nothing again: no read layout, contiguity or cost check and no destination
view built by narrowing, about 25 us a block of Python on a warm load of many column shards.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import MutableMapping
from dataclasses import dataclass

import numpy as np
import torch

import regiontrace as rt
from regiontrace.executor import ReadLayout, RunGrid, dest_view, read_layout

from ..checkpoint import TensorInfo
from ..plan import BlockRead, RankPlan
from ..plan.slots import box_view
from ..storage import PAGE
from ..storage.scatter import scatter_pays
from .staging import GATHER_OVERREAD, align

DIRECT, SCATTER, SPAN, STAGED = "direct", "scatter", "span", "staged"

#: blocks reading more contiguous runs than this are read by byte span and copied in one strided copy
STRIDED_RUNS = 32

#: a view of a tensor's storage: ``(sizes, strides, storage offset)``, as ``torch.as_strided`` takes them
Geometry = tuple[tuple[int, ...], tuple[int, ...], int]


@dataclass(frozen=True, slots=True)
class Route:
    """How one block is read (see the module's vocabulary).

    Attributes:
        kind: ``DIRECT``, ``SCATTER``, ``SPAN`` or ``STAGED``.
        layout: the block's read layout.
        view: the destination, as a geometry of the model tensor's storage: the block's own view, or for ``STAGED``
            and a ``SPAN`` read in parts the view of its local box.
        rows: ``SCATTER``: ``(size, byte stride)`` of the destination dims the runs are enumerated over, major
            first (each run's address is the view's start plus a combination of them).
        at: ``DIRECT`` into a contiguous tensor: the byte offset of the block's bytes in it (None: use ``view``).
        parts: ``SPAN``: the block is read in parts (too sparse to copy its span to a device, too large to pack
            beside it in one buffer).
    """

    kind: str
    layout: ReadLayout
    view: Geometry
    rows: tuple[tuple[int, int], ...] = ()
    at: int | None = None
    parts: bool = False

    def dest(self, local: torch.Tensor) -> torch.Tensor:
        """The destination view of ``local`` (the tensor of the key's geometry)."""
        return torch.as_strided(local, *self.view)

    def targets(self, dest: torch.Tensor) -> np.ndarray:
        """``SCATTER``: the address of each run in ``dest`` (this route's view), in file order."""
        targets = np.array([dest.data_ptr()], dtype=np.uint64)
        for n, step in self.rows:
            targets = (targets[:, None] + np.arange(n, dtype=np.uint64) * np.uint64(step)).reshape(-1)
        return targets


class RouteTables:
    """The routes the executor decided, one table per plan, for the last :attr:`plans` plans loaded.

    A plan is known by its reads (every binding of it shares them, :meth:`~loader.plan.RankPlan.rebound`); the
    table keeps them alive, so their identity is not reused while it is kept.
    """

    def __init__(self, plans: int = 8) -> None:
        self.plans = plans
        self._tables: OrderedDict[int, tuple[object, dict]] = OrderedDict()
        self._lock = threading.Lock()

    def of(self, plan: RankPlan) -> dict:
        """The routes of ``plan`` (a new, empty table on its first load), bounded: past a few per block (tensors
        of ever new geometries) they are dropped and decided anew."""
        with self._lock:
            key = id(plan.reads)
            entry = self._tables.get(key)
            if entry is None or entry[0] is not plan.reads:
                entry = self._tables[key] = (plan.reads, {})
                while len(self._tables) > self.plans:
                    self._tables.popitem(last=False)
            self._tables.move_to_end(key)
            routes = entry[1]
            if len(routes) > 4 * len(plan.reads) + 1024:
                routes.clear()
            return routes


#: the executor's routes, for every load of this process
ROUTES = RouteTables()


def routes_of(plan: RankPlan) -> dict:
    """The routes the executor keeps for ``plan`` (:class:`RouteTables`): decided on its first load, reused after."""
    return ROUTES.of(plan)


def route_for(
    routes: MutableMapping,
    r: BlockRead,
    info: TensorInfo,
    local: torch.Tensor,
    *,
    alone: bool,
    capacity: int,
    host: bool,
    scatter: bool,
) -> Route:
    """The route of ``r`` (its source ``info``) into ``local``: kept in ``routes`` under its key, decided on a miss.

    Args:
        routes: the plan's routes (any mapping; a fresh one decides every block).
        alone: whether no other block reads any of ``r``'s bytes.
        capacity: bytes of one staging buffer.
        host: whether ``local`` is written with a plain copy (no device link).
        scatter: whether the reader reads runs straight into place (``read_runs_to``).
    """
    key = (r, info.data_start, info.itemsize, local.dtype, local.shape, local.stride(), local.storage_offset())
    key = (*key, local.device, alone, capacity, host, scatter)
    route = routes.get(key)
    if route is None:
        route = routes[key] = decide(r, info, local, alone=alone, capacity=capacity, host=host, scatter=scatter)
    return route


def decide(
    r: BlockRead, info: TensorInfo, local: torch.Tensor, *, alone: bool, capacity: int, host: bool, scatter: bool
) -> Route:
    """The route of ``r`` into ``local`` (arguments as :func:`route_for`): straight into place where the block is
    one run of its destination (``DIRECT``) or its runs are and that beats a span read (``SCATTER``), else by its
    span when it has many runs and fits a buffer (``SPAN``), else batched (``STAGED``)."""
    dest = box_view(local, r.local_box)
    layout = read_layout(r.block)
    if alone and host:  # a block whose bytes may overlap another's is batched: overlapping ranges read once
        direct = _direct_target(r.block, dest, layout)
        if direct is not None:
            at = (direct.data_ptr() - local.data_ptr()) if local.is_contiguous() else None
            return Route(DIRECT, layout, _geometry(direct), at=at)
        rows = _scatter_rows(r.block, dest, layout, info.run_grid(layout)) if scatter else None
        if rows is not None:
            return Route(SCATTER, layout, _geometry(dest_view(r.block, dest)), rows)
    span, wanted = (layout.end - layout.base) * info.itemsize, layout.count * layout.run * info.itemsize
    if alone and layout.count > STRIDED_RUNS and align(span) <= capacity:
        if span > GATHER_OVERREAD * wanted and align(span) + align(wanted) > capacity:
            return Route(SPAN, layout, _geometry(dest), parts=True)
        return Route(SPAN, layout, _geometry(dest_view(r.block, dest)))
    return Route(STAGED, layout, _geometry(dest))


def _geometry(t: torch.Tensor) -> Geometry:
    return tuple(t.shape), t.stride(), t.storage_offset()


def _direct_target(block: rt.RemapBlock, dest: torch.Tensor, layout: ReadLayout) -> torch.Tensor | None:
    """The destination view when the block can be pread straight into model memory, else None."""
    if block.casts or dest.dtype != block.source_dtype or layout.count != 1 or layout.flips:
        return None
    if dest.device.type != "cpu":
        return None
    view = dest_view(block, dest)
    if not view.is_contiguous():
        return None
    want = [0] * len(block.shape)
    acc = 1
    for j in range(len(block.shape) - 1, -1, -1):
        want[j] = acc if block.shape[j] > 1 else 0
        acc *= block.shape[j]
    packed = [p if block.shape[j] > 1 else 0 for j, p in enumerate(layout.strides)]
    if packed != want or any(s == 0 and n > 1 for s, n in zip(block.src_strides, block.shape)):
        return None
    return view


def _scatter_rows(
    block: rt.RemapBlock, dest: torch.Tensor, layout: ReadLayout, grid: RunGrid
) -> tuple[tuple[int, int], ...] | None:
    """The destination dims ``(size, byte stride)`` that enumerate ``block``'s runs in file order, when the runs can
    be read straight there — same dtype, no cast, flip or broadcast, each run contiguous in a host destination,
    runs in file order — and that beats the span read and copy (:func:`~loader.storage.scatter.scatter_pays`);
    else None."""
    shape, src, packed = block.shape, block.src_strides, layout.strides
    if block.casts or dest.dtype != block.source_dtype or layout.flips or layout.count < 2 or grid.gaps is None:
        return None
    if dest.device.type != "cpu" or any(s == 0 and n > 1 for s, n in zip(src, shape)):
        return None
    spans = grid.spans(PAGE)
    if not scatter_pays(grid.count, len(spans), sum(b - a for a, b in spans), grid.count * grid.length):
        return None
    view = dest_view(block, dest)
    walked = [j for j in range(len(shape)) if shape[j] > 1]
    if any(view.stride(j) != packed[j] for j in walked if packed[j] < layout.run):
        return None  # a run is not contiguous in the destination
    outer = sorted((j for j in walked if packed[j] >= layout.run), key=lambda j: -layout.steps[j])
    if [(shape[j], layout.steps[j]) for j in outer] != list(layout.outer):
        return None
    item = view.element_size()
    return tuple((shape[j], view.stride(j) * item) for j in outer)
