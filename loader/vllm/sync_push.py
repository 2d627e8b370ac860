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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .sync_pieces import Piece, apply_segments, assemble, encode_segments, gather, segments
from .sync_plan import Want
from .sync_wire import Wire

__all__ = ["Outgoing", "header", "prepare_outgoing", "receive_wants", "send_packets", "stats"]


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
    """This rank's packets for every worker, packed (and encoded against ``base`` when ``delta``) before any send.

    A full packet is one byte buffer its segments are views of (each piece cast into it once, no second copy);
    its changed bytes are all its bytes (a full push compares nothing)."""
    out = Outgoing([], [], [], [])
    with torch.no_grad():
        for w, pieces in enumerate(mine):
            packet, new = gather(local, pieces, wants[w])
            out.segments.append(new)
            out.full.append(packet)
            if delta and base[w] is not None:
                deltas, changed = encode_segments(base[w], new)
                sizes = [d.to_bytes() for d in deltas]
                lengths = torch.tensor([s.numel() for s in sizes], dtype=torch.int64)
                out.delta.append((lengths, torch.cat(sizes) if sizes else torch.empty(0, dtype=torch.uint8)))
            else:
                out.delta.append(None)
                changed = packet.numel()
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


def receive_wants(
    wire: Wire,
    trainers: int,
    pieces: Sequence[Piece],
    wants: Sequence[Want],
    old: list[torch.Tensor] | None,
    full: bool,
) -> tuple[list[torch.Tensor], int]:
    """A worker's new wants (one tensor per want), from every trainer rank's packet: full, or deltas applied to
    ``old`` (its wants last received, left as they are); and the bytes received."""
    by_sender = [[p for p in pieces if p.sender == t] for t in range(trainers)]
    layouts = [segments(group, wants) for group in by_sender]
    if full:
        sizes = [sum(sum(p.numel for p in g) * d.itemsize for d, g in layout) for layout in layouts]
        payloads = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        wire.exchange([], [(p, t) for t, p in enumerate(payloads)])
        new = [torch.empty(w.lengths, dtype=w.dtype) for w in wants]
        for t, (layout, payload) in enumerate(zip(layouts, payloads)):
            assemble(new, by_sender[t], wants, _split(payload, layout))
        return new, sum(sizes)
    lengths = [torch.zeros(len(layout), dtype=torch.int64) for layout in layouts]
    wire.exchange([], [(n, t) for t, n in enumerate(lengths)])
    payloads = [torch.empty(int(n.sum()), dtype=torch.uint8) for n in lengths]
    wire.exchange([], [(p, t) for t, p in enumerate(payloads)])
    new = [t.clone() for t in old]
    for t, group in enumerate(by_sender):
        if group:
            base = assemble(old, group, wants)
            assemble(new, group, wants, apply_segments(base, payloads[t], lengths[t].tolist()))
    received = sum(n.numel() * 8 + p.numel() for n, p in zip(lengths, payloads) if n.numel())
    return new, received


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
