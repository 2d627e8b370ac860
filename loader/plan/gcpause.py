"""Pausing Python's cyclic garbage collector while a load plans, reads and reports.

A load of N tensors allocates a few records per tensor (conversions, slots, blocks, reads), none of them in a
reference cycle, while the model and the checkpoint headers keep hundreds of thousands of objects alive: each
full collection the allocations trigger walks all of them, which made planning 200 000 tensors quadratic in
practice. Reference counting still frees everything as usual; the collector runs again (as scheduled) after.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic garbage collector inside the ``with`` body (nested uses and a collector already disabled by
    the caller are left as they are)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
