"""A replay's closing verdict (``loader.distributed.ballot.Ballot``) when a rank fails, is late or dies before it,
on a 4-rank gloo world (this file is also the worker: ``python test_transfer_replay_faults.py RANK WORLD CTX``).

Oracles: the destination's local shards before the failed run (put back bit for bit), a fresh ``transfer_weights``
(a replay after a failed one), and the store's keys (a ballot's keys gone once the next one is past).
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import transfer_models as tm
from gloo_world import ok, run_world, worker_main

from loader.options import TransferOptions

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

LATE, KILLED = 1, 2
TIMEOUT = 4


def _locals(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from loader.placements import slot_for

    return {n: slot_for(n, t).local.detach().clone() for n, t in model.state_dict(keep_vars=True).items()}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [n for n in a if not torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8))]


def _step(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.75).add_(0.5)


def _outcome(call) -> dict:
    from loader.errors import PeerFailure

    try:
        call()
        return {"type": None}
    except BaseException as e:
        out = {"type": type(e).__name__, "message": str(e)}
        if isinstance(e, PeerFailure):
            out |= {"reason": e.reason, "ranks": list(e.ranks)}
        return out


def _prepared(rank: int, on_last_round):
    """The FSDP -> EP x TP pair prepared (rollback on, many rounds); ``on_last_round()`` runs on this rank after
    the last round of the second run (before its verdict)."""
    import transfer_worker as tw

    from loader.transfer import prepare_transfer

    src, dst, calls = tw.source_model(tw.MESHES["world"]), tw.dest_model(tw.MESHES["2x2"], ep=True), []

    def progress(done: int, total: int) -> None:
        calls.append(done)
        if total < len(calls) <= 2 * total and done == total:
            on_last_round()

    options = TransferOptions(timeout=TIMEOUT, bucket_bytes=8192, rollback=True, progress=progress)
    return src, dst, prepare_transfer(src, dst, dst_mapping=tm.rules(), options=options)


def scenario_ballot_keys(ctx: dict) -> dict:
    """Three ballots, a collective between each (as a replay's check): the second fails on rank 3 and is raised on
    every rank as rank 3's error; past the third, the first two's keys are gone and the third's remain."""
    import torch.distributed as dist

    from loader.distributed.ballot import Ballot

    rank, world = dist.get_rank(), dist.get_world_size()
    ballot = Ballot(30)
    outcomes = []
    for n in range(3):
        error = ValueError(f"ballot {n} failed on rank {rank}") if n == 1 and rank == 3 else None
        outcomes.append(_outcome(lambda e=error, n=n: ballot.agree(e, "transferring", n)))
        dist.barrier()
    present = {key: ballot.store.check([key]) for n in range(3) for key in [f"{n}/{r}" for r in range(world)]}
    verdicts = {f"{n}/verdict": ballot.store.check([f"{n}/verdict"]) for n in range(3)}
    return {"outcomes": outcomes, "present": present, "verdicts": verdicts}


def scenario_late_rank(ctx: dict) -> dict:
    """Rank 1 reaches the second run's verdict only after the others gave up waiting for it: every rank raises a
    PeerFailure naming rank 1 (rank 1 too: it came too late) and puts its destination back; the next run replays
    right on every rank."""
    import torch.distributed as dist
    import transfer_worker as tw

    from loader.transfer import transfer_weights

    rank = dist.get_rank()
    gave_up = [os.path.join(ctx["out"], f"gave_up_{r}") for r in range(dist.get_world_size()) if r != LATE]

    def wait_for_the_others() -> None:
        if rank == LATE:
            deadline = time.monotonic() + 120
            while not all(map(os.path.exists, gave_up)) and time.monotonic() < deadline:
                time.sleep(0.05)

    src, dst, prepared = _prepared(rank, wait_for_the_others)
    prepared.run(src, dst)
    before = _locals(dst)
    _step(src)
    failed = _outcome(lambda: prepared.run(src, dst))
    if rank != LATE:
        open(os.path.join(ctx["out"], f"gave_up_{rank}"), "w").close()
    restored = _differ(before, _locals(dst))
    after = prepared.run(src, dst)
    fresh = tw.dest_model(tw.MESHES["2x2"], ep=True)
    transfer_weights(src, fresh, dst_mapping=tm.rules(), options=TransferOptions(timeout=60))
    return {"failed": failed, "restored": restored, "planned": after.planned,
            "version": after.version, "mismatch": _differ(_locals(dst), _locals(fresh))}  # fmt: skip


def scenario_dead_rank(ctx: dict) -> dict:
    """Rank 2 is SIGKILLed after the second run's last round, before its verdict: the others raise a PeerFailure
    naming rank 2 within the timeout and put their destination back."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def die() -> None:
        if rank == KILLED:
            os.kill(os.getpid(), signal.SIGKILL)

    src, dst, prepared = _prepared(rank, die)
    prepared.run(src, dst)
    before = _locals(dst)
    _step(src)
    failed = _outcome(lambda: prepared.run(src, dst))
    return {"failed": failed, "restored": _differ(before, _locals(dst))}


SCENARIOS = [
    ("ballot_keys", scenario_ballot_keys),
    ("late_rank", scenario_late_rank),
    ("dead_rank", scenario_dead_rank),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("transfer_replay_faults")
    return run_world(__file__, root, str(root), {"store": str(root / "store"), "out": str(root)})


def test_a_ballot_raises_a_failure_everywhere_and_keeps_one_ballots_keys(results):
    for res in ok(results, "ballot_keys"):
        first, failed, third = res["outcomes"]
        assert first["type"] is None and third["type"] is None
        assert failed["type"] == "ValueError" and "ballot 1 failed on rank 3" in failed["message"], failed
        assert [k for k, here in res["present"].items() if here] == ["2/0", "2/1", "2/2", "2/3"], res["present"]
        assert res["verdicts"] == {"0/verdict": False, "1/verdict": False, "2/verdict": True}


def test_a_rank_late_to_the_verdict_fails_every_rank_and_all_roll_back(results):
    for r, res in enumerate(ok(results, "late_rank")):
        failed = res["failed"]
        assert failed["type"] == "PeerFailure" and failed["reason"] == "timeout" and failed["ranks"] == [LATE], failed
        if r == LATE:
            assert "this rank (1) finished" in failed["message"], failed
        else:
            assert "rank(s) 1 did not finish" in failed["message"], failed
        assert res["restored"] == [], (r, res["restored"])
        assert res["planned"] is False and res["version"] == 3
        assert res["mismatch"] == [], (r, res["mismatch"])


def test_a_rank_that_dies_before_the_verdict_is_named_and_the_others_roll_back(results):
    lived = [res for r, res in enumerate(results) if r != KILLED]
    for res in lived:
        assert res["dead_rank"]["ok"], res["dead_rank"].get("error")
        failed = res["dead_rank"]["failed"]
        assert failed["type"] == "PeerFailure" and failed["ranks"] == [KILLED], failed
        assert res["dead_rank"]["restored"] == []


if __name__ == "__main__":  # run by the fixture above: test_transfer_replay_faults.py RANK WORLD CTX_JSON
    import transfer_worker as tw

    worker_main(SCENARIOS, setup=tw._meshes)
