"""Traces of conversions, cached by signature: one trace serves every layer whose conversion has the same
structure, and the blocks compiled for a box are cached with it.

A conversion is traced by running it once on RegionTensors (canonical leaves ``#0, #1, …`` standing for its
sources) and checking the result against its meta run (:attr:`~loader.rules.Conversion.meta`, made by the
rules for its signature): each conversion runs on meta once per signature, and the trace reuses that run.
The outcome is :class:`TracedConversion` (its outputs: index maps, or values computed from index maps by pointwise
ops) or :class:`Untraced` (why not).

A transformers rule's ops receive their sources cast to the model tensor's dtype
(:func:`~loader.rules.conversion.source_cast`). For an index map the cast commutes with every movement op, so it is
left to the final copy; a conversion that computes values is traced again on cast leaves, so its arithmetic rounds
in the dtype ``from_pretrained`` (and the deferred path) rounds in.

One trace serves load, save and transfer: :class:`TracedConversion` also carries, lazily, the trace's inverse
(:func:`regiontrace.invert`, the save's scatter back into the checkpoint) and its blocks compiled per box both
ways, all shared by every conversion of its signature (:meth:`TraceCache.signature`).

Constant elements (``F.pad``'s padding) are constant pieces of an index map: their blocks read a constant source
(``<constant VALUE: DTYPE>``, kept by :func:`_rename`) and are filled, not read (:attr:`~loader.plan.RankPlan.fills`);
they have no inverse (:attr:`TracedConversion.constants`: the save refuses, a transfer moves the conversion whole).
Constants inside values computed by pointwise ops make the conversion :class:`Untraced`, naming the op.

A source stored as several chunks (:mod:`loader.checkpoint.chunks`) is traced as those chunks put together: its
leaf is the ``torch.cat`` of one leaf per chunk (``#i.j``: chunk ``j`` of source ``i``), cut one dim at a time,
so the blocks compiled for a box read each chunk within its own bounds, and the chunk grid is part of the
signature. Chunks that no such cuts separate (a pinwheel tiling) make the conversion :class:`Untraced`: it is read
whole, assembled from its chunks.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import torch

import regiontrace as rt
from regiontrace.executor import is_constant

from ..checkpoint import Checkpoint, TableCheckpoint, TensorInfo, chunk_source
from ..rules import Conversion
from ..rules.conversion import MetaRun, cast_like_transformers, meta_tensors, run_on_meta
from .slots import Box


class _Shared:
    """What every conversion of one signature shares: its traced outputs (in target order, on canonical leaves),
    its inverse once asked for, and the blocks and value programs compiled per box."""

    __slots__ = ("outputs", "leaves", "inverse", "blocks", "programs", "inverse_blocks")

    def __init__(self, outputs: tuple[rt.RegionTensor, ...], leaves: tuple[rt.RegionTensor, ...]) -> None:
        self.outputs, self.leaves = outputs, leaves
        self.inverse: rt.Inverse | rt.NotInvertible | None = None
        self.blocks: dict[tuple, tuple[rt.RemapBlock, ...]] = {}
        self.programs: dict[tuple, rt.ValueProgram] = {}
        self.inverse_blocks: dict[tuple, tuple[rt.RemapBlock, ...]] = {}


@dataclass(frozen=True, eq=False)
class TracedConversion:
    """A conversion traced: each output an exact index map, or values computed from index maps by pointwise ops
    (:attr:`is_index_map` says which). One value serves load (its blocks), save (its inverse) and transfer.

    Attributes:
        outputs: each target's RegionTensor (over canonical leaves ``#i``: the conversion's ``sources[i]``).
        key: the signature's key in its :class:`TraceCache`.
    """

    outputs: Mapping[str, rt.RegionTensor]
    key: int
    _shared: _Shared = field(repr=False)

    @property
    def is_index_map(self) -> bool:
        """Whether every output is an index map (no output computed by pointwise ops)."""
        return all(t.is_index_map for t in self.outputs.values())

    @property
    def constants(self) -> str:
        """The ops that put constant elements into an output (``constant_pad_nd``), or "" when none does: such
        elements are filled, not read (:attr:`~loader.plan.RankPlan.fills`), and have no inverse."""
        return ", ".join(constant_op(t) for t in self.outputs.values() if any(map(is_constant, t.sources())))

    def invert(self) -> rt.Inverse:
        """The trace's inverse (outputs named ``"0", "1", …`` in target order), made once per signature.

        Raises:
            regiontrace.NotInvertible: the conversion is not a bijection (drops, repeats or computes elements).
        """
        shared = self._shared
        if shared.inverse is None:
            outputs = {str(i): t for i, t in enumerate(shared.outputs)}
            try:
                shared.inverse = rt.invert(outputs, list(shared.leaves))
            except rt.NotInvertible as e:
                shared.inverse = e
        if isinstance(shared.inverse, rt.NotInvertible):
            raise shared.inverse
        return shared.inverse

    def blocks(self, target_index: int, box: Box, names: tuple[str, ...]) -> tuple[rt.RemapBlock, ...]:
        """Blocks for ``box`` of target ``target_index``, compiled once per signature, reading ``names``."""
        cache, key = self._shared.blocks, (target_index, box)
        blocks = cache.get(key)
        if blocks is None:
            blocks = cache[key] = self._shared.outputs[target_index].remap_blocks(box)
        return tuple(_rename(b, names) for b in blocks)

    def program(self, target_index: int, box: Box, names: tuple[str, ...]) -> rt.ValueProgram:
        """The value program for ``box``, compiled once per signature, reading ``names``."""
        cache, key = self._shared.programs, (target_index, box)
        program = cache.get(key)
        if program is None:
            program = cache[key] = self._shared.outputs[target_index].value_program(box)
        return program.with_blocks(lambda b: _rename(b, names))

    def inverse_blocks(self, target_index: int, box: Box, names: tuple[str, ...]) -> tuple[rt.RemapBlock, ...]:
        """The blocks of ``box`` (global) of target ``target_index`` run backwards (model tensor -> checkpoint
        keys ``names``), compiled once per signature (:meth:`invert` raises when there is no inverse)."""
        cache, key = self._shared.inverse_blocks, (target_index, box)
        blocks = cache.get(key)
        if blocks is None:
            blocks = cache[key] = self.invert().blocks(str(target_index), box)
        return tuple(_rename(b, names) for b in blocks)


@dataclass(frozen=True)
class Untraced:
    """A conversion that is not traced (it becomes a deferred read).

    Attributes:
        reason: why (the :class:`~regiontrace.Untraceable` or :class:`~regiontrace.TraceMismatch` message, or
            the hook that rejected it).
        untraceable: the reason is an op that does not trace (else: what the conversion returned, or a hook).
    """

    reason: str
    untraceable: bool = False


class StandInCheckpoint(TableCheckpoint):
    """A checkpoint of keys, shapes and dtypes without bytes (no files, no store): the save's and the transfer's
    stand-in for the checkpoint their conversions are traced on (a :class:`~loader.checkpoint.Checkpoint`)."""

    def __init__(self, keys: Mapping[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        super().__init__({k: TensorInfo(k, None, d, tuple(s), None, None) for k, (s, d) in keys.items()}, ())


class TraceCache:
    """Traces by signature: one trace serves every layer whose conversion has the same structure, for load, save
    and transfer alike (:meth:`signature`).

    Attributes:
        hits, misses: trace lookups served from the cache, and traces made.
    """

    def __init__(self) -> None:
        self._traces: dict[int, _Shared | Untraced] = {}
        self._keys: dict[tuple[int, int], tuple[Conversion, Checkpoint, int, MetaRun, _Grids]] = {}
        self._interned: dict[Hashable, int] = {}
        self._reruns: dict[int, MetaRun] = {}
        self.hits = 0
        self.misses = 0

    def meta(self, conv: Conversion, checkpoint: Checkpoint) -> MetaRun:
        """``conv``'s meta run on ``checkpoint``'s shapes and dtypes (its own, when it was made on those)."""
        return self._key(conv, checkpoint)[1]

    def signature(self, conv: Conversion, checkpoint: Checkpoint) -> int:
        """The key of ``conv``'s signature on ``checkpoint``: equal for conversions of one rule and feed
        (:attr:`~loader.rules.Conversion.signature`) whose sources have the same shapes, dtypes and chunk grids
        there."""
        return self._key(conv, checkpoint)[0]

    def trace(
        self, conv: Conversion, checkpoint: Checkpoint, cast: torch.dtype | None = None
    ) -> TracedConversion | Untraced:
        """Trace ``conv`` on canonical leaves (a source stored as several chunks: its chunks', see the module),
        once per signature.

        Args:
            checkpoint: the checkpoint (a :class:`StandInCheckpoint`: keys' shapes and dtypes alone).
            cast: the dtype the conversion's floating-point sources are cast to before it runs
                (:func:`~loader.rules.conversion.source_cast`); None: they are not.

        Raises:
            the exception ``conv`` raised on meta tensors (a broken conversion fails planning).
        """
        key, meta, grids = self._entry(conv, checkpoint)
        if meta.error is not None:
            raise meta.error
        cached = self._traced(key, conv, meta, None, grids)
        if cast is not None and isinstance(cached, _Shared) and not all(t.is_index_map for t in cached.outputs):
            if any(d.is_floating_point and d != cast for d in meta.dtypes):
                key = self._intern((key, "cast", cast))
                cached = self._traced(key, conv, meta, cast, grids)
        if isinstance(cached, Untraced):
            return cached
        return TracedConversion(dict(zip(conv.targets, cached.outputs)), key, cached)

    def _traced(
        self, key: int, conv: Conversion, meta: MetaRun, cast: torch.dtype | None, grids: _Grids
    ) -> _Shared | Untraced:
        cached = self._traces.get(key)
        if cached is None:
            self.misses += 1
            cached = self._traces[key] = _trace(conv, meta, cast, grids)
        else:
            self.hits += 1
        return cached

    def _key(self, conv: Conversion, checkpoint: Checkpoint) -> tuple[int, MetaRun]:
        key, meta, _ = self._entry(conv, checkpoint)
        return key, meta

    def _entry(self, conv: Conversion, checkpoint: Checkpoint) -> tuple[int, MetaRun, _Grids]:
        """A small int standing for ``conv``'s signature on ``checkpoint`` (equal signatures, equal ints), its
        meta run, and its sources' chunk grids: the rule's signature with the sources' shapes, dtypes and chunk
        grids on ``checkpoint``.

        Memoised per (conversion, checkpoint) object: simulated ranks share both, and an expert merge's
        signature holds hundreds of source shapes, too costly to compare and hash per rank. The entry keeps both
        objects alive, so their ids cannot be reused.
        """
        entry = self._keys.get((id(conv), id(checkpoint)))
        if entry is not None and entry[0] is conv and entry[1] is checkpoint:
            return entry[2], entry[3], entry[4]
        infos = [checkpoint.tensors[k] for k in conv.sources]
        shapes, dtypes = tuple(i.shape for i in infos), tuple(i.dtype for i in infos)
        meta = conv.meta
        if meta is not None and conv.signature is not None and meta.shapes == shapes and meta.dtypes == dtypes:
            key = self._intern(conv.signature)  # the rule's signature holds these shapes and dtypes already
        else:  # made on other dtypes (rules planned from shapes alone), or a conversion built by hand
            key = self._intern((conv.signature if conv.signature is not None else _Unique(conv), shapes, dtypes))
            meta = self._reruns.get(key)
            if meta is None:
                meta = self._reruns[key] = run_on_meta(conv, shapes, dtypes)
        grids: _Grids = None
        if any(i.split for i in infos):
            grids = tuple(tuple(c.box for c in i.split) if i.split else None for i in infos)
            key = self._intern((key, "chunks", grids))
        self._keys[(id(conv), id(checkpoint))] = (conv, checkpoint, key, meta, grids)
        return key, meta, grids

    def _intern(self, signature: Hashable) -> int:
        return self._interned.setdefault(signature, len(self._interned))


#: each source's chunk boxes (None: stored in one chunk), or None when no source is stored in several
_Grids = tuple[tuple[Box, ...] | None, ...] | None


class _Unique:
    """Hashes by identity: a conversion that shares its trace with no other."""

    __slots__ = ("obj",)

    def __init__(self, obj: object) -> None:
        self.obj = obj


def _trace(conv: Conversion, meta: MetaRun, cast: torch.dtype | None, grids: _Grids = None) -> _Shared | Untraced:
    """Run ``conv`` on RegionTensor leaves (a chunked source's: its chunks put together; cast to ``cast`` first
    when given), check it against its meta run; its outputs in target order, or the reason it does not trace."""
    leaves, stored = {}, []
    for i, (k, shape, dtype) in enumerate(zip(conv.sources, meta.shapes, meta.dtypes)):
        grid = grids[i] if grids is not None else None
        if grid is None or 0 in shape:  # an empty source is never read
            leaves[k] = rt.RegionTensor.leaf(f"#{i}", shape, dtype)
            stored.append(leaves[k])
            continue
        chunks = [
            (box, rt.RegionTensor.leaf(f"#{i}.{j}", [b - a for a, b in box], dtype)) for j, box in enumerate(grid)
        ]
        stored += [leaf for _, leaf in chunks]
        assembled = _assembled(tuple((0, n) for n in shape), chunks)
        if assembled is None:
            return Untraced(f"source {k!r} is stored as chunks that no cuts along one dim at a time separate")
        leaves[k] = assembled
    try:
        if cast is None:
            out, expected = conv.run(dict(leaves)), _meta_outputs(conv, meta)
        else:
            out = conv.run(cast_like_transformers(conv.rule, leaves, cast))
            expected = rt.run_on_meta(
                lambda t: conv.run(cast_like_transformers(conv.rule, t, cast)),
                meta_tensors(conv.sources, meta.shapes, meta.dtypes),
            )
        rt.check_trace(out, expected)
    except (rt.Untraceable, rt.TraceMismatch) as e:
        return Untraced(f"{type(e).__name__}: {e}", untraceable=True)
    if not isinstance(out, Mapping) or set(out) != set(conv.targets):
        return Untraced(f"conversion returned {sorted(out) if isinstance(out, Mapping) else type(out).__name__}")
    for name, t in out.items():
        if not isinstance(t, rt.RegionTensor):
            return Untraced(f"output {name!r} is not derived from the checkpoint tensors")
        other = sorted(s for s in t.sources() if not s.startswith("#") and not is_constant(s))
        if other:  # a destination's prior contents (``<prior NAME>``): no checkpoint tensor holds them
            return Untraced(f"output {name!r} reads {other[0]!r}, which is not a checkpoint tensor")
    return _Shared(tuple(out[t] for t in conv.targets), tuple(stored))


def constant_op(t: rt.RegionTensor) -> str:
    """The op that put constant elements into ``t`` (``constant_pad_nd``, a ``fill``), for a log line or an error."""
    seen, todo, ops = set(), [t.node], []
    while todo:
        node = todo.pop()
        if id(node) not in seen:
            seen.add(id(node))
            ops += [node.op] if any(w in node.op for w in ("pad", "fill", "zero", "full", "constant")) else []
            todo.extend(node.parents)
    return ", ".join(sorted(set(ops))) or t.node.op


def _assembled(box: Box, chunks: list[tuple[Box, rt.RegionTensor]]) -> rt.RegionTensor | None:
    """The chunks tiling ``box`` put together by ``torch.cat``, cut one dim at a time (a guillotine cut: a plane
    that crosses no chunk); None when no such cut separates them."""
    chunks = [(b, leaf) for b, leaf in chunks if all(hi > lo for lo, hi in b)]
    if len(chunks) == 1:
        return chunks[0][1]
    for d, (lo, hi) in enumerate(box):
        cuts = sorted({b[d][0] for b, _ in chunks} - {lo})
        cuts = [c for c in cuts if all(not (b[d][0] < c < b[d][1]) for b, _ in chunks)]
        if not cuts:
            continue
        slabs, bounds = [], [lo, *cuts, hi]
        for a, z in zip(bounds, bounds[1:]):
            sub = tuple((a, z) if e == d else span for e, span in enumerate(box))
            slab = _assembled(sub, [(b, leaf) for b, leaf in chunks if a <= b[d][0] < z])
            if slab is None:
                return None
            slabs.append(slab)
        return torch.cat(slabs, dim=d)
    return None


def _meta_outputs(conv: Conversion, meta: MetaRun) -> dict[str, torch.Tensor]:
    """The meta run's outputs as meta tensors, in the structure the conversion returns."""
    assert meta.outputs is not None
    return {
        t: torch.empty(o[0], dtype=o[1], device="meta") for t, o in zip(conv.targets, meta.outputs) if o is not None
    }


def _rename(block: rt.RemapBlock, names: tuple[str, ...]) -> rt.RemapBlock:
    """``block``, compiled for canonical leaf ``#i``, reading ``names[i]`` instead (built field by field: once per
    block of every load, and ``dataclasses.replace`` costs several times more)."""
    b = block
    if not b.source.startswith("#"):  # a constant source: the same for every conversion of the signature
        return b
    index, dot, chunk = b.source[1:].partition(".")
    source = names[int(index)] if not dot else chunk_source(names[int(index)], int(chunk))
    return rt.RemapBlock(
        source,
        b.shape,
        b.src_offset,
        b.src_strides,
        b.dst_offset,
        b.dst_dims,
        b.dst_steps,
        b.source_shape,
        b.source_dtype,
        b.casts,
    )
