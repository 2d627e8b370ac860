"""Value reads: boxes of model tensors computed by pointwise ops over checkpoint regions (FP8 dequantization).

Each :class:`~loader.plan.ValueRead` reads its program's inputs — box-shaped tensors on the target's device,
filled by the same region reads as model tensors (:class:`~.reads.BlockExecutor`) — then replays the traced
pointwise ops on them and copies the result into the model tensor's box. A value read holds at most the plan's
``value_bytes`` of inputs at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch

from regiontrace.values import fill_inputs

from ..checkpoint import FileReader, SafetensorsCheckpoint
from ..plan import BlockRead, TargetSlot, ValueRead, full_box
from ..plan.slots import box_view
from .reads import STAGING_BYTES, BlockExecutor
from .staging import StagingRing


def run_values(
    values: Iterable[ValueRead],
    checkpoint: SafetensorsCheckpoint,
    slots: Mapping[str, TargetSlot],
    reader: FileReader,
    *,
    progress: Callable[[int], None] | None = None,
    staging: StagingRing | None = None,
) -> None:
    """Execute value reads: fill each program's inputs from the files, compute, copy into the model tensor.

    Args:
        values: the value reads.
        checkpoint, slots, reader: as for :class:`~.reads.BlockExecutor`.
        progress: called with the bytes of each read.
        staging: the staging ring the inputs are read through (default: one for these reads).

    Raises:
        CheckpointError: a file is short, or changed since its header was read.
    """
    staging = staging if staging is not None else StagingRing(STAGING_BYTES)
    for v in values:
        dest = box_view(slots[v.target].local, v.local_box)

        def fill(blocks: tuple, tensor: torch.Tensor) -> None:
            slot = TargetSlot("#input", tuple(tensor.shape), tensor.dtype, tensor, ())
            box = full_box(tuple(tensor.shape))
            BlockExecutor(checkpoint, {"#input": slot}, reader, progress=progress, staging=staging).run(
                BlockRead("#input", box, b) for b in blocks
            )

        inputs = fill_inputs(v.program, fill, dest.device)
        with torch.no_grad():
            dest.copy_(v.program.evaluate(inputs))
