"""Constant pieces: elements whose value is a constant (padding, ``fill_``, ``zero_``), not a checkpoint element.

Vocabulary (as in :mod:`regiontrace.region`, plus):

- **constant source**: a 0-dim source named ``<constant VALUE: DTYPE>``; a *constant piece* reads it with stride 0
  on every axis (a broadcast). It is a piece like any other: it compiles into a broadcast block, and
  :func:`constant_tensors` gives the real 0-dim tensors that blocks read for it.
- **constant region**: a region of any shape whose one piece reads one constant source.

``F.pad`` (``aten.constant_pad_nd``) traces here: the padded dims are a ``cat`` of constant regions and the input.
So does a real tensor that code mixes with stand-ins when all its elements are one value (``torch.zeros(pad, h)``
in a ``cat``: :func:`uniform_value`). ``new_zeros``/``new_full``/``zeros_like`` … of a stand-in make a destination
filled with the constant (:mod:`regiontrace.writes`), which code may then write into.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from . import region as R
from . import values as V
from .movement import HANDLERS

aten = torch.ops.aten

__all__ = [
    "constant_region",
    "constant_source",
    "constant_tensors",
    "constant_value",
    "is_constant",
    "uniform_value",
    "with_constants",
]

_PREFIX, _SUFFIX = "<constant ", ">"


def _exact(value: Any, dtype: torch.dtype) -> Any:
    """``value`` as a tensor of ``dtype`` holds it (``fill_(1.7)`` of an int tensor stores 1)."""
    return torch.full((), value, dtype=dtype).item()


def constant_source(value: Any, dtype: torch.dtype) -> R.Source:
    """The 0-dim source standing for ``value`` stored as ``dtype``."""
    return R.Source(f"{_PREFIX}{_exact(value, dtype)!r}: {str(dtype).removeprefix('torch.')}{_SUFFIX}", (), dtype)


def is_constant(source: R.Source | str) -> bool:
    """Whether ``source`` (or a source name) is a constant source."""
    name = source if isinstance(source, str) else source.name
    return name.startswith(_PREFIX) and name.endswith(_SUFFIX)


def constant_value(name: str) -> torch.Tensor:
    """The real 0-dim tensor a constant source's name stands for.

    Raises:
        ValueError: ``name`` is not a constant source's.
    """
    if not is_constant(name):
        raise ValueError(f"{name!r} is not a constant source")
    text, dtype_name = name[len(_PREFIX) : -len(_SUFFIX)].rsplit(": ", 1)
    dtype = getattr(torch, dtype_name)
    if text in ("True", "False"):
        value: Any = text == "True"
    elif dtype.is_floating_point or dtype.is_complex:
        value = complex(text.strip("()")) if dtype.is_complex else float(text)
    else:
        value = int(text)
    return torch.full((), value, dtype=dtype)


def constant_region(value: Any, shape: Sequence[int], dtype: torch.dtype) -> R.Region:
    """A region of ``shape`` whose every element is ``value`` stored as ``dtype`` (one constant piece)."""
    shape = tuple(int(n) for n in shape)
    if math.prod(shape) == 0:
        return R.Region(shape, ())
    return R.expand(R.Region.leaf(constant_source(value, dtype)), shape)


def constant_tensors(names: Iterable[str] | R.Region) -> dict[str, torch.Tensor]:
    """The real tensors of the constant sources among ``names`` (or a region's pieces), for executing blocks."""
    if isinstance(names, R.Region):
        names = (p.source.name for p in names.pieces)
    return {n: constant_value(n) for n in names if is_constant(n)}


def with_constants(sources: Mapping[str, torch.Tensor], region: R.Region) -> dict[str, torch.Tensor]:
    """``sources`` plus the constant tensors ``region`` reads."""
    return {**constant_tensors(region), **sources}


def _pad(b: dict, out: torch.Tensor) -> V.Value:
    """``constant_pad_nd``: per padded dim (last dim first), constants before and after; a negative pad crops."""
    x, pads, fill = b["self"], list(b["pad"]), b["value"]
    value = x.value
    shape = list(x.shape)
    for k in range(len(pads) // 2):
        d = x.ndim - 1 - k
        before, after = pads[2 * k], pads[2 * k + 1]
        start, stop = max(-before, 0), shape[d] - max(-after, 0)
        value = V.move(value, lambda r, d=d, start=start, stop=stop: R.narrow(r, d, start, max(stop, start)))
        shape[d] = max(stop - start, 0)
        parts, total = [], list(shape)
        for n in (max(before, 0), None, max(after, 0)):
            if n is None:
                parts.append(value)
            elif n:
                parts.append(constant_region(0 if fill is None else fill, shape[:d] + [n] + shape[d + 1 :], x.dtype))
                total[d] += n
        value = V.cat(parts, d, tuple(total)) if len(parts) > 1 else value
        shape = total
    return value


HANDLERS[aten.constant_pad_nd.default] = _pad


def uniform_value(t: torch.Tensor) -> Any:
    """The one value every element of the real tensor ``t`` holds (NaN included), or None: it holds several, none,
    or no data (the meta device)."""
    if t.device.type == "meta" or t.numel() == 0 or t.is_complex():
        return None
    first = t.reshape(-1)[0]
    if bool((t == first).all()) or (t.is_floating_point() and bool(t.isnan().all())):
        return first.item()
    return None
