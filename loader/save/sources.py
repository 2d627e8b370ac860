"""Which checkpoint tensors a model saves to, and the traced inverse of every conversion.

The original layout (checkpoint keys, shapes, dtypes, in ``save_pretrained``'s order) is found without any
checkpoint: for a transformers ``PreTrainedModel`` by transformers' own ``revert_weight_conversion`` run on meta
stand-ins of the state dict ``save_pretrained`` saves (tied aliases and ``_keys_to_ignore_on_save`` removed);
for renames, by reversing them; from ``source_shapes`` when the caller gives them (a ``Convert`` cannot be
reversed by name). Then the loader's own key plan (``plan_keys``, the rules ``load_hf_checkpoint`` uses) runs
forwards on those keys, each conversion is traced on ``RegionTensor`` leaves and inverted
(:func:`regiontrace.invert`): the model tensors' values are scattered back through the very mapping a load
would read them with, checked to be a bijection. The trace is the load's own
(:class:`~loader.plan.TracedConversion`, from a :class:`~loader.plan.TraceCache` a load may share).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

import regiontrace as rt

from .._torch import storage_key
from ..options import Rules
from ..plan.traces import StandInCheckpoint, TraceCache, TracedConversion, Untraced
from ..rules import Conversion, Convert, Rename, dot_natural_key, plan_keys
from ..rules import hf as hf_rules
from .filelayout import TensorSpec
from .recorded import rules_to_reverse

SourceShapes = Mapping[str, Sequence[int] | tuple[Sequence[int], torch.dtype]]


@dataclass(frozen=True)
class SavedConversion:
    """One conversion, inverted: model tensors ``targets`` scatter back into checkpoint tensors ``sources``.

    Attributes:
        conversion: the forward conversion (``plan_keys``).
        inverse: the checked inverse, on canonical leaves ``#0, #1, …`` and outputs ``"0", "1", …`` (one
            trace serves every layer of the same structure).
        sources: the checkpoint keys standing for ``#0, #1, …``.
        signature: the trace's signature key in its :class:`~loader.plan.TraceCache`.
        traced: the forward trace (shared by every conversion of the signature, with its compiled blocks).
    """

    conversion: Conversion
    inverse: rt.Inverse
    sources: tuple[str, ...]
    signature: int
    traced: TracedConversion

    @property
    def targets(self) -> tuple[str, ...]:
        return self.conversion.targets


@dataclass
class SaveMapping:
    """Everything a save needs to know about the model, computed identically on every rank.

    Attributes:
        specs: the checkpoint tensors, in ``save_pretrained``'s order.
        conversions: every conversion with its inverse.
        tensors: the model tensors to save, by name (one name per tied group).
        derived_by: how the checkpoint keys were found (``"revert_weight_conversion"``, ``"renames"``,
            ``"source_shapes"``).
    """

    specs: list[TensorSpec]
    conversions: list[SavedConversion]
    tensors: dict[str, torch.Tensor]
    derived_by: str

    def blocks(self, saved: SavedConversion, target: str, box: tuple) -> tuple[rt.RemapBlock, ...]:
        """The blocks of ``box`` (global) of model tensor ``target``, run backwards, named by checkpoint key
        (compiled once per signature)."""
        return saved.traced.inverse_blocks(saved.targets.index(target), box, saved.sources)


def map_for_save(
    model: torch.nn.Module,
    rules: Rules | None = None,
    *,
    source_shapes: SourceShapes | None = None,
    cache: TraceCache | None = None,
) -> SaveMapping:
    """Find the checkpoint layout of ``model`` and invert every conversion into it.

    Args:
        model: the model (plain or DTensor tensors; only shapes and dtypes are read here).
        rules: the :class:`~loader.options.Rules`, as for ``load_hf_checkpoint`` (None: the defaults); for a model
            a load recorded its rules on, only those of them the load applied (none given: all it applied).
        source_shapes: the checkpoint keys to save, with their shapes (or ``(shape, dtype)``; without a dtype, the
            dtype of the model tensors they convert to), or a checkpoint (a path or a
            :class:`~loader.checkpoint.Checkpoint`) whose keys, shapes and dtypes to use. Needed when a ``Convert``
            rule is used.
        cache: the traces by signature to use (e.g. a load's, or a transfer's other side); None: a new one.

    Raises:
        ValueError: the checkpoint keys cannot be derived (a ``Convert`` without ``source_shapes``), the rules do
            not map them back onto exactly the model's tensors, or a conversion is not invertible (computes
            values, drops or repeats elements); the message names the conversion.
    """
    if getattr(model, "hf_quantizer", None) is not None or getattr(model, "_hf_peft_config_loaded", False):
        raise ValueError("cannot save a quantized model or PEFT adapters: use save_pretrained")
    state = model.state_dict(keep_vars=True)
    meta = _saved_state(model, state)
    given = rules if rules is not None else Rules()
    rules: dict[str, Any] = {  # plan_keys' keyword arguments
        "weights_mapping": given.weights_mapping,
        "extra_weights_mapping": given.extra_weights_mapping,
        "key_mapping": given.key_mapping,
    }
    custom = given.given
    recorded = rules_to_reverse(model, given.weights_mapping, given.extra_weights_mapping, given.key_mapping)
    if recorded is not None:  # a load recorded the rules it applied: reverse exactly those
        rules, custom = recorded, True
    if source_shapes is not None:
        originals, derived_by = _from_source_shapes(source_shapes), "source_shapes"
    elif hf_rules.is_pretrained_model(model):
        originals, derived_by = _reverted(model, meta, rules if custom else None), "revert_weight_conversion"
    else:
        originals, derived_by = _reversed_renames(meta, rules), "renames"
    keyplan = plan_keys(model, {k: shape for k, (shape, _, _) in originals.items()}, **rules)
    _check_coverage(keyplan, meta, originals, derived_by)
    dtypes = _source_dtypes(keyplan.conversions, originals, state)
    specs = [
        TensorSpec(key, tuple(shape), dtypes[key], storage, nbytes)
        for key, (shape, _, (storage, nbytes)) in originals.items()
    ]
    stand_in = StandInCheckpoint({key: (tuple(shape), dtypes[key]) for key, (shape, _, _) in originals.items()})
    cache = cache if cache is not None else TraceCache()
    conversions = [_invert(conv, stand_in, state, cache) for conv in keyplan.conversions]
    tensors = {t: state[t] for c in keyplan.conversions for t in c.targets}
    return SaveMapping(specs, conversions, tensors, derived_by)


# ---------------------------------------------------------------------------------------------------
# the state dict save_pretrained saves


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")


def _saved_state(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Meta stand-ins of what ``save_pretrained`` saves: one name per tied group, ignored keys left out."""
    if hf_rules.is_pretrained_model(model):
        from transformers.modeling_utils import remove_tied_weights_from_state_dict

        ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
        meta = {name: _meta_like(t) for name, t in state.items() if name not in ignored}
        # meta tensors are grouped by the identity of the model's tensor: transformers' own rule for ties
        return remove_tied_weights_from_state_dict(meta, model)
    seen: set[int] = set()
    meta = {}
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            meta[name] = _meta_like(t)
    return meta


