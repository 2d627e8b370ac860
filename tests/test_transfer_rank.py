"""``plan_transfer(..., rank=r)``: one rank's plan is its part of the whole world's, and senders are balanced.

Oracle: the whole world's plan (itself checked against files in tests/test_transfer_simulate.py); the union over
ranks of the per-rank plans must hold the same moves (same source and destination ranks, targets, boxes and
blocks: the same bytes), each rank's plan exactly those it sends or receives.
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import pytest
import torch
import transfer_models as tm
from hf_models import build
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from loader.options import Rules
from loader.transfer import dest_side, mesh_parts, plan_transfer, source_side
from loader.transfer.cells import Cell, sender

pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")]

FSDP = lambda name, shape: [Shard(0)]


def _world(src_parts, dst_parts, colocated):
    offset = 0 if colocated else len(src_parts)
    world = max(len(src_parts), offset + len(dst_parts))
    src = [src_parts[r] if r < len(src_parts) else {} for r in range(world)]
    dst = [dst_parts[r - offset] if 0 <= r - offset < len(dst_parts) else {} for r in range(world)]
    return src, dst


def _move(m):
    return (m.src, m.dst, m.target, m.local, m.block, m.key)


def _assert_union_is_the_world(source, dest, src, dst):
    whole = plan_transfer(source, dest, src, dst)
    union: list = []
    for r in range(len(src)):
        mine = plan_transfer(source, dest, src, dst, rank=r)
        assert mine.rank == r and mine.fallback == whole.fallback and mine.transferred == whole.transferred
        assert all(r in (m.src, m.dst) for m in mine.moves)
        want = [_move(m) for m in whole.moves if r in (m.src, m.dst)]
        assert Counter(map(_move, mine.moves)) == Counter(want), r
        assert sum(m.nbytes for m in mine.moves) == sum(n for (s, d), n in whole.pair_bytes().items() if r in (s, d))
        union += [_move(m) for m in mine.moves if m.dst == r]
    assert Counter(union) == Counter(map(_move, whole.moves))
    return whole


def _ep_tp(dest):
    placements = tm.tp_placements(dest, two_dims=True)
    return {
        n: [Shard(0), _StridedShard(1, split_factor=2)] if n.endswith("gate_up_proj") else p
        for n, p in placements.items()
    }


@pytest.mark.parametrize(
    "case", ["fsdp2-tp2", "fsdp2-tp2-colocated", "fsdp4-ep2xtp2-strided", "replicated", "fallback", "ep-tp-source"]
)
def test_the_union_of_per_rank_plans_is_the_whole_worlds_plan(case):
    with torch.device("meta"):
        _, source = build("qwen3_moe", 0, tie_word_embeddings=False)
        dest = tm.Engine()
    rules = tm.rules_with_fallback() if case == "fallback" else tm.rules()
    if case == "fsdp4-ep2xtp2-strided":
        src_parts, dst_parts = mesh_parts(source, (4,), FSDP), mesh_parts(dest, (2, 2), _ep_tp(dest))
    elif case == "replicated":
        src_parts = mesh_parts(source, (3,), lambda n, s: [Replicate()])
        dst_parts = mesh_parts(dest, (4,), tm.tp_placements(dest))
    elif case == "ep-tp-source":
        src_parts = mesh_parts(source, (2, 2), tm.ep_tp_source_placements(source))
        dst_parts = mesh_parts(dest, (4,), tm.tp_placements(dest))
    else:
        src_parts, dst_parts = mesh_parts(source, (2,), FSDP), mesh_parts(dest, (2,), tm.tp_placements(dest))
    src, dst = _world(src_parts, dst_parts, colocated=case in ("fsdp2-tp2-colocated", "ep-tp-source"))
    src_side = source_side(source)
    dst_side, _ = dest_side(dest, Rules(weights_mapping=rules), src_side.keys)
    whole = _assert_union_is_the_world(src_side, dst_side, src, dst)
    assert bool(whole.fallback) == (case == "fallback")


def test_the_union_on_a_deepseek_v3_meta_pair():
    """A 4-layer DeepSeek-V3 (3 dense + 1 MoE layer of 256 experts), FSDP over 8 ranks → EP2 x TP4."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    import plan_scale

    model = plan_scale.build_model(4)
    src, dst = _world(mesh_parts(model, (8,), FSDP), mesh_parts(model, (2, 4), plan_scale.placements_for(model)), False)
    side = source_side(model)
    _assert_union_is_the_world(side, dest_side(model, None, side.keys)[0], src, dst)


