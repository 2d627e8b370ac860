"""Deferred conversions: read the sources whole, run the conversion for real, copy the owned boxes out."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..checkpoint import Checkpoint, read_tensor
from ..plan import DeferredRead, deferred_inputs
from ..plan.slots import TargetSlot, box_view
from ..rules.conversion import rule_name
from ..storage import RangeReader


def run_deferred(
    deferred: DeferredRead, checkpoint: Checkpoint, slots: Mapping[str, TargetSlot], reader: RangeReader
) -> None:
    """Read the conversion's sources whole (a source stored as several chunks assembled from them), run it for
    real, copy the owned boxes of its outputs.

    Raises:
        CheckpointError: a source file is short, or changed since its header was read.
    """
    identities = checkpoint.identities
    for file in {c.location for k in deferred.conversion.sources for c in checkpoint[k].chunks}:
        reader.expect(file, identities.get(file))
    tensors = {k: read_tensor(checkpoint[k], reader) for k in deferred.conversion.sources}  # each verified
    apply_deferred(deferred, tensors, slots)


def apply_deferred(
    deferred: DeferredRead, tensors: Mapping[str, torch.Tensor], slots: Mapping[str, TargetSlot]
) -> None:
    """Run a deferred conversion on its real source tensors and copy the owned boxes of its outputs.

    Raises:
        ValueError: the conversion returned a tensor on the meta device (it wrote into a meta buffer).
    """
    conv = deferred.conversion
    try:
        outs = conv.run(deferred_inputs(conv, tensors, slots))
    except Exception as e:
        e.add_note(f"raised by {rule_name(conv)} for {', '.join(conv.targets[:4])} (a deferred conversion)")
        raise
    for target, g, lb in deferred.boxes:
        src = outs[target]
        if getattr(src, "is_meta", False):
            raise ValueError(
                f"{rule_name(conv)} returned {target!r} on the meta device (no data): it writes its result into a "
                "meta tensor it made (torch.empty(..., device='meta')); build it from its inputs (w.new_zeros(...), "
                "torch.zeros_like(w), F.pad, torch.cat) so that it follows their device"
            )
        for d, (a, b) in enumerate(g):
            src = src.narrow(d, a, b - a)
        box_view(slots[target].local, lb).copy_(src)
