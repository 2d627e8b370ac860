"""The distributed load: plan on every rank, fail together, read each rank's own byte ranges.

Each rank plans its own load (RemapBlocks compiled for exactly the boxes of its local shards); the outcome
of planning is agreed before anyone reads or writes, so a failure on one rank fails every rank with that
rank's message (and, for a ``CheckpointError``, its ``path`` and ``key``). The outcome of reading is agreed
the same way. Agreement goes through the process group's store with a timeout and a heartbeat
(:class:`~loader.distributed.LoadSession`), so a rank that hangs or dies turns into a
:class:`~loader.errors.PeerFailure` on every other rank. With ``broadcast_replicated_tensors`` a target that
several ranks hold with the same boxes is read by one of them and broadcast to the others.

This module composes the layers below it — plan values, :func:`~loader.execute.execute_plan` and the
collectives of :mod:`loader.distributed` — and is used by :func:`loader.load_hf_checkpoint` and
:class:`loader.SafetensorsReader`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from .checkpoint import SafetensorsCheckpoint
from .checkpoint.hub import looks_like_repo_id, resolve_checkpoint
from .distributed import LoadSession, broadcast_owned, owned_subset, peer_errors
from .distributed.exchange_reads import SessionPeers
from .distributed.session import check_same
from .distributed.versions import open_agreed
from .execute import SPARSE_FRACTION, execute_plan, host_shared, restore, snapshot
from .execute.exchanged import exchanged_reads
from .options import LoadOptions
from .placements import rank_and_world
from .plan import BlockRead, DeferredRead, RankPlan, ValueRead, describe
from .planner import HFLoadPlanner
from .report import LoadReport, load_report
from .storage import RangeReader, is_url

log = logging.getLogger("loader")


def read_together(
    plan: RankPlan,
    reader: RangeReader,
    reads: Sequence[BlockRead],
    deferred: Sequence[DeferredRead],
    options: LoadOptions,
    *,
    values: Sequence[ValueRead] | None = None,
    session: LoadSession | None = None,
) -> int:
    """Execute this rank's share of ``plan``, agree on the outcome, then broadcast shared targets.

    Args:
        plan: this rank's plan.
        reader: the open file reader.
        reads: this rank's block reads (of ``plan``).
        deferred: this rank's deferred conversions (of ``plan``).
        options: how to read: ``staging_bytes``, ``progress``; ``broadcast_replicated_tensors`` (read each box
            several ranks hold identically on one of them, and broadcast it); ``rollback`` (restore every tensor
            this rank wrote when the load fails on any rank); ``timeout`` (seconds each rank waits for the
            others, when no ``session`` is given); ``exchange_reads`` (fetch interleaved bytes once and exchange
            them: :func:`exchanging`).
        values: this rank's value reads (default: all of ``plan``'s).
        session: the load's :class:`~loader.distributed.LoadSession` (inside ``dcp.load``: none, one is opened
            here).

    Returns:
        Bytes this rank received from other ranks (exchanged reads).

    Raises:
        CheckpointError | ValueError | RuntimeError: the same error on every rank when a read failed on any
            rank. PeerFailure: a rank hung, died or left. With ``rollback``, every rank first restores the
            tensors it wrote.
    """
    if session is None:
        with LoadSession(options.timeout) as session:
            return read_together(plan, reader, reads, deferred, options, values=values, session=session)
    owners: dict = {}
    values = plan.values if values is None else values
    # under a fake process group there are no peers to share with: this rank reads all
    if options.broadcast_replicated_tensors and not session.solo:
        with peer_errors("reading", "assigning replicated tensors"):
            reads, deferred, values, owners = owned_subset(plan, reads, deferred, values)
    saved = snapshot(plan) if options.rollback else None
    error, received = None, 0
    try:
        exchange = exchanging(options, plan, session)
        try:
            shared = _agree_on_reads(plan, reader, reads, session, exchange)
        except host_shared.PostError as e:  # a mate's post: agreed next (the other hosts' ranks never saw it)
            error, shared = e, 0
        if shared:
            what = "file(s) read with readahead (this host's ranks read most of them)"
            log.info("rank %d: %d %s", session.rank, shared, what)
        if exchange:  # a mate's bad post is agreed at the exchanged reads' first agreement point
            peers = SessionPeers(session, "reading")
            peers.carry(error)
            reads, received = exchanged_reads(plan, reader, reads, options, peers)
        if error is None:
            try:
                execute_plan(
                    plan,
                    reader,
                    replace(options, rollback=False),  # rolled back here, once every rank agreed
                    reads=reads,
                    deferred=deferred,
                    values=values,
                )
            except Exception as e:  # agreed below: every rank raises, none hangs
                error = e
        session.agree(error, "reading")
        with peer_errors("reading", "broadcasting replicated tensors"):
            broadcast_owned(plan.slots, owners)
    except BaseException:
        if saved is not None:
            restore(saved, plan.slots)
        raise
    return received


def _agree_on_reads(
    plan: RankPlan, reader: RangeReader, reads: Sequence[BlockRead], session: LoadSession, exchange: bool
) -> int:
    """One gather of every rank's reading settings: ``exchange`` must be the same everywhere (a collective path:
    every rank or none), and the local files this host's ranks read most of together are read with readahead
    (:mod:`~loader.execute.host_shared`). Returns how many of this rank's files that is. Collective."""
    mine: dict = {"host": "", "files": {}}
    if getattr(reader, "read_ahead", None) is not None and not session.solo:
        try:
            mine = host_shared.post(plan.checkpoint, reads)
        except Exception:  # only a hint: this rank then reads as it would alone (and never leaves the others waiting)
            log.warning("rank %d: could not describe its reads to the host's other ranks", session.rank, exc_info=True)
    side = host_shared.pack(mine["files"]) if mine["files"] else None
    small = json.dumps({"exchange": str(exchange), "host": mine["host"], "files": side is not None})
    posts = [json.loads(p) for p in session.gather("reading", small, side=side)]
    check_same("exchange_reads", [p["exchange"] for p in posts])
    if side is None:  # no local file (or a solo session)
        return 0
    mates = host_shared.mates(posts, session.rank)
    together = [host_shared.unpack(t, r) for t, r in zip(session.sides("reading", mates), mates)]
    files = host_shared.files_to_read_ahead(together, mates.index(session.rank), SPARSE_FRACTION)
    reader.read_ahead(files)  # type: ignore[attr-defined]
    return len(files)


