"""Inverting a trace (issue 10): the bijection check, the scatter back into sources, packed source runs."""

import math
import random
import re

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import regiontrace as rt
from regiontrace.executor import packed_source_runs, scatter_blocks
from regiontrace.invert import RUN_BUDGET, _lattice, _verify_source
from regiontrace.testing import code_tensors, programs, random_box, random_tensor

BF16, F32 = torch.bfloat16, torch.float32
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SENTINEL = -1


def leaf(name, shape, dtype=F32):
    return rt.RegionTensor.leaf(name, shape, dtype)


def brute_counts(outputs, specs):
    """Per source, how often each element is read: enumerated element by element from the full-box blocks."""
    counts = {n: torch.zeros(math.prod(shape), dtype=torch.int64) for n, (shape, _) in specs.items()}
    for t in outputs.values():
        for b in t.remap_blocks():
            offsets = torch.tensor([b.src_offset])
            for n, s in zip(b.shape, b.src_strides):
                offsets = (offsets[:, None] + torch.arange(n) * s).reshape(-1)
            counts[b.source] += torch.bincount(offsets, minlength=counts[b.source].numel())
    return counts


def index_in(message):
    return tuple(int(i) for i in re.search(r"index \(([\d, ]*)\)", message).group(1).split(",") if i.strip())


def check_refusal(err, counts, specs):
    """A refusal's reason and the element its message names agree with the element-by-element counts."""
    name = err.source
    if err.reason == "dropped" and "no output reads it" in str(err):
        assert int(counts[name].sum()) == 0
    elif err.reason in ("dropped", "duplicate") and "index" not in str(err):  # decided by the count alone
        total, numel = int(counts[name].sum()), counts[name].numel()
        assert total < numel if err.reason == "dropped" else total > numel
    elif err.reason in ("dropped", "duplicate"):
        flat = counts[name].reshape(specs[name][0])[index_in(str(err))]
        assert (flat == 0) if err.reason == "dropped" else (flat >= 2), str(err)
    elif err.reason == "broadcast":
        assert int(counts[name].max()) >= 2
    elif err.reason == "unverifiable":
        assert int(counts[name].sum()) == counts[name].numel()
    else:
        assert err.reason == "cast", err.reason


# ---------------------------------------------------------------------------------------------------
# properties over random op chains


def traced_program(program, dtype=None):
    leaves = {n: leaf(n, s, dtype or d) for n, s, d in program.leaves}
    return leaves, rt.trace(program, **leaves)


@SETTINGS
@given(programs())
def test_check_says_bijective_exactly_when_every_element_is_read_once(program):
    leaves, out = traced_program(program)
    specs = {n: (t.shape, t.dtype) for n, t in leaves.items()}
    counts = brute_counts({"out": out}, specs)
    bijective = all(bool((c == 1).all()) for c in counts.values())
    try:
        rt.invert({"out": out}, leaves)
    except rt.NotInvertible as err:
        check_refusal(err, counts, specs)
        assert not bijective or err.reason == "cast", (program, str(err))
        assert err.reason != "cast" or any(p.casts for p in out.region.pieces)
    else:
        assert bijective, program


@SETTINGS
@given(programs())
def test_level_regrouping_agrees_with_element_counts(program):
    """Force the regrouped check (no plain runs at all): it decides exactly, or says it cannot."""
    leaves, out = traced_program(program)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in leaves.items()}
    counts = brute_counts({"out": out}, specs)
    lattices = {n: [] for n in specs}
    try:
        for p in out.region.pieces:
            lattices[p.source.name].append(_lattice(0, "out", p))
    except rt.NotInvertible as err:
        assert err.reason == "broadcast" and int(counts[err.source].max()) >= 2
        return
    for name, (shape, _) in specs.items():
        once = bool((counts[name] == 1).all())
        try:
            _verify_source(name, shape, lattices[name], ["out"], run_budget=0)
        except rt.NotInvertible as err:
            check_refusal(err, counts, specs)
            assert not once or err.reason == "unverifiable", (program, str(err))
        else:
            assert once, program


