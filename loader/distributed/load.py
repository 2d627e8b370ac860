"""Distributed loading: DTensor shard boxes, planning that fails together, broadcast of replicated regions.

Each rank plans its own load (RemapBlocks compiled for exactly the boxes of its local shards); the
outcome of planning is agreed before anyone reads or writes, so a failure on one rank fails every rank
with that rank's message (and, for a ``CheckpointError``, its ``path`` and ``key``). The outcome of reading
is agreed the same way. Agreement goes through the process group's store with a timeout and a heartbeat
(:class:`LoadSession`), so a rank that hangs or dies turns into a :class:`~loader.errors.PeerFailure` on
every other rank. With ``broadcast_replicated_tensors`` a target that several ranks hold with the same
boxes is read by one of them and broadcast to the others.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

from ..placements import rank_and_world
from .broadcast import broadcast_owned, owned_subset
from .session import DEFAULT_TIMEOUT, LoadSession, peer_errors

log = logging.getLogger("loader")


def read_together(
    planner: Any,
    reader: Any,
    reads: list,
    deferred: list,
    *,
    progress: bool | None = None,
    rollback: bool = False,
    session: LoadSession | None = None,
) -> None:
    """Execute this rank's share, agree on the outcome, then broadcast shared targets.

    Args:
        planner: the planner whose plan is executed (its ``timeout`` applies when no ``session`` is given).
        reader: the open file reader.
        reads: this rank's block reads.
        deferred: this rank's deferred conversions.
        progress: tqdm progress bar.
        rollback: restore every tensor this rank wrote when the load fails (on any rank).
        session: the load's :class:`LoadSession` (inside ``dcp.load``: none, one is opened here).

    Raises:
        the same error on every rank when a read failed on any rank; :class:`~loader.errors.PeerFailure`
        when a rank hung, died or left. With ``rollback``, every rank first restores the tensors it wrote.
    """
    from ..execute.run import _snapshot, execute_plan, restore

    if session is None:
        with LoadSession(getattr(planner, "timeout", DEFAULT_TIMEOUT)) as session:
            read_together(planner, reader, reads, deferred, progress=progress, rollback=rollback, session=session)
        return
    with peer_errors("reading", "assigning replicated tensors"):
        reads, deferred, owners = owned_subset(planner, reads, deferred)
    saved = _snapshot(planner.plan, planner.slots) if rollback else None
    error = None
    try:
        execute_plan(planner, reader, progress=progress, reads=reads, deferred=deferred)
    except Exception as e:  # agreed below: every rank raises, none hangs
        error = e
    try:
        session.agree(error, "reading")
        with peer_errors("reading", "broadcasting replicated tensors"):
            broadcast_owned(planner, owners)
    except BaseException:
        if saved is not None:
            restore(saved, planner.slots)
        raise


def load_distributed(
    planner: Any,
    path: str,
    *,
    progress: bool | None = None,
    rollback: bool = False,
    timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT,
    revision: str | None = None,
) -> Any:
    """Plan on every rank, agree on the outcome, then read each rank's own byte ranges.

    Args:
        planner: the load planner.
        path: checkpoint file, folder or Hugging Face repo id.
        progress: tqdm progress bar.
        rollback: restore every tensor this rank wrote when reading fails on any rank.
        timeout: seconds each rank waits for the others at the end of planning and of reading.
        revision: the revision of a repo id.

    Returns:
        This rank's :class:`~loader.planner.LoadReport`.

    Raises:
        ValueError/CheckpointError/RuntimeError on every rank when planning (or reading) failed on any rank
        (when planning failed, no model is touched); PeerFailure when a rank hung past ``timeout`` or died.
    """
    from ..checkpoint import FileReader, SafetensorsCheckpoint
    from ..plan import describe

    rank, world = rank_and_world()
    with LoadSession(timeout) as session:
        _resolve_on_rank_zero_first(session, path, revision)
        error = None
        try:
            checkpoint = SafetensorsCheckpoint.open(path, revision=revision)
            plan = planner.build_plan(checkpoint)
        except Exception as e:  # agreed below: every rank raises, none hangs
            error = e
        session.agree(error, "planning")
        log.info("rank %d: %s", rank, describe(plan, checkpoint))
        with FileReader() as reader:
            read_together(
                planner, reader, plan.reads, plan.deferred, progress=progress, rollback=rollback, session=session
            )
            bytes_read = reader.bytes_read
    planner.keyplan.record_on_model(planner.model)
    return planner.report(bytes_read, rank, world)


def _resolve_on_rank_zero_first(session: LoadSession, path: str, revision: str | None) -> None:
    """A Hub repo id not on disk is resolved (downloaded when not cached) by rank 0 alone, while the others
    wait without limit; then every rank finds it in the cache. Local paths need nothing."""
    from ..checkpoint.hub import looks_like_repo_id, resolve_checkpoint

    if os.path.exists(path) or not looks_like_repo_id(path):
        return
    error = None
    if session.rank == 0:
        try:
            resolve_checkpoint(path, revision)
        except Exception as e:  # agreed below: every rank raises
            error = e
    session.agree(error, "resolving", bounded=False)
