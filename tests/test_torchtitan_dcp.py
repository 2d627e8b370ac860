"""A torchtitan Llama checkpoint (torchtitan's names and q/k row layout, written by ``dcp.save``) loads into a
transformers ``LlamaForCausalLM`` through :func:`torchtitan_llama.rules` (renames, and the adapter's per-head q/k
permutation traced into region reads) bit-identical to ``from_pretrained`` of the same weights converted for real
(torchtitan's ``to_hf``); in one process, and on 4 gloo ranks from DTensor shards saved by each rank into a model
sharded otherwise (tests/torchtitan_worker.py), each rank reading only its shards' bytes."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torchtitan_llama as tt
from hf_models import build

from loader import Rules, load_hf_checkpoint
from loader.options import LoadOptions

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
QUIET = LoadOptions(progress=False)
BF16 = torch.bfloat16
#: a Llama with separate output weights (torchtitan's ``output``), 4 query heads over 2 key/value heads
SIZE = dict(tie_word_embeddings=False, hidden_size=64, intermediate_size=128, head_dim=16)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def titan_checkpoint(root) -> tuple[dict, dict]:
    """``(torchtitan's state, transformers' state converted for real)`` of a random llama; the converted state
    saved as a transformers folder ``root/hf`` (config included)."""
    from safetensors.torch import save_file

    _, model = build("llama", seed=4, dtype=BF16, **SIZE)
    cfg = model.config
    titan = tt.from_hf(model.state_dict(), cfg.num_attention_heads, cfg.num_key_value_heads)
    converted = tt.to_hf(titan, cfg.num_attention_heads, cfg.num_key_value_heads)
    os.makedirs(root / "hf", exist_ok=True)
    save_file(converted, str(root / "hf" / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(root / "hf")
    return titan, converted


def titan_rules(model) -> Rules:
    return Rules(weights_mapping=tt.rules(model.config.num_attention_heads, model.config.num_key_value_heads))


def test_the_adapters_permutation_moves_rows_and_inverts(tmp_path):
    """The q/k permutation is not the identity (a load that skipped it would differ) and ``to_hf`` inverts
    ``from_hf``."""
    _, model = build("llama", seed=4, dtype=BF16, **SIZE)
    state = model.state_dict()
    titan, converted = titan_checkpoint(tmp_path)
    assert set(titan) == {tt.FROM_HF[tt.abstract_key(k)[0]].format(tt.abstract_key(k)[1]) for k in state}
    assert "layers.1.feed_forward.w2.weight" in titan and "output.weight" in titan
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(titan["layers.0.attention.wq.weight"], state[q])
    assert all(torch.equal(converted[k], state[k]) for k in state)


def test_titan_dcp_loads_like_from_pretrained_of_the_converted_weights(tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    titan, _ = titan_checkpoint(tmp_path)
    dcp.save({k: v.clone() for k, v in titan.items()}, checkpoint_id=str(tmp_path / "titan"), no_dist=True)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=BF16)
    _, model = build("llama", seed=8, dtype=BF16, **SIZE)
    report = load_hf_checkpoint(model, str(tmp_path / "titan"), rules=titan_rules(model), options=QUIET)
    assert report.missing_keys == () and report.unexpected_keys == () and report.deferred == ()
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for k in theirs:
        assert ours[k].dtype == theirs[k].dtype and torch.equal(bits(ours[k]), bits(theirs[k])), k
    assert report.bytes_read == report.planned_bytes == sum(t.nbytes for t in titan.values())


@pytest.mark.dist
def test_four_ranks_load_titan_shards_into_a_sharded_llama(tmp_path):
    """torchtitan's TP layout saved by 4 gloo ranks (colwise ``wq/wk/wv/w1/w3/output`` ``Shard(0)``, rowwise
    ``wo/w2`` and the embedding ``Shard(1)``, norms replicated), loaded into a llama sharded otherwise (q/k/v rows,
    o/down columns, the embedding's columns): each rank's shards equal its load of the converted folder."""
    import torchtitan_worker
    from gloo_world import WORLD, ok, run_world

    titan, _ = titan_checkpoint(tmp_path)
    torch.save(titan, tmp_path / "titan.pt")
    ctx = {"store": str(tmp_path / "store"), "out": str(tmp_path), "titan": str(tmp_path / "titan.pt")}
    ctx.update(path=str(tmp_path / "ckpt"), hf=str(tmp_path / "hf"))
    results = run_world(torchtitan_worker.__file__, tmp_path, str(tmp_path), ctx, expected_codes=[0] * WORLD)
    ok(results, "save")
    total = sum(t.nbytes for t in titan.values())
    for r, res in enumerate(ok(results, "load")):
        assert res["unequal"] == [] and res["missing"] == () and res["deferred"] == (), (r, res)
        assert res["bytes_read"] == res["planned_bytes"] < total / 2, (r, res, total)
        assert res["planned_bytes"] <= 1.01 * res["shard_bytes"] + res["replicated_bytes"], (r, res)
