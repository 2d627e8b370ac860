"""Property tests of the plan of exchanged reads (loader/execute/exchange_plan.py), a pure function of every
rank's wanted byte ranges: random worlds of 1..6 ranks wanting column shards (a run of every row each), row shards,
replicated and overlapping ranges, with ranks that want nothing, at byte offsets of small files and of files of
many GiB; every property checked against a plain-Python reference of the module's definitions.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.execute.exchange_plan import END, SMALL_RANGE, as_ranges, parcels, plan_files, rounds, shares

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- a reference of the module's vocabulary, in plain Python ---------------------------------------------------


def merged(ranges) -> list[tuple[int, int]]:
    """The byte set of ``ranges`` as sorted, disjoint, non-touching, non-empty ``(start, end)`` pairs."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges if b > a):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def intersect(xs, ys) -> list[tuple[int, int]]:
    """The bytes in both (each a list of disjoint ranges)."""
    return merged((max(a, c), min(b, d)) for a, b in xs for c, d in ys)


def nbytes(ranges) -> int:
    return sum(int(b) - int(a) for a, b in ranges)


def pairs(a: np.ndarray) -> list[tuple[int, int]]:
    return [(int(s), int(e)) for s, e in a]


def shared_extents(everyone) -> list[tuple[int, int]]:
    """Extents (every rank's wanted ranges merged) that >= 2 ranks want, one of them in more than one range."""
    out = []
    for a, b in merged(r for mine in everyone for r in pairs(mine)):
        counts = [sum(a <= s < b for s, _ in pairs(mine)) for mine in everyone]
        if sum(c > 0 for c in counts) >= 2 and max(counts) >= 2:
            out.append((a, b))
    return out


# -- strategies ------------------------------------------------------------------------------------------------


@st.composite
def tensor_wants(draw, world: int, at: int, unit: int) -> tuple[list[list[tuple[int, int]]], int]:
    """One tensor's wanted ranges per rank from byte ``at`` on, and its end: column shards, row shards, replicated
    or random overlapping ranges, each over a random subset of the ranks."""
    kind = draw(st.sampled_from(["columns", "rows", "replicated", "random"]))
    ranks = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
    rows, run = draw(st.integers(1, 5)), draw(st.integers(1, 3)) * unit
    out: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    if kind == "columns":  # each rank a run of every row
        for row in range(rows):
            for k, r in enumerate(ranks):
                a = at + (row * len(ranks) + k) * run
                out[r].append((a, a + run))
        return out, at + rows * len(ranks) * run
    if kind == "rows":  # each rank a contiguous shard
        for k, r in enumerate(ranks):
            out[r].append((at + k * rows * run, at + (k + 1) * rows * run))
        return out, at + len(ranks) * rows * run
    size = rows * len(ranks) * run
    if kind == "replicated":
        for r in ranks:
            out[r].append((at, at + size))
        return out, at + size
    for r in ranks:  # random, overlapping between ranks
        for _ in range(draw(st.integers(1, 4))):
            a = draw(st.integers(0, size - 1))
            out[r].append((at + a, at + draw(st.integers(a + 1, size))))
    return out, at + size


@st.composite
def file_tensors(draw, world: int) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """One file's tensors one after another, touching or with a gap, in offsets of one byte or of one GiB (files of
    many GiB: bounds must not overflow), some wanted by no rank: every rank's wanted ranges of each tensor (a
    tensor's as :data:`Ranges`; index ``[rank][tensor]``) and the tensors' byte spans."""
    unit = draw(st.sampled_from([1, 2, 1 << 30]))
    at = draw(st.integers(0, 3)) * unit
    per_tensor: list[list[np.ndarray]] = [[] for _ in range(world)]
    spans = []
    for _ in range(draw(st.integers(1, 4))):
        wants, end = draw(tensor_wants(world, at, unit))
        if draw(st.integers(0, 5)) == 0:  # a tensor no rank loads
            wants = [[] for _ in range(world)]
        for r in range(world):
            per_tensor[r].append(as_ranges(np.array(wants[r], dtype=np.int64).reshape(-1, 2)))
        spans.append((at, end))
        at = end + draw(st.sampled_from([0, 0, 1, 3])) * unit
    return per_tensor, np.array(spans, dtype=np.int64)


