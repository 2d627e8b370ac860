"""One verdict per call through the store, without a session: :class:`Ballot`, for a call its ranks make again and
again (a prepared transfer's replays), whose ranks met in a collective earlier in the same call.

A :class:`~.session.Session` per call starts and joins a heartbeat thread and polls the store; a ballot posts
each rank's outcome under the call's own key, waits for every rank's with one blocking ``wait`` (the store wakes
it when the last rank posts), and settles the verdict with one compare-and-set: ``"ok"`` once every rank posted,
else ``"timeout:<the ranks that did not>"``, the first set obeyed by every rank, a late rank included. Four
round trips per call (five with the key of the call before deleted), no thread.

Vocabulary (with :mod:`.verdicts`'): a *ballot* is one call's agreement point; its *number* is the caller's count
of its calls (a prepared transfer's version: the same on every rank, whichever ranks failed before a ballot).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch.distributed as dist

from .._torch import default_store
from .collectives import group_rank_and_world
from .remote import decode_failure, encode_failure, remote_error
from .session import numbered_prefix
from .verdicts import STAGES, decide, peer_errors, peer_failure

log = logging.getLogger("loader")

OK = "ok"

_BALLOT_IDS: dict[tuple[int, ...], Any] = {}
"""A counter of ballots per group (its world ranks; ``()``: the default group): every rank of a group
numbers them alike, so that each one's keys are its own in the shared store."""


class Ballot:
    """The closing verdict of each call over ``group`` (its ranks), through the default store, each wait at most
    ``timeout`` seconds. Collective to create (every rank of the group, at the same point of its flow: its keys'
    prefix is numbered per group, in the order they are made).

    A rank that never posts within the timeout is named in a :class:`~loader.errors.PeerFailure` on every other
    rank; a rank that dies is not told from a hung one (no heartbeat: the timeout bounds the wait). The keys of
    this rank's previous ballot are deleted at its next (safe when every rank passed a collective of the call
    before its ballot: each had read them all), so the store holds at most one ballot's keys.
    """

    def __init__(self, timeout: float, group: Any = None) -> None:
        self.rank, self.world = group_rank_and_world(group)
        self.timeout = timeout
        self.store = dist.PrefixStore(numbered_prefix(_BALLOT_IDS, "loader/ballot", group), default_store())
        self._last: int | None = None  # this rank's previous ballot

    def agree(self, error: BaseException | None, stage: str, number: int) -> None:
        """Post this rank's outcome of ``stage`` in ballot ``number`` (the same on every rank, unique), wait for
        every rank's, and raise on every rank if any failed.

        Raises:
            Exception: some rank failed: the lowest failed rank's error, as :meth:`.Session.agree` raises it.
            PeerFailure: some rank did not post within the timeout (naming it), this rank posted after the others
                stopped waiting for it, or the store failed.
        """
        n, s = number, self.store
        keys = [f"{n}/{r}" for r in range(self.world)]
        with peer_errors(stage, "agreeing on the outcome through the store"):
            s.set(keys[self.rank], OK if error is None else encode_failure(error, self.rank))
            if self._last is not None:
                self._forget(self._last)
            self._last = n
            verdict = self._verdict(n, keys)
            if verdict == OK:
                failed = [decode_failure(v) for v in s.multi_get(keys) if v != OK.encode()]
        if verdict == OK and not failed:
            return
        if verdict == OK:
            agreed = remote_error(sorted(failed, key=lambda f: (f.rank is None, f.rank or 0)), STAGES[stage], stage)
        else:
            reason, _, names = verdict.partition(":")
            ranks = tuple(int(r) for r in names.split(",") if r)
            agreed = peer_failure(stage, reason, ranks, rank=self.rank, timeout=self.timeout, dead_after=self.timeout)
        raise agreed from error

    def _verdict(self, n: int, keys: list[str]) -> str:
        """``"ok"`` once every rank posted ballot ``n`` within the timeout, else ``"timeout:<missing>"``; the first
        decided wins."""
        s = self.store
        try:
            s.wait(keys, datetime.timedelta(seconds=self.timeout))
        except RuntimeError:  # the wait timed out (or the store failed: the checks below raise then)
            missing = [r for r, key in enumerate(keys) if not s.check([key])]
            if missing:
                return decide(s, f"{n}/verdict", "timeout:" + ",".join(map(str, missing)))
        return decide(s, f"{n}/verdict", OK)

    def _forget(self, n: int) -> None:
        """Delete this rank's key of ballot ``n`` (rank 0: its verdict too)."""
        for key in [f"{n}/{self.rank}"] + ([f"{n}/verdict"] if self.rank == 0 else []):
            try:
                self.store.delete_key(key)
            except Exception:  # a store without deletion: the key stays, nothing else is affected
                log.debug("could not delete %s from the store", key, exc_info=True)
