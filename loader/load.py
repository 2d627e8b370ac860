"""The distributed load: plan on every rank, fail together, read each rank's own byte ranges.

Each rank plans its own load (RemapBlocks compiled for exactly the boxes of its local shards); the outcome
of planning is agreed before anyone reads or writes, so a failure on one rank fails every rank with that
rank's message (and, for a ``CheckpointError``, its ``path`` and ``key``). The outcome of reading is agreed
the same way: ``"planning"`` and ``"reading"`` are stages of the load's :class:`~loader.distributed.Session`, agreed
through the process group's store with a timeout and a heartbeat, so a rank that hangs or dies turns into a
:class:`~loader.errors.PeerFailure` on every other rank; what the load changed is undone by its one
:class:`~loader.execute.Rollback`. With ``broadcast_replicated_tensors`` a target that
several ranks hold with the same boxes is read by one of them and broadcast to the others.

This module composes the layers below it — plan values, :func:`~loader.execute.execute_plan` and the
collectives of :mod:`loader.distributed` — and is used by :func:`loader.load_hf_checkpoint` and
:class:`loader.SafetensorsReader`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from .checkpoint import Checkpoint, TableCheckpoint, open_checkpoint
from .checkpoint.hub import looks_like_repo_id, resolve_checkpoint
from .distributed import Session, broadcast_owned, owned_subset
from .distributed.verdicts import check_same
from .distributed.versions import open_agreed
from .execute import Rollback, execute_plan, host_shared
from .execute.exchanged import exchanged_reads
from .options import LoadOptions, StorageOptions
from .plan import BlockRead, DeferredRead, RankPlan, ValueRead, describe
from .planner import HFLoadPlanner
from .report import LoadReport, load_report
from .storage import RangeReader, is_url
from .storage.capabilities import ReadsAhead, capability, is_remote

log = logging.getLogger("loader")


def read_on_every_rank(
    plan: RankPlan,
    reader: RangeReader,
    reads: Sequence[BlockRead],
    deferred: Sequence[DeferredRead],
    options: LoadOptions,
    *,
    values: Sequence[ValueRead] | None = None,
    session: Session | None = None,
    rollback: Rollback | None = None,
) -> int:
    """Execute this rank's share of ``plan`` as the stage ``"reading"`` of every rank of the session's group, then
    broadcast shared targets.

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
        session: the flow's :class:`~loader.distributed.Session` (inside ``dcp.load``: none, this read is a flow of
            its own: it opens one, and its rollback).
        rollback: the flow's :class:`~loader.execute.Rollback`, which keeps the tensors this read writes (with
            ``session``; None: nothing kept).

    Returns:
        Bytes this rank received from other ranks (exchanged reads).

    Raises:
        CheckpointError | ValueError | RuntimeError: the same error on every rank when a read failed on any
            rank. PeerFailure: a rank hung, died or left. With ``rollback``, every rank first restores the
            tensors it wrote (when the flow's rollback undoes).
    """
    if session is None:
        with Session(options.timeout) as session, Rollback(options.rollback) as rollback:
            return read_on_every_rank(
                plan, reader, reads, deferred, options, values=values, session=session, rollback=rollback
            )
    owners: dict = {}
    values = plan.values if values is None else values
    # under a fake process group there are no peers to share with: this rank reads all
    if options.broadcast_replicated_tensors and not session.solo:
        reads, deferred, values, owners = owned_subset(plan, reads, deferred, values, session)
    if rollback is not None:
        rollback.keep(plan)
    received = 0
    alone = replace(options, rollback=False)  # undone by the flow, once every rank agreed
    with session.stage("reading"):
        exchange = exchanging(options, plan, session)
        posts = _gather_posts(plan, reader, reads, session, exchange)  # exchange: the same on every rank past here
        # before the exchanged reads' own points: a post only this host's ranks found bad is agreed by every rank
        with session.stage("reading", point="posts") if exchange else contextlib.nullcontext():
            shared = _read_ahead(posts, reader, session)
        if shared:
            what = "file(s) read with readahead (this host's ranks read most of them)"
            log.info("rank %d: %d %s", session.rank, shared, what)
        if exchange:
            peers = session.peers("reading")
            reads, values, received = exchanged_reads(plan, reader, reads, alone, peers, values=values)
        execute_plan(plan, reader, alone, reads=reads, deferred=deferred, values=values)
    broadcast_owned(plan.slots, owners, session)
    return received


def _gather_posts(
    plan: RankPlan, reader: RangeReader, reads: Sequence[BlockRead], session: Session, exchange: bool
) -> list[dict]:
    """One gather of every rank's reading settings (index = rank): ``exchange`` must be the same everywhere (a
    collective path: every rank or none), and its host and local files (:mod:`~loader.execute.host_shared`).
    Collective.

    Raises:
        ValueError: the ranks disagree on ``exchange`` (on every rank).
    """
    mine: dict = {"host": "", "files": {}}
    if capability(reader, ReadsAhead) is not None and not session.solo:
        try:
            mine = host_shared.post(plan.checkpoint, reads)
        except Exception:  # only a hint: this rank then reads as it would alone (and never leaves the others waiting)
            log.warning("rank %d: could not describe its reads to the host's other ranks", session.rank, exc_info=True)
    packed = host_shared.pack(mine["files"]) if mine["files"] else None
    post = json.dumps({"exchange": str(exchange), "host": mine["host"], "files": packed}).encode()
    posts = [json.loads(p) for p in session.gather(post, doing="gathering every rank's reading settings")]
    check_same("exchange_reads", [p["exchange"] for p in posts])
    return posts


def _read_ahead(posts: list[dict], reader: RangeReader, session: Session) -> int:
    """Read with readahead the local files this host's ranks read most of together; how many of this rank's files
    that is.

    Raises:
        PostError: a mate's post does not unpack (on this host's ranks).
    """
    if session.solo:  # torch's fake process group: no mates, and its gather holds this rank's post alone
        return 0
    return host_shared.read_ahead_shared(posts, reader, session.rank)


def exchanging(options: LoadOptions, plan: RankPlan, session: Session) -> bool:
    """Whether this load exchanges reads (``options.exchange_reads``; None: for a checkpoint at a URL)."""
    if session.solo or session.world < 2:
        return False
    if options.exchange_reads is not None:
        return options.exchange_reads
    return is_remote(plan.checkpoint.store)


def load_distributed(
    planner: HFLoadPlanner,
    path: str,
    options: LoadOptions,
    *,
    storage: StorageOptions | None = None,
    allocate: Callable[[RankPlan], RankPlan] | None = None,
    group: Any = None,
) -> LoadReport:
    """Plan on every rank, agree on the outcome, then read each rank's own byte ranges.

    Args:
        path: checkpoint file, folder, Hugging Face repo id or URL, or a :class:`~loader.checkpoint.Checkpoint`
            (each rank's own).
        options: how the load runs and reads (see :func:`read_on_every_rank`); ``timeout``: seconds each rank waits for
            the others at the end of planning and of reading.
        storage: where and how the checkpoint's bytes are reached (:class:`~loader.options.StorageOptions`).
        allocate: for a model on the meta device: the plan is made against its meta tensors, then
            ``allocate(plan)`` allocates them and returns the plan bound to them (a
            :class:`~loader.materialize.MetaAllocation`), before the outcome of planning is agreed; undoing it
            when this raises is the caller's.
        group: the process group of the load (None: the default group).

    Returns:
        This rank's :class:`~loader.LoadReport`.

    Raises:
        ValueError | CheckpointError | RuntimeError: on every rank, when planning (or reading) failed on any
            rank (when planning failed, no model is touched). PeerFailure: a rank hung past ``timeout`` or died.
    """
    started = time.perf_counter()
    storage = storage if storage is not None else StorageOptions()
    with Session(options.timeout, group) as session, Rollback(options.rollback) as rollback:
        checkpoint = path if isinstance(path, Checkpoint) else None  # a checkpoint object: each rank's own, opened
        if checkpoint is None:
            _resolve_on_rank_zero_first(session, path, storage.revision)
        with session.stage("planning"):  # when it fails anywhere, no model is touched
            if checkpoint is None:
                checkpoint = open_agreed(session, opener(path, storage), remote=is_url(path))
            plan = planner.build_plan(checkpoint, check_devices=allocate is None)
            plan = allocate(plan) if allocate is not None else plan
        rank, world = session.rank, session.world
        log.info("rank %d: %s", rank, describe(plan))
        with plan.checkpoint.reader(direct_io=storage.direct_io) as reader:
            received = read_on_every_rank(
                plan, reader, plan.reads, plan.deferred, options, session=session, rollback=rollback
            )
            bytes_read, requests = reader.bytes_read, reader.reads
    plan.keyplan.record_on_model(planner.model)
    seconds = time.perf_counter() - started
    return load_report(plan, bytes_read, rank, world, seconds=seconds, requests=requests, exchanged=received)


def opener(path: str, storage: StorageOptions | None) -> Callable:
    """What opens the checkpoint ``path`` bound to the identities it is given
    (:func:`~loader.distributed.versions.open_agreed`)."""

    def open_at(identities: Mapping | None) -> TableCheckpoint:
        return open_checkpoint(path, storage=storage, identities=identities)

    return open_at


def _resolve_on_rank_zero_first(session: Session, path: str, revision: str | None) -> None:
    """A Hub repo id not on disk is resolved (downloaded when not cached) by rank 0 alone, while the others
    wait without limit; then every rank finds it in the cache. Local paths need nothing."""
    if is_url(path) or os.path.exists(path) or not looks_like_repo_id(path):
        return
    with session.stage("resolving", bounded=False):  # every rank raises rank 0's failure
        if session.rank == 0 or session.solo:  # torch's fake process group: no rank 0 to wait for
            resolve_checkpoint(path, revision)
