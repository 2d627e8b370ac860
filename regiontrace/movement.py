"""The movement ops a RegionTensor traces: each aten op that moves data (view, permute, slice, cat, stack, …) as a
function of its bound arguments and torch's meta output, returning the output's value (or one per output).

A handler moves an index map (:mod:`regiontrace.region`), or pushes the move down to the input regions of values
computed by pointwise ops (:func:`regiontrace.values.move`). :data:`HANDLERS` maps each aten overload to its
handler; an op in neither it nor the pointwise ops is refused by :class:`~regiontrace.RegionTensor`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import region as R
from . import values as V
from .reshape import reshape

aten = torch.ops.aten

#: a handler: ``(bound arguments, meta output) -> value`` (a list of values for ops with several outputs); tensor
#: arguments are RegionTensors
Handler = Callable[[dict, Any], Any]
#: the handler of each aten overload a RegionTensor traces as a movement op
HANDLERS: dict[Any, Handler] = {}


def _handles(*ops: Any) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for op in ops:
            HANDLERS[op] = fn
        return fn

    return register


def _val(t: torch.Tensor, dtype: torch.dtype | None = None) -> V.Value:
    """``t``'s value, cast to ``dtype`` when given."""
    return t.value if dtype is None else V.cast(t.value, dtype, t.dtype)


def _move(t: torch.Tensor, fn: Callable[[R.Region], R.Region]) -> V.Value:
    """A movement op on ``t``'s value: on its region, or pushed down to the input regions of its pointwise ops."""
    return V.move(t.value, fn)


def _dim(d: int, ndim: int) -> int:
    return d % max(ndim, 1)


@_handles(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten._reshape_alias.default)
def _view(b: dict, out: torch.Tensor) -> V.Value:
    return _move(b["self"], lambda r: reshape(r, tuple(out.shape)))


@_handles(
    aten.alias.default,
    aten.detach.default,
    aten.clone.default,
    aten.lift_fresh.default,
    aten._to_copy.default,
    aten.contiguous.default,
)
def _identity(b: dict, out: torch.Tensor) -> V.Value:
    return _val(b["self"], out.dtype)


@_handles(aten.permute.default)
def _permute(b: dict, out: torch.Tensor) -> V.Value:
    x = b["self"]
    return _move(x, lambda r: R.permute(r, [_dim(d, x.ndim) for d in b["dims"]]))


@_handles(aten.transpose.int)
def _transpose(b: dict, out: torch.Tensor) -> V.Value:
    x = b["self"]
    dims = list(range(x.ndim))
    d0, d1 = _dim(b["dim0"], x.ndim), _dim(b["dim1"], x.ndim)
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return _move(x, lambda r: R.permute(r, dims))


@_handles(aten.t.default)
def _t(b: dict, out: torch.Tensor) -> V.Value:
    x = b["self"]
    return _move(x, lambda r: R.permute(r, [1, 0])) if x.ndim == 2 else _val(x)


@_handles(aten.unsqueeze.default)
def _unsqueeze(b: dict, out: torch.Tensor) -> V.Value:
    x = b["self"]
    return _move(x, lambda r: R.unsqueeze(r, b["dim"] % (x.ndim + 1)))


@_handles(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(b: dict, out: torch.Tensor) -> V.Value:
    x = b["self"]
    dims = b.get("dims", b.get("dim"))
    if dims is None:
        dims = range(x.ndim)
    elif isinstance(dims, int):
        dims = [dims]
    dims = [_dim(d, x.ndim) for d in dims]
    return _move(x, lambda r: R.squeeze(r, dims))


@_handles(aten.expand.default)
def _expand(b: dict, out: torch.Tensor) -> V.Value:
    return _move(b["self"], lambda r: R.expand(r, tuple(out.shape)))


def _clamp(start: int | None, end: int | None, n: int) -> tuple[int, int]:
    start = 0 if start is None else start
    end = n if end is None else end
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    start = min(max(start, 0), n)
    end = min(max(end, start), n)
    return start, end


@_handles(aten.slice.Tensor)
def _slice(b: dict, out: torch.Tensor) -> V.Value:
    x = b["self"]
    d = _dim(b["dim"], x.ndim)
    start, end = _clamp(b["start"], b["end"], x.shape[d])
    return _move(x, lambda r: R.narrow(r, d, start, end, b["step"]))


@_handles(aten.narrow.default)
def _narrow(b: dict, out: torch.Tensor) -> V.Value:
    x = b["self"]
    d = _dim(b["dim"], x.ndim)
    start = b["start"] + x.shape[d] if b["start"] < 0 else b["start"]
    return _move(x, lambda r: R.narrow(r, d, start, start + b["length"]))


@_handles(aten.select.int)
def _select(b: dict, out: torch.Tensor) -> V.Value:
    x = b["self"]
    d = _dim(b["dim"], x.ndim)
    i = b["index"] + x.shape[d] if b["index"] < 0 else b["index"]
    return _move(x, lambda r: R.squeeze(R.narrow(r, d, i, i + 1), [d]))


@_handles(
    aten.split.Tensor,
    aten.split_with_sizes.default,
    aten.unsafe_split.Tensor,
    aten.unsafe_split_with_sizes.default,
    aten.split.sizes,
)
def _split(b: dict, outs: Sequence[torch.Tensor]) -> list[V.Value]:
    x = b["self"]
    d = _dim(b["dim"], x.ndim)
    bounds, start = [], 0
    for o in outs:
        bounds.append((start, start + o.shape[d]))
        start += o.shape[d]
    return V.move_many(x.value, lambda r: [R.narrow(r, d, a, e) for a, e in bounds], len(bounds))


@_handles(aten.unbind.int)
def _unbind(b: dict, outs: Sequence[torch.Tensor]) -> list[V.Value]:
    x = b["self"]
    d, n = _dim(b["dim"], x.ndim), x.shape[_dim(b["dim"], x.ndim)]
    return V.move_many(x.value, lambda r: [R.squeeze(R.narrow(r, d, i, i + 1), [d]) for i in range(n)], n)


def _inputs(tensors: Sequence[torch.Tensor], out: torch.Tensor) -> list[V.Value]:
    kept = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0 and out.ndim != 1)]
    return [_val(t, out.dtype) for t in kept]


@_handles(aten.cat.default)
def _cat(b: dict, out: torch.Tensor) -> V.Value:
    return V.cat(_inputs(b["tensors"], out), _dim(b["dim"], out.ndim), tuple(out.shape))


@_handles(aten.stack.default)
def _stack(b: dict, out: torch.Tensor) -> V.Value:
    d = _dim(b["dim"], out.ndim)
    parts = [V.move(v, lambda r: R.unsqueeze(r, d)) for v in _inputs(b["tensors"], out)]
    return V.cat(parts, d, tuple(out.shape))


@_handles(aten.flip.default)
def _flip(b: dict, out: torch.Tensor) -> V.Value:
    x = b["self"]
    return _move(x, lambda r: R.flip(r, sorted({_dim(d, x.ndim) for d in b["dims"]})))


@_handles(aten.repeat.default)
def _repeat(b: dict, out: torch.Tensor) -> V.Value:
    x, reps = b["self"], list(b["repeats"])
    shape = (1,) * (len(reps) - x.ndim) + tuple(x.shape)
    tiled = []
    for rep, n in zip(reps, shape):
        tiled += [rep, n]

    def tile(region: R.Region) -> R.Region:
        region = reshape(region, shape)
        for i in range(len(reps)):
            region = R.unsqueeze(region, 2 * i)
        return reshape(R.expand(region, tiled), tuple(out.shape))

    return _move(x, tile)
