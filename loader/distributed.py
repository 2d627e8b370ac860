"""Distributed loading: DTensor shard boxes, planning that fails together, broadcast of replicated regions.

Each rank plans its own load (RemapBlocks compiled for exactly the boxes of its local shards); the
outcome of planning is gathered before anyone reads or writes, so a failure on one rank fails every rank
with that rank's message. With ``broadcast_replicated_tensors`` a target that several ranks hold with the
same boxes is read by one of them and broadcast to the others.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from .targets import Box, TargetSlot, _storage, plain_slot

log = logging.getLogger("loader")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 outside ``torch.distributed``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _is_dtensor(t: Any) -> bool:
    return type(getattr(t, "data", t)).__name__ == "DTensor" or type(t).__name__ == "DTensor"


def shard_runs(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
               placements: Sequence[Any]) -> list[list[tuple[int, int, int]]]:
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
        size, idx = _get_shard_size_and_offsets(local[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim], p,
                                                offsets.get(p.dim), global_shape[p.dim], False)
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


def shard_boxes(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                placements: Sequence[Any]) -> tuple[tuple[Box, Box], ...]:
    """``(global box, local box)`` pairs of the local shard at ``coordinate`` (a union of boxes).

    Cached per (shape, mesh, coordinate, placements): every layer of a model repeats the same few.
    """
    key = (tuple(global_shape), tuple(mesh_shape), tuple(coordinate), tuple((type(p), p) for p in placements))
    try:
        return _shard_boxes_cached(*key)
    except TypeError:  # an unhashable placement: compute it uncached
        return _shard_boxes(global_shape, mesh_shape, coordinate, placements)


@functools.lru_cache(maxsize=65536)
def _shard_boxes_cached(global_shape: tuple, mesh_shape: tuple, coordinate: tuple,
                        typed_placements: tuple) -> tuple[tuple[Box, Box], ...]:
    return _shard_boxes(global_shape, mesh_shape, coordinate, [p for _, p in typed_placements])


def _shard_boxes(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: Sequence[Any]) -> tuple[tuple[Box, Box], ...]:
    import itertools

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
        return TargetSlot(name, shape, data.dtype, _storage(tensor), ())
    try:
        boxes = shard_boxes(shape, tuple(mesh.shape), coord, data.placements)
    except ValueError as e:
        raise ValueError(f"model tensor {name!r}: {e}") from None
    return TargetSlot(name, shape, data.dtype, _storage(tensor), boxes)


# ---------------------------------------------------------------------------------------------------
# fail together


def _gather_outcome(error: BaseException | None, what: str) -> None:
    """All-gather each rank's outcome; raise on every rank if any failed (naming the first failed rank)."""
    rank, world = rank_and_world()
    message = None if error is None else f"{type(error).__name__}: {error}"
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, (message, _error_kind(error)))
    failed = [(r, m, k) for r, (m, k) in enumerate(outcomes) if m is not None]
    if not failed:
        return
    r, m, kind = failed[0]
    text = f"{what} failed on rank {r}: {m}"
    if len(failed) > 1:
        text += f" (and on rank(s) {', '.join(str(f[0]) for f in failed[1:])})"
    exc = _make_error(kind, text)
    if error is not None:
        raise exc from error
    raise exc


def _error_kind(error: BaseException | None) -> str:
    from .errors import CheckpointError

    if error is None:
        return ""
    if isinstance(error, CheckpointError):
        return "checkpoint"
    if isinstance(error, ValueError):
        return "value"
    return "runtime"


def _make_error(kind: str, text: str) -> BaseException:
    from .errors import CheckpointError

    if kind == "checkpoint":
        return CheckpointError(text)
    if kind == "value":
        return ValueError(text)
    return RuntimeError(text)


# ---------------------------------------------------------------------------------------------------
# broadcast of replicated regions


def _signature(slot: TargetSlot) -> tuple:
    return tuple(g for g, _ in slot.boxes)


