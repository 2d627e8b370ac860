"""In-place writes: a destination stand-in that ``copy_``, ``fill_``, ``__setitem__`` … write into, piece by piece.

Vocabulary (as in :mod:`regiontrace.region`, plus):

- **destination**: a stand-in for a tensor that code writes into (``torch.empty``, a parameter, ``param.data``):
  a :class:`Destination`. Its *content* is a region of its shape; before any write every element reads the
  destination's *prior* source (``<prior NAME>``: what the tensor held before) or a constant (``fill=``).
- **address**: where a view of the destination lies in its storage (:mod:`regiontrace.addresses`): every view
  (``narrow``, slicing, ``select``, ``view``, ``transpose``, ``split``, ``as_strided`` …) is a Destination with
  its own address over the same content.
- **write**: one in-place op through one address: the content there becomes the written value (a later write
  wins, as torch runs it). A destination keeps, besides its content, which write last wrote each element and
  which elements a write found already written: :func:`regiontrace.certificate.coverage` reads both.

Reading a Destination (any op that is not a write or a view) reads its current content through its address.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import region as R
from . import values as V
from ._torch import op_schema
from .addresses import Address, address, overwrite, read
from .constants import constant_region
from .errors import Untraceable
from .reshape import reshape
from .tensor import FACTORIES, Node, RegionTensor

aten = torch.ops.aten

__all__ = ["Destination", "Write", "constant", "destination", "prior_name"]

#: the source every element of a destination's write maps reads before any write reached it
UNWRITTEN = R.Source("<unwritten>", (), torch.int64)


def prior_name(name: str) -> str:
    """The name of the source a destination ``name``'s elements read before any write (what the tensor held)."""
    return f"<prior {name}>"


def write_marker(index: int) -> R.Source:
    """The 0-dim source standing for "written by write ``index``" in a destination's write maps."""
    return R.Source(f"<write {index}>", (), torch.int64)


@dataclass(frozen=True)
class Write:
    """One in-place op: its index (program order), the op, and the addresses it wrote through (one, or one per
    run of consecutive rows of an ``index_copy_``/``index_put_``)."""

    index: int
    op: str
    addresses: tuple[Address, ...]


@dataclass(eq=False)
class WriteState:
    """What the views of one destination share: its content, and per element the last write and an earlier one."""

    name: str
    content: R.Region
    prior: R.Source | None
    last: R.Region
    earlier: R.Region
    writes: list[Write] = field(default_factory=list)
    made: int = 0

    @property
    def shape(self) -> tuple[int, ...]:
        """The destination's shape."""
        return self.content.shape


def destination(name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32, fill: Any = None) -> Destination:
    """A stand-in for a tensor that code writes into.

    Args:
        name: its name; elements no write reaches read the source :func:`prior_name` of it (what the tensor
            held before: pass it to ``materialize`` under that name).
        shape, dtype: the tensor's.
        fill: a constant every element holds before any write (``torch.zeros``/``torch.full``), instead.
    """
    shape = tuple(int(n) for n in shape)
    prior = None if fill is not None else R.Source(prior_name(name), shape, dtype)
    content = R.Region.leaf(prior) if prior is not None else constant_region(fill, shape, dtype)
    unwritten = R.expand(R.Region.leaf(UNWRITTEN), shape) if math.prod(shape) else R.Region(shape, ())
    state = WriteState(name, content, prior, unwritten, unwritten)
    meta = torch.empty(shape, dtype=dtype, device="meta")
    return Destination(meta, None, Node("destination", shape, dtype, (), {"name": name}), state)


