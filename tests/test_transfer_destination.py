"""``loader.transfer.TensorDestination``: trainer ranks' unchanged ``EngineSync`` pushes into plain local tensors
of other processes.

One world of four processes (tests/destination_worker.py), run once for the module: two FSDP2 trainer ranks
(their own gloo world, float32) and two destination ranks (their own gloo world: ``Shard(1)`` and ``Replicate``
DTensors in bfloat16, hand-described rows in bfloat16, a plain float32 tensor). A full push then a delta push
after one element of each trainer shard changed: each destination rank holds its boxes of the trainer's full
tensors cast to its dtypes, bit for bit, the versions agree, and a full push puts exactly its shard's bytes on
the wire to it. A trainer group whose tensor does not fit is a ``ValueError`` naming the tensor on every member,
nothing written; a trainer rank killed mid-push is a ``PeerFailure`` on every destination rank, the values of the
last good push kept. And, in this process, the destination's wants and their refusals by name, and a push the
trainer refuses: nothing written, the next push lands.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sync_world import run_sync_world

from loader.transfer.destination import destination_wants

WORKER = str(Path(__file__).resolve().parent / "destination_worker.py")
ROWS = {0: (0, 1), 1: (1, 4)}  # the destination's hand-described rows of "1.weight" (as in the worker)
LIMIT = 400  # seconds for the whole world (a normal run: a few; a hung rank is killed and named)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Every rank's saved phases, by ``"dest0"``, ``"dest1"``, ``"trainer0"``, ``"trainer1"``."""
    folder = tmp_path_factory.mktemp("destination")
    return run_sync_world(WORKER, folder, limit=LIMIT, codes=[0, 0, 0, 1], why=" (trainer rank 1 dies by design)")


def expected(full: dict, rank: int) -> dict:
    """Destination rank ``rank``'s local tensors, from the trainer's full state."""
    a, b = ROWS[rank]
    return {
        "0.weight": full["0.weight"][:, 3 * rank : 3 * rank + 3].to(torch.bfloat16),
        "0.bias": full["0.bias"].to(torch.bfloat16),
        "1.weight": full["1.weight"][a:b].to(torch.bfloat16),
        "1.bias": full["1.bias"],
    }


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and bool((x.view(torch.uint8) == y.view(torch.uint8)).all())


def shard_bytes(rank: int) -> int:
    a, b = ROWS[rank]
    return 10 * 3 * 2 + 10 * 2 + (b - a) * 10 * 2 + 4 * 4


def test_full_then_delta_pushes_give_each_destination_rank_its_boxes_bit_for_bit(world):
    trainer = world["trainer0"]
    assert not torch.equal(trainer["full"][0]["0.weight"], trainer["full"][1]["0.weight"])  # the step changed it
    for rank in (0, 1):
        dest = world[f"dest{rank}"]
        assert dest["versions"] == [1, 2] == [r.version for r in trainer["reports"]]
        for push in (0, 1):
            want = expected(trainer["full"][push], rank)
            got = dest["values"][push]
            bad = [k for k in want if not same_bits(got[k], want[k])]
            assert not bad, (push, rank, bad)
        full, delta = dest["reports"]
        assert full.bytes_sent[rank] == full.shard_bytes[rank] == shard_bytes(rank) and not full.delta
        assert delta.delta and delta.changed_bytes[rank] < delta.shard_bytes[rank]
    assert trainer["reports"][0].bytes_sent == tuple(shard_bytes(r) for r in (0, 1))  # what the trainers sent


def test_a_trainer_tensor_that_does_not_fit_is_refused_by_name_on_every_member_and_nothing_changes(world):
    for member in ("dest0", "dest1", "trainer0", "trainer1"):
        said = world[member]["bad"]
        assert said["raised"] == "ValueError" and "trainer tensor '1.weight' is [5, 10]" in said["message"], said
    for rank in (0, 1):
        dest = world[f"dest{rank}"]
        assert all(same_bits(dest["after_bad"][k], v) for k, v in dest["values"][1].items())


