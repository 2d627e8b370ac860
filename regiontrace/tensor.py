"""RegionTensor: a stand-in for a checkpoint tensor that records movement ops as an index map.

A RegionTensor is a ``torch.Tensor`` wrapper subclass on the meta device. Every op reaches
``__torch_dispatch__`` after torch's own decompositions (``reshape`` → ``view`` or ``clone`` +
``_unsafe_view``, ``chunk`` → ``split``, ``x[1:]`` → ``slice`` …). Each op runs on the carried meta tensor,
which gives torch's exact shapes, strides and dtypes, and on the :class:`~regiontrace.region.Region`, which
records where every output element comes from. Ops that are not pure index mappings raise
:class:`~regiontrace.errors.Untraceable` naming the op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import region as R
from . import values as V
from ._torch import DISABLED_TORCH_FUNCTION, make_wrapper_subclass, schema_arguments, tree_flatten, tree_map_only
from .compile import compile_blocks
from .constants import constant_region, uniform_value
from .errors import TraceMismatch, Untraceable
from .movement import HANDLERS
from .remap_block import RemapBlock
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
        return _dispatch(func, args, kwargs or {})


#: ops that make a new tensor like a RegionTensor (``new_zeros`` … ``full_like``): ``(func, args, kwargs) -> tensor``;
#: :mod:`regiontrace.writes` registers them (each makes a destination)
FACTORIES: dict[Any, Any] = {}


def _dispatch(func, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` on RegionTensors: on their meta tensors for the output's shape and dtype, and on their values
    (a movement handler of :data:`HANDLERS`, or a pointwise op recorded as an Apply)."""
    name = func.overloadpacket.__name__
    if func in FACTORIES:
        return FACTORIES[func](func, args, kwargs)
    flat, _ = tree_flatten((args, kwargs))
    handler = HANDLERS.get(func)
    pointwise = handler is None and V.is_value_op(func)
    if handler is None and not pointwise:
        raise Untraceable(f"`{name}` ({func}) is not a pure index mapping or a pointwise op")
    for x in flat:  # a pointwise op may take real scalars (``x - 127.0`` passes a 0-dim tensor)
        if isinstance(x, torch.Tensor) and not isinstance(x, RegionTensor) and x.device.type == "meta":
            raise Untraceable(
                f"`{name}` ({func}) takes a real tensor on the meta device (a Python scalar torch made one of, as "
                "for `torch.where(c, x, 0.0)`): its value is lost; pass a tensor (`x.new_zeros(())`) instead"
            )
        if isinstance(x, torch.Tensor) and not isinstance(x, RegionTensor) and (x.dim() or not pointwise):
            args, kwargs = tree_map_only(torch.Tensor, lambda t: _as_constant(t, name, func), (args, kwargs))
            flat, _ = tree_flatten((args, kwargs))
            break
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


def _as_constant(t: torch.Tensor, name: str, func: Any) -> torch.Tensor:
    """A real tensor an op mixes with RegionTensors: a constant RegionTensor when all its elements are one value
    (a ``torch.zeros`` padding), else Untraceable (its values are no source's)."""
    if isinstance(t, RegionTensor) or (t.dim() == 0 and V.is_value_op(func)):
        return t
    value = uniform_value(t)
    if value is None:
        raise Untraceable(f"`{name}` ({func}) mixes a RegionTensor with a real tensor whose elements differ")
    meta = torch.empty(t.shape, dtype=t.dtype, device="meta")
    region = constant_region(value, tuple(t.shape), t.dtype)
    return RegionTensor(meta, region, Node("constant", tuple(t.shape), t.dtype, (), {"value": value}))


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
