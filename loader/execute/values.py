"""Value reads: boxes of model tensors computed by pointwise ops over checkpoint regions (FP8 dequantization).

Each :class:`~loader.plan.ValueRead` reads its program's inputs — box-shaped tensors on the target's device,
filled by the same region reads as model tensors (:class:`~.reads.BlockExecutor`) — then replays the traced
pointwise ops on them and copies the result into the model tensor's box. A value read holds at most the plan's
``value_bytes`` of inputs at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

import torch

from regiontrace.executor import ValueInput, evaluate_into, fill_inputs

from ..checkpoint import Checkpoint
from ..plan import BlockRead, TargetSlot, ValueRead, full_box
from ..plan.slots import box_view
from ..storage import RangeReader
from .fills import is_fill, run_fills
from .reads import STAGING_BYTES, BlockExecutor
from .staging import StagingRing


def run_values(
    values: Iterable[ValueRead],
    checkpoint: Checkpoint,
    slots: Mapping[str, TargetSlot],
    reader: RangeReader,
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
    buffers: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # inputs reused across value reads

    def empty(index: int, value_input: ValueInput, device: torch.device) -> torch.Tensor:
        numel = math.prod(value_input.shape)
        key = (index, value_input.dtype, device)
        buf = buffers.get(key)
        if buf is None or buf.numel() < numel:
            buf = buffers[key] = torch.empty(numel, dtype=value_input.dtype, device=device)
        return buf[:numel].view(value_input.shape)

    def fill_all(pending: list[tuple[tuple, torch.Tensor]]) -> None:
        """Fill every input of one program in one run of reads: an operand the program uses several times (the
        fields of packed codes) is one byte range, read once."""
        slots, reads = {}, []
        for n, (blocks, tensor) in enumerate(pending):
            name = f"#input{n}"
            slots[name] = TargetSlot(name, tuple(tensor.shape), tensor.dtype, tensor, ())
            reads += [BlockRead(name, full_box(tuple(tensor.shape)), b) for b in blocks]
        run_fills((r for r in reads if is_fill(r)), slots)  # constant inputs (a shift amount): no byte
        # copies to a device stay queued: the program's ops run after them on the same stream
        BlockExecutor(checkpoint, slots, reader, progress=progress, staging=staging).run(
            (r for r in reads if not is_fill(r)), finish=False
        )

    try:
        for v in values:
            dest = box_view(slots[v.target].local, v.local_box)
            pending: list[tuple[tuple, torch.Tensor]] = []
            inputs = fill_inputs(
                v.program,
                lambda b, t, p=pending: p.append((b, t)),
                dest.device,
                lambda i, vi, d=dest.device: empty(i, vi, d),
            )
            fill_all(pending)
            with torch.no_grad():
                evaluate_into(v.program, inputs, dest)
    finally:
        staging.finish()  # every copy has landed before this returns (or raises: rollback restores after it)
