"""RegionTensor: a stand-in for a checkpoint tensor that records movement ops as an index map.

A RegionTensor is a ``torch.Tensor`` wrapper subclass on the meta device. Every op reaches
``__torch_dispatch__`` after torch's own decompositions (``reshape`` → ``view`` or ``clone`` +
``_unsafe_view``, ``chunk`` → ``split``, ``x[1:]`` → ``slice`` …). Each op runs on the carried meta tensor,
which gives torch's exact shapes, strides and dtypes, and on the :class:`~regiontrace.region.Region`, which
records where every output element comes from. Ops that are not pure index mappings raise
:class:`~regiontrace.errors.Untraceable` naming the op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import region as R
from . import values as V
from ._torch import DISABLED_TORCH_FUNCTION, make_wrapper_subclass, schema_arguments, tree_flatten, tree_map_only
from .compile import compile_blocks
from .errors import TraceMismatch, Untraceable
from .remap_block import RemapBlock
from .reshape import reshape
from .value_program import ValueProgram, compile_values

aten = torch.ops.aten


@dataclass(frozen=True, eq=False)
class Node:
    """One vertex of the index-mapping graph: the op that made a RegionTensor, and its parents."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    parents: tuple[Node, ...] = ()
    params: dict[str, Any] = field(default_factory=dict)