def test_a_replicated_cell_is_dealt_to_its_holders_in_turn():
    """The sender rule: the destination itself when it holds the cell, else the holders in turn over consecutive
    destination ranks (each of n holders sends to one destination of every n consecutive ones), the turn
    starting elsewhere for each cell: a function of the cell and the destination only."""
    box = ((0, 4),)
    for n in (1, 2, 3, 4):
        owners = tuple((r, box) for r in range(10, 10 + n))
        for index in range(5):
            cell = Cell("w", box, owners, index)
            assert sender(cell, 11) == 11 if n > 1 else sender(cell, 10) == 10
            for first in range(0, 6):  # destinations 0-8: none a holder
                counts = Counter(sender(cell, d) for d in range(first, first + n))
                assert sorted(counts) == [r for r, _ in owners] and set(counts.values()) == {1}
            assert len({sender(Cell("w", box, owners, i), 0) for i in range(n)}) == n


def test_replicas_send_equal_bytes():
    """Ranks 0-3 hold the whole source, ranks 4-7 a TP shard each: every holder sends a quarter."""
    with torch.device("meta"):
        _, source = build("qwen3_moe", 0, tie_word_embeddings=False)
        dest = tm.Engine()
    src, dst = _world(
        mesh_parts(source, (4,), lambda n, s: [Replicate()]), mesh_parts(dest, (4,), tm.tp_placements(dest)), False
    )
    src_side = source_side(source)
    plan = plan_transfer(src_side, dest_side(dest, Rules(weights_mapping=tm.rules()), src_side.keys)[0], src, dst)
    sent = [plan.bytes_sent(r) for r in range(4)]
    assert max(sent) - min(sent) <= max(m.nbytes for m in plan.moves), sent


@pytest.mark.parametrize("bucket", [4096, 1 << 20])
def test_each_ranks_rounds_agree_with_its_peers_and_are_bounded(bucket):
    """Rounds from each rank's own plan: the two ends of a pair put the same moves in the same round, in the same
    order, and in every round each rank sends and receives at most ``bucket`` bytes to and from other ranks."""
    from loader.transfer.schedule import degrees, rank_rounds

    with torch.device("meta"):
        _, source = build("qwen3_moe", 0, tie_word_embeddings=False)
        dest = tm.Engine()
    src, dst = _world(mesh_parts(source, (4,), FSDP), mesh_parts(dest, (2, 2), _ep_tp(dest)), True)
    src_side = source_side(source)
    dst_side, _ = dest_side(dest, Rules(weights_mapping=tm.rules()), src_side.keys)
    plans = [plan_transfer(src_side, dst_side, src, dst, rank=r) for r in range(4)]
    every = [degrees(p) for p in plans]
    schedules = [rank_rounds(p, bucket, every) for p in plans]
    assert max(map(len, schedules)) > (1 if bucket == 4096 else 0)
    for r, schedule in enumerate(schedules):
        for k, moves in enumerate(schedule):
            assert sum(m.nbytes for m in moves if m.src == r != m.dst) <= bucket
            assert sum(m.nbytes for m in moves if m.dst == r != m.src) <= bucket
            assert k == 0 or all(m.src != m.dst for m in moves)
            for peer in range(4):
                if peer != r:
                    theirs = schedules[peer][k] if k < len(schedules[peer]) else []
                    assert [_move(m) for m in moves if m.dst == peer] == [_move(m) for m in theirs if m.src == r]
    received = [sum(m.nbytes for ms in s for m in ms if m.dst == r) for r, s in enumerate(schedules)]
    assert received == [sum(m.nbytes for m in p.moves if m.dst == r) for r, p in enumerate(plans)]
