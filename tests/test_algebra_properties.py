"""Property tests: random op chains (movement ops, and pointwise ops with movement after them) traced on
RegionTensors vs the same chains run by torch."""

import random

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import regiontrace as rt
from regiontrace.testing import (
    check_values,
    code_tensors,
    programs,
    random_box,
    random_tensor,
    same_values,
    value_programs,
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _run(program, data):
    return program(**{n: t.clone() for n, t in data.items()})


def check_against_torch(program, seed: int) -> None:
    """Trace ``program``, run it for real on random data: the materialized trace, and 4 random boxes compiled
    (to blocks, or to value programs), equal torch's result bit for bit."""
    leaves = {n: rt.RegionTensor.leaf(n, s, d) for n, s, d in program.leaves}
    traced = rt.trace(program, **leaves)
    gen = torch.Generator().manual_seed(seed)
    data = {n: random_tensor(s, d, gen) for n, s, d in program.leaves}
    real = _run(program, data)
    assert tuple(traced.shape) == tuple(real.shape) and traced.dtype == real.dtype, program
    assert same_values(rt.materialize(traced, data), real), program
    rng = random.Random(seed)
    for _ in range(4):
        box = random_box(real.shape, rng)
        check_values(traced, box, data, real[tuple(slice(a, b) for a, b in box)])


@SETTINGS
@given(programs(), st.integers(0, 2**32 - 1))
def test_random_chains_match_torch(program, seed):
    check_against_torch(program, seed)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value_programs(), st.integers(0, 2**32 - 1))
def test_value_programs_match_torch_in_every_box(program, seed):
    """Chains ending in pointwise ops (then movement ops pushed down through them)."""
    check_against_torch(program, seed)


@SETTINGS
@given(programs())
def test_code_oracle_is_exact(program):
    """Fill sources with unique integer codes; every output element decodes to the right source element."""
    uncast = [(n, s, torch.int64) for n, s, _ in program.leaves]
    leaves = {n: rt.RegionTensor.leaf(n, s, d) for n, s, d in uncast}
    traced = rt.trace(program, **leaves)
    # value casts of int codes are not an identity (covered by the value test): hypothesis draws another
    assume(not any(p.casts for p in traced.region.pieces))
    codes = code_tensors({n: (s, d) for n, s, d in uncast})
    real = _run(program, codes)
    assert torch.equal(rt.materialize(traced, codes), real), program
