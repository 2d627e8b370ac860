"""One rank of the 4-rank gloo world of tests/test_distributed_groups.py: ranks {0, 1} and {2, 3} each run their own
flow (a load of their own checkpoint, a save of their own model) on their own process group (``group=``) at the same
time; a flow of one group involves no rank of the other (a collective or agreement over the world would mismatch
the two flows, or wait for ranks that never come)."""

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


def scenario_groups_save(ctx: dict) -> dict:
    """Each pair saves its own model (a ``Shard(0)`` weight, a plain bias) on its group into its own folder: the
    files hold the model's values; the plain tensor is written by the group's rank 0."""
    from safetensors.torch import load_file
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from loader import save_hf_checkpoint
    from loader.options import SaveOptions

    pair, group, mesh = _my_pair()
    torch.manual_seed(pair[0])  # the same model on both ranks of a pair, another in each pair
    model = nn.Linear(8, 6)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model.weight = nn.Parameter(distribute_tensor(full["weight"], mesh, [Shard(0)]), requires_grad=False)
    folder = os.path.join(ctx["out"], f"saved{pair[0]}")
    report = save_hf_checkpoint(model, folder, options=SaveOptions(progress=False, timeout=60), group=group)
    saved = load_file(os.path.join(folder, "model.safetensors"))
    same = sorted(saved) == sorted(full) and all(torch.equal(saved[k], full[k]) for k in full)
    return {"same": same, "rank": report.rank, "world": report.world, "written": list(report.written)}


SCENARIOS = [
    ("two_groups", scenario_two_groups),
    ("one_group_fails", scenario_one_group_fails),
    ("groups_save", scenario_groups_save),
]


if __name__ == "__main__":
    worker_main(SCENARIOS, lost_a_rank=False)
