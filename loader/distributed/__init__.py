"""Distributed collectives of a load: agreement of outcomes (:mod:`.session`; a failed rank's exception
travels as :mod:`.remote` says) and broadcast of replicated boxes (:mod:`.broadcast`). The distributed
load that composes them with planning and execution is :mod:`loader.load`."""

from .broadcast import assign_owners, broadcast_owned, owned_subset
from .session import DEFAULT_TIMEOUT, LoadSession, peer_errors, timeout_seconds

__all__ = [
    "DEFAULT_TIMEOUT",
    "LoadSession",
    "assign_owners",
    "broadcast_owned",
    "owned_subset",
    "peer_errors",
    "timeout_seconds",
]
