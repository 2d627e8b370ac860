"""The checks of a traced engine loader, before any byte is read: coverage, and consistent checkpoint shapes.

Vocabulary (as in :mod:`loader.engine.trace`, plus):

- **certificate**: a parameter's :class:`regiontrace.certificate.Coverage` (``rt.coverage``): which boxes each
  write wrote, which no write reached, which two writes wrote.
- **span**: along one dim of a checkpoint key, the indices this rank's parameters read of it, ``[a, b)`` (all
  parameters together; a block that reads across dims of a key, a reshape, spans them whole).

The rules (each broken rule is a ``ValueError`` naming the parameter, the box and the checkpoint keys):

1. **Coverage.** A parameter some key wrote into must end with every element written or a constant (a ``fill_``,
   zeroed padding): an element left unwritten is an error, strict as ``Rules(strict=True)``. A parameter no key
   wrote into is *missing* (reported in ``LoadReport.missing_keys``, not an error: the loader left it alone).
   An element written twice is an error, unless the earlier write was a ``fill_``/``zero_`` (initialise, then
   copy: a common pattern) — two copies into one element mean two keys claim it.
2. **Shapes.** A key must be consumed in a way consistent with its full shape: along each dim ``d`` of key ``k``
   (size ``K``), with span ``[a, b)`` of ``n = b - a`` indices, either the key is read whole (``n == K``), or this
   rank reads one of ``tp_size`` equal shares (``a % n == 0`` and ``tp_size * n >= K``: together the shares can
   cover the key — replicated KV heads read the same share on several ranks), or it reads the key's tail
   (``b == K``: the last rows of a vocabulary before its padding). Anything else means rows of the checkpoint
   tensor that no rank reads, which the module's loader would narrow away silently: a checkpoint with 64 extra
   vocabulary rows, a hidden size that does not match. That every element is read by *some* rank is not locally
   checkable; this rule catches what one rank sees.

A key whose dtype differs from its parameter's is cast as the module's ``copy_`` would (that is not refused).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import regiontrace as rt

from ..checkpoint import Checkpoint
from .trace import EngineTrace, writer_keys

#: a parameter's coverage certificate (what ``rt.coverage`` returns)
Coverage = Any

__all__ = ["certificates", "check_coverage", "check_shapes", "key_spans"]

#: the ops whose writes may be written over (initialise, then copy)
FILLS = frozenset({"fill_", "zero_"})


def certificates(trace: EngineTrace) -> dict[str, Coverage]:
    """Each parameter's coverage certificate (an alias's is its parameter's: a certificate names no key)."""
    own = {name: rt.coverage(dest) for name, dest in trace.params.items() if name not in trace.aliases}
    return {name: own[trace.aliases[name].of] if name in trace.aliases else own[name] for name in trace.params}


def check_coverage(trace: EngineTrace, certs: Mapping[str, Coverage]) -> tuple[str, ...]:
    """Rule 1 (see the module); returns the missing parameters (no write reached them).

    Parameters that a key which fell back had written into before it stopped, or any incomplete parameter while
    keys fall back, are left to those keys (their writes are not seen): not refused here.

    Raises:
        ValueError: a parameter with elements unwritten or written twice (naming it, the box, the keys).
    """
    missing = []
    left = {n for f in trace.fallbacks for n in f.touched}
    for name, cov in certs.items():
        if not cov.writes:
            if name not in left and name not in trace.buffers:
                missing.append(name)
            continue
        keys = writer_keys(trace, name, range(len(cov.writes)))
        if cov.undefined and not trace.fallbacks:
            raise ValueError(
                f"parameter {name!r} {tuple(cov.shape)}: elements {_boxes(cov.undefined)} are never written by "
                f"load_weights (it wrote the rest from checkpoint keys {_keys(keys)}): the module's loader leaves "
                "them holding whatever the parameter held before"
            )
        twice = _written_over(trace, name, cov)
        if twice:
            box, earlier, later = twice
            first, then = writer_keys(trace, name, [earlier.index]), writer_keys(trace, name, [later.index])
            raise ValueError(
                f"parameter {name!r} {tuple(cov.shape)}: elements {_boxes((box,))} are written twice by "
                f"load_weights (by {earlier.op} from checkpoint key {_keys(first)}, then by {later.op} from "
                f"{_keys(then)}): two writes claim them"
            )
    return tuple(missing)


