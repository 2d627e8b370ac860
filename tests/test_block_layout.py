"""The read side of RemapBlocks (regiontrace.remap_block, regiontrace.block_reads) against brute force: runs,
spans, packed and span views, splitting, and union counting, for blocks of random programs and random boxes and
for arbitrary strided blocks (negative, zero and overlapping strides)."""

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import regiontrace as rt
from regiontrace.block_reads import union_numel
from regiontrace.executor import (
    distinct_read_numel,
    overlap_clusters,
    read_layout,
    source_view,
    split_block,
    split_span,
)
from regiontrace.remap_block import source_span
from regiontrace.testing import boxes, programs

F32 = torch.float32
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def flat_read(block: rt.RemapBlock) -> np.ndarray:
    """Brute force: the flat source index each block index reads (block-shaped)."""
    idx = np.full(block.shape, block.src_offset, dtype=np.int64)
    for j, (n, s) in enumerate(zip(block.shape, block.src_strides)):
        at = [1] * len(block.shape)
        at[j] = n
        idx = idx + (np.arange(n, dtype=np.int64) * s).reshape(at)
    return idx


def flat_write(block: rt.RemapBlock) -> np.ndarray:
    """Brute force: the box-local output coordinate each block index writes (block shape + (ndim,))."""
    ndim = len(block.dst_offset)
    out = np.zeros((*block.shape, ndim), dtype=np.int64) + np.asarray(block.dst_offset, dtype=np.int64)
    for j, (n, d, w) in enumerate(zip(block.shape, block.dst_dims, block.dst_steps)):
        at = [1] * (len(block.shape) + 1)
        at[j] = n
        step = np.zeros(ndim, dtype=np.int64)
        step[d] = w
        out = out + (np.arange(n, dtype=np.int64).reshape(at[:-1] + [1]) * step)
    return out


