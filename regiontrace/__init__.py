"""regiontrace: trace tensor conversion code as an exact, compact index mapping.

Run conversion code on :class:`RegionTensor` stand-ins for checkpoint tensors; the result records where
every output element comes from and compiles, for any box of the output, into :class:`RemapBlock` copies.
Running those copies on real bytes (read layouts, bounded reads, views, casts, writing backwards) is
:mod:`regiontrace.executor`.
"""

from .certificate import coverage
from .compile import compile_blocks
from .composition import compose, inverse_regions
from .errors import NotInvertible, TraceMismatch, Untraceable
from .execute import materialize
from .invert import Inverse, invert, unmaterialize
from .region import PIECE_BUDGET, Region
from .remap_block import Box, RemapBlock
from .tensor import RegionTensor
from .trace import check_trace, run_on_meta, trace
from .value_program import ValueProgram
from .values import Apply
from .writes import destination

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
    "Box",
    "RemapBlock",
    "compile_blocks",
    "materialize",
    # values computed by pointwise ops
    "Apply",
    "ValueProgram",
    # running the map backwards
    "invert",
    "Inverse",
    "NotInvertible",
    "unmaterialize",
    # composing a traced map with an inverse
    "compose",
    "inverse_regions",
    # in-place writes: a destination stand-in, and the coverage certificate of what was written into it
    "destination",
    "coverage",
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