# ---------------------------------------------------------------------------------------------------
# the original layout: ``{key: (shape, dtype or None, (storage id, storage bytes))}``


def _storage(t: torch.Tensor) -> tuple[Any, int]:
    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    return (("empty",) if nbytes == 0 else storage_key(storage)), nbytes


def _from_source_shapes(source_shapes: SourceShapes | str | os.PathLike) -> dict[str, tuple]:
    from ..checkpoint import Checkpoint, SafetensorsCheckpoint

    if isinstance(source_shapes, (str, os.PathLike)):
        source_shapes = SafetensorsCheckpoint.open(os.fspath(source_shapes))
    if isinstance(source_shapes, Checkpoint):
        ckpt = source_shapes
        source_shapes = {k: (ckpt[k].shape, ckpt[k].dtype) for k in ckpt.keys()}
    out = {}
    for key in sorted(source_shapes, key=dot_natural_key):
        value = source_shapes[key]
        if len(value) == 2 and isinstance(value[1], torch.dtype):
            shape, dtype = tuple(int(n) for n in value[0]), value[1]
        else:
            shape, dtype = tuple(int(n) for n in value), None
        out[key] = (shape, dtype, (None, None))
    return out


def _reverted(model: Any, meta: dict[str, torch.Tensor], rules: dict | None) -> dict[str, tuple]:
    """``revert_weight_conversion`` on meta stand-ins: exactly the keys, order and storages ``save_pretrained``
    writes (with custom rules: those rules, reversed by transformers)."""
    from transformers.core_model_loading import revert_weight_conversion

    had = "_weight_conversions" in vars(model)
    before = vars(model).get("_weight_conversions")
    try:
        if rules is not None:
            model._weight_conversions = _transformers_rules(model, **rules)
        reverted = revert_weight_conversion(model, dict(meta))
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(
            f"could not derive the checkpoint layout with transformers' revert_weight_conversion "
            f"({type(e).__name__}: {e}); pass source_shapes= (checkpoint key -> shape)"
        ) from e
    finally:
        if rules is not None:
            if had:
                model._weight_conversions = before
            else:
                del model._weight_conversions
    return {k: (tuple(t.shape), t.dtype, _storage(t)) for k, t in reverted.items()}


