"""The exactness check: :func:`assert_converter_exact` and the checks it is made of (blocks partition a box and
read no more than it holds; blocks and value programs give the real slice bit for bit)."""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..compile import check_box
from ..execute import dest_view, execute_blocks, execute_program, materialize
from ..remap_block import RemapBlock
from ..tensor import RegionTensor
from ..trace import trace
from .difference import Spec, first_difference

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64)


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
    return any(not t.is_index_map or any(p.casts for p in t.region.pieces) for t in output_tensors(out))


def output_tensors(out: Any) -> list[Any]:
    """The tensors of a function's output structure (nested lists, tuples, dicts), in order."""
    from .._torch import tree_flatten

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


InputSpec = Spec | Sequence[Spec]
#: the options of :func:`assert_converter_exact`, which ``fn``'s inputs given as keywords cannot be named
OPTIONS = ("boxes", "seed", "reference")


def assert_converter_exact(
    fn: Callable[..., Any],
    inputs: Mapping[str, InputSpec] | None = None,
    /,
    *,
    boxes: int = 8,
    seed: int = 0,
    reference: Callable[..., Any] | None = None,
    **named: InputSpec,
) -> Any:
    """Check that ``fn`` traces exactly: an index map, or pointwise ops over index maps (bit for bit); with
    ``reference``, also that ``fn`` computes what ``reference`` does.

    Args:
        fn: the converter; called with one keyword argument per input: a tensor, or a list of tensors.
        inputs: ``{name: (shape, dtype)}`` per argument of ``fn``, or ``{name: [(shape, dtype), ...]}`` for an
            argument that is a list of tensors (per-expert weights); its leaves are named ``name.0``,
            ``name.1``, .... As one mapping, any name is allowed (``seed``, ``boxes``).
        boxes: random boxes per output to compile and execute.
        seed: seed for data and boxes.
        reference: an independent implementation of the conversion, called like ``fn`` on the same data: every
            output of ``fn``'s real run must equal its output bit for bit (a converter that is consistently
            wrong — trace and real run agree, but not with the truth — passes the other checks).
        **named: the inputs as keywords instead of ``inputs`` (``w=(shape, dtype)``; not named as an option).

    Returns:
        The traced output (RegionTensors in ``fn``'s output structure).

    Raises:
        AssertionError: the trace, its materialization or a box's blocks differ from the real run, or the real
            run from ``reference``; the message ends with the first differing element
            (``first difference: output 0[0, 0]: the trace reads w[0, 0], the real run holds w[2, 0]``).
        TypeError: inputs that are no ``(shape, dtype)`` (or list of them), or a keyword input named as an option.
        Untraceable, TraceMismatch: as :func:`regiontrace.trace`.
    """
    inputs = _check_inputs(fn, inputs, named, boxes=boxes, seed=seed, reference=reference)
    specs = flat_inputs(inputs)

    def call(kwargs: dict[str, Any]) -> Any:  # one positional argument: no name of fn's can collide with trace's
        return fn(**kwargs)

    def trace_on(dtype: torch.dtype | None) -> Any:
        leaves = {n: RegionTensor.leaf(n, s, dtype or d) for n, (s, d) in specs.items()}
        return trace(call, arguments(inputs, leaves))

    traced = trace_on(None)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    runs = []
    # the code oracle needs int64 sources end to end: trace again with int64 leaves (the codes do not fit
    # the original dtypes) and use it only where that trace records no value cast; it runs first, so that a
    # difference names the source elements involved
    code_specs = {n: (s, torch.int64) for n, (s, _) in specs.items()}
    code_traced = trace_on(torch.int64)
    if not _has_casts(code_traced):
        runs.append((code_traced, code_tensors(code_specs), code_specs))
    runs.append((traced, {n: random_tensor(s, d, gen) for n, (s, d) in specs.items()}, None))
    for traced_run, data, codes in runs:
        real = output_tensors(fn(**arguments(inputs, {n: t.clone() for n, t in data.items()})))
        outs = output_tensors(traced_run)
        assert len(outs) == len(real), f"traced {len(outs)} output tensors, the real run {len(real)}"
        for i, (t, r) in enumerate(zip(outs, real)):
            assert tuple(t.shape) == tuple(r.shape) and t.dtype == r.dtype, (
                f"output {i}: shape/dtype differ: the trace gives {tuple(t.shape)} {t.dtype}, "
                f"the real run {tuple(r.shape)} {r.dtype}"
            )
            got = materialize(t, data)
            assert same_values(got, r), (
                f"output {i}: materialize differs from the real result\n"
                f"first difference: {first_difference(got, r, i, codes)}"
            )
            for _ in range(boxes):
                box = check_box(t.shape, random_box(t.shape, rng))
                check_values(t, box, data, r[tuple(slice(a, b) for a, b in box)])
        if reference is not None:
            want = output_tensors(reference(**arguments(inputs, {n: t.clone() for n, t in data.items()})))
            assert len(want) == len(real), f"the converter gives {len(real)} output tensors, the reference {len(want)}"
            for i, (r, w) in enumerate(zip(real, want)):
                if not same_values(r, w):
                    where = first_difference(r, w, i, codes, ours="the converter", theirs="the reference")
                    raise AssertionError(
                        f"output {i}: the converter differs from the reference\nfirst difference: {where}"
                    )
    return traced


