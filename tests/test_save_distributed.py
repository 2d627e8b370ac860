"""``save_hf_checkpoint`` on a real 4-rank gloo world (one world for every case here; tests/save_worker.py).

Every rank saves its DTensor shards (Shard(0/1/2), uneven, _StridedShard, Replicate, a fused rope'd qkv, fused
MoE experts): the files equal the original checkpoint byte for byte, each rank writes exactly the bytes of the
shards it is the lowest holder of (together: every checkpoint byte once), and a failure or death on one rank
fails every rank and leaves no checkpoint behind.
"""

from __future__ import annotations

import os
import socket
import sys

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(__file__))

import dist_models as dm
import save_worker
from gloo_world import ok, run_world
from hf_models import build

from loader import load_hf_checkpoint, save_hf_checkpoint
from loader.options import LoadOptions, Rules, SaveOptions

MOE_SHARD_SIZE = "20KB"
pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("save_dist")
    tensors = dm.write_checkpoint(str(root / "full.safetensors"))
    del tensors["scaled_src"]
    os.makedirs(root / "layout")
    save_file(tensors, root / "layout" / "model.safetensors", metadata={"format": "pt"})
    _, moe = build("qwen3_moe", dtype=torch.bfloat16, num_key_value_heads=4, vocab_size=70, tie_word_embeddings=False)
    moe.save_pretrained(root / "moe", max_shard_size=MOE_SHARD_SIZE)
    out = root / "out"
    out.mkdir()
    with socket.socket() as sock:  # a free port for the world's TCP store
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = {
        "port": port, "out": str(out), "layout": str(root / "layout" / "model.safetensors"),
        "moe": str(root / "moe"), "moe_shard_size": MOE_SHARD_SIZE,
    }  # fmt: skip
    return root, run_world(save_worker.__file__, root, ctx["out"], ctx)


def folder_bytes(path) -> dict[str, bytes]:
    return {n: open(os.path.join(path, n), "rb").read() for n in sorted(os.listdir(path))}


def _each_rank_writes_its_shards_once(per_rank: list[dict]) -> None:
    expected = per_rank[0]["expected"]
    for r, res in enumerate(per_rank):
        assert res["all"] == [p["bytes_written"] for p in per_rank]
        assert res["bytes_written"] == expected[r], (r, res["bytes_written"], expected)  # its shard bytes, 1.00x
    assert sum(expected) == per_rank[0]["total_size"]  # together: every checkpoint byte, once
    assert all(res["header_bytes"] == 0 for res in per_rank[1:]) and per_rank[0]["header_bytes"] > 0


def test_layout_shards_write_the_original_file(world):
    root, results = world
    per_rank = ok(results, "layout_1d")
    _each_rank_writes_its_shards_once(per_rank)
    out = per_rank[0]["out"]
    assert os.listdir(out) == ["model.safetensors"]  # a plain module: no config
    assert folder_bytes(out)["model.safetensors"] == (root / "layout" / "model.safetensors").read_bytes()


def test_sharded_files_from_a_2d_mesh_equal_a_one_process_save(world, tmp_path):
    root, results = world
    per_rank = ok(results, "layout_2d")
    _each_rank_writes_its_shards_once(per_rank)
    assert len(per_rank[0]["files"]) > 2
    model = save_worker.NoScaled()
    load_hf_checkpoint(
        model,
        str(root / "layout"),
        rules=Rules(weights_mapping=save_worker.layout_rules()),
        options=LoadOptions(progress=False),
    )
    one = tmp_path / "one"
    save_hf_checkpoint(
        model,
        one,
        source_shapes=str(root / "layout"),
        rules=Rules(weights_mapping=save_worker.layout_rules()),
        options=SaveOptions(max_shard_size="1KB", progress=False),
    )
    assert folder_bytes(per_rank[0]["out"]) == folder_bytes(one)


