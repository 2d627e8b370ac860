"""One rank of the 4-rank gloo world of tests/test_distributed_groups.py: ranks {0, 1} and {2, 3} each load their own
checkpoint on their own process group (``group=``) at the same time; a flow of one group involves no rank of the
other (a collective or agreement over the world would mismatch the two loads, or wait for ranks that never come)."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))

from dist_worker import check_full, layout_placements
from gloo_world import worker_main

PAIRS = ((0, 1), (2, 3))


def _my_pair() -> tuple[tuple[int, int], object, object]:
    """This rank's pair, its process group and its mesh (every rank makes both groups and meshes, in one order)."""
    from torch.distributed.device_mesh import DeviceMesh

    groups = [dist.new_group(list(p)) for p in PAIRS]
    meshes = [DeviceMesh("cpu", list(p)) for p in PAIRS]
    i = dist.get_rank() // 2
    return PAIRS[i], groups[i], meshes[i]


def _load(ctx: dict, path: str, group, mesh):
    import dist_models as dm

    from loader import load_hf_checkpoint
    from loader.options import LoadOptions, Rules
    from loader.placements import shard_module

    model = shard_module(dm.Layout(), mesh, layout_placements((2,)))
    options = LoadOptions(progress=False, timeout=60)
    report = load_hf_checkpoint(model, path, rules=Rules(weights_mapping=dm.RULES), options=options, group=group)
    return model, report


def scenario_two_groups(ctx: dict) -> dict:
    """Each pair loads its own checkpoint on its group: right values, the report's rank and world the group's."""
    pair, group, mesh = _my_pair()
    model, report = _load(ctx, ctx["paths"][pair[0] // 2], group, mesh)
    expected = torch.load(ctx["refs"][pair[0] // 2])
    return {"bad": check_full(model, expected), "rank": report.rank, "world": report.world_size}


def scenario_one_group_fails(ctx: dict) -> dict:
    """Rank 1 loads a truncated file: both ranks of its pair raise its CheckpointError (rank 1 of the group); the
    other pair loads, at the same time, as if nothing happened."""
    from loader.errors import CheckpointError

    pair, group, mesh = _my_pair()
    path = ctx["bad_path"] if dist.get_rank() == 1 else ctx["paths"][pair[0] // 2]
    try:
        model, _ = _load(ctx, path, group, mesh)
    except CheckpointError as e:
        return {"raised": "CheckpointError", "from_rank": getattr(e, "rank", None), "message": str(e)}
    return {"raised": None, "bad": check_full(model, torch.load(ctx["refs"][pair[0] // 2]))}


SCENARIOS = [
    ("two_groups", scenario_two_groups),
    ("one_group_fails", scenario_one_group_fails),
]


if __name__ == "__main__":
    worker_main(SCENARIOS, lost_a_rank=False)
