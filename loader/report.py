"""``LoadReport``: what a load did on one rank, made from the rank's plan and the bytes it read."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from .plan import RankPlan
from .rules import dot_natural_key


@dataclass(frozen=True)
class LoadReport:
    """What a load did on this rank.

    Attributes:
        loaded_keys: model tensor names loaded (tied aliases included), natural-sorted.
        missing_keys: model tensors nothing loaded (only with ``strict=False``).
        unexpected_keys: checkpoint keys no rule maps to a model tensor.
        bytes_read: bytes this process read from checkpoint files.
        traced: model tensors loaded by region reads.
        deferred: model tensors loaded through deferred (run-for-real) conversions.
        blocks: RemapBlocks executed (region reads and value reads' inputs).
        planned_bytes: bytes the plan needed.
        deferred_reasons: why each deferred conversion could not be traced.
        rank, world_size: this process's rank and the world size.
        cast_keys: ``(model tensor name, checkpoint dtype, model dtype)`` for each model tensor whose values were
            converted across kinds (integer <-> floating point, bool), natural-sorted; the checkpoint dtype is
            that of the values its conversion produced (the checkpoint tensor's, for a rename). Such a load
            also warns once (``UserWarning``). Casts within a kind (bf16 -> float32) are normal and not listed.
    """

    loaded_keys: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    bytes_read: int
    traced: tuple[str, ...]
    deferred: tuple[str, ...]
    blocks: int = 0
    planned_bytes: int = 0
    deferred_reasons: Mapping[str, str] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    cast_keys: tuple[tuple[str, torch.dtype, torch.dtype], ...] = ()


def load_report(plan: RankPlan, bytes_read: int, rank: int = 0, world_size: int = 1) -> LoadReport:
    """The :class:`LoadReport` of ``plan``, executed; warns once when values changed kind.

    Args:
        plan: the rank's plan.
        bytes_read: bytes this process read from checkpoint files.
        rank, world_size: this process's rank and the world size.

    Returns:
        The report.
    """
    casts = tuple(sorted(set(plan.casts), key=lambda c: dot_natural_key(c[0])))
    if casts:
        _warn_casts(casts)
    return LoadReport(
        loaded_keys=natural_sorted(plan.loaded_keys),
        missing_keys=natural_sorted(plan.missing_keys),
        unexpected_keys=natural_sorted(plan.unexpected_keys),
        bytes_read=bytes_read,
        traced=natural_sorted(plan.traced),
        deferred=natural_sorted(plan.deferred_targets),
        blocks=len(plan.block_reads()),
        planned_bytes=plan.planned_bytes(),
        deferred_reasons={", ".join(d.conversion.targets): d.reason for d in plan.deferred},
        rank=rank,
        world_size=world_size,
        cast_keys=casts,
    )


def natural_sorted(keys: Iterable[str]) -> tuple[str, ...]:
    """Distinct ``keys`` in ``dot_natural_key`` order."""
    return tuple(sorted(set(keys), key=dot_natural_key))


def _warn_casts(casts: tuple[tuple[str, torch.dtype, torch.dtype], ...]) -> None:
    shown = ", ".join(f"{name} ({_dtype(a)} -> {_dtype(b)})" for name, a, b in casts[:8])
    more = f" and {len(casts) - 8} more" if len(casts) > 8 else ""
    warnings.warn(
        f"{len(casts)} model tensor(s) loaded from values of another kind (integer, floating point, bool), "
        f"converted by value: {shown}{more} (LoadReport.cast_keys lists them)",
        UserWarning,
        stacklevel=4,
    )


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
