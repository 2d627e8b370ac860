"""torch.distributed.checkpoint (DCP) folders as a source: ``load_hf_checkpoint(model, folder)`` of what
``dcp.save`` (``FileSystemWriter``) wrote is bit-identical to ``dcp.load`` into the same target, reading only the
bytes each rank needs; in one process, and on 4 gloo ranks from a ``Shard(0)`` save (keys of 4 chunks) into a model
sharded otherwise. Hostile metadata and chunks are refused naming the file and the key."""

from __future__ import annotations

import os
import pickle
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dcp_worker
from gloo_world import WORLD, ok, run_world
from hf_models import build

from loader import load_hf_checkpoint
from loader.checkpoint import open_checkpoint, read_tensor
from loader.checkpoint.dcp import DcpCheckpoint
from loader.errors import CheckpointError
from loader.options import LoadOptions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
QUIET = LoadOptions(progress=False)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def dcp_save(state: dict, folder) -> None:
    dcp.save({k: v.detach().clone() for k, v in state.items()}, checkpoint_id=str(folder), no_dist=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dcp") / "ckpt"
    auto, model = build("llama", dtype=torch.bfloat16)
    dcp_save(model.state_dict(), folder)
    return auto, model, folder


def test_open_reads_every_chunk_as_saved(saved):
    _, model, folder = saved
    checkpoint = open_checkpoint(folder)
    assert isinstance(checkpoint, DcpCheckpoint)
    assert list(checkpoint) == list(model.state_dict())
    with checkpoint.reader() as reader:
        for key, tensor in model.state_dict().items():
            got = read_tensor(checkpoint[key], reader)
            assert got.dtype == tensor.dtype and torch.equal(bits(got), bits(tensor)), key
    assert open_checkpoint(folder / ".metadata").keys() == checkpoint.keys()


def test_load_is_bit_identical_to_dcp_load(saved):
    auto, model, folder = saved
    _, ours = build("llama", seed=7, dtype=torch.bfloat16)
    _, theirs = build("llama", seed=7, dtype=torch.bfloat16)
    report = load_hf_checkpoint(ours, str(folder), options=QUIET)
    state = theirs.state_dict()
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    for (name, a), b, c in zip(ours.state_dict().items(), state.values(), model.state_dict().values()):
        assert torch.equal(bits(a), bits(b)) and torch.equal(bits(a), bits(c)), name
    distinct = {t.data_ptr(): t.nbytes for t in model.state_dict().values()}  # lm_head tied to the embedding
    assert report.bytes_read == report.planned_bytes == sum(distinct.values())


def test_sharded_save_loads_on_4_ranks_like_dcp_load(tmp_path):
    _, model = build("llama")
    model.config.save_pretrained(tmp_path / "config")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp_path / "ref.pt")
    ctx = {"store": str(tmp_path / "store"), "out": str(tmp_path), "path": str(tmp_path / "ckpt")}
    ctx.update(ref=str(tmp_path / "ref.pt"), config=str(tmp_path / "config"))
    results = run_world(dcp_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    ok(results, "save")
    checkpoint = DcpCheckpoint.open(tmp_path / "ckpt")
    weight = checkpoint["model.layers.0.self_attn.q_proj.weight"]
    assert len(weight.split) == WORLD and len(checkpoint.files) == WORLD
    total = checkpoint.total_bytes
    for r, res in enumerate(ok(results, "load")):
        assert res["bad"] == [] and res["differ"] == [], (r, res)
        assert res["bytes_read"] == res["planned_bytes"] < total, (r, res, total)


# --- hostile ------------------------------------------------------------------------------------------------


def _metadata(folder):
    with open(folder / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own trusted file, edited into a hostile one


def _write_metadata(folder, metadata) -> None:
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(metadata, f)


@pytest.fixture
def small(tmp_path):
    dcp_save({"w": torch.arange(24, dtype=torch.float32).reshape(4, 6), "b": torch.ones(3)}, tmp_path)
    return tmp_path


def test_a_forbidden_global_is_refused(small):
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    _write_metadata(small, Evil())
    with pytest.raises(CheckpointError, match="system") as e:
        DcpCheckpoint.open(small)
    assert e.value.path.endswith(".metadata")


def test_a_chunk_outside_its_file_is_refused(small):
    metadata = _metadata(small)
    for index, info in metadata.storage_data.items():
        if index.fqn == "w":
            info.offset += os.path.getsize(small / info.relative_path)
    _write_metadata(small, metadata)
    with pytest.raises(CheckpointError, match="outside the file") as e:
        DcpCheckpoint.open(small)
    assert e.value.key == "w"


def test_overlapping_chunks_are_refused(small):
    metadata = _metadata(small)
    chunks = metadata.state_dict_metadata["w"].chunks
    chunks.append(chunks[0])
    _write_metadata(small, metadata)
    with pytest.raises(CheckpointError, match="overlap") as e:
        DcpCheckpoint.open(small)
    assert e.value.key == "w"


def test_chunks_not_covering_the_tensor_are_refused(small):
    metadata = _metadata(small)
    metadata.state_dict_metadata["w"].size = torch.Size([8, 6])
    _write_metadata(small, metadata)
    with pytest.raises(CheckpointError, match="cover 24 of the 48") as e:
        DcpCheckpoint.open(small)
    assert e.value.key == "w"


def test_a_chunk_of_another_shape_than_its_blob_is_refused(small):
    """The blob is read when the chunk is first needed (by the load's plan), not when the folder opens; the load
    is refused before a byte is written."""
    metadata = _metadata(small)
    chunk = metadata.state_dict_metadata["w"].chunks[0]
    chunk.sizes = torch.Size([2, 6])
    metadata.state_dict_metadata["w"].size = torch.Size([2, 6])
    _write_metadata(small, metadata)
    checkpoint = DcpCheckpoint.open(small)
    assert checkpoint.opened_pages == {}
    with pytest.raises(CheckpointError, match="metadata says") as e:
        checkpoint["w"]
    assert e.value.key == "w" and e.value.path.endswith(".distcp")
    from loader import Convert
    from loader.options import Rules

    model = torch.nn.Linear(6, 2, bias=False)
    before = model.weight.detach().clone()
    rules = Rules(weights_mapping=[Convert("w", "weight", lambda w: w * 1)])
    with pytest.raises(CheckpointError, match="metadata says") as e:
        load_hf_checkpoint(model, str(small), rules=rules, options=QUIET)
    assert e.value.key == "w" and torch.equal(model.weight.detach(), before)


def test_conversion_rules_apply_to_a_dcp_source(tmp_path):
    from loader import Convert
    from loader.options import Rules

    source = torch.arange(48, dtype=torch.float32).reshape(8, 6)
    dcp_save({"a": source}, tmp_path)
    model = torch.nn.Linear(6, 4, bias=False)
    rules = Rules(weights_mapping=[Convert("a", "weight", lambda a: a[:4] * 2)])
    report = load_hf_checkpoint(model, str(tmp_path), rules=rules, options=QUIET)
    assert torch.equal(model.weight.detach(), source[:4] * 2)
    assert report.bytes_read == report.planned_bytes == 4 * 6 * 4  # the rows the model needs


def test_a_save_holding_non_tensor_items_loads_its_tensors(tmp_path):
    """A training checkpoint's extra state (a step, a dict) is keyed without chunk offsets: its tensors load."""
    w = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    dcp.save({"weight": w, "step": 5, "extra": {"lr": 0.1}}, checkpoint_id=str(tmp_path), no_dist=True)
    assert list(open_checkpoint(str(tmp_path)).keys()) == ["weight"]
    model = torch.nn.Linear(6, 4, bias=False)
    load_hf_checkpoint(model, str(tmp_path), options=LoadOptions(progress=False))
    assert torch.equal(model.weight.data, w)
