"""A traced engine loader as the planner's value: a :class:`~loader.plan.RankPlan` whose targets are the module's
parameters, whole and local, and the constant boxes the executor does not read.

Vocabulary (as in :mod:`loader.engine.trace`, plus):

- **target**: a parameter by its first name, owned whole (:func:`~loader.plan.slots.plain_slot`): the module
  already holds this rank's slot, so its global box is its local one.
- **region read**: a :class:`~loader.plan.BlockRead` of a block compiled from a parameter's final content
  (``remap_blocks`` of its whole box) that reads a checkpoint key; blocks name the keys themselves (the leaves
  were named so), and the executor casts to the parameter's dtype as the module's ``copy_`` does.
- **constant box**: a block whose source is a constant (zeroed padding, a ``fill_``): the executor reads no
  constants yet, so :func:`fill_constants` writes them after the region reads.

The plan is planned with ``broadcast_replicated_tensors`` off: two ranks' parameters of one name hold different
slots of the model (a ``qkv_proj`` shard each), which a broadcast by name would confuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

import regiontrace as rt
from regiontrace.executor import copy_cast, dest_view

from ..checkpoint import Checkpoint
from ..plan import BlockRead, RankPlan
from ..plan.slots import TargetSlot, plain_slot
from ..rules import Conversion, KeyPlan
from .trace import EngineTrace

__all__ = ["ConstantFill", "EnginePlan", "engine_plan", "fill_constants"]

_CONSTANT = ("<constant ", ">")  # regiontrace's constant sources: ``<constant VALUE: DTYPE>``


@dataclass(frozen=True)
class ConstantFill:
    """Write ``value`` (stored as ``dtype``) into ``box`` of parameter ``target`` (a block of a constant source)."""

    target: str
    block: rt.RemapBlock
    value: torch.Tensor


@dataclass(frozen=True)
class EnginePlan:
    """The plan of one rank's load through a module's loader: its region reads (a RankPlan), its constant fills,
    and the keys loaded for real (fallbacks)."""

    plan: RankPlan
    constants: tuple[ConstantFill, ...]
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
    constants: list[ConstantFill] = []
    conversions: list[Conversion] = []
    for name, dest in trace.params.items():
        if name in missing or not dest.writes:
            continue
        real = trace.real[name]
        slots[name] = plain_slot(name, real)
        box = slots[name].boxes[0][1]
        for block in dest.remap_blocks():
            if block.source in checkpoint:
                reads.append(BlockRead(name, box, block))
            elif _is_constant(block.source):
                constants.append(ConstantFill(name, block, constant_value(block.source)))
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
    )
    return EnginePlan(plan, tuple(constants), fallbacks)


def _is_constant(source: str) -> bool:
    return source.startswith(_CONSTANT[0]) and source.endswith(_CONSTANT[1])


def constant_value(name: str) -> torch.Tensor:
    """The 0-dim tensor a constant source's name ``<constant VALUE: DTYPE>`` stands for.

    Raises:
        ValueError: a name in another form (regiontrace changed how it names constants).
    """
    text, _, dtype_name = name[len(_CONSTANT[0]) : -len(_CONSTANT[1])].rpartition(": ")
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype) or not text:
        raise ValueError(f"constant source {name!r} is not of the form '<constant VALUE: DTYPE>'")
    if text in ("True", "False"):
        return torch.tensor(text == "True", dtype=dtype)
    if dtype.is_complex:
        return torch.tensor(complex(text.strip("()")), dtype=dtype)
    return torch.tensor(float(text) if dtype.is_floating_point else int(text), dtype=dtype)


def fill_constants(constants: tuple[ConstantFill, ...], slots: Mapping[str, TargetSlot]) -> None:
    """Write each constant block into its parameter (its value broadcast over the block, cast as the block casts)."""
    for c in constants:
        copy_cast(dest_view(c.block, slots[c.target].local), c.value.expand(c.block.shape), c.block.casts)
