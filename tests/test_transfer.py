"""``transfer_weights`` on a shared 4-rank gloo world (tests/transfer_worker.py), and the plan in one process.

Oracle: the destination loaded with ``load_hf_checkpoint`` from the source's ``save_hf_checkpoint`` files, bit
for bit.
"""

from __future__ import annotations

import pytest
import torch
import transfer_models as tm
import transfer_worker
from gloo_world import ok, run_world
from hf_models import build

from loader import load_hf_checkpoint, save_hf_checkpoint, transfer_weights
from loader.options import LoadOptions, Rules, SaveOptions
from loader.transfer import dest_side, model_parts, plan_transfer, rounds, source_side

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]


def _oracle(folder: str, rules: list) -> dict[str, torch.Tensor]:
    model = tm.Engine()
    load_hf_checkpoint(model, folder, rules=Rules(weights_mapping=rules), options=LoadOptions(progress=False))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def source_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer")
    _, model = build("qwen3_moe", 0, tie_word_embeddings=False)
    save_hf_checkpoint(model, str(root / "ckpt"), options=SaveOptions(progress=False))
    return root, model


@pytest.fixture(scope="module")
def results(source_files):
    root, _ = source_files
    torch.save(_oracle(str(root / "ckpt"), tm.rules()), root / "oracle.pt")
    torch.save(_oracle(str(root / "ckpt"), tm.rules_with_fallback()), root / "oracle_fallback.pt")
    ctx = {
        "store": str(root / "store"), "out": str(root), "oracle": str(root / "oracle.pt"),
        "oracle_fallback": str(root / "oracle_fallback.pt"),
    }  # fmt: skip
    return run_world(transfer_worker.__file__, root, str(root), ctx)


@pytest.fixture(scope="module")
def hung_results(source_files, results):
    root, _ = source_files
    out = root / "hung"
    out.mkdir()
    ctx = {"store": str(root / "hung_store"), "out": str(out), "oracle": str(root / "oracle.pt"), "hung": True}
    return run_world(transfer_worker.__file__, out, str(out), ctx)


# -- one process ---------------------------------------------------------------------------------------------------


def test_one_process_transfer_equals_save_then_load(source_files):
    root, source = source_files
    dst = tm.Engine()
    report = transfer_weights(source, dst, dst_mapping=tm.rules())
    oracle = _oracle(str(root / "ckpt"), tm.rules())
    assert all(torch.equal(v, oracle[k]) for k, v in dst.state_dict().items())
    shard = sum(t.numel() * t.element_size() for t in dst.state_dict().values())
    assert report.bytes_received == report.bytes_sent == report.bytes_local == shard
    assert report.messages == 0 and report.fallback == ()
    assert "transfer:" in str(report)


