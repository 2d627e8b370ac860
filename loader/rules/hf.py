"""The transformers side of :mod:`loader.rules`: default mappings, running ``WeightConverter`` chains,
tied weights, and recording conversions for ``save_pretrained``.

Importing this module does not import transformers; every function imports what it needs lazily, and
checks against transformers classes are skipped while transformers has not been imported (an object cannot
be a transformers model or transform before that).
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from copy import deepcopy
from typing import Any, NamedTuple

import torch

import regiontrace as rt

from .conversion import Conversion, Convert, MetaRun, Rename, meta_tensors, signature, source_feed, spec_of

AVAILABLE = importlib.util.find_spec("transformers") is not None


def _loaded(module: str):
    return sys.modules.get(module)


def is_pretrained_model(model: Any) -> bool:
    mod = _loaded("transformers.modeling_utils")
    return mod is not None and isinstance(model, mod.PreTrainedModel)


def rule_kind(obj: Any) -> str | None:
    """``"converter"`` for a ``WeightConverter``, ``"renaming"`` for a ``WeightRenaming`` (incl.
    subclasses such as ``PrefixChange``), else ``None`` (transformers ignores other objects in a mapping)."""
    core = _loaded("transformers.core_model_loading")
    if core is None:
        return None
    if isinstance(obj, core.WeightConverter):
        return "converter"
    if isinstance(obj, core.WeightRenaming):
        return "renaming"
    return None


def fresh_copy(transform: Any) -> Any:
    """A private copy with fresh matching state (``was_used``, ``GroupWeightRename`` activation)."""
    core = _loaded("transformers.core_model_loading")
    copy = deepcopy(transform)
    copy._was_used = False
    copy.collected_tensors = defaultdict(list)
    copy.layer_targets = defaultdict(set)
    if isinstance(copy, getattr(core, "GroupWeightRename", ())):
        copy._active = None
    return copy


def probe(transform: Any, key: str) -> tuple[str, str | None]:
    """``transform.rename_source_key(key)`` without recording a use."""
    used = transform._was_used
    try:
        return transform.rename_source_key(key)
    finally:
        transform._was_used = used


def default_mapping(model: Any, key_mapping: Mapping[str, str] | None) -> list:
    """The rules ``from_pretrained`` uses (``get_model_conversion_mapping(model, key_mapping, hf_quantizer)``,
    here without a quantizer)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    return get_model_conversion_mapping(model, dict(key_mapping) if key_mapping else None)


def key_mapping_rules(key_mapping: Mapping[str, str]) -> list:
    from transformers.core_model_loading import WeightRenaming

    return [WeightRenaming(source_patterns=k, target_patterns=v) for k, v in key_mapping.items()]


