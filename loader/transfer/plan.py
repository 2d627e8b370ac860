"""The plan of a weight transfer: which source rank sends which strided region to which destination rank.

A pure function of values every rank can hold (:func:`plan_transfer`): the two models' mappings to their
checkpoint layout (:class:`SourceSide`, :class:`DestSide`, built by :mod:`loader.transfer.sides`) and what each
rank holds of each model tensor (:data:`Slots`). Every rank computes the same plan from the same gathered
values, without further messages; simulations call it on meta models for any mesh.

Vocabulary:

- **source** / **destination**: two models holding the same weights in different layouts (names, fused
  tensors, shardings); the source sends, the destination receives.
- **key**: a checkpoint tensor, the meeting point. The source's save inverts into keys, the destination's load
  reads keys: composed, every destination element is an element of a source model tensor.
- **slot**: what one rank holds of one model tensor: ``(global shape, dtype, ((global box, local box), …))`` (a
  :class:`~loader.plan.TargetSlot` without its tensor); a rank's slots of one model are a :data:`Slots`.
  The public names `mesh_parts`, `model_parts`, `parts_of` and the arguments `src_parts`/`dst_parts` say
  "parts" for slots (tests, docs and the benches, also run against older checkouts, call them so).
- **cell**: a box of a source tensor that a fixed set of ranks hold whole (the grid of every rank's boxes of
  it), named ``"<tensor>@<i>"``: the source of every block the plan moves, so that each block reads one rank's
  local memory.
- **move**: one strided copy (a :class:`~regiontrace.RemapBlock` reading a cell) from one source rank into a
  box of one destination rank's local shard.
- **fallback**: a destination conversion that does not trace: its keys are moved whole (each key rebuilt from
  the cells through the inverse) to the ranks holding its targets, and it runs there.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

import regiontrace as rt
from regiontrace import Box

from ..plan.gcpause import paused_gc
from .cells import Cell, Slot, Slots, numel, sender, tensor_cells  # noqa: F401 (Cell, Slot, Slots: re-exported)


@dataclass(frozen=True)
class SourceConversion:
    """One conversion of the source's save mapping: each of its model tensors over its keys.

    Attributes:
        keys: the checkpoint keys it reads.
        outputs: source model tensor name -> RegionTensor over canonical leaves ``#i`` standing for ``keys[i]``
            (the forward trace, checked to be a bijection by the save mapping; see :func:`named`).
        signature: equal for conversions whose traces are equal but for names (layers of one structure); None:
            shared with no other. With the destination's, it lets a plan compile one layer for all.
    """

    keys: tuple[str, ...]
    outputs: Mapping[str, rt.RegionTensor]
    signature: Hashable | None = None


@dataclass(frozen=True)
class DestConversion:
    """One conversion of the destination's load: its model tensors over its keys.

    Attributes:
        keys: the checkpoint keys it reads.
        targets: the destination model tensors it writes.
        outputs: target -> RegionTensor over canonical leaves ``#i`` standing for ``keys[i]``; None when it does
            not trace (then ``reason``).
        reason: why it does not trace (it is moved as a fallback).
        signature: as :attr:`SourceConversion.signature`.
    """

    keys: tuple[str, ...]
    targets: tuple[str, ...]
    outputs: Mapping[str, rt.RegionTensor] | None
    reason: str = ""
    signature: Hashable | None = None


@dataclass(frozen=True)
class SourceSide:
    """The source model's checkpoint layout: its keys with shape and dtype, and its conversions."""

    keys: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    conversions: tuple[SourceConversion, ...]


@dataclass(frozen=True)
class DestSide:
    """The destination model's load conversions, in the order its key plan lists them."""

    conversions: tuple[DestConversion, ...]


@dataclass(frozen=True)
class Move:
    """``block`` (reading cell ``block.source``) sent by rank ``src`` into box ``local`` of rank ``dst``'s local
    shard of ``target`` (block offsets are relative to ``local``); ``key``: ``target`` is a checkpoint key
    rebuilt whole for a fallback, not a model tensor."""

    src: int
    dst: int
    target: str
    local: Box
    block: rt.RemapBlock
    key: bool = False

    @property
    def nbytes(self) -> int:
        """Payload bytes: the block's elements in the source dtype."""
        return self.block.numel * self.block.source_dtype.itemsize


