"""A traced engine loader as the planner's value: a :class:`~loader.plan.RankPlan` whose targets are the module's
parameters, whole and local.

Vocabulary (as in :mod:`loader.engine.trace`, plus):

- **target**: a parameter by its first name, owned whole (:func:`~loader.plan.slots.plain_slot`): the module
  already holds this rank's slot, so its global box is its local one.
- **region read**: a :class:`~loader.plan.BlockRead` of a block compiled from a parameter's final content
  (``remap_blocks`` of its whole box) that reads a checkpoint key; blocks name the keys themselves (the leaves
  were named so), and the executor casts to the parameter's dtype as the module's ``copy_`` does.
- **constant fill**: a block whose source is a constant (zeroed padding, a ``fill_``): one of the plan's
  ``fills``, which the executor fills with the constant, no byte read.

The plan is planned with ``broadcast_replicated_tensors`` off: two ranks' parameters of one name hold different
slots of the model (a ``qkv_proj`` shard each), which a broadcast by name would confuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from regiontrace.executor import is_constant

from ..checkpoint import Checkpoint
from ..plan import BlockRead, RankPlan
from ..plan.slots import TargetSlot, plain_slot
from ..rules import Conversion, KeyPlan
from .trace import EngineTrace

__all__ = ["EnginePlan", "engine_plan"]


@dataclass(frozen=True)
class EnginePlan:
    """The plan of one rank's load through a module's loader: its region reads and constant fills (a RankPlan),
    and the keys loaded for real (fallbacks)."""

    plan: RankPlan
    fallback_keys: tuple[str, ...]


def engine_plan(trace: EngineTrace, checkpoint: Checkpoint, missing: tuple[str, ...], description: str) -> EnginePlan:
    """The plan reading, for every parameter some key wrote, exactly the elements its content reads.

    Args:
        trace: the traced loader (checked: :mod:`loader.engine.check`).
        checkpoint: the checkpoint it was traced on.
        missing: parameters no key wrote (left as they are).
        description: names the loader in the plan's conversions (``"Model.load_weights"``).
    """
    slots: dict[str, TargetSlot] = {}
    reads: list[BlockRead] = []
    fills: list[BlockRead] = []
    conversions: list[Conversion] = []
    for name in trace.params:
        if name in missing or not trace.writes_of(name):
            continue
        real = trace.real[name]
        slots[name] = plain_slot(name, real)
        box = slots[name].boxes[0][1]
        for block in trace.blocks(name):
            if block.source in checkpoint:
                reads.append(BlockRead(name, box, block))
            elif is_constant(block.source):
                fills.append(BlockRead(name, box, block))
            # else: ``<prior NAME>``, elements no traced key wrote (a fallback key's, checked by the caller)
        conversions.append(Conversion((name,), trace.keys_of(name), description))
    for name in missing:
        slots.setdefault(name, plain_slot(name, trace.real[name]))
    loaded = tuple(n for n in slots if n not in missing)
    fallbacks = tuple(f.key for f in trace.fallbacks)
    keyplan = KeyPlan(conversions, list(trace.unused), list(missing), {})
    plan = RankPlan(
        checkpoint=checkpoint,
        slots=slots,
        keyplan=keyplan,
        conversions=tuple(conversions),
        outcomes=(),
        reads=tuple(reads),
        values=(),
        deferred=(),
        loaded_keys=loaded,
        missing_keys=tuple(missing),
        unexpected_keys=tuple(trace.unused),
        traced=loaded,
        deferred_targets=(),
        casts=(),
        fills=tuple(fills),
    )
    return EnginePlan(plan, fallbacks)
