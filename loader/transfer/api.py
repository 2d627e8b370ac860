"""``transfer_weights``: move the weights of one (sharded) model into another, shard to shard, without files.

Every rank of the world calls it; each holds a part of the source, of the destination, of both or of neither.
The steps, each agreed by every rank before the next through the process group's store
(:mod:`.agreement`: every wait bounded by ``timeout``, a rank that never arrives named):

1. every rank describes what it holds of each model (names, global shapes, dtypes, boxes, and a digest of its
   tensors' views: the ranks holding one tensor must hold it alike);
2. the first rank holding the source maps it to its checkpoint layout and inverts it (as a save does); the first
   rank holding the destination traces its load from that layout (as a load does): both shared;
3. every rank computes its own part of the :class:`~loader.transfer.TransferPlan` from those values (pure:
   ``plan_transfer(..., rank=r)``, the moves it sends or receives), checks the local memory it reads and writes
   (:mod:`.memory`), and its rounds from its plan and every rank's count of peers (shared, then the number of
   rounds);
4. rounds of ``all_to_all_single`` with exact split sizes move the payload (:mod:`.exchange`), each waiting at
   most ``timeout``; destination conversions that do not trace run on the destination ranks from their keys
   moved whole.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import Session, peer_errors
from ..execute import Rollback
from ..options import BUCKET_BYTES, Rules, TransferOptions, timeout_seconds
from ..plan import TraceCache
from ..plan.slots import box_view
from ..rules.conversion import cast_like_transformers
from .agreement import STAGE, Sharing, check_views, digest, model_views
from .exchange import Counts, Exchange, log_progress
from .memory import check_memory
from .plan import TransferPlan, plan_transfer
from .schedule import degrees, rank_rounds
from .sides import as_rules, dest_side, parts_of, source_side

__all__ = ["BUCKET_BYTES", "TransferReport", "transfer_weights"]

Mapping_ = Rules | Sequence[Any] | None


@dataclass(frozen=True)
class TransferReport:
    """What one rank did in a transfer.

    Attributes:
        bytes_sent: payload bytes this rank sent (tensor data, no padding or headers), to itself included.
        bytes_received: payload bytes this rank received, from itself included.
        bytes_local: the part of both that stayed on this rank (a strided copy, no message).
        transferred: destination tensors this rank received region by region.
        fallback: destination tensors this rank computed from checkpoint keys moved whole (their conversion
            does not trace).
        messages: segments this rank sent to other ranks (one per peer and round).
        rounds: exchange rounds (every rank runs the same number).
        seconds: wall time of the call on this rank.
    """

    bytes_sent: int
    bytes_received: int
    bytes_local: int
    transferred: tuple[str, ...]
    fallback: tuple[str, ...]
    messages: int
    rounds: int
    seconds: float

    def __str__(self) -> str:
        fb = f" ({len(self.fallback)} moved whole)" if self.fallback else ""
        return (
            f"transfer: {len(self.transferred) + len(self.fallback)} tensor(s){fb}, received {self.bytes_received} B, "
            f"sent {self.bytes_sent} B ({self.bytes_local} B local) in {self.messages} message(s), "
            f"{self.rounds} round(s), {self.seconds:.3f} s"
        )


def transfer_weights(
    src: torch.nn.Module | None,
    dst: torch.nn.Module | None,
    *,
    src_mapping: Mapping_ = None,
    dst_mapping: Mapping_ = None,
    group: dist.ProcessGroup | None = None,
    options: TransferOptions | None = None,
    source_shapes: Any = None,
) -> TransferReport:
    """Copy the weights of ``src`` into ``dst`` through their checkpoint layout, each rank receiving exactly its
    shards' elements. Collective: every rank of the world calls it.

    Args:
        src: the source model (plain or DTensor tensors) on ranks holding a part of it, else None.
        dst: the destination model on ranks holding a part of it, else None.
        src_mapping, dst_mapping: each model's rules to and from the checkpoint layout: a
            :class:`~loader.options.Rules`, a list of rules (replacing the default ones, like
            ``weights_mapping=``), or None (transformers' conversion mapping for a ``PreTrainedModel``, none
            otherwise), as for ``save_hf_checkpoint`` and ``load_hf_checkpoint``.
        group: the process group of the exchanges, holding every rank of the world (default: the world; e.g. a
            gloo group for CPU tensors beside a default NCCL one).
        options: how the transfer moves weights (:class:`~loader.options.TransferOptions`: bucket size, timeout,
            rollback, progress); None: the defaults.
        source_shapes: the source's checkpoint keys with their shapes (or ``(shape, dtype)``), or a checkpoint
            (a path or a :class:`~loader.checkpoint.Checkpoint`): needed when ``src_mapping`` has a ``Convert``
            rule, whose keys cannot be derived from the model (as for ``save_hf_checkpoint``).

    Returns:
        This rank's :class:`TransferReport`.

    Raises:
        ValueError: on every rank, before anything is sent: shapes or dtypes that do not match, a key the
            destination needs that the source lacks, a source conversion that is not a bijection, ranks holding
            a tensor differently, a tensor on the meta device, destination tensors overlapping in memory (each
            other, or a source tensor read).
        PeerFailure: on every rank, a rank failed, died, hung or never called (past ``options.timeout``, naming it).
    """
    t0 = time.perf_counter()
    options = options if options is not None else TransferOptions()
    bucket_bytes, rollback, progress = options.bucket_bytes, options.rollback, options.progress
    seconds = timeout_seconds(options.timeout)
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if distributed else 0
    src_parts, src_local = parts_of(src)
    dst_parts, dst_local = parts_of(dst)
    session = Session(seconds, group) if distributed else None
    sharing = Sharing(session)
    with session or contextlib.nullcontext(), Rollback(rollback) as undo:
        mappings = (src_mapping, dst_mapping, source_shapes)
        plan, keyplan = _plan(rank, src, dst, mappings, (src_parts, dst_parts), (src_local, dst_local), sharing)
        schedule = rank_rounds(plan, bucket_bytes, sharing.share("degrees", degrees(plan)))
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
        undo.keep_tensors({t: dst_local[t] for t in written})  # put back if the transfer fails on any rank
        counts = Counts()
        with session.stage(STAGE) if session is not None else contextlib.nullcontext():
            report = log_progress(rank) if progress is True else (progress or None)
            exchange = Exchange(
                plan, rank, src_local, dst_local, buffers, group=group, timeout=seconds, every_round=total > 0
            )
            with peer_errors(STAGE, "exchanging the weights") if distributed else contextlib.nullcontext():
                counts = exchange.run(schedule, report)
            _run_fallbacks(plan, rank, keyplan, buffers, dst_parts, dst_local)
        sharing.close()
    mine = [m for m in plan.moves if m.dst == rank and not m.key]
    return TransferReport(
        bytes_sent=counts.sent,
        bytes_received=counts.received,
        bytes_local=counts.local,
        transferred=tuple(dict.fromkeys(m.target for m in mine)),
        fallback=tuple(t for f in plan.fallback if rank in f.ranks for t in f.targets),
        messages=counts.messages,
        rounds=len(schedule),
        seconds=time.perf_counter() - t0,
    )


def _plan(rank: int, src, dst, mappings, parts, local, sharing: Sharing) -> tuple[TransferPlan, Any]:
    """Steps 1-3: describe, map both sides on their first ranks, plan; failures raised on every rank."""
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
