"""Reading many blocks, and reading through a bounded buffer: the distinct source elements blocks read together,
which of their spans overlap, and splitting a block so each part's read fits a buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from .remap_block import RemapBlock, source_span

__all__ = ["distinct_read_numel", "overlap_clusters", "split_block", "split_span", "union_numel"]


# ---------------------------------------------------------------------------------------------------
# counting over many blocks


def union_numel(runs: Iterable[tuple[int, int]]) -> int:
    """Number of elements in the union of ``(start, length)`` runs (any order, overlapping or not)."""
    total, lo, hi = 0, 0, None
    for a, n in sorted(runs):
        if hi is None or a > hi:
            total += 0 if hi is None else hi - lo
            lo, hi = a, a + n
        else:
            hi = max(hi, a + n)
    return total + (0 if hi is None else hi - lo)


def overlap_clusters(spans: Iterable[tuple[int, int]]) -> list[int]:
    """Cluster index of each half-open span, for spans sorted by start.

    Spans that overlap, directly or through others, share a cluster; spans that only touch do not.
    """
    ids: list[int] = []
    cluster, end = -1, None
    for lo, hi in spans:
        if end is None or lo >= end:
            cluster, end = cluster + 1, hi
        else:
            end = max(end, hi)
        ids.append(cluster)
    return ids


def distinct_read_numel(blocks: Sequence[RemapBlock]) -> int:
    """Number of distinct source elements that ``blocks``, all of one source, read together.

    A block whose span overlaps no other block's counts :attr:`RemapBlock.read_numel`; only the runs of blocks
    whose spans overlap are enumerated, and their union counted once.
    """
    if len(blocks) == 1:
        return blocks[0].read_numel
    order = sorted(range(len(blocks)), key=lambda i: (source_span(blocks[i]), i))
    clusters: list[list[RemapBlock]] = []
    for i, c in zip(order, overlap_clusters(source_span(blocks[i]) for i in order)):
        if c == len(clusters):
            clusters.append([])
        clusters[c].append(blocks[i])
    return sum(c[0].read_numel if len(c) == 1 else union_numel(r for b in c for r in b.source_runs()) for c in clusters)


# ---------------------------------------------------------------------------------------------------
# splitting to fit a bounded buffer


def split_block(block: RemapBlock, max_elems: int) -> list[RemapBlock]:
    """Split ``block`` along its outermost source dim so each part reads at most ``max_elems`` elements."""
    if block.read_numel <= max_elems:
        return [block]
    dims = sorted((j for j in range(len(block.shape)) if block.shape[j] > 1), key=lambda j: -abs(block.src_strides[j]))
    j = dims[0]
    inner = block.numel // block.shape[j]
    step = max(1, max_elems // max(inner, 1))
    parts = []
    for a in range(0, block.shape[j], step):
        n = min(step, block.shape[j] - a)
        shape = block.shape[:j] + (n,) + block.shape[j + 1 :]
        dst = list(block.dst_offset)
        dst[block.dst_dims[j]] += a * block.dst_steps[j]
        offset = block.src_offset + a * block.src_strides[j]
        part = replace(block, shape=shape, src_offset=offset, dst_offset=tuple(dst))
        parts.extend(split_block(part, max_elems) if n == 1 and len(dims) > 1 else [part])
    return parts


def split_span(block: RemapBlock, max_elems: int) -> list[RemapBlock]:
    """:func:`split_block`, then split again each part whose source span exceeds ``max_elems`` (where it can)."""
    parts = []
    for part in split_block(block, max_elems):
        lo, hi = source_span(part)
        if hi - lo <= max_elems or part.read_numel <= 1:
            parts.append(part)
            continue
        sub = split_block(part, max(1, part.read_numel * max_elems // (hi - lo)))
        parts.extend([part] if len(sub) == 1 else [p for q in sub for p in split_span(q, max_elems)])
    return parts
