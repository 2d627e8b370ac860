"""One rank of the gloo world of tests/test_remote_load.py's distributed tests: a qwen3_moe model sharded TP (mesh 4)
and EP x TP (mesh 2x2) loaded from moto's S3 and nginx, each rank's shards compared with the same rank's shards
loaded from the local folder (``python remote_worker.py RANK WORLD CTX_JSON``, run by ``gloo_world.run_world``)."""

from __future__ import annotations

import os

import torch
from dist_worker import check_full, local_numel, moe_placements
from gloo_world import worker_main

from loader.options import LoadOptions, RemoteOptions, RequestCosts, StorageOptions
from loader.placements import shard_module

WIRE_BOUND = 0.01  # the max_overread of the bounded wire scenario (tests/test_remote_load.py holds the log to it)


def _sharded_model(ctx: dict, mesh_shape: tuple[int, ...], folder: str | None = None):
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder or ctx["local"])
    torch.manual_seed(123)
    model = AutoModelForCausalLM.from_config(cfg)
    mesh = init_device_mesh("cpu", mesh_shape)
    return shard_module(model, mesh, moe_placements(model, mesh_shape))


def _local_shards(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: getattr(t.data, "_local_tensor", t.data).clone() for n, t in model.state_dict(keep_vars=True).items()}


def scenario_remote(ctx: dict, source: str, mesh_shape: tuple[int, ...], *, dcp: bool = False, **kwargs) -> dict:
    """Load ``source`` (``s3_options``, ``s3_env`` or ``http``) into a ``mesh_shape`` sharding; compare each local
    shard with the local folder's load on this rank, and the gathered tensors with the reference."""
    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    local = _sharded_model(ctx, mesh_shape)
    load_hf_checkpoint(local, ctx["local"], options=LoadOptions(progress=False, **kwargs))
    storage = None
    if source == "s3_options":
        url, storage = ctx["s3_url"], StorageOptions(backend={"endpoint_url": ctx["s3"], **ctx["s3_keys"]})
    elif source == "s3_env":
        url = ctx["s3_url"]
        os.environ.update(ctx["s3_env"])
    elif source == "local":
        url = ctx["local"]
    else:
        url = ctx["http_url"]
    model = _sharded_model(ctx, mesh_shape)
    try:
        if dcp:
            import torch.distributed.checkpoint as torch_dcp

            planner = HFLoadPlanner(model)
            reader = SafetensorsReader(url, options=LoadOptions(**kwargs), storage=storage)
            torch_dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner)
            report = planner.finish(reader)
        else:
            report = load_hf_checkpoint(model, url, options=LoadOptions(progress=False, **kwargs), storage=storage)
    finally:
        for key in ctx["s3_env"] if source == "s3_env" else ():
            os.environ.pop(key, None)
    want, got = _local_shards(local), _local_shards(model)
    unequal = [n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))]
    sd = model.state_dict(keep_vars=True)
    return {
        "unequal_shards": unequal,
        "bad": check_full(model, torch.load(ctx["ref"])),
        "bytes_read": report.bytes_read,
        "planned_bytes": report.planned_bytes,
        "requests": report.requests,
        "bytes_exchanged": report.bytes_exchanged,
        "shard_bytes": sum(local_numel(sd[n]) * 2 for n in report.loaded_keys if n in sd),
    }


def scenario_wire(ctx: dict, name: str, costs: RequestCosts | None = None) -> dict:
    """The wire checkpoint (hidden 64, head_dim 128, 8 experts of 2048, 4 MB shards) TP on 4 ranks from nginx with
    exchanged reads and request ``costs``, this rank's requests told apart in the server's log by their User-Agent:
    equal to the local load; what the test holds the log against."""
    import torch.distributed as dist

    from loader import load_hf_checkpoint

    local = _sharded_model(ctx, (4,), ctx["wire_local"])
    load_hf_checkpoint(local, ctx["wire_local"], options=LoadOptions(progress=False))
    model = _sharded_model(ctx, (4,), ctx["wire_local"])
    agent = f"regiontrace-{name}-rank{dist.get_rank()}"
    remote = RemoteOptions(costs=costs or RequestCosts())
    storage = StorageOptions(backend={"headers": {"User-Agent": agent}}, remote=remote)
    report = load_hf_checkpoint(model, ctx["wire_url"], options=LoadOptions(progress=False), storage=storage)
    want, got = _local_shards(local), _local_shards(model)
    sd = model.state_dict(keep_vars=True)
    return {
        "agent": agent,
        "unequal_shards": [n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))],
        "bytes_read": report.bytes_read,
        "bytes_exchanged": report.bytes_exchanged,
        "shard_bytes": sum(local_numel(sd[n]) * sd[n].element_size() for n in report.loaded_keys if n in sd),
    }


SCENARIOS = [
    ("s3_tp4", lambda ctx: scenario_remote(ctx, "s3_options", (4,))),
    ("s3_ep_tp_2x2", lambda ctx: scenario_remote(ctx, "s3_env", (2, 2))),
    ("http_tp4", lambda ctx: scenario_remote(ctx, "http", (4,))),
    ("http_tp4_each_its_own", lambda ctx: scenario_remote(ctx, "http", (4,), exchange_reads=False)),
    ("local_tp4_exchanged", lambda ctx: scenario_remote(ctx, "local", (4,), exchange_reads=True)),
    ("s3_dcp_2x2", lambda ctx: scenario_remote(ctx, "s3_options", (2, 2), dcp=True)),
    ("s3_broadcast_2x2", lambda ctx: scenario_remote(ctx, "s3_options", (2, 2), broadcast_replicated_tensors=True)),
    ("wire_tp4", lambda ctx: scenario_wire(ctx, "wire_tp4")),
    ("wire_tp4_bounded", lambda ctx: scenario_wire(ctx, "wire_tp4_bounded", RequestCosts(max_overread=WIRE_BOUND))),
]


if __name__ == "__main__":  # run by tests/test_remote_load.py: remote_worker.py RANK WORLD CTX_JSON
    worker_main(SCENARIOS, lost_a_rank=False)
