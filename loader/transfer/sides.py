"""The two sides of a transfer as plain values: what a rank holds, the source's save mapping, the destination's
load conversions, ready to compose (:mod:`loader.transfer.plan`).

Both sides are traced conversions (:class:`loader.plan.TracedConversion`), from one
:class:`~loader.plan.TraceCache` when given: the source's inverted and checked to be a bijection, as for a save
(:func:`loader.save.sources.map_for_save`), the destination's as for a load. Both are on canonical leaves
(``#0, #1, …``), shared by every layer of one structure; the plan names them after the checkpoint keys
(:func:`~loader.transfer.plan.named`) only for the first layer of each structure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..fallbacks import MOVED_WHOLE, log_fallbacks
from ..options import Rules
from ..placements import slot_for
from ..plan import StandInCheckpoint, TraceCache, TracedConversion, Untraced
from ..plan.dtypes import kind_cast
from ..plan.slots import iter_model_tensors
from ..rules import KeyPlan, plan_keys
from ..rules.conversion import source_cast
from ..save.sources import map_for_save
from .plan import DestConversion, DestSide, Slots, SourceConversion, SourceSide

#: checkpoint key -> (shape, dtype)
Keys = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def as_rules(mapping: Rules | Sequence[Any] | None) -> Rules:
    """A ``src_mapping``/``dst_mapping`` argument as :class:`~loader.options.Rules`: None is the defaults, a
    list of rules replaces the default ones (``weights_mapping=``), a ``Rules`` is used as it is."""
    if mapping is None:
        return Rules()
    if isinstance(mapping, Rules):
        return mapping
    return Rules(weights_mapping=list(mapping))


def parts_of(model: torch.nn.Module | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """What this rank holds of ``model``: its :data:`~loader.transfer.plan.Slots` and the local tensors
    (DTensor local shards, or whole tensors), by name. None: nothing."""
    if model is None:
        return {}, {}
    parts, local = {}, {}
    for name, tensor in iter_model_tensors(model):
        slot = slot_for(name, tensor)
        parts[name] = (slot.shape, slot.dtype, slot.boxes)
        local[name] = slot.local
    return parts, local


def source_side(
    model: torch.nn.Module, rules: Rules | None = None, *, source_shapes: Any = None, cache: TraceCache | None = None
) -> SourceSide:
    """The source's checkpoint layout and its conversions, each checked to be a bijection (as for a save).

    Args:
        source_shapes: the checkpoint keys with their shapes (or ``(shape, dtype)``), or a checkpoint: needed when
            a ``Convert`` rule maps the source (as for ``save_hf_checkpoint``).
        cache: the traces by signature (shared with the destination side); None: a new one.

    Raises:
        ValueError: a conversion is not invertible (computes values, drops or repeats elements), or the layout
            cannot be derived; the message names the conversion (:func:`~loader.save.sources.map_for_save`).
    """
    mapping = map_for_save(model, rules, source_shapes=source_shapes, cache=cache)
    keys = {s.key: (tuple(s.shape), s.dtype) for s in mapping.specs}
    conversions = []
    for saved in mapping.conversions:
        outputs = {t: saved.inverse.outputs[str(i)] for i, t in enumerate(saved.targets)}
        conversions.append(SourceConversion(tuple(saved.sources), outputs, ("save", saved.signature)))
    return SourceSide(keys, tuple(conversions))


def dest_side(
    model: torch.nn.Module, rules: Rules | None, keys: Keys, cache: TraceCache | None = None
) -> tuple[DestSide, KeyPlan]:
    """The destination's load from a checkpoint of layout ``keys``: its conversions traced (and its key plan,
    whose conversions run the fallbacks).

    Args:
        cache: the traces by signature (shared with the source side); None: a new one.

    Raises:
        ValueError: a destination tensor no key loads (the source lacks it), a shape mismatch, or a dtype of
            another kind (float into int); the message names the tensor.
        Exception: what a conversion raised on meta tensors.
    """
    rules = rules or Rules()
    keyplan = plan_keys(
        model,
        {k: s for k, (s, _) in keys.items()},
        checkpoint_dtypes={k: d for k, (_, d) in keys.items()},
        weights_mapping=rules.weights_mapping,
        extra_weights_mapping=rules.extra_weights_mapping,
        key_mapping=rules.key_mapping,
    )
    state = dict(iter_model_tensors(model))
    loaded = {t for c in keyplan.conversions for t in c.targets}
    skip = set(keyplan.ignored_missing_keys) | {a for a, c in keyplan.tied.items() if c in loaded}
    missing = [k for k in keyplan.missing_keys if k not in loaded and k not in skip]
    if missing:
        raise ValueError(
            f"{len(missing)} destination tensor(s) have no checkpoint key in the source's layout: {missing[:8]} "
            "(the source lacks the keys they load from, or the mappings differ)" + keyplan.unmatched_note(keys)
        )
    cache, stand_in = cache if cache is not None else TraceCache(), StandInCheckpoint(keys)
    conversions, untraced = [], []
    for conv in keyplan.conversions:
        meta = cache.meta(conv, stand_in)
        if meta.error is not None:
            raise meta.error
        for t, out in zip(conv.targets, meta.outputs or ()):
            want = state[t]
            if out is None or tuple(out[0]) != tuple(want.shape):
                raise ValueError(
                    f"shape mismatch for destination tensor {t!r}: the source's keys {list(conv.sources)[:4]} give "
                    f"{None if out is None else tuple(out[0])}, the destination holds {tuple(want.shape)}"
                )
            if kind_cast(t, out[1], want.dtype) is not None:
                raise ValueError(
                    f"dtype mismatch for destination tensor {t!r}: the source's keys give {out[1]}, the destination "
                    f"holds {want.dtype}"
                )
        cast = source_cast(conv.rule, state[conv.targets[0]].dtype)
        outcome = cache.trace(conv, stand_in, cast)
        if isinstance(outcome, TracedConversion) and outcome.constants:  # no source key holds those elements
            reason = f"Untraceable: {outcome.constants} writes constant elements, which a transfer does not route"
            outcome = Untraced(reason, untraceable=True)
        if isinstance(outcome, TracedConversion):
            outputs = dict(outcome.outputs)
            targets = tuple(conv.targets)
            conversions.append(DestConversion(tuple(conv.sources), targets, outputs, signature=("load", outcome.key)))
        else:
            conversions.append(DestConversion(tuple(conv.sources), tuple(conv.targets), None, outcome.reason))
            untraced.append((conv, outcome.reason))
    log_fallbacks(untraced, MOVED_WHOLE)  # on each destination rank: each receives those keys whole
    return DestSide(tuple(conversions)), keyplan


def model_parts(model: torch.nn.Module) -> Slots:
    """This rank's parts of ``model`` (for a plan made in one process: :func:`parts_of` without the tensors)."""
    return parts_of(model)[0]
