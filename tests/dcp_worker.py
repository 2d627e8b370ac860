"""One rank of the 4-rank gloo world of tests/test_dcp_source.py: ``dcp.save`` of a llama state dict as DTensors
``Shard(0)`` (keys of 4 chunks), then ``load_hf_checkpoint`` of that folder into a model sharded otherwise, checked
bit-identical to ``dcp.load`` into the same target and to the reference."""

from __future__ import annotations

import torch
from dist_worker import check_full
from gloo_world import worker_main

from loader.options import LoadOptions
from loader.placements import placements_matching, shard_module


def _target(ctx: dict, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ctx["config"]))
    patterns = {"*_proj.weight": [Shard(1)], "*embed_tokens.weight": [Shard(1)], "*lm_head.weight": [Replicate()]}
    return shard_module(model, mesh, placements_matching(model, patterns))


def scenario_save(ctx: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (4,))
    reference = torch.load(ctx["ref"])
    state = {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() else v for k, v in reference.items()}
    dcp.save(state, checkpoint_id=ctx["path"])
    return {}


def scenario_load(ctx: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from loader import load_hf_checkpoint

    mesh = init_device_mesh("cpu", (4,))
    ours, theirs = _target(ctx, mesh), _target(ctx, mesh)
    report = load_hf_checkpoint(ours, ctx["path"], options=LoadOptions(progress=False))
    state = theirs.state_dict()
    dcp.load(state, checkpoint_id=ctx["path"])
    differ = []
    for (name, a), b in zip(ours.state_dict().items(), state.values()):
        a, b = getattr(a, "_local_tensor", a), getattr(b, "_local_tensor", b)
        if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
            differ.append(name)
    bad = check_full(ours, torch.load(ctx["ref"]))
    local = sum(getattr(t, "_local_tensor", t).nbytes for t in ours.state_dict().values())
    return {
        "bad": bad,
        "differ": differ,
        "bytes_read": report.bytes_read,
        "planned_bytes": report.planned_bytes,
        "local_bytes": local,
    }


SCENARIOS = [("save", scenario_save), ("load", scenario_load)]

if __name__ == "__main__":
    worker_main(SCENARIOS, lost_a_rank=False)
