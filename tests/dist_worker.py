"""One rank of the shared gloo world used by tests/test_distributed.py: runs every scenario, saves results.

Each scenario returns plain data (no tensors cross processes except via the results file). The test
process writes the checkpoints and references first; every rank then runs all scenarios in the same order.
"""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn


def shard_model(model: nn.Module, mesh, placements: dict) -> nn.Module:  # noqa: ANN001
    """DTensor parameters with the given placements; every element NaN, so the loader must write them all."""
    from regiontrace.cli.sharding import shard_module

    return shard_module(model, mesh, placements)


def layout_placements(mesh_shape):  # noqa: ANN001, ANN201
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if len(mesh_shape) == 1:
        return {"qkv.weight": [Shard(0)], "o_proj.weight": [Shard(1)], "gate_up": [Shard(0)],
                "gate_up_strided": [_StridedShard(1, split_factor=2)], "down": [Shard(2)],
                "uneven": [Shard(0)], "scaled": [Shard(0)]}
    return {"qkv.weight": [Shard(0), Shard(0)], "o_proj.weight": [Replicate(), Shard(1)],
            "gate_up": [Shard(0), Shard(1)], "gate_up_strided": [_StridedShard(1, split_factor=2), Shard(1)],
            "down": [Shard(0), Shard(2)], "uneven": [Shard(0), Shard(0)], "scaled": [Replicate(), Shard(0)]}


def moe_placements(model: nn.Module, mesh_shape) -> dict:  # noqa: ANN001
    from torch.distributed.tensor import Replicate, Shard

    out = {}
    two = len(mesh_shape) == 2
    for name, _ in model.named_parameters():
        if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
            out[name] = [Replicate(), Shard(0)] if two else [Shard(0)]
        elif name.endswith("o_proj.weight"):
            out[name] = [Replicate(), Shard(1)] if two else [Shard(1)]
        elif name.endswith("experts.gate_up_proj"):
            out[name] = [Shard(0), Shard(1)] if two else [Shard(1)]
        elif name.endswith("experts.down_proj"):
            out[name] = [Shard(0), Shard(2)] if two else [Shard(2)]
        elif name.endswith("embed_tokens.weight"):
            out[name] = [Shard(0), Replicate()] if two else [Shard(0)]
    return out


def check_full(model: nn.Module, expected: dict) -> list[str]:
    """Names whose full (gathered) value differs from the reference. Collective: all ranks call it."""
    bad = []
    for name, t in model.state_dict(keep_vars=True).items():
        if name not in expected:
            continue
        data = t.data
        full = data.full_tensor() if hasattr(data, "full_tensor") else data
        if not torch.equal(full.to(expected[name].dtype), expected[name]):
            bad.append(name)
    return bad


def local_numel(t: torch.Tensor) -> int:
    data = t.data
    local = getattr(data, "_local_tensor", data)
    return local.numel()


# ---------------------------------------------------------------------------------------------------


def scenario_layout(ctx: dict, mesh_shape, use_dcp: bool = False) -> dict:  # noqa: ANN001
    import dist_models as dm
    from torch.distributed.device_mesh import init_device_mesh

    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    mesh = init_device_mesh("cpu", mesh_shape)
    model = shard_model(dm.Layout(), mesh, layout_placements(mesh_shape))
    path = ctx["layout_path"]
    if use_dcp:
        import torch.distributed.checkpoint as dcp

        planner = HFLoadPlanner(model, weights_mapping=dm.RULES)
        dcp.load(planner.state_dict_for_load(), storage_reader=SafetensorsReader(path), planner=planner)
        report = planner.finish(path)
    else:
        report = load_hf_checkpoint(model, path, weights_mapping=dm.RULES, progress=False)
    expected = torch.load(ctx["layout_ref"])
    bad = check_full(model, expected)
    sd = model.state_dict(keep_vars=True)
    traced_bytes = sum(local_numel(sd[n]) * 2 for n in report.traced)
    deferred_bytes = dm.ROWS * dm.H * 2 if local_numel(sd["scaled"]) else 0
    return {"bad": bad, "bytes_read": report.bytes_read, "traced_bytes": traced_bytes,
            "deferred_bytes": deferred_bytes, "deferred": report.deferred, "blocks": report.blocks,
            "planned_bytes": report.planned_bytes,
            "traced": report.traced}