@st.composite
def file_wants(draw, world: int) -> list[np.ndarray]:
    """Every rank's wanted ranges of one file, touching ones merged across tensors."""
    per_tensor, _ = draw(file_tensors(world))
    return [as_ranges(np.concatenate(mine)) for mine in per_tensor]


worlds = st.integers(1, 6)


@st.composite
def one_file(draw) -> list[np.ndarray]:
    return draw(file_wants(draw(worlds)))


@st.composite
def many_files(draw) -> tuple[int, list[dict[str, np.ndarray]]]:
    """``(world, every rank's {file: wanted})``; a rank wanting nothing of a file has no entry for it."""
    world = draw(worlds)
    everyone: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    for name in draw(st.lists(st.sampled_from("abcdefg"), min_size=1, max_size=5, unique=True)):
        for r, mine in enumerate(draw(file_wants(world))):
            if len(mine) or draw(st.booleans()):
                everyone[r][f"/ckpt/{name}.safetensors"] = mine
    return world, everyone


# -- properties -------------------------------------------------------------------------------------------------


@SETTINGS
@given(st.lists(st.tuples(st.integers(-2, 40), st.integers(-2, 40)), max_size=12))
def test_as_ranges_is_the_normal_form_of_the_same_bytes(raw):
    got = as_ranges(raw)
    assert got.dtype == np.int64 and got.shape == (len(got), 2)
    assert (got[:, 1] > got[:, 0]).all()  # none empty
    assert (got[1:, 0] > got[:-1, 1]).all()  # ascending, disjoint, not touching
    mask = np.zeros(50, dtype=bool)
    for a, b in raw:  # the same byte set (shifted by 2: offsets may be negative)
        if b > a:
            mask[a + 2 : b + 2] = True
    got_mask = np.zeros(50, dtype=bool)
    for a, b in got:
        got_mask[a + 2 : b + 2] = True
    assert (got_mask == mask).all(), (raw, got)
    assert pairs(got) == merged(raw)


@SETTINGS
@given(one_file())
def test_shares_exactly_cover_the_shared_extents_each_rank_fetching_at_most_its_wants(everyone):
    c = shares(everyone)
    starts, ends, holders = c.starts, c.ends, c.holders
    assert (ends > starts).all()  # none empty
    assert (starts[1:] >= ends[:-1]).all()  # ascending, disjoint
    assert set(holders.tolist()) <= set(range(len(everyone)))
    shared = shared_extents(everyone)
    assert merged(zip(starts, ends)) == shared, (everyone, c)
    assert c.nbytes == nbytes(shared)
    for a, b in shared:
        inside = (starts >= a) & (ends <= b)
        for r, mine in enumerate(everyone):
            held = holders[inside] == r
            wanted = nbytes(intersect(pairs(mine), [(a, b)]))
            assert held.sum() <= 1, "a rank fetches one contiguous share of an extent"
            # exact integer bounds: never more than it wants in the extent (no rounding slack needed)
            assert int((ends[inside][held] - starts[inside][held]).sum()) <= wanted, (r, (a, b), everyone)
    for r in range(len(everyone)):
        assert pairs(c.of(r)) == [(int(s), int(e)) for s, e, h in zip(starts, ends, holders) if h == r]


@SETTINGS
@given(one_file())
def test_parcels_partition_each_ranks_shared_wants_and_lie_in_their_holders_shares(everyone):
    c = shares(everyone)
    shared = shared_extents(everyone)
    share_list = list(zip(c.starts.tolist(), c.ends.tolist(), c.holders.tolist()))
    for mine in everyone:
        p = parcels(mine, c)
        assert (p.ends > p.starts).all() and (p.starts[1:] >= p.ends[:-1]).all()
        assert merged(zip(p.starts, p.ends)) == intersect(pairs(mine), shared), (mine, everyone)
        for a, b, h in zip(p.starts.tolist(), p.ends.tolist(), p.holders.tolist()):
            assert any(s <= a and b <= e and h == k for s, e, k in share_list), ((a, b, h), share_list)
        for h in range(len(everyone)):
            assert p.sizes_from(h).tolist() == [b - a for a, b in pairs(p.from_holder(h))]


