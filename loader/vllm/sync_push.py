"""One push over the sync's wire, both ends: what a trainer rank sends and what a worker receives and assembles.

Vocabulary (as in :mod:`loader.vllm.sync_pieces` and :mod:`loader.vllm.sync_wire`, plus):

- **header**: a push's first collective, a ``MAX`` all-reduce of ``[refused, full, version]`` over the whole
  group: a trainer rank that refuses (a tensor of another shape, naming it in the store) stops every member
  before anything is sent; the push is full when any member asks for it (the first push after prepare, a
  ``push(delta=False)``, a worker without the base).
- **stats**: a push's last collective, a ``SUM`` all-reduce of the trainer ranks' wire bytes and changed bytes
  per worker: every member reports the totals.

Order of a push: header, packets (a full packet's bytes; a delta packet: its segments' sizes, then their
:meth:`~loader.transfer.delta.Delta.to_bytes`), the worker's rebuild, agreement, stats.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..transfer.delta import Written
from .sync_pieces import Piece, apply_segments, assemble, encode_segments, gather, place, segments, touched
from .sync_plan import Want
from .sync_wire import Wire

__all__ = ["Outgoing", "Received", "header", "prepare_outgoing", "receive_wants", "send_packets", "stats"]


@dataclass
class Outgoing:
    """A trainer rank's packets of one push, per worker: the new segments, what goes on the wire, the bytes."""

    segments: list[list[torch.Tensor]]
    full: list[torch.Tensor]
    delta: list[tuple[torch.Tensor, torch.Tensor] | None]
    changed: list[int]


def header(wire: Wire, refused: bool, full: bool, version: int) -> tuple[bool, bool, int]:
    """The push's header (see the module): (refused, full, version) as the whole group agreed."""
    r, f, v = wire.allreduce([int(refused), int(full), version], dist.ReduceOp.MAX, "starting a push")
    return bool(r), bool(f), v


