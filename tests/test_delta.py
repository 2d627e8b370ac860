"""Deltas of buffers: the runs of changed elements as Rice streams and elements (raw, or their integer differences);
applied to the base they give the new value bit for bit (NaN payloads and signed zeros included), never larger than
the whole buffer."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from loader.transfer.delta import Delta, apply_delta, changed_elements, encode_delta

INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.float8_e4m3fn]


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _random(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * torch.empty(0, dtype=dtype).element_size(),), dtype=torch.uint8, generator=g)
    return raw.view(dtype)  # any bit pattern: NaNs, infinities, signed zeros


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3000),
    dtype=st.sampled_from(DTYPES),
    density=st.sampled_from([0.0, 0.001, 0.01, 0.1, 0.5, 1.0]),
    clustered=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_a_delta_applied_to_the_base_gives_the_new_value_bit_for_bit(n, dtype, density, clustered, seed):
    base = _random(n, dtype, seed)
    new = base.clone()
    g = torch.Generator().manual_seed(seed + 1)
    if clustered:  # a few contiguous stretches, as rows of a matrix
        count = int(n * density)
        start = int(torch.randint(0, n - count + 1, (1,), generator=g))
        mask = torch.zeros(n, dtype=torch.bool)
        mask[start : start + count] = True
    else:
        mask = torch.rand(n, generator=g) < density
    ints = INTS[new.element_size()]
    new.view(ints)[mask] = _random(int(mask.sum()), dtype, seed + 2).view(ints)  # bits: fp8 has no masked writes
    delta = encode_delta(base, new)
    assert delta.changed == changed_elements(base, new)
    assert delta.nbytes <= n * new.element_size() + 16  # the header's varints
    target = base.clone()
    apply_delta(target, delta)
    assert _bits(target) == _bits(new)


def test_signed_zeros_and_nan_payloads_are_changes_and_equal_bits_are_not():
    base = torch.tensor([0.0, 1.0, float("nan"), 2.0] * 8, dtype=torch.bfloat16)
    new = base.clone()
    new[0] = -0.0
    new.view(torch.int16)[2] ^= 1  # another NaN
    delta = encode_delta(base, new)
    assert delta.changed == 2 and not delta.full
    target = base.clone()
    apply_delta(target, delta)
    assert _bits(target) == _bits(new)
    assert encode_delta(base, base.clone()).nbytes == 5  # nothing changed: the header alone


def test_a_delta_larger_than_the_buffer_sends_the_buffer():
    base = torch.zeros(100, dtype=torch.bfloat16)
    delta = encode_delta(base, torch.ones(100, dtype=torch.bfloat16))
    assert delta.full and delta.nbytes == 200 + 6


def test_sparse_runs_cost_their_elements_and_a_few_bytes_each():
    """A row of 512 elements changed in a 64 k buffer: the elements' bytes and two short Rice streams."""
    base = torch.randn(128, 512).to(torch.bfloat16)
    new = base.clone()
    new[7] += 1
    delta = encode_delta(base, new)
    assert delta.runs == 1 and delta.nbytes <= 512 * 2 + 8 + 12


def test_a_delta_that_does_not_fit_is_refused():
    base = torch.randn(64)
    new = base.clone()
    new[60:] += 1
    delta = encode_delta(base, new)
    with pytest.raises(ValueError, match="does not fit"):
        apply_delta(torch.zeros(32), delta)
    forged = Delta(False, delta.runs + 1, delta.index, delta.values, delta.changed)  # one run more than its index
    with pytest.raises(ValueError, match="index holds|stream"):
        apply_delta(base.clone(), forged)
    with pytest.raises(ValueError, match="equal shapes"):
        encode_delta(base, new[:10])


def test_a_delta_travels_as_one_byte_buffer_and_reads_back_the_same():
    base = torch.arange(1000, dtype=torch.float32).to(torch.bfloat16)
    new = base.clone()
    new[::97] += 1
    delta = encode_delta(base, new)
    data = delta.to_bytes()
    assert data.dtype == torch.uint8 and data.numel() == delta.nbytes
    back = Delta.from_bytes(data)
    target = base.clone()
    apply_delta(target, back)
    assert torch.equal(target.view(torch.int16), new.view(torch.int16))
    with pytest.raises(ValueError, match="header says"):
        Delta.from_bytes(data[:-1])
    with pytest.raises(ValueError, match="no header"):
        Delta.from_bytes(torch.tensor([0x80, 0x80], dtype=torch.uint8))


