"""One rank of the 4-rank gloo world of tests/test_torchtitan_dcp.py: ``dcp.save`` of a torchtitan Llama state as
DTensors in torchtitan's TP layout, then ``load_hf_checkpoint`` of that folder through the torchtitan rules into a
transformers llama sharded otherwise, compared with the same sharding loaded from the converted folder."""

from __future__ import annotations

import torch
from gloo_world import worker_main

from loader.options import LoadOptions
from loader.placements import placements_matching, shard_module


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (4,))


def scenario_save(ctx: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh()

    def placement(key: str) -> list:
        if key.endswith(("wo.weight", "w2.weight", "tok_embeddings.weight")):
            return [Shard(1)]
        return [Replicate()] if key.endswith("norm.weight") else [Shard(0)]

    state = {k: distribute_tensor(v, mesh, placement(k)) for k, v in torch.load(ctx["titan"]).items()}
    dcp.save(state, checkpoint_id=ctx["path"])
    return {}


def _target(ctx: dict):
    from torch.distributed.tensor import Shard
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ctx["hf"]), dtype=torch.bfloat16)
    patterns = {"*o_proj.weight": [Shard(1)], "*down_proj.weight": [Shard(1)], "*_proj.weight": [Shard(0)]}
    patterns["*embed_tokens.weight"] = [Shard(1)]
    return shard_module(model, _mesh(), placements_matching(model, patterns))


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t.data, "_local_tensor", t.data)


def scenario_load(ctx: dict) -> dict:
    import torchtitan_llama as tt

    from loader import Rules, load_hf_checkpoint

    quiet = LoadOptions(progress=False, timeout=60)
    ours, theirs = _target(ctx), _target(ctx)
    cfg = ours.config
    rules = Rules(weights_mapping=tt.rules(cfg.num_attention_heads, cfg.num_key_value_heads))
    report = load_hf_checkpoint(ours, ctx["path"], rules=rules, options=quiet)
    load_hf_checkpoint(theirs, ctx["hf"], options=quiet)
    a, b = ours.state_dict(keep_vars=True), theirs.state_dict(keep_vars=True)
    unequal = [n for n in b if not torch.equal(_local(a[n]).view(torch.uint8), _local(b[n]).view(torch.uint8))]
    sharded = [n for n in a if hasattr(a[n].data, "_local_tensor")]
    return {
        "unequal": unequal,
        "missing": report.missing_keys,
        "deferred": report.deferred,
        "bytes_read": report.bytes_read,
        "planned_bytes": report.planned_bytes,
        "shard_bytes": sum(_local(a[n]).nbytes for n in sharded),
        "replicated_bytes": sum(a[n].nbytes for n in a if n not in sharded),
    }


SCENARIOS = [("save", scenario_save), ("load", scenario_load)]

if __name__ == "__main__":
    worker_main(SCENARIOS, lost_a_rank=False)
