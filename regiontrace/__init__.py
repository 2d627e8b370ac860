"""regiontrace: trace tensor conversion code as an exact, compact index mapping.

Run conversion code on :class:`RegionTensor` stand-ins for checkpoint tensors; the result records where
every output element comes from and compiles, for any box of the output, into :class:`RemapBlock` copies.
"""

from .block_reads import distinct_read_numel, overlap_clusters, split_block, split_span
from .compile import compile_blocks
from .composition import compose, inverse_regions
from .errors import NotInvertible, TraceMismatch, Untraceable
from .execute import copy_cast, dest_view, execute_blocks, materialize, source_view
from .invert import Inverse, invert, unmaterialize
from .region import PIECE_BUDGET, Region, contiguous_strides
from .remap_block import Box, ReadLayout, RemapBlock, read_layout
from .run_grid import RunGrid
from .scatter import PackedRuns, packed_source_runs, scatter_blocks
from .tensor import RegionTensor
from .trace import check_trace, run_on_meta, trace
from .value_program import ValueInput, ValueProgram, evaluate_into, fill_inputs
from .values import Apply, input_regions

__all__ = [
    # tracing: stand-ins for sources, and the checks of a traced run
    "RegionTensor",
    "trace",
    "run_on_meta",
    "check_trace",
    "Untraceable",
    "TraceMismatch",
    # the index map and what it compiles to
    "Region",
    "PIECE_BUDGET",
    "contiguous_strides",
    "Box",
    "RemapBlock",
    "compile_blocks",
    "ReadLayout",
    "read_layout",
    "RunGrid",
    "distinct_read_numel",
    "overlap_clusters",
    "split_block",
    "split_span",
    # running blocks forwards
    "execute_blocks",
    "materialize",
    "source_view",
    "dest_view",
    "copy_cast",
    # values computed by pointwise ops
    "Apply",
    "ValueProgram",
    "ValueInput",
    "input_regions",
    "fill_inputs",
    "evaluate_into",
    # running blocks backwards
    "invert",
    "Inverse",
    "NotInvertible",
    "unmaterialize",
    "scatter_blocks",
    "packed_source_runs",
    "PackedRuns",
    # composing a traced map with an inverse
    "compose",
    "inverse_regions",
    # reading the map
    "explain",
    "to_networkx",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> object:  # sympy and networkx load only when explain/to_networkx are used
    if name in ("explain", "to_networkx"):
        from . import symbolic

        return getattr(symbolic, name)
    raise AttributeError(f"module 'regiontrace' has no attribute {name!r}")
