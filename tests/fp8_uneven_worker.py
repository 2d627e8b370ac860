"""One rank of the 4-rank gloo world of tests/test_fp8_uneven_blocks.py: FP8 weights of 128 x 128 blocks sharded
192 rows (or columns) a rank, a cut that misses the blocks, each rank reading its codes and the blocks it touches."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from dist_worker import check_full
from gloo_world import worker_main


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rows = nn.Linear(256, 768, bias=False, dtype=torch.bfloat16)  # Shard(0): 192 output rows a rank
        self.cols = nn.Linear(768, 256, bias=False, dtype=torch.bfloat16)  # Shard(1): 192 input columns a rank


def scenario_uneven_blocks(ctx: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from loader import load_hf_checkpoint
    from loader.options import LoadOptions
    from loader.placements import shard_module

    mesh = init_device_mesh("cpu", (4,))
    model = shard_module(Pair(), mesh, {"rows.weight": [Shard(0)], "cols.weight": [Shard(1)]})
    report = load_hf_checkpoint(model, ctx["folder"], options=LoadOptions(progress=False, timeout=60))
    expected = torch.load(ctx["ref"])
    return {"bad": check_full(model, expected), "deferred": report.deferred, "bytes_read": report.bytes_read}


if __name__ == "__main__":
    worker_main([("uneven_blocks", scenario_uneven_blocks)], lost_a_rank=False)
