"""Composing a traced conversion with the inverse of another (issue 17): g over checkpoint keys, read through f^-1."""

import math
import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import regiontrace as rt
from regiontrace.executor import execute_blocks
from regiontrace.testing import programs, random_box, random_tensor, same_values
from regiontrace.testing.strategies import DTYPES, _unary_ops

BF16, F32 = torch.bfloat16, torch.float32
SETTINGS = settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]
)


def leaf(name, shape, dtype=F32):
    return rt.RegionTensor.leaf(name, shape, dtype)


@dataclass(frozen=True)
class Reads:
    """A random conversion g over named keys: per output, a key (or two cut together) and a chain of movement ops."""

    outs: tuple

    def __call__(self, **keys):
        out = {}
        for name, (srcs, dim, ops) in self.outs:
            x = keys[srcs[0]] if len(srcs) == 1 else torch.cat([keys[s] for s in srcs], dim)
            for fn in ops:
                x = fn(x)
            out[name] = x
        return out


@st.composite
def reads(draw, specs):
    """Random g over ``specs`` (name -> (shape, dtype)): unary chains (casts, slices, broadcasts included)."""
    names = sorted(specs)
    outs = []
    for i in range(draw(st.integers(1, 3))):
        srcs = (draw(st.sampled_from(names)),)
        shape, dtype = specs[srcs[0]]
        dim = 0
        same = [n for n in names if specs[n] == specs[srcs[0]]]
        if shape and draw(st.integers(0, 3)) == 0:
            srcs = srcs + (draw(st.sampled_from(same)),)
            dim = draw(st.integers(0, len(shape) - 1))
            shape = shape[:dim] + (2 * shape[dim],) + shape[dim + 1 :]
        ops = []
        for _ in range(draw(st.integers(0, 5))):
            _, fn, new_shape, new_dtype = _unary_ops(draw, shape, dtype)
            if math.prod(new_shape) > 4096:
                continue
            ops.append(fn)
            shape, dtype = new_shape, new_dtype
        outs.append((f"g{i}", (srcs, dim, tuple(ops))))
    return Reads(tuple(outs))


