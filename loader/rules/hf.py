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
from collections.abc import Mapping
from copy import deepcopy
from typing import Any

import torch

from .conversion import Conversion, Convert, Rename

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


def run_converter(template: Any, first_target: str, groups, tensors: Mapping[str, Any], model: Any) -> dict:
    """Run a ``WeightConverter`` the way ``convert_and_load_state_dict_in_model`` does: one fresh
    converter per group, tensors collected per source pattern in key order, then
    ``convert(first target name, model=model, config=model.config)``. Tensors are handed over as callables
    so that transformers never inspects them (``materialize_tensors`` would call a callable tensor-like and
    wait on a Future)."""
    converter = deepcopy(template)
    for pattern, keys in groups:
        for key in keys:
            value = tensors[key]
            converter.add_tensor(first_target, key, pattern, lambda value=value: value)
    out = converter.convert(first_target, model=model, config=getattr(model, "config", None))
    return {name: value[0] if isinstance(value, list) else value for name, value in out.items()}


def make_conversion(template, first_target: str, groups, sources, shapes, state, model) -> Conversion:
    description = " -> ".join(repr(op) for op in template.operations)
    # Target names (and shapes) come from running the chain on meta tensors: ops such as
    # Chunk(num_shards_attribute=...) or SplitModulelist decide the names themselves.
    dtype = state[first_target].dtype
    try:
        meta = {k: torch.empty(shapes[k], dtype=dtype, device="meta") for k in sources}
        out = run_converter(template, first_target, groups, meta, model)
        targets = tuple(out)
        target_shapes = tuple(tuple(v.shape) for v in out.values())
    except Exception:  # noqa: BLE001 - fall back to the names transformers reports for unexpected keys
        prefix, _, suffix = first_target.partition(template.target_patterns[0])
        targets = tuple(prefix + t + suffix for t in template.target_patterns)
        target_shapes = None

    def runner(tensors: Mapping[str, Any]) -> dict[str, Any]:
        return run_converter(template, first_target, groups, tensors, model)

    return Conversion(targets, sources, description, False, groups, target_shapes, template, runner)


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
