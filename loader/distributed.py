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

import contextlib
import datetime
import functools
import itertools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .targets import Box, TargetSlot, _storage, plain_slot

log = logging.getLogger("loader")


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 outside ``torch.distributed``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _is_dtensor(t: Any) -> bool:
    return type(getattr(t, "data", t)).__name__ == "DTensor" or type(t).__name__ == "DTensor"


def shard_runs(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> list[list[tuple[int, int, int]]]:
    """The global indices a mesh coordinate owns, per tensor dim, as runs ``(global start, stop, local start)``.

    Follows DTensor exactly (``torch.chunk`` sizes, several mesh dims on one tensor dim applied left to right,
    ``_StridedShard``'s strided indices).

    Raises:
        ValueError: a ``Partial`` placement (there is nothing to load into a pending reduction).
    """
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    local = list(global_shape)
    offsets: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(f"placement {p} is Partial: a checkpoint cannot be loaded into a pending reduction")
        if not isinstance(p, (Shard, _StridedShard)):
            continue
        if p.dim < 0:  # DTensor normalises negative dims; explicit placements may not be
            dim = p.dim + len(global_shape)
            p = _StridedShard(dim, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(dim)
        size, idx = _get_shard_size_and_offsets(
            local[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim], p, offsets.get(p.dim), global_shape[p.dim], False
        )
        local[p.dim] = size
        offsets[p.dim] = idx[:size] if size else idx[:0]
    runs = []
    for d, n in enumerate(global_shape):
        if d not in offsets:
            runs.append([(0, n, 0)] if n else [])
            continue
        # maximal runs of consecutive global indices, found vectorised (a dim may hold ~10^5 indices)
        idx = offsets[d]
        if not idx.numel():
            runs.append([])
            continue
        breaks = (torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1).tolist()
        starts, ends = [0] + breaks, breaks + [idx.numel()]
        firsts, lasts = idx[starts].tolist(), idx[[e - 1 for e in ends]].tolist()
        runs.append([(a, b + 1, pos) for a, b, pos in zip(firsts, lasts, starts)])
    return runs


def shard_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[tuple[Box, Box], ...]:
    """``(global box, local box)`` pairs of the local shard at ``coordinate`` (a union of boxes).

    Cached per (shape, mesh, coordinate, placements): every layer of a model repeats the same few.
    """
    key = (tuple(global_shape), tuple(mesh_shape), tuple(coordinate), tuple((type(p), p) for p in placements))
    try:
        return _shard_boxes_cached(*key)
    except TypeError:  # an unhashable placement: compute it uncached
        return _shard_boxes(global_shape, mesh_shape, coordinate, placements)


@functools.lru_cache(maxsize=65536)
def _shard_boxes_cached(
    global_shape: tuple, mesh_shape: tuple, coordinate: tuple, typed_placements: tuple
) -> tuple[tuple[Box, Box], ...]:
    return _shard_boxes(global_shape, mesh_shape, coordinate, [p for _, p in typed_placements])


def _shard_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[tuple[Box, Box], ...]:
    import itertools

    runs = shard_runs(global_shape, mesh_shape, coordinate, placements)
    if any(not r for r in runs) and global_shape:
        return ()
    pairs = []
    for combo in itertools.product(*runs):
        g = tuple((a, b) for a, b, _ in combo)
        loc = tuple((lp, lp + b - a) for a, b, lp in combo)
        pairs.append((g, loc))
    return tuple(pairs)


def slot_for(name: str, tensor: torch.Tensor) -> TargetSlot:
    """The slot of ``tensor`` on this rank: a DTensor's local shard boxes, or the whole tensor."""
    data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
    if not _is_dtensor(data):
        return plain_slot(name, tensor)
    mesh = data.device_mesh
    coord = mesh.get_coordinate()
    shape = tuple(data.shape)
    if coord is None:
        return TargetSlot(name, shape, data.dtype, _storage(tensor), ())
    try:
        boxes = shard_boxes(shape, tuple(mesh.shape), coord, data.placements)
    except ValueError as e:
        raise ValueError(f"model tensor {name!r}: {e}") from None
    return TargetSlot(name, shape, data.dtype, _storage(tensor), boxes)


# ---------------------------------------------------------------------------------------------------
# fail together

DEFAULT_TIMEOUT = 300.0
"""Seconds a rank waits at an agreement point for the others (``load_hf_checkpoint(timeout=...)``)."""

HEARTBEAT_LIMIT = 30.0
"""At most this many seconds without a heartbeat and a rank that had started the load is reported dead."""

_STAGES = {
    "resolving": "Resolving the checkpoint",
    "planning": "Planning the load",
    "reading": "Reading the checkpoint",
}
_LOAD_IDS = itertools.count()


def timeout_seconds(timeout: float | datetime.timedelta | None) -> float | None:
    """``timeout`` in seconds (None: no limit).

    Raises:
        ValueError: a timeout that is not positive.
    """
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"timeout must be positive (or None for no limit), got {timeout!r}")
    return seconds


class LoadSession:
    """The fail-together protocol of one distributed load, carried by the default process group's store.

    At each agreement point (end of planning, end of reading) every rank posts its outcome to the store and
    waits, at most ``timeout`` seconds, until every rank has posted. No collective is involved, so a rank
    that never arrives blocks nobody: the waiting ranks see in the store which ranks are missing. One
    verdict per agreement point is chosen by the store's compare-and-set and obeyed by every rank, a hung
    rank that resumes after the others gave up included. A background thread beats a per-rank counter and
    watches the next live rank's: a rank that started the load and stops beating for ``dead_after`` seconds
    (``min(timeout / 2, HEARTBEAT_LIMIT)``) is reported dead without waiting for the full timeout.

    Use as a context manager around the load (it starts and stops the heartbeat); collective: every rank of
    the default group opens one session per load, in the same order.

    Args:
        timeout: seconds (or a ``timedelta``) to wait at each agreement point; None waits without limit
            (dead ranks are still detected).
    """

    def __init__(self, timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT) -> None:
        self.rank, self.world = rank_and_world()
        self.timeout = timeout_seconds(timeout)
        self.dead_after = HEARTBEAT_LIMIT if self.timeout is None else min(HEARTBEAT_LIMIT, self.timeout / 2)
        self.store = dist.PrefixStore(f"loader/{next(_LOAD_IDS)}", dist.distributed_c10d._get_default_store())
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._declared: set[int] = set()

    def __enter__(self) -> LoadSession:
        self.store.add(f"beat/{self.rank}", 1)  # a first beat before anything can hang
        self._thread = threading.Thread(target=self._heartbeat, name="loader-heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.store.set(f"done/{self.rank}", "1")  # before the beats stop: not to be taken for dead
        except Exception:  # noqa: BLE001 - a broken store: the load is failing anyway
            log.debug("rank %d: could not mark the load done", self.rank, exc_info=True)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.dead_after))

    # -- heartbeat ------------------------------------------------------------------------------------

    def _heartbeat(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        try:
            while not self._stop.wait(self.dead_after / 5):
                self.store.add(f"beat/{self.rank}", 1)
                self._watch(seen)
        except Exception:  # noqa: BLE001 - the store went away (group destroyed): nothing left to watch
            log.debug("rank %d: heartbeat stopped", self.rank, exc_info=True)

    def _watch(self, seen: dict[int, tuple[int, float]]) -> None:
        """Watch the next rank's beats; past one declared dead, watch the one after it too."""
        peer = (self.rank + 1) % self.world
        while peer != self.rank:
            beats = self.store.add(f"beat/{peer}", 0)
            now = time.monotonic()
            if peer not in seen or seen[peer][0] != beats:
                seen[peer] = (beats, now)
                return
            if beats == 0 or now - seen[peer][1] < self.dead_after or self.store.check([f"done/{peer}"]):
                return  # not started yet (never called dead: it may just be late), alive, or finished
            if peer not in self._declared:
                self._declared.add(peer)
                log.warning(
                    "rank %d: rank %d stopped beating for %.1f s: reported dead", self.rank, peer, now - seen[peer][1]
                )
                self.store.append("dead", f"{peer},")
            peer = (peer + 1) % self.world

    # -- agreement --------------------------------------------------------------------------------------

    def agree(self, error: BaseException | None, stage: str, *, bounded: bool = True) -> None:
        """Post this rank's outcome of ``stage``, wait for every rank's, and raise on every rank if any failed.

        Args:
            error: this rank's failure, or None.
            stage: ``"resolving"``, ``"planning"`` or ``"reading"``.
            bounded: wait at most the session's timeout (False: wait without limit, e.g. for a download;
                dead ranks are still detected).

        Raises:
            CheckpointError | ValueError | RuntimeError: some rank failed (the lowest failed rank's error type,
                message, ``path`` and ``key``; other failed ranks are listed).
            PeerFailure: some rank did not arrive within the timeout, died, or this rank arrived after the
                others gave up waiting for it.
        """
        with peer_errors(stage, "agreeing on the outcome through the store"):  # e.g. the store's host died
            verdict, failed = self._exchange(error, stage, bounded)
        if verdict == "ok":
            if failed:
                _raise_failed(_STAGES[stage], failed, error)
            return
        reason, _, names = verdict.partition(":")
        raise self._peer_failure(stage, reason, tuple(int(r) for r in names.split(",") if r)) from error

    def _exchange(self, error: BaseException | None, stage: str, bounded: bool) -> tuple[str, list]:
        """Post this rank's outcome; the verdict and, when it is ``"ok"``, every failed rank's outcome."""
        from .errors import CheckpointError

        s = self.store
        if error is not None:
            carried = isinstance(error, CheckpointError)
            payload = [
                self.rank,
                f"{type(error).__name__}: {error}",
                _error_kind(error),
                error.path if carried else None,
                error.key if carried else None,
            ]
            s.set(f"{stage}/failed/{s.add(f'{stage}/failed', 1)}", json.dumps(payload))
        s.set(f"{stage}/here/{self.rank}", "1")
        s.add(f"{stage}/count", 1)
        verdict = self._verdict(stage, self.timeout if bounded else None)
        if verdict != "ok":
            return verdict, []
        count = s.add(f"{stage}/failed", 0)
        failed = [json.loads(s.get(f"{stage}/failed/{i}")) for i in range(1, count + 1)]
        return verdict, sorted(failed, key=lambda f: f[0])

    def _verdict(self, stage: str, timeout: float | None) -> str:
        s, key = self.store, f"{stage}/verdict"
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.001
        while True:
            if s.add(f"{stage}/count", 0) == self.world:
                return _decide(s, key, "ok")
            if s.check([key]):
                return s.get(key).decode()
            if s.check(["dead"]):
                dead = sorted({int(r) for r in s.get("dead").decode().split(",") if r})
                return _decide(s, key, "died:" + ",".join(map(str, dead)))
            if deadline is not None and time.monotonic() >= deadline:
                missing = [r for r in range(self.world) if not s.check([f"{stage}/here/{r}"])]
                if missing:
                    return _decide(s, key, "timeout:" + ",".join(map(str, missing)))
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _peer_failure(self, stage: str, reason: str, ranks: tuple[int, ...]) -> BaseException:
        from .errors import PeerFailure

        what, listed = _STAGES[stage], ", ".join(map(str, ranks))
        limit = "the timeout" if self.timeout is None else f"the {self.timeout:g} s timeout"  # ranks may differ
        if reason == "timeout" and self.rank in ranks:
            text = (
                f"{what} failed: this rank ({self.rank}) finished {stage} after the other ranks had stopped "
                f"waiting for it ({limit})"
            )
        elif reason == "timeout":
            text = (
                f"{what} failed: rank(s) {listed} did not finish {stage} within {limit} (hung, or slower "
                "than the timeout allows); every other rank stopped"
            )
        elif self.rank in ranks:
            text = (
                f"{what} failed: this rank ({self.rank}) was reported dead by its peers (its heartbeat "
                f"stopped for {self.dead_after:g} s)"
            )
        else:
            text = (
                f"{what} failed: a peer died during {stage}: rank(s) {listed} stopped responding (no "
                f"heartbeat for {self.dead_after:g} s: the process exited, was killed or froze)"
            )
        return PeerFailure(text, stage=stage, ranks=ranks, reason=reason)


def _decide(store: Any, key: str, verdict: str) -> str:
    """The verdict of an agreement point: the first one set wins, every rank reads the same."""
    return store.compare_set(key, "", verdict).decode()


@contextlib.contextmanager
def peer_errors(stage: str, doing: str) -> Iterator[None]:
    """Translate a failed collective or store operation (gloo's bare "Connection closed by peer", a timeout)
    into :class:`~loader.errors.PeerFailure` (``reason="connection"``)."""
    from .errors import PeerFailure

    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as e:  # DistBackendError is a RuntimeError
        raise PeerFailure(
            f"{_STAGES[stage]} failed: a peer died or left the process group while {doing} ({type(e).__name__}: {e})",
            stage=stage,
            reason="connection",
        ) from e


def _raise_failed(what: str, failed: list, error: BaseException | None) -> None:
    """Raise the lowest failed rank's error (its type, message, path and key), listing the others."""
    r, message, kind, path, key = failed[0]
    text = f"{what} failed on rank {r}: {message}"
    if len(failed) > 1:
        text += f" (and on rank(s) {', '.join(str(f[0]) for f in failed[1:])})"
    exc = _make_error(kind, text, path, key)
    if error is not None:
        raise exc from error
    raise exc


def _error_kind(error: BaseException | None) -> str:
    from .errors import CheckpointError

    if error is None:
        return ""
    if isinstance(error, CheckpointError):
        return "checkpoint"
    if isinstance(error, ValueError):
        return "value"
    return "runtime"


def _make_error(kind: str, text: str, path: str | None = None, key: str | None = None) -> BaseException:
    from .errors import CheckpointError

    if kind == "checkpoint":
        return CheckpointError(text, path=path, key=key)
    if kind == "value":
        return ValueError(text)
    return RuntimeError(text)


# ---------------------------------------------------------------------------------------------------
# broadcast of replicated regions


def _signature(slot: TargetSlot) -> tuple:
    return tuple(g for g, _ in slot.boxes)


def assign_owners(planner: Any) -> dict[str, tuple[int, tuple[int, ...]]]:
    """For conversions several ranks need identically: ``{target: (owner rank, ranks sharing it)}``.

    Owners are chosen per conversion (so shared sources are read once), balancing bytes; every rank
    computes the same answer from the all-gathered signatures.
    """
    rank, world = rank_and_world()
    mine = {}
    for i, conv in enumerate(planner.plan.conversions):
        slots = [planner.slots[t] for t in conv.targets]
        if all(s.boxes for s in slots):
            mine[i] = tuple(_signature(s) for s in slots)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    groups: dict[tuple[int, tuple], list[int]] = {}
    for r, sigs in enumerate(everyone):
        for i, sig in sigs.items():
            groups.setdefault((i, sig), []).append(r)
    owners: dict[str, tuple[int, tuple[int, ...]]] = {}
    load = [0] * world
    for (i, sig), ranks in sorted(groups.items(), key=lambda kv: kv[0][0]):
        if len(ranks) < 2:
            continue
        owner = min(ranks, key=lambda r: (load[r], r))
        load[owner] += sum(_box_numel(s) for s in sig)
        if rank in ranks:
            for t in planner.plan.conversions[i].targets:
                owners[t] = (owner, tuple(ranks))
    return owners


def _box_numel(sig: tuple) -> int:
    return sum(math.prod(b - a for a, b in g) for g in sig)


_GROUPS: dict[tuple[int, ...], Any] = {}


def _group_for(ranks: tuple[int, ...], world: int) -> Any:
    if len(ranks) == world:
        return None
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def _all_groups(planner: Any, owners: dict) -> list[tuple[int, ...]]:
    """Every rank group any rank needs, in one agreed order (new_group is collective over the world)."""
    _, world = rank_and_world()
    mine = sorted({ranks for _, ranks in owners.values() if len(ranks) < world})
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    return sorted({g for groups in everyone for g in groups})


# ---------------------------------------------------------------------------------------------------
# the distributed load


def owned_subset(planner: Any, reads: list, deferred: list) -> tuple[list, list, dict]:
    """With ``broadcast_replicated_tensors``: the reads and deferred conversions this rank owns, and the owners.

    Collective (all ranks call it, after planning succeeded everywhere).
    """
    rank, world = rank_and_world()
    if not planner.broadcast_replicated_tensors or world < 2:
        return reads, deferred, {}
    owners = assign_owners(planner)
    skip = {n for n, (owner, _) in owners.items() if owner != rank}
    for g in _all_groups(planner, owners):
        _group_for(g, world)
    reads = [r for r in reads if r.target not in skip]
    deferred = [d for d in deferred if not set(d.conversion.targets) <= skip]
    return reads, deferred, owners


def broadcast_owned(planner: Any, owners: dict) -> None:
    """Broadcast each shared target from its owner (names in one global order: no cross-group deadlock)."""
    _, world = rank_and_world()
    for name in sorted(owners):
        owner, ranks = owners[name]
        local = planner.slots[name].local
        buf = local if local.is_contiguous() else local.contiguous()
        dist.broadcast(buf, src=owner, group=_group_for(ranks, world))
        if buf is not local:
            local.copy_(buf)


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
    from .api import _snapshot, execute_plan, restore

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
    from .checkpoint import FileReader, SafetensorsCheckpoint
    from .plan import describe

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
    from .checkpoint.hub import looks_like_repo_id, resolve_checkpoint

    if os.path.exists(path) or not looks_like_repo_id(path):
        return
    error = None
    if session.rank == 0:
        try:
            resolve_checkpoint(path, revision)
        except Exception as e:  # agreed below: every rank raises
            error = e
    session.agree(error, "resolving", bounded=False)
