"""Where two results first disagree, in words: the line ``first difference: output 0[0, 0]: the trace reads
w[0, 0], the real run holds w[2, 0]`` that :func:`~regiontrace.testing.assert_converter_exact` and
``regiontrace check`` print."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

Spec = tuple[Sequence[int], torch.dtype]


def first_difference(
    got: torch.Tensor,
    expected: torch.Tensor,
    output: int,
    codes: Mapping[str, Spec] | None = None,
    *,
    ours: str = "the trace",
    theirs: str = "the real run",
) -> str:
    """The first element (in row-major order) where ``got`` and ``expected`` differ, in words, e.g.
    ``output 0[0, 0]: the trace reads w[0, 0], the real run holds w[2, 0]`` (source elements, with ``codes``) or
    ``output 0[1]: the trace gives 0.5, the real run 0.25`` (values); ``""`` when they are equal.

    Args:
        got: what ``ours`` gives for output number ``output``.
        expected: what ``theirs`` gives.
        output: the output's number, for the text.
        codes: the specs the values were made from by :func:`~regiontrace.testing.code_tensors`: each value is
            then named as the source element it codes (``w[2, 0]``); without it, values are shown as numbers.
        ours, theirs: the two sides' names.
    """
    if (tuple(got.shape), got.dtype) != (tuple(expected.shape), expected.dtype):
        return f"output {output}: {ours} gives {_kind(got)}, {theirs} {_kind(expected)}"
    differs = got != expected
    if got.is_floating_point() or got.is_complex():
        differs &= ~(got.isnan() & expected.isnan())  # NaN where NaN is expected is no difference
    found = differs.nonzero()
    if not len(found):
        return ""
    idx = tuple(int(i) for i in found[0])
    where = f"output {output}" + (f"[{', '.join(map(str, idx))}]" if idx else "")
    a, b = got[idx], expected[idx]
    if codes is not None:
        return f"{where}: {ours} reads {decode(int(a), codes)}, {theirs} holds {decode(int(b), codes)}"
    return f"{where}: {ours} gives {a.item()!r}, {theirs} {b.item()!r}"


def decode(code: int, specs: Mapping[str, Spec]) -> str:
    """The source element a code of :func:`~regiontrace.testing.code_tensors` stands for (``w[2, 0]``), or
    ``the value N`` for a number that codes no element."""
    names = list(specs)
    sid, flat = divmod(code, 2**40)
    if not 1 <= sid <= len(names):
        return f"the value {code}"
    name = names[sid - 1]
    shape = tuple(specs[name][0])
    if flat >= math.prod(shape):
        return f"the value {code}"
    idx = []
    for n in reversed(shape):
        idx.append(flat % n)
        flat //= n
    return f"{name}[{', '.join(map(str, reversed(idx)))}]"


def _kind(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
