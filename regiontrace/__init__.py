"""regiontrace: trace tensor conversion code as an exact, compact index mapping.

Run conversion code on :class:`RegionTensor` stand-ins for checkpoint tensors; the result records where
every output element comes from and compiles, for any box of the output, into :class:`RemapBlock` copies.
"""

from .blocks import Box, RemapBlock, compile_blocks
from .errors import NotInvertible, TraceMismatch, Untraceable
from .execute import execute_blocks, materialize
from .invert import Inverse, invert, unmaterialize
from .layout import ReadLayout
from .region import PIECE_BUDGET, Region
from .scatter import PackedRuns, packed_source_runs, scatter_blocks
from .tensor import RegionTensor
from .trace import check_trace, run_on_meta, trace

__all__ = [
    "PIECE_BUDGET",
    "Box",
    "Inverse",
    "NotInvertible",
    "PackedRuns",
    "ReadLayout",
    "Region",
    "RegionTensor",
    "RemapBlock",
    "TraceMismatch",
    "Untraceable",
    "check_trace",
    "compile_blocks",
    "execute_blocks",
    "explain",
    "invert",
    "materialize",
    "packed_source_runs",
    "run_on_meta",
    "scatter_blocks",
    "to_networkx",
    "trace",
    "unmaterialize",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:  # sympy and networkx load only when explain/to_networkx are used
    if name in ("explain", "to_networkx"):
        from . import symbolic

        return getattr(symbolic, name)
    raise AttributeError(f"module 'regiontrace' has no attribute {name!r}")
