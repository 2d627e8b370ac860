"""Model tensors as load targets: which boxes of each global tensor this rank owns, and where they go.

A :class:`TargetSlot` is one model tensor as one rank sees it: its global shape and dtype, the local tensor
written in place, and the pairs ``(global box, local box)`` that rank owns. A plain tensor is owned whole
(replicated); a DTensor owns the boxes of its local tensor (one box for ``Shard``/``Replicate``, several for
``_StridedShard``). A rank's **slot** of a model tensor is what it holds of it: not a "part", not a "shard" (a shard
is a file of a sharded checkpoint folder).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from regiontrace import Box

from .._torch import local_tensor


@dataclass(frozen=True, slots=True)  # 200 000 slots: ~40 B less each than with a __dict__
class TargetSlot:
    """One model tensor on this rank.

    Attributes:
        name: canonical model tensor name.
        shape: global shape.
        dtype: the model tensor's dtype (values are cast to it on copy).
        local: the tensor written in place (a DTensor's local tensor); None when planning without tensors.
        boxes: ``(global box, local box)`` pairs this rank owns; empty when it owns nothing.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    local: torch.Tensor | None
    boxes: tuple[tuple[Box, Box], ...]

    @property
    def local_numel(self) -> int:
        return sum(math.prod(b - a for a, b in g) for g, _ in self.boxes)


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


@functools.lru_cache(maxsize=1 << 12)
def whole_boxes(shape: tuple[int, ...]) -> tuple[tuple[Box, Box], ...]:
    """The ``boxes`` of a slot holding a tensor of ``shape`` whole (one tuple per shape, shared by its slots)."""
    box = full_box(shape)
    return ((box, box),)


def box_view(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``t`` for ``box`` (half-open per dim)."""
    for d, (a, b) in enumerate(box):
        if a != 0 or b != t.shape[d]:
            t = t.narrow(d, a, b - a)
    return t


def storage_of(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor whose memory a parameter/buffer (or DTensor) keeps its values in."""
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    local = local_tensor(data)
    return local if local is not None else data


def iter_model_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer by name (tied tensors appear under each name)."""
    yield from model.state_dict(keep_vars=True).items()


def plain_slot(name: str, tensor: torch.Tensor) -> TargetSlot:
    """A slot for a tensor this rank holds whole."""
    shape = tuple(tensor.shape)
    return TargetSlot(name, shape, tensor.dtype, storage_of(tensor), whole_boxes(shape))


def model_slots(
    model: torch.nn.Module, slot_for: Callable[[str, torch.Tensor], TargetSlot] | None = None
) -> dict[str, TargetSlot]:
    """Slots for every model tensor; ``slot_for(name, tensor)`` builds them (default: whole tensors)."""
    slot_for = slot_for or plain_slot
    return {name: slot_for(name, t) for name, t in iter_model_tensors(model)}