@SETTINGS
@given(programs(), st.integers(0, 2**32 - 1))
def test_scatter_after_forward_is_the_identity_on_codes(program, seed):
    """Unique codes through the real program and back through the inverse give the codes again; a box writes
    exactly the source elements it maps from, and its packed runs write the same."""
    leaves, out = traced_program(program, torch.int64)
    assume(not any(p.casts for p in out.region.pieces))
    used = {n: t for n, t in leaves.items() if n in out.sources() or t.numel() == 0}
    try:
        inverse = rt.invert(out, used)
    except rt.NotInvertible:
        assume(False)
    codes = code_tensors({n: (t.shape, t.dtype) for n, t in used.items()})
    real = program(**{n: codes.get(n, torch.zeros(t.shape, dtype=t.dtype)) for n, t in leaves.items()})
    back = inverse.unmaterialize(real)
    assert back.keys() == codes.keys()
    for n in codes:
        assert torch.equal(back[n], codes[n]), program
    rng = random.Random(seed)
    for _ in range(4):
        box = random_box(real.shape, rng)
        values = real[tuple(slice(a, b) for a, b in box)]
        written = inverse.scatter(values, {n: torch.full_like(c, SENTINEL) for n, c in codes.items()}, box=box)
        packed = {n: torch.full_like(c, SENTINEL).reshape(-1) for n, c in codes.items()}
        for block in inverse.blocks(box=box):
            runs = packed_source_runs(block, values)
            assert bool((runs.starts[1:] >= runs.starts[:-1] + runs.run_length).all()), "runs overlap or unsorted"
            where = (runs.starts[:, None] + torch.arange(runs.run_length)).reshape(-1)
            packed[block.source][where] = runs.values
        for n, c in codes.items():
            inside = torch.isin(c, values.reshape(-1))
            expected = torch.where(inside, c, torch.full_like(c, SENTINEL))
            assert torch.equal(written[n], expected), (program, box, n)
            assert torch.equal(packed[n].reshape(c.shape), expected), (program, box, n)


@SETTINGS
@given(programs(), st.integers(0, 2**32 - 1))
def test_round_trip_with_real_dtypes_and_widening_casts(program, seed):
    """With the program's own dtypes, exact widening casts included, forward then back restores the values."""
    leaves, out = traced_program(program)
    try:
        inverse = rt.invert(out, leaves)
    except rt.NotInvertible:
        assume(False)
    gen = torch.Generator().manual_seed(seed)
    data = {n: random_tensor(t.shape, t.dtype, gen) for n, t in leaves.items()}
    back = inverse.unmaterialize(program(**{n: t.clone() for n, t in data.items()}))
    for n, t in data.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), program