class Destination(RegionTensor):
    """A RegionTensor over a destination's storage: writes through it change the content every view reads."""

    _state: WriteState

    @staticmethod
    def __new__(cls, meta: torch.Tensor, value: Any, node: Node, state: WriteState) -> Destination:
        r = RegionTensor.__new__(cls, meta, value, node)
        r._state = state
        return r

    @property
    def _value(self) -> V.Value:  # the current content, read through this view's address
        return read(self._state.content, self._state.shape, address(self._meta))

    @_value.setter
    def _value(self, value: Any) -> None:  # RegionTensor.__new__ sets it; a Destination's comes from its state
        pass

    @property
    def destination_name(self) -> str:
        """The name of the destination this tensor is (a view of)."""
        return self._state.name

    @property
    def writes(self) -> tuple[Write, ...]:
        """The writes into this destination so far, in program order."""
        return tuple(self._state.writes)

    def __setitem__(self, key: Any, value: Any) -> None:
        # torch turns a scalar into a meta tensor for a meta-device subclass (its value lost): pass a constant
        if not isinstance(value, RegionTensor):
            if isinstance(value, torch.Tensor) and value.numel() != 1:
                raise Untraceable("`copy_` writes a real tensor into a destination: its values are no source's")
            value = constant(value.item() if isinstance(value, torch.Tensor) else value, self.dtype)
        super().__setitem__(key, value)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        target = args[0] if args else None
        if isinstance(target, Destination):
            if func in WRITE_OPS:
                return WRITE_OPS[func](target, *args[1:], **kwargs)
            if func in FACTORY_OPS:
                return _factory(target, func, args[1:], kwargs)
            if _is_view(func):
                return _view(target, func, args, kwargs)
        if op_schema(func).is_mutable:
            raise Untraceable(
                f"`{name}` ({func}) writes in place: only copy_, fill_, zero_, index_put_ and "
                "index_copy_ into a destination are traced"
            )
        return RegionTensor.__torch_dispatch__(func, types, args, kwargs)


def constant(value: Any, dtype: torch.dtype) -> RegionTensor:
    """A 0-dim RegionTensor holding the constant ``value`` (stored as ``dtype``)."""
    meta = torch.empty((), dtype=dtype, device="meta")
    return RegionTensor(meta, constant_region(value, (), dtype), Node("constant", (), dtype, (), {"value": value}))


def _is_view(func: Any) -> bool:
    schema = op_schema(func)
    return not schema.is_mutable and any(r.alias_info is not None for r in schema.returns)


def _view(target: Destination, func: Any, args: tuple, kwargs: dict) -> Any:
    margs = [a._meta if isinstance(a, RegionTensor) else a for a in args]
    out = func(*margs, **kwargs)
    name = func.overloadpacket.__name__

    def wrap(m: torch.Tensor) -> Destination:
        if m.dtype != target.dtype:
            raise Untraceable(f"`{name}` ({func}) views a destination as another dtype")
        return Destination(m, None, Node(name, tuple(m.shape), m.dtype, (target._node,)), target._state)

    return wrap(out) if isinstance(out, torch.Tensor) else type(out)(wrap(m) for m in out)


def _factory(target: RegionTensor, func: Any, args: tuple, kwargs: dict) -> Destination:
    """``new_zeros``/``new_full``/``new_empty``/``zeros_like`` … of a destination or any RegionTensor: a new
    destination (filled with the constant; ``new_empty``/``empty_like``: holding its prior contents)."""
    name = func.overloadpacket.__name__
    shape = tuple(target.shape) if name.endswith("_like") else tuple(args[0])
    dtype = kwargs.get("dtype") or target.dtype
    fill = {"new_zeros": 0, "zeros_like": 0, "new_ones": 1, "ones_like": 1}.get(name)
    if name in ("new_full", "full_like"):
        fill = args[-1] if len(args) > (0 if name == "full_like" else 1) else kwargs["fill_value"]
    if not isinstance(target, Destination):
        return destination(f"<{name} {next(_MADE)}>", shape, dtype, fill)
    state = target._state
    state.made += 1
    return destination(f"{state.name}.{name}.{state.made}", shape, dtype, fill)


#: numbers the destinations that factory ops make from stand-ins which are not destinations
_MADE = itertools.count()


# ---------------------------------------------------------------------------------------------------
# the writes


def record(parts: Sequence[tuple[Destination, R.Region]], op: str) -> None:
    """One write: each ``value`` (a region of its view's shape and dtype) through its view's address; the views
    are of one destination and do not overlap each other."""
    state = parts[0][0]._state
    index, addrs = len(state.writes), []
    for target, value in parts:
        addr = address(target._meta)
        state.earlier = overwrite(state.earlier, state.shape, addr, read(state.last, state.shape, addr))
        marker = R.expand(R.Region.leaf(write_marker(index)), addr[0])
        state.last = overwrite(state.last, state.shape, addr, marker)
        state.content = overwrite(state.content, state.shape, addr, value)
        addrs.append(addr)
    state.writes.append(Write(index, op, tuple(addrs)))


