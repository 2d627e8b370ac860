"""Pointwise value ops over regions: a traced conversion may end in elementwise arithmetic (``w.float() * scale``)
whose operands are index maps of the same box.

Vocabulary (used identically in code, docstrings and docs):

- **value**: what a RegionTensor stands for: a :class:`~regiontrace.region.Region` (an index map: pure data
  movement), or an :class:`Apply` (values computed from regions).
- **Apply**: one pointwise aten op (tagged ``torch.Tag.pointwise``, or a dtype cast) over *operands*, which are
  values of the Apply's own shape (a broadcast operand is an expanded region: stride 0 on the broadcast dims),
  plus its non-tensor arguments (*constants*, real scalar tensors among them).
- **input**: a region at the bottom of an Apply, with the dtype its elements have there (its *input dtype*);
  a ValueProgram fills one box-shaped tensor per input. (A *leaf* is a RegionTensor standing for a whole source.)
- **push-down**: movement ops commute with pointwise ops, so a view, slice, cat or permute of an Apply is the
  same Apply over the moved operands. An Apply is therefore always on top, regions at the bottom (its inputs).
- **ValueProgram**: an Apply compiled for a box: per input, the RemapBlocks that fill a box-shaped tensor of the
  input dtype, and the op tree that turns those tensors into the box's values (:mod:`regiontrace.value_program`).

Each element of an output box depends only on the same element of each operand, so a box's values need only
the box's part of each input: a rank reads the weight elements of its box and the scale blocks they touch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import region as R
from ._torch import TreeSpec, op_schema, schema_arguments, tree_flatten
from .errors import Untraceable
from .reshape import reshape

aten = torch.ops.aten


@dataclass(frozen=True)
class Operand:
    """Marks where operand ``index`` goes among an :class:`Apply`'s arguments."""

    index: int


