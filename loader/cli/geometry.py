"""What the plan picture shows, as plain data: per model tensor, which boxes each rank holds (its slot), and which
boxes of which checkpoint tensors each rank reads.

Every tensor is drawn in its *2-D view*: ``rows = prod(shape[:-1])`` and ``cols = shape[-1]`` (C order, so
an expert tensor ``(E, 2I, H)`` is its experts stacked vertically). Boxes, strided block reads (their flat
source runs) and shard boxes all become rectangles ``(r0, r1, c0, c1)`` of that view.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..plan import unique_read_bytes
from ..plan.slots import TargetSlot
from ..rules import dot_natural_key
from ..simulate import MeshPlacements, coordinate_of

Rect = tuple[int, int, int, int]  # rows [r0, r1), cols [c0, c1) of the 2-D view


@dataclass
class SourceView:
    """One checkpoint tensor and what each rank reads of it."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    reads: dict[int, list[Rect]] = field(default_factory=dict)
    read_bytes: dict[int, int] = field(default_factory=dict)
    whole: bool = False  # read whole (a deferred conversion)


@dataclass
class TensorView:
    """One model tensor: its owners per rank and the checkpoint tensors it is loaded from."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    placement: str
    owners: dict[int, list[Rect]]
    sources: list[SourceView]
    deferred: str | None = None
    replicated: bool = False


@dataclass
class PlanView:
    """Everything the picture draws."""

    title: str
    subtitle: str
    mesh_shape: tuple[int, ...]
    ranks: list[int]
    coords: dict[int, tuple[int, ...]]
    figures: list[Any]
    tensors: list[TensorView]
    hidden: int = 0
    note: str = ""


def view_shape(shape: Sequence[int]) -> tuple[int, int]:
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def box_rects(shape: Sequence[int], box: Sequence[tuple[int, int]], limit: int = 4096) -> list[Rect]:
    """Rectangles of the 2-D view covering an N-D box (its bounding rows when that would be too many)."""
    if not shape:
        return [(0, 1, 0, 1)]
    if len(shape) == 1:
        ((a, b),) = box
        return [(0, 1, a, b)] if b > a else []
    if any(b <= a for a, b in box):
        return []
    c0, c1 = box[-1]
    lead = box[:-2]
    rows_per = [math.prod(shape[d + 1 : -1]) for d in range(len(shape) - 1)]
    ra, rb = box[-2]
    count = math.prod(b - a for a, b in lead)
    if count > limit:
        lo = sum(a * w for (a, _), w in zip(box[:-1], rows_per))
        hi = sum((b - 1) * w for (_, b), w in zip(box[:-1], rows_per)) + 1
        return [(lo, hi, c0, c1)]
    rects = []
    for idx in _product([range(a, b) for a, b in lead]):
        base = sum(i * w for i, w in zip(idx, rows_per))
        rects.append((base + ra, base + rb, c0, c1))
    return merge_rects(rects)


def _product(ranges: list[range]) -> Iterable[tuple[int, ...]]:
    return itertools.product(*ranges)


def run_rects(shape: Sequence[int], runs: Iterable[tuple[int, int]]) -> list[Rect]:
    """Rectangles of the 2-D view covering flat element runs ``(start, length)``."""
    _, cols = view_shape(shape)
    rects = []
    for start, n in runs:
        end = start + n
        r, c = divmod(start, cols)
        if c:
            take = min(cols - c, end - start)
            rects.append((r, r + 1, c, c + take))
            start += take
        full = (end - start) // cols
        if full > 0:
            r = start // cols
            rects.append((r, r + full, 0, cols))
            start += full * cols
        if end > start:
            r = start // cols
            rects.append((r, r + 1, 0, end - start))
    return merge_rects(rects)


def merge_rects(rects: list[Rect]) -> list[Rect]:
    """Merge rectangles that continue each other vertically (same columns), then horizontally."""
    out: list[Rect] = []
    for r in sorted(set(rects), key=lambda r: (r[2], r[3], r[0])):
        if out and out[-1][2:] == r[2:] and out[-1][1] >= r[0]:
            out[-1] = (out[-1][0], max(out[-1][1], r[1]), r[2], r[3])
        else:
            out.append(r)
    merged: list[Rect] = []
    for r in sorted(out, key=lambda r: (r[0], r[1], r[2])):
        if merged and merged[-1][:2] == r[:2] and merged[-1][3] >= r[2]:
            merged[-1] = (r[0], r[1], merged[-1][2], max(merged[-1][3], r[3]))
        else:
            merged.append(r)
    return merged


def partition(owners: dict[int, list[Rect]], order: Sequence[int]) -> list[tuple[Rect, tuple[int, ...]]]:
    """Partition the union of everyone's rectangles into rectangles owned by one set of ranks."""
    rows = sorted({v for rects in owners.values() for r in rects for v in r[:2]})
    cols = sorted({v for rects in owners.values() for r in rects for v in r[2:]})
    if len(rows) * len(cols) > 250_000 or len(order) > 62:  # too fine to partition: draw as they come
        return [(r, (k,)) for k in order for r in owners.get(k, [])]
    ri = {v: i for i, v in enumerate(rows)}
    ci = {v: i for i, v in enumerate(cols)}
    grid = [[0] * max(len(cols) - 1, 0) for _ in range(max(len(rows) - 1, 0))]
    for bit, k in enumerate(order):
        for r0, r1, c0, c1 in owners.get(k, []):
            for i in range(ri[r0], ri[r1]):
                row = grid[i]
                for j in range(ci[c0], ci[c1]):
                    row[j] |= 1 << bit
    open_: dict[tuple[int, int, int], list[int]] = {}
    out: list[tuple[Rect, int]] = []
    for i, row in enumerate(grid):
        j = 0
        while j < len(row):
            m, k = row[j], j
            while k + 1 < len(row) and row[k + 1] == m:
                k += 1
            if m:
                key = (cols[j], cols[k + 1], m)
                if key in open_ and open_[key][1] == rows[i]:
                    open_[key][1] = rows[i + 1]  # grow downwards
                else:
                    if key in open_:
                        out.append((tuple(open_[key]), m))
                    open_[key] = [rows[i], rows[i + 1], cols[j], cols[k + 1]]
            j = k + 1
    out += [(tuple(v), key[2]) for key, v in open_.items()]
    return [(rect, tuple(k for b, k in enumerate(order) if m >> b & 1)) for rect, m in out]