def _transformers_rules(model: Any, weights_mapping, extra_weights_mapping, key_mapping) -> list:
    """The rules a load uses, as transformers transforms, for ``revert_weight_conversion`` to reverse."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightRenaming

    if weights_mapping is None:
        base = getattr(model, "_weight_conversions", None)
        if base is None:
            base = [r for r in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(r, PrefixChange)]
    else:
        base = list(weights_mapping)
    rules = [*extra_weights_mapping, *hf_rules.key_mapping_rules(key_mapping or {}), *base]
    out = []
    for rule in rules:
        if isinstance(rule, Convert):
            raise ValueError(_needs_shapes(rule))
        if isinstance(rule, Rename):
            rule = WeightRenaming(source_patterns=rule.source_pattern, target_patterns=rule.target_pattern)
        out.append(rule)
    return out


def _reversed_renames(meta: dict[str, torch.Tensor], rules: dict) -> dict[str, tuple]:
    """A plain module's checkpoint keys: its tensor names through the renames, reversed (last rule first)."""
    chain = [*rules["extra_weights_mapping"], *[Rename(k, v) for k, v in (rules["key_mapping"] or {}).items()]]
    chain += list(rules["weights_mapping"] or ())
    reverse = []
    for rule in chain:
        if isinstance(rule, Rename):
            reverse.append(Rename(rule.target_pattern, rule.source_pattern).rename)
        elif hf_rules.rule_kind(rule) == "renaming":
            undo = rule.reverse_transform()
            reverse.append(lambda key, undo=undo: undo.rename_source_key(key)[0])
        else:
            raise ValueError(_needs_shapes(rule))
    out = {}
    for name, t in meta.items():
        key = name
        try:
            for undo in reversed(reverse):
                key = undo(key)
        except (re.error, IndexError) as e:
            raise ValueError(f"could not reverse the renames for {name!r} ({e}); pass source_shapes=") from e
        if key in out:
            raise ValueError(f"model tensors {out[key][3]!r} and {name!r} both reverse to checkpoint key {key!r}")
        out[key] = (tuple(t.shape), t.dtype, (None, None), name)
    return {k: v[:3] for k, v in sorted(out.items(), key=lambda kv: dot_natural_key(kv[0]))}


def _needs_shapes(rule: Any) -> str:
    return (
        f"cannot derive the checkpoint keys {rule!r} reads from the model alone: pass source_shapes= (checkpoint "
        "key -> shape, e.g. from the checkpoint the model was loaded from)"
    )


