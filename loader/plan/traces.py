"""Traces of conversions, cached by signature: one trace serves every layer whose conversion has the same
structure, and the blocks compiled for a box are cached with it.
"""

from __future__ import annotations

from collections.abc import Mapping

import regiontrace as rt

from ..checkpoint import SafetensorsCheckpoint
from ..rules import Conversion
from .slots import Box


class TraceCache:
    """Traces by shape signature: one trace serves every layer whose conversion has the same structure."""

    def __init__(self) -> None:
        self._traces: dict[int, dict[int, rt.RegionTensor] | str] = {}
        self._blocks: dict[tuple, tuple[rt.RemapBlock, ...]] = {}
        self._keys: dict[tuple[int, int], tuple] = {}
        self._interned: dict[tuple, int] = {}
        self.hits = 0
        self.misses = 0

    def _key(self, conv: Conversion, checkpoint: SafetensorsCheckpoint) -> int:
        """A small int standing for ``conv``'s signature (equal signatures, equal ints).

        Memoised per (conversion, checkpoint) object: simulated ranks share both, and an expert merge's
        signature holds hundreds of source shapes, too costly to rebuild and hash per rank and per box. The
        entry keeps both objects alive, so their ids cannot be reused.
        """
        entry = self._keys.get((id(conv), id(checkpoint)))
        if entry is not None and entry[0] is conv and entry[1] is checkpoint:
            return entry[2]
        key = self._interned.setdefault(self.signature(conv, checkpoint), len(self._interned))
        self._keys[(id(conv), id(checkpoint))] = (conv, checkpoint, key)
        return key

    def signature(self, conv: Conversion, checkpoint: SafetensorsCheckpoint) -> tuple:
        rule = conv.rule
        rule_id = (
            id(getattr(rule, "fn", None)) if getattr(rule, "fn", None) is not None else type(rule).__name__,
            repr(getattr(rule, "operations", None)),
        )
        # a rename's only "pattern" is its key: leave it out, so that every rename of one shape shares a trace
        groups = () if conv.is_rename else tuple((p, len(keys)) for p, keys in conv.groups)
        srcs = tuple((tuple(checkpoint[k].shape), checkpoint[k].dtype) for k in conv.sources)
        return (conv.is_rename, rule_id, conv.description, groups, srcs, len(conv.targets))

    def trace(
        self, conv: Conversion, checkpoint: SafetensorsCheckpoint
    ) -> tuple[dict[str, rt.RegionTensor] | str, int]:
        """Trace ``conv`` on canonical leaves ``#0, #1, …``; returns ``{target: RegionTensor}`` or the reason,
        and the signature's key for :meth:`blocks`."""
        sig = self._key(conv, checkpoint)
        cached = self._traces.get(sig)
        if cached is None:
            self.misses += 1
            cached = self._trace(conv, checkpoint)
            self._traces[sig] = cached
        else:
            self.hits += 1
        if isinstance(cached, str):
            return cached, sig
        return {conv.targets[i]: t for i, t in cached.items()}, sig

    def _trace(self, conv: Conversion, checkpoint: SafetensorsCheckpoint) -> dict[int, rt.RegionTensor] | str:
        leaves = {
            k: rt.RegionTensor.leaf(f"#{i}", checkpoint[k].shape, checkpoint[k].dtype)
            for i, k in enumerate(conv.sources)
        }
        try:
            out = rt.trace(conv.run, leaves)
        except (rt.Untraceable, rt.TraceMismatch) as e:
            return f"{type(e).__name__}: {e}"
        if not isinstance(out, Mapping) or set(out) - set(conv.targets):
            return f"conversion returned {sorted(out) if isinstance(out, Mapping) else type(out).__name__}"
        result = {}
        for name, t in out.items():
            if not isinstance(t, rt.RegionTensor):
                return f"output {name!r} is not derived from the checkpoint tensors"
            result[conv.targets.index(name)] = t
        return result

    def blocks(
        self, sig: int, target_index: int, traced: rt.RegionTensor, box: Box, names: tuple[str, ...]
    ) -> tuple[rt.RemapBlock, ...]:
        """Blocks for ``box``, compiled once per signature and renamed to this conversion's sources."""
        key = (sig, target_index, box)
        blocks = self._blocks.get(key)
        if blocks is None:
            blocks = traced.remap_blocks(box)
            self._blocks[key] = blocks
        return tuple(_rename(b, names) for b in blocks)


def _rename(block: rt.RemapBlock, names: tuple[str, ...]) -> rt.RemapBlock:
    return rt.RemapBlock(
        names[int(block.source[1:])],
        block.shape,
        block.src_offset,
        block.src_strides,
        block.dst_offset,
        block.dst_dims,
        block.dst_steps,
        block.source_shape,
        block.source_dtype,
        block.casts,
    )
