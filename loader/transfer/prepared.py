"""A transfer planned once for a (source, destination) pair and replayed on every step: :func:`prepare_transfer`,
:class:`PreparedTransfer`.

Preparing runs steps 1-3 of :func:`~loader.transfer.transfer_weights` (describe, map both sides, plan, rounds)
and compiles this rank's rounds into copies of fixed views (:func:`~loader.transfer.exchange.compile_rounds`).
Each :meth:`PreparedTransfer.run` then only checks that both models are still the ones planned
(:func:`fingerprint`: names, global shapes, dtypes, placements and mesh, and each local tensor's device, shape,
strides and memory address) and replays. The ranks agree on the check in one small collective over the
transfer's group (:class:`~loader.transfer.agreement.Flags`: every rank's "changed" flag, within the timeout),
before any byte is sent: when any rank's models changed, every rank plans again from the models it is given, in
a session through the store as :func:`prepare_transfer` does (``TransferReport.planned``), and a change that
cannot be transferred (a shape no key gives, ranks holding a tensor differently) is raised on every rank as
``transfer_weights`` raises it; a rank whose check failed, or a failed check collective, sends the ranks to an
agreement through the store (:func:`~loader.transfer.agreement.fail_together`). After the rounds the outcome is
agreed through the store (one verdict, as in ``transfer_weights``, by a :class:`~loader.distributed.ballot.Ballot`:
no session thread, four round trips; without a timeout, a session): the same error on every rank, a rank that
never arrives named in a :class:`~loader.errors.PeerFailure` within the timeout, and no rank keeping the new
values while another puts the old back.

Vocabulary:

- **fingerprint**: what a rank's compiled views depend on, per model tensor, compared as a value (not sent);
- **version**: how many times a prepared transfer ran (each run's report carries it).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._torch import local_tensor
from ..distributed import Session, peer_errors
from ..distributed.ballot import Ballot
from ..errors import PeerFailure
from ..execute import Rollback
from ..options import Rules, TransferOptions, timeout_seconds
from ..plan import TraceCache
from ..plan.slots import box_view, iter_model_tensors
from ..rules.conversion import cast_like_transformers
from .agreement import STAGE, Flags, Sharing, check_views, digest, fail_together, model_views
from .exchange import Exchange, compile_rounds, log_progress
from .memory import check_memory
from .plan import TransferPlan, plan_transfer
from .report import TransferReport, TransferRun
from .schedule import degrees, rank_rounds
from .sides import as_rules, dest_side, parts_of, source_side

__all__ = ["PreparedTransfer", "fingerprint", "prepare_transfer"]

log = logging.getLogger("loader")

Mapping_ = Rules | Sequence[Any] | None


@dataclass(frozen=True)
class _Planned:
    """What one planning left on this rank: the plan, the key plan (fallbacks), the destination's slots, the
    fallbacks' key buffers, the tensors it writes, the compiled replay, the fingerprint it holds for, and the
    destination tensors it receives region by region and computes from keys (the reports' names)."""

    plan: TransferPlan
    keyplan: Any
    dst_parts: dict
    buffers: dict[str, torch.Tensor]
    written: dict[str, torch.Tensor]
    replay: Exchange
    fingerprint: tuple
    transferred: tuple[str, ...]
    fallback: tuple[str, ...]


def fingerprint(model: torch.nn.Module | None) -> tuple:
    """What a compiled transfer depends on of ``model`` on this rank: per tensor its name, global shape, dtype,
    placements and mesh shape (DTensor), and its local tensor's device, shape, strides, storage offset and data
    pointer. Equal before and after in-place updates of the values (an optimizer step)."""
    if model is None:
        return ()
    out = []
    for name, t in iter_model_tensors(model):
        local = local_tensor(t)
        if local is None:
            out.append((name, t.dtype, t.device, t.shape, t.stride(), t.storage_offset(), t.data_ptr()))
        else:
            mesh = t.device_mesh
            where = (local.dtype, local.device, local.shape, local.stride(), local.storage_offset(), local.data_ptr())
            out.append((name, t.dtype, t.shape, tuple(t.placements), mesh.shape, mesh.mesh_dim_names, *where))
    return tuple(out)


class PreparedTransfer:
    """A transfer planned for one (source, destination) pair (:func:`prepare_transfer`), replayed by :meth:`run`.

    Holds, besides the plan, a send and a receive buffer of its largest round (each at most ``bucket_bytes`` plus
    padding), the staging of non-contiguous source cells of its largest round, and the whole checkpoint keys of
    fallback conversions: :attr:`buffer_bytes`.

    Attributes:
        version: how many times :meth:`run` ran (successfully or not).
        plans: how many times it planned (preparing included).
        cpu_outside_seconds: this thread's CPU time in the last replay outside its rounds: the check, the
            agreements, the bookkeeping (its wall outside the rounds less this is waiting for other ranks).
    """

    def __init__(
        self, mappings: tuple[Mapping_, Mapping_, Any], group: dist.ProcessGroup | None, options: TransferOptions
    ) -> None:
        self._mappings, self.group, self.options = mappings, group, options
        self.timeout = timeout_seconds(options.timeout)
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.version = 0
        self.plans = 0
        self._planned: _Planned | None = None
        self._flags: Flags | None = None  # a replay's check (:meth:`run`), made by the first plan
        self._ballot: Ballot | None = None  # a replay's closing verdict (:func:`_close`), made with the flags
        self.cpu_outside_seconds = 0.0

    @property
    def plan(self) -> TransferPlan:
        """This rank's part of the plan (``plan_transfer(..., rank=r)``)."""
        assert self._planned is not None
        return self._planned.plan

    @property
    def buffer_bytes(self) -> int:
        """Bytes of the buffers it holds between runs (rounds' pools and fallback keys)."""
        p = self._planned
        return 0 if p is None else p.replay.buffer_bytes + sum(b.nbytes for b in p.buffers.values())

    @property
    def copies(self) -> int:
        """Strided copies one run makes on this rank (staging, within the rank, packing, unpacking)."""
        return 0 if self._planned is None else self._planned.replay.copies

    def run(self, src: torch.nn.Module | None, dst: torch.nn.Module | None) -> TransferReport:
        """Copy ``src``'s current values into ``dst`` by the prepared plan. Collective: every rank of the world calls
        it with its parts of the two models (the same ones it prepared with, or others: then it plans again).

        Returns:
            This rank's :class:`TransferReport` (``planned``: whether this run planned; ``version``: this run's).

        Raises:
            ValueError: on every rank, when the models changed on some rank and planning again refuses them (as
                :func:`~loader.transfer.transfer_weights` does); nothing was sent.
            PeerFailure: on every rank, a rank failed, died, hung or never called (past ``options.timeout``).
        """
        t0, c0 = time.perf_counter(), time.thread_time()
        self.version += 1
        current = self._planned is not None and fingerprint_pair(src, dst) == self._planned.fingerprint
        if self._flags is None:  # one process
            return self._run_planning(src, dst, t0, None if current else [self.rank])
        t1, c1 = time.perf_counter(), time.thread_time()
        error = _pack_first(self._planned.replay) if current else None  # before the wait for the slowest rank
        t2, c2 = time.perf_counter(), time.thread_time()
        try:  # every rank's flag: 0 unchanged, 1 changed, 2 failed
            flags = self._flags.exchange(2 if error else int(not current), "checking the models")
        except PeerFailure as e:
            flags, error = [2], error or e
        if 2 in flags:
            fail_together(error, self.timeout, self.group)
        changed = [r for r, flag in enumerate(flags) if flag]
        if changed:
            return self._run_planning(src, dst, t0, changed)
        return self._replay(self._planned, (t0, c0), (t2 - t1, c2 - c1))

    def _replay(self, p: _Planned, start: tuple[float, float], ahead: tuple[float, float]) -> TransferReport:
        """The rounds (the first packed already, in ``ahead``: seconds of wall and of this thread's CPU), then the
        outcome agreed through the store (:func:`_close`): a failure on any rank (or a failed collective) raised on
        every rank, every rank's writes put back."""
        (t0, c0), t1, progress = start, time.perf_counter(), self.options.progress
        report = log_progress(self.rank) if progress is True else (progress or None)
        error = None
        with Rollback(self.options.rollback) as undo:
            undo.keep_tensors(p.written)  # put back if the transfer fails on any rank
            t2, c2 = time.perf_counter(), time.thread_time()
            try:
                with peer_errors(STAGE, "exchanging the weights"):
                    counts = p.replay.run(report)
                _run_fallbacks(p.plan, self.rank, p.keyplan, p.buffers, p.dst_parts, p.written)
            except Exception as e:
                error = e
            t3, c3 = time.perf_counter(), time.thread_time()
            _close(self._ballot, error, self.version, self.timeout, self.group)
        t4, c4 = time.perf_counter(), time.thread_time()
        self.cpu_outside_seconds = c4 - c0 - (c3 - c2) - ahead[1]
        return _report(p, counts, TransferRun(t4 - t0, False, self.version, 0.0, t1 - t0 - ahead[0],
                                              t3 - t2 + ahead[0]))  # fmt: skip

    def _run_planning(
        self, src: torch.nn.Module | None, dst: torch.nn.Module | None, t0: float, changed: list[int] | None
    ) -> TransferReport:
        """A run in a session of its own (through the store): planning again when ``changed`` names ranks whose
        models changed (one process: the check is this rank's alone)."""
        session = Session(self.timeout, self.group) if self.distributed else None
        sharing = Sharing(session)
        with session or contextlib.nullcontext(), Rollback(self.options.rollback) as undo:
            t1 = time.perf_counter()
            if changed:
                log.info("rank %d: transfer version %d: models changed on rank(s) %s: planning again",
                         self.rank, self.version, changed)  # fmt: skip
                self._planned = None
                self._plan(src, dst, sharing)
            p = self._planned
            assert p is not None
            t2 = time.perf_counter()
            undo.keep_tensors(p.written)  # put back if the transfer fails on any rank
            with session.stage(STAGE) if session is not None else contextlib.nullcontext():
                progress = self.options.progress
                report = log_progress(self.rank) if progress is True else (progress or None)
                t3 = time.perf_counter()
                with peer_errors(STAGE, "exchanging the weights") if self.distributed else contextlib.nullcontext():
                    counts = p.replay.run(report)
                _run_fallbacks(p.plan, self.rank, p.keyplan, p.buffers, p.dst_parts, p.written)
                t4 = time.perf_counter()
            sharing.close()
        planned = bool(changed)
        return _report(p, counts, TransferRun(time.perf_counter() - t0, planned, self.version, (t2 - t1) * planned,
                                              t1 - t0, t4 - t3))  # fmt: skip

    # -- planning ---------------------------------------------------------------------------------

    def _plan(self, src: torch.nn.Module | None, dst: torch.nn.Module | None, sharing: Sharing) -> None:
        """Steps 1-3 of ``transfer_weights`` and the compiled rounds; failures raised on every rank."""
        rank, options = self.rank, self.options
        (src_parts, src_local), (dst_parts, dst_local) = parts_of(src), parts_of(dst)
        plan, keyplan = _plan(rank, src, dst, self._mappings, (src_parts, dst_parts), (src_local, dst_local), sharing)
        schedule = rank_rounds(plan, options.bucket_bytes, sharing.share("degrees", degrees(plan)))
        total = max(sharing.share("rounds", len(schedule) if any(m.src != m.dst for m in plan.moves) else 0))
        schedule += [[] for _ in range(max(total, 1) - len(schedule))]
        buffers = {
            k: torch.empty(shape, dtype=dtype)
            for f in plan.fallback
            if rank in f.ranks
            for k, (shape, dtype) in zip(f.keys, f.specs)
        }
        written = {m.target for m in plan.moves if m.dst == rank and not m.key}
        written |= {t for f in plan.fallback if rank in f.ranks for t in f.targets}
        replay = compile_rounds(
            plan, rank, schedule, (src_local, dst_local, buffers), group=self.group, timeout=self.timeout,
            every_round=total > 0,
        )  # fmt: skip
        self.plans += 1
        transferred = tuple(dict.fromkeys(m.target for m in plan.moves if m.dst == rank and not m.key))
        fallback = tuple(t for f in plan.fallback if rank in f.ranks for t in f.targets)
        self._planned = _Planned(plan, keyplan, dst_parts, buffers, {t: dst_local[t] for t in written}, replay,
                                 fingerprint_pair(src, dst), transferred, fallback)  # fmt: skip
        if self.distributed and self._flags is None:
            self._flags = Flags(self.group, self.timeout, replay.device)
            self._ballot = None if self.timeout is None else Ballot(self.timeout, self.group)


def _close(ballot: Ballot | None, error: BaseException | None, version: int, timeout: float | None, group) -> None:
    """A replay's closing point: one verdict through the store, so that the ranks never part with some keeping the
    new values and others putting the old back (a collective cut short by a dying rank reaches only some): a
    :class:`~loader.distributed.ballot.Ballot` (no session, no heartbeat thread: the timeout bounds its wait), or
    without a timeout a session (its heartbeat finds a rank that dies while the others wait)."""
    if ballot is not None:
        ballot.agree(error, STAGE, version)
        return
    with Session(timeout, group) as session:
        session.agree(error, STAGE)


def _pack_first(replay: Exchange) -> Exception | None:
    """The first round's packing ahead (:meth:`~.exchange.Exchange.pack_first`: no byte sent, no model written);
    its failure, if any."""
    try:
        replay.pack_first()
    except Exception as e:
        return e
    return None


def _report(p: _Planned, counts: Any, run: TransferRun) -> TransferReport:
    return TransferReport(
        bytes_sent=counts.sent, bytes_received=counts.received, bytes_local=counts.local,
        transferred=p.transferred, fallback=p.fallback, messages=counts.messages, rounds=len(p.replay.rounds),
        run=run,
    )  # fmt: skip


def fingerprint_pair(src: torch.nn.Module | None, dst: torch.nn.Module | None) -> tuple:
    """:func:`fingerprint` of both models (a model given as both is compared as both)."""
    return fingerprint(src), fingerprint(dst)


def prepare_transfer(
    src: torch.nn.Module | None,
    dst: torch.nn.Module | None,
    *,
    src_mapping: Mapping_ = None,
    dst_mapping: Mapping_ = None,
    group: dist.ProcessGroup | None = None,
    options: TransferOptions | None = None,
    source_shapes: Any = None,
) -> PreparedTransfer:
    """Plan a transfer of ``src`` into ``dst`` once, to replay with :meth:`PreparedTransfer.run`. Collective: every
    rank of the world calls it. Arguments as for :func:`~loader.transfer.transfer_weights`; nothing is sent.

    Raises:
        ValueError: on every rank, as ``transfer_weights`` before anything is sent.
        PeerFailure: on every rank, a rank failed, died, hung or never called (past ``options.timeout``).
    """
    prepared = PreparedTransfer((src_mapping, dst_mapping, source_shapes), group, options or TransferOptions())
    session = Session(prepared.timeout, group) if prepared.distributed else None
    sharing = Sharing(session)
    with session or contextlib.nullcontext():
        prepared._plan(src, dst, sharing)
        sharing.agree(None, "prepared")  # every rank has read the values shared: they can go
        sharing.close()
    return prepared


def _plan(rank: int, src, dst, mappings, parts, local, sharing: Sharing) -> tuple[TransferPlan, Any]:
    """Describe, map both sides on their first ranks, plan; failures raised on every rank."""
    src_mapping, dst_mapping, source_shapes = mappings
    views = (model_views(src), model_views(dst))
    described = (src is not None, dst is not None, *parts, *(digest(v) if m is not None else None
                 for v, m in zip(views, (src, dst))))  # fmt: skip
    holds = sharing.share("describe", described)
    srcs = [r for r, h in enumerate(holds) if h[0]]
    dsts = [r for r, h in enumerate(holds) if h[1]]
    if not srcs or not dsts:
        raise ValueError(f"no rank holds the {'source' if not srcs else 'destination'} model (src/dst None everywhere)")
    check_views(sharing, [h[4:] for h in holds], views)

    cache = TraceCache()  # one trace per signature for both sides

    def make_source() -> Any:
        return source_side(src, as_rules(src_mapping), source_shapes=source_shapes, cache=cache)

    source = _on_one(srcs[0] == rank, make_source, sharing, "source")
    keyplan, error = None, None
    dest_here = None
    if dst is not None:
        try:
            dest_here, keyplan = dest_side(dst, as_rules(dst_mapping), source.keys, cache)
        except Exception as e:
            error = e
    dest = _on_one(dsts[0] == rank, lambda: _raise_or(dest_here, error), sharing, "dest", error if dst else None)
    with sharing.stage("plan"):
        plan = plan_transfer(source, dest, [h[2] for h in holds], [h[3] for h in holds], rank=rank)
        check_memory(plan, rank, *local)
    return plan, keyplan


def _raise_or(value: Any, error: BaseException | None) -> Any:
    if error is not None:
        raise error
    return value


def _on_one(
    lead: bool, make: Callable[[], Any], sharing: Sharing, name: str, error: BaseException | None = None
) -> Any:
    """``make()`` on the lead rank, shared with every rank; a failure there (or ``error`` here) raised on all."""
    value = None
    if lead:
        try:
            value = make()
        except Exception as e:
            error = e
    return next(v for v in sharing.share(name, value, error) if v is not None)


def _run_fallbacks(plan: TransferPlan, rank: int, keyplan: Any, buffers, dst_parts, dst_local) -> None:
    """Run this rank's fallback conversions on their keys (moved whole) and copy the boxes it holds."""
    for f in plan.fallback:
        if rank not in f.ranks:
            continue
        conv = keyplan.conversions[f.index]
        dtype = dst_parts[conv.targets[0]][1]
        with torch.no_grad():
            out = conv.run(cast_like_transformers(conv.rule, {k: buffers[k] for k in conv.sources}, dtype))
            for t in conv.targets:
                for g, lb in dst_parts[t][2]:
                    box_view(dst_local[t], lb).copy_(box_view(out[t], g))