@st.composite
def bijective_cuts(draw):
    """f: one key cut into parts (slices, strided slices), each moved; every element read once."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES[:4]))
    ops = []

    def cut(path, shape, depth):
        d = draw(st.integers(0, len(shape) - 1))
        if depth >= 2 or shape[d] < 2 or draw(st.integers(0, 2)) == 0:
            ops.append((path, draw(st.sampled_from(["none", "t", "flip", "flatten", "float", "rope"]))))
            return
        n = shape[d]
        if draw(st.booleans()):
            k = draw(st.integers(2, n))
            parts = [(slice(r, None, k), len(range(r, n, k))) for r in range(k)]
        else:
            cuts = sorted(set(draw(st.lists(st.integers(1, n - 1), min_size=1, max_size=3))))
            parts = [(slice(a, b), b - a) for a, b in zip([0] + cuts, cuts + [n])]
        for sl, size in parts:
            cut(path + ((d, sl),), shape[:d] + (size,) + shape[d + 1 :], depth + 1)

    cut((), shape, 0)

    def move(y, how):
        if how == "rope" and y.ndim and y.shape[-1] % 2 == 0:  # interleave halves: view + transpose + reshape
            return y.reshape(*y.shape[:-1], 2, y.shape[-1] // 2).transpose(-1, -2).reshape(y.shape)
        if how == "t" and y.ndim > 1:
            return y.mT
        if how == "float" and y.dtype in (BF16, torch.float16):
            return y.float()
        return {"flip": lambda: y.flip(0), "flatten": lambda: y.reshape(-1)}.get(how, lambda: y)()

    def convert(x):
        out = {}
        for i, (path, how) in enumerate(ops):
            y = x
            for d, sl in path:
                y = y[(slice(None),) * d + (sl,)]
            out[f"part{i}"] = move(y, how)
        return out

    return {"x": (shape, dtype)}, convert


def check_composed(f, g, specs, seed, boxes=3):
    """T = f(K), D = g(K) real; the composed map on T gives D bit for bit, whole and box by box."""
    keys = {n: leaf(n, s, d) for n, (s, d) in specs.items()}
    traced_f = rt.trace(f, **keys)
    inverse = rt.invert(traced_f, keys)
    composed = rt.compose(rt.trace(g, **keys), inverse)
    gen = torch.Generator().manual_seed(seed)
    real = {n: random_tensor(s, d, gen) for n, (s, d) in specs.items()}
    targets = {n: v.contiguous() for n, v in f(**real).items()}
    want = g(**real)
    rng = random.Random(seed)
    for name, d in want.items():
        got = rt.materialize(composed[name], targets)
        assert same_values(got, d.contiguous()), name
        if composed[name].is_index_map:
            for _ in range(boxes):
                box = random_box(d.shape, rng)
                out = torch.empty([b - a for a, b in box], dtype=d.dtype)
                execute_blocks(composed[name].remap_blocks(box), targets, out)
                assert same_values(out, d[tuple(slice(a, b) for a, b in box)]), (name, box)
    return composed


@settings(SETTINGS, max_examples=100)  # most random programs are not bijective: many are drawn per example
@given(st.data(), st.integers(0, 2**32 - 1))
def test_composed_map_on_the_targets_is_g_on_the_keys(data, seed):
    """f: a random program (filtered to the bijective ones); g: random reads of its keys."""
    program = data.draw(programs(max_leaves=3))
    leaves = {n: leaf(n, s, d) for n, s, d in program.leaves}
    out = rt.trace(program, **leaves)
    specs = {n: (tuple(t.shape), t.dtype) for n, t in leaves.items()}
    assume(all(n in out.sources() for n in specs))
    try:
        inverse = rt.invert({"out": out}, leaves)
    except rt.NotInvertible:
        assume(False)
    g = data.draw(reads(specs))
    composed = check_composed(lambda **k: {"out": program(**k)}, g, specs, seed)
    regions = rt.inverse_regions(inverse)
    rerun, traced_g = g(**regions), rt.trace(g, **leaves)
    most = max(len(r.region.pieces) for r in regions.values())
    for name, t in composed.items():  # compact: about g's pieces times the inverse's, or g run on the inverse regions
        if t.is_index_map:
            bound = max(len(traced_g[name].region.pieces) * most, len(rerun[name].region.pieces))
            assert len(t.region.pieces) <= 2 * bound + 2, (program, g)


@SETTINGS
@given(st.data(), st.integers(0, 2**32 - 1))
def test_composed_cuts_of_one_key(data, seed):
    """f: a key cut into many parts (strided and contiguous slices, transposes, flips, rope interleaves, casts)."""
    specs, convert = data.draw(bijective_cuts())
    check_composed(lambda x: convert(x), data.draw(reads(specs)), specs, seed)


@SETTINGS
@given(st.data())
def test_running_g_on_the_inverse_regions_is_the_composition(data):
    specs, convert = data.draw(bijective_cuts())
    g = data.draw(reads(specs))
    keys = {n: leaf(n, s, d) for n, (s, d) in specs.items()}
    inverse = rt.invert(rt.trace(convert, keys["x"]), keys)
    direct = rt.compose(rt.trace(g, **keys), inverse)
    rerun = g(**rt.inverse_regions(inverse))
    gen = torch.Generator().manual_seed(0)
    real = {n: random_tensor(s, d, gen) for n, (s, d) in specs.items()}
    targets = {n: v.contiguous() for n, v in convert(real["x"]).items()}
    for name in direct:
        assert same_values(rt.materialize(direct[name], targets), rt.materialize(rerun[name], targets))


# ---------------------------------------------------------------------------------------------------
# the layouts of issue 17


def moe_keys(E, I, H, dtype=BF16):
    keys = {}
    for e in range(E):
        for p in ("gate_proj", "up_proj", "down_proj"):
            shape = (H, I) if p == "down_proj" else (I, H)
            keys[f"experts.{e}.{p}.weight"] = (shape, dtype)
    for p, rows in (("q_proj", 2 * H), ("k_proj", H // 2), ("v_proj", H // 2)):
        keys[f"{p}.weight"] = ((rows, H), dtype)
    return keys


def trainer(E, heads=4):
    """f: transformers' Qwen3-MoE layout: experts fused as gate_up (E, 2I, H) and down (E, H, I)."""

    def f(**k):
        gate = torch.stack([k[f"experts.{e}.gate_proj.weight"] for e in range(E)])
        up = torch.stack([k[f"experts.{e}.up_proj.weight"] for e in range(E)])
        out = {
            "mlp.experts.gate_up_proj": torch.cat([gate, up], dim=1),
            "mlp.experts.down_proj": torch.stack([k[f"experts.{e}.down_proj.weight"] for e in range(E)]),
        }
        for p in ("q_proj", "k_proj", "v_proj"):
            out[f"attn.{p}.weight"] = k[f"{p}.weight"]
        return out

    return f


