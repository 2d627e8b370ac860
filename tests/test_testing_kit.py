"""`regiontrace.testing.assert_converter_exact` as a user calls it: list inputs, argument names that are also the
kit's options, the first-difference line of its message, and ``reference=`` against a converter that is wrong
the same way in the trace and the real run."""

from __future__ import annotations

import pytest
import torch

from regiontrace.testing import assert_converter_exact, code_tensors, first_difference

F32, BF16 = torch.float32, torch.bfloat16


def gate_up(gate, up):
    """Per-expert gate and up projections fused into one stacked tensor (as MoE checkpoints are converted)."""
    return torch.cat([torch.stack(gate), torch.stack(up)], dim=1)


def test_list_inputs_are_lists_of_leaves():
    """A converter taking a list of per-expert tensors (what `regiontrace check --input 'gate[4]=...'` accepts):
    this used to fail with ``ValueError: too many values to unpack``."""
    out = assert_converter_exact(gate_up, {"gate": [((4, 3), BF16)] * 3, "up": [((4, 3), BF16)] * 3})
    assert out.shape == (3, 8, 3) and out.dtype == BF16
    assert out.sources() == {f"{n}.{i}" for n in ("gate", "up") for i in range(3)}
    # the keyword spelling takes lists too
    out = assert_converter_exact(gate_up, gate=[((2, 5), F32)] * 2, up=[((2, 5), F32)] * 2, boxes=2)
    assert out.shape == (2, 4, 5)


def test_a_wrong_expert_in_a_list_is_named():
    def swaps_on_cpu(experts):  # the real run puts expert 1 first; the trace (on meta) does not
        ws = experts[::-1] if experts[0].device.type == "cpu" else experts
        return torch.stack(ws)

    with pytest.raises(AssertionError) as e:
        assert_converter_exact(swaps_on_cpu, {"experts": [((2, 2), F32)] * 2})
    assert str(e.value).splitlines()[-1] == (
        "first difference: output 0[0, 0, 0]: the trace reads experts.0[0, 0], the real run holds experts.1[0, 0]"
    )


def test_converter_arguments_named_like_the_kits_options():
    """``seed``, ``boxes`` and ``reference`` are the kit's options: a converter taking arguments of those names
    passes its inputs as one mapping; as keywords, a clear TypeError says so (it used to run with the spec as
    the seed, or fail inside the converter)."""

    def f(w, seed, boxes):
        return torch.cat([w, seed.t(), boxes])

    inputs = {"w": ((2, 3), F32), "seed": ((3, 1), F32), "boxes": ((1, 3), F32)}
    out = assert_converter_exact(f, inputs, seed=3, boxes=2)
    assert out.shape == (4, 3) and out.sources() == {"w", "seed", "boxes"}

    with pytest.raises(TypeError, match=r"seed= must be an int, not \(\(3, 1\), torch.float32\); if fn takes 'seed'"):
        assert_converter_exact(f, w=((2, 3), F32), seed=((3, 1), F32))
    with pytest.raises(TypeError, match=r"fn takes 'reference', which is an option .* as one mapping"):
        assert_converter_exact(lambda w, reference: w + reference, w=((2,), F32))
    with pytest.raises(TypeError, match="as one mapping or as keywords, not both"):
        assert_converter_exact(f, inputs, w=((2, 3), F32))
    with pytest.raises(TypeError, match=r"input 'w': expected \(shape, dtype\) or a list of them, got \(2, 3\)"):
        assert_converter_exact(lambda w: w, {"w": (2, 3)})
    # an argument named like a parameter of trace's (fn) is no problem either
    assert assert_converter_exact(lambda fn: fn.t(), {"fn": ((2, 3), F32)}).shape == (3, 2)


def test_the_message_names_the_first_differing_element():
    """The message ends with the line `regiontrace check` prints: which source element the trace reads and which
    the real run holds (the code oracle runs first, so that elements can be named)."""

    def device_dependent(w):
        return w if w.device.type == "cpu" else w.flip(0)  # the trace runs on meta: flips; the real run does not

    with pytest.raises(AssertionError) as e:
        assert_converter_exact(device_dependent, w=((4, 3), F32))
    assert str(e.value) == (
        "output 0: materialize differs from the real result\n"
        "first difference: output 0[0, 0]: the trace reads w[3, 0], the real run holds w[0, 0]"
    )


def test_first_difference_in_words():
    specs = {"a": ((2, 3), F32), "b": ((4,), F32)}
    codes = code_tensors(specs)
    got, want = codes["a"].clone(), codes["a"].clone()
    want[1, 2] = codes["b"][3]
    assert first_difference(got, want, 2, specs) == "output 2[1, 2]: the trace reads a[1, 2], the real run holds b[3]"
    assert first_difference(got, got, 0, specs) == ""
    x, y = torch.tensor([0.5, float("nan")]), torch.tensor([0.25, float("nan")])
    assert first_difference(x, y, 0, ours="mine", theirs="yours") == "output 0[0]: mine gives 0.5, yours 0.25"
    assert first_difference(y, y.clone(), 0) == ""  # NaN where NaN is expected
    assert first_difference(x, x.double(), 1) == (
        "output 1: the trace gives shape (2,) float32, the real run shape (2,) float64"
    )


def permute_rope(w, heads=2):
    """The reference: interleaved rotary halves -> rotate-half layout, per head (transformers' permute)."""
    dim, n = w.shape
    return w.view(heads, dim // heads // 2, 2, n).transpose(1, 2).reshape(dim, n)


def test_reference_catches_a_consistently_wrong_converter():
    """A converter that swaps the wrong dims is wrong the same way in the trace and in the real run: the exactness
    checks pass. ``reference=`` compares the real run with an independent implementation and names the element."""

    def wrong(w):  # transposes the head dim with the pair dim instead of the half dim
        return w.view(2, 2, 2, 3).transpose(0, 2).reshape(8, 3)

    assert assert_converter_exact(wrong, w=((8, 3), BF16)).shape == (8, 3)  # passes without a reference
    with pytest.raises(AssertionError) as e:
        assert_converter_exact(wrong, w=((8, 3), BF16), reference=permute_rope)
    assert str(e.value) == (
        "output 0: the converter differs from the reference\n"
        "first difference: output 0[1, 0]: the converter reads w[4, 0], the reference holds w[2, 0]"
    )
    # the right converter passes, with lists too; a reference returning fewer tensors is caught
    assert_converter_exact(
        lambda w: w.view(2, 2, 2, 3).transpose(1, 2).reshape(8, 3), w=((8, 3), BF16), reference=permute_rope
    )
    assert_converter_exact(gate_up, {"gate": [((2, 3), F32)] * 2, "up": [((2, 3), F32)] * 2}, reference=gate_up)
    with pytest.raises(AssertionError, match="the converter gives 2 output tensors, the reference 1"):
        assert_converter_exact(lambda w: w.chunk(2), w=((4, 3), F32), reference=lambda w: w[:2])


def test_reference_compares_computed_values_bit_for_bit():
    """A converter with value casts (no code oracle) is compared on random data, value for value."""

    def third(w):
        return w.float() / 3

    assert_converter_exact(third, w=((4, 3), BF16), reference=lambda w: w.to(F32) / 3)
    with pytest.raises(AssertionError) as e:  # divides in bf16, then casts: other bits
        assert_converter_exact(third, w=((4, 3), BF16), reference=lambda w: (w / 3).float())
    first, where = str(e.value).splitlines()
    assert first == "output 0: the converter differs from the reference" and where.startswith(
        "first difference: output 0["
    )
    assert ": the converter gives " in where and ", the reference " in where
