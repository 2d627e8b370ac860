"""RunGrid (regiontrace.run_grid): a block's runs, span, merged runs and page spans in closed form, equal to the
list-based computation they replace (kept here as the reference) on random blocks: arbitrary strided ones
(negative, zero, overlapping strides), box reads of larger tensors with steps and permuted dims, any itemsize,
file offset and page size."""

import math

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_block_layout import strided_blocks

import regiontrace as rt
from regiontrace.executor import RunGrid, contiguous_strides, read_layout

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---------------------------------------------------------------------------------------------------
# the reference: what the read path computed from the listed runs before


def listed_page_spans(starts: np.ndarray, length: int, page: int) -> list[tuple[int, int]]:
    """loader/execute/pages.py's page_spans before issue 19: sort the run starts, cut where a page lies between."""
    starts = np.sort(starts)
    ends = starts + length
    cut = np.flatnonzero(starts[1:] // page - (ends[:-1] - 1) // page > 1) + 1
    firsts = np.concatenate(([0], cut))
    lasts = np.concatenate((cut - 1, [len(starts) - 1]))
    return list(zip(starts[firsts].tolist(), ends[lasts].tolist()))


def listed_merged_runs(runs: tuple[int, ...], run: int) -> list[tuple[int, int]]:
    """ReadLayout.merged_runs before issue 19: sorted runs, merged while they touch or overlap."""
    merged: list[tuple[int, int]] = []
    for b in sorted(runs):
        if merged and merged[-1][0] + merged[-1][1] >= b:
            a, length = merged[-1]
            merged[-1] = (a, max(length, b + run - a))
        else:
            merged.append((b, run))
    return merged


def check_grid(block: rt.RemapBlock, itemsize: int, offset: int, page: int) -> None:
    layout = read_layout(block)
    runs = layout.runs  # the list, enumerated in packed order
    grid = layout.grid(itemsize, offset)
    starts = offset + np.asarray(runs, dtype=np.int64) * itemsize
    assert grid.count == layout.count == len(runs)
    assert grid.starts().tolist() == sorted(starts.tolist())
    assert layout.merged_runs() == listed_merged_runs(runs, layout.run)
    if not runs:
        assert grid.spans(page) == grid.touching() == [] and grid.end == grid.first
        return
    length = layout.run * itemsize
    assert (grid.first, grid.end) == (int(starts.min()), int(starts.max()) + length)
    assert (grid.first, grid.end) == (offset + layout.base * itemsize, offset + layout.end * itemsize)
    assert grid.spans(page) == listed_page_spans(starts, length, page)
    touching = [(a, a + n) for a, n in listed_merged_runs(tuple(starts.tolist()), length)]
    assert grid.touching() == touching


# ---------------------------------------------------------------------------------------------------
# random blocks


@st.composite
def box_blocks(draw) -> rt.RemapBlock:
    """A box of a C-contiguous tensor, read with steps and its dims in any order (a shard, a strided shard)."""
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 40), min_size=ndim, max_size=ndim)))
    strides = contiguous_strides(shape)
    offset, dims, steps, sizes = 0, [], [], []
    for d in range(ndim):
        step = draw(st.sampled_from([1, 1, 1, 2, 3]))
        a = draw(st.integers(0, shape[d] - 1))
        n = draw(st.integers(1, (shape[d] - a + step - 1) // step))
        offset += a * strides[d]
        sizes.append(n)
        steps.append(step * strides[d])
        dims.append(d)
    order = draw(st.permutations(range(ndim)))
    block_shape = tuple(sizes[d] for d in order)
    src_strides = tuple(steps[d] for d in order)
    flip = draw(st.integers(-1, ndim - 1))
    if flip >= 0:  # walk one dim backwards
        offset += (block_shape[flip] - 1) * src_strides[flip]
        src_strides = tuple(-s if j == flip else s for j, s in enumerate(src_strides))
    ident = tuple(range(ndim))
    return rt.RemapBlock("x", block_shape, offset, src_strides, (0,) * ndim, ident, (1,) * ndim, shape, torch.float32)


@SETTINGS
@given(strided_blocks(), st.sampled_from([1, 2, 4]), st.integers(0, 50), st.integers(1, 64))
def test_grid_of_arbitrary_strided_blocks_equals_the_run_list(block, itemsize, offset, page):
    check_grid(block, itemsize, offset, page)


@SETTINGS
@given(box_blocks(), st.sampled_from([1, 2, 4, 8]), st.integers(0, 5000), st.sampled_from([4, 16, 64, 256, 4096]))
def test_grid_of_box_reads_equals_the_run_list(block, itemsize, offset, page):
    check_grid(block, itemsize, offset, page)


@SETTINGS
@given(
    st.integers(0, 9000),
    st.integers(1, 3000),
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 6000)), max_size=3),
    st.sampled_from([64, 512, 4096]),
)
def test_nested_grids_with_page_multiple_steps(first, length, dims, page):
    """Steps that are multiples of the page put every gap of a dim at one offset in its page: one decision."""
    extent, nested = length, []
    for n, s in reversed(dims):  # a nested grid with page-multiple steps
        step = math.ceil((extent + s) / page) * page
        nested.append((n, step))
        extent += (n - 1) * step
    grid = RunGrid(first, length, tuple(reversed(nested)))
    assert grid.gaps is not None
    assert grid.spans(page) == listed_page_spans(grid.starts(), length, page)


# ---------------------------------------------------------------------------------------------------
# the column shards of the benchmarks, in closed form


def test_column_shard_is_one_span_when_its_gaps_hold_no_page():
    # down_proj Shard(2) of a [1024, 512] bf16 expert at TP4: 256 B of every 1 KiB row, 1024 rows
    x = rt.RegionTensor.leaf("w", (1024, 512), torch.bfloat16)
    layout = read_layout(x[:, 128:256].remap_blocks()[0])
    grid = layout.grid(2, 1000)
    assert (grid.count, grid.length, grid.gaps) == (1024, 256, (768,))
    assert grid.spans(4096) == [(grid.first, grid.end)] == [(1000 + 256, 1000 + 1023 * 1024 + 512)]


def test_column_shard_is_a_span_per_row_when_each_gap_holds_a_page():
    # o_proj Shard(1) of a [7168, 16384] bf16 tensor at TP4: 8 KiB of every 32 KiB row
    x = rt.RegionTensor.leaf("w", (7168, 16384), torch.bfloat16)
    grid = read_layout(x[:, 4096:8192].remap_blocks()[0]).grid(2, 0)
    spans = grid.spans(4096)
    assert len(spans) == 7168 and spans[:2] == [(8192, 16384), (32768 + 8192, 32768 + 16384)]


def test_rows_of_a_page_multiple_with_gaps_between_one_and_two_pages():
    # 2 KiB of every 8 KiB row, the file offset 1 KiB into a page: every gap (6 KiB) holds one whole page
    grid = RunGrid(1024, 2048, ((5, 8192),))
    assert grid.spans(4096) == [(1024 + i * 8192, 1024 + i * 8192 + 2048) for i in range(5)]
    # 3 KiB into a page: each run ends 1 KiB into the next page and the gap ends in the page after: no page between
    grid = RunGrid(3072, 2048, ((5, 8192),))
    assert grid.spans(4096) == [(3072, 3072 + 4 * 8192 + 2048)]
