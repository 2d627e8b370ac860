"""Planning a load on one rank: trace each conversion, compile RemapBlocks for the boxes the rank owns.

Phases: rules (``plan_keys``, given) → check (each conversion's meta run against the model: names, shapes,
value kinds) → trace (once per signature, cached; the outcome is :class:`TracedConversion` or :class:`Untraced`) →
compile (blocks per owned box) → validate (meta-device targets, strictness). Everything is checked before any
byte is read. An untraced conversion — it raises :class:`~regiontrace.Untraceable` or
:class:`~regiontrace.TraceMismatch`, or a hook rejects it — becomes a :class:`DeferredRead`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch

import regiontrace as rt
from regiontrace.executor import distinct_read_numel, input_regions, is_constant

from ..checkpoint import Checkpoint, check_encodings
from ..rules import Conversion, KeyPlan
from ..rules.conversion import MetaRun, cast_like_transformers, source_cast
from .dtypes import check_float8, kind_cast
from .gcpause import paused_gc
from .slots import Box, TargetSlot
from .traces import TraceCache, TracedConversion, Untraced

#: the most bytes a value read's inputs hold at once (a larger box is split)
VALUE_BYTES = 64 << 20
#: the reason of a conversion the ``supports_symbolic`` hook sent to a deferred read
REJECTED_BY_HOOK = "rejected by supports_symbolic"


@dataclass(frozen=True)
class BlockRead:
    """Execute ``block`` (compiled for a box of ``target``) into ``local_box`` of its local tensor."""

    target: str
    local_box: Box
    block: rt.RemapBlock


@dataclass(frozen=True)
class ValueRead:
    """Fill ``program``'s inputs (box-shaped reads), compute its pointwise ops, copy into ``local_box``."""

    target: str
    local_box: Box
    program: rt.ValueProgram


@dataclass(frozen=True)
class DeferredRead:
    """Read ``conversion``'s sources whole, run it for real, copy the owned boxes of its outputs."""

    conversion: Conversion
    reason: str
    boxes: tuple[tuple[str, Box, Box], ...]  # (target, global box, local box)


@dataclass(frozen=True, eq=False)
class RankPlan:
    """Everything one rank does to load, and what it was planned from: a value, nothing read or written yet.

    Attributes:
        checkpoint: the checkpoint headers planned against.
        slots: the model tensors as this rank sees them, by name.
        keyplan: which checkpoint keys feed which model tensors (:func:`loader.rules.plan_keys`).
        conversions: ``keyplan.conversions``; outcomes: each one's :class:`TracedConversion` or :class:`Untraced`.
        reads: the region reads; values: the value reads (boxes of targets computed by pointwise ops, e.g. FP8
            dequantization); deferred: the deferred conversions (``boxes`` empty when this rank owns nothing of
            their targets).
        loaded_keys, missing_keys, unexpected_keys: the key report (tied aliases loaded with their tensor).
        traced, deferred_targets: model tensors loaded by region or value reads, and by deferred conversions.
        casts: ``(model tensor, dtype its values come in, model dtype)`` for loads across value kinds
            (see :func:`~loader.plan.dtypes.kind_cast`).
        fills: the constant fills: blocks of traced conversions reading a constant source (``F.pad``'s padding),
            run by filling their destination with the constant, no byte read (not among ``reads``, nor in
            :meth:`planned_bytes`).
    """

    checkpoint: Checkpoint
    slots: Mapping[str, TargetSlot]
    keyplan: KeyPlan
    conversions: tuple[Conversion, ...]
    outcomes: tuple[TracedConversion | Untraced, ...]
    reads: tuple[BlockRead, ...]
    values: tuple[ValueRead, ...]
    deferred: tuple[DeferredRead, ...]
    loaded_keys: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    traced: tuple[str, ...]
    deferred_targets: tuple[str, ...]
    casts: tuple[tuple[str, torch.dtype, torch.dtype], ...]
    fills: tuple[BlockRead, ...] = ()

    def block_reads(self) -> list[tuple[str, rt.RemapBlock]]:
        """``(target, block)`` for every block this plan reads: region reads and value reads' inputs."""
        values = [(v.target, b) for v in self.values for b in value_blocks(v)]
        return [(r.target, r.block) for r in self.reads] + values

    def planned_bytes(self) -> int:
        """Bytes of checkpoint data this plan reads (region and value reads by element, deferred sources whole)."""
        return self._planned_bytes

    @functools.cached_property
    def _planned_bytes(self) -> int:  # the log line, the progress bar and the report each ask: counted once
        with paused_gc():  # one record per block: no full collections over the model meanwhile
            blocks = [r.block for r in self.reads] + [b for v in self.values for b in value_blocks(v)]
            total = unique_read_bytes(blocks, self.checkpoint)
        keys = {k for d in self.deferred if d.boxes for k in d.conversion.sources}
        return total + sum(self.checkpoint[k].nbytes for k in keys)

    def look_up_sources(self) -> None:
        """Look up every checkpoint tensor this plan reads, now: a source placed when first asked for (a DCP
        chunk: its blob's records read and checked then) is found, or refused, while planning, not mid-read.

        Raises:
            CheckpointError: a source the checkpoint refuses, naming the file and the tensor.
        """
        names = {r.block.source for r in self.reads} | {b.source for v in self.values for b in value_blocks(v)}
        names |= {k for d in self.deferred if d.boxes for k in d.conversion.sources}
        for name in sorted(names):
            self.checkpoint[name]

    @property
    def block_count(self) -> int:
        """``len(block_reads())``, without listing them."""
        return len(self.reads) + sum(len(value_blocks(v)) for v in self.values)

    def rebound(self, slots: Mapping[str, TargetSlot], checkpoint: Checkpoint) -> RankPlan:
        """This plan writing into ``slots`` (the same names, shapes, boxes and dtypes: their tensors are written
        instead) and reading ``checkpoint`` (the same tensor table); what was counted is kept."""
        plan = replace(self, slots=slots, checkpoint=checkpoint)
        if "_planned_bytes" in vars(self):
            vars(plan)["_planned_bytes"] = self._planned_bytes
        return plan


