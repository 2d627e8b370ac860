"""Peers: what the read drivers of the execution layer (:mod:`.exchanged`) need of the other ranks of a group, and
nothing more: their count and this rank's place, two collectives of bytes, and agreeing on an outcome.

Vocabulary:

- a *peer*: another rank of the group (this rank's ``rank`` among ``world``);
- *agreeing* at a *point*: every rank posts its outcome of the step named ``point`` (its error, or None) and waits
  for every rank's; when any failed, every rank raises the same error (a rank that hung or died: a
  :class:`~loader.errors.PeerFailure` naming it), so no rank enters the next collective alone.

The execution layer defines the protocol; the distributed layer implements it (over ``torch.distributed`` and the
session's store), so the drivers never import the process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np


class Peers(Protocol):
    """The ranks of one group, as a read driver talks to them. Every method is collective: every rank of the group
    calls it, in the same order; a collective a peer never joins (hung, died, left) raises
    :class:`~loader.errors.PeerFailure` within the timeout.

    Attributes:
        rank: this rank's index in the group.
        world: how many ranks the group has.
        timeout: seconds a collective waits for the others (None: no limit).
    """

    rank: int
    world: int
    timeout: float | None

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (index = rank)."""
        ...

    def all_to_all_bytes(self, sends: Sequence[np.ndarray], recv_sizes: Sequence[int]) -> list[np.ndarray]:
        """Send ``sends[j]`` (``uint8``) to rank ``j`` and receive ``recv_sizes[i]`` bytes from each rank ``i``
        (index = rank; this rank's own entries are empty)."""
        ...

    def agree(self, error: BaseException | None, point: str) -> None:
        """Post this rank's outcome of the step ``point`` (None: it succeeded) and wait for every rank's.

        Raises:
            Exception: some rank failed: the same error on every rank. PeerFailure: a rank did not arrive within
                the timeout or died.
        """
        ...
