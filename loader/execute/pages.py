"""Pages: the byte runs of a block's read layout grouped into ranges that read no page the runs do not touch.

The arithmetic of a block's reads is regiontrace's (:class:`regiontrace.ReadLayout`: runs, packed strides, flips,
spans; :func:`regiontrace.split_block`: splitting to fit a bounded buffer); this module adds the page-aware grouping.
"""

from __future__ import annotations

import numpy as np

from ..storage import PAGE, ByteRuns


def page_spans(starts: np.ndarray, length: int, page: int = PAGE) -> list[tuple[int, int]]:
    """Byte runs ``[s, s + length)`` merged into ranges whose gaps hold no page that no run touches.

    Reading such a range through its gaps reads no page more than the runs alone would.
    """
    return ByteRuns(np.asarray(starts, dtype=np.int64), length).spans(page)
