"""The session, the collectives and the rollback of a distributed flow (loader/distributed/session.py,
collectives.py; loader/execute/rollback.py), on two real gloo ranks: stages agree, an error agreed at a point
inside a stage passes through it once, the heartbeat thread is joined when the session exits, and the collectives
move bytes of any length over a group.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from loader.execute import Rollback


def test_rollback_undoes_last_first_on_failure_and_forgets_on_success():
    done: list[str] = []
    with pytest.raises(RuntimeError):
        with Rollback() as rollback:
            rollback.add(lambda: done.append("first"))
            second = rollback.add(lambda: done.append("second"))
            rollback.add(lambda: done.append("third"))
            rollback.drop(second)  # became final
            raise RuntimeError("the flow failed")
    assert done == ["third", "first"]
    done.clear()
    with Rollback() as rollback:
        rollback.add(lambda: done.append("never"))
    assert done == []


def test_rollback_keeps_tensors_only_when_enabled():
    t = torch.zeros(3)
    for enabled, after in ((True, 0.0), (False, 1.0)):
        t.zero_()
        with pytest.raises(ValueError):
            with Rollback(enabled) as rollback:
                rollback.keep_tensors({"t": t, "absent": None})
                t.fill_(1.0)
                raise ValueError("a read failed")
        assert torch.equal(t, torch.full((3,), after)), enabled


def _rank(rank: int, root: str) -> None:
    """One of two ranks: every check's outcome saved to ``root/rank{rank}.json``."""
    from datetime import timedelta

    import numpy as np
    import torch.distributed as dist

    from loader.distributed import Collectives, Session

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{root}/store", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    out: dict = {}
    peers = Collectives(timeout=30)
    out["gathered"] = [b.hex() for b in peers.all_gather_bytes(b"" if rank == 0 else b"\x00abc")]
    sends = [np.full(rank + j, 10 * rank + j, dtype=np.uint8) for j in range(2)]  # rank r sends r + j bytes to j
    got = peers.all_to_all_bytes(sends, [r + rank for r in range(2)])
    out["received"] = [g.tolist() for g in got]
    t = torch.full((2, 3), float(rank)).t()  # not contiguous
    peers.broadcast(t, src=1)
    out["broadcast"] = t.tolist()
    with Session(timeout=30) as session:
        with session.stage("planning"):
            pass
        try:
            with session.stage("reading"):
                with session.stage("reading", point="inner"):
                    if rank == 1:
                        raise KeyError("only on rank 1")
        except KeyError as e:
            out["error"] = [str(e), getattr(e, "rank", None), getattr(e, "stage", None)]
        out["in_flow"] = sorted(t.name for t in threading.enumerate() if t.name == "loader-heartbeat")
    out["after_flow"] = sorted(t.name for t in threading.enumerate() if t.name == "loader-heartbeat")
    with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()


@pytest.mark.dist
def test_stages_collectives_and_the_heartbeat_on_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_rank, args=(str(tmp_path),), nprocs=2, join=True, start_method="spawn")
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(2)]
    for r, res in enumerate(results):
        assert res["gathered"] == ["", "00616263"], r  # empty and binary bytes, index = rank
        assert res["received"] == [[10 * i + r] * (i + r) for i in range(2)], r
        assert res["broadcast"] == [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], r
        message, rank, stage = res["error"]
        assert rank == 1 and stage == "reading", r  # agreed at the inner point, passed through the stage as it was
        assert message.count("failed on rank 1") == 1 and "only on rank 1" in message, message
        assert res["in_flow"] == ["loader-heartbeat"] and res["after_flow"] == [], r  # joined when the flow ends
    assert results[0]["error"] == results[1]["error"]
