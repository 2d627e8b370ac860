"""The rounds of a transfer: its moves grouped so that, in each round, every rank sends and receives a bounded
payload (``bucket_bytes``) to and from other ranks.

Pure: every rank computes the same rounds from the same :class:`~loader.transfer.plan.TransferPlan`, so the
collectives of each round match.
"""

from __future__ import annotations

import regiontrace as rt

from .plan import Move, TransferPlan


def split_move(move: Move, max_numel: int) -> list[Move]:
    """``move`` cut (:func:`regiontrace.split_block`, outermost source dim first) into moves reading at most
    ``max_numel`` elements each (at least one)."""
    parts = rt.split_block(move.block, max_numel)
    return [Move(move.src, move.dst, move.target, move.local, b, move.key) for b in parts]


def rounds(plan: TransferPlan, bucket_bytes: int) -> list[list[Move]]:
    """The moves in rounds: in each, every rank sends at most ``bucket_bytes`` and receives at most
    ``bucket_bytes`` of payload to and from other ranks (moves within one rank are copies, in round 0).

    Larger moves are split first. Pure: every rank computes the same rounds.
    """
    out: list[list[Move]] = [[]]
    sent: list[dict[int, int]] = [{}]
    received: list[dict[int, int]] = [{}]
    last: dict[tuple[int, int], int] = {}
    for whole in plan.moves:
        if whole.src == whole.dst:
            out[0].append(whole)
            continue
        for m in split_move(whole, max(1, bucket_bytes // whole.block.source_dtype.itemsize)):
            r = last.get((m.src, m.dst), 0)
            while r < len(out) and (
                sent[r].get(m.src, 0) + m.nbytes > bucket_bytes or received[r].get(m.dst, 0) + m.nbytes > bucket_bytes
            ) and (sent[r].get(m.src, 0) or received[r].get(m.dst, 0)):  # fmt: skip
                r += 1
            if r == len(out):
                out.append([])
                sent.append({})
                received.append({})
            out[r].append(m)
            sent[r][m.src] = sent[r].get(m.src, 0) + m.nbytes
            received[r][m.dst] = received[r].get(m.dst, 0) + m.nbytes
            last[m.src, m.dst] = r
    return out
