"""Distributed loading on a real 4-rank gloo world (started once, shared by every test here).

The world runs as one subprocess per rank under a wall-clock limit, so a rank can be killed (the last
scenario kills rank 2) and a regression that hangs fails the tests instead of blocking the suite.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import dist_models as dm
import dist_worker
from fake_hub import add_snapshot
from gloo_world import WORLD, ok, run_world

from loader.cli.model_configs import TINY_QWEN3_MOE, hf_config, seeded_model

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    ctx = {"store": str(root / "store"), "out": str(root)}
    ctx["layout_path"] = str(root / "layout.safetensors")
    torch.save(dm.expected_state(dm.write_checkpoint(ctx["layout_path"])), root / "layout_ref.pt")
    ctx["layout_ref"] = str(root / "layout_ref.pt")
    ctx["bad_layout_path"] = _truncated_copy(ctx["layout_path"], str(root / "bad"))
    with open(ctx["layout_path"], "rb") as f:  # the same checkpoint as a Hub repo id in a fake cache
        add_snapshot(root / "hub", "org/layout", "c" * 40, {"model.safetensors": f.read()}, refs=("main",))
    ctx["hub_cache"] = str(root / "hub")
    model = seeded_model(hf_config("qwen3_moe", TINY_QWEN3_MOE, vocab_size=70), seed=0)
    ctx["moe_path"] = str(root / "moe")
    model.save_pretrained(ctx["moe_path"])
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, root / "moe_ref.pt")
    ctx["moe_ref"] = str(root / "moe_ref.pt")
    return run_world(dist_worker.__file__, root, str(root), ctx)


@pytest.mark.parametrize("name", ["layout_1d", "layout_2d", "layout_dcp_2d", "layout_repo_id"])
def test_layout_shards_equal_single_process_load(results, name):
    per_rank = ok(results, name)
    for r, res in enumerate(per_rank):
        assert res["bad"] == [], f"rank {r}: {res['bad']}"
        assert res["deferred"] == ("scaled",)
        # gate_up and gate_up_strided read the same source regions: read once, so <= the shard bytes
        assert res["bytes_read"] == res["planned_bytes"], (r, res)
        assert res["bytes_read"] - res["deferred_bytes"] <= 1.02 * res["traced_bytes"], (r, res)


@pytest.mark.parametrize("name", ["moe_1d", "moe_2d", "moe_dcp_1d"])
def test_moe_model_shards(results, name):
    per_rank = ok(results, name)
    for r, res in enumerate(per_rank):
        assert res["bad"] == [], f"rank {r}: {res['bad']}"
        assert res["deferred"] == ()
        assert res["placements"] > 0
        assert res["bytes_read"] <= 1.02 * res["shard_bytes"], (r, res)
        assert res["bytes_read"] >= res["shard_bytes"], (r, res)


def test_planning_failure_on_one_rank_fails_every_rank(results):
    per_rank = ok(results, "fail_on_rank2")
    for r, res in enumerate(per_rank):
        assert "Planning the load failed on rank 2" in res["outcome"], (r, res["outcome"])
        assert "only breaks on rank 2" in res["outcome"]
        assert res["unchanged"], f"rank {r} modified its model"


@pytest.mark.parametrize("name", ["broadcast", "broadcast_dcp"])
def test_broadcast_replicated_reads_checkpoint_once(results, name):
    per_rank = ok(results, name)
    for res in per_rank:
        assert res["bad"] == []
    data_bytes = _checkpoint_data_bytes()
    assert per_rank[0]["total"] == data_bytes
    assert sum(res["bytes_read"] for res in per_rank) == data_bytes


def _checkpoint_data_bytes() -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        tensors = dm.write_checkpoint(os.path.join(d, "x.safetensors"))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_simulation_matches_real_plans(results):
    per_rank = ok(results, "simulation_2d")
    for res in per_rank:
        assert res["ranks"] == WORLD
        assert res["sim_blocks"] == res["blocks"]
        assert res["sim_bytes"] == res["bytes_read"]


def _truncated_copy(path: str, folder: str) -> str:
    os.makedirs(folder)
    bad = os.path.join(folder, os.path.basename(path))
    shutil.copy(path, bad)
    os.truncate(bad, os.path.getsize(bad) - 100)  # the last tensors' data runs past the end
    return bad


def test_read_failure_with_rollback_restores_every_rank(results):
    per_rank = ok(results, "read_fail_rollback")
    for r, res in enumerate(per_rank):
        assert res["type"] == "RuntimeError", (r, res)
        assert "Reading the checkpoint failed on rank 2" in res["message"], (r, res["message"])
        assert "reads break on rank 2" in res["message"]
        assert res["wrote"] == [True], f"rank {r} had written nothing when the read failed: {res}"
        assert res["unchanged"], f"rank {r} was not restored"


def test_checkpoint_error_carries_failing_ranks_path_and_key(results):
    from loader import CheckpointError, SafetensorsCheckpoint

    per_rank = ok(results, "checkpoint_error_carried")
    bad = per_rank[2]["path"]
    with pytest.raises(CheckpointError) as single:  # what one process says about that file
        SafetensorsCheckpoint.open(bad)
    assert single.value.path == bad and single.value.key is not None
    for r, res in enumerate(per_rank):
        assert res["type"] == "CheckpointError", (r, res)
        assert "Planning the load failed on rank 2" in res["message"], (r, res["message"])
        assert (res["path"], res["key"]) == (single.value.path, single.value.key), (r, res)
        assert res["unchanged"]


@pytest.mark.parametrize(
    "name, kind, stage",
    [
        ("KeyError", "KeyError", "planning"),
        ("ValueError", "ValueError", "planning"),
        ("CheckpointError", "CheckpointError", "planning"),
        ("ForeignFailure", "RemoteError", "planning"),
        ("reading", "KeyError", "reading"),
    ],
)
def test_a_failure_on_one_rank_keeps_its_type_rank_and_traceback_everywhere(results, name, kind, stage):
    words = {"planning": "Planning the load", "reading": "Reading the checkpoint"}[stage]
    for r, res in enumerate(ok(results, "remote_errors")):
        got = res["errors"][name]
        assert (got["type"], got["rank"], got["stage"]) == (kind, 2, stage), (r, got)
        assert f"{words} failed on rank 2: " in got["message"], (r, got["message"])
        assert "in _raise_on_rank_2" in got["remote_traceback"], (r, got["remote_traceback"])  # rank 2's frames
        if sys.version_info >= (3, 11):  # PEP 678 notes
            assert got["notes"] == [f"--- the traceback on rank 2 ({stage}) ---\n{got['remote_traceback'].rstrip()}"]
        if name == "CheckpointError":
            assert (got["path"], got["key"]) == ("/ckpt/x.safetensors", "norm"), (r, got)
        if name == "ForeignFailure":  # not ours, not a builtin: named, never imported
            assert got["remote_type"] == "__main__.ForeignFailure", (r, got)
            assert "__main__.ForeignFailure: not one of ours" in got["message"], (r, got["message"])


# ---------------------------------------------------------------------------------------------------
# faults: a rank that hangs, a rank that is killed


def test_hung_rank_in_planning_is_named_on_every_rank(results):
    per_rank = ok(results, "hung_planning")
    for r, res in enumerate(per_rank):
        assert res["type"] == "PeerFailure", (r, res)
        assert (res["stage"], res["ranks"], res["reason"]) == ("planning", (2,), "timeout"), (r, res)
        if r == 2:  # it resumed after the others gave up: it raises too instead of waiting for them
            assert "this rank (2) finished planning after the other ranks had stopped waiting" in res["message"]
        else:
            assert "rank(s) 2 did not finish planning within the 2.5 s timeout" in res["message"], res["message"]
        assert res["unchanged"], f"rank {r} modified its model"


def test_hung_rank_inside_dcp_load_is_named(results):
    per_rank = ok(results, "hung_reading_dcp")
    for r, res in enumerate(per_rank):
        # dcp.load gathers every rank's failure into one CheckpointException, raised on every rank
        assert res["type"] == "CheckpointException", (r, res)
        assert "PeerFailure" in res["message"] and "rank(s) 2 did not finish reading" in res["message"], res


def test_killed_rank_is_reported_dead_and_survivors_roll_back(results):
    for r in (0, 1, 3):
        res = results[r]["killed_reading"]
        assert res["ok"], res.get("error")
        assert res["type"] == "PeerFailure", (r, res)
        assert (res["stage"], res["ranks"], res["reason"]) == ("reading", (2,), "died"), (r, res)
        assert "a peer died during reading: rank(s) 2" in res["message"], res["message"]
        assert res["wrote"] == [True], f"rank {r} had written nothing when its peer died: {res}"
        assert res["unchanged"], f"rank {r} was not restored"
    assert "killed_reading" not in results[2]


def test_host_ranks_read_shared_files_ahead(results):
    """Four ranks of one host, one copy of the files, each reading its quarter: together they read all of each file,
    so none is advised POSIX_FADV_RANDOM (large folios, large reads: loader/execute/host_shared.py); a rank that
    reads alone keeps its exact reads."""
    per_rank = ok(results, "host_reads")
    for r, res in enumerate(per_rank):
        assert res["all"]["bad"] == [], (r, res)
        assert res["all"]["files"] >= 1 and res["all"]["sparse"] == 0, (r, res)
    assert per_rank[0]["rank0"]["sparse"] == per_rank[0]["rank0"]["files"] >= 1, per_rank[0]
    assert all(res["rank0"]["sparse"] == 0 for res in per_rank[1:])
