"""Running blocks backwards: write an output box's values into the source elements its blocks read — the mirror
of :mod:`regiontrace.execute` — as tensor copies (:func:`scatter_blocks`) or as packed runs for a file writer
(:func:`packed_source_runs`). :func:`~regiontrace.invert` decides when this is a bijection.
"""

from __future__ import annotations

from collections.abc import Iterable, MutableMapping
from typing import NamedTuple

import torch

from .execute import dest_view
from .remap_block import RemapBlock


class PackedRuns(NamedTuple):
    """One block's source elements as equal-length contiguous runs, ready for positional writes.

    Attributes:
        starts: int64 tensor of flat source element offsets, ascending, one per run.
        run_length: elements per run.
        values: 1-D tensor of ``len(starts) * run_length`` values in the source dtype, run after run.
    """

    starts: torch.Tensor
    run_length: int
    values: torch.Tensor


def scatter_blocks(
    blocks: Iterable[RemapBlock], values: torch.Tensor, sources: MutableMapping[str, torch.Tensor]
) -> MutableMapping[str, torch.Tensor]:
    """Run blocks backwards: write the box-shaped ``values`` into the source elements each block reads.

    The mirror of :func:`regiontrace.executor.execute_blocks`. Values are cast to each source's dtype on write.

    Args:
        blocks: blocks compiled for one box of one output.
        values: the box's values (box-shaped, any strides).
        sources: real source tensors by name (C-contiguous, the blocks' source shapes), written in place.

    Returns:
        ``sources``.

    Raises:
        KeyError: a source is missing. ValueError: a source has the wrong shape or is not contiguous, or a
            block broadcasts (it would write one source element from several values).
    """
    for block in blocks:
        if block.source not in sources:
            raise KeyError(f"no tensor given for source {block.source!r}")
        src = sources[block.source]
        if tuple(src.shape) != block.source_shape or not src.is_contiguous():
            raise ValueError(
                f"source {block.source!r} must be a C-contiguous tensor of shape {block.source_shape}, "
                f"got shape {tuple(src.shape)}{'' if src.is_contiguous() else ' (not contiguous)'}"
            )
        lo, strides, flips = _positive(block)
        view = torch.as_strided(src, block.shape, strides, src.storage_offset() + lo)
        vals = dest_view(block, values)
        view.copy_(vals.flip(flips) if flips else vals)
    return sources


def packed_source_runs(block: RemapBlock, values: torch.Tensor) -> PackedRuns:
    """The source elements ``block`` writes when run backwards, as equal runs and packed values in source order.

    A file writer ``pwrite`` s ``values[i * run_length:(i + 1) * run_length]`` at source element ``starts[i]``
    (times the item size, plus the tensor's data offset).

    Args:
        block: a block compiled for the box ``values`` holds.
        values: the box's values (box-shaped, any strides).

    Returns:
        :class:`PackedRuns`, values cast to the block's source dtype.

    Raises:
        ValueError: the block broadcasts (one source element, several values).
    """
    lo, strides, flips = _positive(block)
    if block.numel == 0:
        return PackedRuns(torch.empty(0, dtype=torch.int64), 0, torch.empty(0, dtype=block.source_dtype))
    vals = dest_view(block, values)
    vals = vals.flip(flips) if flips else vals
    sized = sorted((j for j, n in enumerate(block.shape) if n > 1), key=lambda j: -strides[j])
    run, inner = 1, 0
    for j in reversed(sized):  # ascending stride: peel the dims that continue one contiguous run
        if strides[j] != run:
            break
        run, inner = run * block.shape[j], inner + 1
    outer = sized[: len(sized) - inner]
    starts = torch.tensor([lo], dtype=torch.int64)
    for j in outer:  # major first, as the permuted values below
        steps = torch.arange(block.shape[j], dtype=torch.int64) * strides[j]
        starts = (starts[:, None] + steps).reshape(-1)
    vals = vals.permute([j for j, n in enumerate(block.shape) if n == 1] + sized)
    packed = torch.empty(vals.shape, dtype=block.source_dtype, device=vals.device).copy_(vals).reshape(-1, run)
    if bool((starts[1:] < starts[:-1]).any()):
        starts, order = torch.sort(starts)
        packed = packed[order.to(packed.device)]
    return PackedRuns(starts, run, packed.reshape(-1))


def _positive(block: RemapBlock) -> tuple[int, list[int], list[int]]:
    """``(lowest source offset, |strides|, flipped block dims)``: the block's read as a plain strided view."""
    if any(s == 0 and n > 1 for n, s in zip(block.shape, block.src_strides)):
        raise ValueError(f"block of source {block.source!r} broadcasts: several values would write one element")
    flips = [j for j, s in enumerate(block.src_strides) if s < 0]
    lo = block.src_offset + sum((block.shape[j] - 1) * block.src_strides[j] for j in flips)
    return lo, [abs(s) for s in block.src_strides], flips
