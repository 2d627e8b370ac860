"""Meta-device models sharded with DTensors on a real 4-rank gloo world (one world; tests/meta_worker.py).

``load_hf_checkpoint(model, path, device="cpu")`` on a model whose DTensors' local shards are on the meta
device allocates only each rank's local shard (storage of exactly the shard's bytes), keeps placements, mesh
and ties, loads values equal to ``from_pretrained`` and initialises what the checkpoint lacks (rotary
``inv_freq``) through the model's own init. Without ``device=`` every rank refuses the meta model.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import dist_models as dm
import meta_worker
from gloo_world import WORLD, ok, run_world
from hf_models import build, read_checkpoint, save

pytestmark = [pytest.mark.dist, pytest.mark.filterwarnings("ignore::FutureWarning")]

FAMILIES = {  # family: (checkpoint dtype, config overrides the worker builds with too)
    "llama": (torch.float32, {"vocab_size": 70}),  # tied embeddings; 70 rows: uneven over 4 ranks
    "qwen3_moe": (torch.bfloat16, {}),
}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("meta_dist")
    out = root / "out"
    out.mkdir()
    ctx = {"store": str(root / "store"), "out": str(out)}
    for family, (dtype, overrides) in FAMILIES.items():
        auto, model = build(family, seed=5, **overrides)
        folder = root / family
        save(model, folder, dtype=dtype)
        reference = auto.from_pretrained(folder, dtype=torch.float32)
        torch.save(
            {
                "state": {k: v.clone() for k, v in reference.state_dict().items()},
                "buffers": {k: v.clone() for k, v in reference.named_buffers()},
            },
            root / f"{family}_ref.pt",
        )
        tensors = read_checkpoint(folder)
        assert {t.dtype for t in tensors.values()} == {dtype}
        ctx.update(
            {
                f"{family}_path": str(folder),
                f"{family}_ref": str(root / f"{family}_ref.pt"),
                f"{family}_itemsize": dtype.itemsize,
                f"{family}_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
            }
        )
    ctx["layout_path"] = str(root / "layout.safetensors")
    dm.write_checkpoint(ctx["layout_path"])
    return ctx, run_world(meta_worker.__file__, root, str(out), ctx)


CASES = {  # scenario: (family, mesh shape)
    "llama_tp4": ("llama", (4,)),
    "llama_2x2": ("llama", (2, 2)),
    "moe_tp4": ("qwen3_moe", (4,)),
    "moe_2x2": ("qwen3_moe", (2, 2)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_meta_model_allocates_only_local_shards(world, name):
    ctx, results = world
    family, mesh_shape = CASES[name]
    per_rank = ok(results, name)
    shards = mesh_shape[-1]  # every sharded tensor is split at least over the last (TP) mesh dim
    for r, res in enumerate(per_rank):
        assert res["n_dtensors"] == res["n_placements"] > 0, (r, res)  # by name: tied names count twice in both
        assert res["on_meta_before"] and len(res["on_meta_before"]) == res["n_tensors"], (r, res)
        assert res["still_meta"] == [], (r, res["still_meta"])
        assert res["not_dtensor"] == [], (r, res["not_dtensor"])
        assert res["bad_layout"] == [], (r, res["bad_layout"])
        assert res["bad_alloc"] == [], (r, res["bad_alloc"])
        # each rank holds its share of the DTensors' bytes, never the global tensors (uneven vocab rows: +3 %)
        assert 0 < res["local_bytes"] * shards <= 1.03 * res["global_bytes"], (r, res)
        assert (res["rank"], res["world_size"]) == (r, WORLD)
    assert sum(res["local_bytes"] for res in per_rank) >= per_rank[0]["global_bytes"]


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_meta_model_equals_from_pretrained(world, name):
    ctx, results = world
    family, _ = CASES[name]
    for r, res in enumerate(ok(results, name)):
        assert res["bad_full"] == [], (r, res["bad_full"])  # bit-exact, buffers (rotary inv_freq) included
        assert res["bad_local"] == [], (r, res["bad_local"])  # each shard is DTensor's own shard of the reference
        assert res["missing_from_model"] == [] and res["missing_keys"] == ()
        assert {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"} <= set(res["buffers"])
    if name == "moe_2x2":  # the experts' fused gate_up is a _StridedShard over TP
        assert any("gate_up_proj" in n for n in ok(results, name)[0]["strided"])


@pytest.mark.parametrize("name", ["llama_tp4", "llama_2x2"])
def test_tied_weights_stay_tied(world, name):
    _, results = world
    for r, res in enumerate(ok(results, name)):
        assert res["tied_before"] and res["tied_after"] and res["tied_is_param"], (r, res)


@pytest.mark.parametrize("name", list(CASES))
def test_each_rank_reads_its_shards_not_the_checkpoint(world, name):
    ctx, results = world
    family, mesh_shape = CASES[name]
    whole = ctx[f"{family}_bytes"]
    for r, res in enumerate(ok(results, name)):
        assert res["bytes_read"] < whole, (r, res["bytes_read"], whole)
        assert res["shard_bytes"] <= res["bytes_read"] <= 1.02 * res["shard_bytes"], (r, res)
        assert res["bytes_all_ranks"][r] == res["bytes_read"]
    if mesh_shape == (4,):  # 4-way TP: well under half the checkpoint per rank
        assert max(res["bytes_read"] for res in ok(results, name)) < whole / 2


def test_meta_model_without_device_is_refused_on_every_rank(world):
    _, results = world
    for r, res in enumerate(ok(results, "without_device")):
        assert res["type"] == "ValueError", (r, res)
        assert "is on the meta device: materialize the model first" in res["message"], (r, res["message"])
        assert res["materialised"] == [], f"rank {r} allocated {res['materialised']}"


def test_killed_rank_during_a_meta_load_is_reported_dead(world):
    _, results = world
    for r in (0, 1, 3):
        res = results[r]["killed_planning"]
        assert res["ok"], res.get("error")
        assert res["type"] == "PeerFailure", (r, res)
        assert (res["stage"], res["ranks"], res["reason"]) == ("planning", (2,), "died"), (r, res)
        assert res["still_meta"] == [], (r, res)  # materialised before planning
    assert "killed_planning" not in results[2]
