"""A ValueProgram: an Apply compiled for one box of its output, and replaying it on real tensors.

Per input (a region at the bottom of the Apply, :func:`~regiontrace.values.input_regions`), the program holds the
RemapBlocks that fill a box-shaped tensor of the input dtype; :meth:`ValueProgram.evaluate` replays the op tree on
the filled tensors, bit-identical to running the traced code on real tensors. Each element of an output box depends
only on the same element of each operand, so a box's values need only the box's part of each input.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from . import region as R
from ._torch import tree_unflatten
from .compile import check_box, compile_blocks
from .remap_block import RemapBlock
from .values import Apply, Operand, Value, input_regions

aten = torch.ops.aten


@dataclass(frozen=True)
class ValueInput:
    """One input of a :class:`ValueProgram`: a tensor of ``shape`` and ``dtype`` that ``blocks`` fill."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    blocks: tuple[RemapBlock, ...]


@dataclass(frozen=True)
class ValueProgram:
    """An Apply compiled for one box of its output.

    Attributes:
        inputs: per input region (depth first): a :class:`ValueInput`, box-shaped (a box's part of each operand is all
            its elements need) or 0-dim for a scalar operand.
        apply: the op tree (its input regions are not used when evaluating).
        shape: the box's shape; dtype: the values'.
    """

    inputs: tuple[ValueInput, ...]
    apply: Apply
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return self.apply.dtype

    @property
    def blocks(self) -> tuple[RemapBlock, ...]:
        """Every input's blocks: what the box reads."""
        return tuple(b for i in self.inputs for b in i.blocks)

    def with_blocks(self, fn: Callable[[RemapBlock], RemapBlock]) -> ValueProgram:
        """The program with every block replaced by ``fn(block)`` (e.g. renamed sources)."""
        return replace(self, inputs=tuple(replace(i, blocks=tuple(fn(b) for b in i.blocks)) for i in self.inputs))

    def evaluate(self, inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """The box's values from its filled inputs (one box-shaped tensor per input, in :attr:`inputs` order).

        Replays each op exactly as traced (same aten op, same arguments, scalar operands 0-dim), so the result
        is bit-identical to running the traced code on real tensors.

        Raises:
            ValueError: the wrong number of inputs. RuntimeError: an op's result has another dtype than traced.
        """
        if len(inputs) != len(self.inputs):
            raise ValueError(f"expected {len(self.inputs)} inputs, got {len(inputs)}")
        it = iter(inputs)
        return _evaluate(self.apply, it)


def evaluate_into(program: ValueProgram, inputs: Sequence[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Write ``program``'s values for its box into ``out`` (cast to ``out``'s dtype).

    A final cast into ``out``'s dtype is left to ``copy_`` (the same conversion, one pass less).

    Returns:
        ``out``.
    """
    top = program.apply
    if top.func is aten._to_copy.default and top.dtype == out.dtype and len(top.operands) == 1:
        if len(inputs) != len(program.inputs):
            raise ValueError(f"expected {len(program.inputs)} inputs, got {len(inputs)}")
        return out.copy_(_evaluate(top.operands[0], iter(inputs)))
    return out.copy_(program.evaluate(inputs))


def _evaluate(value: Value, inputs: Any) -> torch.Tensor:
    if isinstance(value, R.Region):
        return next(inputs)
    operands = [_evaluate(o, inputs) for o in value.operands]
    # a box of no dims (the op's output moved down to 0-dim): its operands still count as dimensioned next to
    # the scalar ones in torch's type promotion, as they did when traced
    lift = any(value.scalars) and not any(o.dim() for o, sc in zip(operands, value.scalars) if not sc)
    if lift:
        operands = [o if sc else o.reshape(1) for o, sc in zip(operands, value.scalars)]
    flat = [operands[c.index] if isinstance(c, Operand) else c for c in value.constants]
    args, kwargs = tree_unflatten(flat, value.spec)
    out = value.func(*args, **kwargs)
    if lift:
        out = out.reshape(())
    if out.dtype != value.dtype:  # never silently wrong: a replay must round as the traced op did
        raise RuntimeError(f"`{value.name}` replayed to {out.dtype}, traced as {value.dtype}")
    return out


def compile_values(value: Apply, box: Sequence[Sequence[int]] | None = None) -> ValueProgram:
    """Compile an Apply for ``box`` of its output (default: everything).

    Raises:
        ValueError: the box lies outside the shape.
    """
    box = check_box(value.shape, box)
    shape = tuple(b - a for a, b in box)
    inputs = tuple(
        ValueInput(dtype, (), compile_blocks(region))
        if scalar
        else ValueInput(dtype, shape, compile_blocks(region, box))
        for region, dtype, scalar in input_regions(value, value.dtype)
    )
    return ValueProgram(inputs, value, shape)


def fill_inputs(
    program: ValueProgram,
    fill: Callable[[tuple[RemapBlock, ...], torch.Tensor], None],
    device: torch.device,
    empty: Callable[[int, ValueInput], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Allocate the program's inputs on ``device`` and fill each with ``fill(blocks, tensor)``.

    Args:
        program: the compiled program.
        fill: writes an input's blocks into its tensor (every element: the blocks partition the box).
        device: where the inputs live.
        empty: ``empty(index, input)`` returns the tensor for input ``index`` (e.g. a reused buffer); default a
            new one.
    """
    tensors = []
    for n, i in enumerate(program.inputs):
        t = empty(n, i) if empty is not None else torch.empty(i.shape, dtype=i.dtype, device=device)
        fill(i.blocks, t)
        tensors.append(t)
    return tensors
