"""One rank of the 4-rank gloo world of tests/test_bin_checkpoints.py: loads a sharded ``.bin`` folder into a
tensor-parallel qwen3_moe and checks the full tensors against the reference."""

from __future__ import annotations

import torch
from dist_worker import check_full, moe_placements
from gloo_world import worker_main

from loader.options import LoadOptions
from loader.placements import shard_module


def scenario_bin_sharded(ctx: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from loader import load_hf_checkpoint

    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ctx["path"]))
    mesh = init_device_mesh("cpu", (4,))
    model = shard_module(model, mesh, moe_placements(model, (4,)))
    report = load_hf_checkpoint(model, ctx["path"], options=LoadOptions(progress=False))
    bad = check_full(model, torch.load(ctx["ref"]))
    return {"bad": bad, "bytes_read": report.bytes_read, "planned_bytes": report.planned_bytes}


SCENARIOS = [("bin_sharded", scenario_bin_sharded)]

if __name__ == "__main__":
    worker_main(SCENARIOS, lost_a_rank=False)