def tied_pairs(model: Any) -> dict[str, str]:
    """transformers' tied weights of ``model``: ``{tied name: source name}``."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def ignore_regexes(model: Any) -> tuple[re.Pattern | None, re.Pattern | None]:
    """The patterns ``PreTrainedModel._adjust_missing_and_unexpected_keys`` drops from the loading report."""
    buffers = [name for name, _ in model.named_buffers()]
    extra = {r"rotary_emb\.inv_freq"} if any(b.endswith("rotary_emb.inv_freq") for b in buffers) else set()
    if any(b.endswith("position_ids") for b in buffers):
        extra.add(r"(^|\.)position_ids$")
    missing = model._keys_to_ignore_on_load_missing or set()
    unexpected = (model._keys_to_ignore_on_load_unexpected or set()) | extra

    def compile_(patterns):
        return re.compile("|".join(rf"({p})" for p in patterns)) if patterns else None

    return compile_(missing), compile_(unexpected)


def convert_chain(template: Any, layer_name: str, groups, tensors: Mapping[str, Any], model: Any) -> dict[str, Any]:
    """Run a ``WeightConverter``'s operations on one group, exactly as ``WeightConverter.convert`` does (without a
    quantizer): tensors collected per source pattern in key order, each op given the layer name, the model and
    its config. Returns the outputs under the names the ops give them (target patterns, not yet full names)."""
    collected: dict[str, Any] = {pattern: [tensors[k] for k in keys] for pattern, keys in groups}
    config = getattr(model, "config", None)
    for op in deepcopy(template.operations):  # private ops, as transformers' per-layer copy of the converter
        collected = op.convert(
            collected,
            source_patterns=template.source_patterns,
            target_patterns=template.target_patterns,
            full_layer_name=layer_name,
            model=model,
            config=config,
            missing_keys=None,
        )
    return collected


def full_names(layer_name: str, keys: Sequence[str]) -> list[str]:
    """The model tensor names of a converter's outputs ``keys`` for the group ``layer_name``, as
    ``WeightConverter.convert`` names them: the prefix and suffix around the first key found in the layer name."""
    full_name = layer_name.replace("*.", "0.") if "*." in layer_name else layer_name
    for key in keys:
        if key in full_name:
            prefix, _, suffix = full_name.partition(key)
            return [prefix + k + suffix for k in keys]
    return list(keys)


def run_converter(template: Any, first_target: str, groups, tensors: Mapping[str, Any], model: Any) -> dict:
    """Run a ``WeightConverter`` on one group the way ``convert_and_load_state_dict_in_model`` does; returns
    ``{model tensor name: tensor}``."""
    out = convert_chain(template, first_target, groups, tensors, model)
    names = full_names(first_target, list(out))
    return {name: value[0] if isinstance(value, list) else value for name, value in zip(names, out.values())}


class GroupSources(NamedTuple):
    """The checkpoint sources of one group: their keys, shapes and dtypes (in the same order)."""

    keys: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]


def make_conversion(
    template: Any,
    first_target: str,
    groups: tuple[tuple[str, tuple[str, ...]], ...],
    group_sources: GroupSources,
    *,
    state: Mapping[str, Any],
    model: Any,
    runs: dict[tuple, tuple[list[str] | None, MetaRun]],
) -> Conversion:
    """The conversion of one group by a transformers ``WeightConverter``.

    Its target names come from running the chain (ops such as ``Chunk(num_shards_attribute=...)`` or
    ``SplitModulelist`` decide them), on meta tensors of the sources' ``shapes`` and ``dtypes``, once per
    signature (``runs`` caches them): layers of one structure share the run, and only the names are rebuilt
    for each group. The signature holds, besides the rule and the sources, what the ops may read of the layer:
    the layer name with its numbers blanked, and the shapes of the model tensors its target patterns name
    (``Split``, ``Transpose(check_dims=True)``).
    """
    sources, shapes, dtypes = group_sources
    tp = template.target_patterns
    context = (
        _NUMBERS.sub("#", first_target),
        tuple(_shape(state.get(first_target.replace(tp[0], t))) for t in tp),
    )
    sig = signature(template, source_feed(groups, sources), shapes, dtypes, context)
    entry = runs.get(sig)
    if entry is None:
        entry = runs[sig] = _meta_chain(template, first_target, groups, sources, shapes, dtypes, model)
    keys, meta = entry
    if keys is not None:
        targets = tuple(full_names(first_target, keys))
    else:  # the run failed (planning raises it): the names transformers reports for unexpected keys
        prefix, _, suffix = first_target.partition(tp[0])
        targets = tuple(prefix + t + suffix for t in tp)

    def runner(tensors: Mapping[str, Any]) -> dict[str, Any]:
        return run_converter(template, first_target, groups, tensors, model)

    description = " -> ".join(repr(op) for op in template.operations)
    return Conversion(targets, sources, description, False, groups, template, meta, sig, runner)


_NUMBERS = re.compile(r"\d+")


def _shape(tensor: Any) -> tuple[int, ...] | None:
    return None if tensor is None else tuple(tensor.shape)


def _meta_chain(template, first_target, groups, sources, shapes, dtypes, model) -> tuple[list[str] | None, MetaRun]:
    """The chain on meta tensors: its output keys (target patterns) and the :class:`MetaRun`."""
    tensors = meta_tensors(sources, shapes, dtypes)
    try:
        out = rt.run_on_meta(convert_chain, template, first_target, groups, tensors, model)
        outputs = tuple(spec_of(v[0] if isinstance(v, list) else v) for v in out.values())
    except Exception as e:
        return None, MetaRun(shapes, dtypes, None, e)
    return list(out), MetaRun(shapes, dtypes, outputs)


def record_on_model(model: Any, used_rules: list) -> None:
    """Set ``model._weight_conversions`` like ``convert_and_load_state_dict_in_model`` does (the used
    transforms, in mapping order), which ``save_pretrained`` reverts. Our ``Rename`` becomes a
    ``WeightRenaming``; a ``Convert`` cannot be reversed and is left out."""
    if not is_pretrained_model(model):
        return
    from transformers.core_model_loading import WeightRenaming

    recorded = []
    for rule in used_rules:
        if isinstance(rule, Convert):
            continue
        if isinstance(rule, Rename):
            rule = WeightRenaming(source_patterns=rule.source_pattern, target_patterns=rule.target_pattern)
        else:
            rule = deepcopy(rule)
        rule._was_used = True
        recorded.append(rule)
    model._weight_conversions = recorded