class RegionTensor(torch.Tensor):
    """A tensor whose values are an exact index map into named source tensors.

    Create leaves with :meth:`leaf`; run ordinary torch code on them; read the map back with
    :meth:`remap_blocks`, :meth:`sources`, :func:`regiontrace.explain` or :func:`regiontrace.to_networkx`.
    """

    _meta: torch.Tensor
    _value: V.Value
    _node: Node

    __torch_function__ = DISABLED_TORCH_FUNCTION

    @staticmethod
    def __new__(cls, meta: torch.Tensor, value: V.Value, node: Node) -> RegionTensor:
        r = make_wrapper_subclass(
            cls,
            meta.shape,
            strides=meta.stride(),
            storage_offset=meta.storage_offset(),
            dtype=meta.dtype,
            device=torch.device("meta"),
            requires_grad=False,
        )
        r._meta, r._value, r._node = meta, value, node
        return r

    @classmethod
    def leaf(cls, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> RegionTensor:
        """A source tensor: element ``i`` of the output is element ``i`` of source ``name``.

        Args:
            name: the source's name (e.g. a checkpoint key).
            shape: its shape.
            dtype: its dtype.
        """
        shape = tuple(int(n) for n in shape)
        if any(n < 0 for n in shape):
            raise ValueError(f"leaf {name!r}: negative size in shape {shape}")
        meta = torch.empty(shape, dtype=dtype, device="meta")
        node = Node("leaf", shape, dtype, (), {"name": name})
        return cls(meta, R.Region.leaf(R.Source(name, shape, dtype)), node)

    # -- reading the map ------------------------------------------------------------------------------

    @property
    def value(self) -> V.Value:
        """What this tensor stands for: an index map (a :class:`~regiontrace.Region`), or values computed from
        index maps by pointwise ops (an :class:`~regiontrace.values.Apply`)."""
        return self._value

    @property
    def is_index_map(self) -> bool:
        """Whether every element is a checkpoint element (possibly cast): no pointwise arithmetic."""
        return isinstance(self._value, R.Region)

    @property
    def region(self) -> R.Region:
        """The index map (pieces partitioning the output).

        Raises:
            Untraceable: the values are computed by pointwise ops (see :attr:`value`).
        """
        return self._index_map("region")

    @property
    def node(self) -> Node:
        """The index-mapping graph node of this tensor."""
        return self._node

    def sources(self) -> frozenset[str]:
        """Names of the sources this tensor reads."""
        return frozenset(p.source.name for r, _, _ in V.input_regions(self._value, self.dtype) for p in r.pieces)

    def remap_blocks(self, box: Sequence[Sequence[int]] | None = None) -> tuple[RemapBlock, ...]:
        """Compile the map for ``box`` (half-open ``(start, stop)`` per dim; default: everything).

        Returns:
            Blocks that partition the box; their destinations are box-local.

        Raises:
            ValueError: the box lies outside the shape.
            Untraceable: the values are computed by pointwise ops (compile them with :meth:`value_program`).
        """
        return compile_blocks(self._index_map("remap_blocks"), box)

    def value_program(self, box: Sequence[Sequence[int]] | None = None) -> ValueProgram:
        """Compile values computed by pointwise ops for ``box`` (default: everything).

        Returns:
            Per leaf, the blocks filling a box-shaped input, and the ops that turn the inputs into the box.

        Raises:
            ValueError: the box lies outside the shape, or this tensor is an index map (use :meth:`remap_blocks`).
        """
        if isinstance(self._value, R.Region):
            raise ValueError("this tensor is an index map: compile it with remap_blocks()")
        return compile_values(self._value, box)

    def _index_map(self, what: str) -> R.Region:
        if isinstance(self._value, V.Apply):
            raise Untraceable(
                f"`{what}`: the values are computed by `{self._value.name}`, not an index map "
                "(see .value and .value_program())"
            )
        return self._value

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        names = ", ".join(sorted(self.sources()))
        if isinstance(self._value, V.Apply):
            what = f"values={V.describe(self._value, lambda r: '·')}"
        else:
            what = f"pieces={len(self._value.pieces)}"
        return f"RegionTensor(shape={tuple(self.shape)}, dtype={self.dtype}, {what}, sources=[{names}])"

    # -- value access is never an index mapping --------------------------------------------------------

    def _refuse(self, op: str) -> Any:
        raise Untraceable(f"`{op}` reads tensor values, which a RegionTensor does not have")

    def item(self) -> Any:
        return self._refuse("item")

    def tolist(self) -> Any:
        return self._refuse("tolist")

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse("numpy")

    def data_ptr(self) -> int:
        return self._refuse("data_ptr")

    def untyped_storage(self) -> Any:
        return self._refuse("untyped_storage")

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        return self._refuse("__array__")

    def __bool__(self) -> bool:
        return self._refuse("__bool__")

    # -- dispatch ----------------------------------------------------------------------------------------

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat, _ = tree_flatten((args, kwargs))
        handler = _HANDLERS.get(func)
        pointwise = handler is None and V.is_value_op(func)
        if handler is None and not pointwise:
            raise Untraceable(f"`{name}` ({func}) is not a pure index mapping or a pointwise op")
        for x in flat:  # a pointwise op may take real scalars (``x - 127.0`` passes a 0-dim tensor)
            if isinstance(x, torch.Tensor) and not isinstance(x, RegionTensor) and (x.dim() or not pointwise):
                raise Untraceable(f"`{name}` ({func}) mixes a RegionTensor with a real tensor")
        margs, mkwargs = tree_map_only(RegionTensor, lambda r: r._meta, (args, kwargs))
        if func is aten._to_copy.default:
            mkwargs = {k: v for k, v in mkwargs.items() if k not in ("device", "pin_memory", "non_blocking")}
        out_meta = func(*margs, **mkwargs)
        bound = _bind(func, args, kwargs)
        if pointwise:
            regions = V.apply(func, args, kwargs, out_meta, lambda x: getattr(x, "_value", None))
        else:
            regions = handler(bound, out_meta)
        parents = tuple(x._node for x in flat if isinstance(x, RegionTensor))
        params = {k: v for k, v in bound.items() if not _has_tensor(v)}
        if isinstance(out_meta, torch.Tensor):
            return _wrap(out_meta, regions, name, parents, params)
        return type(out_meta)(
            _wrap(m, r, name, parents, dict(params, output=i)) for i, (m, r) in enumerate(zip(out_meta, regions))
        )


def _has_tensor(v: Any) -> bool:
    return any(isinstance(x, torch.Tensor) for x in tree_flatten(v)[0])


def _wrap(meta: torch.Tensor, value: V.Value, op: str, parents: tuple, params: dict) -> RegionTensor:
    if tuple(meta.shape) != value.shape:
        raise TraceMismatch(f"`{op}`: traced shape {value.shape} differs from torch's {tuple(meta.shape)}")
    return RegionTensor(meta, value, Node(op, value.shape, meta.dtype, parents, params))


def _bind(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = {}
    for i, a in enumerate(schema_arguments(func)):
        if i < len(args) and not a.kwarg_only:
            bound[a.name] = args[i]
        elif a.name in kwargs:
            bound[a.name] = kwargs[a.name]
        else:
            bound[a.name] = a.default_value if a.has_default_value() else None
    return bound


# ---------------------------------------------------------------------------------------------------
# handlers: (bound args, meta output) -> Region(s)

Handler = Callable[[dict, Any], Any]
_HANDLERS: dict[Any, Handler] = {}


def _handles(*ops: Any) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        for op in ops:
            _HANDLERS[op] = fn
        return fn

    return register


def _val(t: RegionTensor, dtype: torch.dtype | None = None) -> V.Value:
    """``t``'s value, cast to ``dtype`` when given."""
    return t._value if dtype is None else V.cast(t._value, dtype, t.dtype)


def _move(t: RegionTensor, fn: Callable[[R.Region], R.Region]) -> V.Value:
    """A movement op on ``t``'s value: on its region, or pushed down to the input regions of its pointwise ops."""
    return V.move(t._value, fn)


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
    return V.move_many(x._value, lambda r: [R.narrow(r, d, a, e) for a, e in bounds], len(bounds))


@_handles(aten.unbind.int)
def _unbind(b: dict, outs: Sequence[torch.Tensor]) -> list[V.Value]:
    x = b["self"]
    d, n = _dim(b["dim"], x.ndim), x.shape[_dim(b["dim"], x.ndim)]
    return V.move_many(x._value, lambda r: [R.squeeze(R.narrow(r, d, i, i + 1), [d]) for i in range(n)], n)


def _inputs(tensors: Sequence[RegionTensor], out: torch.Tensor) -> list[V.Value]:
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
