"""One rank of the 4-rank gloo world of tests/test_dcp_open_pages.py: ``dcp.save`` of a llama state dict as DTensors
``Shard(0)`` (:func:`dcp_worker.scenario_save`), then ``load_hf_checkpoint`` of that folder into a 2x2 mesh's
``Shard(0)`` of its first dim (half the rows: two of the four chunks of each projection, as resharding to 2 ranks;
norms and ``lm_head`` replicated), checked against the reference; returns the pages the rank's shard lies in and
the pages opening the folder read."""

from __future__ import annotations

import os

import torch
from dcp_worker import scenario_save
from dist_worker import check_full
from gloo_world import worker_main

from loader.options import LoadOptions
from loader.placements import placements_matching, shard_module
from loader.storage import PAGE


def _rows(ctx: dict, rank: int, key: str, rows: int) -> tuple[int, int]:
    """The rows of ``key`` this rank holds: half of a sharded key's (by its mesh row), all of a replicated one's."""
    if key.endswith("_proj.weight") or key.endswith("embed_tokens.weight"):
        half = rows // 2
        return (rank // 2) * half, (rank // 2 + 1) * half
    return 0, rows


def rchar() -> int:
    """Bytes this process's ``read``/``pread`` calls returned so far (``rchar`` of ``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def idle_blobs(checkpoint, ctx: dict, rank: int) -> dict[str, int]:
    """Per file, the chunk blobs none of whose elements this rank's shard needs."""
    idle: dict[str, int] = {}
    for key in checkpoint:
        info = checkpoint[key]
        lo, hi = _rows(ctx, rank, key, info.shape[0])
        for chunk in info.chunks:
            name = os.path.basename(chunk.location)
            idle[name] = idle.get(name, 0) + (max(lo, chunk.box[0][0]) >= min(hi, chunk.box[0][1]))
    return idle


def shard_pages(checkpoint, ctx: dict, rank: int) -> dict[str, set[int]]:
    """The pages of each file holding the elements this rank's shard needs (its page bound)."""
    pages: dict[str, set[int]] = {}
    for key in checkpoint:
        info = checkpoint[key]
        lo, hi = _rows(ctx, rank, key, info.shape[0])
        width = info.dtype.itemsize * (info.shape[1] if len(info.shape) == 2 else 1)
        for chunk in info.chunks:
            a, b = max(lo, chunk.box[0][0]), min(hi, chunk.box[0][1])
            if a < b:
                start = chunk.offset + (a - chunk.box[0][0]) * width
                end = chunk.offset + (b - chunk.box[0][0]) * width
                pages.setdefault(chunk.location, set()).update(range(start // PAGE, -(-end // PAGE)))
    return pages


def scenario_load_x2(ctx: dict) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from loader import load_hf_checkpoint
    from loader.checkpoint import open_checkpoint

    mesh = init_device_mesh("cpu", (2, 2))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ctx["config"]))
    patterns = {"*_proj.weight": [Shard(0), Replicate()], "*embed_tokens.weight": [Shard(0), Replicate()]}
    patterns["*lm_head.weight"] = [Replicate(), Replicate()]
    model = shard_module(model, mesh, placements_matching(model, patterns))
    report = load_hf_checkpoint(model, ctx["path"], options=LoadOptions(progress=False))
    bad = check_full(model, torch.load(ctx["ref"]))
    asked = rchar()
    checkpoint = open_checkpoint(ctx["path"])  # opened again, its modules imported: only its reads counted
    asked = rchar() - asked
    bound = shard_pages(checkpoint, ctx, dist.get_rank())
    opened = checkpoint.opened_pages
    return {
        "bad": bad,
        "bytes_read": report.bytes_read,
        "planned_bytes": report.planned_bytes,
        "shard_bytes": sum(getattr(t, "_local_tensor", t).nbytes for t in model.state_dict().values()),
        "bound_pages": sum(len(p) for p in bound.values()),
        "outside_pages": {
            os.path.basename(f): len(set(opened.get(f, ())) - bound.get(f, set())) for f in checkpoint.files
        },
        "opened_pages": sum(len(p) for p in opened.values()),
        "open_asked": asked,
        "idle_blobs": idle_blobs(checkpoint, ctx, dist.get_rank()),
    }


SCENARIOS = [("save", scenario_save), ("load_x2", scenario_load_x2)]

if __name__ == "__main__":
    worker_main(SCENARIOS, lost_a_rank=False)
