"""One rank of the 4-rank gloo world of tests/test_checkpoint_protocol.py: a DTensor-sharded model loads a checkpoint
whose keys are split across files as sub-boxes (``SplitFiles``), each rank reading the chunks its slots cross."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from dist_worker import check_full
from gloo_world import worker_main


class Sharded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(6, 8))  # Shard(0): rows 0:2, 2:4, 4:6, none; the chunks split rows at 2
        self.v = nn.Parameter(torch.zeros(6, 8))  # Shard(1): columns in twos; the chunks split columns at 3
        self.p = nn.Parameter(torch.zeros(3, 3))  # replicated; a pinwheel tiling: read whole, assembled


def scenario_split_keys(ctx: dict) -> dict:
    from test_checkpoint_protocol import SplitFiles
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    from loader import load_hf_checkpoint
    from loader.options import LoadOptions
    from loader.placements import shard_module

    mesh = init_device_mesh("cpu", (4,))
    model = shard_module(Sharded(), mesh, {"w": [Shard(0)], "v": [Shard(1)], "p": [Replicate()]})
    checkpoint = SplitFiles(ctx["folder"], ctx["parts"], {k: tuple(s) for k, s in ctx["shapes"].items()})
    report = load_hf_checkpoint(model, checkpoint, options=LoadOptions(progress=False, timeout=60))
    expected = torch.load(ctx["ref"])
    return {"bad": check_full(model, expected), "deferred": report.deferred, "bytes_read": report.bytes_read}


if __name__ == "__main__":
    worker_main([("split_keys", scenario_split_keys)], lost_a_rank=False)
