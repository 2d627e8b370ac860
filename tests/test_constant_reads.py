"""Constant reads: a traced conversion whose output holds constant elements (a vocabulary padded by ``F.pad``) is
planned as region reads for the checkpoint's elements and constant fills for the padding. The fills read no byte:
``planned_bytes`` and ``bytes_read`` count the real rows only, a rank whose shard is all padding reads nothing, and
every rank's tensor equals the conversion run on the real tensors, bit for bit. A save of the padded model refuses,
naming the op.

The sharded loads run on torch's fake process group (a subprocess playing each rank of a world of 4 in turn).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file
from torch import nn

from loader import (
    Convert,
    HFLoadPlanner,
    SafetensorsCheckpoint,
    SafetensorsReader,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from loader.hooks import PlanHooks
from loader.options import LoadOptions, Rules

VOCAB, PADDED, DIM, WORLD = 10, 16, 8, 4
QUIET = LoadOptions(progress=False)
TESTS = os.path.dirname(os.path.abspath(__file__))


def pad_vocab(w):
    return F.pad(w, (0, 0, 0, PADDED - w.shape[0]), value=-1.7)  # -1.7 rounds in the checkpoint's dtype


class Embedding(nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(PADDED, DIM, dtype=dtype))


class NoTracing(PlanHooks):
    def supports_symbolic(self, conversion):
        return False


RULES = Rules(weights_mapping=[Convert(r"^embed$", "weight", pad_vocab)])


@pytest.fixture
def checkpoint(tmp_path) -> torch.Tensor:
    embed = torch.randn(VOCAB, DIM, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    save_file({"embed": embed}, str(tmp_path / "model.safetensors"))
    return embed


def fallbacks(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "does not trace" in r.getMessage()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_padded_vocabulary_reads_its_real_rows_and_fills_the_rest(tmp_path, checkpoint, caplog, dtype):
    with caplog.at_level(logging.WARNING, logger="loader"):
        report = load_hf_checkpoint(model := Embedding(dtype), tmp_path, rules=RULES, options=QUIET)
    assert report.traced == ("weight",) and report.deferred == () and fallbacks(caplog) == []
    assert report.bytes_read == report.planned_bytes == VOCAB * DIM * 2  # bf16 rows; the padding is not read
    real = pad_vocab(checkpoint).to(dtype)  # the conversion run on the real tensor, cast as the copy casts
    assert torch.equal(model.weight, real)
    deferred = Embedding(dtype)
    planner = HFLoadPlanner(deferred, hooks=NoTracing(), rules=RULES)
    assert load_hf_checkpoint(deferred, tmp_path, planner=planner, options=QUIET).deferred == ("weight",)
    assert torch.equal(model.weight.view(torch.uint8), deferred.weight.view(torch.uint8))


def test_the_plan_holds_the_padding_as_fills_not_reads(tmp_path, checkpoint):
    plan = HFLoadPlanner(Embedding(), rules=RULES).build_plan(SafetensorsCheckpoint.open(str(tmp_path)))
    assert [r.block.source for r in plan.reads] == ["embed"]
    assert [(r.block.source, r.block.dst_offset, r.block.shape) for r in plan.fills] == [
        ("<constant -1.703125: bfloat16>", (VOCAB, 0), (PADDED - VOCAB, DIM))
    ]
    assert plan.planned_bytes() == VOCAB * DIM * 2


@pytest.mark.parametrize("storage", ["ours", "torchs"])
def test_inside_dcp_load_the_padding_is_filled_with_any_storage_reader(tmp_path, checkpoint, storage):
    """``SafetensorsReader`` fills with its reads; torch's box reader reads the real rows, the planner fills."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = SafetensorsReader(str(tmp_path)) if storage == "ours" else HuggingFaceStorageReader(str(tmp_path))
    planner = HFLoadPlanner(model := Embedding(), rules=RULES)
    model.weight.data.fill_(3.0)
    dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner, no_dist=True)
    report = planner.finish(reader)
    assert report.traced == ("weight",) and report.bytes_read == VOCAB * DIM * 2
    assert torch.equal(model.weight, pad_vocab(checkpoint).float())