@dataclass(frozen=True)
class Fallback:
    """Destination conversion ``index`` (of :attr:`DestSide.conversions`), run on the destination ranks ``ranks``
    from its keys moved whole (``specs``: their shapes and dtypes)."""

    index: int
    keys: tuple[str, ...]
    targets: tuple[str, ...]
    ranks: tuple[int, ...]
    reason: str
    specs: tuple[tuple[tuple[int, ...], torch.dtype], ...] = ()


@dataclass
class TransferPlan:
    """Every move of a transfer (the whole world's, the same on every rank), or one rank's.

    Attributes:
        world: the number of ranks.
        moves: every strided copy, in a deterministic order (of one rank's plan: those it sends or receives).
        cells: the cells moves read, by name.
        transferred: destination tensors moved region by region.
        fallback: destination conversions moved as whole keys and run on the destination.
        rank: None for the whole world's plan, else the rank whose moves it holds.
    """

    world: int
    moves: tuple[Move, ...]
    cells: Mapping[str, Cell]
    transferred: tuple[str, ...]
    fallback: tuple[Fallback, ...]
    rank: int | None = None
    _pairs: dict[tuple[int, int], int] | None = field(default=None, repr=False)

    def pair_bytes(self) -> dict[tuple[int, int], int]:
        """Payload bytes per ``(source rank, destination rank)``, itself included."""
        if self._pairs is None:
            pairs: dict[tuple[int, int], int] = {}
            for m in self.moves:
                pairs[m.src, m.dst] = pairs.get((m.src, m.dst), 0) + m.nbytes
            self._pairs = pairs
        return self._pairs

    def bytes_sent(self, rank: int) -> int:
        return sum(n for (s, _), n in self.pair_bytes().items() if s == rank)

    def bytes_received(self, rank: int) -> int:
        return sum(n for (_, d), n in self.pair_bytes().items() if d == rank)


@paused_gc()  # many small frozen values, no cycles: no full collections over the model meanwhile
def plan_transfer(
    source: SourceSide,
    dest: DestSide,
    src_parts: Sequence[Slots],
    dst_parts: Sequence[Slots],
    *,
    rank: int | None = None,
) -> TransferPlan:
    """Plan a transfer: for every destination rank and box it holds, the source ranks and regions it comes from.

    Pure and deterministic: every rank computes the same plan from the same values. Works on meta models (only
    names, shapes, dtypes and boxes are read), for any number of ranks.

    Args:
        source: the source's checkpoint layout and inverted conversions (:func:`~loader.transfer.source_side`).
        dest: the destination's traced load conversions (:func:`~loader.transfer.dest_side`).
        src_parts: per rank (index = rank), what it holds of the source model (empty: nothing).
        dst_parts: per rank, what it holds of the destination model.
        rank: plan only the moves this rank sends or receives (the same moves, with the same senders, as the
            whole world's plan has for it), compiling only its own destination boxes and the regions of cells
            it holds; None: the whole world's.

    Returns:
        The :class:`TransferPlan`. A source element several ranks hold is sent by the destination rank itself
        when it is one of them, else by a holder chosen from the cell and the destination rank alone
        (:func:`loader.transfer.cells.sender`: balanced over the holders).

    Raises:
        ValueError: the destination needs keys the source lacks, a source tensor no rank holds (in part), or a
            composition that fails; the message names the tensor or keys.
    """
    world = len(src_parts)
    needed = [k for c in dest.conversions for k in c.keys if k not in source.keys]
    if needed:
        raise ValueError(f"the destination needs checkpoint key(s) the source does not have: {sorted(set(needed))[:8]}")
    cells, grids = _cells(source, src_parts)
    per_tensor: dict[str, list[tuple[str, Cell]]] = {}
    for name, cell in cells.items():
        per_tensor.setdefault(cell.tensor, []).append((name, cell))
    by_key = {k: (i, j) for i, c in enumerate(source.conversions) for j, k in enumerate(c.keys)}
    inverses: dict[tuple[int, ...], rt.Inverse] = {}

    def inverse_of(which: tuple[int, ...]) -> rt.Inverse:
        inverse = inverses.get(which)
        if inverse is None:
            inverse = inverses[which] = _joint_inverse([source.conversions[i] for i in which], source, per_tensor)
        return inverse

    compiled: dict[Hashable, list] = {}
    moves: list[Move] = []
    transferred: list[str] = []
    fallback: list[Fallback] = []
    for index, conv in enumerate(dest.conversions):
        which = tuple(sorted({by_key[k][0] for k in conv.keys}))
        names = [name for i in which for t in source.conversions[i].outputs for name, _ in per_tensor.get(t, ())]
        shape = _structure(conv, which, by_key, source, grids, dst_parts)
        blocks = compiled.get(shape) if shape is not None else None
        if blocks is None:
            composed, reason = _composed(conv, inverse_of(which), source.keys)
            if composed is not None:
                blocks = _compile(composed, conv.targets, dst_parts, names, cells, rank)
                if shape is not None:
                    compiled[shape] = blocks
        if blocks is not None:
            for t, dst, local, cell, src, block in blocks:
                moves.append(Move(src, dst, conv.targets[t], local, _renamed(block, names[cell])))
            transferred += conv.targets
            continue
        ranks = tuple(r for r, parts in enumerate(dst_parts) if any(_owns(parts, t) for t in conv.targets))
        specs = tuple((tuple(source.keys[k][0]), source.keys[k][1]) for k in conv.keys)
        fallback.append(Fallback(index, conv.keys, conv.targets, ranks, reason, specs))
        keys = rt.inverse_regions(inverse_of(which))
        for k in conv.keys:
            whole = {r: {k: (source.keys[k][0], source.keys[k][1], ((_full(source.keys[k][0]),) * 2,))}
                     for r in ranks}  # fmt: skip
            moves += _moves(keys[k], k, [whole.get(r, {}) for r in range(world)], cells, rank, key=True)
    return TransferPlan(world, tuple(moves), cells, tuple(transferred), tuple(fallback), rank)


