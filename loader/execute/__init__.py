"""Execute: read exactly the byte ranges a plan's blocks need and copy them into model tensors.

:mod:`.pages` (a block's runs grouped by page) and :mod:`.staging` (``StagingRing``: reused host buffers, pinned and
double-buffered for GPU targets) ← :mod:`.reads` (``BlockExecutor``) ← :mod:`.values` (value reads: pointwise
ops over box-shaped inputs) and :mod:`.deferred` (run-for-real conversions) ← :mod:`.run` (``execute_plan``:
all three, with progress and rollback).
"""

from regiontrace import ReadLayout, read_layout, split_block, split_span

from .deferred import apply_deferred, run_deferred
from .pages import page_spans
from .reads import SPARSE_FRACTION, STAGING_BYTES, STRIDED_RUNS, BlockExecutor
from .run import execute_plan, restore, snapshot
from .staging import StagingRing
from .values import run_values

__all__ = [
    "SPARSE_FRACTION",
    "STAGING_BYTES",
    "STRIDED_RUNS",
    "BlockExecutor",
    "ReadLayout",
    "StagingRing",
    "apply_deferred",
    "execute_plan",
    "page_spans",
    "read_layout",
    "restore",
    "run_deferred",
    "run_values",
    "snapshot",
    "split_block",
    "split_span",
]
