"""Execute: read exactly the byte ranges a plan's blocks need and copy them into model tensors.

:mod:`.layout` (runs of a block) ← :mod:`.reads` (``BlockExecutor``) and :mod:`.deferred` (run-for-real
conversions) ← :mod:`.run` (``execute_plan``: both, with progress and rollback).
"""

from .deferred import apply_deferred, run_deferred
from .layout import ReadLayout, page_spans, read_layout, split_block, split_span
from .reads import SPARSE_FRACTION, STAGING_BYTES, STRIDED_RUNS, BlockExecutor
from .run import execute_plan, restore, snapshot

__all__ = [
    "SPARSE_FRACTION",
    "STAGING_BYTES",
    "STRIDED_RUNS",
    "BlockExecutor",
    "ReadLayout",
    "apply_deferred",
    "execute_plan",
    "page_spans",
    "read_layout",
    "restore",
    "run_deferred",
    "snapshot",
    "split_block",
    "split_span",
]
