"""Which trainer rank sends which part of each worker's wants: one pure function both sides compute alike.

Vocabulary (as in :mod:`loader.vllm.sync_plan`, plus):

- **trainer parts**: per trainer rank, per trainer tensor, the ``(global box, local box)`` pairs of its local
  shard (a DTensor's, by :func:`loader.placements.slot_for`; a plain tensor: the whole); sent to the engine at
  prepare and published back, so every trainer rank and every worker knows every rank's boxes.
- **piece**: the part of one want one trainer rank sends, a box of the trainer tensor: the want cut by the grid of
  every rank's boxes (:func:`loader.transfer.cells.tensor_cells`), each cell sent by its **owner**, the lowest rank
  holding it (replicated data is sent once).
- **packet**: what one trainer rank sends one worker: its pieces for that worker grouped into **segments**, one
  per wire dtype (in order of first appearance), each piece C-contiguous in the want's dtype. A full push sends
  the segments' bytes one after another; a delta push each segment's :class:`~loader.transfer.delta.Delta`
  against the segment last sent (both sides hold that base: the sender a copy of it, the worker the segments it
  received, which its wants are views of where a want is one piece: :func:`place`).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from regiontrace import Box

from ..placements import slot_for
from ..transfer.cells import tensor_cells
from ..transfer.delta import Delta, Written, apply_delta, encode_delta
from .sync_plan import Want

__all__ = [
    "Parts",
    "Piece",
    "apply_segments",
    "assemble",
    "encode_segments",
    "gather",
    "local_parts",
    "place",
    "plan_pieces",
    "segments",
    "touched",
]

#: one trainer rank's boxes: tensor -> its ``(global box, local box)`` pairs
Parts = Mapping[str, Sequence[tuple[Box, Box]]]


@dataclass(frozen=True)
class Piece:
    """``box`` (global coordinates) of want ``want``, sent by trainer rank ``sender`` from its local ``local`` box."""

    want: int
    box: Box
    sender: int
    local: Box

    @property
    def numel(self) -> int:
        return math.prod(b - a for a, b in self.box)


def local_parts(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, list], dict[str, torch.Tensor]]:
    """This trainer rank's :data:`Parts` of ``state`` (JSON-able lists) and its local tensors, by key.

    Raises:
        ValueError: a DTensor with a ``Partial`` placement (a pending reduction: no rank holds its values),
            naming it.
    """
    parts, local = {}, {}
    for key, tensor in state.items():
        partial = [p for p in getattr(tensor, "placements", ()) if p.is_partial()]
        if partial:
            raise ValueError(
                f"trainer tensor {key!r} has a Partial placement ({partial[0]}): a pending reduction no rank holds "
                "the values of; reduce it first (redistribute it to Replicate or Shard)"
            )
        slot = slot_for(key, tensor)
        parts[key] = [[list(map(list, g)), list(map(list, lb))] for g, lb in slot.boxes]
        local[key] = slot.local
    return parts, local


def _boxes(parts: Sequence[Parts]) -> list[dict[str, tuple]]:
    """``parts`` as tuples (as they come back from JSON)."""
    out = []
    for rank in parts:
        out.append({k: tuple((_box(g), _box(lb)) for g, lb in pairs) for k, pairs in rank.items()})
    return out


def _box(box: Sequence[Sequence[int]]) -> Box:
    return tuple((int(a), int(b)) for a, b in box)


def plan_pieces(wants: Sequence[Want], parts: Sequence[Parts]) -> list[Piece]:
    """One worker's pieces, in order (by want, then by cell), each from the lowest trainer rank holding it.

    Raises:
        ValueError: no trainer rank holds some elements of a wanted tensor (naming it).
    """
    held = _boxes(parts)
    slots = [{k: (None, None, pairs) for k, pairs in rank.items()} for rank in held]
    cache: dict = {}
    pieces = []
    for i, want in enumerate(wants):
        box = tuple((o, o + n) for o, n in zip(want.offsets, want.lengths))
        try:
            _, cells = tensor_cells(want.key, _shape(want.key, held), slots, cache)
        except ValueError as e:
            raise ValueError(f"trainer tensor {want.key!r}, which an engine worker wants: {e}") from None
        for cell in cells:
            part = _intersect(cell.box, box)
            if part is None or not cell.owners:
                continue
            rank, local = cell.owners[0]
            shifted = tuple((lo + a - c, lo + b - c) for (a, b), (c, _), (lo, _) in zip(part, cell.box, local))
            pieces.append(Piece(i, part, rank, shifted))
        got = sum(p.numel for p in pieces if p.want == i)
        if got != math.prod(want.lengths):
            raise ValueError(
                f"no trainer rank holds {math.prod(want.lengths) - got} of the elements {list(box)} an engine worker "
                f"wants of trainer tensor {want.key!r}"
            )
    return pieces


def _shape(key: str, held: Sequence[Mapping[str, tuple]]) -> tuple[int, ...]:
    """A tensor's global shape, as the union of every rank's global boxes bounds it."""
    boxes = [g for rank in held for g, _ in rank.get(key, ())]
    return tuple(max(b[d][1] for b in boxes) for d in range(len(boxes[0]))) if boxes else ()


def _intersect(a: Box, b: Box) -> Box | None:
    box = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) or not box else None


def segments(pieces: Sequence[Piece], wants: Sequence[Want]) -> list[tuple[torch.dtype, list[Piece]]]:
    """``pieces`` grouped by their wants' dtypes, in order of first appearance (a packet's segments)."""
    out: dict[torch.dtype, list[Piece]] = {}
    for p in pieces:
        out.setdefault(wants[p.want].dtype, []).append(p)
    return list(out.items())


def _narrow(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (a, b) in enumerate(box):
        t = t.narrow(d, a, b - a)
    return t


def gather(
    local: Mapping[str, torch.Tensor], pieces: Sequence[Piece], wants: Sequence[Want]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A trainer rank's packet for one worker: its bytes, and per segment its pieces' values cast once to the wire
    dtype (views of the bytes where a segment starts aligned; a segment that does not is copied in after)."""
    layout = segments(pieces, wants)
    total = sum(sum(p.numel for p in group) * dtype.itemsize for dtype, group in layout)
    packet, out, at = torch.empty(total, dtype=torch.uint8), [], 0
    for dtype, group in layout:
        n = sum(p.numel for p in group)
        aligned = at % dtype.itemsize == 0
        flat = packet[at : at + n * dtype.itemsize].view(dtype) if aligned else torch.empty(n, dtype=dtype)
        k = 0
        for p in group:
            box = _narrow(local[wants[p.want].key].detach(), p.local)
            flat[k : k + p.numel].view(box.shape).copy_(box)  # the cast, written in place
            k += p.numel
        if not aligned:
            packet[at : at + n * dtype.itemsize].copy_(flat.view(torch.uint8))
        out.append(flat)
        at += n * dtype.itemsize
    return packet, out


