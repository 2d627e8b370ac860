"""Executing a rank's plan: region reads then deferred conversions, with a progress bar and rollback."""

from __future__ import annotations

import sys
from typing import Any

import torch

from ..checkpoint import FileReader
from .deferred import run_deferred
from .reads import BlockExecutor


def _progress_bar(enabled: bool | None, total: int):  # noqa: ANN202
    if enabled is False or (enabled is None and not sys.stderr.isatty()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="loading", leave=False)


def execute_plan(
    planner: Any,
    reader: FileReader,
    *,
    progress: bool | None = None,
    rollback: bool = False,
    reads=None,
    deferred=None,
) -> None:  # noqa: ANN001
    """Run the planner's plan (or the given subsets of it) against the checkpoint files."""
    plan, checkpoint, slots = planner.plan, planner.checkpoint, planner.slots
    reads = plan.reads if reads is None else reads
    deferred = plan.deferred if deferred is None else deferred
    saved = _snapshot(plan, slots) if rollback else None
    bar = _progress_bar(progress, plan.planned_bytes(checkpoint))
    try:
        BlockExecutor(checkpoint, slots, reader, progress=bar.update if bar else None).run(reads)
        for d in deferred:
            if d.boxes:
                run_deferred(d, checkpoint, slots, reader)
                if bar:
                    bar.update(sum(checkpoint[k].nbytes for k in d.conversion.sources))
    except BaseException:
        if saved is not None:
            restore(saved, slots)
        raise
    finally:
        if bar:
            bar.close()


def restore(saved: dict[str, torch.Tensor], slots) -> None:  # noqa: ANN001
    """Put back the values :func:`_snapshot` took (rollback)."""
    with torch.no_grad():
        for name, value in saved.items():
            slots[name].local.copy_(value)


def _snapshot(plan, slots) -> dict[str, torch.Tensor]:  # noqa: ANN001
    names = set(plan.traced) | set(plan.deferred_targets)
    return {n: slots[n].local.detach().clone() for n in names if slots[n].local is not None}