@st.composite
def partitions(draw):
    """A leaf cut into parts (contiguous or strided slices along random dims, recursively), each part moved
    (transposed, flipped, flattened), as named outputs; sometimes a part is dropped or used twice."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    ops = []

    def cut(path, shape, depth):
        d = draw(st.integers(0, len(shape) - 1))
        if depth >= 2 or shape[d] < 2 or draw(st.integers(0, 2)) == 0:
            move = draw(st.sampled_from(["none", "t", "flip", "flatten"]))
            ops.append((path, move))
            return
        n = shape[d]
        if draw(st.booleans()):  # strided: every k-th element from offset r
            k = draw(st.integers(2, n))
            parts = [(slice(r, None, k), len(range(r, n, k))) for r in range(k)]
        else:
            cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=3))))
            parts = [(slice(a, b), b - a) for a, b in zip([0] + cuts, cuts + [n])]
        for sl, size in parts:
            sub = shape[:d] + (size,) + shape[d + 1 :]
            cut(path + ((d, sl),), sub, depth + 1)

    cut((), shape, 0)
    if draw(st.integers(0, 3)) == 0:
        i = draw(st.integers(0, len(ops) - 1))
        ops = ops[:i] + ops[i + 1 :] if draw(st.booleans()) else ops + [ops[i]]

    def convert(x):
        out = {}
        for i, (path, move) in enumerate(ops):
            y = x
            for d, sl in path:
                y = y[(slice(None),) * d + (sl,)]
            y = {"none": y, "t": y.mT if y.ndim > 1 else y, "flip": y.flip(0), "flatten": y.reshape(-1)}[move]
            out[f"part{i}"] = y
        return out

    return shape, convert


@SETTINGS
@given(partitions(), st.sampled_from([RUN_BUDGET, 0]))
def test_partitions_of_one_source(case, run_budget):
    """Multi-output cuts of one source: the check (plain runs, or the regrouped levels) agrees with element
    counts, and a bijective cut scatters the real parts back into the source."""
    shape, convert = case
    x = leaf("x", shape, torch.int64)
    outs = rt.trace(convert, x)
    specs = {"x": (shape, torch.int64)}
    counts = brute_counts(outs, specs)
    once = bool((counts["x"] == 1).all())
    names = list(outs)
    lattices = [_lattice(names.index(n), n, p) for n, t in outs.items() for p in t.region.pieces]
    try:
        _verify_source("x", shape, lattices, names, run_budget=run_budget)
    except rt.NotInvertible as err:
        check_refusal(err, counts, specs)
        assert not once and err.reason != "unverifiable" or run_budget == 0, str(err)
        return
    assert once
    codes = code_tensors(specs)
    back = rt.invert(outs, [x]).unmaterialize(convert(codes["x"]))
    assert torch.equal(back["x"], codes["x"])


def test_regrouped_levels_refuse_to_guess_across_a_carry():
    """A part that starts off a level boundary (a carry) is no box of levels: the regrouping says it cannot
    decide (rather than misreading the part as another box), and the plain runs decide."""
    x = leaf("x", (8,))
    outs = {"mid": x[2:6], "head": x[:2], "tail": x[6:]}
    names = list(outs)
    lattices = [_lattice(names.index(n), n, p) for n, t in outs.items() for p in t.region.pieces]
    with pytest.raises(rt.NotInvertible, match="no compact regrouping") as err:
        _verify_source("x", (8,), lattices, names, run_budget=0)
    assert err.value.reason == "unverifiable"
    _verify_source("x", (8,), lattices, names)
    rt.invert(outs, [x])


# ---------------------------------------------------------------------------------------------------
# the conversions people use


def round_trip(fn, **inputs):
    """Trace ``fn``, invert it, and check that the real outputs scatter back to the real inputs."""
    leaves = {n: leaf(n, s, d) for n, (s, d) in inputs.items()}
    traced = rt.trace(fn, **leaves)
    inverse = rt.invert(traced, leaves)
    gen = torch.Generator().manual_seed(0)
    data = {n: random_tensor(s, d, gen) for n, (s, d) in inputs.items()}
    back = inverse.unmaterialize(fn(**{n: t.clone() for n, t in data.items()}))
    assert back.keys() == data.keys()
    for n, t in data.items():
        assert back[n].dtype == t.dtype and torch.equal(back[n], t), n
    return traced, inverse, data


def test_moe_expert_stack_and_gate_up_cat():
    E, I, H = 4, 6, 8

    def convert(**w):
        gate = torch.stack([w[f"e{e}.gate"] for e in range(E)])
        up = torch.stack([w[f"e{e}.up"] for e in range(E)])
        return {"gate_up": torch.cat([gate, up], 1), "down": torch.stack([w[f"e{e}.down"] for e in range(E)])}

    inputs = {f"e{e}.{p}": ((I, H), BF16) for e in range(E) for p in ("gate", "up")}
    inputs.update({f"e{e}.down": ((H, I), BF16) for e in range(E)})
    traced, inverse, data = round_trip(convert, **inputs)
    # an expert-parallel shard writes only its experts' sources, and all of them
    real = convert(**data)["gate_up"]
    fresh = {n: torch.zeros(s, dtype=d) for n, (s, d) in inputs.items()}
    inverse.scatter(real[2:4], fresh, target="gate_up", box=((2, 4), (0, 2 * I), (0, H)))
    for n in fresh:
        expert, part = n.split(".")
        hit = part in ("gate", "up") and expert in ("e2", "e3")
        assert torch.equal(fresh[n], data[n]) if hit else not fresh[n].any(), n
    # a tensor-parallel shard (half the rows of each of gate and up) writes half of every gate and up
    fresh = {n: torch.zeros(s, dtype=d) for n, (s, d) in inputs.items()}
    box = ((0, E), (0, I // 2), (0, H))
    inverse.scatter(real[:, : I // 2], fresh, target="gate_up", box=box)
    assert torch.equal(fresh["e1.gate"][: I // 2], data["e1.gate"][: I // 2]) and not fresh["e1.gate"][I // 2 :].any()
    assert not fresh["e1.up"].any()


def test_qkv_cat_rope_chunk_transpose_flip():
    round_trip(lambda q, k, v: torch.cat([q, k, v]), q=((16, 8), BF16), k=((4, 8), BF16), v=((4, 8), BF16))
    h, d, n = 4, 32, 6
    rope = lambda w: w.view(h, 2, d // h // 2, n).transpose(1, 2).reshape(d, n)
    traced, _, _ = round_trip(rope, w=((d, n), BF16))
    assert len(traced.region.pieces) == 1
    round_trip(lambda w: dict(zip(("gate", "up"), w.chunk(2))), w=((12, 5), F32))
    round_trip(lambda w: w.t(), w=((7, 3), F32))
    round_trip(lambda w: w.flip(0).transpose(0, 1).reshape(-1), w=((5, 4), torch.int32))
    round_trip(lambda w: torch.cat([w[:, ::2], w[:, 1::2]], 1), w=((3, 8), F32))  # de-interleave
    round_trip(lambda w: torch.cat([w[:, ::2], w[:, 1::2]], 1), w=((3, 5), F32))  # odd: strided runs
    round_trip(lambda a, b: torch.stack([a, b], -1).flatten(-2), a=((3, 6), BF16), b=((3, 6), BF16))


def test_widening_cast_inverts_and_narrows_back():
    traced, _, data = round_trip(lambda g, u: torch.cat([g, u]), g=((4, 3), BF16), u=((4, 3), F32))
    assert traced.dtype == F32 and traced.region.pieces[0].casts == (F32,)


def test_scatter_writes_through_flips_into_the_source():
    w = leaf("w", (4, 3))
    out = w.flip(0, 1)
    blocks = out.remap_blocks(((1, 3), (0, 3)))
    assert any(s < 0 for b in blocks for s in b.src_strides)
    real = torch.arange(12.0).reshape(4, 3)
    into = {"w": torch.zeros(4, 3)}
    scatter_blocks(blocks, real.flip(0, 1)[1:3], into)
    assert torch.equal(into["w"][1:3], real[1:3]) and not into["w"][0].any() and not into["w"][3].any()


def test_packed_source_runs_of_a_transposed_box():
    w = leaf("w", (4, 6))
    out = w.t()  # (6, 4): a box of output rows 2..5 reads source columns 2..5 of every row
    (block,) = out.remap_blocks(((2, 5), (0, 4)))
    real = torch.arange(24.0).reshape(4, 6)
    runs = packed_source_runs(block, real.t()[2:5])
    assert runs.starts.tolist() == [2, 8, 14, 20] and runs.run_length == 3
    assert runs.values.tolist() == real[:, 2:5].reshape(-1).tolist()
    bf16 = packed_source_runs(block, real.t()[2:5].to(F32).to(torch.float64))
    assert bf16.values.dtype == F32  # packed in the source's dtype


def test_a_huge_interleave_is_checked_without_enumerating_elements():
    x = leaf("x", (1 << 20, 1 << 20), BF16)  # 2**40 elements, one element per plain run
    rt.invert(torch.cat([x[:, ::2], x[:, 1::2]], 1), [x])
    with pytest.raises(rt.NotInvertible) as err:
        rt.invert(x[:, ::2], [x])
    assert str(err.value) == (
        "source 'x' (1048576, 1048576): 549755813888 of 1099511627776 elements are never written, the first at "
        "index (0, 1): the conversion drops them (a slice?)"
    )
    with pytest.raises(rt.NotInvertible, match=r"read twice by outputs 'a' and 'b'") as err:
        rt.invert({"a": x[:, ::2], "b": x[:, ::2], "c": x[:, 1::2]}, [x])
    assert err.value.reason == "duplicate"
    odd = leaf("y", (4097, 4095))  # stride 2 does not divide the size: no regrouping, too many runs
    flat = odd.reshape(-1)
    with pytest.raises(rt.NotInvertible, match="no compact regrouping") as err:
        rt.invert(torch.cat([flat[::2], flat[1::2]]), [odd])
    assert err.value.reason == "unverifiable"


# ---------------------------------------------------------------------------------------------------
# refusals, each with its message


def test_refuses_a_slice_that_drops_rows():
    w = leaf("w", (8, 4))
    with pytest.raises(rt.NotInvertible) as err:
        rt.invert({"head": w[:6]}, {"w": w})
    assert str(err.value) == (
        "source 'w' (8, 4): 8 of 32 elements are never written, the first at index (6, 0): the conversion drops "
        "them (a slice?)"
    )
    assert (err.value.source, err.value.reason) == ("w", "dropped")
    assert isinstance(err.value, rt.Untraceable)


def test_refuses_a_broadcast():
    b = leaf("bias", (1, 4))
    with pytest.raises(rt.NotInvertible) as err:
        rt.invert({"bias": b.expand(3, 4)}, [b])
    assert str(err.value) == (
        "output 'bias' reads elements of source 'bias' 3 times each along output dim 0: a broadcast "
        "(expand/repeat) has no inverse"
    )
    assert err.value.reason == "broadcast"


def test_refuses_a_narrowing_cast():
    w = leaf("w", (2, 2), F32)
    with pytest.raises(rt.NotInvertible) as err:
        rt.invert({"w": w.to(BF16)}, [w])
    assert str(err.value) == (
        "output 'w' reads source 'w' (torch.float32) through a cast torch.float32 -> torch.bfloat16, which is not "
        "exact: its inverse cannot restore the source values (only exact widenings such as bfloat16 -> float32 "
        "invert)"
    )
    i64 = leaf("n", (3,), torch.int64)
    with pytest.raises(rt.NotInvertible, match="torch.int64 -> torch.float64, which is not exact"):
        rt.invert(i64.double(), [i64])


def test_refuses_a_source_used_twice_and_a_source_never_read():
    w, u = leaf("w", (2, 3)), leaf("unused", (5,))
    with pytest.raises(rt.NotInvertible) as err:
        rt.invert({"embed": w, "lm_head": w}, [w])
    assert str(err.value) == (
        "source 'w' (2, 3): 6 extra reads, the first of index (0, 0) read twice by outputs 'embed' and "
        "'lm_head' (broadcast/expand, or the source used twice)"
    )
    with pytest.raises(rt.NotInvertible) as err:
        rt.invert(w.t(), [w, u])
    assert str(err.value) == "source 'unused' (5,) is never written: no output reads it (the conversion drops it)"


def test_argument_errors():
    w = leaf("w", (2, 3))
    with pytest.raises(ValueError, match="reads source 'w', which is not among the sources"):
        rt.invert(w, {"v": ((2, 3), F32)})
    with pytest.raises(ValueError, match=r"reads source 'w' as \(2, 3\) torch.float32, the sources give \(3, 2\)"):
        rt.invert(w, {"w": ((3, 2), F32)})
    with pytest.raises(ValueError, match="not a leaf"):
        rt.invert(w, {"w": w.t()})
    inverse = rt.invert({"o": w.t()}, {"w": ((2, 3), F32)})
    with pytest.raises(KeyError, match="no output 'x'"):
        inverse.blocks("x")
    with pytest.raises(ValueError, match=r"values have shape \(2, 3\), the box has shape \(3, 2\)"):
        inverse.scatter(torch.zeros(2, 3), {"w": torch.zeros(2, 3)}, target="o")
    with pytest.raises(ValueError, match="C-contiguous"):
        inverse.scatter(torch.zeros(3, 2), {"w": torch.zeros(3, 2).t()}, target="o")
    with pytest.raises(KeyError, match="no tensor given for source 'w'"):
        inverse.scatter(torch.zeros(3, 2), {}, target="o")
    with pytest.raises(KeyError, match="no values given for output 'o'"):
        inverse.unmaterialize({})
    with pytest.raises(ValueError, match="broadcasts"):
        packed_source_runs(leaf("b", (1, 2)).expand(3, 2).remap_blocks()[0], torch.zeros(3, 2))


def test_unmaterialize_function_and_empty_sources():
    w, e = leaf("w", (2, 3)), leaf("e", (0, 3))
    back = rt.unmaterialize({"o": torch.cat([w, e]).t()}, {"o": torch.arange(6.0).reshape(2, 3).t()}, [w, e])
    assert torch.equal(back["w"], torch.arange(6.0).reshape(2, 3)) and back["e"].shape == (0, 3)
