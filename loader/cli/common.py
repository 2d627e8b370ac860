"""Shared pieces of the loader's commands: mesh shapes, byte counts, tables, a quiet transformers."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from regiontrace.cli.common import CLIError, parse_shape

#: the per-rank load table's columns, shared by ``plan`` and ``demo`` (each adds its own last column)
LOAD_COLUMNS = ("rank", "coord", "tensors", "blocks", "bytes read", "shard bytes", "whole tensors", "read/shard")


def parse_mesh(text: str) -> tuple[int, ...]:
    """``2x4`` → ``(2, 4)``."""
    shape = parse_shape(text)
    if not shape or any(n < 1 for n in shape):
        raise CLIError(f"bad --mesh {text!r}: write sizes separated by 'x', e.g. 4 or 2x4")
    return shape


def human_bytes(n: float) -> str:
    """``24473`` → ``23.9 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def table(header: Sequence[str], rows: Sequence[Sequence[Any]], *, right: Sequence[bool] | None = None) -> str:
    """A plain-text table with aligned columns (numbers right-aligned by default)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(header))]
    if right is None:
        right = [j > 0 for j in range(len(header))]
    lines = []
    for i, r in enumerate(cells):
        lines.append("  ".join(c.rjust(w) if rt else c.ljust(w) for c, w, rt in zip(r, widths, right)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def have_transformers() -> bool:
    """Whether transformers can be imported."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def quiet_transformers() -> None:
    """Offline, errors only, no progress bars."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
