"""Planning a load on one rank: trace each conversion, compile RemapBlocks for the boxes the rank owns.

Phases: rules (``plan_keys``) → trace (one trace per distinct conversion shape signature, cached) →
validate (shapes, meta targets, strictness; all before any byte is read) → compile (blocks per owned box).
A conversion that raises :class:`~regiontrace.Untraceable` or :class:`~regiontrace.TraceMismatch`, or that a
hook rejects, becomes a :class:`DeferredRead`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

import regiontrace as rt

from ..checkpoint import SafetensorsCheckpoint
from ..rules import Conversion, KeyPlan
from .dtypes import check_float8, kind_cast
from .slots import Box, TargetSlot
from .traces import TraceCache


@dataclass(frozen=True)
class BlockRead:
    """Execute ``block`` (compiled for ``global_box`` of ``target``) into ``local_box`` of its local tensor."""

    target: str
    local_box: Box
    block: rt.RemapBlock


@dataclass(frozen=True)
class DeferredRead:
    """Read ``conversion``'s sources whole, run it for real, copy the owned boxes of its outputs."""

    conversion: Conversion
    reason: str
    boxes: tuple[tuple[str, Box, Box], ...]  # (target, global box, local box)


@dataclass
class RankPlan:
    """Everything one rank does to load: region reads, deferred conversions, and the key report."""

    reads: list[BlockRead] = field(default_factory=list)
    deferred: list[DeferredRead] = field(default_factory=list)
    loaded_keys: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    traced: list[str] = field(default_factory=list)
    deferred_targets: list[str] = field(default_factory=list)
    conversions: list[Conversion] = field(default_factory=list)
    #: ``(model tensor, dtype its values come in, model dtype)`` for loads across value kinds (see :func:`kind_cast`)
    casts: list[tuple[str, torch.dtype, torch.dtype]] = field(default_factory=list)

    def planned_bytes(self, checkpoint: SafetensorsCheckpoint) -> int:
        """Bytes of checkpoint data this plan reads (region reads by element, deferred sources whole)."""
        total = unique_read_bytes([r.block for r in self.reads], checkpoint)
        keys = {k for d in self.deferred if d.boxes for k in d.conversion.sources}
        return total + sum(checkpoint[k].nbytes for k in keys)


def unique_read_bytes(blocks: list[rt.RemapBlock], checkpoint: SafetensorsCheckpoint) -> int:
    """Bytes of the union of source elements the blocks read (overlapping reads are read once)."""
    by_source: dict[str, list[rt.RemapBlock]] = {}
    for b in blocks:
        by_source.setdefault(b.source, []).append(b)
    total = 0
    for source, group in by_source.items():
        itemsize = checkpoint[source].itemsize
        if len(group) == 1:
            total += group[0].read_numel * itemsize
            continue
        # blocks whose spans overlap form a cluster, whose union is counted run by run
        spans = sorted(((b.source_span(), i) for i, b in enumerate(group)))
        numel = 0
        cluster: list[rt.RemapBlock] = []
        end = -1
        for (lo, hi), i in spans:
            if lo >= end:
                if len(cluster) == 1:
                    numel += cluster[0].read_numel
                elif cluster:
                    numel += _union_numel(cluster)
                cluster = []
            cluster.append(group[i])
            end = max(end, hi) if cluster[1:] else hi
        numel += cluster[0].read_numel if len(cluster) == 1 else _union_numel(cluster)
        total += numel * itemsize
    return total


def _union_numel(blocks: list[rt.RemapBlock]) -> int:
    runs = sorted(r for b in blocks for r in b.source_runs())
    total, cur_a, cur_b = 0, None, None
    for a, n in runs:
        if cur_b is None or a > cur_b:
            total += (cur_b - cur_a) if cur_b is not None else 0
            cur_a, cur_b = a, a + n
        else:
            cur_b = max(cur_b, a + n)
    return total + ((cur_b - cur_a) if cur_b is not None else 0)


def _shape_error(target: str, got: tuple[int, ...], want: tuple[int, ...], conv: Conversion) -> ValueError:
    return ValueError(
        f"shape mismatch for {target!r}: checkpoint {tuple(got)} vs target {tuple(want)} "
        f"(from {', '.join(conv.sources[:4])}{' …' if len(conv.sources) > 4 else ''} via {conv.description})"
    )


def deferred_inputs(
    conv: Conversion, tensors: Mapping[str, torch.Tensor], slots: Mapping[str, TargetSlot]
) -> dict[str, torch.Tensor]:
    """Source tensors for running a deferred conversion for real.

    transformers casts every source to the dtype of the group's first target before its ops run; for its
    rules we do the same, so non-index ops round exactly as ``from_pretrained``. Our ``Convert`` functions get
    the checkpoint dtype.
    """
    if not type(conv.rule).__module__.startswith("transformers"):
        return dict(tensors)
    dtype = slots[conv.targets[0]].dtype
    return {k: t.to(dtype) if t.is_floating_point() and dtype.is_floating_point else t for k, t in tensors.items()}