def _nudged(base: torch.Tensor, mask: torch.Tensor, ulps: torch.Tensor) -> torch.Tensor:
    """``base`` with the masked elements' bits moved by ``ulps`` (as element-width integers, wrapping)."""
    new = base.clone()
    ints = new.view(INTS[new.element_size()])
    moved = ints[mask].to(torch.int64) + ulps[mask]
    ints[mask] = moved.to(ints.dtype)
    return new


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 3000),
    dtype=st.sampled_from([*DTYPES, torch.int32, torch.int64]),
    density=st.sampled_from([0.001, 0.01, 0.1, 0.5, 1.0]),
    reach=st.sampled_from([1, 3, 200, 2**40]),
    seed=st.integers(0, 2**16),
)
def test_small_integer_differences_are_sent_as_differences_and_applied_bit_for_bit(n, dtype, density, reach, seed):
    """A few ulps up or down (wrapping past the element's width, through NaNs and signs): exact, and sent as
    differences whenever that is smaller than the elements."""
    base = _random(n, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    mask = torch.rand(n, generator=g) < density
    ulps = torch.randint(-reach, reach + 1, (n,), generator=g)
    new = _nudged(base, mask, ulps)
    delta = encode_delta(base, new)
    assert delta.changed == changed_elements(base, new)
    assert delta.nbytes <= n * new.element_size() + 16  # the header's varints
    target = base.clone()
    apply_delta(target, Delta.from_bytes(delta.to_bytes()))
    assert _bits(target) == _bits(new)
    if not delta.full and reach == 1 and delta.changed * new.element_size() >= 8:
        assert delta.diff  # at most 2 bits a change and the stream's 2-byte head


@pytest.mark.parametrize("density", [0.001, 0.01, 0.1])
def test_an_ulp_step_costs_at_most_1_1_of_its_changed_bytes_and_random_bits_are_sent_raw(density):
    """bf16 elements moved by one ulp at scattered places (what an optimizer step does): positions and
    differences together within 1.1 x the changed elements' bytes; random new bits are sent as they are."""
    n = 1 << 18
    g = torch.Generator().manual_seed(3)
    base = torch.randn(n, generator=g).to(torch.bfloat16)
    mask = torch.rand(n, generator=g) < density
    step = _nudged(base, mask, torch.randint(0, 2, (n,), generator=g) * 2 - 1)
    delta = encode_delta(base, step)
    assert delta.diff and delta.nbytes / (2 * delta.changed) <= 1.1
    noise = base.clone()
    noise.view(torch.int16)[mask] = _random(int(mask.sum()), torch.bfloat16, 4).view(torch.int16)
    raw = encode_delta(base, noise)
    assert not raw.diff and not raw.full
    target = base.clone()
    apply_delta(target, raw)
    assert _bits(target) == _bits(noise)


def test_forged_streams_are_refused():
    base = torch.zeros(4096, dtype=torch.bfloat16)
    new = base.clone()
    new[::64] = 1.0
    delta = encode_delta(base, new)
    with pytest.raises(ValueError, match="stream"):
        apply_delta(base.clone(), Delta(False, delta.runs, delta.index[:3], delta.values, delta.changed))
    bent = _nudged(base, torch.ones(4096, dtype=torch.bool).index_fill_(0, torch.arange(0, 4096, 2), False),
                   torch.ones(4096, dtype=torch.int64))  # fmt: skip
    diff = encode_delta(base, bent)
    assert diff.diff
    with pytest.raises(ValueError, match="differences|stream"):
        apply_delta(base.clone(), Delta(False, diff.runs, diff.index, diff.values[:-1], diff.changed, True))


def test_a_few_sign_changes_among_ulp_steps_are_escaped_not_sent_in_unary():
    """1 % of the changes flip the sign (an integer difference of ~2^15): each costs its bits, not 2^15 ones."""
    n = 1 << 16
    g = torch.Generator().manual_seed(5)
    base = torch.randn(n, generator=g).to(torch.bfloat16)
    mask = torch.rand(n, generator=g) < 0.05
    new = _nudged(base, mask, torch.ones(n, dtype=torch.int64))
    flips = mask & (torch.rand(n, generator=g) < 0.01)
    new[flips] = -new[flips]
    delta = encode_delta(base, new)
    assert delta.diff and delta.nbytes / (2 * delta.changed) <= 0.8
    target = base.clone()
    apply_delta(target, delta)
    assert _bits(target) == _bits(new)


@pytest.mark.parametrize("n", [1, 3, 4099, 1 << 16])
@pytest.mark.parametrize("offset", [0, 1])
def test_changes_are_found_in_any_buffer_length_and_alignment(n, offset):
    """The comparison goes 8 bytes at a time where it can (a tail and an unaligned view elementwise): every changed
    element found, sparse or dense."""
    for density in (0.001, 0.5):
        base = _random(n + offset, torch.bfloat16, n)[offset:]
        mask = torch.rand(n, generator=torch.Generator().manual_seed(n)) < density
        mask[-1] = True  # the tail
        new = _nudged(base, mask, torch.ones(n, dtype=torch.int64))
        delta = encode_delta(base, new)
        assert delta.changed == int(mask.sum()) == changed_elements(base, new)
        target = base.clone()
        apply_delta(target, delta)
        assert _bits(target) == _bits(new)


@pytest.mark.parametrize("kind", ["diff", "raw", "full", "none"])
def test_a_delta_applied_with_keep_undoes_to_the_base_bit_for_bit(kind):
    base = _random(4096, torch.bfloat16, 9)
    mask = torch.zeros(4096, dtype=torch.bool)
    mask[:: {"diff": 50, "raw": 50, "full": 1, "none": 4096}[kind]] = kind != "none"
    new = _nudged(base, mask, torch.ones(4096, dtype=torch.int64))
    if kind in ("raw", "full"):
        new.view(torch.int16)[mask] = _random(int(mask.sum()), torch.bfloat16, 10).view(torch.int16)
    delta = encode_delta(base, new)
    assert (delta.full, delta.diff) == {"diff": (False, True), "raw": (False, False), "full": (True, False),
                                        "none": (False, False)}[kind]  # fmt: skip
    target = base.clone()
    written = apply_delta(target, delta, keep=True)
    assert _bits(target) == _bits(new)
    assert (written.where is None) == delta.full and (delta.full or written.where.size == delta.changed)
    written.undo(target)
    assert _bits(target) == _bits(base)
    with pytest.raises(ValueError, match="keep=True"):
        apply_delta(target.clone(), delta).undo(target)