@pytest.mark.parametrize("name", ["moe_1d", "moe_2d", "moe_submesh"])
def test_moe_shards_write_save_pretrained_files(world, name):
    """TP attention, EP x TP experts (Shard + _StridedShard gate_up), vocab-sharded embedding, replicated norms:
    the shards, the index and the config equal what save_pretrained wrote."""
    root, results = world
    per_rank = ok(results, name)
    _each_rank_writes_its_shards_once(per_rank)
    ours, original = folder_bytes(per_rank[0]["out"]), folder_bytes(root / "moe")
    assert list(ours) == list(original) and len(per_rank[0]["files"]) > 1
    for file in original:
        assert ours[file] == original[file], file
    if name == "moe_submesh":  # ranks 2 and 3 replicate ranks 0 and 1 (the dp dim): they write nothing
        assert [res["bytes_written"] for res in per_rank][2:] == [0, 0]


def test_a_write_failure_on_one_rank_fails_every_rank(world):
    _, results = world
    for r, res in enumerate(ok(results, "fail_writing")):
        assert res["type"] == "OSError", (r, res)  # rank 2's own type (EFBIG), on every rank
        assert "Writing the checkpoint failed on rank 2: OSError" in res["message"], res["message"]
        assert res["left"] == [], f"rank {r} sees {res['left']}"  # no folder, no temporary folder


def test_a_planning_failure_on_one_rank_removes_the_files_rank_0_created(world):
    _, results = world
    for r, res in enumerate(ok(results, "fail_preparing")):
        assert res["type"] == "RuntimeError", (r, res)
        assert "Preparing the save failed on rank 2" in res["message"] and "only breaks on rank 2" in res["message"]
        assert res["left"] == [], f"rank {r} sees {res['left']}"


@pytest.mark.parametrize(
    ("how", "name", "first", "other"),
    [
        ("placement", "o_proj.weight", "a DTensor of shape (16, 16) float32, placements (Shard(dim=1),) on a mesh of "
         "shape (4,)", "a DTensor of shape (16, 16) float32, placements (Shard(dim=0),) on a mesh of shape (4,)"),
        ("plain", "uneven", "a DTensor of shape (10, 16) float32, placements (Shard(dim=0),) on a mesh of shape (4,)",
         "a plain tensor of shape (10, 16) float32"),
        ("dtype", "down", "a DTensor of shape (4, 16, 8) float32, placements (Shard(dim=2),) on a mesh of shape (4,)",
         "a DTensor of shape (4, 16, 8) float64, placements (Shard(dim=2),) on a mesh of shape (4,)"),
    ],
)  # fmt: skip
def test_ranks_holding_a_tensor_differently_refuse_before_writing(world, how, name, first, other):
    """Rank 1 holds one tensor differently from ranks 0, 2, 3 (the layout alone is the same): each would write
    its own idea of it, leaving elements nobody writes. Every rank raises, naming the tensor and both views, and
    nothing is left (rank 0's temporary folder removed; no rank wrote a byte of tensor data)."""
    _, results = world
    expected = (
        f"Writing the checkpoint failed on rank 1: ValueError: the ranks hold model tensor {name!r} differently: "
        f"rank 0 holds {first}, rank 1 holds {other}; every rank must save the same model sharded the same way "
        "(nothing was written)"
    )
    for r, res in enumerate(ok(results, f"disagree_{how}")):
        assert (res["type"], res["message"]) == ("ValueError", expected), (r, res)
        assert res["left"] == [], f"rank {r} sees {res['left']}"


def test_a_killed_rank_fails_every_rank_and_leaves_no_checkpoint(world):
    root, results = world
    assert "killed" not in results[2]
    for r in (0, 1, 3):
        res = results[r]["killed"]
        assert res["ok"], res.get("error")
        assert res["type"] == "PeerFailure", (r, res)
        assert (res["stage"], res["ranks"], res["reason"]) == ("preparing", (2,), "died"), (r, res)
    assert results[0]["killed"]["left"] == []  # rank 0 removed the files it had created
    assert not [n for n in os.listdir(root / "out") if n.startswith("killed")]