def value_blocks(read: ValueRead) -> tuple[rt.RemapBlock, ...]:
    """The blocks of a value read's inputs that read checkpoint bytes (a constant input, such as the shift amounts
    that unpack codes, is filled without a read)."""
    return tuple(b for b in read.program.blocks if not is_constant(b.source))


def unique_read_bytes(blocks: list[rt.RemapBlock], checkpoint: Checkpoint) -> int:
    """Bytes of the union of source elements the blocks read (overlapping reads are read once)."""
    by_source: dict[str, rt.RemapBlock | list[rt.RemapBlock]] = {}  # a list only for a source read several times
    for b in blocks:
        seen = by_source.get(b.source)
        if seen is None:
            by_source[b.source] = b
        elif isinstance(seen, list):
            seen.append(b)
        else:
            by_source[b.source] = [seen, b]
    return sum(
        (distinct_read_numel(g) if isinstance(g, list) else g.read_numel) * checkpoint[s].itemsize
        for s, g in by_source.items()
    )


def plan_rank(
    keyplan: KeyPlan,
    checkpoint: Checkpoint,
    slots: Mapping[str, TargetSlot],
    *,
    strict: bool = True,
    supports_symbolic: Callable[[Conversion], bool] = lambda conv: True,
    cache: TraceCache | None = None,
    check_devices: bool = True,
    value_bytes: int | None = VALUE_BYTES,
) -> RankPlan:
    """Plan this rank's part of a load.

    Args:
        keyplan: which checkpoint keys feed which model tensors (from :func:`loader.rules.plan_keys`).
        checkpoint: the validated checkpoint headers.
        slots: model tensors as this rank sees them, by name.
        strict: raise when a model tensor is loaded by nothing.
        supports_symbolic: hook; False sends a conversion to a deferred read.
        cache: trace cache shared across plans (e.g. simulated ranks).
        check_devices: refuse targets still on the meta device.
        value_bytes: conversions that end in pointwise ops compile into value reads, each holding at most this
            many bytes of inputs at once (larger boxes are split); None: no value reads, such conversions are
            deferred (a reader that copies plain boxes only: ``build_plan(values=False)``).

    Returns:
        The rank's plan. Nothing has been read or written.

    Raises:
        ValueError: a shape mismatch, an unknown target, a meta-device target, or (strict) missing tensors;
            the message names the tensor.
        CheckpointError: float8 codes would load as values (see :func:`check_float8`); a source's element
            encoding is not one the loader reads (:func:`~loader.checkpoint.check_encodings`).
        Exception: what a conversion raised on meta tensors (it cannot run on these checkpoint tensors).
    """
    cache = cache or TraceCache()
    check_encodings(checkpoint[k] for conv in keyplan.conversions for k in conv.sources)  # before any byte is read
    check_float8(keyplan, checkpoint, slots)
    outcomes: list[TracedConversion | Untraced] = []
    reads: list[BlockRead] = []
    fills: list[BlockRead] = []
    value_reads: list[ValueRead] = []
    deferred: list[DeferredRead] = []
    casts: list[tuple[str, torch.dtype, torch.dtype]] = []
    for conv in keyplan.conversions:
        casts += _checked_outputs(conv, cache.meta(conv, checkpoint), slots)
        if supports_symbolic(conv):
            outcome = cache.trace(conv, checkpoint, source_cast(conv.rule, slots[conv.targets[0]].dtype))
        else:
            outcome = Untraced(REJECTED_BY_HOOK)
        if isinstance(outcome, TracedConversion) and value_bytes is None and not outcome.is_index_map:
            outcome = Untraced("values computed by pointwise ops are read whole here (values=False)")
        outcomes.append(outcome)
        if isinstance(outcome, TracedConversion):
            for r in _compiled(conv, outcome, slots):
                (fills if is_constant(r.block.source) else reads).append(r)
            value_reads += _compiled_values(conv, outcome, slots, value_bytes or VALUE_BYTES)
        else:
            owned = tuple((t, g, lb) for t in conv.targets for g, lb in slots[t].boxes if _nonempty(g))
            deferred.append(DeferredRead(conv, outcome.reason, owned))
    loaded = {t for conv in keyplan.conversions for t in conv.targets}
    if check_devices:
        _check_materialized(loaded, slots)
    aliases = {a for a, c in keyplan.tied.items() if c in loaded}
    ignored = set(keyplan.ignored_missing_keys)
    missing = tuple(k for k in keyplan.missing_keys if k not in loaded and k not in aliases and k not in ignored)
    if strict and missing:
        shown = ", ".join(missing[:8]) + (" …" if len(missing) > 8 else "")
        raise ValueError(
            f"{len(missing)} model tensor(s) are not in the checkpoint: {shown} (pass strict=False to load the rest)"
            + keyplan.unmatched_note(checkpoint.tensors)
        )
    # like from_pretrained, leave out what the model says to ignore (``_keys_to_ignore_on_load_*``, stale
    # ``rotary_emb.inv_freq`` / ``position_ids``): not reported, and not an error with ``strict``
    ignored_unexpected = set(keyplan.ignored_unexpected_keys)
    conversions = tuple(keyplan.conversions)
    return RankPlan(
        checkpoint=checkpoint,
        slots=slots,
        keyplan=keyplan,
        conversions=conversions,
        outcomes=tuple(outcomes),
        reads=tuple(reads),
        values=tuple(value_reads),
        deferred=tuple(deferred),
        loaded_keys=tuple(sorted(loaded | aliases)),
        missing_keys=missing,
        unexpected_keys=tuple(k for k in keyplan.unexpected_keys if k not in ignored_unexpected),
        traced=tuple(t for c, o in zip(conversions, outcomes) if isinstance(o, TracedConversion) for t in c.targets),
        deferred_targets=tuple(t for d in deferred for t in d.conversion.targets),
        casts=tuple(casts),
        fills=tuple(fills),
    )