def test_a_rope_permuted_pair(tmp_path):
    """The source keeps q and k rope-permuted (its own ``Convert`` rules, keys from ``source_shapes``), the
    destination fuses them unpermuted beside v: the composition undoes one permutation inside the other."""
    from torch import nn

    from loader import Convert

    class Permuted(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_rot = nn.Parameter(torch.randn(tm.HEADS * tm.D, tm.H))
            self.k_rot = nn.Parameter(torch.randn(tm.KV * tm.D, tm.H))
            self.v = nn.Parameter(torch.randn(tm.KV * tm.D, tm.H))

    class Fused(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Parameter(torch.zeros((tm.HEADS + 2 * tm.KV) * tm.D, tm.H))

    src_rules = [
        Convert("q", "q_rot", lambda w: tm.rope_permute(w, tm.HEADS)),
        Convert("k", "k_rot", lambda w: tm.rope_permute(w, tm.KV)),
        Convert("v", "v", lambda w: w),
    ]
    dst_rules = [Convert(["q", "k", "v"], "qkv", lambda q, k, v: torch.cat([q, k, v]))]
    shapes = {"q": (tm.HEADS * tm.D, tm.H), "k": (tm.KV * tm.D, tm.H), "v": (tm.KV * tm.D, tm.H)}
    torch.manual_seed(0)
    source, dest = Permuted(), Fused()
    report = transfer_weights(source, dest, src_mapping=src_rules, dst_mapping=dst_rules, source_shapes=shapes)
    save_hf_checkpoint(
        source,
        str(tmp_path / "ckpt"),
        source_shapes=shapes,
        rules=Rules(weights_mapping=src_rules),
        options=SaveOptions(progress=False),
    )
    oracle = Fused()
    load_hf_checkpoint(
        oracle, str(tmp_path / "ckpt"), rules=Rules(weights_mapping=dst_rules), options=LoadOptions(progress=False)
    )
    assert torch.equal(dest.qkv, oracle.qkv) and not torch.equal(dest.qkv[: tm.H], source.q_rot)
    assert report.transferred == ("qkv",) and report.bytes_received == dest.qkv.numel() * 4


def test_the_plan_is_a_pure_function_of_meta_models():
    """Planned for 8 simulated ranks from meta models: every destination rank receives exactly its shard."""
    from torch.distributed.tensor import Shard

    with torch.device("meta"):
        _, source = build("qwen3_moe", 0, tie_word_embeddings=False)
        dest = tm.Engine()
    src_side = source_side(source)
    dst_side, _ = dest_side(dest, Rules(weights_mapping=tm.rules()), src_side.keys)

    src = [_parts(source, lambda n, t: Shard(0), r) for r in range(8)]
    dst = [_parts(dest, lambda n, t: Shard(t.ndim - 1), r) for r in range(8)]
    plan = plan_transfer(src_side, dst_side, src, dst)
    for r in range(8):
        want = sum(sum(_numel(g) for g, _ in p[2]) * p[1].itemsize for p in dst[r].values())
        assert plan.bytes_received(r) == want
    assert sum(plan.bytes_sent(r) for r in range(8)) == sum(plan.bytes_received(r) for r in range(8))
    for moves in rounds(plan, 4096):
        for r in range(8):
            assert sum(m.nbytes for m in moves if m.src == r and m.dst != r) <= 4096
    assert model_parts(tm.Engine())["lm_head.weight"][0] == (tm.V, tm.H)


def test_bytes_per_rank_pair_are_what_destinations_need_from_each_source(tmp_path):
    """Independent of the plan: every source element labelled with the rank holding it (FSDP over 8 ranks), the
    labels saved and loaded into the engine through files; per destination rank (TP over 8), the count of each
    label is what the plan moves from that source rank, in bytes: nothing more, nothing twice."""
    from torch.distributed.tensor import Shard

    from loader.plan import box_view

    _, source = build("qwen3_moe", 0, tie_word_embeddings=False)
    dest = tm.Engine()
    src = [_parts(source, lambda n, t: Shard(0), r) for r in range(8)]
    dst = [_parts(dest, lambda n, t: Shard(t.ndim - 1), r) for r in range(8)]
    with torch.no_grad():
        for name, t in source.state_dict().items():
            for r in range(8):
                for g, _ in src[r][name][2]:
                    box_view(t, g).fill_(r)
    save_hf_checkpoint(source, str(tmp_path / "labels"), options=SaveOptions(progress=False))
    labels = _oracle(str(tmp_path / "labels"), tm.rules())
    want: dict[tuple[int, int], int] = {}
    for d in range(8):
        for name, (_, dtype, boxes) in dst[d].items():
            for g, _ in boxes:
                counts = torch.bincount(box_view(labels[name], g).flatten().long(), minlength=8)
                for s in range(8):
                    if counts[s]:
                        want[s, d] = want.get((s, d), 0) + int(counts[s]) * dtype.itemsize
    src_side = source_side(source)
    dst_side, _ = dest_side(dest, Rules(weights_mapping=tm.rules()), src_side.keys)
    assert plan_transfer(src_side, dst_side, src, dst).pair_bytes() == want


def test_a_replicated_source_element_is_sent_once_balanced_over_its_holders():
    """Ranks 0-3 hold the whole source (replicas), ranks 4-7 a TP shard of the engine: each element a destination
    needs is sent once, by one holder, and the holders send about equally."""
    from torch.distributed.tensor import Replicate, Shard

    with torch.device("meta"):
        _, source = build("qwen3_moe", 0, tie_word_embeddings=False)
        dest = tm.Engine()
    src = [_parts(source, lambda n, t: Replicate(), 0) if r < 4 else {} for r in range(8)]
    dst = [{} if r < 4 else _parts(dest, lambda n, t: Shard(t.ndim - 1), r - 4, 4) for r in range(8)]
    src_side = source_side(source)
    dst_side, _ = dest_side(dest, Rules(weights_mapping=tm.rules()), src_side.keys)
    plan = plan_transfer(src_side, dst_side, src, dst)
    shard = [sum(sum(_numel(g) for g, _ in p[2]) * p[1].itemsize for p in parts.values()) for parts in dst]
    assert [plan.bytes_received(r) for r in range(8)] == shard
    sent = [plan.bytes_sent(r) for r in range(4)]
    assert sum(sent) == sum(shard) and max(sent) - min(sent) <= max(m.nbytes for m in plan.moves), sent


def _parts(model, placement, rank, ranks=8):
    from loader.placements import shard_boxes

    return {
        n: (tuple(t.shape), t.dtype, shard_boxes(tuple(t.shape), (ranks,), (rank,), [placement(n, t)]))
        for n, t in model.state_dict().items()
    }


def _numel(box) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def test_a_shape_mismatch_is_refused_before_anything_moves(source_files):
    _, source = source_files
    dst = tm.Engine(vocab=tm.V + 2)
    with pytest.raises(ValueError, match="shape mismatch for destination tensor 'lm_head.weight'"):
        transfer_weights(source, dst, dst_mapping=tm.rules())
    assert all(bool((t == -1).all()) for t in dst.state_dict().values())


def test_a_key_the_source_lacks_is_refused(source_files):
    _, source = source_files
    with pytest.raises(ValueError, match="no checkpoint key in the source's layout"):
        transfer_weights(source, tm.Engine(), dst_mapping=tm.rules()[:2])  # no rule for the experts' down_proj


# -- four ranks -----------------------------------------------------------------------------------------------------


def _check_exact(per_rank: list[dict]) -> None:
    for r, res in enumerate(per_rank):
        assert res["mismatch"] == [], (r, res["mismatch"])
        assert res["report"]["bytes_received"] == res["shard_bytes"], (r, res["report"])
    sent = sum(res["report"]["bytes_sent"] for res in per_rank)
    assert sent == sum(res["shard_bytes"] for res in per_rank)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["colocated_tp", "colocated_ep_tp", "ep_tp_source"])
def test_colocated_fsdp_to_tp_bit_for_bit(results, name):
    """Every rank holds a Shard(0) of the transformers Qwen3-MoE and a TP (or EP x TP, _StridedShard gate_up)
    shard of the fused engine model, or the reverse roles of the meshes (the source EP x TP with replicated
    tensors, the engine TP): each receives exactly its shard bytes, equal to save-then-load."""
    per_rank = ok(results, name)
    _check_exact(per_rank)
    assert all(res["report"]["messages"] > 0 for res in per_rank)


@pytest.mark.dist
def test_disaggregated_two_to_two_bit_for_bit(results):
    """Ranks 0-1 hold the source, 2-3 the destination: only they send, only they receive, in several rounds."""
    per_rank = ok(results, "disaggregated")
    _check_exact(per_rank)
    assert [res["report"]["bytes_received"] > 0 for res in per_rank] == [False, False, True, True]
    assert [res["report"]["bytes_sent"] > 0 for res in per_rank] == [True, True, False, False]
    assert per_rank[0]["report"]["rounds"] > 1
    assert all(res["report"]["bytes_local"] == 0 for res in per_rank)


@pytest.mark.dist
def test_an_untraceable_conversion_falls_back(results):
    for res in ok(results, "fallback"):
        assert res["mismatch"] == []
        assert res["report"]["fallback"] == ("model.norm.weight",)


@pytest.mark.dist
def test_a_shape_mismatch_fails_every_rank_before_sending(results):
    for r, res in enumerate(ok(results, "shape_mismatch")):
        assert res["type"] == "ValueError" and "lm_head.weight" in res["message"], (r, res)
        assert not res["sent"] and res["unchanged"], (r, res)


@pytest.mark.dist
def test_a_hung_rank_fails_every_rank_within_the_timeout_and_rollback_restores(hung_results):
    for r, every in enumerate(hung_results):
        if r == transfer_worker.KILLED:
            continue
        res = every["hung"]
        assert res["ok"], res.get("error")
        assert res["type"] == "PeerFailure", (r, res)
        assert "did not finish transferring" in res["message"], res["message"]
        # the round's 4 s timeout, then the agreement's: the transfer's own timeout naming rank 2 (the process
        # group's would be a "connection" failure after its 120 s)
        assert res["reason"] == "timeout" and res["ranks"] == (transfer_worker.KILLED,), res
        assert res["unchanged"], f"rank {r} was not restored"


@pytest.mark.dist
def test_a_killed_rank_fails_every_rank_and_rollback_restores(results):
    for r, every in enumerate(results):
        if r == transfer_worker.KILLED:
            continue
        res = every["killed"]
        assert res["ok"], res.get("error")
        assert res["type"] == "PeerFailure", (r, res)
        assert res["unchanged"], f"rank {r} was not restored"
        assert res["rounds_run"] >= 2


@pytest.mark.dist
def test_aliased_destination_tensors_are_refused_on_every_rank_and_disjoint_views_work(results):
    """Rank 3's destination ``b`` shares ``a``'s memory: a ValueError naming both on every rank, nothing written;
    ``a`` and ``b`` as disjoint views of one flat buffer receive their (crossed) values."""
    for r, res in enumerate(ok(results, "aliased_destination")):
        assert res["type"] == "ValueError", (r, res)
        assert "destination model tensors 'a' and 'b' overlap in memory" in res["message"], res["message"]
        assert res["unchanged"] and res["flat_crossed"], (r, res)


@pytest.mark.dist
def test_source_ranks_holding_a_tensor_in_different_dtypes_are_refused(results):
    for r, res in enumerate(ok(results, "mixed_source_dtypes")):
        assert res["type"] == "ValueError", (r, res)
        message = res["message"]
        assert "source model tensor 'a' differently" in message, message
        assert "rank 1: a DTensor of shape (8, 8) bfloat16" in message, message
        assert all(f"rank {q}: a DTensor of shape (8, 8) float32" in message for q in (0, 2, 3)), message
        assert res["unchanged"], r


@pytest.mark.dist
def test_a_rank_that_never_calls_fails_the_others_by_the_transfers_timeout(results):
    """Rank 2 calls only once the others gave up: they raise the transfer's own PeerFailure (reason "timeout",
    rank 2 named; the process group's would be a "connection" failure after its 120 s), rank 2 learns it came
    too late."""
    for r, res in enumerate(ok(results, "absent_rank")):
        assert res["type"] == "PeerFailure" and res["reason"] == "timeout", (r, res)
        assert res["ranks"] == (transfer_worker.KILLED,) and res["stage"] == "transferring", (r, res)
        if r == transfer_worker.KILLED:
            assert "this rank (2) finished transferring after the other ranks had stopped" in res["message"], res
        else:
            assert "rank(s) 2 did not finish transferring within the 5 s timeout" in res["message"], res
        assert res["unchanged"], r


@pytest.mark.dist
def test_meta_tensors_are_refused_on_every_rank_naming_the_tensor(results):
    for r, res in enumerate(ok(results, "meta_tensors")):
        src, dst = res["source"], res["dest"]
        assert src["type"] == "ValueError" and "source model tensor 'a' is on the meta device" in src["message"], src
        assert "on rank 1" in src["message"], src
        assert dst["type"] == "ValueError" and "destination model tensor 'a' is on the meta device" in dst["message"]
        assert "on rank 3" in dst["message"], dst
        assert res["unchanged"], r


@pytest.mark.dist
def test_a_model_into_itself_with_a_transposing_rule_is_refused(results):
    for r, res in enumerate(ok(results, "into_itself_transposed")):
        assert res["type"] == "ValueError", (r, res)
        assert "destination model tensor 'a' overlaps source model tensor 'a' in memory" in res["message"], res
        assert res["unchanged"], r


@pytest.mark.dist
def test_zero_element_tensors_transfer(results):
    per_rank = ok(results, "zero_elements")
    for res in per_rank:
        assert res["mismatch"] == [] and res["report"]["bytes_received"] == 3 * 4, res