def block_rects(block: Any) -> list[Rect]:
    """The source elements a RemapBlock reads, as rectangles of the source's 2-D view."""
    sb = block.source_box()
    if sb is not None:
        offsets, lengths, _ = sb
        return box_rects(block.source_shape, [(o, o + n) for o, n in zip(offsets, lengths)])
    runs = block.source_runs()
    if len(runs) > 20000:  # draw the span rather than thousands of slivers
        lo, hi = block.source_span()
        runs = [(lo, hi - lo)]
    return run_rects(block.source_shape, runs)


# ---------------------------------------------------------------------------------------------------
# choosing what to draw


def select_tensors(names: Sequence[str], patterns: Sequence[str] | None) -> list[str]:
    """Names matching any pattern (glob, or substring); default: the first layer's tensors and the rest."""
    if patterns:
        chosen = [n for n in names if any(fnmatch.fnmatchcase(n, p) or p in n for p in patterns)]
        return chosen
    layer = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
    indices = [int(m.group(1)) for n in names if (m := layer.search(n))]
    first = min(indices) if indices else None
    return [n for n in names if (m := layer.search(n)) is None or int(m.group(1)) == first]


def collect(
    planner: Any,
    checkpoint: Any,
    tensors: Mapping[str, Any],
    mesh_shape: Sequence[int],
    placements: Mapping[str, Sequence[Any]] | Callable[[str, tuple[int, ...]], Sequence[Any]],
    ranks: Sequence[int],
    selected: Sequence[str],
    placement_text: Callable[[Sequence[Any]], str],
) -> list[TensorView]:
    """Plan each rank for the ``selected`` model tensors only, and describe what the picture draws.

    Args:
        planner: an ``HFLoadPlanner`` for the model (its key plan is reused).
        checkpoint: the checkpoint (a :class:`~loader.checkpoint.Checkpoint`).
        tensors: model tensors by name (any device).
        mesh_shape, placements: as ``loader.simulate.simulate_load``.
        ranks: the ranks drawn.
        selected: model tensor names drawn.
        placement_text: formats a placement list.
    """
    chosen = set(selected)
    mesh = MeshPlacements(tuple(mesh_shape), placements)
    views: dict[str, TensorView] = {}
    per_source: dict[tuple[str, str], SourceView] = {}
    for rank in ranks:
        coord = coordinate_of(rank, mesh_shape)
        slots = {}
        for name, t in tensors.items():
            shape = tuple(t.shape)
            pl = mesh.of(name, shape)
            if name not in chosen:
                slots[name] = TargetSlot(name, shape, t.dtype, None, ())
                continue
            boxes = mesh.boxes(shape, coord, pl)
            slots[name] = TargetSlot(name, shape, t.dtype, None, boxes)
            if name not in views:
                views[name] = TensorView(
                    name,
                    shape,
                    str(t.dtype).removeprefix("torch."),
                    placement_text(pl) if pl else "replicated",
                    {},
                    [],
                    replicated=not pl or all(type(p).__name__ == "Replicate" for p in pl),
                )
            views[name].owners[rank] = merge_rects([r for g, _ in boxes for r in box_rects(shape, g)])
        plan = planner.build_plan(checkpoint, slots, check_devices=False)
        by_target: dict[str, dict[str, list]] = {}
        for target, block in plan.block_reads():
            by_target.setdefault(target, {}).setdefault(block.source, []).append(block)
        for name, srcs in by_target.items():
            for src, blocks in srcs.items():
                sv = _source(per_source, views[name], src, checkpoint)
                sv.reads.setdefault(rank, []).extend(rect for b in blocks for rect in block_rects(b))
                sv.read_bytes[rank] = sv.read_bytes.get(rank, 0) + unique_read_bytes(blocks, checkpoint)
        for d in plan.deferred:
            for target in {t for t, _, _ in d.boxes}:
                if target not in views:
                    continue
                views[target].deferred = d.reason
                for src in d.conversion.sources:
                    sv = _source(per_source, views[target], src, checkpoint)
                    sv.whole = True
                    sv.reads[rank] = [(0, view_shape(sv.shape)[0], 0, view_shape(sv.shape)[1])]
                    sv.read_bytes[rank] = checkpoint[src].nbytes
    for sv in per_source.values():
        sv.reads = {r: merge_rects(rects) for r, rects in sv.reads.items()}
    for v in views.values():
        v.sources.sort(key=lambda s: dot_natural_key(s.name))
    return [views[n] for n in selected if n in views and (views[n].sources or views[n].deferred)]


def _source(per_source: dict, view: TensorView, src: str, checkpoint: Any) -> SourceView:
    key = (view.name, src)
    if key not in per_source:
        info = checkpoint[src]
        per_source[key] = SourceView(src, tuple(info.shape), str(info.dtype).removeprefix("torch."), info.nbytes)
        view.sources.append(per_source[key])
    return per_source[key]
