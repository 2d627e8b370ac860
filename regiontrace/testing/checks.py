"""The exactness check: :func:`assert_converter_exact` and the checks it is made of (blocks partition a box and
read no more than it holds; blocks and value programs give the real slice bit for bit)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..blocks import RemapBlock, check_box
from ..execute import dest_view, execute_blocks, execute_program, materialize
from ..tensor import RegionTensor
from ..trace import trace

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64)
Spec = tuple[Sequence[int], torch.dtype]


# ---------------------------------------------------------------------------------------------------
# the exactness check


def random_tensor(shape: Sequence[int], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random values of ``dtype`` (finite, distinct with high probability)."""
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    return torch.randint(-(2**15), 2**15, tuple(shape), generator=gen).to(dtype)


def code_tensors(specs: Mapping[str, Spec]) -> dict[str, torch.Tensor]:
    """Unique int64 codes per source element: ``source_id * 2**40 + flat index``."""
    return {
        name: (torch.arange(math.prod(shape), dtype=torch.int64) + (i + 1) * 2**40).reshape(tuple(shape))
        for i, (name, (shape, _)) in enumerate(specs.items())
    }


def _has_casts(out: Any) -> bool:
    """Whether values are cast or computed (the code oracle needs values equal to their codes)."""
    return any(not t.is_index_map or any(p.casts for p in t.region.pieces) for t in _tensors(out))


def _tensors(out: Any) -> list[Any]:
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def random_box(shape: Sequence[int], rng: random.Random) -> tuple[tuple[int, int], ...]:
    box = []
    for n in shape:
        a, b = sorted((rng.randint(0, n), rng.randint(0, n)))
        box.append((a, b))
    return tuple(box)


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and values, NaNs in the same places counting as equal (a computed value may be NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if torch.equal(a, b):
        return True
    return a.is_floating_point() and bool(torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def check_blocks(
    blocks: Sequence[RemapBlock],
    box: Sequence[tuple[int, int]],
    sources: Mapping[str, torch.Tensor],
    expected: torch.Tensor,
) -> None:
    """Assert that ``blocks`` partition ``box`` exactly, read no more than the box needs, and give
    ``expected``.

    Raises:
        AssertionError: with a description of the first violation.
    """
    check_partition(blocks, box)
    out = torch.empty(tuple(b - a for a, b in box), dtype=expected.dtype)
    execute_blocks(blocks, sources, out)
    assert torch.equal(out, expected), "executed blocks differ from the real slice"


def check_partition(blocks: Sequence[RemapBlock], box: Sequence[tuple[int, int]]) -> None:
    """Assert that ``blocks`` partition ``box`` exactly and read no more source elements than it holds.

    Raises:
        AssertionError: with a description of the first violation.
    """
    shape = tuple(b - a for a, b in box)
    numel = math.prod(shape)
    written = sum(b.numel for b in blocks)
    assert written == numel, f"blocks write {written} of {numel} elements"
    hits = torch.zeros(shape, dtype=torch.int32)
    for b in blocks:
        dest_view(b, hits).add_(1)
    assert bool((hits == 1).all()), "blocks overlap or leave gaps in the box"
    assert sum(b.read_numel for b in blocks) <= numel, "blocks read more source elements than the box holds"


def check_values(
    tensor: RegionTensor, box: Sequence[tuple[int, int]], sources: Mapping[str, torch.Tensor], expected: torch.Tensor
) -> None:
    """Assert that ``tensor``'s box compiles to blocks or a value program giving ``expected`` bit for bit.

    Raises:
        AssertionError: with a description of the first violation.
    """
    if tensor.is_index_map:
        return check_blocks(tensor.remap_blocks(box), box, sources, expected)
    program = tensor.value_program(box)
    for i in program.inputs:
        check_partition(i.blocks, box if i.shape == program.shape else ())
    got = execute_program(program, sources, torch.empty_like(expected))
    assert same_values(got, expected), "the value program's box differs from the real slice"


def assert_converter_exact(fn: Callable[..., Any], *, boxes: int = 8, seed: int = 0, **inputs: Spec) -> Any:
    """Check that ``fn`` traces exactly: an index map, or pointwise ops over index maps (bit for bit).

    Args:
        fn: the converter; called with one tensor per keyword of ``inputs``.
        boxes: random boxes per output to compile and execute.
        seed: seed for data and boxes.
        **inputs: ``name=(shape, dtype)`` for each argument.

    Returns:
        The traced output (RegionTensors in ``fn``'s output structure).

    Raises:
        AssertionError: the trace, its materialization or a box's blocks differ from the real run.
        Untraceable, TraceMismatch: as :func:`regiontrace.trace`.
    """
    leaves = {name: RegionTensor.leaf(name, shape, dtype) for name, (shape, dtype) in inputs.items()}
    traced = trace(fn, **leaves)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    runs = [(traced, {n: random_tensor(s, d, gen) for n, (s, d) in inputs.items()})]
    # the code oracle needs int64 sources end to end: trace again with int64 leaves (the codes do not fit
    # the original dtypes) and use it only where that trace records no value cast
    code_specs = {n: (s, torch.int64) for n, (s, _) in inputs.items()}
    code_traced = trace(fn, **{n: RegionTensor.leaf(n, s, d) for n, (s, d) in code_specs.items()})
    if not _has_casts(code_traced):
        runs.append((code_traced, code_tensors(code_specs)))
    for traced_run, data in runs:
        real = fn(**{n: t.clone() for n, t in data.items()})
        outs, reals = _tensors(traced_run), _tensors(real)
        assert len(outs) == len(reals), f"traced {len(outs)} output tensors, the real run {len(reals)}"
        for i, (t, r) in enumerate(zip(outs, reals)):
            assert tuple(t.shape) == tuple(r.shape) and t.dtype == r.dtype, f"output {i}: shape/dtype differ"
            got = materialize(t, data)
            assert same_values(got, r), f"output {i}: materialize differs from the real result"
            for _ in range(boxes):
                box = check_box(t.shape, random_box(t.shape, rng))
                check_values(t, box, data, r[tuple(slice(a, b) for a, b in box)])
    return traced
