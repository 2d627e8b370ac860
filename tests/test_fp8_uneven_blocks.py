"""FP8 block-scaled weights whose TP cut misses the 128 x 128 quant blocks load exactly: Qwen3-235B-A22B-FP8 at TP 8
has 192 rows a rank (vLLM refuses it: "not divisible by weight quantization block_n = 128"). Each rank's value
program reads its own codes and the scale blocks its rows or columns touch — a block two ranks share is read by
both — and its values equal transformers' ``Fp8Dequantize`` of the whole weight, sliced.
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch
from torch.distributed.tensor import Shard

from loader import HFLoadPlanner
from loader.checkpoint import FileReader, SafetensorsCheckpoint
from loader.execute import execute_plan
from loader.options import LoadOptions
from loader.placements import shard_boxes
from loader.plan import TargetSlot

sys.path.insert(0, os.path.dirname(__file__))

from test_fp8 import Weight, write_fp8

BF16, BLOCK = torch.bfloat16, (128, 128)


def fp8_dequantize(stored: dict, name: str = "weight") -> torch.Tensor:
    """transformers' fine-grained FP8 dequantization of a whole weight (its quant block divides the weight)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(stored[name], stored[name + "_scale_inv"], BF16)


def touched_blocks(lo: int, hi: int) -> int:
    return math.ceil(hi / 128) - lo // 128


@pytest.mark.parametrize(("shape", "dim"), [((1536, 256), 0), ((256, 1536), 1)])
def test_tp8_cuts_of_192_read_their_codes_and_the_scale_blocks_they_touch(tmp_path, shape, dim):
    """1536 outputs (or inputs) over 8 ranks: 192 a rank, 1.5 blocks; every rank touches 2 block rows (columns)."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    stored = write_fp8(tmp_path, {"weight": w}, BLOCK)
    want = fp8_dequantize(stored)
    checkpoint = SafetensorsCheckpoint.open(str(tmp_path))
    planner = HFLoadPlanner(Weight(shape))
    total = 0
    for rank in range(8):
        boxes = shard_boxes(shape, (8,), (rank,), [Shard(dim)])
        ((g, _),) = boxes
        local = torch.zeros(tuple(b - a for a, b in g), dtype=BF16)
        plan = planner.build_plan(checkpoint, {"weight": TargetSlot("weight", shape, BF16, local, boxes)})
        assert plan.deferred == () and plan.reads == () and len(plan.values) >= 1
        with FileReader() as reader:
            execute_plan(plan, reader, LoadOptions(progress=False))
        (r0, r1), (c0, c1) = g
        assert (r1 - r0 if dim == 0 else c1 - c0) == 192
        assert torch.equal(local.view(torch.int16), want[r0:r1, c0:c1].contiguous().view(torch.int16)), rank
        scale_blocks = touched_blocks(r0, r1) * touched_blocks(c0, c1)
        assert scale_blocks == 2 * 2  # two cut blocks by the other dim's two
        assert reader.bytes_read == plan.planned_bytes() == local.numel() + 4 * scale_blocks, rank
        total += reader.bytes_read
    # the codes once, the scale grid (12 x 2 blocks) with the 4 block rows two ranks cut through read twice
    assert total == stored["weight"].numel() + 4 * (stored["weight_scale_inv"].numel() + 4 * 2)


@pytest.mark.dist
def test_four_gloo_ranks_load_192_a_rank(tmp_path):
    """A 4-rank gloo world: a 768 x 256 weight row-sharded and a 256 x 768 one column-sharded, 192 a rank."""
    import pair_worker
    from gloo_world import WORLD, ok, run_world

    g = torch.Generator().manual_seed(8)
    full = {"rows.weight": torch.randn(768, 256, generator=g), "cols.weight": torch.randn(256, 768, generator=g)}
    folder = tmp_path / "fp8"
    stored = write_fp8(folder, full, BLOCK)
    torch.save({k: fp8_dequantize(stored, k) for k in full}, tmp_path / "ref.pt")
    ctx = {
        "store": str(tmp_path / "store"),
        "out": str(tmp_path),
        "loads": [{"folder": str(folder), "ref": str(tmp_path / "ref.pt"), "dtype": "bfloat16"}],
    }
    results = run_world(pair_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    codes = 192 * 256  # a rank's codes of each weight
    for r, (res,) in enumerate(a["loads"] for a in ok(results, "pair_shards")):
        assert res["bad"] == [] and res["deferred"] == (), f"rank {r}: {res}"
        assert res["bytes_read"] == 2 * (codes + 4 * 2 * 2), r  # each weight: its codes and 2 x 2 scale blocks