def flat_inputs(inputs: Mapping[str, InputSpec]) -> dict[str, Spec]:
    """Every source tensor of ``inputs`` by leaf name: a list input's tensors are ``NAME.0``, ``NAME.1``, ....

    Raises:
        TypeError: an input that is neither ``(shape, dtype)`` nor a list of them.
    """
    out: dict[str, Spec] = {}
    for name, spec in inputs.items():
        if _is_spec(spec):
            out[name] = (tuple(spec[0]), spec[1])
        elif isinstance(spec, (list, tuple)) and all(_is_spec(s) for s in spec):
            out.update({f"{name}.{i}": (tuple(s[0]), s[1]) for i, s in enumerate(spec)})
        else:
            raise TypeError(f"input {name!r}: expected (shape, dtype) or a list of them, got {spec!r}")
    return out


def arguments(inputs: Mapping[str, InputSpec], tensors: Mapping[str, Any]) -> dict[str, Any]:
    """``fn``'s keyword arguments from tensors named as :func:`flat_inputs` names them (lists for list inputs)."""
    return {
        name: tensors[name] if _is_spec(spec) else [tensors[f"{name}.{i}"] for i in range(len(spec))]
        for name, spec in inputs.items()
    }


def _is_spec(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and len(x) == 2 and isinstance(x[1], torch.dtype)


def _check_inputs(
    fn: Callable[..., Any], inputs: Mapping[str, InputSpec] | None, named: dict[str, InputSpec], **options: Any
) -> Mapping[str, InputSpec]:
    """The inputs, one way or the other; a clear TypeError where a keyword input was taken for an option."""
    if inputs is not None and named:
        raise TypeError("give fn's inputs as one mapping or as keywords, not both")
    hint = "pass fn's inputs as one mapping, assert_converter_exact(fn, {{{!r}: (shape, dtype), ...}})"
    for name in ("boxes", "seed"):
        if not isinstance(options[name], int) or isinstance(options[name], bool):
            raise TypeError(f"{name}= must be an int, not {options[name]!r}; if fn takes {name!r}, {hint.format(name)}")
    if options["reference"] is not None and not callable(options["reference"]):
        raise TypeError(f"reference= must be a function, not {options['reference']!r}; {hint.format('reference')}")
    if inputs is None:
        try:
            params = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):
            params = ()
        for p in params:
            named_only = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            if p.name in OPTIONS and named_only and p.default is p.empty and p.name not in named:
                raise TypeError(
                    f"fn takes {p.name!r}, which is an option of assert_converter_exact: {hint.format(p.name)}"
                )
        inputs = named
    if not inputs:
        raise TypeError("give fn's inputs: assert_converter_exact(fn, {'w': ((8, 4), torch.bfloat16)})")
    return inputs
