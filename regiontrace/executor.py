"""regiontrace.executor: what a reader, a writer or an executor needs to run RemapBlocks on real bytes.

The algebra (``regiontrace`` itself) says where every output element comes from and compiles a box into
:class:`~regiontrace.RemapBlock` copies; this module runs them: where a block's source elements lie and how they sit
packed in a read buffer, splitting a block so its read fits a bounded buffer, counting what many blocks read
together, the strided views a block reads and writes, a copy with its casts, a value program's inputs filled and its
ops replayed, and the same blocks run backwards for a writer.

Vocabulary (the algebra's words, docs/algebra.md, plus):

- a **read layout** (:class:`ReadLayout`): where the source elements one block reads lie (equal contiguous runs,
  their span, flips) and how they sit in a read buffer (packed, or the span read whole). "Layout" keeps its one
  meaning, the placement of elements or bytes: a read layout places one block's reads, a file layout a file's
  tensors;
- a **run grid** (:class:`RunGrid`): a read layout's runs in closed form (count, span, merged runs, page spans);
- a **span**: a flat ``[lo, hi)`` interval of source elements (:func:`split_span` cuts a block at a bound);
- an **input** of a value program (:class:`ValueInput`): a box-shaped tensor that blocks fill
  (:func:`fill_inputs`) before its ops run (:func:`evaluate_into`);
- **packed runs** (:class:`PackedRuns`): a block's values in source order, one equal-length run per write;
- a **constant block**: a block reading a constant source (:func:`is_constant`: padding, a ``fill_``) with stride 0;
  an executor fills its destination with :func:`constant_value` and reads no bytes.
"""

from __future__ import annotations

from .block_reads import distinct_read_numel, overlap_clusters, split_block, split_span
from .constants import constant_value, is_constant
from .execute import copy_cast, dest_view, execute_blocks, source_view
from .region import contiguous_strides
from .remap_block import ReadLayout, read_layout
from .run_grid import RunGrid
from .scatter import PackedRuns, packed_source_runs, scatter_blocks
from .value_program import ValueInput, evaluate_into, fill_inputs
from .values import input_regions

__all__ = [
    # where a block's reads lie
    "ReadLayout",
    "read_layout",
    "RunGrid",
    "contiguous_strides",
    # reading through a bounded buffer, and counting what many blocks read together
    "split_block",
    "split_span",
    "distinct_read_numel",
    "overlap_clusters",
    # running blocks forwards
    "execute_blocks",
    "source_view",
    "dest_view",
    "copy_cast",
    # constant blocks: filled, never read
    "is_constant",
    "constant_value",
    # values computed by pointwise ops: filling a program's inputs and replaying its ops
    "ValueInput",
    "input_regions",
    "fill_inputs",
    "evaluate_into",
    # running blocks backwards
    "scatter_blocks",
    "packed_source_runs",
    "PackedRuns",
]
