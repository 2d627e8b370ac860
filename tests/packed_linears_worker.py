"""One rank of the 4-rank gloo world of tests/test_packed_linears.py: DTensor-sharded dense linears load a GPTQ and
an AWQ checkpoint, each rank decoding the words, zero points and scale groups of its shard."""

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
        self.rows = nn.Linear(128, 64, bias=False, dtype=torch.float16)  # Shard(0): 16 output rows a rank
        self.cols = nn.Linear(256, 32, bias=False, dtype=torch.float16)  # Shard(1): 64 inputs (2 groups) a rank


def scenario_linear_shards(ctx: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from loader import load_hf_checkpoint
    from loader.options import LoadOptions
    from loader.placements import shard_module

    mesh = init_device_mesh("cpu", (4,))
    out = {}
    for method in ("gptq", "awq"):
        model = shard_module(Pair(), mesh, {"rows.weight": [Shard(0)], "cols.weight": [Shard(1)]})
        options = LoadOptions(progress=False, timeout=60)
        report = load_hf_checkpoint(model, os.path.join(ctx["out"], method), options=options)
        expected = torch.load(os.path.join(ctx["out"], method + ".pt"))
        out[method] = {"bad": check_full(model, expected), "deferred": report.deferred, "bytes": report.bytes_read}
    return out


if __name__ == "__main__":
    worker_main([("linear_shards", scenario_linear_shards)], lost_a_rank=False)