def test_a_failed_read_rolls_the_filled_padding_back(tmp_path, checkpoint):
    """The fills run first; a file truncated after planning fails the reads, and rollback restores every row."""
    from loader import CheckpointError
    from loader.execute import execute_plan

    model = Embedding()
    model.weight.data.fill_(3.0)
    plan = HFLoadPlanner(model, rules=RULES).build_plan(SafetensorsCheckpoint.open(str(tmp_path)))
    with open(tmp_path / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 8)
    with plan.checkpoint.reader() as reader, pytest.raises(CheckpointError, match="model.safetensors"):
        execute_plan(plan, reader, LoadOptions(rollback=True, progress=False))
    assert torch.equal(model.weight, torch.full((PADDED, DIM), 3.0))


def test_saving_a_padded_model_refuses_naming_the_op(tmp_path, checkpoint):
    load_hf_checkpoint(model := Embedding(), tmp_path, rules=RULES, options=QUIET)
    with pytest.raises(ValueError, match="constant_pad_nd writes constant elements"):
        save_hf_checkpoint(model, str(tmp_path / "saved"), rules=RULES, source_shapes=str(tmp_path))
    assert not (tmp_path / "saved").exists()


# ------------------------------------------------------------------------------------------------- DTensor shards


def play_rank(rank: int, root: str) -> None:
    """Init a fake world of ``WORLD`` as ``rank``; load the padded vocabulary sharded by rows and by columns; write
    per dim whether the local shard equals DTensor's chunk of the real run and the bytes read and planned."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from loader.placements import shard_module

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    real = pad_vocab(load_file(f"{root}/model.safetensors")["embed"]).float()
    result = {}
    for dim in (0, 1):
        model = shard_module(Embedding(), mesh, {"weight": [Shard(dim)]})
        report = load_hf_checkpoint(model, root, rules=RULES, options=QUIET)
        want = distribute_tensor(real, mesh, [Shard(dim)], src_data_rank=None).to_local()
        same = torch.equal(model.weight.to_local().view(torch.uint8), want.view(torch.uint8))
        result[dim] = {"same": same, "read": report.bytes_read, "planned": report.planned_bytes}
    Path(root, f"rank{rank}.json").write_text(json.dumps(result))


def test_each_shard_of_a_padded_vocabulary_reads_only_its_real_rows(tmp_path, checkpoint):
    """Each rank played in a subprocess (a process inits one process group: DTensor keeps its first mesh)."""
    script = f"import sys; sys.path.insert(0, {TESTS!r}); from test_constant_reads import play_rank; "
    for rank in range(WORLD):
        code = script + f"play_rank({rank}, {str(tmp_path)!r})"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        rows = max(0, min(VOCAB, (rank + 1) * PADDED // WORLD) - rank * PADDED // WORLD)
        by_rows, by_cols = result["0"], result["1"]
        assert by_rows["same"] and by_cols["same"], (rank, result)
        assert by_rows["read"] == by_rows["planned"] == rows * DIM * 2, (rank, result)  # bf16 checkpoint rows
        assert by_cols["read"] == by_cols["planned"] == VOCAB * DIM // WORLD * 2, (rank, result)
    assert rows == 0  # the last rank's rows (12..16) are all padding: it read nothing


# ------------------------------------------------------------------------------------------------- property


@st.composite
def paddings(draw) -> tuple[tuple[int, ...], tuple[int, ...], float]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    pads = []
    for n in reversed(shape[-draw(st.integers(1, len(shape))) :]):  # F.pad: the last dim first
        pads += [draw(st.integers(-(n // 2), 3)), draw(st.integers(-(n // 2), 3))]
    return shape, tuple(pads), draw(st.sampled_from([0.0, 1.0, -2.5]))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=paddings())
def test_any_padding_loads_as_f_pad_runs_reading_the_kept_elements_once(tmp_path_factory, case):
    shape, pads, value = case
    folder = tmp_path_factory.mktemp("pad")
    x = (torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32) + 0.5).reshape(shape)  # no element 0
    save_file({"x": x}, str(folder / "model.safetensors"))
    real = F.pad(x, pads, value=value)
    model = nn.Module()
    model.register_parameter("y", nn.Parameter(torch.full(real.shape, 7.0)))
    rules = Rules(weights_mapping=[Convert(r"^x$", "y", lambda t: F.pad(t, pads, value=value))])
    report = load_hf_checkpoint(model, folder, rules=rules, options=QUIET)
    assert torch.equal(model.y, real) and report.traced == ("y",)
    kept = F.pad(x, pads, value=0.0).count_nonzero().item()  # the checkpoint elements the output holds
    assert report.bytes_read == report.planned_bytes == kept * 4