def stats(wire: Wire, sent: Sequence[int], changed: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per worker, the bytes on the wire and the changed bytes, summed over the trainer ranks."""
    n = len(sent)
    total = wire.allreduce([*sent, *changed], dist.ReduceOp.SUM, "reporting a push")
    return tuple(total[:n]), tuple(total[n:])


def prepare_outgoing(
    local: Mapping[str, torch.Tensor],
    mine: Sequence[Sequence[Piece]],
    wants: Sequence[Sequence[Want]],
    base: Sequence[list[torch.Tensor] | None],
    delta: bool,
) -> Outgoing:
    """This rank's packets for every worker, packed (and encoded against ``base`` when ``delta``) before any send;
    a delta push packs and encodes the workers' packets in threads (the encoding's numpy passes release the GIL).

    A full packet is one byte buffer its segments are views of (each piece cast into it once, no second copy);
    its changed bytes are all its bytes (a full push compares nothing)."""

    def one(w: int) -> tuple[torch.Tensor, list[torch.Tensor], tuple | None, int]:
        with torch.no_grad():
            packet, new = gather(local, mine[w], wants[w])
            if not delta or base[w] is None:
                return packet, new, None, packet.numel()
            deltas, changed = encode_segments(base[w], new)
            sizes = [d.to_bytes() for d in deltas]
            lengths = torch.tensor([s.numel() for s in sizes], dtype=torch.int64)
            return packet, new, (lengths, torch.cat(sizes) if sizes else torch.empty(0, dtype=torch.uint8)), changed

    threads = min(len(mine), os.cpu_count() or 1) if delta else 1
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            packets = list(pool.map(one, range(len(mine))))
    else:
        packets = [one(w) for w in range(len(mine))]
    out = Outgoing([], [], [], [])
    for packet, new, encoded, changed in packets:
        out.segments.append(new)
        out.full.append(packet)
        out.delta.append(encoded)
        out.changed.append(changed)
    return out


def send_packets(wire: Wire, trainers: int, out: Outgoing, full: bool) -> list[int]:
    """Send every worker its packet (full, or the deltas prepared); the bytes put on the wire per worker."""
    sends, sent = [], []
    for w, packet in enumerate(out.full):
        if not packet.numel():
            sent.append(0)
            continue
        if full or out.delta[w] is None:
            sends.append((packet, trainers + w))
            sent.append(packet.numel())
        else:
            lengths, payload = out.delta[w]
            sends += [(lengths, trainers + w), (payload, trainers + w)]
            sent.append(lengths.numel() * 8 + payload.numel())
    wire.exchange(sends, [])
    return sent


class Received(Sequence[torch.Tensor]):
    """A worker's wants as last received (one tensor per want, in order: a delta's base), with what a delta push
    applies in place: every trainer rank's segments as last received (a want that is one piece is a view of its
    segment, :func:`~loader.vllm.sync_pieces.place`; any other a copy assembled from the segments)."""

    def __init__(self, segs: list[list[torch.Tensor]], pieces: list[list[Piece]], wants: Sequence[Want]) -> None:
        self.segments, self.pieces, self.wants = segs, pieces, wants
        self.tensors, self.views = place(segs, pieces, wants)
        #: the wants the last push changed (None: every want, a full push)
        self.changed: set[int] | None = None
        self._written: list[list[Written]] = []

    def __getitem__(self, i):
        return self.tensors[i]

    def __len__(self) -> int:
        return len(self.tensors)

    def apply(self, payloads: Sequence[torch.Tensor], lengths: Sequence[torch.Tensor]) -> None:
        """Every trainer rank's deltas applied in place (:meth:`undo` puts the wants back).

        Raises:
            ValueError: a packet does not hold its segments' deltas (the wants are as they were).
        """
        self._written, self.changed = [], set()
        try:
            for rank, group in enumerate(self.pieces):
                segs = self.segments[rank]
                self._written.append(apply_segments(segs, payloads[rank], lengths[rank].tolist()) if group else [])
        except Exception:
            self.undo()  # the ranks applied before (the failing one undid its own)
            raise
        self.changed = set()
        for written, group in zip(self._written, self.pieces):
            self.changed |= touched(written, group, self.wants)
        self._assemble(self.changed)

    def undo(self) -> None:
        """Put back the wants the last :meth:`apply` changed (a push that was not kept)."""
        for segs, written in zip(self.segments, self._written):
            for seg, w in zip(segs, written):
                w.undo(seg)
        self._written = []
        self._assemble(self.changed if self.changed is not None else set(range(len(self.wants))))

    def _assemble(self, wants: set[int]) -> None:
        rest = {i for i in wants if not self.views[i]}
        for rank, group in enumerate(self.pieces):
            if group and rest:
                assemble(self.tensors, group, self.wants, self.segments[rank], only=rest)


def receive_wants(
    wire: Wire,
    trainers: int,
    pieces: Sequence[Piece],
    wants: Sequence[Want],
    old: Received | None,
    full: bool,
) -> tuple[Received, int]:
    """A worker's new wants, from every trainer rank's packet: full (new buffers), or deltas applied in place to
    ``old`` (its wants last received; :meth:`Received.undo` puts them back); and the bytes received."""
    by_sender = [[p for p in pieces if p.sender == t] for t in range(trainers)]
    layouts = [segments(group, wants) for group in by_sender]
    if full:
        sizes = [sum(sum(p.numel for p in g) * d.itemsize for d, g in layout) for layout in layouts]
        payloads = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        wire.exchange([], [(p, t) for t, p in enumerate(payloads)])
        segs = [_split(payload, layout) for layout, payload in zip(layouts, payloads)]
        return Received(segs, by_sender, wants), sum(sizes)
    if old is None:
        raise ValueError("a delta push to a worker without the wants last received")
    lengths = [torch.zeros(len(layout), dtype=torch.int64) for layout in layouts]
    wire.exchange([], [(n, t) for t, n in enumerate(lengths)])
    payloads = [torch.empty(int(n.sum()), dtype=torch.uint8) for n in lengths]
    wire.exchange([], [(p, t) for t, p in enumerate(payloads)])
    old.apply(payloads, lengths)
    received = sum(n.numel() * 8 + p.numel() for n, p in zip(lengths, payloads) if n.numel())
    return old, received


def _split(payload: torch.Tensor, layout: Sequence[tuple[torch.dtype, list[Piece]]]) -> list[torch.Tensor]:
    """A full packet's bytes as its segments (each viewed as its dtype; copied where its offset is unaligned)."""
    out, at = [], 0
    for dtype, group in layout:
        n = sum(p.numel for p in group) * dtype.itemsize
        chunk = payload[at : at + n]
        out.append((chunk if at % dtype.itemsize == 0 else chunk.clone()).view(dtype))
        at += n
    if at != payload.numel():
        raise ValueError(f"a sync packet of {payload.numel()} bytes, where its pieces take {at}")
    return out


def want_bytes(wants: Sequence[Want]) -> int:
    return sum(math.prod(w.lengths) * w.dtype.itemsize for w in wants)