@dataclass(frozen=True, eq=False)
class Apply:
    """Values computed by one pointwise op from operands of this shape.

    Attributes:
        func: the aten op replayed on real tensors.
        spec, constants: the op's ``(args, kwargs)`` flattened; :class:`Operand` marks the operands' places.
        operands: each operand's value (a Region or an Apply), of shape ``shape`` — except *scalar* operands.
        dtypes: each operand's dtype.
        scalars: per operand, whether it was a 0-dim tensor in an op of higher rank. A scalar operand stays
            0-dim (never broadcast, never moved): torch's type promotion treats it differently.
        shape, dtype: the result's.
    """

    func: Any
    spec: TreeSpec
    constants: tuple[Any, ...]
    operands: tuple[Value, ...]
    dtypes: tuple[torch.dtype, ...]
    scalars: tuple[bool, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def name(self) -> str:
        return self.func.overloadpacket.__name__

    def same_op(self, other: Apply) -> bool:
        """Whether ``other`` computes its values the same way (operands aside)."""
        return (
            self.func == other.func
            and self.spec == other.spec
            and self.dtypes == other.dtypes
            and self.scalars == other.scalars
            and self.dtype == other.dtype
            and len(self.constants) == len(other.constants)
            and all(_same_constant(a, b) for a, b in zip(self.constants, other.constants))
        )


Value = R.Region | Apply


def _same_constant(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    return type(a) is type(b) and a == b


#: ``_to_copy`` arguments that move memory rather than change values (dropped when a cast is recorded)
_PLACEMENT_ARGS = ("device", "pin_memory", "non_blocking", "layout", "memory_format")


#: pointwise ops whose every element is exactly rounded (IEEE basic arithmetic, comparisons, selection, integer
#: and rounding ops): the value of an element does not depend on how many elements a kernel processes at once.
#: Transcendental ops (``exp``, ``log``, ``pow`` …) round differently in vectorised and scalar code paths, so a
#: box computed alone could differ from the whole tensor in the last bit: they are refused.
EXACT_OPS = frozenset(
    "add sub rsub mul div true_divide neg abs sign sgn sqrt reciprocal where masked_fill clamp clamp_min clamp_max "
    "minimum maximum fmin fmax eq ne lt le gt ge isnan isinf isfinite signbit logical_and logical_or logical_xor "
    "logical_not bitwise_and bitwise_or bitwise_xor bitwise_not bitwise_left_shift bitwise_right_shift __lshift__ "
    "__rshift__ __and__ __or__ __xor__ floor ceil round trunc frac remainder fmod copysign nan_to_num".split()
)


def is_value_op(func: Any) -> bool:
    """Whether ``func`` is a deterministic, out-of-place pointwise op (a candidate for :func:`apply`)."""
    tags = getattr(func, "tags", ())
    return (
        torch.Tag.pointwise in tags
        and torch.Tag.nondeterministic_seeded not in tags
        and not op_schema(func).is_mutable
        and len(op_schema(func).returns) == 1
    )


def check_exact(func: Any, kwargs: dict) -> None:
    """Refuse a pointwise op whose elements could round differently in a box than in the whole tensor.

    Raises:
        Untraceable: naming the op and why.
    """
    name = func.overloadpacket.__name__
    if name not in EXACT_OPS:
        raise Untraceable(
            f"`{name}` is pointwise but not exactly rounded: its kernels round differently in vectorised and "
            "scalar code, so a box computed alone could differ from the whole tensor"
        )
    if kwargs.get("alpha", 1) != 1:  # ``a + alpha * b`` is fused (one rounding) in vectorised kernels only
        raise Untraceable(f"`{name}` with alpha={kwargs['alpha']}: fused in vectorised kernels only")


# ---------------------------------------------------------------------------------------------------
# building values


def apply(func: Any, args: tuple, kwargs: dict, out: torch.Tensor, value_of: Callable[[Any], Value | None]) -> Apply:
    """The Apply of pointwise ``func`` on ``(args, kwargs)``, whose tensors are RegionTensors or real scalars.

    Args:
        func: the op.
        args, kwargs: its arguments as called.
        out: the op's meta output (shape and dtype).
        value_of: a tensor's value when it is a RegionTensor, else None.

    Raises:
        Untraceable: a real tensor that is not a scalar among the arguments.
    """
    check_exact(func, _bound_kwargs(func, args, kwargs))
    flat, spec = tree_flatten((args, kwargs))
    constants, operands, dtypes, scalars = [], [], [], []
    shape = tuple(out.shape)
    for x in flat:
        value = value_of(x) if isinstance(x, torch.Tensor) else None
        if value is None:
            if isinstance(x, torch.Tensor) and x.dim() != 0:
                raise Untraceable(f"`{func.overloadpacket.__name__}` mixes a RegionTensor with a real tensor")
            constants.append(x.detach().clone() if isinstance(x, torch.Tensor) else x)
            continue
        constants.append(Operand(len(operands)))
        scalar = x.dim() == 0 and len(shape) > 0
        operands.append(value if scalar else _broadcast(value, tuple(x.shape), shape))
        dtypes.append(x.dtype)
        scalars.append(scalar)
    return Apply(func, spec, tuple(constants), tuple(operands), tuple(dtypes), tuple(scalars), shape, out.dtype)


def _bound_kwargs(func: Any, args: tuple, kwargs: dict) -> dict:
    names = [a.name for a in schema_arguments(func)]
    return {**dict(zip(names, args)), **kwargs}


def cast(value: Value, dtype: torch.dtype, from_dtype: torch.dtype) -> Value:
    """``value`` (of dtype ``from_dtype``) cast to ``dtype``: recorded on the pieces of a region, an Apply on top
    of an Apply."""
    if dtype == from_dtype:
        return value
    if isinstance(value, R.Region):
        return R.cast(value, dtype)
    _, spec = tree_flatten(((Operand(0),), {"dtype": dtype}))
    return Apply(
        aten._to_copy.default, spec, (Operand(0), dtype), (value,), (from_dtype,), (False,), value.shape, dtype
    )


def move(value: Value, fn: Callable[[R.Region], R.Region]) -> Value:
    """Push a movement op down: ``fn`` applied to every input region (movement commutes with pointwise ops)."""
    if isinstance(value, R.Region):
        return fn(value)
    operands = tuple(o if sc else move(o, fn) for o, sc in zip(value.operands, value.scalars))
    return replace(value, operands=operands, shape=_moved_shape(value, operands))


def move_many(value: Value, fn: Callable[[R.Region], Sequence[R.Region]], count: int) -> list[Value]:
    """Push down a movement op with ``count`` outputs (split, unbind): the i-th output of every input region."""
    if isinstance(value, R.Region):
        return list(fn(value))
    per_operand = [[o] * count if sc else move_many(o, fn, count) for o, sc in zip(value.operands, value.scalars)]
    outs = [tuple(p[i] for p in per_operand) for i in range(count)]
    return [replace(value, operands=ops, shape=_moved_shape(value, ops)) for ops in outs]


def _moved_shape(value: Apply, operands: Sequence[Value]) -> tuple[int, ...]:
    return next(o.shape for o, sc in zip(operands, value.scalars) if not sc)


def cat(values: Sequence[Value], dim: int, shape: Sequence[int]) -> Value:
    """Concatenate values along ``dim``: regions as regions; Applies of the same op over concatenated operands.

    Raises:
        Untraceable: index-mapped and computed values mixed, or Applies of different ops.
    """
    if all(isinstance(v, R.Region) for v in values):
        return R.cat(values, dim, shape)
    first = next(v for v in values if isinstance(v, Apply))
    for v in values:
        if not isinstance(v, Apply) or not first.same_op(v):
            what = "an index map" if isinstance(v, R.Region) else f"`{v.name}`"
            raise Untraceable(f"`cat` of values computed by `{first.name}` with {what}: not one pointwise op")
    operands = []
    for i in range(len(first.operands)):
        parts = [v.operands[i] for v in values]
        if first.scalars[i]:
            if any(p != parts[0] for p in parts):
                raise Untraceable(f"`cat` of values computed by `{first.name}` with different scalar operands")
            operands.append(parts[0])
            continue
        op_shape = list(parts[0].shape)
        op_shape[dim] = sum(p.shape[dim] for p in parts)
        operands.append(cat(parts, dim, op_shape))
    return replace(first, operands=tuple(operands), shape=tuple(shape))


def input_regions(value: Value, dtype: torch.dtype, scalar: bool = False) -> list[tuple[R.Region, torch.dtype, bool]]:
    """The inputs of ``value``: the regions at the bottom of its op tree (depth first), each with its input dtype
    and whether it is (under) a scalar operand; ``dtype`` is ``value``'s own (a region is its own one input)."""
    if isinstance(value, R.Region):
        return [(value, dtype, scalar)]
    return [
        i for o, d, sc in zip(value.operands, value.dtypes, value.scalars) for i in input_regions(o, d, scalar or sc)
    ]


def _broadcast(value: Value, shape: tuple[int, ...], out: tuple[int, ...]) -> Value:
    """An operand of ``shape`` expanded to the op's output shape ``out`` (torch's broadcasting)."""
    if shape == out:
        return value
    padded = (1,) * (len(out) - len(shape)) + shape
    return move(value, lambda r: R.expand(reshape(r, padded), out))


def describe(value: Value, names: Callable[[R.Region], str]) -> str:
    """``value`` as an expression, e.g. ``_to_copy(mul(v0, v1), bfloat16)``; ``names`` names an input region."""
    if isinstance(value, R.Region):
        return names(value)
    args = [
        describe(value.operands[c.index], names) if isinstance(c, Operand) else _constant(c) for c in value.constants
    ]
    return f"{value.name}({', '.join(a for a in args if a)})"


def _constant(c: Any) -> str:
    if isinstance(c, torch.Tensor):
        return repr(c.item())
    if isinstance(c, torch.dtype):
        return str(c).replace("torch.", "")
    return "" if c is None else repr(c)
