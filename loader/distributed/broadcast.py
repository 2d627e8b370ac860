"""Broadcast of replicated boxes: a target several ranks of a session's group hold with the same boxes is read by one
of them (its owner, balancing bytes) and broadcast to the others.

Vocabulary: a target's *signature* is the global boxes of its slot; the *sharing* ranks of a conversion are those
whose slots of its targets have the same signatures; ranks are the session's group's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist

from ..plan import BlockRead, DeferredRead, RankPlan, TargetSlot, ValueRead
from .collectives import broadcast_tensor, global_rank
from .session import Session
from .verdicts import peer_errors

#: ``{target: (owner rank, ranks sharing it)}``
Owners = dict[str, tuple[int, tuple[int, ...]]]


def _signature(slot: TargetSlot) -> tuple:
    return tuple(g for g, _ in slot.boxes)


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def assign_owners(plan: RankPlan, session: Session) -> Owners:
    """For conversions several ranks need identically: ``{target: (owner rank, ranks sharing it)}``.

    Owners are chosen per conversion (so shared sources are read once), balancing bytes; every rank
    computes the same answer from the gathered signatures (:meth:`~.session.Session.gather`). Collective.
    """
    mine = {}
    for i, conv in enumerate(plan.conversions):
        slots = [plan.slots[t] for t in conv.targets]
        if all(s.boxes for s in slots):
            mine[i] = tuple(_signature(s) for s in slots)
    posted = json.dumps(sorted(mine.items())).encode()
    everyone = [json.loads(p) for p in session.gather(posted, doing="assigning replicated tensors")]
    groups: dict[tuple[int, tuple], list[int]] = {}
    for r, sigs in enumerate(everyone):
        for i, sig in sigs:
            groups.setdefault((i, _tuples(sig)), []).append(r)
    owners: Owners = {}
    load = [0] * session.world
    for (i, sig), ranks in sorted(groups.items(), key=lambda kv: kv[0][0]):
        if len(ranks) < 2:
            continue
        owner = min(ranks, key=lambda r: (load[r], r))
        load[owner] += sum(_box_numel(s) for s in sig)
        if session.rank in ranks:
            for t in plan.conversions[i].targets:
                owners[t] = (owner, tuple(ranks))
    return owners


def _box_numel(sig: tuple) -> int:
    return sum(math.prod(b - a for a, b in g) for g in sig)


_GROUPS: dict[tuple[int, ...], Any] = {}


def _group_for(ranks: tuple[int, ...], session: Session) -> Any:
    """The process group of the session's ``ranks`` (its own group when they are all of it), made by those ranks
    alone (``use_local_synchronization``: no other rank takes part)."""
    if len(ranks) == session.world:
        return session.group
    world_ranks = tuple(global_rank(session.group, r) for r in ranks)
    if world_ranks not in _GROUPS:
        _GROUPS[world_ranks] = dist.new_group(list(world_ranks), use_local_synchronization=True)
    return _GROUPS[world_ranks]


def owned_subset(
    plan: RankPlan,
    reads: Sequence[BlockRead],
    deferred: Sequence[DeferredRead],
    values: Sequence[ValueRead],
    session: Session,
) -> tuple[list[BlockRead], list[DeferredRead], list[ValueRead], Owners]:
    """The reads, deferred conversions and value reads this rank owns, and the owners of the shared targets.

    Collective over the session's group (after planning succeeded everywhere). One rank: everything, no owners.
    """
    if session.world < 2:
        return list(reads), list(deferred), list(values), {}
    owners = assign_owners(plan, session)
    skip = {n for n, (owner, _) in owners.items() if owner != session.rank}
    with peer_errors("reading", "making the groups of replicated tensors"):
        for ranks in sorted({ranks for _, ranks in owners.values()}):  # one order on every rank: no deadlock
            _group_for(ranks, session)
    return (
        [r for r in reads if r.target not in skip],
        [d for d in deferred if not set(d.conversion.targets) <= skip],
        [v for v in values if v.target not in skip],
        owners,
    )


def broadcast_owned(slots: Mapping[str, TargetSlot], owners: Owners, session: Session) -> None:
    """Broadcast each shared target from its owner (names in one global order: no cross-group deadlock).
    Collective."""
    with peer_errors("reading", "broadcasting replicated tensors"):
        for name in sorted(owners):
            owner, ranks = owners[name]
            group = _group_for(ranks, session)
            src = owner if group is session.group else ranks.index(owner)
            broadcast_tensor(slots[name].local, src, group=group, timeout=session.timeout)
