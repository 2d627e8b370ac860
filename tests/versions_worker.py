"""One rank of tests/test_remote_versions.py's gloo world: the ranks of one load from a URL read one version of
every file (``python versions_worker.py RANK WORLD CTX_JSON``, run by ``gloo_world.run_world``).

Where an object is to change between two ranks' header reads, rank 0 loads at once while the others wait until it
has posted its identities (its ``loader`` log says so); rank 1 then changes the object (overwrites it in S3, moves
the Hub branch) and ranks 1-3 load after it: every one of them has read the new version before rank 0's identities
reach it, deterministically."""

from __future__ import annotations

import logging
import os

import torch
from gloo_world import worker_main
from torch import nn

from loader.options import LoadOptions, RemoteOptions, StorageOptions

N = 64
POSTED = "rank 0: posted the identities"


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.zeros(N, N))
        self.b = nn.Parameter(torch.zeros(N, N))


class _Posted(logging.Handler):
    """On rank 0: sets ``key`` in the world's store once the load posted its identities."""

    def __init__(self, key: str) -> None:
        super().__init__(logging.DEBUG)
        self.key = key

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(POSTED):
            from loader._torch import default_store

            default_store().set(self.key, "1")


def _load(url: str, options: dict, *, dcp: bool = False) -> dict:
    """Load ``url`` into a :class:`Pair` with the backend settings ``options`` (``dcp``: through ``dcp.load`` with
    ``HFLoadPlanner`` and ``SafetensorsReader``): ``{"values": the model's, "error": the message or ""}``."""
    import torch.distributed.checkpoint as torch_dcp

    from loader import HFLoadPlanner, SafetensorsReader, load_hf_checkpoint

    model = Pair()
    storage = StorageOptions(backend=options, remote=RemoteOptions(retries=1, backoff=0.01))
    try:
        if dcp:
            planner = HFLoadPlanner(model)
            reader = SafetensorsReader(url, storage=storage)
            torch_dcp.load(planner.state_dict_for_load(), storage_reader=reader, planner=planner)
        else:
            load_hf_checkpoint(model, url, options=LoadOptions(progress=False), storage=storage)
        error = ""
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return {"values": {k: v.detach().clone() for k, v in model.state_dict().items()}, "error": error}


def _after_rank_zero_posted(name: str, change, url: str, options: dict, *, dcp: bool = False) -> dict:
    """Rank 0 loads; once it posted its identities rank 1 calls ``change()``, then ranks 1-3 load."""
    import torch.distributed as dist

    from loader._torch import default_store

    rank, store = dist.get_rank(), default_store()
    posted, changed = f"test/{name}/posted", f"test/{name}/changed"
    if rank == 0:
        handler, logger = _Posted(posted), logging.getLogger("loader")
        level = logger.level
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG)
        try:
            return _load(url, options, dcp=dcp)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
    store.wait([posted])
    if rank == 1:
        change()
        store.set(changed, "1")
    store.wait([changed])
    return _load(url, options, dcp=dcp)


def scenario_http(ctx: dict, path: str) -> dict:
    """The fault server answers rank 1 with another version of ``path`` (the test set its mode)."""
    import torch.distributed as dist

    headers = {"X-Rank": str(dist.get_rank())}
    return _load(f"{ctx['faults']}{path}", {"headers": headers})


def scenario_s3(ctx: dict, bucket: str, prefix: str = "pair", *, dcp: bool = False) -> dict:
    """``s3://bucket/{prefix}/model.safetensors`` overwritten by v2 between rank 0's header read and the others'."""
    import servers

    def overwrite() -> None:
        with open(ctx["v2"], "rb") as f:
            servers.s3_client(ctx["s3"]).put_object(Bucket=bucket, Key=f"{prefix}/model.safetensors", Body=f.read())

    options = {"endpoint_url": ctx["s3"], **ctx["s3_keys"]}
    return _after_rank_zero_posted(f"s3_{bucket}_{prefix}", overwrite, f"s3://{bucket}/{prefix}", options, dcp=dcp)


def scenario_hub(ctx: dict) -> dict:
    """``hf://org/pair``'s ``main`` moved from commit A to B between rank 0's header reads and the others'."""

    def move() -> None:
        link = os.path.join(ctx["hub_repo"], "main")
        os.symlink(ctx["commit_b"], link + ".moving")
        os.replace(link + ".moving", link)

    os.environ.update({"HF_ENDPOINT": ctx["hub"], "HF_HUB_OFFLINE": "0"})
    return _after_rank_zero_posted("hub", move, "hf://org/pair", {})


SCENARIOS = [
    ("http_if_match", lambda ctx: scenario_http(ctx, "/plain/strong/model.safetensors")),
    ("http_constant_etag", lambda ctx: scenario_http(ctx, "/plain/constant/model.safetensors")),
    ("s3_versioned", lambda ctx: scenario_s3(ctx, ctx["versioned"])),
    ("s3_unversioned", lambda ctx: scenario_s3(ctx, ctx["unversioned"])),
    ("s3_versioned_dcp", lambda ctx: scenario_s3(ctx, ctx["versioned"], "dcp", dcp=True)),
    ("hub_branch_moved", scenario_hub),
]


if __name__ == "__main__":  # run by tests/test_remote_versions.py: versions_worker.py RANK WORLD CTX_JSON
    worker_main(SCENARIOS, lost_a_rank=False)
