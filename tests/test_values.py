"""Pointwise value ops over regions (regiontrace.values): FP8 block dequantization traced and compiled per box,
bit for bit against torch and transformers; what is refused. Random chains: tests/test_algebra_properties.py."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import regiontrace as rt
from regiontrace.testing import assert_converter_exact, check_values, random_box

E4M3 = torch.float8_e4m3fn
F32, BF16 = torch.float32, torch.bfloat16


def dequantize(w: torch.Tensor, scale_inv: torch.Tensor, quant_block: tuple[int, int], dtype=BF16) -> torch.Tensor:
    """Block dequantization for any shape: element (i, j) times scale_inv[i // bm, j // bn]."""
    rows, cols = w.shape
    bm, bn = quant_block
    s = scale_inv.to(F32).repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    return (w.to(F32) * s).to(dtype)


def _fp8(shape, gen):
    return (torch.randn(shape, generator=gen) * 100).to(E4M3)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 300),
    st.integers(1, 300),
    st.sampled_from([(128, 128), (1, 32), (64, 32), (16, 48), (7, 5)]),
    st.integers(0, 2**31 - 1),
)
def test_block_dequantization_reads_the_box_and_its_scale_blocks(rows, cols, quant_block, seed):
    bm, bn = quant_block
    grid = (math.ceil(rows / bm), math.ceil(cols / bn))
    gen = torch.Generator().manual_seed(seed)
    data = {"w": _fp8((rows, cols), gen), "s": torch.rand(grid, generator=gen) + 0.01}
    traced = rt.trace(
        lambda w, s: dequantize(w, s, quant_block),
        rt.RegionTensor.leaf("w", (rows, cols), E4M3),
        rt.RegionTensor.leaf("s", grid),
    )
    real = dequantize(data["w"], data["s"], quant_block)
    rng = random.Random(seed)
    for _ in range(4):
        box = random_box((rows, cols), rng)
        (r0, r1), (c0, c1) = box
        check_values(traced, box, data, real[r0:r1, c0:c1])
        program = traced.value_program(box)
        by_source = {}
        for b in program.blocks:
            by_source[b.source] = by_source.get(b.source, 0) + b.read_numel
        n = (r1 - r0) * (c1 - c0)
        quant_blocks = 0 if n == 0 else (math.ceil(r1 / bm) - r0 // bm) * (math.ceil(c1 / bn) - c0 // bn)
        # the weight's box, and the scale of each quant block the box touches once per run of elements sharing it
        assert by_source.get("w", 0) == n
        assert quant_blocks <= by_source.get("s", 0) <= n


def test_transformers_fine_grained_fp8_dequantization_traces_bit_identically():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    op = Fp8Dequantize(None)
    gen = torch.Generator().manual_seed(0)
    w, s = _fp8((256, 384), gen), torch.rand((2, 3), generator=gen) + 0.01
    traced = rt.trace(
        lambda a, b: op._dequantize_one(a, b, BF16),
        rt.RegionTensor.leaf("w", (256, 384), E4M3),
        rt.RegionTensor.leaf("s", (2, 3)),
    )
    real = op._dequantize_one(w, s, BF16)
    got = rt.materialize(traced, {"w": w, "s": s})
    assert torch.equal(got.view(torch.int16), real.view(torch.int16))
    # ours (any shape) agrees bit for bit where transformers' applies (the shape divisible by the block)
    assert torch.equal(dequantize(w, s, (128, 128)).view(torch.int16), real.view(torch.int16))
    box = ((100, 200), (130, 300))
    program = traced.value_program(box)
    reads = {b.source: 0 for b in program.blocks}
    for b in program.blocks:
        reads[b.source] += b.read_numel
    assert reads == {"w": 100 * 170, "s": 4}  # rows 100..200 x cols 130..300 touch 2 x 2 blocks, one read each
    check_values(traced, box, {"w": w, "s": s}, real[100:200, 130:300])


def test_movement_after_pointwise_pushes_down_and_cat_merges_same_ops():
    def fn(a, sa, b, sb):
        da, db = dequantize(a, sa, (4, 4)), dequantize(b, sb, (4, 4))
        return torch.stack([da, db]).transpose(1, 2).reshape(2, -1)[:, 3:40]

    specs = {"a": ((8, 6), E4M3), "sa": ((2, 2), F32), "b": ((8, 6), E4M3), "sb": ((2, 2), F32)}
    traced = assert_converter_exact(fn, **specs)
    assert not traced.is_index_map and traced.sources() == {"a", "sa", "b", "sb"}
    assert "mul" in repr(traced)


def test_cat_of_index_map_and_computed_values_is_untraceable():
    a, b = rt.RegionTensor.leaf("a", (2, 3)), rt.RegionTensor.leaf("b", (2, 3))
    with pytest.raises(rt.Untraceable, match="cat"):
        torch.cat([a * 2, b])
    with pytest.raises(rt.Untraceable, match="cat"):
        torch.cat([a * 2, b + 1])


def test_computed_values_refuse_index_map_apis_clearly():
    out = rt.RegionTensor.leaf("a", (2, 3)) * 2
    with pytest.raises(rt.Untraceable, match="computed by `mul`"):
        out.remap_blocks()
    with pytest.raises(rt.Untraceable, match="computed by `mul`"):
        _ = out.region
    with pytest.raises(ValueError, match="index map"):
        rt.RegionTensor.leaf("a", (2, 3)).value_program()
    with pytest.raises(rt.NotInvertible, match="mul"):
        rt.invert(out, {"a": ((2, 3), F32)})


def test_real_scalar_tensors_are_constants_real_tensors_are_refused():
    x = rt.RegionTensor.leaf("x", (3, 4), torch.uint8)
    traced = rt.trace(lambda x: (x.to(F32) - 127.0) / 3, x)
    data = {"x": torch.randint(0, 255, (3, 4), dtype=torch.uint8)}
    torch.testing.assert_close(rt.materialize(traced, data), (data["x"].to(F32) - 127.0) / 3, rtol=0, atol=0)
    with pytest.raises(rt.Untraceable, match="mixes a RegionTensor with a real tensor whose elements differ"):
        x.to(F32) * torch.arange(12.0).reshape(3, 4)
    ones = x.to(F32) * torch.ones(3, 4)  # a real tensor of one value: a constant operand
    assert torch.equal(rt.materialize(ones, data), data["x"].to(F32) * torch.ones(3, 4))


@pytest.mark.parametrize(
    "fn, op",
    [
        (lambda x: x.exp2(), "exp2"),
        (lambda x: torch.log(x), "log"),
        (lambda x: x.pow(2.5), "pow"),
        (lambda x: torch.add(x, x, alpha=2), "add"),
        (lambda x: torch.sigmoid(x), "sigmoid"),
    ],
)
def test_pointwise_ops_that_round_differently_per_box_are_refused(fn, op):
    """A transcendental kernel rounds differently in its vectorised and scalar paths: a box alone could differ."""
    with pytest.raises(rt.Untraceable, match=f"`{op}`"):
        fn(rt.RegionTensor.leaf("x", (3, 4)))
