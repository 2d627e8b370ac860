"""Executing RemapBlocks: strided copies from real source tensors into an output box."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from .constants import constant_tensors
from .remap_block import RemapBlock
from .value_program import ValueProgram, evaluate_into, fill_inputs

if TYPE_CHECKING:
    from .tensor import RegionTensor


def source_view(block: RemapBlock, source: torch.Tensor) -> torch.Tensor:
    """The strided view of ``source`` (C-contiguous, the block's source shape) that ``block`` reads."""
    if tuple(source.shape) != block.source_shape:
        raise ValueError(
            f"source {block.source!r} has shape {tuple(source.shape)}, the block expects {block.source_shape}"
        )
    src = source.contiguous()
    layout = block.read_layout()
    return layout.span_view(src, src.storage_offset() + layout.base)


def dest_view(block: RemapBlock, out: torch.Tensor) -> torch.Tensor:
    """The strided view of the box-shaped ``out`` that ``block`` writes."""
    strides = [step * out.stride(d) for d, step in zip(block.dst_dims, block.dst_steps)]
    offset = out.storage_offset() + sum(o * s for o, s in zip(block.dst_offset, out.stride()))
    return torch.as_strided(out, block.shape, strides, offset)


def apply_casts(view: torch.Tensor, casts: Iterable[torch.dtype]) -> torch.Tensor:
    for dtype in casts:
        view = view.to(dtype)
    return view


def copy_cast(dest: torch.Tensor, src: torch.Tensor, casts: Sequence[torch.dtype]) -> torch.Tensor:
    """``dest.copy_(src)`` with ``src``'s values cast through ``casts`` first; a last cast into ``dest``'s dtype is
    left to ``copy_`` (the same conversion, without a temporary tensor).

    Returns:
        ``dest``.
    """
    if casts and casts[-1] == dest.dtype:
        casts = casts[:-1]
    return dest.copy_(apply_casts(src, casts))


def execute_blocks(
    blocks: Iterable[RemapBlock], sources: Mapping[str, torch.Tensor], out: torch.Tensor
) -> torch.Tensor:
    """Fill ``out`` (the compiled box's shape, box-local) from real source tensors.

    Args:
        blocks: blocks compiled for one box.
        sources: real tensors by source name, in the shapes the blocks expect.
        out: destination tensor of the box's shape (any strides).

    Returns:
        ``out``.

    Raises:
        KeyError: a source is missing. ValueError: a source has the wrong shape.
    """
    for block in blocks:
        if block.source not in sources:
            raise KeyError(f"no tensor given for source {block.source!r}")
        copy_cast(dest_view(block, out), source_view(block, sources[block.source]), block.casts)
    return out


def materialize(tensor: RegionTensor, sources: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Build the real tensor a RegionTensor stands for, from real sources.

    Args:
        tensor: a RegionTensor.
        sources: real tensors by source name (constant sources, ``<constant V: dtype>``, need not be given: their
            names hold their values).

    Returns:
        A new contiguous tensor, on the device of the first of ``sources`` (the CPU when there are none), equal
        to running the traced code on ``sources``.
    """
    device = next((s.device for s in sources.values()), torch.device("cpu"))
    out = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=device)
    if tensor.is_index_map:
        blocks = tensor.remap_blocks()
        return execute_blocks(blocks, _with_constants(sources, blocks, device), out)
    program = tensor.value_program()
    return execute_program(program, _with_constants(sources, program.blocks, device), out)


def _with_constants(sources: Mapping[str, torch.Tensor], blocks: Sequence[RemapBlock], device: torch.device) -> dict:
    """``sources`` plus the constants ``blocks`` read (a constant source names its value), on ``device``."""
    found = constant_tensors(b.source for b in blocks if b.source not in sources)
    return {**{n: t.to(device) for n, t in found.items()}, **sources}


def execute_program(program: ValueProgram, sources: Mapping[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (the program's box shape) with values computed by pointwise ops, from real source tensors.

    Args:
        program: an Apply compiled for one box (:meth:`RegionTensor.value_program`).
        sources: real tensors by source name.
        out: destination tensor of the box's shape (any strides); the values are cast to its dtype.

    Returns:
        ``out``.

    Raises:
        KeyError: a source is missing. ValueError: a source has the wrong shape.
    """
    inputs = fill_inputs(program, lambda blocks, t: execute_blocks(blocks, sources, t), out.device)
    return evaluate_into(program, inputs, out)
