"""What a rank reads of a DCP folder it reshards on load: on 4 gloo ranks, a ``Shard(0)`` save (each key in 4 row
chunks, one file per rank) loaded into a 2x2 mesh's ``Shard(0)`` of its first dim (two of the four chunks of each
projection; norms and ``lm_head`` replicated, so a rank needs a little of every file). The load reads exactly the
shard (the load report); opening the folder reads its metadata and no page of a ``.distcp`` file, and finding the
places of the chunks the load reads reads only pages of those chunks' blobs: outside the pages the shard lies in,
a few at each blob's boundaries (its records), and no page of a blob the rank needs nothing of."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dcp_x2_worker
from gloo_world import WORLD, ok, run_world
from hf_models import build

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
        # opening asks for the metadata alone (and the count's own read of /proc/self/io): no page of a .distcp file
        assert res["opened_at_open"] == 0 and metadata <= res["open_asked"] <= metadata + 512, (r, res)
        # no chunk the rank needs nothing of is looked into, though such blobs hold pages of their own
        assert res["idle_found"] == [] and res["idle_blob_pages"] > 0, (r, res)
        assert all(p == [] for p in res["idle_read"].values()), (r, res)
        # every page read to find places is a needed blob's; outside the page bound, its records' few pages
        assert res["found_pages"] > 0 and all(p == [] for p in res["stray"].values()), (r, res)
        for name, outside in res["outside_pages"].items():
            assert outside <= 3 * res["needed_blobs"][name], (r, name, res)
    _spoilt(results)


def _spoilt(results: list[dict]) -> None:
    """A blob only ranks 0 and 1 need is spoilt: its refusal is agreed in planning, so every rank raises the error
    naming its key, and no rank's model was written."""
    spoilt = ok(results, "spoilt")
    assert [res["needs_it"] for res in spoilt] == [True, True, False, False], spoilt
    for r, res in enumerate(spoilt):
        assert res["error"] is not None and res["error"]["type"] == "CheckpointError", (r, res)
        assert res["error"]["key"] == dcp_x2_worker.SPOILT, (r, res)
        assert "end-of-central-directory" in res["error"]["message"], (r, res)
        assert res["changed"] == [], (r, res)