def test_a_trainer_rank_killed_mid_push_is_a_peer_failure_on_every_destination_rank_and_old_values_are_kept(world):
    for rank in (0, 1):
        dest = world[f"dest{rank}"]
        assert dest["dying"]["raised"] == "PeerFailure", dest["dying"]
        assert dest["version_after_dying"] == 2
        want = expected(world["trainer0"]["full"][1], rank)
        assert all(same_bits(dest["after_dying"][k], v) for k, v in want.items())
    assert world["trainer0"]["dying"]["raised"] == "PeerFailure"


KEYS = [("w", [4, 6], "float32"), ("b", [4], "float32")]


def test_the_wants_are_the_destination_boxes_in_its_dtypes():
    w = torch.zeros(2, 6, dtype=torch.bfloat16)
    wants, lands = destination_wants({"w": (w, (4, 6), (2, 0)), "b": torch.zeros(4, dtype=torch.float16)}, KEYS)
    assert [(x.key, x.offsets, x.lengths, x.dtype) for x in wants] == [
        ("w", (2, 0), (2, 6), torch.bfloat16),
        ("b", (0,), (4,), torch.float16),
    ]
    assert lands[0][0] is w and lands[0][1] == ((0, 2), (0, 6))


@pytest.mark.parametrize(
    ("tensors", "says"),
    [
        ({"w": torch.zeros(4, 6)}, "trainer tensor 'b' has no destination tensor"),
        ({"w": torch.zeros(4, 6), "b": torch.zeros(4), "c": torch.zeros(1)}, "destination tensor 'c' is written"),
        ({"w": torch.zeros(6, 4), "b": torch.zeros(4)}, "trainer tensor 'w' is [4, 6], its destination tensor [6, 4]"),
        ({"w": (torch.zeros(2, 6), (4, 6), (3, 0)), "b": torch.zeros(4)}, "destination tensor 'w': its shard"),
        ({"w": torch.zeros(4, 6, dtype=torch.int32), "b": torch.zeros(4)}, "trainer tensor 'w' is torch.float32"),
    ],
)
def test_a_destination_that_does_not_fit_is_refused_naming_the_tensor(tensors, says):
    with pytest.raises(ValueError, match=says.replace("[", r"\[")):
        destination_wants(tensors, KEYS)


def test_a_refused_push_is_a_value_error_on_the_destination_and_the_next_push_lands():
    """One trainer rank and one destination rank in this process (a thread each side): a push the trainer
    refuses (a tensor replaced by one of another shape) writes nothing; the next push lands, bit for bit."""
    from concurrent.futures import ThreadPoolExecutor

    from loader.transfer import TensorDestination
    from loader.vllm import EngineSync

    torch.manual_seed(0)
    policy = torch.nn.Linear(6, 4)
    held = {"weight": torch.zeros(4, 6, dtype=torch.bfloat16), "bias": (torch.zeros(2), (4,), (2,))}
    dest = TensorDestination(held, trainers=1, rank=0, world=1, timeout=60.0)
    with ThreadPoolExecutor(1) as side:
        accepted = side.submit(dest.accept)
        sync = EngineSync(dest.address, policy, rank=0, trainers=1, timeout=60.0)
        accepted.result()
        weight = policy.weight
        policy.weight = torch.nn.Parameter(torch.zeros(5, 6))
        received = side.submit(dest.receive)
        with pytest.raises(ValueError, match="'weight'"):
            sync.push()
        with pytest.raises(ValueError, match="'weight'"):
            received.result()
        assert not held["weight"].any() and dest.version == 0
        policy.weight = weight
        received = side.submit(dest.receive)
        sync.push()
        assert received.result() == 1
    assert same_bits(held["weight"], policy.weight.detach().to(torch.bfloat16))
    assert same_bits(held["bias"][0], policy.bias.detach()[2:])
