"""Placements: where each model tensor's local shard sits in the global tensor (DTensor geometry).

A rank owns, per model tensor, a union of boxes of the global tensor (one box for ``Shard``/``Replicate``,
several for ``_StridedShard``), computed with DTensor's own arithmetic. These become the
:class:`~loader.plan.TargetSlot` a plan is made for.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .plan.slots import Box, TargetSlot, plain_slot, storage_of


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 outside ``torch.distributed``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _is_dtensor(t: Any) -> bool:
    return type(getattr(t, "data", t)).__name__ == "DTensor" or type(t).__name__ == "DTensor"


def shard_runs(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> list[list[tuple[int, int, int]]]:
    """The global indices a mesh coordinate owns, per tensor dim, as runs ``(global start, stop, local start)``.

    Follows DTensor exactly (``torch.chunk`` sizes, several mesh dims on one tensor dim applied left to right,
    ``_StridedShard``'s strided indices).

    Raises:
        ValueError: a ``Partial`` placement (there is nothing to load into a pending reduction).
    """
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    local = list(global_shape)
    offsets: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(f"placement {p} is Partial: a checkpoint cannot be loaded into a pending reduction")
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        if p.dim < 0:  # DTensor normalises negative dims; explicit placements may not be
            dim = p.dim + len(global_shape)
            p = _StridedShard(dim, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(dim)
        size, idx = _get_shard_size_and_offsets(
            local[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim], p, offsets.get(p.dim), global_shape[p.dim], False
        )
        local[p.dim] = size
        offsets[p.dim] = idx[:size] if size else idx[:0]
    runs = []
    for d, n in enumerate(global_shape):
        if d not in offsets:
            runs.append([(0, n, 0)] if n else [])
            continue
        # maximal runs of consecutive global indices, found vectorised (a dim may hold ~10^5 indices)
        idx = offsets[d]
        if not idx.numel():
            runs.append([])
            continue
        breaks = (torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1).tolist()
        starts, ends = [0] + breaks, breaks + [idx.numel()]
        firsts, lasts = idx[starts].tolist(), idx[[e - 1 for e in ends]].tolist()
        runs.append([(a, b + 1, pos) for a, b, pos in zip(firsts, lasts, starts)])
    return runs


def shard_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[tuple[Box, Box], ...]:
    """``(global box, local box)`` pairs of the local shard at ``coordinate`` (a union of boxes).

    Cached per (shape, mesh, coordinate, placements): every layer of a model repeats the same few.
    """
    key = (tuple(global_shape), tuple(mesh_shape), tuple(coordinate), tuple((type(p), p) for p in placements))
    try:
        return _shard_boxes_cached(*key)
    except TypeError:  # an unhashable placement: compute it uncached
        return _shard_boxes(global_shape, mesh_shape, coordinate, placements)


@functools.lru_cache(maxsize=65536)
def _shard_boxes_cached(
    global_shape: tuple, mesh_shape: tuple, coordinate: tuple, typed_placements: tuple
) -> tuple[tuple[Box, Box], ...]:
    return _shard_boxes(global_shape, mesh_shape, coordinate, [p for _, p in typed_placements])


def _shard_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[tuple[Box, Box], ...]:

    runs = shard_runs(global_shape, mesh_shape, coordinate, placements)
    if any(not r for r in runs) and global_shape:
        return ()
    pairs = []
    for combo in itertools.product(*runs):
        g = tuple((a, b) for a, b, _ in combo)
        loc = tuple((lp, lp + b - a) for a, b, lp in combo)
        pairs.append((g, loc))
    return tuple(pairs)


def slot_for(name: str, tensor: torch.Tensor) -> TargetSlot:
    """The slot of ``tensor`` on this rank: a DTensor's local shard boxes, or the whole tensor."""
    data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
    if not _is_dtensor(data):
        return plain_slot(name, tensor)
    mesh = data.device_mesh
    coord = mesh.get_coordinate()
    shape = tuple(data.shape)
    if coord is None:
        return TargetSlot(name, shape, data.dtype, storage_of(tensor), ())
    try:
        boxes = shard_boxes(shape, tuple(mesh.shape), coord, data.placements)
    except ValueError as e:
        raise ValueError(f"model tensor {name!r}: {e}") from None
    return TargetSlot(name, shape, data.dtype, storage_of(tensor), boxes)
