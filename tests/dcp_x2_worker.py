"""One rank of the 4-rank gloo world of tests/test_dcp_open_pages.py: ``dcp.save`` of a llama state dict as DTensors
``Shard(0)`` (:func:`dcp_worker.scenario_save`), then ``load_hf_checkpoint`` of that folder into a 2x2 mesh's
``Shard(0)`` of its first dim (half the rows: two of the four chunks of each projection, as resharding to 2 ranks;
norms and ``lm_head`` replicated), checked against the reference; returns the pages the rank's shard lies in, the
pages opening the folder read (none) and the pages finding the places of the chunks it reads read."""

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


def _needed(lo: int, hi: int, chunk) -> bool:
    return max(lo, chunk.box[0][0]) < min(hi, chunk.box[0][1])


def blob_pages(checkpoint, ctx: dict, rank: int) -> tuple[dict[str, set[int]], dict[str, set[int]]]:
    """Per file, the pages of the chunk blobs this rank's shard needs something of, and of those it needs nothing
    of (a page two blobs share: in both)."""
    needed: dict[str, set[int]] = {}
    idle: dict[str, set[int]] = {}
    for key in checkpoint:
        info = checkpoint.tensors[key]
        lo, hi = _rows(ctx, rank, key, info.shape[0])
        for chunk in info.chunks:
            blob = chunk.spec.blob
            side = needed if _needed(lo, hi, chunk) else idle
            pages = range(blob.offset // PAGE, -(-(blob.offset + blob.length) // PAGE))
            side.setdefault(chunk.location, set()).update(pages)
    return needed, idle


def needed_blobs(checkpoint, ctx: dict, rank: int) -> dict[str, int]:
    """Per file, the chunk blobs this rank's shard needs something of."""
    count: dict[str, int] = {}
    for key in checkpoint:
        info = checkpoint.tensors[key]
        lo, hi = _rows(ctx, rank, key, info.shape[0])
        for chunk in info.chunks:
            if _needed(lo, hi, chunk):
                name = os.path.basename(chunk.location)
                count[name] = count.get(name, 0) + 1
    return count


def idle_found(checkpoint, ctx: dict, rank: int) -> list[str]:
    """The chunks this rank's shard needs nothing of whose place was found (their blob read)."""
    out = []
    for key in checkpoint:
        info = checkpoint.tensors[key]
        lo, hi = _rows(ctx, rank, key, info.shape[0])
        out += [f"{key} {c.box}" for c in info.chunks if not _needed(lo, hi, c) and c.found]
    return out


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
    open_checkpoint(ctx["path"])  # its modules imported: only the open's own reads counted below
    asked = rchar()
    checkpoint = open_checkpoint(ctx["path"])
    asked = rchar() - asked
    opened = {f: set(p) for f, p in checkpoint.opened_pages.items()}
    report = load_hf_checkpoint(model, checkpoint, options=LoadOptions(progress=False))
    bad = check_full(model, torch.load(ctx["ref"]))
    bound = shard_pages(checkpoint, ctx, dist.get_rank())
    found = checkpoint.opened_pages  # the pages read to find the places of the chunks the load read
    needed, idle = blob_pages(checkpoint, ctx, dist.get_rank())
    return {
        "bad": bad,
        "bytes_read": report.bytes_read,
        "planned_bytes": report.planned_bytes,
        "shard_bytes": sum(getattr(t, "_local_tensor", t).nbytes for t in model.state_dict().values()),
        "opened_at_open": sum(len(p) for p in opened.values()),
        "open_asked": asked,
        "found_pages": sum(len(p) for p in found.values()),
        "outside_pages": {os.path.basename(f): len(set(found.get(f, ())) - bound.get(f, set())) for f in needed},
        "needed_blobs": needed_blobs(checkpoint, ctx, dist.get_rank()),
        "idle_read": {
            os.path.basename(f): sorted(set(found.get(f, ())) & (idle[f] - needed.get(f, set()))) for f in idle
        },
        "stray": {os.path.basename(f): sorted(p - needed.get(f, set())) for f, p in found.items()},
        "idle_blob_pages": sum(len(idle[f] - needed.get(f, set())) for f in idle),
        "idle_found": idle_found(checkpoint, ctx, dist.get_rank()),
    }


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


#: the key whose first chunk's blob :func:`scenario_spoilt` spoils: rows only the first mesh row (ranks 0, 1) need
SPOILT = "model.layers.0.self_attn.q_proj.weight"


def scenario_spoilt(ctx: dict) -> dict:
    """The x2 load again, after rank 0 overwrote the end-of-central-directory record of :data:`SPOILT`'s first
    chunk's blob: the error and whether the rank's model tensors are as they were before the load."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from transformers import AutoConfig, AutoModelForCausalLM

    from loader import load_hf_checkpoint
    from loader.checkpoint import open_checkpoint

    if dist.get_rank() == 0:
        chunk = open_checkpoint(ctx["path"]).tensors[SPOILT].split[0]
        with open(chunk.location, "r+b") as f:
            f.seek(chunk.spec.blob.offset + chunk.spec.blob.length - 22)
            f.write(b"\0" * 22)
    dist.barrier()
    mesh = init_device_mesh("cpu", (2, 2))
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(ctx["config"]))
    patterns = {"*_proj.weight": [Shard(0), Replicate()], "*embed_tokens.weight": [Shard(0), Replicate()]}
    patterns["*lm_head.weight"] = [Replicate(), Replicate()]
    model = shard_module(model, mesh, placements_matching(model, patterns))
    before = {n: getattr(t, "_local_tensor", t).clone() for n, t in model.state_dict().items()}
    checkpoint = open_checkpoint(ctx["path"])
    try:
        load_hf_checkpoint(model, checkpoint, options=LoadOptions(progress=False))
        error = None
    except Exception as e:
        error = {"type": type(e).__name__, "key": getattr(e, "key", None), "message": str(e)}
    after = {n: getattr(t, "_local_tensor", t) for n, t in model.state_dict().items()}
    lo, hi = _rows(ctx, dist.get_rank(), SPOILT, checkpoint.tensors[SPOILT].shape[0])
    return {
        "error": error,
        "needs_it": _needed(lo, hi, checkpoint.tensors[SPOILT].split[0]),
        "changed": [n for n in before if not torch.equal(_bits(before[n]), _bits(after[n]))],
    }


SCENARIOS = [("save", scenario_save), ("load_x2", scenario_load_x2), ("spoilt", scenario_spoilt)]

if __name__ == "__main__":
    worker_main(SCENARIOS, lost_a_rank=False)
