"""One rank of the 4-rank gloo world of tests/test_formats_remote.py: a llama sharded TP (q/k/v/gate/up rows,
o/down columns, the embedding's columns) loads each format (``.bin``, DCP, int4) from the local folder, nginx, moto's
S3 and the Hub-like nginx; each rank's shards are compared with the same rank's local load and the gathered
tensors with the one-process load (``python formats_remote_worker.py RANK WORLD CTX_JSON``)."""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":  # before huggingface_hub reads its constants: the Hub-like nginx, online
    os.environ.update(HF_ENDPOINT=json.loads(sys.argv[3])["hf_endpoint"], HF_HUB_OFFLINE="0")

import torch
from dist_worker import check_full
from gloo_world import worker_main

from loader.options import LoadOptions, StorageOptions
from loader.placements import placements_matching, shard_module

FORMATS = ("bin", "dcp", "int4")
SCHEMES = ("local", "http", "s3", "hf")


def _model(ctx: dict):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ctx["local"]["bin"])
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    patterns = {"*o_proj.weight": [Shard(1)], "*down_proj.weight": [Shard(1)], "*_proj.weight": [Shard(0)]}
    patterns["*embed_tokens.weight"] = [Shard(1)]
    return shard_module(model, init_device_mesh("cpu", (4,)), placements_matching(model, patterns))


def _shards(model) -> dict[str, torch.Tensor]:
    return {n: getattr(t.data, "_local_tensor", t.data).clone() for n, t in model.state_dict(keep_vars=True).items()}


#: ``{format: (this rank's shards of the local load, its report)}``: each format's local load, once per rank
_LOCAL: dict[str, tuple[dict[str, torch.Tensor], object]] = {}


def _local_load(ctx: dict, fmt: str, quiet: LoadOptions) -> tuple[dict[str, torch.Tensor], object]:
    """This rank's shards of ``fmt``'s local load and its report: the reference of each of the format's schemes
    (its ``local`` scenario, the first of them, loads it)."""
    from loader import load_hf_checkpoint

    if fmt not in _LOCAL:
        local = _model(ctx)
        report = load_hf_checkpoint(local, ctx["local"][fmt], options=quiet)
        _LOCAL[fmt] = _shards(local), report
    return _LOCAL[fmt]


def scenario(ctx: dict, fmt: str, scheme: str) -> dict:
    from loader import load_hf_checkpoint

    quiet = LoadOptions(progress=False, timeout=60)
    want, local_report = _local_load(ctx, fmt, quiet)
    import torch.distributed as dist

    agent = f"regiontrace-{fmt}-rank{dist.get_rank()}"  # this rank's requests in nginx's log
    storage = StorageOptions(backend=ctx["s3_backend"]) if scheme == "s3" else None
    if scheme == "http":
        storage = StorageOptions(backend={"headers": {"User-Agent": agent}})
    model = _model(ctx)
    report = load_hf_checkpoint(model, ctx[scheme][fmt], options=quiet, storage=storage)
    got = _shards(model)
    return {
        "unequal": [n for n in want if not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))],
        "bad": check_full(model, torch.load(ctx["ref"][fmt])),
        "bytes_read": report.bytes_read,
        "planned_bytes": report.planned_bytes,
        "bytes_exchanged": report.bytes_exchanged,
        "requests": report.requests,
        "local_planned": local_report.planned_bytes,
        "total_bytes": ctx["total"][fmt],
        "agent": agent,
    }


def _scenario(fmt: str, scheme: str):
    return lambda ctx: scenario(ctx, fmt, scheme)


SCENARIOS = [(f"{fmt}_{scheme}", _scenario(fmt, scheme)) for fmt in FORMATS for scheme in SCHEMES]

if __name__ == "__main__":  # run by tests/test_formats_remote.py
    worker_main(SCENARIOS, lost_a_rank=False)
