"""Plan: for one rank, which checkpoint elements go where — pure values, nothing read or written.

:mod:`.slots` (model tensors as load targets: ``TargetSlot``, boxes) ← :mod:`.traces` (traced conversions,
cached by signature: ``TracedConversion | Untraced``, one value for load, save and transfer) and :mod:`.dtypes`
(cast and FP8 checks) ← :mod:`.rank` (``plan_rank`` → ``RankPlan``).
"""

from .rank import (
    BlockRead,
    DeferredRead,
    RankPlan,
    ValueRead,
    deferred_inputs,
    describe,
    plan_rank,
    split_box,
    unique_read_bytes,
)
from .slots import Box, TargetSlot, box_view, full_box, iter_model_tensors, model_slots, plain_slot
from .traces import StandInCheckpoint, TraceCache, TracedConversion, Untraced

__all__ = [
    "BlockRead",
    "Box",
    "DeferredRead",
    "RankPlan",
    "StandInCheckpoint",
    "TargetSlot",
    "TraceCache",
    "TracedConversion",
    "Untraced",
    "ValueRead",
    "box_view",
    "deferred_inputs",
    "describe",
    "full_box",
    "iter_model_tensors",
    "model_slots",
    "plain_slot",
    "plan_rank",
    "split_box",
    "unique_read_bytes",
]
