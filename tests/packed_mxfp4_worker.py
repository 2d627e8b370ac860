"""One rank of the 4-rank gloo world of tests/test_packed_mxfp4.py: DTensor-sharded expert weights load an MXFP4
checkpoint, each rank decoding the bytes and exponents of its shard."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from dist_worker import check_full
from gloo_world import worker_main


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 128, 64, dtype=torch.bfloat16))  # Shard(2): 16 outputs a rank
        self.down_proj = nn.Parameter(torch.zeros(4, 64, 48, dtype=torch.bfloat16))  # Shard(1): K cut through blocks


def scenario_mxfp4_shards(ctx: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from loader import load_hf_checkpoint
    from loader.options import LoadOptions
    from loader.placements import shard_module

    mesh = init_device_mesh("cpu", (4,))
    model = shard_module(Experts(), mesh, {"gate_up_proj": [Shard(2)], "down_proj": [Shard(1)]})
    report = load_hf_checkpoint(model, ctx["folder"], options=LoadOptions(progress=False, timeout=60))
    expected = torch.load(ctx["ref"])
    return {"bad": check_full(model, expected), "deferred": report.deferred, "bytes_read": report.bytes_read}


if __name__ == "__main__":
    worker_main([("mxfp4_shards", scenario_mxfp4_shards)], lost_a_rank=False)
