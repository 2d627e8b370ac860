"""Executing a transfer plan on one rank: pack the strided regions each peer needs, exchange them round by round
with ``all_to_all_single`` (exact split sizes), unpack with strided copies into the local shards.

The rounds are compiled once (:func:`compile_rounds`) into copies of fixed views of the local tensors, valid
while those tensors' memory stays where it was (checked by :mod:`loader.transfer.prepared` before each run); an
:class:`Exchange` then only copies and exchanges, on every run.

Vocabulary (as in :mod:`loader.transfer.plan`, plus):

- **segment**: the moves of one round between one source rank and one destination rank, packed one after the
  other, each at an offset aligned to :data:`ALIGN` bytes (both ends compute the same offsets from the plan).
- **payload**: the elements of the moves, in the source dtype; padding is not payload.
- **staging**: a cell that is not contiguous in the local shard is copied into a contiguous buffer at the start
  of each round that reads it, the round's cells one after the other in one staging pool.
- **pack** / **unpack**: a move's source view copied into its place in the round's send buffer; its payload in
  the receive buffer copied (and cast) into its destination view. One send and one receive pool, the size of
  the largest round, serve every round.

Only a round's buffers are ever held (at most ``bucket_bytes`` sent and received per rank, plus padding); no
tensor is materialised whole except the checkpoint keys of a fallback conversion.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from regiontrace.executor import copy_cast, dest_view, source_view

from ..distributed.collectives import all_to_all_tensor, pick_device
from ..plan.slots import box_view
from .plan import Move, TransferPlan

log = logging.getLogger("loader")

#: segment offsets are multiples of this many bytes (a dtype view of the byte buffer needs its alignment)
ALIGN = 16


@dataclass
class Counts:
    """What this rank moved: payload bytes sent and received (itself included), the part of them that stayed on
    this rank, and the segments it sent to other ranks."""

    sent: int = 0
    received: int = 0
    local: int = 0
    messages: int = 0


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def segment_layout(moves: Sequence[Move]) -> tuple[list[int], int]:
    """Each move's byte offset in its segment, and the segment's size (padded)."""
    offsets, at = [], 0
    for m in moves:
        offsets.append(at)
        at = _aligned(at + m.nbytes)
    return offsets, at


#: (destination view, source view, casts): one strided copy
Copy = tuple[torch.Tensor, torch.Tensor, tuple[torch.dtype, ...]]


@dataclass
class Round:
    """One round's work on this rank: ``staging`` (contiguous buffer, cell view) copied first, then ``packs`` and
    ``copies`` (within the rank), the collective (``sizes``: receive and send split sizes; None: no collective),
    then ``unpacks``."""

    staging: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    copies: list[Copy] = field(default_factory=list)
    packs: list[Copy] = field(default_factory=list)
    unpacks: list[Copy] = field(default_factory=list)
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # (receive, send)
    sizes: tuple[list[int], list[int]] | None = None


class Exchange:
    """This rank's end of a transfer: its compiled rounds (:func:`compile_rounds`); :meth:`run` runs them.

    Attributes:
        rounds: the compiled rounds, every rank the same number.
        counts: what one run moves (the same every run).
        buffer_bytes: bytes of the pools it holds (staging, send, receive).
        device: where its buffers live (:func:`~loader.distributed.pick_device` of the group and tensors).
    """

    def __init__(
        self, rounds: list[Round], counts: Counts, buffer_bytes: int, group, timeout: float | None,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.rounds, self.counts, self.buffer_bytes = rounds, counts, buffer_bytes
        self.group, self.timeout, self.device = group, timeout, device
        self._packed: Round | None = None  # the round packed ahead (:meth:`pack_first`), until it runs

    @property
    def copies(self) -> int:
        """Strided copies one run makes (staging, within the rank, packing, unpacking)."""
        return sum(len(r.staging) + len(r.copies) + len(r.packs) + len(r.unpacks) for r in self.rounds)

    def pack_first(self) -> None:
        """The first round's staging and packing ahead of :meth:`run` (which then skips them): they read the source
        and write this rank's own buffers only, so they may run before the ranks know that every model is the one
        planned (nothing is sent or written to a model)."""
        if self.rounds:
            with torch.no_grad():
                self._pack(self.rounds[0])
            self._packed = self.rounds[0]

    def run(self, progress: Callable[[int, int], None] | None = None) -> Counts:
        """Every round in order (each rank runs the same number: the collectives match): copies and collectives
        only."""
        n = len(self.rounds)
        try:
            with torch.no_grad():
                for i, r in enumerate(self.rounds):
                    self._round(r)
                    if progress is not None:
                        progress(i + 1, n)
        finally:
            self._packed = None
        return self.counts

    def _pack(self, r: Round) -> None:
        for buffer, cell in r.staging:
            buffer.copy_(cell)
        for dst, src, _ in r.packs:
            dst.copy_(src)

    def _round(self, r: Round) -> None:
        if r is not self._packed:
            self._pack(r)
        self._packed = None
        for dst, src, casts in r.copies:
            copy_cast(dst, src, casts)
        if r.sizes is not None:
            recv, send = r.buffers
            all_to_all_tensor(recv, send, *r.sizes, group=self.group, timeout=self.timeout)
        for dst, src, casts in r.unpacks:
            copy_cast(dst, src, casts)


def compile_rounds(
    plan: TransferPlan,
    rank: int,
    schedule: Sequence[list[Move]],
    tensors: tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]],
    *,
    group: dist.ProcessGroup | None = None,
    timeout: float | None = None,
    every_round: bool = False,
) -> Exchange:
    """This rank's rounds of ``plan`` (``schedule``: :func:`~loader.transfer.schedule.rank_rounds`; ``every_round``:
    run the collective in every round, even one without a message here) compiled on ``tensors``: the local source
    tensors, destination tensors and fallback key buffers, by name."""
    sources, targets, keys = tensors
    device = pick_device(group, [*sources.values(), *targets.values()])
    layouts = [_layout(plan, rank, moves, sources, every_round) for moves in schedule]
    sizes = [max((x[i] for x in layouts), default=0) for i in (0, 1, 2)]
    staging, send, recv = (torch.empty(n, dtype=torch.uint8, device=device) for n in sizes)
    counts = Counts()
    rounds = []
    for moves, (_, _, _, cells, out, into) in zip(schedule, layouts):
        r = Round()
        staged = _stage(plan, rank, cells, sources, staging, r)
        read = functools.partial(_read, plan, rank, sources, staged)
        for m in moves:
            if m.src == m.dst == rank:
                r.copies.append((_write(m, targets, keys), read(m), m.block.casts))
                counts.sent += m.nbytes
                counts.received += m.nbytes
                counts.local += m.nbytes
        if out is not None:
            send_layouts, recv_layouts = [segment_layout(ms) for ms in out], [segment_layout(ms) for ms in into]
            at = 0
            for ms, (offsets, size) in zip(out, send_layouts):
                for m, off in zip(ms, offsets):
                    r.packs.append((_payload(send, at + off, m), read(m), ()))
                    counts.sent += m.nbytes
                at += size
                counts.messages += bool(ms)
            r.buffers = (recv[: sum(n for _, n in recv_layouts)], send[:at])
            at = 0
            for ms, (offsets, size) in zip(into, recv_layouts):
                for m, off in zip(ms, offsets):
                    r.unpacks.append((_write(m, targets, keys), _payload(recv, at + off, m), m.block.casts))
                    counts.received += m.nbytes
                at += size
            r.sizes = ([n for _, n in recv_layouts], [n for _, n in send_layouts])
        rounds.append(r)
    return Exchange(rounds, counts, sum(sizes), group, timeout, device)


def _layout(plan: TransferPlan, rank: int, moves: list[Move], sources, every_round: bool):
    """A round's pool sizes (staging, send, receive), the cells it stages, and its moves per peer (None: no
    collective: no move between ranks, the same on every rank, and not ``every_round``)."""
    world = plan.world
    out: list[list[Move]] = [[] for _ in range(world)]
    into: list[list[Move]] = [[] for _ in range(world)]
    cells: dict[str, None] = {}
    remote = False
    for m in moves:
        if m.src == rank:
            cells[m.block.source] = None
        if m.src != m.dst:
            remote = True
            if m.src == rank:
                out[m.dst].append(m)
            elif m.dst == rank:
                into[m.src].append(m)
    staged = [c for c in cells if not _cell_view(plan, rank, c, sources).is_contiguous()]
    stage_bytes = sum(_aligned(_cell_view(plan, rank, c, sources).nbytes) for c in staged)
    if not remote and not every_round:
        return stage_bytes, 0, 0, staged, None, None
    send = sum(segment_layout(ms)[1] for ms in out)
    recv = sum(segment_layout(ms)[1] for ms in into)
    return stage_bytes, send, recv, staged, out, into


def _cell_view(plan: TransferPlan, rank: int, name: str, sources) -> torch.Tensor:
    cell = plan.cells[name]
    return box_view(sources[cell.tensor], dict(cell.owners)[rank])


def _stage(plan: TransferPlan, rank: int, staged: list[str], sources, pool: torch.Tensor, r: Round) -> dict:
    """The staging buffer of each cell in ``staged`` (views of ``pool``), its copy added to ``r``."""
    views = {}
    at = 0
    for name in staged:
        cell = _cell_view(plan, rank, name, sources)
        buffer = pool[at : at + cell.nbytes].view(cell.dtype).view(cell.shape)
        r.staging.append((buffer, cell))
        views[name] = buffer
        at += _aligned(cell.nbytes)
    return views


def _read(plan: TransferPlan, rank: int, sources, staged: Mapping[str, torch.Tensor], m: Move) -> torch.Tensor:
    """The view ``m`` reads: of its cell's staging buffer, or of its box of the local shard."""
    view = staged.get(m.block.source)
    return source_view(m.block, view if view is not None else _cell_view(plan, rank, m.block.source, sources))


def _payload(buffer: torch.Tensor, offset: int, m: Move) -> torch.Tensor:
    b = m.block
    return buffer[offset : offset + m.nbytes].view(b.source_dtype).view(b.shape)


def _write(m: Move, targets, keys) -> torch.Tensor:
    return dest_view(m.block, box_view((keys if m.key else targets)[m.target], m.local))


def log_progress(rank: int) -> Callable[[int, int], None]:
    """A ``progress`` callback logging each round on ``loader``'s logger."""

    def report(done: int, total: int) -> None:
        log.info("rank %d: transfer round %d/%d done", rank, done, total)

    return report