def scenario_moe(ctx: dict, mesh_shape, use_dcp: bool = False) -> dict:  # noqa: ANN001
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    cfg = AutoConfig.from_pretrained(ctx["moe_path"])
    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(cfg)
    mesh = init_device_mesh("cpu", mesh_shape)
    placements = moe_placements(model, mesh_shape)
    model = shard_model(model, mesh, placements)
    if use_dcp:
        import torch.distributed.checkpoint as dcp

        planner = HFLoadPlanner(model)
        dcp.load(planner.state_dict_for_load(), storage_reader=SafetensorsReader(ctx["moe_path"]), planner=planner)
        report = planner.finish(ctx["moe_path"])
    else:
        report = load_hf_checkpoint(model, ctx["moe_path"], progress=False)
    expected = torch.load(ctx["moe_ref"])
    bad = check_full(model, expected)
    sd = model.state_dict(keep_vars=True)
    shard_bytes = sum(local_numel(sd[n]) * 2 for n in report.loaded_keys if n in sd)
    return {"bad": bad, "bytes_read": report.bytes_read, "shard_bytes": shard_bytes, "deferred": report.deferred,
            "placements": len(placements)}


def scenario_fail_on_rank2(ctx: dict) -> dict:
    import dist_models as dm

    from loader import Convert, load_hf_checkpoint

    rank = dist.get_rank()

    def norm(w):  # noqa: ANN001, ANN202
        if rank == 2:
            raise RuntimeError("this rule only breaks on rank 2")
        return w

    model = dm.Layout()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(7.0)
    rules = [r for r in dm.RULES if "norm" not in repr(r)] + [Convert("norm_src", "norm", norm)]
    t0 = time.time()
    try:
        load_hf_checkpoint(model, ctx["layout_path"], weights_mapping=rules, progress=False)
        outcome = "no error"
    except BaseException as e:  # noqa: BLE001
        outcome = f"{type(e).__name__}: {e}"
    unchanged = all(bool((p == 7.0).all()) for p in model.parameters())
    return {"outcome": outcome, "seconds": time.time() - t0, "unchanged": unchanged}


def scenario_broadcast(ctx: dict, use_dcp: bool = False) -> dict:
    import dist_models as dm

    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    model = dm.Layout()
    if use_dcp:
        import torch.distributed.checkpoint as dcp

        planner = HFLoadPlanner(model, weights_mapping=dm.RULES, broadcast_replicated_tensors=True)
        dcp.load(planner.state_dict_for_load(), storage_reader=SafetensorsReader(ctx["layout_path"]),
                 planner=planner)
        report = planner.finish(ctx["layout_path"])
    else:
        report = load_hf_checkpoint(model, ctx["layout_path"], weights_mapping=dm.RULES, progress=False,
                                    broadcast_replicated_tensors=True)
    expected = torch.load(ctx["layout_ref"])
    bad = [n for n, t in model.state_dict().items() if not torch.equal(t, expected[n])]
    totals = [None] * dist.get_world_size()
    dist.all_gather_object(totals, report.bytes_read)
    return {"bad": bad, "bytes_read": report.bytes_read, "total": sum(totals)}


def scenario_simulation(ctx: dict, mesh_shape) -> dict:  # noqa: ANN001
    import dist_models as dm
    from torch.distributed.device_mesh import init_device_mesh

    from loader import load_hf_checkpoint
    from loader.simulate import simulate_load

    mesh = init_device_mesh("cpu", mesh_shape)
    model = shard_model(dm.Layout(), mesh, layout_placements(mesh_shape))
    figures = simulate_load(model, ctx["layout_path"], weights_mapping=dm.RULES)
    report = load_hf_checkpoint(model, ctx["layout_path"], weights_mapping=dm.RULES, progress=False)
    mine = figures[dist.get_rank()]
    return {"sim_blocks": mine.blocks, "sim_bytes": mine.bytes_read, "blocks": report.blocks,
            "bytes_read": report.bytes_read, "ranks": len(figures)}


SCENARIOS = [
    ("layout_1d", lambda ctx: scenario_layout(ctx, (4,))),
    ("layout_2d", lambda ctx: scenario_layout(ctx, (2, 2))),
    ("layout_dcp_2d", lambda ctx: scenario_layout(ctx, (2, 2), use_dcp=True)),
    ("moe_1d", lambda ctx: scenario_moe(ctx, (4,))),
    ("moe_2d", lambda ctx: scenario_moe(ctx, (2, 2))),
    ("moe_dcp_1d", lambda ctx: scenario_moe(ctx, (4,), use_dcp=True)),
    ("fail_on_rank2", scenario_fail_on_rank2),
    ("broadcast", scenario_broadcast),
    ("broadcast_dcp", lambda ctx: scenario_broadcast(ctx, use_dcp=True)),
    ("simulation_2d", lambda ctx: scenario_simulation(ctx, (2, 2))),
]


def run_rank(rank: int, world: int, ctx: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{ctx['store']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = {}
    for name, fn in SCENARIOS:
        t0 = time.time()
        try:
            results[name] = {"ok": True, **fn(ctx)}
        except BaseException:  # noqa: BLE001
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["wall"] = time.time() - t0
        dist.barrier()
    torch.save(results, os.path.join(ctx["out"], f"rank{rank}.pt"))
    dist.destroy_process_group()