@SETTINGS
@given(many_files())
def test_plan_files_sends_and_costs(world_and_wants):
    world, everyone = world_and_wants
    plans = plan_files(everyone)
    files = sorted({f for wants in everyone for f in wants})
    empty = np.zeros((0, 2), dtype=np.int64)
    with_shared = [f for f in files if shared_extents([w.get(f, empty) for w in everyone])]
    assert sorted(plans) == with_shared
    for f, fp in plans.items():
        wants = [w.get(f, empty) for w in everyone]
        assert len(fp.parcels) == world
        share_of = list(zip(fp.shares.starts.tolist(), fp.shares.ends.tolist(), fp.shares.holders.tolist()))
        for i in range(world):
            for j in range(world):
                # what i sends j: j's wanted bytes inside i's shares, cut at share bounds, ascending
                expected = [parcel for s, e, h in share_of if h == i for parcel in intersect(pairs(wants[j]), [(s, e)])]
                assert pairs(fp.sends(i, j)) == expected, (f, i, j)
            received = sum(nbytes(pairs(fp.parcels[i].from_holder(h))) for h in range(world) if h != i)
            assert fp.cost(i) == nbytes(pairs(fp.shares.of(i))) + received


@SETTINGS
@given(many_files(), st.integers(0, 1 << 34))
def test_rounds_of_whole_files_keep_each_rank_within_the_budget_unless_a_file_is_alone(world_and_wants, budget):
    """Without the tensors' spans a file is not cut: a round is whole files, grouped greedily in name order."""
    world, everyone = world_and_wants
    plans = plan_files(everyone)
    groups = rounds(plans, world, budget)
    assert all(p.lo == 0 and p.hi == END for g in groups for p in g)
    assert [p.file for g in groups for p in g] == sorted(plans)  # every file once, in name order
    assert all(groups)

    def held(group):
        return max(sum(plans[f].cost(r) for f in group) for r in range(world))

    for k, g in enumerate(groups):
        files = [p.file for p in g]
        assert len(files) == 1 or held(files) <= budget, (g, budget)
        if k + 1 < len(groups):  # greedy: the next group's first file did not fit in this one
            assert held([*files, groups[k + 1][0].file]) > budget