def exchanging(options: LoadOptions, plan: RankPlan, session: LoadSession) -> bool:
    """Whether this load exchanges reads (``options.exchange_reads``; None: for a checkpoint at a URL)."""
    if session.solo or session.world < 2:
        return False
    if options.exchange_reads is not None:
        return options.exchange_reads
    return bool(getattr(plan.checkpoint.store, "remote", False))


def load_distributed(
    planner: HFLoadPlanner,
    path: str,
    options: LoadOptions,
    *,
    revision: str | None = None,
    allocate: Callable[[RankPlan], RankPlan] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> LoadReport:
    """Plan on every rank, agree on the outcome, then read each rank's own byte ranges.

    Args:
        path: checkpoint file, folder, Hugging Face repo id or URL.
        options: how the load runs and reads (see :func:`read_together`); ``timeout``: seconds each rank waits for
            the others at the end of planning and of reading.
        revision: the revision of a repo id.
        allocate: for a model on the meta device: the plan is made against its meta tensors, then
            ``allocate(plan)`` allocates them and returns the plan bound to them (a
            :class:`~loader.materialize.MetaAllocation`), before the outcome of planning is agreed; undoing it
            when this raises is the caller's.
        storage_options: options for a URL's backend.

    Returns:
        This rank's :class:`~loader.LoadReport`.

    Raises:
        ValueError | CheckpointError | RuntimeError: on every rank, when planning (or reading) failed on any
            rank (when planning failed, no model is touched). PeerFailure: a rank hung past ``timeout`` or died.
    """
    started = time.perf_counter()
    rank, world = rank_and_world()
    with LoadSession(options.timeout) as session:
        _resolve_on_rank_zero_first(session, path, revision)
        error = plan = None
        try:
            checkpoint = open_agreed(session, opener(path, revision, storage_options), remote=is_url(path))
            plan = planner.build_plan(checkpoint, check_devices=allocate is None)
            plan = allocate(plan) if allocate is not None else plan
        except Exception as e:  # agreed below: every rank raises, none hangs
            error = e
        session.agree(error, "planning")
        assert plan is not None
        log.info("rank %d: %s", rank, describe(plan))
        with plan.checkpoint.reader(direct_io=options.direct_io) as reader:
            received = read_together(plan, reader, plan.reads, plan.deferred, options, session=session)
            bytes_read, requests = reader.bytes_read, reader.reads
    plan.keyplan.record_on_model(planner.model)
    seconds = time.perf_counter() - started
    return load_report(plan, bytes_read, rank, world, seconds=seconds, requests=requests, exchanged=received)


def opener(path: str, revision: str | None, storage_options: Mapping[str, Any] | None) -> Callable:
    """What opens the checkpoint ``path`` bound to the identities it is given
    (:func:`~loader.distributed.versions.open_agreed`)."""

    def open_at(identities: Mapping | None) -> SafetensorsCheckpoint:
        return SafetensorsCheckpoint.open(
            path, revision=revision, storage_options=storage_options, identities=identities
        )

    return open_at


def _resolve_on_rank_zero_first(session: LoadSession, path: str, revision: str | None) -> None:
    """A Hub repo id not on disk is resolved (downloaded when not cached) by rank 0 alone, while the others
    wait without limit; then every rank finds it in the cache. Local paths need nothing."""
    if is_url(path) or os.path.exists(path) or not looks_like_repo_id(path):
        return
    error = None
    if session.rank == 0 or session.solo:  # torch's fake process group: no rank 0 to wait for
        try:
            resolve_checkpoint(path, revision)
        except Exception as e:  # agreed below: every rank raises
            error = e
    session.agree(error, "resolving", bounded=False)
