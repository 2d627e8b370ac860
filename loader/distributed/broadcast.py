"""Broadcast of replicated boxes: a target several ranks of a session's group hold with the same boxes is read by one
of them (its owner, balancing bytes) and broadcast to the others.

Vocabulary: a target's *signature* is the global boxes of its slot; the *sharing* ranks of a conversion are those
whose slots of its targets have the same signatures; ranks are the session's group's.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from ..plan import BlockRead, DeferredRead, RankPlan, TargetSlot, ValueRead
from .collectives import broadcast_among, broadcast_tensor
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
    return (
        [r for r in reads if r.target not in skip],
        [d for d in deferred if not set(d.conversion.targets) <= skip],
        [v for v in values if v.target not in skip],
        owners,
    )


def broadcast_owned(slots: Mapping[str, TargetSlot], owners: Owners, session: Session) -> None:
    """Broadcast each shared target from its owner to the ranks sharing it (names in one order on every rank: no
    deadlock; a tag per name). Collective over the ranks sharing each target."""
    with peer_errors("reading", "broadcasting replicated tensors"):
        for name in sorted(owners):
            owner, ranks = owners[name]
            local = slots[name].local
            if len(ranks) == session.world:
                broadcast_tensor(local, owner, group=session.group, timeout=session.timeout)
            else:
                tag = zlib.crc32(name.encode()) & 0x7FFFFFFF
                broadcast_among(local, owner, ranks, group=session.group, timeout=session.timeout, tag=tag)