# ---------------------------------------------------------------------------------------------------
# cells: the grid of the source ranks' boxes


def _full(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def _owns(parts: Slots, name: str) -> bool:
    part = parts.get(name)
    return part is not None and any(numel(g) for g, _ in part[2])


def _cells(source: SourceSide, src_parts: Sequence[Slots]) -> tuple[dict[str, Cell], dict[str, int]]:
    """Every source tensor cut into cells (:func:`~loader.transfer.cells.tensor_cells`), by name, and each
    tensor's grid number (equal for tensors cut alike)."""
    cache: dict[Hashable, tuple[int, list[Cell]]] = {}
    cells, grids = {}, {}
    for name, traced in ((t, out) for c in source.conversions for t, out in c.outputs.items()):
        grids[name], cut = tensor_cells(name, tuple(traced.shape), src_parts, cache)
        cells.update((f"{name}@{cell.index}", cell) for cell in cut)
    return cells, grids


def named(outputs: Mapping[str, rt.RegionTensor], keys: Sequence[str], specs: Mapping) -> dict[str, rt.RegionTensor]:
    """``outputs`` traced on canonical leaves ``#i`` (standing for ``keys[i]``) over leaves named by the keys:
    composed with the identity from the keys (``specs``: key -> (shape, dtype))."""
    leaves = [rt.RegionTensor.leaf(f"#{i}", *specs[k]) for i, k in enumerate(keys)]
    identity = rt.invert({k: leaf for k, leaf in zip(keys, leaves)}, leaves)
    return dict(rt.compose(dict(outputs), identity))


def _joint_inverse(
    convs: Sequence[SourceConversion], source: SourceSide, cells: Mapping[str, list[tuple[str, Cell]]]
) -> rt.Inverse:
    """The inverse of the source conversions ``convs`` with their tensors cut into cells: each key over cells."""
    outputs = {}
    for conv in convs:
        for tensor, out in named(conv.outputs, conv.keys, source.keys).items():
            for name, cell in cells.get(tensor, ()):  # a zero-element tensor has no cells
                if numel(cell.box):
                    outputs[name] = out[tuple(slice(a, b) for a, b in cell.box)]
    keys = {k: source.keys[k] for conv in convs for k in conv.keys}
    return rt.invert(outputs, keys)


def _composed(
    conv: DestConversion, inverse: rt.Inverse, specs: Mapping
) -> tuple[dict[str, rt.RegionTensor] | None, str]:
    """The destination conversion over cells, or None and why it is moved as a fallback."""
    if conv.outputs is None:
        return None, conv.reason
    if not all(t.is_index_map for t in conv.outputs.values()):
        return None, "computes values by pointwise ops (moved whole, run on the destination)"
    try:
        return dict(rt.compose(named(conv.outputs, conv.keys, specs), inverse)), ""
    except (ValueError, rt.Untraceable) as e:
        return None, f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------------------------------
# moves


def _structure(
    conv: DestConversion,
    which: tuple[int, ...],
    by_key: Mapping[str, tuple[int, int]],
    source: SourceSide,
    grids: Mapping[str, int],
    dst_parts: Sequence[Slots],
) -> Hashable | None:
    """What the blocks of ``conv`` depend on but names: equal for the layers of one structure (same traces, keys
    in the same places, the same cells with the same holders, the same destination boxes); None when a
    conversion has no signature."""
    sigs = tuple(source.conversions[i].signature for i in which)
    if conv.signature is None or any(s is None for s in sigs):
        return None
    places = tuple((which.index(by_key[k][0]), by_key[k][1]) for k in conv.keys)
    grid = tuple(grids[t] for i in which for t in source.conversions[i].outputs)
    boxes = tuple(
        tuple(None if t not in parts else tuple(g for g, _ in parts[t][2]) for parts in dst_parts) for t in conv.targets
    )
    return (conv.signature, sigs, places, grid, boxes)


def _compile(
    composed: Mapping[str, rt.RegionTensor],
    targets: Sequence[str],
    dst_parts: Sequence[Slots],
    names: Sequence[str],
    cells: Mapping[str, Cell],
    rank: int | None,
) -> list[tuple[int, int, Box, int, int, rt.RemapBlock]]:
    """``(target index, destination rank, local box, cell index in names, sender, block)`` for every box a
    destination rank holds; for one ``rank``: only its own boxes and the blocks it sends (compiled from the
    pieces reading the cells it holds)."""
    index = {n: i for i, n in enumerate(names)}
    held = set() if rank is None else {n for n in names if any(r == rank for r, _ in cells[n].owners)}
    out = []
    for ti, t in enumerate(targets):
        mine: rt.Region | None = None
        for dst, parts in enumerate(dst_parts):
            part = parts.get(t)
            if part is None:
                continue
            if rank is None or dst == rank:
                blocks = composed[t].remap_blocks
            elif not held:
                continue
            else:
                if mine is None:
                    region = composed[t].region
                    mine = rt.Region(region.shape, tuple(p for p in region.pieces if p.source.name in held))
                blocks = functools.partial(rt.compile_blocks, mine)
            for g, lb in part[2]:
                for b in blocks(g) if numel(g) else ():
                    src = sender(cells[b.source], dst)
                    if rank is None or rank in (src, dst):
                        out.append((ti, dst, lb, index[b.source], src, b))
    return out


def _renamed(b: rt.RemapBlock, source: str) -> rt.RemapBlock:
    if b.source == source:
        return b
    return rt.RemapBlock(
        source, b.shape, b.src_offset, b.src_strides, b.dst_offset, b.dst_dims, b.dst_steps, b.source_shape,
        b.source_dtype, b.casts,
    )  # fmt: skip


def _moves(
    tensor: rt.RegionTensor,
    target: str,
    dst_parts: Sequence[Slots],
    cells: Mapping[str, Cell],
    rank: int | None,
    *,
    key: bool,
) -> list[Move]:
    """The moves filling every destination rank's boxes of ``target`` (``tensor`` is over cells); for one
    ``rank``: those it sends or receives."""
    out = []
    for dst, parts in enumerate(dst_parts):
        part = parts.get(target)
        if part is None:
            continue
        for g, lb in part[2]:
            if not numel(g):
                continue
            for block in tensor.remap_blocks(g):
                src = sender(cells[block.source], dst)
                if rank is None or rank in (src, dst):
                    out.append(Move(src, dst, target, lb, block, key))
    return out
