"""Executing a transfer plan on one rank: pack the strided regions each peer needs, exchange them round by round
with ``all_to_all_single`` (exact split sizes), unpack with strided copies into the local shards.

Vocabulary (as in :mod:`loader.transfer.plan`, plus):

- **segment**: the moves of one round between one source rank and one destination rank, packed one after the
  other, each at an offset aligned to :data:`ALIGN` bytes (both ends compute the same offsets from the plan).
- **payload**: the elements of the moves, in the source dtype; padding is not payload.

Only a round's buffers are ever held (at most ``bucket_bytes`` sent and received per rank, plus padding); no
tensor is materialised whole except the checkpoint keys of a fallback conversion.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

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


class Exchange:
    """This rank's end of a transfer.

    Args:
        plan: the transfer plan (the same on every rank).
        rank: this rank (in the plan's numbering: the group's).
        sources: this rank's local tensors of the source model, by name.
        targets: this rank's local tensors of the destination model, by name.
        keys: the buffers of the checkpoint keys its fallbacks receive whole, by key.
        group: the process group (None: the default one).
        timeout: seconds each round may take (None: no limit).
        every_round: run the collective in every round, even one without a message here (rounds from each
            rank's own plan, :func:`~loader.transfer.schedule.rank_rounds`: only their number is agreed); else
            a round that moves nothing between ranks (the same on every rank, from the whole world's plan) has
            none.
    """

    def __init__(
        self,
        plan: TransferPlan,
        rank: int,
        sources: Mapping[str, torch.Tensor],
        targets: Mapping[str, torch.Tensor],
        keys: Mapping[str, torch.Tensor],
        *,
        group: dist.ProcessGroup | None = None,
        timeout: float | None = None,
        every_round: bool = False,
    ) -> None:
        self.plan, self.rank, self.sources, self.targets, self.keys = plan, rank, sources, targets, keys
        self.group, self.timeout, self.every_round = group, timeout, every_round
        self.counts = Counts()
        self._cells: dict[str, torch.Tensor] = {}  # this round's contiguous copies of non-contiguous cells

    def run(self, rounds: Sequence[list[Move]], progress: Callable[[int, int], None] | None = None) -> Counts:
        """Run every round in order (each rank runs the same rounds: the collectives match)."""
        for i, moves in enumerate(rounds):
            self._round(moves)
            self._cells.clear()
            if progress is not None:
                progress(i + 1, len(rounds))
        return self.counts

    # -- one round ----------------------------------------------------------------------------------

    def _round(self, moves: list[Move]) -> None:
        me, world = self.rank, self.plan.world
        out: list[list[Move]] = [[] for _ in range(world)]
        into: list[list[Move]] = [[] for _ in range(world)]
        remote = False
        for m in moves:
            if m.src == m.dst == me:
                self._copy(m)
            elif m.src != m.dst:
                remote = True
                if m.src == me:
                    out[m.dst].append(m)
                elif m.dst == me:
                    into[m.src].append(m)
        if not remote and not self.every_round:  # every rank knows: no collective this round
            return
        send_layouts = [segment_layout(ms) for ms in out]
        recv_layouts = [segment_layout(ms) for ms in into]
        device = self._device()
        send = torch.empty(sum(n for _, n in send_layouts), dtype=torch.uint8, device=device)
        recv = torch.empty(sum(n for _, n in recv_layouts), dtype=torch.uint8, device=device)
        at = 0
        for ms, (offsets, size) in zip(out, send_layouts):
            for m, off in zip(ms, offsets):
                self._pack(m, send, at + off)
            at += size
            self.counts.messages += bool(ms)
        all_to_all_tensor(
            recv,
            send,
            [n for _, n in recv_layouts],
            [n for _, n in send_layouts],
            group=self.group,
            timeout=self.timeout,
        )
        at = 0
        for ms, (offsets, size) in zip(into, recv_layouts):
            for m, off in zip(ms, offsets):
                self._unpack(m, recv, at + off)
            at += size

    def _device(self) -> torch.device:
        """Where the round's buffers live: the local tensors' GPU under NCCL (untested here), else the CPU."""
        return pick_device(self.group, [*self.sources.values(), *self.targets.values()])

    # -- strided copies -----------------------------------------------------------------------------

    def _read(self, m: Move) -> torch.Tensor:
        """The strided view of this rank's local source memory that ``m`` reads.

        A cell that is not contiguous in the local shard (a box of a ``_StridedShard`` along an inner dim) is
        copied once per round, not once per move."""
        name = m.block.source
        view = self._cells.get(name)
        if view is None:
            cell = self.plan.cells[name]
            view = box_view(self.sources[cell.tensor], dict(cell.owners)[self.rank])
            if not view.is_contiguous():
                view = self._cells[name] = view.contiguous()
        return source_view(m.block, view)

    def _write(self, m: Move) -> torch.Tensor:
        return dest_view(m.block, box_view((self.keys if m.key else self.targets)[m.target], m.local))

    def _copy(self, m: Move) -> None:
        copy_cast(self._write(m), self._read(m), m.block.casts)
        self.counts.sent += m.nbytes
        self.counts.received += m.nbytes
        self.counts.local += m.nbytes

    def _pack(self, m: Move, buffer: torch.Tensor, offset: int) -> None:
        b = m.block
        buffer[offset : offset + m.nbytes].view(b.source_dtype).view(b.shape).copy_(self._read(m))
        self.counts.sent += m.nbytes

    def _unpack(self, m: Move, buffer: torch.Tensor, offset: int) -> None:
        b = m.block
        payload = buffer[offset : offset + m.nbytes].view(b.source_dtype).view(b.shape)
        copy_cast(self._write(m), payload, b.casts)
        self.counts.received += m.nbytes


def log_progress(rank: int) -> Callable[[int, int], None]:
    """A ``progress`` callback logging each round on ``loader``'s logger."""

    def report(done: int, total: int) -> None:
        log.info("rank %d: transfer round %d/%d done", rank, done, total)

    return report