def engine(E, tp, heads=4):
    """g: an inference engine's layout: qkv fused per TP rank with a rope permute of q and k, gate_up fused per TP
    rank as (E, 2I, H) with [gate_r; up_r] blocks, down as (E, H, I)."""

    def rope(w, n):
        d = w.shape[0] // n
        return w.reshape(n, d // 2, 2, -1).transpose(1, 2).reshape(w.shape)

    def g(**k):
        q = rope(k["q_proj.weight"], heads)
        kk = rope(k["k_proj.weight"], heads // 2)
        v = k["v_proj.weight"]
        qkv = torch.cat([torch.cat([a, b, c]) for a, b, c in zip(q.chunk(tp), kk.chunk(tp), v.chunk(tp))])
        gate = torch.stack([k[f"experts.{e}.gate_proj.weight"] for e in range(E)])
        up = torch.stack([k[f"experts.{e}.up_proj.weight"] for e in range(E)])
        gate_up = torch.cat([torch.cat([a, b], dim=1) for a, b in zip(gate.chunk(tp, 1), up.chunk(tp, 1))], dim=1)
        down = torch.stack([k[f"experts.{e}.down_proj.weight"] for e in range(E)])
        return {"qkv_proj.weight": qkv, "experts.w13_weight": gate_up, "experts.w2_weight": down}

    return g


def test_qwen_moe_trainer_to_engine_with_fused_qkv_and_rope():
    E, I, H, tp = 4, 8, 16, 2
    specs = moe_keys(E, I, H)
    composed = check_composed(trainer(E), engine(E, tp), specs, seed=1)
    assert composed["qkv_proj.weight"].sources() == {"attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"}
    assert composed["experts.w13_weight"].sources() == {"mlp.experts.gate_up_proj"}
    assert len(composed["experts.w13_weight"].region.pieces) == 2 * tp  # [gate_r; up_r] per rank, all experts
    assert len(composed["experts.w2_weight"].region.pieces) == 1


def test_composition_of_a_huge_model_is_symbolic():
    """Sizes of a large MoE layer (10^9 elements per tensor): pieces follow the layout, not the elements."""
    E, I, H, tp = 64, 2048, 4096, 8
    specs = moe_keys(E, I, H)
    keys = {n: leaf(n, s, d) for n, (s, d) in specs.items()}
    inverse = rt.invert(rt.trace(trainer(E), **keys), keys)
    composed = rt.compose(rt.trace(engine(E, tp), **keys), inverse)
    gate_up = composed["experts.w13_weight"]
    assert gate_up.numel() > 10**9 and gate_up.sources() == {"mlp.experts.gate_up_proj"}
    assert len(gate_up.region.pieces) == 2 * tp
    assert len(composed["qkv_proj.weight"].region.pieces) == 3 * tp
    regions = rt.inverse_regions(inverse)
    assert all(len(r.region.pieces) == 1 for r in regions.values())
    back = rt.compose(rt.trace(trainer(E), **keys), rt.invert(rt.trace(engine(E, tp), **keys), keys))
    assert len(back["mlp.experts.gate_up_proj"].region.pieces) == 2 * tp
    assert all(len(back[f"attn.{p}.weight"].region.pieces) == tp for p in ("q_proj", "k_proj", "v_proj"))


def test_identity_and_casts_narrow_back_exactly():
    w = leaf("w", (6, 4), BF16)
    inverse = rt.invert({"w32": w.float().t()}, [w])
    same = rt.compose({"w": w}, inverse)["w"]
    (piece,) = same.region.pieces
    assert piece.source.name == "w32" and piece.casts == (BF16,)
    wide = rt.compose({"w": w.double()}, inverse)["w"]
    assert wide.region.pieces[0].casts == (torch.float64,)
    back = rt.compose({"w": w.float()}, inverse)["w"]
    assert back.region.pieces[0].casts == ()
    real = torch.randn(6, 4).to(BF16)
    targets = {"w32": real.float().t().contiguous()}
    assert torch.equal(rt.materialize(same, targets), real)
    assert torch.equal(rt.materialize(wide, targets), real.double())


def test_pointwise_values_of_g_compose_over_regions():
    w, s = leaf("w", (4, 6), BF16), leaf("s", (4, 1), F32)
    inverse = rt.invert({"wt": w.t(), "s": s.reshape(4)}, [w, s])
    composed = rt.compose({"y": w.float() * s}, inverse)["y"]
    assert not composed.is_index_map and composed.sources() == {"wt", "s"}
    real_w, real_s = torch.randn(4, 6).to(BF16), torch.randn(4, 1)
    got = rt.materialize(composed, {"wt": real_w.t().contiguous(), "s": real_s.reshape(4)})
    assert torch.equal(got, real_w.float() * real_s)


def test_refusals():
    w = leaf("w", (6, 4))
    with pytest.raises(rt.NotInvertible, match="never written"):
        rt.invert({"half": w[:3]}, [w])
    inverse = rt.invert({"w": w}, [w])
    with pytest.raises(ValueError, match="does not rebuild"):
        rt.compose({"y": leaf("other", (2,))}, inverse)
    with pytest.raises(ValueError, match="is read as"):
        rt.compose({"y": leaf("w", (4, 6))}, inverse)
    with pytest.raises(ValueError, match="named outputs"):
        rt.compose(w, rt.invert(w.t(), [w]))


def test_engine_to_trainer_undoes_the_rope_permute_and_the_tp_fusion():
    """The other direction: f = the engine's fused, rope-permuted layout, g = the trainer's."""
    E, I, H, tp = 4, 8, 16, 2
    composed = check_composed(engine(E, tp), trainer(E), moe_keys(E, I, H), seed=2)
    assert composed["mlp.experts.gate_up_proj"].sources() == {"experts.w13_weight"}
    assert len(composed["mlp.experts.down_proj"].region.pieces) == 1
    assert composed["attn.v_proj.weight"].sources() == {"qkv_proj.weight"}


def test_a_lattice_that_is_not_chained_splits_along_its_fewest_digits():
    """Columns 0 and 2 of 3 (strides 2 and 3 do not divide): split per column, whatever the rows."""

    def f(k):
        return {"even": k[:, ::2], "odd": k[:, 1::2]}

    k = leaf("k", (5, 3))
    regions = rt.inverse_regions(rt.invert(rt.trace(f, k), [k]))
    assert len(regions["k"].region.pieces) == 3
    check_composed(f, lambda k: {"y": k.t()}, {"k": ((5, 3), F32)}, seed=3)
    big = leaf("k", (100_000, 3))  # invert checks its 300 000 runs; the inverse has 3 pieces
    inverse = rt.invert(rt.trace(f, big), [big])
    assert len(rt.inverse_regions(inverse)["k"].region.pieces) == 3
    assert len(rt.compose({"y": big.t()}, inverse)["y"].region.pieces) == 3
