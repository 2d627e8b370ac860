"""Which checkpoint keys feed which model tensors, through which conversion.

``plan_keys`` reproduces the key handling of transformers' ``from_pretrained`` (5.x,
``core_model_loading.convert_and_load_state_dict_in_model``):

* checkpoint keys are visited in ``dot_natural_key`` order;
* every renaming rule is applied in turn (they chain), then at most one converter rule (the first that
  matches);
* the model's ``base_model_prefix`` is added or stripped when that makes the key a model tensor name
  (a ``ForCausalLM`` model from base-model keys and the reverse), and a key that already is a model tensor
  name but was renamed away from it is kept as it is; in a checkpoint holding prefixed keys a plain key naming
  a model tensor stays there (a head's ``linear.*`` beside its base's ``base.linear.*``: ``from_pretrained``
  exchanges the two, a warning says so); where two plain keys then reach one model tensor, one of
  them through the prefix (a head checkpoint's ``base.linear.*`` and ``linear.*`` into the base model), the
  first visited loads and the other is unexpected;
* converter matches are grouped by their (first) target tensor name, one converter instance per group.

The visiting and grouping live in :mod:`.grouping`, tied weights in :mod:`.tied`, the result in :mod:`.keyplan`.

Rules are our :class:`Rename` / :class:`Convert`, or transformers ``WeightRenaming`` / ``WeightConverter``
objects (including ``PrefixChange`` and scoped sub-model transforms), used as they are. transformers is
optional: this module imports without it, transformers-specific code lives in :mod:`loader.rules.hf`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from . import hf
from .conversion import (
    Conversion,
    Convert,
    MetaRun,
    Patterns,
    Rename,
    run_on_meta,
    signature,
    source_feed,
)
from .grouping import KeyGroup, base_prefix, duplicate_error, group_keys, visit_order
from .keyplan import KeyPlan
from .matching import Rule, hf_adapters
from .tied import resolve_tied


def rules_in_order(
    model: torch.nn.Module,
    weights_mapping: Sequence[Any] | None = None,
    extra_weights_mapping: Sequence[Any] = (),
    key_mapping: Mapping[str, str] | None = None,
) -> list:
    """Every rule :func:`plan_keys` tries for these arguments, in precedence order."""
    adapters = hf_adapters()
    is_pretrained = adapters is not None and adapters.is_pretrained_model(model)
    return [*extra_weights_mapping, *_default_rules(model, adapters, is_pretrained, weights_mapping, key_mapping)]


def _default_rules(model, hf, is_pretrained, weights_mapping, key_mapping) -> list:
    if weights_mapping is None and is_pretrained:
        return list(hf.default_mapping(model, key_mapping))  # key_mapping renamings come first
    rules: list = []
    if key_mapping:
        rules += hf.key_mapping_rules(key_mapping) if is_pretrained else [Rename(k, v) for k, v in key_mapping.items()]
    if weights_mapping is not None:
        rules += list(weights_mapping)
    return rules


def plan_keys(
    model: torch.nn.Module,
    checkpoint_shapes: Mapping[str, Sequence[int]],
    *,
    checkpoint_dtypes: Mapping[str, torch.dtype] | None = None,
    weights_mapping: Sequence[Any] | None = None,
    extra_weights_mapping: Sequence[Any] = (),
    key_mapping: Mapping[str, str] | None = None,
    map_checkpoint_key: Callable[[str], str | None] | None = None,
    select_converter: Callable[..., Any] | None = None,
) -> KeyPlan:
    """Decide which checkpoint keys load which model tensors, exactly like transformers' ``from_pretrained``.

    Each conversion is also run once on meta tensors per signature (:attr:`Conversion.meta`): layers of one
    structure share the run, which the plan's trace reuses.

    Args:
        model: the module to load into (its ``state_dict(keep_vars=True)`` names are the model tensors).
        checkpoint_shapes: checkpoint key -> shape.
        checkpoint_dtypes: checkpoint key -> dtype, for the meta runs (default: each conversion's sources take
            the dtype of the model tensor it loads).
        weights_mapping: rules replacing the default ones. Default: for a transformers
            ``PreTrainedModel``, ``get_model_conversion_mapping(model, key_mapping)`` (model and scoped
            sub-model conversions, then the legacy renames); no rules for any other module.
        extra_weights_mapping: rules applied before all others.
        key_mapping: ``{regex: replacement}`` renamings, like ``from_pretrained(key_mapping=...)``; they come
            after ``extra_weights_mapping`` and before the other rules.
        map_checkpoint_key: applied to every checkpoint key first; ``None`` skips the key (it is listed in
            ``skipped_keys`` only). Rules see the mapped key; conversions name the original key.
        select_converter: called as ``select_converter(source_pattern, target, candidates, source_key=key)``
            when, after the renamings, ``key`` matches several converter rules (``candidates``, in precedence
            order): ``source_pattern`` is the source pattern of the first candidate that matched the key,
            ``target`` what that candidate renames it to, ``source_key`` the checkpoint key as stored (before
            ``map_checkpoint_key`` and the renamings); it is passed only to callables that accept it (a
            3-argument callable still works). Return one of the candidates, or ``None`` for no conversion.
            Without it the first candidate wins (transformers' behaviour).

    Returns:
        The :class:`KeyPlan`.

    Raises:
        ValueError: two checkpoint keys feed one model tensor, a conversion produces a name that is not a
            model tensor, or a ``Convert`` group lacks one of its source patterns.
    """
    adapters = hf_adapters()
    is_pretrained = adapters is not None and adapters.is_pretrained_model(model)
    rules = [Rule(r) for r in rules_in_order(model, weights_mapping, extra_weights_mapping, key_mapping)]
    state = model.state_dict(keep_vars=True)
    mapped, keys, skipped = visit_order(checkpoint_shapes, map_checkpoint_key)
    groups, unexpected = group_keys(mapped, keys, rules, state, base_prefix(model, is_pretrained), select_converter)
    specs = _Specs(checkpoint_shapes, checkpoint_dtypes, state)
    runs: dict[tuple, Any] = {}
    conversions = [_make_conversion(g, specs, state, model, runs) for g in groups.values()]

    produced: dict[str, Conversion] = {}
    for conv in conversions:
        for target in conv.targets:
            if target not in state:
                raise ValueError(
                    f"{conv.description} of checkpoint keys {list(conv.sources)} produces {target!r}, "
                    "which is not a tensor of the model"
                )
            if target in produced:
                raise duplicate_error(produced[target].sources[0], conv.sources[0], target)
            produced[target] = conv

    tied, duplicates = resolve_tied(state, produced, adapters.tied_pairs(model) if is_pretrained else {})
    if duplicates:
        conversions = [c for c in conversions if all(c is not d for d in duplicates)]
        for dup in duplicates:
            del produced[dup.targets[0]]
    missing = [n for n in state if n not in produced and not (n in tied and tied[n] in produced)]

    ignored_missing: list[str] = []
    ignored_unexpected: list[str] = []
    if is_pretrained:
        missing_re, unexpected_re = adapters.ignore_regexes(model)
        if missing_re is not None:
            ignored_missing = [n for n in missing if missing_re.search(n)]
        if unexpected_re is not None:
            ignored_unexpected = [k for k, renamed in unexpected if unexpected_re.search(renamed)]

    return KeyPlan(
        conversions=conversions,
        unexpected_keys=[k for k, _ in unexpected],
        missing_keys=missing,
        tied=tied,
        skipped_keys=skipped,
        tied_duplicates=duplicates,
        ignored_missing_keys=ignored_missing,
        ignored_unexpected_keys=ignored_unexpected,
        used_rules=[r.impl if r.hf else r.orig for r in rules if r.used],
        custom_rules=weights_mapping is not None or bool(extra_weights_mapping) or bool(key_mapping),
        unmatched_rules=_unmatched(rules, [*extra_weights_mapping, *(weights_mapping or ())]),
    )


def _unmatched(rules: Sequence[Rule], given: Sequence[Any]) -> list[Any]:
    """The given rules (of ``given``) that matched no checkpoint key, in precedence order."""
    ids = {id(g) for g in given}
    return [r.orig for r in rules if id(r.orig) in ids and not r.used]


class _Specs:
    """Shapes and dtypes of checkpoint keys for the meta runs: the checkpoint's dtypes, or else the dtype of the
    model tensor the conversion loads."""

    def __init__(self, shapes: Mapping[str, Sequence[int]], dtypes: Mapping[str, torch.dtype] | None, state) -> None:
        self.shapes, self.dtypes, self.state = shapes, dtypes, state

    def __call__(self, keys: Sequence[str], target: str) -> tuple[tuple[tuple[int, ...], ...], tuple[torch.dtype, ...]]:
        shapes = tuple(s if type(s) is tuple else tuple(int(d) for d in s) for s in map(self.shapes.__getitem__, keys))
        if self.dtypes is None:
            return shapes, (self.state[target].dtype,) * len(keys)
        return shapes, tuple(map(self.dtypes.__getitem__, keys))


def _make_conversion(group: KeyGroup, specs: _Specs, state, model, runs: dict) -> Conversion:
    sources = tuple(group.keys)
    shapes, dtypes = specs(sources, group.name)
    rule = group.rule
    if rule is None:
        (key,) = sources
        shared = runs.get(("rename", shapes, dtypes))  # one signature and meta run per shape and dtype, not per key
        if shared is None:
            sig = signature("rename", (), shapes, dtypes)
            shared = runs[("rename", shapes, dtypes)] = (sig, MetaRun(shapes, dtypes, ((shapes[0], dtypes[0]),)))
        return Conversion((group.name,), sources, "rename", True, ((key, sources),), None, shared[1], shared[0])
    for pattern, keys in group.patterns.items():
        if len(keys) > 1 and "*" not in pattern:
            raise duplicate_error(keys[0], keys[1], group.name)
    frozen_groups = tuple((p, tuple(keys)) for p, keys in group.patterns.items())
    if rule.hf:
        group_sources = hf.GroupSources(sources, shapes, dtypes)
        return hf.make_conversion(
            rule.impl, group.name, frozen_groups, group_sources, state=state, model=model, runs=runs
        )
    return _make_convert_conversion(
        rule.orig, rule.impl._patterns, group.name, frozen_groups, sources, shapes, dtypes, runs
    )


def _make_convert_conversion(
    convert: Convert,
    patterns: Patterns,
    name: str,
    groups: tuple[tuple[str, tuple[str, ...]], ...],
    sources: tuple[str, ...],
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    runs: dict,
) -> Conversion:
    by_pattern = dict(groups)
    for pattern in patterns.source_patterns:
        if pattern not in by_pattern:
            raise ValueError(
                f"{convert!r}: no checkpoint key for source pattern {pattern!r} in the group of {name!r} "
                f"(found {list(sources)})"
            )
    targets = convert_targets(name, patterns.target_patterns)
    ordered = tuple((p, by_pattern[p]) for p in patterns.source_patterns)

    def runner(tensors: Mapping[str, Any]) -> dict[str, Any]:
        args = [[tensors[k] for k in keys] if "*" in p else tensors[keys[0]] for p, keys in ordered]
        out = convert.fn(*args)
        if len(targets) == 1 and not isinstance(out, (list, tuple)):
            out = (out,)
        if not isinstance(out, (list, tuple)) or len(out) != len(targets):
            raise ValueError(f"{convert!r} must return {len(targets)} tensor(s) for {list(targets)}")
        return dict(zip(targets, out))

    fn_name = getattr(convert.fn, "__qualname__", type(convert.fn).__name__)
    sig = signature(convert, source_feed(ordered, sources), shapes, dtypes, (len(targets),))
    conv = Conversion(targets, sources, f"Convert({fn_name})", False, ordered, convert, None, sig, runner)
    meta = runs.get(sig)
    if meta is None:
        meta = runs[sig] = run_on_meta(conv, shapes, dtypes)
    return replace(conv, meta=meta)


def convert_targets(name: str, target_patterns: Sequence[str]) -> tuple[str, ...]:
    """The targets of a ``Convert`` group named ``name`` (``target_patterns[0]`` as the key's match became it): each
    target pattern in its place, its ``\\1`` the text the first pattern's ``\\1`` became in ``name``."""
    first = target_patterns[0]
    if r"\1" not in first:
        prefix, _, suffix = name.partition(first)
        return tuple(prefix + t + suffix for t in target_patterns)
    parts = first.split(r"\1")
    value = "(?P<v>.+)" if parts[-1] == "" else "(?P<v>.+?)"
    found = re.search(re.escape(parts[0]) + value + "(?P=v)".join(map(re.escape, parts[1:])), name)
    if found is None:  # (cannot happen: ``name`` was made from ``first``)
        raise ValueError(f"Convert group {name!r} does not follow its first target pattern {first!r}")
    prefix, suffix, text = name[: found.start()], name[found.end() :], found["v"]
    return tuple(prefix + t.replace(r"\1", text) + suffix for t in target_patterns)