@st.composite
def files_with_tensors(draw) -> tuple[int, list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """``(world, every rank's {file: wanted}, {file: tensor spans})``: wanted ranges per tensor, unmerged across
    tensors (as ranks send them)."""
    world = draw(worlds)
    everyone: list[dict[str, np.ndarray]] = [{} for _ in range(world)]
    spans = {}
    for name in draw(st.lists(st.sampled_from("abcd"), min_size=1, max_size=3, unique=True)):
        f = f"/ckpt/{name}.safetensors"
        per_tensor, spans[f] = draw(file_tensors(world))
        for r, mine in enumerate(per_tensor):
            everyone[r][f] = np.concatenate([np.zeros((0, 2), dtype=np.int64), *mine])
    return world, everyone, spans


def section_cost(fp, rank: int, lo: int, hi: int) -> int:
    """Bytes ``rank`` holds for ``[lo, hi)`` of a file: its shares and the parcels it receives there (plain
    reference)."""
    received = [pair for h in range(len(fp.parcels)) if h != rank for pair in pairs(fp.parcels[rank].from_holder(h))]
    return nbytes(intersect(pairs(fp.shares.of(rank)), [(lo, hi)])) + nbytes(intersect(received, [(lo, hi)]))


def with_holders(starts, ends, holders) -> dict[int, list[tuple[int, int]]]:
    """``{holder: its bytes, merged}``."""
    out: dict[int, list[tuple[int, int]]] = {}
    for a, b, h in zip(starts.tolist(), ends.tolist(), holders.tolist()):
        out.setdefault(h, []).append((a, b))
    return {h: merged(r) for h, r in out.items()}


@SETTINGS
@given(files_with_tensors(), st.data())
def test_files_over_the_budget_are_cut_at_tensor_starts_into_sections_within_it(drawn, data):
    world, everyone, spans = drawn
    plans = plan_files(everyone, spans)
    if not plans:
        return
    most = max(fp.cost(r) for fp in plans.values() for r in range(world))
    budget = data.draw(st.one_of(st.integers(0, most), st.just(1)))
    groups = rounds(plans, world, budget, spans)
    flat = [p for g in groups for p in g]
    assert sorted({p.file for p in flat}) == sorted(plans) and [p.file for p in flat] == sorted(p.file for p in flat)
    for g in groups:
        assert g and len({p.file for p in g}) == len(g), g  # two sections of a file never in one round
        held = [sum(section_cost(plans[p.file], r, p.lo, p.hi) for p in g) for r in range(world)]
        if max(held) > budget:  # only a tensor over the budget alone (with tensors holding nothing)
            (p,) = g
            costly = [
                (a, b)
                for a, b in pairs(spans[p.file])
                if p.lo <= a < p.hi and any(section_cost(plans[p.file], r, a, b) for r in range(world))
            ]
            assert len(costly) == 1, (g, costly, held, budget)
    for f, fp in plans.items():
        mine = [p for p in flat if p.file == f]
        starts = set(spans[f][:, 0].tolist())
        assert mine[0].lo == 0 and mine[-1].hi == END and all(x.hi == y.lo for x, y in zip(mine, mine[1:]))
        assert all(p.lo in starts for p in mine[1:]), (mine, starts)  # cut at tensor starts only
        assert all(any(section_cost(fp, r, p.lo, p.hi) for r in range(world)) for p in mine), mine  # no empty round
        for x, y in zip(mine, mine[1:]):  # greedy: a section within the budget ends where the next tensor won't fit
            if max(section_cost(fp, r, x.lo, x.hi) for r in range(world)) <= budget:
                nxt = min([b for b in [*starts, END] if b > y.lo] + [y.hi])
                assert max(section_cost(fp, r, x.lo, nxt) for r in range(world)) > budget, (x, y, budget)
        # the sections' plans cover the file's shares and parcels exactly once, each parcel with its holder
        cut = [fp.section(p.lo, p.hi) for p in mine]
        for q, p in zip(cut, mine):
            assert (q.shares.starts >= p.lo).all() and (q.shares.ends <= p.hi).all()
            for r in range(world):
                assert q.cost(r) == section_cost(fp, r, p.lo, p.hi)
                for h in range(world):
                    clipped = [(max(a, p.lo), min(b, p.hi)) for a, b in pairs(fp.sends(h, r)) if a < p.hi and b > p.lo]
                    assert pairs(q.sends(h, r)) == clipped  # in order, touching ones (two tensors') not merged
        cat = lambda xs: np.concatenate([np.zeros(0, dtype=np.int64), *xs])
        c = fp.shares
        assert sum(q.shares.nbytes for q in cut) == c.nbytes
        got = with_holders(*(cat(getattr(q.shares, k) for q in cut) for k in ("starts", "ends", "holders")))
        assert got == with_holders(c.starts, c.ends, c.holders)
        for r in range(world):
            p = fp.parcels[r]
            sections_r = [q.parcels[r] for q in cut]
            assert sum(int((x.ends - x.starts).sum()) for x in sections_r) == int((p.ends - p.starts).sum())
            got = with_holders(*(cat(getattr(x, k) for x in sections_r) for k in ("starts", "ends", "holders")))
            assert got == with_holders(p.starts, p.ends, p.holders)


def test_a_5_gib_file_of_column_shards_is_held_a_gib_at_most_per_round():
    """TP2 over a 5 GiB file of ten 512 MiB column-sharded tensors (each rank a 64 KiB run of every 128 KiB row):
    one extent over the file, rank 0's share its first half. Whole, the file held 3.75 GiB per rank at once (its
    2.5 GiB share and the 1.25 GiB of parcels it receives); cut at tensor starts, at most 1 GiB: two tensors a section
    (a rank's 512 MiB of share and its peer's 256 MiB of parcels, in each)."""
    world, run, size = 2, 1 << 16, 1 << 29
    row_starts = np.arange(0, 10 * size, world * run, dtype=np.int64)
    wants = [{"/ckpt/f": np.stack([row_starts + r * run, row_starts + (r + 1) * run], axis=1)} for r in range(world)]
    spans = {"/ckpt/f": np.array([(t * size, (t + 1) * size) for t in range(10)], dtype=np.int64)}
    fp = plan_files(wants, spans)["/ckpt/f"]
    assert [fp.cost(r) for r in range(world)] == [15 << 28] * world  # 3.75 GiB
    groups = rounds({"/ckpt/f": fp}, world, 1 << 30, spans)
    assert [[(p.lo, p.hi) for p in g] for g in groups] == [
        [(0, 2 * size)],
        *([(t, t + 2 * size)] for t in (2 * size, 4 * size, 6 * size)),
        [(8 * size, END)],
    ]
    held = [[fp.section(p.lo, p.hi).cost(r) >> 20 for r in range(world)] for (p,) in groups]
    assert held == [[1024, 512], [1024, 512], [768, 768], [512, 1024], [512, 1024]]  # MiB


def test_a_column_shard_of_a_5_gib_file_is_cut_into_one_quarter_per_rank():
    """4 ranks, a run of each of 1000 rows each, over 5 GiB: bounds computed exactly (``size * cumulative wants``
    overflowed int64 past ~3 GB extents: shares lost, parcels assigned to holders that had not fetched them)."""
    run, world, rows = (5 << 30) // 4000, 4, 1000
    starts = [[(row * world + r) * run for row in range(rows)] for r in range(world)]
    everyone = [as_ranges([(a, a + run) for a in mine]) for mine in starts]
    c = shares(everyone)
    quarter = rows * run
    assert pairs(np.stack([c.starts, c.ends], axis=1)) == [(r * quarter, (r + 1) * quarter) for r in range(world)]
    assert c.holders.tolist() == list(range(world))
    for r, mine in enumerate(everyone):
        p = parcels(mine, c)
        assert nbytes(pairs(np.stack([p.starts, p.ends], axis=1))) == quarter
        assert p.sizes_from(r).sum() == quarter // world  # a quarter of its own runs lie in its own share


def shared_tensors(per_tensor: list[list[np.ndarray]], small: int) -> list[int]:
    """The tensors shared: those of a *group* (a maximal run of consecutive tensors each wanted by at least two
    ranks) where some rank wants at least two ranges of under ``small`` bytes on average."""
    n, world = len(per_tensor[0]), len(per_tensor)
    multi = [sum(len(per_tensor[r][k]) > 0 for r in range(world)) >= 2 for k in range(n)]
    out, k = [], 0
    while k < n:
        j = k
        while j + 1 < n and multi[j + 1] == multi[k]:
            j += 1
        group = range(k, j + 1)
        for mine in per_tensor:
            count, size = sum(len(mine[t]) for t in group), sum(nbytes(pairs(mine[t])) for t in group)
            if multi[k] and count >= 2 and size < small * count:
                out += group
                break
        k = j + 1
    return out


@SETTINGS
@given(st.data())
def test_sharing_decided_per_group_of_tensors(data):
    """With the tensors' spans: the extents are the wanted bytes of the shared tensors (:func:`shared_tensors`)
    merged across touching tensors; the other tensors are each rank's own (ranges of two tensors that touch come
    unmerged, as ranks send them)."""
    world = data.draw(worlds)
    per_tensor, spans = data.draw(file_tensors(world))
    small = data.draw(st.sampled_from([1, 3, SMALL_RANGE, 1 << 31]))
    everyone = [np.concatenate([np.zeros((0, 2), dtype=np.int64), *mine]) for mine in per_tensor]
    shared = shared_tensors(per_tensor, small)
    extents = merged(pair for mine in per_tensor for k in shared for pair in pairs(mine[k]))
    c = shares(everyone, spans, small)
    assert (c.ends > c.starts).all() and (c.starts[1:] >= c.ends[:-1]).all()
    assert merged(zip(c.starts, c.ends)) == extents, (per_tensor, spans, c)
    share_list = list(zip(c.starts.tolist(), c.ends.tolist(), c.holders.tolist()))
    for r, mine in enumerate(everyone):
        for a, b in extents:
            fetched = sum(e - s for s, e, h in share_list if h == r and a <= s and e <= b)
            assert fetched <= nbytes(intersect(pairs(mine), [(a, b)])), (r, (a, b))
        p = parcels(mine, c)
        assert merged(zip(p.starts, p.ends)) == intersect(pairs(mine), extents), (r, per_tensor, spans)
        for a, b, h in zip(p.starts.tolist(), p.ends.tolist(), p.holders.tolist()):
            assert any(s <= a and b <= e and h == k for s, e, k in share_list), ((a, b, h), share_list)
    if small == SMALL_RANGE:  # plan_files decides with the default
        plans = plan_files([{"/ckpt/f": mine} for mine in everyone], {"/ckpt/f": spans})
        assert sorted(plans) == (["/ckpt/f"] if extents else [])
