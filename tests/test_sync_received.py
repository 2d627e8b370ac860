"""A worker's base between pushes (``loader.vllm.sync_push.Received``), without a wire: every trainer rank's
segments as last received, the wants views of them where a want is one piece and assembled otherwise; a delta
push's deltas applied in place name the wants they changed (and only those), give the trainer's new values bit for
bit, and undo back to the old bits exactly, also when a packet is forged halfway through."""

from __future__ import annotations

import pytest
import torch

from loader.vllm.sync_pieces import gather, plan_pieces, segments
from loader.vllm.sync_plan import Want
from loader.vllm.sync_push import Received, prepare_outgoing

ROWS, COLS = 10, 6


def _parts(bounds: list[tuple[int, int]]) -> list[dict]:
    """Per trainer rank, rows ``bounds[r]`` of ``w`` (a ``Shard(0)``) and a replicated ``b`` and ``n``."""
    whole = {"b": [[[[0, 4]], [[0, 4]]]], "n": [[[[0, 8]], [[0, 8]]]]}
    return [{"w": [[[[a, b], [0, COLS]], [[0, b - a], [0, COLS]]]], **whole} for a, b in bounds]


def _world(bounds):
    """One worker wanting rows 2-8 of ``w`` (cut by the trainer ranks' rows), all of ``b`` and ``n`` (one piece
    each, from rank 0), in bf16; its pieces per trainer rank."""
    wants = [Want("w", (2, 0), (6, COLS), torch.bfloat16), Want("b", (0,), (4,), torch.bfloat16),
             Want("n", (0,), (8,), torch.bfloat16)]  # fmt: skip
    pieces = plan_pieces(wants, _parts(bounds))
    return wants, [[p for p in pieces if p.sender == r] for r in range(len(bounds))]


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(4, generator=g),
            "n": torch.randn(8, generator=g)}  # fmt: skip


def _local(tensors, bounds, r):
    a, b = bounds[r]
    return {"w": tensors["w"][a:b], "b": tensors["b"], "n": tensors["n"]}


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _expected(tensors, wants) -> list[bytes]:
    out = []
    for want in wants:
        box = tensors[want.key]
        for d, (o, n) in enumerate(zip(want.offsets, want.lengths)):
            box = box.narrow(d, o, n)
        out.append(_bits(box.to(want.dtype)))
    return out


@pytest.mark.parametrize("bounds", [[(0, 10)], [(0, 5), (5, 10)]])
def test_a_delta_applied_in_place_changes_only_the_wants_it_names_and_undoes_to_the_old_bits(bounds):
    wants, by_rank = _world(bounds)
    old = _tensors(0)
    segs = [gather(_local(old, bounds, r), by_rank[r], wants)[1] for r in range(len(bounds))]
    got = Received([[s.clone() for s in rank] for rank in segs], by_rank, wants)
    assert [_bits(t) for t in got] == _expected(old, wants)
    assert got.views == [len(bounds) == 1, True, True]  # w is cut in two pieces by two trainer ranks
    new = {k: v.clone() for k, v in old.items()}
    new["w"][7, 2] += 1.0  # rank 1's row where there are two ranks
    new["n"][3] -= 1.0
    lengths, payloads = [], []
    for r in range(len(bounds)):
        out = prepare_outgoing(_local(new, bounds, r), [by_rank[r]], [wants], [segs[r]], True)
        lengths.append(out.delta[0][0])
        payloads.append(out.delta[0][1])
    got.apply(payloads, lengths)
    assert got.changed == {0, 2}  # b unchanged
    assert [_bits(t) for t in got] == _expected(new, wants)
    got.undo()
    assert [_bits(t) for t in got] == _expected(old, wants)
    assert [[_bits(s) for s in rank] for rank in got.segments] == [[_bits(s) for s in rank] for rank in segs]


def test_a_forged_packet_leaves_every_want_as_it_was():
    """Rank 0's deltas apply, rank 1's packet is cut short: rank 0's in-place writes are undone before the error."""
    bounds = [(0, 5), (5, 10)]
    wants, by_rank = _world(bounds)
    old, new = _tensors(1), _tensors(2)
    segs = [gather(_local(old, bounds, r), by_rank[r], wants)[1] for r in range(2)]
    got = Received([[s.clone() for s in rank] for rank in segs], by_rank, wants)
    lengths, payloads = [], []
    for r in range(2):
        out = prepare_outgoing(_local(new, bounds, r), [by_rank[r]], [wants], [segs[r]], True)
        lengths.append(out.delta[0][0])
        payloads.append(out.delta[0][1])
    assert len(segments(by_rank[0], wants)) == 1 and payloads[0].numel() > 0
    payloads[1] = payloads[1][:-1]
    with pytest.raises(ValueError, match="delta packet|header says"):
        got.apply(payloads, lengths)
    assert [_bits(t) for t in got] == _expected(old, wants)