def assign_owners(planner: Any) -> dict[str, tuple[int, tuple[int, ...]]]:
    """For conversions several ranks need identically: ``{target: (owner rank, ranks sharing it)}``.

    Owners are chosen per conversion (so shared sources are read once), balancing bytes; every rank
    computes the same answer from the all-gathered signatures.
    """
    rank, world = rank_and_world()
    mine = {}
    for i, conv in enumerate(planner.plan.conversions):
        slots = [planner.slots[t] for t in conv.targets]
        if all(s.boxes for s in slots):
            mine[i] = tuple(_signature(s) for s in slots)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    groups: dict[tuple[int, tuple], list[int]] = {}
    for r, sigs in enumerate(everyone):
        for i, sig in sigs.items():
            groups.setdefault((i, sig), []).append(r)
    owners: dict[str, tuple[int, tuple[int, ...]]] = {}
    load = [0] * world
    for (i, sig), ranks in sorted(groups.items(), key=lambda kv: kv[0][0]):
        if len(ranks) < 2:
            continue
        owner = min(ranks, key=lambda r: (load[r], r))
        load[owner] += sum(_box_numel(s) for s in sig)
        if rank in ranks:
            for t in planner.plan.conversions[i].targets:
                owners[t] = (owner, tuple(ranks))
    return owners


def _box_numel(sig: tuple) -> int:
    return sum(math.prod(b - a for a, b in g) for g in sig)


_GROUPS: dict[tuple[int, ...], Any] = {}


def _group_for(ranks: tuple[int, ...], world: int) -> Any:
    if len(ranks) == world:
        return None
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def _all_groups(planner: Any, owners: dict) -> list[tuple[int, ...]]:
    """Every rank group any rank needs, in one agreed order (new_group is collective over the world)."""
    _, world = rank_and_world()
    mine = sorted({ranks for _, ranks in owners.values() if len(ranks) < world})
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return sorted({g for groups in everyone for g in groups})


# ---------------------------------------------------------------------------------------------------
# the distributed load


def owned_subset(planner: Any, reads: list, deferred: list) -> tuple[list, list, dict]:
    """With ``broadcast_replicated_tensors``: the reads and deferred conversions this rank owns, and the owners.

    Collective (all ranks call it, after planning succeeded everywhere).
    """
    rank, world = rank_and_world()
    if not planner.broadcast_replicated_tensors or world < 2:
        return reads, deferred, {}
    owners = assign_owners(planner)
    skip = {n for n, (owner, _) in owners.items() if owner != rank}
    for g in _all_groups(planner, owners):
        _group_for(g, world)
    reads = [r for r in reads if r.target not in skip]
    deferred = [d for d in deferred if not set(d.conversion.targets) <= skip]
    return reads, deferred, owners


def broadcast_owned(planner: Any, owners: dict) -> None:
    """Broadcast each shared target from its owner (names in one global order: no cross-group deadlock)."""
    _, world = rank_and_world()
    for name in sorted(owners):
        owner, ranks = owners[name]
        local = planner.slots[name].local
        buf = local if local.is_contiguous() else local.contiguous()
        dist.broadcast(buf, src=owner, group=_group_for(ranks, world))
        if buf is not local:
            local.copy_(buf)


def read_together(planner: Any, reader: Any, reads: list, deferred: list, *, progress: bool | None = None,
                  rollback: bool = False) -> None:
    """Execute this rank's share, agree on the outcome, then broadcast shared targets.

    Raises:
        the same error on every rank when a read failed on any rank (with ``rollback``, every rank first
        restores the tensors it wrote).
    """
    from .api import _snapshot, execute_plan, restore

    reads, deferred, owners = owned_subset(planner, reads, deferred)
    saved = _snapshot(planner.plan, planner.slots) if rollback else None
    error = None
    try:
        execute_plan(planner, reader, progress=progress, reads=reads, deferred=deferred)
    except Exception as e:
        error = e
    try:
        _gather_outcome(error, "Reading the checkpoint")
    except BaseException:
        if saved is not None:
            restore(saved, planner.slots)
        raise
    broadcast_owned(planner, owners)


def load_distributed(planner: Any, path: str, *, progress: bool | None = None, rollback: bool = False) -> Any:
    """Plan on every rank, agree on the outcome, then read each rank's own byte ranges.

    Raises:
        ValueError/CheckpointError/RuntimeError on every rank when planning (or reading) failed on any rank;
        no rank hangs and, when planning failed, no model is touched.
    """
    from .checkpoint import FileReader, SafetensorsCheckpoint
    from .plan import describe

    rank, world = rank_and_world()
    error = None
    try:
        checkpoint = SafetensorsCheckpoint.open(path)
        plan = planner.build_plan(checkpoint)
    except Exception as e:  # gathered below: every rank raises, none hangs
        error = e
    _gather_outcome(error, "Planning the load")
    log.info("rank %d: %s", rank, describe(plan, checkpoint))
    with FileReader() as reader:
        read_together(planner, reader, plan.reads, plan.deferred, progress=progress, rollback=rollback)
        bytes_read = reader.bytes_read
    planner.keyplan.record_on_model(planner.model)
    return planner.report(bytes_read, rank, world)
