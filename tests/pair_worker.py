"""One rank of a 4-rank gloo world loading packed or block-scaled checkpoints (tests/test_packed_int4.py,
test_packed_linears.py, test_fp8_uneven_blocks.py) into a pair of DTensor-sharded dense linears: ``rows``
sharded by its output rows (``Shard(0)``), ``cols`` by its input columns (``Shard(1)``), each rank decoding the
codes and scale groups of its shard.

Its context names the loads: ``loads``, a list of ``{"folder", "ref", "dtype"}`` (``ref`` a ``torch.save`` of the
expected ``rows.weight`` and ``cols.weight``, whose shapes the pair takes); per load it answers what was wrong
(:func:`dist_worker.check_full`), what was deferred and the bytes read, as its answer's ``loads``."""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

from dist_worker import check_full
from gloo_world import worker_main


def pair(ref: dict, dtype: torch.dtype) -> nn.Module:
    module = nn.Module()
    for name in ("rows", "cols"):
        out, inp = ref[f"{name}.weight"].shape
        setattr(module, name, nn.Linear(inp, out, bias=False, dtype=dtype))
    return module


def scenario_pair_shards(ctx: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    from loader import load_hf_checkpoint
    from loader.options import LoadOptions
    from loader.placements import shard_module

    mesh = init_device_mesh("cpu", (4,))
    out = []
    for load in ctx["loads"]:
        expected = torch.load(load["ref"])
        placements = {"rows.weight": [Shard(0)], "cols.weight": [Shard(1)]}
        model = shard_module(pair(expected, getattr(torch, load["dtype"])), mesh, placements)
        report = load_hf_checkpoint(model, load["folder"], options=LoadOptions(progress=False, timeout=60))
        out.append({"bad": check_full(model, expected), "deferred": report.deferred, "bytes_read": report.bytes_read})
    return {"loads": out}


if __name__ == "__main__":
    worker_main([("pair_shards", scenario_pair_shards)], lost_a_rank=False)
