"""Broadcast of replicated boxes: a target several ranks hold with the same boxes is read by one of them
(its owner, balancing bytes) and broadcast to the others.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from ..placements import rank_and_world
from ..plan import BlockRead, DeferredRead, RankPlan, TargetSlot, ValueRead

#: ``{target: (owner rank, ranks sharing it)}``
Owners = dict[str, tuple[int, tuple[int, ...]]]


def _signature(slot: TargetSlot) -> tuple:
    return tuple(g for g, _ in slot.boxes)


def assign_owners(plan: RankPlan) -> Owners:
    """For conversions several ranks need identically: ``{target: (owner rank, ranks sharing it)}``.

    Owners are chosen per conversion (so shared sources are read once), balancing bytes; every rank
    computes the same answer from the all-gathered signatures. Collective.
    """
    rank, world = rank_and_world()
    mine = {}
    for i, conv in enumerate(plan.conversions):
        slots = [plan.slots[t] for t in conv.targets]
        if all(s.boxes for s in slots):
            mine[i] = tuple(_signature(s) for s in slots)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    groups: dict[tuple[int, tuple], list[int]] = {}
    for r, sigs in enumerate(everyone):
        for i, sig in sigs.items():
            groups.setdefault((i, sig), []).append(r)
    owners: Owners = {}
    load = [0] * world
    for (i, sig), ranks in sorted(groups.items(), key=lambda kv: kv[0][0]):
        if len(ranks) < 2:
            continue
        owner = min(ranks, key=lambda r: (load[r], r))
        load[owner] += sum(_box_numel(s) for s in sig)
        if rank in ranks:
            for t in plan.conversions[i].targets:
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


def _all_groups(owners: Owners) -> list[tuple[int, ...]]:
    """Every rank group any rank needs, in one agreed order (new_group is collective over the world)."""
    _, world = rank_and_world()
    mine = sorted({ranks for _, ranks in owners.values() if len(ranks) < world})
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return sorted({g for groups in everyone for g in groups})


def owned_subset(
    plan: RankPlan, reads: Sequence[BlockRead], deferred: Sequence[DeferredRead], values: Sequence[ValueRead] = ()
) -> tuple[list[BlockRead], list[DeferredRead], list[ValueRead], Owners]:
    """The reads, deferred conversions and value reads this rank owns, and the owners of the shared targets.

    Collective (all ranks call it, after planning succeeded everywhere). In one process: everything, no owners.
    """
    rank, world = rank_and_world()
    if world < 2:
        return list(reads), list(deferred), list(values), {}
    owners = assign_owners(plan)
    skip = {n for n, (owner, _) in owners.items() if owner != rank}
    for g in _all_groups(owners):
        _group_for(g, world)
    return (
        [r for r in reads if r.target not in skip],
        [d for d in deferred if not set(d.conversion.targets) <= skip],
        [v for v in values if v.target not in skip],
        owners,
    )


def broadcast_owned(slots: Mapping[str, TargetSlot], owners: Owners) -> None:
    """Broadcast each shared target from its owner (names in one global order: no cross-group deadlock).
    Collective."""
    _, world = rank_and_world()
    for name in sorted(owners):
        owner, ranks = owners[name]
        local = slots[name].local
        buf = local if local.is_contiguous() else local.contiguous()
        dist.broadcast(buf, src=owner, group=_group_for(ranks, world))
        if buf is not local:
            local.copy_(buf)
