"""Runs read straight into place (loader/storage/scatter.py): every run lands at its address exactly, the gaps read
through count as gaps, a short file is a CheckpointError naming it; the executor reads a column shard of long
runs scattered and one of short runs by its span (the cost model), both bit-exact. Real files."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file
from torch import nn

from loader import CheckpointError, SafetensorsCheckpoint, load_hf_checkpoint
from loader.execute import BlockExecutor
from loader.hooks import PlanHooks
from loader.options import LoadOptions
from loader.planner import HFLoadPlanner
from loader.storage import PAGE, FileReader
from loader.storage.scatter import SCATTER, scatter_pays
from regiontrace.executor import RunGrid

pytestmark = pytest.mark.skipif(not SCATTER, reason="no libc preadv here")
FILE_BYTES = 1 << 20


@pytest.fixture(scope="module")
def data_file(tmp_path_factory) -> tuple[str, bytes]:
    path = tmp_path_factory.mktemp("scatter") / "bytes.bin"
    data = np.random.default_rng(0).integers(0, 256, FILE_BYTES, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    return str(path), data


@st.composite
def grids(draw) -> RunGrid:
    """Nested grids inside the file: runs of any length, gaps under a page, between one and two, beyond two."""
    length = draw(st.integers(1, 3 * PAGE))
    extent, dims = length, []
    for _ in range(draw(st.integers(0, 2))):
        n = draw(st.integers(1, 6))
        step = extent + draw(st.sampled_from([0, 1, 100, PAGE - 1, PAGE, PAGE + 7, 2 * PAGE, 3 * PAGE + 5]))
        dims.append((n, step))
        extent += (n - 1) * step
    first = draw(st.integers(0, max(0, FILE_BYTES - extent)))
    grid = RunGrid(first, length, tuple(reversed(dims)))
    return grid if grid.end <= FILE_BYTES else RunGrid(0, 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(grids(), st.data())
def test_every_run_lands_at_its_address(data_file, grid, data):
    path, content = data_file
    starts = grid.starts().tolist()
    pad = data.draw(st.integers(0, 64))  # each run's slot in the destination, with room between
    dest = np.full(len(starts) * (grid.length + pad), 7, dtype=np.uint8)
    order = data.draw(st.permutations(range(len(starts))))  # slots in any order
    targets = np.array([dest.ctypes.data + k * (grid.length + pad) for k in order], dtype=np.uint64)
    with FileReader() as reader:
        reader.read_runs_to(path, grid, targets)
        spans = grid.spans(PAGE)
        assert reader.gap_bytes == sum(b - a for a, b in spans) - grid.count * grid.length
        assert reader.bytes_read == grid.count * grid.length
    for s, k in zip(starts, order):
        at = k * (grid.length + pad)
        assert dest[at : at + grid.length].tobytes() == content[s : s + grid.length]
        assert (dest[at + grid.length : at + grid.length + pad] == 7).all()  # nothing written beside a run


def test_a_short_file_is_an_error_naming_it(data_file):
    path, _ = data_file
    grid = RunGrid(FILE_BYTES - 8000, 2048, ((4, 3000),))  # the last run ends 3048 bytes past the end of the file
    dest = np.zeros(4 * 2048, dtype=np.uint8)
    targets = dest.ctypes.data + np.arange(4, dtype=np.uint64) * 2048
    with FileReader() as reader, pytest.raises(CheckpointError, match=os.path.basename(path)):
        reader.read_runs_to(path, grid, targets)


def test_the_cost_model_reads_long_runs_in_place_and_short_ones_by_span():
    # 256 B of every 1 KiB row: every iovec cuts pages into pieces, the copy out of staging is cheap
    assert not scatter_pays(runs=1024, spans=1, span_bytes=1023 * 1024 + 256, wanted=1024 * 256)
    # 8 KiB of every 32 KiB row: a span per row, an iovec per span, nothing to copy
    assert scatter_pays(runs=1024, spans=1024, span_bytes=1024 * 8192, wanted=1024 * 8192)


class Cols(nn.Module):
    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(rows, cols))


@pytest.mark.parametrize("cols, run", [(8192, 2048), (256, 64)], ids=["long runs", "short runs"])
def test_a_column_shard_loads_exactly_either_way(tmp_path, cols, run):
    """A column shard of ``run`` float32 columns of every row of ``cols``: scattered when runs are long, by span
    when short; the same values either way."""
    full = torch.randn(48, cols)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    model = Cols(48, run)

    class Shard(PlanHooks):
        def target_slot(self, name, tensor):
            from loader.plan import TargetSlot

            box = ((0, 48), (run, 2 * run))
            return TargetSlot(name, (48, cols), tensor.dtype, tensor.data, ((box, ((0, 48), (0, run))),))

    planner = HFLoadPlanner(model, hooks=Shard())
    checkpoint = SafetensorsCheckpoint.open(str(tmp_path))
    plan = planner.build_plan(checkpoint)
    with FileReader() as reader:
        BlockExecutor(checkpoint, plan.slots, reader).run(plan.reads)
        calls = reader.reads
    assert torch.equal(model.w.data, full[:, run : 2 * run])
    runs = RunGrid(0, run * 4, ((48, cols * 4),))
    spans = runs.spans(PAGE)
    scattered = scatter_pays(48, len(spans), sum(b - a for a, b in spans), 48 * run * 4)
    assert scattered == (run == 2048)
    assert calls >= len(spans)
    with torch.no_grad():
        model.w.zero_()
    load_hf_checkpoint(
        model, str(tmp_path), planner=HFLoadPlanner(model, hooks=Shard()), options=LoadOptions(progress=False)
    )
    assert torch.equal(model.w.data, full[:, run : 2 * run])
