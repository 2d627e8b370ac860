"""``EngineSync`` from expert-parallel trainer ranks into a ``TensorDestination`` of another layout.

One world of four processes (tests/ep_sync_worker.py), run once for the module: two trainer ranks (their own gloo
world) holding a tiny transformers Qwen3-MoE in float32 whose experts' 3-D ``gate_up_proj`` ``[4, 64, 64]`` and
``down_proj`` ``[4, 64, 32]`` are ``Shard(0)`` DTensors (rank r: experts 2r, 2r+1), the rest plain; and two
destination ranks (their own gloo world) holding every tensor in bfloat16, ``gate_up_proj`` ``Shard(1)``,
``down_proj`` ``Replicate``, the rest whole. A full push, an in-place change of some experts (on one rank each)
and of a replicated norm, then a delta push: each destination rank holds its boxes of the trainer's full tensors
cast to bfloat16, bit for bit, the versions agree, and each trainer rank sends only what its local shards hold
(a replicated tensor: the lowest rank).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from sync_world import run_sync_world

WORKER = str(Path(__file__).resolve().parent / "ep_sync_worker.py")
LIMIT = 400  # seconds for the whole world (a normal run: tens; a hung rank is killed and named)
EXPERTS = (".gate_up_proj", ".down_proj")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict:
    """Every rank's saved phases, by ``"dest0"``, ``"dest1"``, ``"trainer0"``, ``"trainer1"``."""
    folder = tmp_path_factory.mktemp("ep_sync")
    return run_sync_world(WORKER, folder, limit=LIMIT, codes=[0, 0, 0, 0])


def box_of(key: str, shape: torch.Size, dest: int) -> tuple[slice, ...]:
    """Destination rank ``dest``'s box of a tensor (``gate_up_proj``: ``Shard(1)``; the rest whole)."""
    if key.endswith(".gate_up_proj"):
        half = shape[1] // 2
        return (slice(None), slice(dest * half, dest * half + half))
    return (slice(None),)


def expected(full: dict, dest: int) -> dict:
    return {k: v[box_of(k, v.shape, dest)].to(torch.bfloat16) for k, v in full.items()}


def same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and bool((x.view(torch.uint8) == y.view(torch.uint8)).all())


def held_bytes(full: dict, dest: int, trainer: int) -> int:
    """The bfloat16 bytes of destination rank ``dest``'s boxes that trainer rank ``trainer`` sends: of the experts,
    the part of its two; of the replicated tensors, all (rank 0, the lowest holding them) or none."""
    total = 0
    for key, v in full.items():
        n = v[box_of(key, v.shape, dest)].numel()
        if key.endswith(EXPERTS):
            total += n // 2  # two of the four experts
        elif trainer == 0:
            total += n
    return total * 2


def test_the_trainer_ranks_hold_their_experts_as_shard0_dtensors_and_the_change_touched_three_tensors(world):
    full = world["trainer0"]["full"]
    assert full[0].keys() == full[1].keys() and sum(k.endswith(EXPERTS) for k in full[0]) == 4
    for rank in (0, 1):
        held = world[f"trainer{rank}"]["held"]  # the DTensors: the experts only, two of four on each rank
        assert held.keys() == {k for k in full[0] if k.endswith(EXPERTS)}
        assert all(p == "(Shard(dim=0),)" and s == (2, *full[0][k].shape[1:]) for k, (p, s) in held.items()), held
    for rank in (0, 1):
        assert all(torch.equal(world[f"trainer{rank}"]["full"][p][k], full[p][k]) for p in (0, 1) for k in full[0])
    changed = {k for k in full[0] if not torch.equal(full[0][k], full[1][k])}
    assert changed == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj",
                       "model.norm.weight"}  # fmt: skip


def test_full_then_delta_pushes_give_each_destination_rank_its_boxes_bit_for_bit(world):
    trainer = world["trainer0"]
    for rank in (0, 1):
        dest = world[f"dest{rank}"]
        assert dest["versions"] == [1, 2] == [r.version for r in trainer["reports"]]
        assert [r.version for r in world["trainer1"]["reports"]] == [1, 2]
        for push in (0, 1):
            want = expected(trainer["full"][push], rank)
            got = dest["values"][push]
            assert got.keys() == want.keys()
            bad = [k for k in want if not same_bits(got[k], want[k])]
            assert not bad, (push, rank, bad)


def test_each_trainer_rank_sends_only_what_its_local_experts_hold_and_replicated_tensors_once(world):
    full = world["trainer0"]["full"][0]
    for trainer in (0, 1):
        pieces = world[f"trainer{trainer}"]["pieces"]
        assert len(pieces) == 2  # one list per destination rank
        for dest, mine in enumerate(pieces):
            assert all(sender == trainer for _, _, sender in mine)
            for key, box, _ in mine:
                if key.endswith(EXPERTS):
                    assert 2 * trainer <= box[0][0] < box[0][1] <= 2 * trainer + 2, (trainer, key, box)
                else:
                    assert trainer == 0, (trainer, key, box)  # a replicated tensor: the lowest rank sends it
            sent = sum(math.prod(b - a for a, b in box) for _, box, _ in mine) * 2  # bfloat16 on the wire
            assert sent == held_bytes(full, dest, trainer), (trainer, dest)
    shard = tuple(held_bytes(full, d, 0) + held_bytes(full, d, 1) for d in (0, 1))  # each box once
    for rank in (0, 1):
        report = world[f"dest{rank}"]["reports"][0]
        assert not report.delta and report.bytes_sent[rank] == report.shard_bytes[rank] == shard[rank]
    for trainer in (0, 1):
        report = world[f"trainer{trainer}"]["reports"][0]
        assert report.bytes_sent == report.shard_bytes == shard


def test_a_delta_push_counts_the_changed_bytes_and_sends_fewer(world):
    for rank in (0, 1):
        dest = world[f"dest{rank}"]
        before, after = dest["values"]
        changed = sum(int((before[k].view(torch.int16) != after[k].view(torch.int16)).sum()) for k in before) * 2
        report = dest["reports"][1]
        assert report.delta and changed > 0
        assert report.changed_bytes[rank] == changed
        assert report.bytes_sent[rank] < report.shard_bytes[rank]
        gate_up = "model.layers.0.mlp.experts.gate_up_proj"  # rank 1's expert 3 changed, experts 0-2 not
        assert not torch.equal(before[gate_up][3], after[gate_up][3])
        assert torch.equal(before[gate_up][:3], after[gate_up][:3])