def assemble(
    buffers: Sequence[torch.Tensor], pieces: Sequence[Piece], wants: Sequence[Want], segs=None, only=None
) -> list:
    """Write a packet's segments ``segs`` into the worker's want ``buffers`` (each shaped as its want; with
    ``only``, just the pieces of those wants); with ``segs`` None, read the packet's segments back out of
    ``buffers`` instead."""
    out = []
    for k, (dtype, group) in enumerate(segments(pieces, wants)):
        flat = segs[k] if segs is not None else torch.empty(sum(p.numel for p in group), dtype=dtype)
        at = 0
        for p in group:
            if only is None or p.want in only:
                want = wants[p.want]
                rel = tuple((a - o, b - o) for (a, b), o in zip(p.box, want.offsets))
                view = _narrow(buffers[p.want], rel)
                chunk = flat[at : at + p.numel].view(view.shape)
                view.copy_(chunk) if segs is not None else chunk.copy_(view)
            at += p.numel
        out.append(flat)
    return out


def place(
    segs: Sequence[Sequence[torch.Tensor]], pieces: Sequence[Sequence[Piece]], wants: Sequence[Want]
) -> tuple[list[torch.Tensor], list[bool]]:
    """A worker's wants from every trainer rank's segments ``segs`` (``pieces``: each rank's): a want that is one
    piece is a view of its segment (no copy); any other is assembled from its pieces. Also, per want, whether it is
    a view (a change to its segment is a change to it)."""
    count = Counter(p.want for group in pieces for p in group)
    tensors: list[torch.Tensor | None] = [None] * len(wants)
    for rank, group in enumerate(pieces):
        for k, (_, layout) in enumerate(segments(group, wants)):
            at = 0
            for p in layout:
                if count[p.want] == 1 and p.numel == math.prod(wants[p.want].lengths):
                    tensors[p.want] = segs[rank][k][at : at + p.numel].view(wants[p.want].lengths)
                at += p.numel
    views = [t is not None for t in tensors]
    out = [t if t is not None else torch.empty(w.lengths, dtype=w.dtype) for t, w in zip(tensors, wants)]
    rest = {i for i, v in enumerate(views) if not v}
    for rank, group in enumerate(pieces):
        if group and rest:
            assemble(out, group, wants, segs[rank], only=rest)
    return out, views


def touched(written: Sequence[Written], pieces: Sequence[Piece], wants: Sequence[Want]) -> set[int]:
    """The wants whose elements a packet's applied deltas (``written``, one per segment) changed."""
    out: set[int] = set()
    for (_, group), w in zip(segments(pieces, wants), written):
        if w.where is None:
            out.update(p.want for p in group)
        elif w.where.size:
            ends = np.searchsorted(w.where, np.cumsum([p.numel for p in group]))  # changes before each piece's end
            out.update(group[i].want for i in np.flatnonzero(np.diff(ends, prepend=0)).tolist())
    return out


def encode_segments(base: Sequence[torch.Tensor] | None, new: Sequence[torch.Tensor]) -> tuple[list[Delta], int]:
    """Each segment of ``new`` as a delta against ``base`` (None: every element changed, sent whole); and the
    changed bytes."""
    if base is None:
        return [], sum(t.numel() * t.element_size() for t in new)
    deltas = [encode_delta(b, n) for b, n in zip(base, new)]
    return deltas, sum(d.changed * n.element_size() for d, n in zip(deltas, new))


def apply_segments(segs: Sequence[torch.Tensor], payload: torch.Tensor, sizes: Sequence[int]) -> list[Written]:
    """Each segment's delta from ``payload`` (``sizes`` bytes each) applied to it in place, the old bits kept
    (:meth:`~loader.transfer.delta.Written.undo`); on an error, the ones applied are undone before it is raised.

    Raises:
        ValueError: ``payload`` does not hold the segments' deltas (the segments are as they were).
    """
    out: list[Written] = []
    try:
        if len(sizes) != len(segs) or sum(sizes) != payload.numel():
            raise ValueError(f"a delta packet of {payload.numel()} bytes, where its sizes say {sum(sizes)} for "
                             f"{len(sizes)} of {len(segs)} segments")  # fmt: skip
        at = 0
        for seg, n in zip(segs, sizes):
            out.append(apply_delta(seg, Delta.from_bytes(payload[at : at + n]), keep=True))
            at += n
    except Exception:
        for seg, w in zip(segs, out):
            w.undo(seg)
        raise
    return out