def _checked_outputs(
    conv: Conversion, meta: MetaRun, slots: Mapping[str, TargetSlot]
) -> list[tuple[str, torch.dtype, torch.dtype]]:
    """Check a conversion's outputs (from its meta run) against the model tensors they load; returns the casts
    across value kinds.

    Raises:
        ValueError: a target that is not a model tensor, not produced, or of another shape.
        Exception: what the conversion raised on meta tensors.
    """
    for t in conv.targets:
        if t not in slots:
            raise ValueError(f"conversion {conv.description} produces {t!r}, which is not a model tensor")
    if meta.error is not None:
        raise meta.error
    assert meta.outputs is not None
    casts = []
    for t, out in zip(conv.targets, meta.outputs):
        if out is None:
            raise ValueError(f"conversion {conv.description} did not produce {t!r}")
        shape, dtype = out
        if shape != slots[t].shape:
            raise _shape_error(t, shape, slots[t].shape, conv)
        if (cast := kind_cast(t, dtype, slots[t].dtype)) is not None:
            casts.append(cast)
    return casts


def _compiled(conv: Conversion, traced: TracedConversion, slots: Mapping[str, TargetSlot]) -> list[BlockRead]:
    """The region reads of a traced conversion: its blocks for every box this rank owns of its targets."""
    reads = []
    for i, t in enumerate(conv.targets):
        out = traced.outputs[t]
        if not out.is_index_map:
            continue
        for g, lb in slots[t].boxes:
            if _nonempty(g):
                reads.extend(BlockRead(t, lb, block) for block in traced.blocks(i, g, conv.sources))
    return reads


