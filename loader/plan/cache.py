"""Plans reused: a second load of the same model and checkpoint takes the first load's plan and plans nothing.

A :class:`~.rank.RankPlan` follows from the checkpoint's headers, the model's slots (which boxes of which tensors
this rank owns, of what dtype, on what device), which model names are one tensor, the rules and the planning
settings. :class:`PlanCache` keeps each model's last plans under a key of exactly those (:func:`plan_key`):

- the checkpoint by its files and their identities (a rewritten file misses), and on a hit its tensor table, read
  again with the headers by this load, compared whole;
- the model weakly (a collected model drops its plans), and its slots *without their tensors* (a
  :class:`SlotTable`: each slot's name, shape, dtype and owned boxes, by columns); a plan is kept with that table
  as its slots and is bound, on a hit, to the slots and checkpoint this load just built
  (:meth:`~.rank.RankPlan.rebound`), so the cache holds no model memory and no stale tensor;
- the rules by the identity of their objects (kept alive with the plan, so no other object can take their id),
  ``strict`` and ``values``; an FP8 checkpoint's quantization scheme (its ``config.json``, the model's config).

Not cached (:func:`plan_key` is None): planning with overridden planning hooks (``target_slot`` aside: slots are
keyed), with slots that hold no tensor or a meta tensor, or against headers of unknown identity.

A first load pays for the key a few passes over the slots in C (``map`` of an attribute getter: no object per
slot), so keeping the plan costs a 200 000-tensor load a few ms and a few MB, where a tuple and a bare copy per slot
cost it about 1 s and 100 MB; the table's hash is its length and end names, its equality the columns compared whole.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import NamedTuple

import torch

from ..checkpoint import Checkpoint
from ..checkpoint.config import quantization_config
from ..options import Rules
from ..rules.fp8 import FLOAT8
from .rank import RankPlan
from .slots import TargetSlot, iter_model_tensors

__all__ = ["PLANS", "PlanCache", "PlanKey", "SlotTable", "model_state", "plan_key"]

#: plans kept per model (a few checkpoints or settings alternating)
PER_MODEL = 2


#: what of a slot a plan follows from (its tensor aside), one column each
COLUMNS = ("name", "shape", "dtype", "boxes")

#: a slot's tensor is on the meta device (AttributeError when it holds none)
_LOCAL_IS_META = attrgetter("local.is_meta")
_DTYPE = attrgetter("dtype")


class SlotTable(Mapping[str, TargetSlot]):
    """A model's slots without their tensors, by name (each a :class:`~.slots.TargetSlot` with ``local=None``):
    kept as one tuple per field of :data:`COLUMNS`, the slots themselves built only when asked for.

    Hashable and compared whole (names, then each column), as part of a :class:`PlanKey`; a kept plan's slots.
    """

    def __init__(self, slots: Mapping[str, TargetSlot]) -> None:
        kept = slots.values()
        self.names: tuple[str, ...] = tuple(slots)
        self.columns: tuple[tuple, ...] = tuple(tuple(map(attrgetter(field), kept)) for field in COLUMNS)
        self._hash = hash((len(self.names), self.names[:1], self.names[-1:]))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SlotTable):
            return NotImplemented
        return self._hash == other._hash and self.names == other.names and self.columns == other.columns

    @functools.cached_property
    def _slots(self) -> dict[str, TargetSlot]:
        return {n: TargetSlot(name, shape, dtype, None, boxes) for n, (name, shape, dtype, boxes) in self._rows()}

    def _rows(self) -> Iterator[tuple[str, tuple]]:
        return zip(self.names, zip(*self.columns))

    def __getitem__(self, name: str) -> TargetSlot:
        return self._slots[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class PlanKey(NamedTuple):
    """What a plan follows from (:func:`plan_key`)."""

    files: tuple
    identities: tuple
    slots: SlotTable
    ties: tuple[int, ...]
    rules: tuple
    settings: tuple[Hashable, ...]
    fp8: str | None


def model_state(
    model: torch.nn.Module, slot_for: Callable[[str, torch.Tensor], TargetSlot]
) -> tuple[dict[str, TargetSlot], tuple[int, ...]]:
    """The model's slots (as :func:`~.slots.model_slots`) and its ties: per tensor name, the index of the first
    name of the same tensor object (tied weights are planned as one); ``()`` when no two names share a tensor."""
    tensors = dict(iter_model_tensors(model))
    slots = {name: slot_for(name, tensor) for name, tensor in tensors.items()}
    ids = list(map(id, tensors.values()))
    if len(set(ids)) == len(ids):
        return slots, ()
    first: dict[int, int] = {}
    return slots, tuple(first.setdefault(i, n) for n, i in enumerate(ids))


def plan_key(
    checkpoint: Checkpoint,
    slots: Mapping[str, TargetSlot],
    ties: tuple[int, ...],
    rules: Rules,
    settings: tuple[Hashable, ...],
    model: torch.nn.Module,
) -> PlanKey | None:
    """What a plan of ``model`` follows from, as a hashable key; None when it cannot be told (see the module)."""
    identities = checkpoint.identities
    if not checkpoint.files or any(f not in identities for f in checkpoint.files):
        return None
    try:
        if any(map(_LOCAL_IS_META, slots.values())):
            return None
    except AttributeError:  # a slot without a tensor
        return None
    files = (type(checkpoint.store).__name__, checkpoint.root, checkpoint.files)
    ids = tuple(identities[f] for f in checkpoint.files)
    return PlanKey(files, ids, SlotTable(slots), ties, _rules_key(rules), settings, _fp8_key(checkpoint, model))


def _rules_key(rules: Rules) -> tuple:
    mapping = None if rules.weights_mapping is None else tuple(map(id, rules.weights_mapping))
    renames = None if rules.key_mapping is None else tuple(rules.key_mapping.items())
    return mapping, tuple(map(id, rules.extra_weights_mapping)), renames


def _fp8_key(checkpoint: Checkpoint, model: torch.nn.Module) -> str | None:
    """The quantization schemes an FP8 checkpoint is dequantized by (None for any other checkpoint)."""
    if FLOAT8.isdisjoint(map(_DTYPE, checkpoint.tensors.values())):
        return None
    config = getattr(getattr(model, "config", None), "quantization_config", None)
    config = config.to_dict() if hasattr(config, "to_dict") else config
    return json.dumps([quantization_config(checkpoint.store), config], sort_keys=True, default=repr)


@dataclass(frozen=True, eq=False)
class _Entry:
    plan: RankPlan  # its slots: the key's SlotTable
    rules: Rules  # the rule objects whose ids the key holds, kept alive


class PlanCache:
    """The last plans of each model by :func:`plan_key`, the model held weakly.

    Attributes:
        hits, misses: plans served from the cache, and plans made and kept.
    """

    def __init__(self, per_model: int = PER_MODEL) -> None:
        self.per_model = per_model
        self._plans: weakref.WeakKeyDictionary[torch.nn.Module, OrderedDict[tuple, _Entry]] = (
            weakref.WeakKeyDictionary()
        )
        self.hits = self.misses = 0

    def get(
        self, model: torch.nn.Module, key: PlanKey, checkpoint: Checkpoint, slots: Mapping[str, TargetSlot]
    ) -> RankPlan | None:
        """The plan kept under ``key``, bound to ``slots`` and ``checkpoint``; None when there is none, or when the
        checkpoint's tensor table differs from the one it was planned against."""
        entries = self._plans.get(model)
        entry = entries.get(key) if entries is not None else None
        if entry is None:
            return None
        kept = entry.plan.checkpoint
        if kept.tensors != checkpoint.tensors or kept.metadata != checkpoint.metadata:
            del entries[key]
            return None
        entries.move_to_end(key)
        self.hits += 1
        return entry.plan.rebound(slots, checkpoint)

    def put(self, model: torch.nn.Module, key: PlanKey, plan: RankPlan, rules: Rules) -> None:
        """Keep ``plan`` (its slots: ``key.slots``, without tensors) under ``key``; the model's oldest past
        ``per_model`` go."""
        plan.planned_bytes()  # counted once, kept by every binding (each load reports it)
        entries = self._plans.setdefault(model, OrderedDict())
        entries[key] = _Entry(plan.rebound(key.slots, plan.checkpoint), rules)
        while len(entries) > self.per_model:
            entries.popitem(last=False)
        self.misses += 1

    def planned(
        self,
        model: torch.nn.Module,
        slot_for: Callable[[str, torch.Tensor], TargetSlot],
        checkpoint: Checkpoint,
        rules: Rules,
        settings: tuple[Hashable, ...],
        make: Callable[[dict[str, TargetSlot]], RankPlan],
    ) -> RankPlan:
        """The plan of ``model``'s own slots (``slot_for`` each tensor): the one kept for what it follows from
        (:func:`plan_key`), else ``make(slots)``, kept."""
        slots, ties = model_state(model, slot_for)
        key = plan_key(checkpoint, slots, ties, rules, settings, model)
        kept = self.get(model, key, checkpoint, slots) if key is not None else None
        if kept is not None:
            return kept
        plan = make(slots)
        if key is not None:
            self.put(model, key, plan, rules)
        return plan

    def kept(self, model: torch.nn.Module) -> list[RankPlan]:
        """The plans kept for ``model``, least recently used first (their slots without tensors)."""
        entries = self._plans.get(model)
        return [] if entries is None else [e.plan for e in entries.values()]

    def __len__(self) -> int:
        """Plans kept, over every live model."""
        return sum(len(e) for e in self._plans.values())

    def clear(self) -> None:
        """Drop every plan."""
        self._plans.clear()


#: the process's plan cache (:class:`~loader.HFLoadPlanner` plans through it)
PLANS = PlanCache()
