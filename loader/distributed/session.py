"""Failing together: one :class:`Session` per distributed flow (a load, a save, a transfer) runs its stages, and the
outcome of each is agreed through the process group's store, with a timeout and a heartbeat, so that a rank that
fails, hangs or dies turns into the same error on every rank.

Vocabulary (with :mod:`.verdicts`'):

- *stage*: a named step of a flow (``"planning"``, ``"reading"``, ``"writing"``…: :data:`~.verdicts.STAGES`);
  ``with session.stage("reading"):`` runs one and agrees on its outcome at the block's end;
- *post*: a value set in the session's store (outcomes, rank 0's posts: :meth:`Session.from_rank_zero`); data every
  rank contributes goes over the collectives instead (:meth:`Session.gather`, :meth:`Session.peers`);
- *solo*: a session under torch's fake process group (:func:`fake_world`): no peers to agree with.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from .._torch import default_store
from ..options import DEFAULT_TIMEOUT, timeout_seconds
from .collectives import Collectives, group_rank_and_world
from .heartbeat import HEARTBEAT_LIMIT, Heartbeat
from .remote import remote_error
from .verdicts import SAVE_STAGES, STAGES, dead_ranks, peer_errors, peer_failure, poll_cap, post_outcome

log = logging.getLogger("loader")

_FLOW_IDS: dict[tuple[int, ...], Any] = {}
"""A counter of flows per group (its world ranks; ``()``: the default group): every rank of a group numbers its
sessions alike, so that each session's keys are its own in the shared store."""