def _written(target: Destination, src: Any, op: str) -> R.Region:
    """``src`` (a RegionTensor or a real scalar) as a region of ``target``'s shape and dtype."""
    shape = tuple(target.shape)
    if not isinstance(src, torch.Tensor) or (not isinstance(src, RegionTensor) and src.dim() == 0):
        return constant_region(src.item() if isinstance(src, torch.Tensor) else src, shape, target.dtype)
    if not isinstance(src, RegionTensor):
        raise Untraceable(f"`{op}` writes a real tensor into a destination: its values are no source's")
    value = V.cast(src.value, target.dtype, src.dtype)
    if not isinstance(value, R.Region):
        raise Untraceable(f"`{op}` writes values computed by `{value.name}`: only index maps are written")
    if tuple(value.shape) != shape:
        lead = len(shape) - len(value.shape)
        value = R.expand(reshape(value, (1,) * max(lead, 0) + tuple(value.shape)), shape)
    return value


def _copy(target: Destination, src: Any, non_blocking: bool = False) -> Destination:
    record([(target, _written(target, src, "copy_"))], "copy_")
    return target


def _fill(target: Destination, value: Any) -> Destination:
    record([(target, _written(target, value, "fill_"))], "fill_")
    return target


def _zero(target: Destination) -> Destination:
    record([(target, constant_region(0, target.shape, target.dtype))], "zero_")
    return target


def _rows(index: Any, n: int, op: str) -> list[tuple[int, int, int]]:
    """Runs ``(position in index, first row, count)`` of consecutive rows of a known index tensor."""
    if isinstance(index, RegionTensor) or not isinstance(index, torch.Tensor) or index.dtype == torch.bool:
        raise Untraceable(f"`{op}` with indices that are not a known integer tensor")
    if index.dim() > 1:
        raise Untraceable(f"`{op}` with a {index.dim()}-dim index: one dim of indices only")
    rows = [int(i) % n if n else int(i) for i in index.reshape(-1).tolist()]
    if len(set(rows)) != len(rows):
        raise Untraceable(f"`{op}` with a repeated index: torch leaves which write wins undefined")
    runs: list[tuple[int, int, int]] = []
    for j, i in enumerate(rows):
        if runs and runs[-1][1] + runs[-1][2] == i and runs[-1][0] + runs[-1][2] == j:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((j, i, 1))
    return runs


def _rows_written(target: Destination, d: int, index: Any, source: Any, op: str) -> Destination:
    """``source`` (rows along ``d`` in ``index`` order) written into rows ``index`` of ``target``: one write."""
    parts = []
    for j, i, n in _rows(index, target.shape[d], op):
        view = target.narrow(d, i, n)
        part = source.narrow(d, j, n) if isinstance(source, RegionTensor) and source.dim() else source
        parts.append((view, _written(view, part, op)))
    if parts:
        record(parts, op)
    return target


def _index_copy(target: Destination, dim: int, index: Any, source: Any) -> Destination:
    if isinstance(source, torch.Tensor) and source.dtype != target.dtype:  # as torch refuses it
        raise RuntimeError(
            f"index_copy_(): self and source expected to have the same dtype, but got (self) "
            f"{target.dtype} and (source) {source.dtype}"
        )
    return _rows_written(target, dim % max(target.ndim, 1), index, source, "index_copy_")


def _index_put(target: Destination, indices: Sequence[Any], values: Any, accumulate: bool = False) -> Destination:
    given = [k for k, t in enumerate(indices) if t is not None]
    if accumulate or len(given) != 1:
        raise Untraceable("`index_put_` traces one known integer index and accumulate=False only")
    (d,) = given
    shape = target.shape[:d] + (indices[d].numel(),) + target.shape[d + 1 :]
    if isinstance(values, RegionTensor) and tuple(values.shape) != tuple(shape):
        values = values.expand(shape)
    return _rows_written(target, d, indices[d], values, "index_put_")


#: the in-place ops a destination traces, each ``(destination, *args, **kwargs) -> destination``
WRITE_OPS = {
    aten.copy_.default: _copy,
    aten.fill_.Scalar: _fill,
    aten.fill_.Tensor: _fill,
    aten.zero_.default: _zero,
    aten.index_copy_.default: _index_copy,
    aten.index_put_.default: _index_put,
}

#: the ops that make a new tensor like a destination: they make a new destination
FACTORY_OPS = frozenset(
    getattr(aten, n).default
    for n in "new_zeros new_ones new_empty new_full zeros_like ones_like empty_like full_like".split()
)
for _op in FACTORY_OPS:
    FACTORIES[_op] = lambda func, args, kwargs: _factory(args[0], func, args[1:], kwargs)
