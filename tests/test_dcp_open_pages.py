"""What a rank reads of a DCP folder it reshards on load: on 4 gloo ranks, a ``Shard(0)`` save (each key in 4 row
chunks, one file per rank) loaded into a 2x2 mesh's ``Shard(0)`` of its first dim (two of the four chunks of each
projection; norms and ``lm_head`` replicated, so a rank needs a little of every file). The load reads exactly the
shard (the load report), and opening the folder reads, outside the pages the shard lies in, only the pages at the
boundaries of the chunk blobs the rank needs nothing of (their records): no stretch of another rank's chunk."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dcp_x2_worker
from gloo_world import WORLD, ok, run_world
from hf_models import build

from loader.storage import PAGE

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
#: projections of 64-256 KiB chunks: a blob's records are a page or two beside pages of data
SHAPE = dict(hidden_size=256, intermediate_size=512, vocab_size=1024, tie_word_embeddings=False)


def test_a_rank_resharding_x4_to_x2_reads_within_its_page_bound(tmp_path):
    _, model = build("llama", **SHAPE)
    model.config.save_pretrained(tmp_path / "config")
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tmp_path / "ref.pt")
    ctx = {"store": str(tmp_path / "store"), "out": str(tmp_path), "path": str(tmp_path / "ckpt")}
    ctx.update(ref=str(tmp_path / "ref.pt"), config=str(tmp_path / "config"))
    results = run_world(dcp_x2_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    ok(results, "save")
    metadata = os.path.getsize(tmp_path / "ckpt" / ".metadata")
    for r, res in enumerate(ok(results, "load_x2")):
        assert res["bad"] == [], (r, res)
        # the load reads exactly the shard: the pages it reads are the page bound
        assert res["bytes_read"] == res["planned_bytes"] == res["shard_bytes"], (r, res)
        # opening asks for the metadata and the pages it keeps, each once: nothing read ahead or twice
        assert 0 < res["open_asked"] <= metadata + res["opened_pages"] * PAGE, (r, res)
        # outside the page bound: the pages at an idle blob's ends (its records), not a stretch of its data
        assert 1 <= sum(res["idle_blobs"].values()), (r, res)
        for name, outside in res["outside_pages"].items():
            assert outside <= 3 * res["idle_blobs"][name], (r, name, res)