def fake_world() -> bool:
    """Whether the default process group is torch's fake one (``init_process_group("fake")``): one process
    playing one rank of the world, with no peers and collectives that do nothing."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


def numbered_prefix(counters: dict[tuple[int, ...], Any], base: str, group: Any) -> str:
    """The store prefix of the next flow over ``group`` under ``base``: ``counters`` numbers them per group (its
    world ranks; ``()``: the whole world), alike on every rank that makes them in the same order."""
    ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
    ranks = () if len(ranks) == dist.get_world_size() else ranks
    number = next(counters.setdefault(ranks, itertools.count()))
    return f"{base}/{number}" if not ranks else f"{base}/{','.join(map(str, ranks))}/{number}"


def _prefix(group: Any) -> str:
    return numbered_prefix(_FLOW_IDS, "loader", group)


class Session:
    """The fail-together protocol of one distributed flow over ``group``, carried by the default store.

    At each agreement point (a stage's end, or a point inside it) every rank posts its outcome and waits, at most
    ``timeout`` seconds, until every rank of the group has posted. No collective is involved, so a rank that never
    arrives blocks nobody: the waiting ranks see in the store which ranks are missing. One verdict per point is
    chosen by the store's compare-and-set and obeyed by every rank, a hung rank that resumes after the others gave up
    included. A heartbeat (:class:`~.heartbeat.Heartbeat`) reports a rank that stops beating for ``dead_after``
    seconds (``min(timeout / 2, HEARTBEAT_LIMIT)``) dead without waiting for the full timeout.

    Use as a context manager around the flow (it starts and joins the heartbeat); collective: every rank of the
    group opens one session per flow, in the same order. Ranks are the group's.

    Under torch's fake process group the session is ``solo``: no heartbeat, an in-process store, and
    :meth:`agree` raises this rank's own error (a save refuses: it needs every rank's shards).

    Args:
        timeout: seconds (or a ``timedelta``) to wait at each agreement point and collective; None waits without
            limit (dead ranks are still detected).
        group: the process group of the flow (None: the default one).
    """

    def __init__(self, timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT, group: Any = None) -> None:
        self.group = group
        self.rank, self.world = group_rank_and_world(group)
        self.timeout = timeout_seconds(timeout)
        self.dead_after = HEARTBEAT_LIMIT if self.timeout is None else min(HEARTBEAT_LIMIT, self.timeout / 2)
        self.solo = fake_world()
        store = dist.HashStore() if self.solo else default_store()
        self.store = dist.PrefixStore(_prefix(group), store)
        self._collectives = Collectives(group, timeout=self.timeout)
        self._heartbeat = Heartbeat(self.store, self.rank, self.world, self.dead_after)
        self._agreed: list[BaseException] = []  # the errors this session's agreement points raised

    def __enter__(self) -> Session:
        if not self.solo:
            self._heartbeat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.solo:
            return
        try:
            self.store.set(f"done/{self.rank}", "1")  # before the beats stop: not to be taken for dead
        except Exception:
            log.debug("rank %d: could not mark the flow done", self.rank, exc_info=True)
        self._heartbeat.stop()

    @contextlib.contextmanager
    def stage(self, name: str, *, point: str = "", bounded: bool = True) -> Iterator[None]:
        """Run the block as stage ``name`` (or its ``point``) of every rank: an exception it raises is caught and,
        with every rank's outcome, agreed at the block's end (:meth:`agree`): every rank raises the same error,
        none waits for one that already failed. An error already agreed (at a point inside the block) passes through."""
        error = None
        try:
            yield
        except Exception as e:  # agreed below: every rank raises, none hangs
            if any(e is agreed for agreed in self._agreed):
                raise  # agreed at a point inside the block: every rank raises it already
            error = e
        self.agree(error, name, bounded=bounded, point=point)

    def agree(self, error: BaseException | None, stage: str, *, bounded: bool = True, point: str = "") -> None:
        """Post this rank's outcome of ``stage``, wait for every rank's, and raise on every rank if any failed.

        Args:
            error: this rank's failure, or None.
            stage: one of :data:`~.verdicts.STAGES`.
            bounded: wait at most the session's timeout (False: wait without limit, e.g. for a download;
                dead ranks are still detected).
            point: which agreement point of ``stage`` this is, when a stage has several (``""``: its end).

        Raises:
            Exception: some rank failed: the lowest failed rank's error as its own type when that is a builtin
                or one of the project's (with its attributes, e.g. ``path`` and ``key``), else as its nearest
                such base class or :class:`~loader.errors.RemoteError` (:mod:`.remote`); it carries ``rank``,
                ``stage``, ``remote_type`` and ``remote_traceback``, and lists the other failed ranks.
            PeerFailure: some rank did not arrive within the timeout, died, or this rank arrived after the
                others gave up waiting for it.
            RuntimeError: a save stage in a ``solo`` session (torch's fake process group).
        """
        if self.solo:
            self._agree_alone(error, stage)
            return
        timeout = self.timeout if bounded else None
        with peer_errors(stage, "agreeing on the outcome through the store"):  # e.g. the store's host died
            verdict, failed = post_outcome(
                self.store, error, f"{stage}@{point}" if point else stage, self.rank, self.world, timeout
            )
        if verdict == "ok" and not failed:
            return
        if verdict == "ok":
            agreed = remote_error(failed, STAGES[stage], stage)
        else:
            reason, _, names = verdict.partition(":")
            agreed = self._failure(stage, reason, tuple(int(r) for r in names.split(",") if r))
        self._agreed.append(agreed)
        raise agreed from error

    def gather(self, data: bytes, stage: str = "reading", doing: str = "gathering from every rank") -> list[bytes]:
        """Every rank's ``data`` (index = rank) over the collectives, each wait at most the timeout. Collective; a
        ``solo`` session returns this rank's alone.

        Raises:
            PeerFailure: a rank left or did not take part within the timeout.
        """
        if self.solo:
            return [data]
        with peer_errors(stage, doing):
            return self._collectives.all_gather_bytes(data)

    def peers(self, stage: str = "reading") -> Collectives:
        """The :class:`~loader.execute.peers.Peers` of this session's group for ``stage``: its collectives (each a
        :class:`~loader.errors.PeerFailure` when it fails) and its agreement points (:meth:`agree`)."""
        return Collectives(
            self.group, timeout=self.timeout, agreement=lambda e, point: self.agree(e, stage, point=point), stage=stage
        )

    def from_rank_zero(self, name: str, value: str | None, stage: str = "planning") -> str:
        """Rank 0's ``value`` posted under ``name``, on every rank: rank 0 passes it, the others ``None`` and wait for
        it (at most the timeout; a rank reported dead stops the wait). Collective; a ``solo`` session returns ``value``.

        Raises:
            PeerFailure: rank 0 did not post within the timeout, or died.
        """
        key, s = f"zero/{name}", self.store
        if self.solo or self.rank == 0:
            if not self.solo:
                with peer_errors(stage, f"posting {name} to the other ranks"):
                    s.set(key, value or "")
            return value or ""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        delay = 0.001
        with peer_errors(stage, f"waiting for rank 0's {name}"):
            while not s.check([key]):
                if s.check(["dead"]):
                    raise self._failure(stage, "died", dead_ranks(s))
                if deadline is not None and time.monotonic() >= deadline:
                    raise self._failure(stage, "timeout", (0,))
                time.sleep(delay)
                delay = min(2 * delay, poll_cap(self.world))
            return s.get(key).decode()

    def _failure(self, stage: str, reason: str, ranks: tuple[int, ...]) -> BaseException:
        return peer_failure(stage, reason, ranks, rank=self.rank, timeout=self.timeout, dead_after=self.dead_after)

    def _agree_alone(self, error: BaseException | None, stage: str) -> None:
        """A ``solo`` session: this rank's outcome is the outcome; a save is refused."""
        if stage in SAVE_STAGES:
            raise RuntimeError(
                f"save_hf_checkpoint under torch's fake process group (rank {self.rank} of {self.world}): a "
                "fake world has no peers to write the other ranks' shards, so no whole checkpoint can be "
                "saved; save from a real process group (gloo, nccl) or from one process"
            ) from error
        if error is not None:
            raise error