def intervals(elements: set[int]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive integers, as sorted ``(start, length)``."""
    runs: list[tuple[int, int]] = []
    for e in sorted(elements):
        if runs and runs[-1][0] + runs[-1][1] == e:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((e, 1))
    return runs


def check_layout(block: rt.RemapBlock) -> None:
    """Every read-side description of ``block`` against brute force."""
    read = flat_read(block)
    elements = set(read.reshape(-1).tolist())
    layout = block.read_layout()
    assert layout == read_layout(block) and layout.shape == block.shape
    runs = layout.runs
    assert len(runs) == layout.count and layout.count * layout.run == (block.read_numel if block.numel else 0)
    assert {a + i for a in runs for i in range(layout.run)} == elements
    assert block.source_runs() == intervals(elements)
    lo, hi = block.source_span()
    if elements:
        assert (lo, hi) == (min(elements), max(elements) + 1) == (layout.base, layout.end)
    else:
        assert lo == hi
    numel = math.prod(block.source_shape)
    codes = torch.arange(numel, dtype=torch.int64)
    expected = torch.from_numpy(read)
    if elements:
        packed = torch.cat([codes[a : a + layout.run] for a in runs])
        assert torch.equal(layout.packed_view(packed), expected)
        assert torch.equal(layout.span_view(codes[lo:hi].clone()), expected)
        assert torch.equal(layout.span_view(codes, lo), expected)
    assert torch.equal(source_view(block, codes.reshape(block.source_shape)), expected)


def check_split(block: rt.RemapBlock, max_elems: int) -> None:
    """Parts of a split write exactly what the block writes, from the same source elements."""

    def pairs(b: rt.RemapBlock) -> list[tuple]:
        src = flat_read(b).reshape(-1)
        dst = flat_write(b).reshape(src.size, len(b.dst_offset))
        return sorted(zip(src.tolist(), map(tuple, dst.tolist())))

    whole = pairs(block)
    parts = split_block(block, max_elems)
    assert sorted(p for part in parts for p in pairs(part)) == whole
    assert all(p.read_numel <= max_elems for p in parts) or parts == [block]
    spans = split_span(block, max_elems)
    assert sorted(p for part in spans for p in pairs(part)) == whole


@SETTINGS
@given(programs(), st.data())
def test_layout_of_compiled_blocks_is_brute_force(program, data):
    leaves = {n: rt.RegionTensor.leaf(n, s, d) for n, s, d in program.leaves}
    traced = rt.trace(program, **leaves)
    box = data.draw(boxes(tuple(traced.shape)))
    for block in traced.remap_blocks(box):
        check_layout(block)
        check_split(block, data.draw(st.integers(1, max(1, block.read_numel))))


@st.composite
def strided_blocks(draw) -> rt.RemapBlock:
    """Arbitrary strided reads of a 1-D source: negative, zero and overlapping strides, size-0/1 dims."""
    ndim = draw(st.integers(0, 4))
    shape = tuple(
        draw(st.lists(st.integers(0 if draw(st.integers(0, 19)) == 0 else 1, 5), min_size=ndim, max_size=ndim))
    )
    strides = tuple(draw(st.lists(st.integers(-12, 12), min_size=ndim, max_size=ndim)))
    low = sum((n - 1) * s for n, s in zip(shape, strides) if s < 0 and n > 0)
    high = sum((n - 1) * s for n, s in zip(shape, strides) if s > 0 and n > 0)
    offset = -low + draw(st.integers(0, 5))
    size = offset + high + 1 + draw(st.integers(0, 5))
    dst_dims = tuple(range(ndim))
    return rt.RemapBlock("x", shape, offset, strides, (0,) * ndim, dst_dims, (1,) * ndim, (size,), F32)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(strided_blocks(), st.integers(1, 40))
def test_layout_of_arbitrary_strided_blocks_is_brute_force(block, max_elems):
    check_layout(block)
    if block.numel:
        check_split(block, max_elems)


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=12))
def test_union_numel_is_the_size_of_the_union(runs):
    assert union_numel(runs) == len({a + i for a, n in runs for i in range(n)})


@SETTINGS
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 12)), max_size=12))
def test_overlap_clusters_are_connected_components(raw):
    spans = sorted((a, a + n) for a, n in raw)
    ids = overlap_clusters(spans)
    parent = list(range(len(spans)))

    def find(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, (a, b) in enumerate(spans):
        for j, (c, d) in enumerate(spans):
            if i < j and max(a, c) < min(b, d):  # they share an element
                parent[find(i)] = find(j)
    for i in range(len(spans)):
        for j in range(len(spans)):
            # empty spans inside another's interval join it; else the clusters are the components
            if spans[i][0] < spans[i][1] and spans[j][0] < spans[j][1]:
                assert (ids[i] == ids[j]) == (find(i) == find(j)), (spans, ids)
    assert ids == sorted(ids) and (not ids or ids[0] == 0)


@SETTINGS
@given(programs(max_leaves=2), st.data())
def test_distinct_read_numel_counts_each_element_once(program, data):
    """Several boxes' blocks of one source, overlapping or not: each source element counted once."""
    leaves = {n: rt.RegionTensor.leaf(n, s, d) for n, s, d in program.leaves}
    traced = rt.trace(program, **leaves)
    blocks: dict[str, list[rt.RemapBlock]] = {}
    for _ in range(data.draw(st.integers(1, 4))):
        for b in traced.remap_blocks(data.draw(boxes(tuple(traced.shape)))):
            blocks.setdefault(b.source, []).append(b)
    for group in blocks.values():
        brute = set().union(*(set(flat_read(b).reshape(-1).tolist()) for b in group))
        assert distinct_read_numel(group) == len(brute)


@SETTINGS
@given(st.lists(strided_blocks(), min_size=2, max_size=4))
def test_distinct_read_numel_of_overlapping_strided_blocks(blocks):
    """Blocks whose spans overlap are counted by their union; a block alone in its span counts read_numel
    (which counts a block's own overlapping dims twice: compiled blocks have none)."""
    size = max(b.source_shape[0] for b in blocks)
    blocks = [replace(b, source_shape=(size,)) for b in blocks if b.numel]
    reads = [set(flat_read(b).reshape(-1).tolist()) for b in blocks]
    spans = [source_span(b) for b in blocks]
    alone = [
        all(j == i or max(spans[i][0], spans[j][0]) >= min(spans[i][1], spans[j][1]) for j in range(len(blocks)))
        for i in range(len(blocks))
    ]
    expected = len(set().union(*(r for r, a in zip(reads, alone) if not a)))
    expected += sum(b.read_numel for b, a in zip(blocks, alone) if a)
    assert distinct_read_numel(blocks) == expected


def test_read_layout_of_a_column_shard():
    x = rt.RegionTensor.leaf("w", (300, 8), torch.bfloat16)
    (b,) = x[:, 2:5].remap_blocks()
    layout = b.read_layout()
    assert (layout.base, layout.end, layout.run, layout.count) == (2, 299 * 8 + 5, 3, 300)
    assert layout.runs[:3] == (2, 10, 18) and layout.strides == (3, 1) and layout.flips == ()
    assert source_span(b) == b.source_span() == (2, 299 * 8 + 5)
    (f,) = x.flip(0)[:, 2:5].remap_blocks()
    assert f.read_layout().flips == (0,) and f.read_layout().base == 2 and f.source_runs() == b.source_runs()


def test_box_is_exported_once():
    from loader.plan import slots

    assert slots.Box is rt.Box


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4)])
def test_empty_blocks_read_nothing(shape):
    b = rt.RemapBlock(
        "x", shape, 4, (1,) * len(shape), (0,) * len(shape), tuple(range(len(shape))), (1,) * len(shape), (10,), F32
    )
    assert b.read_layout().runs == () and b.read_layout().count == 0
    assert b.source_runs() == [] and b.source_span() == (4, 4)