def _written_over(trace: EngineTrace, name: str, cov: Coverage) -> tuple | None:
    """The first box written twice where an earlier write is no fill: ``(box, earlier write, later write)``."""
    shape = tuple(cov.shape)
    spans = [[tuple(_span(shape, off, ext, st)) for ext, st, off in a] for a in (w.addresses for w in cov.writes)]
    for box in cov.overwritten:
        hits = [w for w, boxes in zip(cov.writes, spans) if any(_overlap(box, b) for b in boxes)]
        for earlier in hits[:-1]:
            if earlier.op not in FILLS:
                return box, earlier, hits[-1]
    return None


def _overlap(a, b) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b))


def key_spans(trace: EngineTrace, checkpoint: Checkpoint) -> dict[str, list[tuple[int, int]]]:
    """Per checkpoint key this rank reads, its span along each dim (see the module), and the parameters reading it."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for name in trace.params:
        for block in trace.blocks(name):
            if block.source not in checkpoint:
                continue
            span = _span(block.source_shape, block.src_offset, block.shape, block.src_strides)
            seen = spans.get(block.source)
            if seen is not None:
                span = [(min(a, c), max(b, d)) for (a, b), (c, d) in zip(seen, span)]
            spans[block.source] = span
    return spans


def check_shapes(trace: EngineTrace, checkpoint: Checkpoint, tp_size: int) -> None:
    """Rule 2 (see the module).

    Raises:
        ValueError: a key read along a dim in a way that leaves indices no rank reads (naming the key, its shape,
            the span and the parameters reading it).
    """
    for key, span in key_spans(trace, checkpoint).items():
        shape = checkpoint[key].shape
        for d, ((a, b), size) in enumerate(zip(span, shape)):
            n = b - a
            if n == size or b == size or (n and a % n == 0 and tp_size * n >= size):
                continue
            readers = [name for name in trace.params if key in trace.keys_of(name)]
            raise ValueError(
                f"checkpoint tensor {key!r} {tuple(shape)} does not fit parameter(s) {', '.join(readers)}: "
                f"load_weights reads indices [{a}, {b}) of its dim {d} on this rank, which is neither the whole dim, "
                f"its tail, nor one of {tp_size} equal shares (tp_size={tp_size}): {size - min(size, tp_size * n)} "
                f"or more of its indices along dim {d} would be read by no rank (the module expects another shape)"
            )


def check_union(spans: list[Mapping[str, list[tuple[int, int]]]], checkpoint: Checkpoint) -> None:
    """Rule 3 (see the module): ``spans`` are every rank's :func:`key_spans` (index = rank).

    Raises:
        ValueError: indices of a key's dim that no rank reads (naming the key, the dim, the gap and the ranks'
            spans).
    """
    keys = dict.fromkeys(k for rank in spans for k in rank)
    for key in keys:
        shape = checkpoint[key].shape
        for d, size in enumerate(shape):
            reading = sorted((s[key][d], r) for r, s in enumerate(spans) if key in s)
            end = 0
            for (a, b), _ in reading:
                if a > end:
                    break
                end = max(end, b)
            if end < size or reading[0][0][0] > 0:
                gap = (end, size) if reading[0][0][0] == 0 else (0, reading[0][0][0])
                shown = ", ".join(f"rank {r}: [{a}, {b})" for (a, b), r in reading[:8])
                raise ValueError(
                    f"checkpoint tensor {key!r} {tuple(shape)}: indices [{gap[0]}, {gap[1]}) of its dim {d} are read "
                    f"by no rank ({shown}): the module expects another shape"
                )


def _span(shape, offset: int, extents, steps) -> list[tuple[int, int]]:
    """The indices along each dim of a contiguous tensor of ``shape`` that the strided view ``(extents, steps,
    offset)`` reads (a view axis that steps across dims: those dims whole)."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    base, rest = [], offset
    for st in strides:
        base.append(rest // st if st else 0)
        rest = rest % st if st else rest
    hi = [c + 1 for c in base]
    for extent, step in zip(extents, steps):
        if extent <= 1 or step == 0:
            continue
        d = next((d for d, st in enumerate(strides) if st <= step and step % st == 0), None)
        if d is None or hi[d] + (step // strides[d]) * (extent - 1) > shape[d]:
            return [(0, n) for n in shape]
        hi[d] += (step // strides[d]) * (extent - 1)
    return list(zip(base, hi))


def _boxes(boxes) -> str:
    shown = ", ".join("[" + ", ".join(f"{a}:{b}" for a, b in box) + "]" for box in list(boxes)[:4])
    return shown + (f" and {len(boxes) - 4} more" if len(boxes) > 4 else "")


def _keys(keys) -> str:
    keys = list(keys)
    return ", ".join(repr(k) for k in keys[:6]) + (" …" if len(keys) > 6 else "") if keys else "(none)"
