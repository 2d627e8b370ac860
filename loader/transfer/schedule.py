"""The rounds of a transfer: its moves grouped so that, in each round, every rank sends and receives a bounded
payload (``bucket_bytes``) to and from other ranks.

Pure: from the whole world's plan every rank computes the same rounds (:func:`rounds`); from its own plan
(``plan_transfer(..., rank=r)``) each rank computes its part of them (:func:`rank_rounds`), the two ends of each
pair the same chunks, so that the collectives of each round match.
"""

from __future__ import annotations

from collections.abc import Sequence

from regiontrace.executor import split_block

from .plan import Move, TransferPlan


def split_move(move: Move, max_numel: int) -> list[Move]:
    """``move`` cut (:func:`regiontrace.executor.split_block`, outermost source dim first) into moves reading at most
    ``max_numel`` elements each (at least one)."""
    parts = split_block(move.block, max_numel)
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


def degrees(plan: TransferPlan) -> tuple[int, int]:
    """The other ranks one rank's plan (``plan.rank``) sends to and receives from: ``(out, in)`` counts."""
    me = plan.rank
    return len({m.dst for m in plan.moves if m.src == me != m.dst}), len(
        {m.src for m in plan.moves if m.dst == me != m.src}
    )


def rank_rounds(plan: TransferPlan, bucket_bytes: int, every: Sequence[tuple[int, int]]) -> list[list[Move]]:
    """One rank's rounds, from its own plan (``plan.rank``) and every rank's :func:`degrees` (``every``, index =
    rank): its moves with each peer, in an order both ends share, cut into chunks of at most ``bucket_bytes //
    max(the sender's out-degree, the receiver's in-degree)`` payload bytes, chunk ``k`` in round ``k``; so that,
    in each round, every rank sends and receives at most ``bucket_bytes`` (moves within the rank are copies, in
    round 0). Both ends of a pair compute the same chunks; the ranks agree on the number of rounds afterwards
    (the longest; the others' last rounds are empty here).
    """
    me = plan.rank
    out: list[list[Move]] = [[m for m in plan.moves if m.src == m.dst == me]]
    pairs: dict[tuple[int, int], list[Move]] = {}
    for m in plan.moves:
        if m.src != m.dst:
            pairs.setdefault((m.src, m.dst), []).append(m)
    for (s, d), moves in sorted(pairs.items()):
        budget = max(1, bucket_bytes // max(every[s][0], every[d][1]))
        k, filled = 0, 0
        for whole in sorted(moves, key=_order):
            for m in split_move(whole, max(1, budget // whole.block.source_dtype.itemsize)):
                if filled and filled + m.nbytes > budget:
                    k, filled = k + 1, 0
                out += [[] for _ in range(k + 1 - len(out))]
                out[k].append(m)
                filled += m.nbytes
    return out


def _order(m: Move) -> tuple:
    b = m.block
    return (
        m.target,
        m.key,
        m.local,
        b.source,
        b.src_offset,
        b.dst_offset,
        b.shape,
        b.src_strides,
        b.dst_dims,
        b.dst_steps,
    )
