"""Pages: the byte runs of a block's read layout grouped into ranges that read no page the runs do not touch.

The arithmetic of a block's reads is regiontrace's (:class:`regiontrace.ReadLayout`: runs, packed strides, flips,
spans; :func:`regiontrace.split_block`: splitting to fit a bounded buffer); this module adds the page-aware grouping.
"""

from __future__ import annotations

import numpy as np

from ..checkpoint.files import PAGE


def page_spans(starts: np.ndarray, length: int, page: int = PAGE) -> list[tuple[int, int]]:
    """Byte runs ``[s, s + length)`` merged into ranges whose gaps hold no page that no run touches.

    Reading such a range through its gaps reads no page more than the runs alone would.
    """
    starts = np.sort(starts)
    ends = starts + length
    cut = np.flatnonzero(starts[1:] // page - (ends[:-1] - 1) // page > 1) + 1
    firsts = np.concatenate(([0], cut))
    lasts = np.concatenate((cut - 1, [len(starts) - 1]))
    return list(zip(starts[firsts].tolist(), ends[lasts].tolist()))
