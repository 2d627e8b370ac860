"""Testing kit: hypothesis strategies for random op chains, and an exactness check for your converters.

Use :func:`assert_converter_exact` on any conversion function: it traces the function on RegionTensors,
runs it for real, and checks ``materialize`` and random-box RemapBlocks against the real result, using
unique integer codes per source element (the *code oracle*) wherever the function has no value casts::

    from regiontrace.testing import assert_converter_exact
    bf16 = torch.bfloat16
    assert_converter_exact(lambda q, k: torch.cat([q, k]), {"q": ((8, 4), bf16), "k": ((8, 4), bf16)})

Pass the converter's inputs as one mapping (any argument name, a list of specs for a list of tensors) or as
keywords; ``reference=`` checks the converter against an independent implementation.

The strategies (:func:`programs`, :func:`value_programs`, :func:`boxes`) generate random programs of movement
ops (and, for :func:`value_programs`, pointwise ops) for property tests.
"""

from .checks import (
    DTYPES,
    Spec,
    assert_converter_exact,
    check_blocks,
    check_partition,
    check_values,
    code_tensors,
    random_box,
    random_tensor,
    same_values,
)
from .difference import first_difference
from .strategies import VALUE_OPS, Op, Program, boxes, leaves, programs, value_programs

__all__ = [
    "DTYPES",
    "VALUE_OPS",
    "Op",
    "Program",
    "Spec",
    "assert_converter_exact",
    "boxes",
    "check_blocks",
    "check_partition",
    "check_values",
    "code_tensors",
    "first_difference",
    "leaves",
    "programs",
    "random_box",
    "random_tensor",
    "same_values",
    "value_programs",
]
