"""``prepare_transfer`` and ``PreparedTransfer.run``: a transfer planned once and replayed, on a 4-rank gloo world
(this file is also the worker: ``python test_transfer_replay.py RANK WORLD CTX_JSON``) and in one process.

Oracle: a fresh ``transfer_weights`` of the same source into a fresh destination, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import transfer_models as tm
from gloo_world import ok, run_world, worker_main

from loader.options import TransferOptions

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

OPTIONS = {"timeout": 60, "bucket_bytes": 8192}  # many rounds


def _step(model: torch.nn.Module, k: int) -> None:
    """An optimizer-like in-place update of every parameter (the same on every rank)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5 + k / 8).add_(k / 16)


def _locals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from loader.placements import slot_for

    return {n: slot_for(n, t).local.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ (bit for bit)."""
    return [n for n in a if a[n].dtype != b[n].dtype or not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))]


def _fields(report) -> dict:
    keys = ("bytes_sent", "bytes_received", "bytes_local", "messages", "rounds", "planned", "version")
    return {k: getattr(report, k) for k in keys} | {"text": str(report)}


def _outcome(call) -> dict:
    try:
        call()
        return {"type": None}
    except BaseException as e:
        return {"type": type(e).__name__, "message": str(e)}


# -- the worker's scenarios ------------------------------------------------------------------------------------------


def _pairs():
    import transfer_worker as tw

    m = tw.MESHES
    return {
        "fsdp_to_ep_tp": (lambda: tw.source_model(m["world"]), lambda: tw.dest_model(m["2x2"], ep=True), tm.rules()),
        "strided_source": (  # _StridedShard cells: staged in each round
            lambda: tw.source_model(m["2x2"], tm.ep_tp_source_placements), lambda: tw.dest_model(m["world"]),
            tm.rules(),
        ),
        "fallback": (lambda: tw.source_model(m["world"]), lambda: tw.dest_model(m["world"]), tm.rules_with_fallback()),
    }  # fmt: skip


def scenario_replay_after_steps(ctx: dict) -> dict:
    """Prepare once, then run after each of three in-place updates of the source; each run equals a fresh
    ``transfer_weights`` into a fresh destination, bit for bit."""
    from loader.transfer import prepare_transfer, transfer_weights

    out = {}
    for name, (make_src, make_dst, rules) in _pairs().items():
        src, dst = make_src(), make_dst()
        options = TransferOptions(**OPTIONS)
        prepared = prepare_transfer(src, dst, dst_mapping=rules, options=options)
        reports, mismatches = [], []
        for k in range(3):
            if k:
                _step(src, k)
            reports.append(_fields(prepared.run(src, dst)))
            fresh = make_dst()
            oracle = transfer_weights(src, fresh, dst_mapping=rules, options=options)
            mismatches.append(_same(_locals(dst), _locals(fresh)))
        out[name] = {"reports": reports, "oracle": _fields(oracle), "mismatch": mismatches, "plans": prepared.plans}
    return out


def scenario_changed_on_every_rank(ctx: dict) -> dict:
    """The destination replaced by one of other placements: the run plans again on every rank and is right; one
    of another shape: refused on every rank (nothing written), and the prepared transfer plans again next time."""
    import transfer_worker as tw

    from loader.transfer import prepare_transfer, transfer_weights

    m, options = tw.MESHES, TransferOptions(**OPTIONS)
    src = tw.source_model(m["world"])
    prepared = prepare_transfer(src, tw.dest_model(m["2x2"], ep=True), dst_mapping=tm.rules(), options=options)
    other = tw.dest_model(m["world"])
    replanned = _fields(prepared.run(src, other))
    fresh = tw.dest_model(m["world"])
    transfer_weights(src, fresh, dst_mapping=tm.rules(), options=options)
    mismatch = _same(_locals(other), _locals(fresh))
    wrong = tw.dest_model(m["world"], model=tm.Engine(vocab=tm.V + 2))
    refused = _outcome(lambda: prepared.run(src, wrong))
    again = _fields(prepared.run(src, other))
    return {
        "replanned": replanned, "mismatch": mismatch, "refused": refused, "unchanged": tw.unchanged(wrong),
        "again": again, "plans": prepared.plans,
    }  # fmt: skip


def scenario_one_rank_differs(ctx: dict) -> dict:
    """Rank 3 alone gives its destination tensor ``a`` new memory: every rank plans again, and the values land in
    the new memory. Then rank 1 alone holds its shard of ``b`` in bfloat16: refused on every rank."""
    import torch.distributed as dist
    import transfer_worker as tw
    from torch.distributed.tensor import DTensor, Shard

    from loader.transfer import prepare_transfer

    mesh, rank, options = tw.MESHES["world"], dist.get_rank(), TransferOptions(timeout=60)
    src = tw.sharded(tm.Pair(), mesh)
    dst = tw.sharded(tm.Pair(values=False), mesh, fill=-1.0)
    prepared = prepare_transfer(src, dst, options=options)
    first = _fields(prepared.run(src, dst))
    if rank == 3:
        dst.a = torch.nn.Parameter(DTensor.from_local(torch.full((2, 8), -1.0), mesh, [Shard(0)]))
    moved = _fields(prepared.run(src, dst))
    values = _same(_locals(dst), _locals(tw.sharded(tm.Pair(), mesh)))
    replayed = _fields(prepared.run(src, dst))
    if rank == 1:
        local = torch.full((2, 8), -1.0, dtype=torch.bfloat16)
        dst.b = torch.nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)]))
    refused = _outcome(lambda: prepared.run(src, dst))
    return {"first": first, "moved": moved, "mismatch": values, "replayed": replayed, "refused": refused}


def scenario_a_failure_in_a_replay(ctx: dict) -> dict:
    """Rank 1's progress callback raises after the last round of the second run: every rank raises rank 1's error
    (agreed at the run's closing flags, not a timeout), puts its destination back, and the next run replays right."""
    import torch.distributed as dist

    from loader.transfer import prepare_transfer, transfer_weights

    rank, (make_src, make_dst, rules) = dist.get_rank(), _pairs()["fsdp_to_ep_tp"]
    src, dst, calls = make_src(), make_dst(), []

    def progress(done: int, total: int) -> None:
        calls.append(done)
        if rank == 1 and len(calls) > total and done == total and len(calls) <= 2 * total:
            raise ValueError(f"progress failed on rank {rank} after round {done}")

    options = TransferOptions(**OPTIONS, rollback=True, progress=progress)
    prepared = prepare_transfer(src, dst, dst_mapping=rules, options=options)
    prepared.run(src, dst)
    before = _locals(dst)
    _step(src, 1)
    failed = _outcome(lambda: prepared.run(src, dst))
    restored = _same(before, _locals(dst))
    after = _fields(prepared.run(src, dst))
    fresh = make_dst()
    transfer_weights(src, fresh, dst_mapping=rules, options=TransferOptions(**OPTIONS))
    return {"failed": failed, "restored": restored, "after": after, "mismatch": _same(_locals(dst), _locals(fresh)),
            "plans": prepared.plans}  # fmt: skip


SCENARIOS = [
    ("replay_after_steps", scenario_replay_after_steps),
    ("changed_on_every_rank", scenario_changed_on_every_rank),
    ("one_rank_differs", scenario_one_rank_differs),
    ("failure_in_a_replay", scenario_a_failure_in_a_replay),
]


# -- the tests -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer_replay")
    ctx = {"store": str(root / "store"), "out": str(root)}
    return run_world(__file__, root, str(root), ctx, expected_codes=[0] * 4)


def test_a_replay_after_in_place_steps_equals_a_fresh_transfer(results):
    for per_rank in ok(results, "replay_after_steps"):
        for name in ("fsdp_to_ep_tp", "strided_source", "fallback"):
            res = per_rank[name]
            assert res["mismatch"] == [[], [], []], (name, res["mismatch"])
            assert [r["version"] for r in res["reports"]] == [1, 2, 3]
            assert [r["planned"] for r in res["reports"]] == [False] * 3 and res["plans"] == 1
            assert res["oracle"]["planned"] is True and res["oracle"]["version"] == 1
            counted = ("bytes_sent", "bytes_received", "bytes_local", "messages", "rounds")
            assert all(r[k] == res["oracle"][k] for r in res["reports"] for k in counted), name
            assert "replayed, version 3" in res["reports"][2]["text"]


def test_changed_placements_plan_again_and_a_wrong_shape_is_refused_on_every_rank(results):
    for res in ok(results, "changed_on_every_rank"):
        assert res["replanned"]["planned"] is True and res["replanned"]["version"] == 1
        assert res["mismatch"] == []
        assert res["refused"]["type"] == "ValueError" and "shape mismatch" in res["refused"]["message"]
        assert res["unchanged"]
        assert res["again"]["planned"] is True and res["again"]["version"] == 3 and res["plans"] == 3


def test_one_rank_that_differs_is_seen_by_every_rank(results):
    for res in ok(results, "one_rank_differs"):
        assert res["first"]["planned"] is False
        assert res["moved"]["planned"] is True and res["moved"]["version"] == 2
        assert res["mismatch"] == []
        assert res["replayed"]["planned"] is False and res["replayed"]["version"] == 3
        assert res["refused"]["type"] == "ValueError" and "differently" in res["refused"]["message"]


def test_a_failure_during_a_replay_is_raised_on_every_rank_and_rolled_back(results):
    for r, res in enumerate(ok(results, "failure_in_a_replay")):
        assert res["failed"]["type"] == "ValueError", (r, res["failed"])
        assert "progress failed on rank 1 after round" in res["failed"]["message"], (r, res["failed"])
        assert res["restored"] == [], (r, res["restored"])
        assert res["after"]["planned"] is False and res["after"]["version"] == 3 and res["plans"] == 1
        assert res["mismatch"] == [], (r, res["mismatch"])


def test_one_process_replay_and_fingerprint():
    """Without a process group: a replay after a step equals a fresh transfer; the fingerprint ignores values and
    sees new memory."""
    from hf_models import build

    from loader.transfer import fingerprint, prepare_transfer, transfer_weights

    _, src = build("qwen3_moe", 0, tie_word_embeddings=False)
    dst = tm.Engine()
    prepared = prepare_transfer(src, dst, dst_mapping=tm.rules())
    before = fingerprint(dst)
    _step(src, 1)
    report = prepared.run(src, dst)
    fresh = tm.Engine()
    transfer_weights(src, fresh, dst_mapping=tm.rules())
    assert _same(_locals(dst), _locals(fresh)) == []
    assert fingerprint(dst) == before and not report.planned and report.version == 1
    assert report.run.plan_seconds == 0 and prepared.buffer_bytes >= 0
    dst.model.norm.weight = torch.nn.Parameter(dst.model.norm.weight.detach().clone())
    assert fingerprint(dst) != before
    assert prepared.run(src, dst).planned


if __name__ == "__main__":  # run by the fixture above: test_transfer_replay.py RANK WORLD CTX_JSON
    import transfer_worker as tw

    worker_main(SCENARIOS, setup=tw._meshes, lost_a_rank=False)
