"""gpt-oss MXFP4 checkpoints dequantize on load, bit for bit as transformers' ``Mxfp4Config(dequantize=True)`` load
(``convert_moe_packed_tensors``) makes them; each rank plans the bytes and exponents its box touches.

Checkpoints are written here as openai and transformers store them (:mod:`packed_mxfp4`).
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import Shard

from loader import CheckpointError, HFLoadPlanner, load_hf_checkpoint
from loader.checkpoint import FileReader, SafetensorsCheckpoint
from loader.execute import execute_plan
from loader.options import LoadOptions
from loader.placements import shard_boxes
from loader.plan import TargetSlot
from loader.rules.mxfp4 import dequantize_mxfp4

sys.path.insert(0, os.path.dirname(__file__))

from packed_mxfp4 import random_mxfp4, tiny_config, write_mxfp4

BF16 = torch.bfloat16
QUIET = LoadOptions(progress=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [BF16, torch.float32, torch.float16])
def test_every_code_and_exponent_dequantizes_like_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.arange(256, dtype=torch.uint8).reshape(1, 1, 16, 16).repeat(1, 256, 1, 1)
    scales = torch.arange(256, dtype=torch.uint8).reshape(1, 256, 1).repeat(1, 1, 16)
    ours, theirs = dequantize_mxfp4(blocks, scales, dtype), convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == theirs.shape == (1, 512, 256)
    assert torch.equal(_bits(ours), _bits(theirs))  # -0.0, 2 ** -127 and exponent 255 included


def test_a_gpt_oss_loads_like_from_pretrained_dequantized(tmp_path):
    from transformers import GptOssForCausalLM, Mxfp4Config

    model = GptOssForCausalLM(tiny_config()).to(BF16)
    stored = write_mxfp4(tmp_path, model, seed=1, edge_scales=True)
    reference = GptOssForCausalLM.from_pretrained(
        tmp_path, dtype=BF16, quantization_config=Mxfp4Config(dequantize=True)
    )
    with torch.device("meta"):
        target = GptOssForCausalLM(tiny_config()).to(BF16)
    report = load_hf_checkpoint(target, str(tmp_path), device="cpu", options=QUIET)
    assert report.deferred == () and report.missing_keys == () and report.unexpected_keys == ()
    assert "model.layers.0.mlp.experts.gate_up_proj" in report.traced
    ours, theirs = target.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(_bits(ours[k]), _bits(theirs[k])), k
    assert report.bytes_read == sum(t.numel() * t.element_size() for t in stored.values())  # each byte once


class Experts(nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape, dtype=BF16))


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_tp_shards_plan_the_bytes_and_exponents_they_touch(tmp_path, dim):
    """Dense ``[E, K, out]``: experts, input (K: 32-code blocks, 16 bytes) or output rows cut four ways."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    experts, k, out = 4, 128, 48
    blocks, scales = random_mxfp4((experts, out, k), torch.Generator().manual_seed(2))
    save_file({"weight_blocks": blocks, "weight_scales": scales}, os.path.join(tmp_path, "model.safetensors"))
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({"quantization_config": {"quant_method": "mxfp4"}}, f)
    want = convert_moe_packed_tensors(blocks, scales, dtype=BF16)
    checkpoint, shape = SafetensorsCheckpoint.open(str(tmp_path)), (experts, k, out)
    planner = HFLoadPlanner(Experts(shape))
    for rank in range(4):
        boxes = shard_boxes(shape, (4,), (rank,), [Shard(dim)])
        ((g, _),) = boxes
        local = torch.zeros(tuple(b - a for a, b in g), dtype=BF16)
        plan = planner.build_plan(checkpoint, {"weight": TargetSlot("weight", shape, BF16, local, boxes)})
        assert plan.deferred == () and plan.reads == ()
        with FileReader() as reader:
            execute_plan(plan, reader, QUIET)
        assert torch.equal(local, want[tuple(slice(a, b) for a, b in g)]), rank
        # every cut here is on 32-code blocks: a quarter of the bytes and of the exponents
        assert plan.planned_bytes() == (blocks.numel() + scales.numel()) // 4, rank
        assert reader.bytes_read == plan.planned_bytes()  # an operand used by several fields is read once


def test_layouts_not_decoded_are_refused_by_name(tmp_path):
    blocks = torch.zeros(8, 2, 16, dtype=torch.uint8)  # a 2-d weight's blocks: not a gpt-oss expert layout
    save_file({"weight_blocks": blocks, "weight_scales": torch.zeros(8, 2, dtype=torch.uint8)},
              os.path.join(tmp_path, "model.safetensors"))  # fmt: skip
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({"quantization_config": {"quant_method": "mxfp4"}}, f)
    model = Experts((64, 8))
    with pytest.raises(CheckpointError, match="'weight_blocks'.*only gpt-oss expert layouts"):
        load_hf_checkpoint(model, str(tmp_path), options=QUIET)
    assert not model.weight.detach().any()


@pytest.mark.dist
def test_four_gloo_ranks_load_mxfp4_shards(tmp_path):
    """A 4-rank gloo world: expert weights cut along the output (on blocks) and along K (16 inputs a rank: through
    32-code blocks and their exponents) equal transformers' dequantization on every rank, each rank reading the
    bytes and exponents its shard touches."""
    import packed_mxfp4_worker
    from gloo_world import WORLD, ok, run_world
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(3)
    stored, ref = {}, {}
    for name, dense in (("gate_up_proj", (4, 64, 128)), ("down_proj", (4, 48, 64))):  # stored [E, out, K]
        blocks, scales = random_mxfp4(dense, g)
        stored[name + "_blocks"], stored[name + "_scales"] = blocks, scales
        ref[name] = convert_moe_packed_tensors(blocks, scales, dtype=BF16)
    folder = tmp_path / "mxfp4"
    os.makedirs(folder)
    save_file(stored, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"quantization_config": {"quant_method": "mxfp4"}}, f)
    torch.save(ref, tmp_path / "ref.pt")
    ctx = {
        "store": str(tmp_path / "store"),
        "out": str(tmp_path),
        "folder": str(folder),
        "ref": str(tmp_path / "ref.pt"),
    }
    results = run_world(packed_mxfp4_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    # gate_up: a quarter of its bytes and exponents; down_proj: K 16 a rank inside one 32-code block of 16 bytes,
    # so its 8 bytes of each block row and the block's exponent
    gate_up = (stored["gate_up_proj_blocks"].numel() + stored["gate_up_proj_scales"].numel()) // 4
    down = 4 * 48 * 8 + 4 * 48 * 1
    for r, res in enumerate(ok(results, "mxfp4_shards")):
        assert res["bad"] == [] and res["deferred"] == (), f"rank {r}: {res}"
        assert res["bytes_read"] == gate_up + down, (r, res["bytes_read"], gate_up, down)