def _compiled_values(
    conv: Conversion, traced: TracedConversion, slots: Mapping[str, TargetSlot], value_bytes: int
) -> list[ValueRead]:
    """The value reads of a traced conversion: a program per owned box of its computed targets, boxes split so
    that a program's inputs hold at most ``value_bytes``."""
    reads = []
    for i, t in enumerate(conv.targets):
        out = traced.outputs[t]
        if out.is_index_map:
            continue
        per_element = sum(d.itemsize for _, d, _ in input_regions(out.value, out.dtype))
        for g, lb in slots[t].boxes:
            for gp, lp in split_box(g, lb, max(1, value_bytes // per_element)):
                reads.append(ValueRead(t, lp, traced.program(i, gp, conv.sources)))
    return reads


def split_box(g: Box, local: Box, numel: int, align: int = 128) -> list[tuple[Box, Box]]:
    """``(global, local)`` box pairs splitting ``g`` (and ``local`` alike) along its first dims into parts of at
    most ``numel`` elements; cuts fall on multiples of ``align`` when a part spans more than that."""
    if not _nonempty(g):
        return []
    if math.prod(b - a for a, b in g) <= numel:
        return [(g, local)]
    (a, b), rest = g[0], g[1:]
    inner = math.prod(hi - lo for lo, hi in rest)
    step = max(1, numel // inner)
    if step > align:
        step -= step % align
    # one index of the first dim may still be too large: then each is split along the dims after it
    tails = [(rest, local[1:])] if inner <= numel else split_box(rest, local[1:], numel, align)
    out = []
    for s in range(a, b, step):
        e, lo = min(b, s + step), local[0][0] + s - a
        out += [(((s, e), *gt), ((lo, lo + e - s), *lt)) for gt, lt in tails]
    return out


def _check_materialized(loaded: set[str], slots: Mapping[str, TargetSlot]) -> None:
    for name in sorted(loaded):
        local = slots[name].local
        if local is not None and local.device.type == "meta":
            raise ValueError(
                f"model tensor {name!r} is on the meta device: materialize the model first "
                "(e.g. model.to_empty(device='cpu'))"
            )


def _shape_error(target: str, got: tuple[int, ...], want: tuple[int, ...], conv: Conversion) -> ValueError:
    return ValueError(
        f"shape mismatch for {target!r}: checkpoint {tuple(got)} vs target {tuple(want)} "
        f"(from {', '.join(conv.sources[:4])}{' …' if len(conv.sources) > 4 else ''} via {conv.description})"
    )


def deferred_inputs(
    conv: Conversion, tensors: Mapping[str, torch.Tensor], slots: Mapping[str, TargetSlot]
) -> dict[str, torch.Tensor]:
    """Source tensors for running a deferred conversion for real (see
    :func:`~loader.rules.conversion.cast_like_transformers`)."""
    return cast_like_transformers(conv.rule, tensors, slots[conv.targets[0]].dtype)


def _nonempty(box: Box) -> bool:
    return math.prod(b - a for a, b in box) > 0


def describe(plan: RankPlan) -> str:
    """The one-line phase summary."""
    convs = {id(d.conversion) for d in plan.deferred}
    return (
        f"planned {len(set(plan.traced))} tensors as region or value reads, {len(set(plan.deferred_targets))} through "
        f"{len(convs)} deferred conversions, {plan.planned_bytes()} bytes"
    )
