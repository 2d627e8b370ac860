"""The distributed layer: one :class:`Session` per flow, running its stages and agreeing on their outcomes
(:mod:`.session`, :mod:`.verdicts`, :mod:`.heartbeat`; a failed rank's exception travels as :mod:`.remote` says), the
collectives over a group (:mod:`.collectives`: the execution layer's ``Peers``) and the broadcast of replicated boxes
(:mod:`.broadcast`). The distributed load that composes them with planning and execution is :mod:`loader.load`."""

from .broadcast import assign_owners, broadcast_owned, owned_subset
from .collectives import Collectives, pick_device
from .session import DEFAULT_TIMEOUT, Session, timeout_seconds
from .verdicts import peer_errors

__all__ = [
    "DEFAULT_TIMEOUT",
    "Collectives",
    "Session",
    "assign_owners",
    "broadcast_owned",
    "owned_subset",
    "peer_errors",
    "pick_device",
    "timeout_seconds",
]