# ---------------------------------------------------------------------------------------------------
# checks and inversion


def _check_coverage(keyplan: Any, meta: Mapping[str, torch.Tensor], originals: Mapping, derived_by: str) -> None:
    """Every checkpoint key is written by exactly one conversion, and every saved model tensor comes from one."""
    hint = "" if derived_by == "source_shapes" else "; pass source_shapes= to name the checkpoint keys"
    consumed = {k for c in keyplan.conversions for k in c.sources}
    unused = [k for k in originals if k not in consumed]
    if unused:
        tied = " (or load a tied alias whose tensor another key already loads)" if keyplan.tied_duplicates else ""
        raise ValueError(
            f"checkpoint keys {unused[:5]} (found by {derived_by}) map to no saved model tensor under the rules"
            f"{tied}{hint}"
        )
    produced = {t for c in keyplan.conversions for t in c.targets}
    canonical = {n: keyplan.tied.get(n, n) for n in meta}
    missing = [n for n in meta if n not in produced and canonical[n] not in produced]
    if missing:
        raise ValueError(f"no checkpoint key maps to model tensors {missing[:5]} under the rules{hint}")


def _source_dtypes(conversions: list[Conversion], originals: dict, state: Mapping) -> dict[str, torch.dtype]:
    dtypes = {}
    for conv in conversions:
        target_dtypes = {state[t].dtype for t in conv.targets}
        for key in conv.sources:
            dtype = originals[key][1]
            if dtype is None:
                if len(target_dtypes) != 1:
                    raise ValueError(
                        f"checkpoint key {key!r} feeds model tensors of several dtypes "
                        f"{sorted(map(str, target_dtypes))}: give its dtype in source_shapes as (shape, dtype)"
                    )
                dtype = next(iter(target_dtypes))
            dtypes[key] = dtype
    return dtypes


def _invert(conv: Conversion, stand_in: StandInCheckpoint, state: Mapping, cache: TraceCache) -> SavedConversion:
    """``conv``'s trace (the load's, by signature) and its inverse, checked against the model's shapes."""
    traced = cache.trace(conv, stand_in)
    if isinstance(traced, Untraced):
        if traced.untraceable:
            raise ValueError(
                f"cannot save {_what(conv)}: it is not a pure index mapping ({traced.reason}), so it has no "
                "traced inverse"
            )
        raise ValueError(f"cannot save {_what(conv)}: {re.sub('^conversion returned', 'it returned', traced.reason)}")
    if traced.constants:  # padding holds no checkpoint element: nothing to save it into, nor to save it from
        raise ValueError(
            f"cannot save {_what(conv)}: {traced.constants} writes constant elements (padding) into the model "
            "tensor, which hold no checkpoint element, so it has no traced inverse"
        )
    try:
        inverse = traced.invert()
    except rt.NotInvertible as e:
        names = {f"#{i}": k for i, k in enumerate(conv.sources)}
        message = re.sub(r"'(#\d+)'", lambda m: repr(names[m.group(1)]), str(e))
        message = re.sub(r"output '(\d+)'", lambda m: f"model tensor {conv.targets[int(m.group(1))]!r}", message)
        raise ValueError(f"cannot save {_what(conv)}: the conversion is not a bijection ({e.reason}): {message}") from e
    for i, t in enumerate(conv.targets):
        out, model = inverse.outputs[str(i)], state[t]
        if tuple(out.shape) != tuple(model.shape):
            raise ValueError(
                f"{_what(conv)} gives {t!r} the shape {tuple(out.shape)}, the model tensor has {tuple(model.shape)}"
            )
    return SavedConversion(conv, inverse, conv.sources, traced.key, traced)


def _what(conv: Conversion) -> str:
    return f"model tensors {list(conv.targets)} (from checkpoint keys {list(conv.sources)[:4]}, {conv.description})"