def meta_outputs(conv: Conversion, checkpoint: SafetensorsCheckpoint) -> dict[str, torch.Tensor]:
    """Run ``conv`` on meta tensors: the output shapes and dtypes of a deferred conversion, without data."""
    tensors = {k: torch.empty(checkpoint[k].shape, dtype=checkpoint[k].dtype, device="meta") for k in conv.sources}
    return conv.run(tensors)


def plan_rank(
    keyplan: KeyPlan,
    checkpoint: SafetensorsCheckpoint,
    slots: Mapping[str, TargetSlot],
    *,
    strict: bool = True,
    supports_symbolic: Callable[[Conversion], bool] = lambda conv: True,
    cache: TraceCache | None = None,
    check_devices: bool = True,
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

    Returns:
        The rank's plan. Nothing has been read or written.

    Raises:
        ValueError: a shape mismatch, an unknown target, a meta-device target, or (strict) missing tensors;
            the message names the tensor.
        CheckpointError: float8 codes would load as values (see :func:`check_float8`).
    """
    cache = cache or TraceCache()
    check_float8(keyplan, checkpoint, slots)
    # like from_pretrained, leave out what the model says to ignore (``_keys_to_ignore_on_load_*``, stale
    # ``rotary_emb.inv_freq`` / ``position_ids``): not reported, and not an error with ``strict``
    ignored_unexpected = set(keyplan.ignored_unexpected_keys)
    ignored_missing = set(keyplan.ignored_missing_keys)
    plan = RankPlan(
        unexpected_keys=[k for k in keyplan.unexpected_keys if k not in ignored_unexpected],
        conversions=list(keyplan.conversions),
    )
    loaded: set[str] = set()
    for conv in keyplan.conversions:
        for t in conv.targets:
            if t not in slots:
                raise ValueError(f"conversion {conv.description} produces {t!r}, which is not a model tensor")
        if supports_symbolic(conv):
            traced, sig = cache.trace(conv, checkpoint)
        else:
            traced, sig = "rejected by supports_symbolic", None
        if isinstance(traced, str):
            outs = meta_outputs(conv, checkpoint)
            for t in conv.targets:
                if t not in outs:
                    raise ValueError(f"conversion {conv.description} did not produce {t!r}")
                if tuple(outs[t].shape) != slots[t].shape:
                    raise _shape_error(t, tuple(outs[t].shape), slots[t].shape, conv)
                if (cast := kind_cast(t, outs[t].dtype, slots[t].dtype)) is not None:
                    plan.casts.append(cast)
            boxes = tuple((t, g, lb) for t in conv.targets for g, lb in slots[t].boxes if _nonempty(g))
            plan.deferred.append(DeferredRead(conv, traced, boxes))
            plan.deferred_targets.extend(conv.targets)
        else:
            for t in conv.targets:
                if t not in traced:
                    raise ValueError(f"conversion {conv.description} did not produce {t!r}")
                out = traced[t]
                if tuple(out.shape) != slots[t].shape:
                    raise _shape_error(t, tuple(out.shape), slots[t].shape, conv)
                if (cast := kind_cast(t, out.dtype, slots[t].dtype)) is not None:
                    plan.casts.append(cast)
                for g, lb in slots[t].boxes:
                    if not _nonempty(g):
                        continue
                    for block in cache.blocks(sig, conv.targets.index(t), out, g, conv.sources):
                        plan.reads.append(BlockRead(t, lb, block))
            plan.traced.extend(conv.targets)
        loaded.update(conv.targets)
    if check_devices:
        for name in sorted(loaded):
            local = slots[name].local
            if local is not None and local.device.type == "meta":
                raise ValueError(
                    f"model tensor {name!r} is on the meta device: materialize the model first "
                    "(e.g. model.to_empty(device='cpu'))"
                )
    aliases = {a for a, c in keyplan.tied.items() if c in loaded}
    plan.loaded_keys = sorted(loaded | aliases)
    plan.missing_keys = [
        k for k in keyplan.missing_keys if k not in loaded and k not in aliases and k not in ignored_missing
    ]
    if strict and plan.missing_keys:
        shown = ", ".join(plan.missing_keys[:8]) + (" …" if len(plan.missing_keys) > 8 else "")
        raise ValueError(
            f"{len(plan.missing_keys)} model tensor(s) are not in the checkpoint: {shown} "
            "(pass strict=False to load the rest)"
        )
    return plan


def _nonempty(box: Box) -> bool:
    return math.prod(b - a for a, b in box) > 0


def describe(plan: RankPlan, checkpoint: SafetensorsCheckpoint) -> str:
    """The one-line phase summary."""
    convs = {id(d.conversion) for d in plan.deferred}
    return (
        f"planned {len(set(plan.traced))} tensors as region reads, {len(set(plan.deferred_targets))} through "
        f"{len(convs)} deferred conversions, {plan.planned_bytes(checkpoint)} bytes"
    )
