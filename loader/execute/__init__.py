"""Execute: read exactly the byte ranges a plan's blocks need and copy them into model tensors.

:mod:`.staging` (``StagingRing``: reused host buffers, pinned and double-buffered for GPU targets), :mod:`.pool`
(I/O threads) and :mod:`.routes` (how each block is read, kept per plan) ← :mod:`.reads` (``BlockExecutor``) ←
:mod:`.values` (value reads: pointwise ops over box-shaped inputs), :mod:`.fills` (constant blocks: filled, no byte
read) and :mod:`.deferred` (run-for-real conversions)
← :mod:`.run` (``execute_plan``: all three, with progress and rollback: :mod:`.rollback`).

The read drivers run ``execute_plan`` across the ranks of a group, talking to them only through :mod:`.peers`
(``Peers``, which the distributed layer implements): :mod:`.exchanged` (exchanged reads: bytes ranks want interleaved
fetched once, round by round; a round's exchange :mod:`.exchange`; its pure plan :mod:`.exchange_plan`) and
:mod:`.host_shared` (the local files a host's ranks read most of together, read with readahead).
"""

from regiontrace.executor import ReadLayout, read_layout, split_block, split_span

from .deferred import apply_deferred, run_deferred
from .fills import run_fills
from .reads import SPARSE_FRACTION, STAGING_BYTES, BlockExecutor
from .rollback import Rollback
from .routes import STRIDED_RUNS
from .run import execute_plan
from .staging import StagingRing
from .values import run_values

__all__ = [
    "SPARSE_FRACTION",
    "STAGING_BYTES",
    "STRIDED_RUNS",
    "BlockExecutor",
    "ReadLayout",
    "Rollback",
    "StagingRing",
    "apply_deferred",
    "execute_plan",
    "read_layout",
    "run_deferred",
    "run_fills",
    "run_values",
    "split_block",
    "split_span",
]
