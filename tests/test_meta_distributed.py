"""Meta-device models sharded with DTensors on a real 4-rank gloo world (one world; tests/meta_worker.py).

``load_hf_checkpoint(model, path, device="cpu")`` on a model whose DTensors' local shards are on the meta
device allocates only each rank's local shard (storage of exactly the shard's bytes), keeps placements, mesh
and ties, loads values equal to ``from_pretrained`` and initialises what the checkpoint lacks (rotary
``inv_freq``) through the model's own init. Without ``device=`` every rank refuses the meta model.

FP8 block-quantized checkpoints (square and non-square blocks dividing none of the shapes, TP row/column shards
cutting through blocks) dequantize on load exactly, nothing deferred, each rank reading exactly its weight
regions' codes and the scale blocks they touch.
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
from safetensors.torch import save_file
from test_fp8 import write_fp8

from loader.rules.fp8 import dequantize_quant_blocks

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
    for name, block in FP8_BLOCKS.items():
        write_fp8_moe(root, ctx, name, block)
    ctx["fp8_weights"] = []
    for shape, block in FP8_WEIGHTS:
        folder = root / f"fp8_weight_{block[0]}x{block[1]}"
        write_fp8(folder, {"weight": torch.randn(shape, generator=torch.Generator().manual_seed(11))}, block)
        ctx["fp8_weights"].append({"path": str(folder), "shape": list(shape), "block": list(block)})
    return ctx, run_world(meta_worker.__file__, root, str(out), ctx)


#: FP8 copies of the tiny qwen3_moe (every 2-D ``*proj*`` weight quantized, per-expert ones included), in
#: non-square blocks dividing none of its dims (32, 16), so every TP shard cuts through blocks
FP8_BLOCKS = {"qwen3_moe_fp8_tp4": (12, 20), "qwen3_moe_fp8_2x2": (20, 12)}
#: one FP8 weight in blocks its shape does not divide (loaded row-, column- and 2-D-sharded)
FP8_WEIGHTS = [((200, 300), (128, 128)), ((200, 300), (64, 48))]


def write_fp8_moe(root, ctx: dict, name: str, block: tuple[int, int]) -> None:
    """An FP8 qwen3_moe checkpoint ``root/name`` and its reference: ``from_pretrained`` (bf16) of a folder
    holding the same weights dequantized up front (as tests/test_fp8.py does single-process)."""
    auto, model = build("qwen3_moe", seed=7)
    plain, quantized, reference_dir = root / f"{name}_bf16", root / name, root / f"{name}_dequantized"
    save(model, plain, dtype=torch.bfloat16)
    save(model, reference_dir, dtype=torch.bfloat16)
    tensors = read_checkpoint(plain)
    quantized.mkdir()
    (quantized / "config.json").write_text((plain / "config.json").read_text())
    stored = write_fp8(quantized, tensors, block, quantize=lambda n, t: t.dim() == 2 and "proj" in n)
    assert any(".experts.0.gate_proj.weight_scale_inv" in k for k in stored)
    assert any("self_attn.o_proj.weight_scale_inv" in k for k in stored)
    dequantized = {
        k: dequantize_quant_blocks(v, stored[k + "_scale_inv"], block, torch.bfloat16)
        if k + "_scale_inv" in stored
        else v
        for k, v in stored.items()
        if not k.endswith("_scale_inv")
    }
    save_file(dequantized, str(reference_dir / "model.safetensors"), metadata={"format": "pt"})
    reference = auto.from_pretrained(reference_dir, dtype=torch.bfloat16)
    torch.save(
        {
            "state": {k: v.clone() for k, v in reference.state_dict().items()},
            "buffers": {k: v.clone() for k, v in reference.named_buffers()},
        },
        root / f"{name}_ref.pt",
    )
    ctx.update(
        {
            f"{name}_path": str(quantized),
            f"{name}_ref": str(root / f"{name}_ref.pt"),
            f"{name}_block": list(block),
            f"{name}_bytes": sum(t.numel() * t.element_size() for t in stored.values()),
        }
    )


CASES = {  # scenario: (family, mesh shape)
    "llama_tp4": ("llama", (4,)),
    "llama_2x2": ("llama", (2, 2)),
    "moe_tp4": ("qwen3_moe", (4,)),
    "moe_2x2": ("qwen3_moe", (2, 2)),
}


FP8_CASES = {  # scenario: (checkpoint, mesh shape); tp4 shards as tests/test_distributed.py, 2x2 by the model's plan
    "fp8_moe_tp4": ("qwen3_moe_fp8_tp4", (4,)),
    "fp8_moe_2x2": ("qwen3_moe_fp8_2x2", (2, 2)),
}


@pytest.mark.parametrize("name", [*CASES, *FP8_CASES])
def test_sharded_meta_model_allocates_only_local_shards(world, name):
    ctx, results = world
    _, mesh_shape = {**CASES, **FP8_CASES}[name]
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


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_moe_dequantizes_on_load_like_from_pretrained(world, name):
    """An FP8 qwen3_moe (per-expert weights too) loaded into a bf16 model sharded with DTensors: every value
    (gathered and local) equals ``from_pretrained`` of the dequantized checkpoint, and nothing is deferred."""
    _, results = world
    per_rank = ok(results, name)
    for r, res in enumerate(per_rank):
        assert res["deferred"] == (), (r, res["deferred"])
        assert res["unexpected_keys"] == () and res["missing_keys"] == (), (r, res)  # the scales are consumed
        assert res["bad_full"] == [], (r, res["bad_full"])
        assert res["bad_local"] == [], (r, res["bad_local"])
        assert res["missing_from_model"] == [], (r, res["missing_from_model"])
        assert any(n.endswith("experts.gate_up_proj") for n in res["traced"]), (r, res["traced"])
    if name == "fp8_moe_2x2":  # the fused gate_up is a _StridedShard over TP: its shards cut gate and up
        assert any("gate_up_proj" in n for n in per_rank[0]["strided"])


@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_moe_ranks_read_their_codes_and_the_scale_blocks_they_touch(world, name):
    """Bytes read per rank, exactly: for the checkpoint regions its shards come from, their codes (1 byte each)
    + 4 bytes per distinct scale block they touch + the bytes of the unquantized (bf16) ones."""
    ctx, results = world
    checkpoint, mesh_shape = FP8_CASES[name]
    whole = ctx[f"{checkpoint}_bytes"]
    per_rank = ok(results, name)
    for r, res in enumerate(per_rank):
        assert res["region_problems"] == [], (r, res["region_problems"])
        assert res["bytes_read"] == res["expected_bytes"], (r, res["bytes_read"], res["expected_bytes"])
        assert res["bytes_all_ranks"][r] == res["bytes_read"]
        assert any(k.endswith(".experts.3.up_proj.weight") for k in res["regions"])
        assert res["bytes_read"] < whole, (r, res["bytes_read"], whole)
    if mesh_shape == (4,):  # 4-way TP: well under half the checkpoint per rank
        assert max(res["bytes_read"] for res in per_rank) < whole / 2


def test_fp8_weight_shards_read_their_region_and_its_scale_blocks(world):
    """One FP8 weight (200 x 300, in blocks of 128 x 128 and 64 x 48) sharded over rows, columns or both on the
    4 ranks: each rank holds exactly its box of the dequantized weight and reads its box's codes plus the scale
    blocks the box touches; shards cut through blocks (some blocks are read by several ranks)."""
    _, results = world
    per_rank = [res["loads"] for res in ok(results, "fp8_weights")]
    assert len({len(loads) for loads in per_rank}) == 1 and len(per_rank[0]) == 8
    for i in range(len(per_rank[0])):
        case = per_rank[0][i]["case"]
        for r, loads in enumerate(per_rank):
            load = loads[i]
            assert load["case"] == case
            assert load["is_box"] and load["local_ok"] and load["full_ok"], (r, load)
            assert load["deferred"] == () and load["traced"] == ("weight",) and load["unexpected_keys"] == ()
            assert load["bytes_read"] == load["expected_bytes"], (r, load)
        (rows, cols), (bm, bn) = case[0], case[1]
        grid = -(-rows // bm) * -(-cols // bn)
        assert sum(loads[i]["scale_blocks"] for loads in per_rank) > grid, case  # blocks shared across ranks


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
        assert res["not_meta"] == [] and res["replaced"] == [], (r, res)  # allocated, then put back on meta
    assert "killed_planning" not in results[2]


def test_a_strict_error_on_one_rank_leaves_every_ranks_model_on_meta(world):
    _, results = world
    for r, res in enumerate(ok(results, "strict_on_one_rank")):
        assert res["type"] == "ValueError", (r, res)
        assert "1 model tensor(s) are not in the checkpoint: model.norm.weight" in res["message"], (r, res)
        assert res["not_meta"] == [] and res["replaced"] == [], (r, res)
        assert res["allocated"] == (r != 1), (r, res)  # the others had allocated: put back


def test_strict_false_initialises_missing_dtensors_through_the_models_init(world):
    _, results = world
    for r, res in enumerate(ok(results, "missing_initialised")):
        assert sorted(res["missing_keys"]) == sorted(meta_worker.MISSING), (r, res)
        assert res["dtensors"] == sorted(meta_worker.MISSING), (r, res)
        assert res["not_ones"] == [] and res["bad_loaded"] == [] and res["warned"] == [], (r, res)


def test_a_replicated_fp8_weight_is_dequantized_by_one_rank_and_broadcast(world):
    _, results = world
    per_rank = ok(results, "fp8_broadcast")
    assert all(res["ok"] and res["deferred"] == () for res in per_rank), per_rank
    reads = sorted(res["bytes_read"] for res in per_rank)
    assert reads == [0, 0, 0, per_rank[0]["whole"]], reads  # its owner reads codes and scales once
