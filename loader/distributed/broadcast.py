"""Broadcast of replicated regions: a target several ranks hold with the same boxes is read by one of them
(its owner, balancing bytes) and broadcast to the others.
"""

from __future__ import annotations

import math
from typing import Any

import torch.distributed as dist

from ..placements import rank_and_world
from ..plan.slots import TargetSlot


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
