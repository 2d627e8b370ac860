"""Constant fills: the blocks of a traced conversion that read a constant source (``F.pad``'s padding, a
``fill_``), run without reading a byte.

A constant block reads a 0-dim constant source with stride 0 (:func:`regiontrace.executor.is_constant`); running it
fills its destination view with the constant cast through the block's casts, then into the model tensor's dtype by
``fill_``: the value a real run of the conversion (the constant in the conversion's dtype, copied into the model
tensor) leaves there, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from regiontrace.executor import constant_value, dest_view, is_constant

from ..plan import BlockRead
from ..plan.slots import TargetSlot, box_view

__all__ = ["is_fill", "run_fills"]


def is_fill(read: BlockRead) -> bool:
    """Whether ``read`` is a constant fill (its block reads a constant source, no checkpoint bytes)."""
    return is_constant(read.block.source)


def run_fills(fills: Iterable[BlockRead], slots: Mapping[str, TargetSlot]) -> None:
    """Fill each constant block's destination in its target's local tensor (on any device); no byte is read."""
    values: dict[tuple[str, tuple[torch.dtype, ...]], torch.Tensor] = {}
    with torch.no_grad():
        for r in fills:
            block = r.block
            value = values.get((block.source, block.casts))
            if value is None:
                value = constant_value(block.source)
                for dtype in block.casts:
                    value = value.to(dtype)
                values[(block.source, block.casts)] = value
            local = slots[r.target].local
            if local is not None and block.numel:
                dest_view(block, box_view(local, r.local_box)).fill_(value)
