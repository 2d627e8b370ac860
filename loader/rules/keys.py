"""Which checkpoint keys feed which model tensors, through which conversion.

``plan_keys`` reproduces the key handling of transformers' ``from_pretrained`` (5.x,
``core_model_loading.convert_and_load_state_dict_in_model``):

* checkpoint keys are visited in ``dot_natural_key`` order;
* every renaming rule is applied in turn (they chain), then at most one converter rule (the first that
  matches);
* the model's ``base_model_prefix`` is added or stripped when that makes the key a model tensor name
  (a ``ForCausalLM`` model from base-model keys and the reverse), and a key that already is a model tensor
  name but was renamed away from it is kept as it is; where two plain keys then reach one model tensor, one of
  them through the prefix (a head checkpoint's ``base.linear.*`` and ``linear.*`` into the base model), the
  first visited loads and the other is unexpected;
* converter matches are grouped by their (first) target tensor name, one converter instance per group.

Rules are our :class:`Rename` / :class:`Convert`, or transformers ``WeightRenaming`` / ``WeightConverter``
objects (including ``PrefixChange`` and scoped sub-model transforms), used as they are. transformers is
optional: this module imports without it, transformers-specific code lives in :mod:`loader.rules.hf`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from . import hf
from .conversion import (
    Conversion,
    Convert,
    MetaRun,
    Patterns,
    Rename,
    arg_layout,
    dot_natural_key,
    natural_order,
    run_on_meta,
    signature,
)
from .matching import Rule, RuleChain, converter_picker, hf_adapters


@dataclass
class KeyPlan:
    conversions: list[Conversion]
    #: checkpoint keys no rule maps to a model tensor, and keys that reach a model tensor a key visited before
    #: loads, one of them through the base model prefix (``base.linear.w`` and ``linear.w`` into the base model:
    #: ``from_pretrained`` loads the first in ``dot_natural_key`` order and drops the other unreported)
    unexpected_keys: list[str]
    #: model tensors nothing loads (tied aliases whose partner is loaded are not missing)
    missing_keys: list[str]
    #: alias model name -> canonical model name, for one tensor object known under several names
    tied: dict[str, str]
    #: checkpoint keys ``map_checkpoint_key`` returned ``None`` for (neither loaded nor reported)
    skipped_keys: list[str] = field(default_factory=list)
    #: conversions that load a tied alias whose canonical name is loaded too (transformers loads both and
    #: unties them when the values differ; here they are left out: compare if you care)
    tied_duplicates: list[Conversion] = field(default_factory=list)
    #: subsets of missing/unexpected keys that transformers does not report (``_keys_to_ignore_on_load_*``,
    #: ``rotary_emb.inv_freq``, ``position_ids``)
    ignored_missing_keys: list[str] = field(default_factory=list)
    ignored_unexpected_keys: list[str] = field(default_factory=list)
    #: rules that matched at least one checkpoint key, in mapping order (what transformers records)
    used_rules: list[Any] = field(default_factory=list, repr=False)
    #: whether the rules were given (``weights_mapping``, ``extra_weights_mapping`` or ``key_mapping``)
    custom_rules: bool = False

    def by_target(self) -> dict[str, Conversion]:
        return {t: c for c in self.conversions for t in c.targets}

    def record_on_model(self, model: torch.nn.Module) -> None:
        """Record the applied rules on ``model`` the way ``from_pretrained`` does, so that
        ``save_pretrained`` writes the checkpoint layout back.

        transformers sets ``model._weight_conversions`` to the transforms that matched a checkpoint key
        (``was_used()``), in mapping order; ``save_pretrained`` reverses them (``revert_weight_conversion``).
        Our ``Rename`` is recorded as a ``WeightRenaming``; a ``Convert`` has no reverse and is not recorded
        (its tensors are saved in the model layout). No-op for modules that are not a transformers
        ``PreTrainedModel``.

        When the rules were given, the rules applied (ours and transformers', as given) are also recorded on any
        module as :data:`APPLIED_RULES`, so that ``save_hf_checkpoint`` reverses exactly them."""
        hf.record_on_model(model, self.used_rules)
        setattr(model, APPLIED_RULES, tuple(self.used_rules) if self.custom_rules else None)


class _Group:
    """The checkpoint keys one converter (or a plain rename) gathers for one model tensor, in visit order."""

    __slots__ = ("keys", "name", "patterns", "rule")

    def __init__(self, name: str, rule: Rule | None):
        self.name, self.rule = name, rule
        self.keys: list[str] = []
        self.patterns: dict[str, list[str]] = {}  # source pattern -> its keys

    def add(self, pattern: str, key: str) -> None:
        self.keys.append(key)
        keys = self.patterns.get(pattern)
        if keys is None:
            self.patterns[pattern] = [key]
        else:
            keys.append(key)


def _duplicate(first: str, second: str, target: str) -> ValueError:
    return ValueError(f"checkpoint keys {first!r} and {second!r} both map to model tensor {target!r}")


#: the attribute a load records the given rules it applied under (see :meth:`KeyPlan.record_on_model`)
APPLIED_RULES = "_regiontrace_applied_rules"


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
    mapped, keys, skipped = _visit_order(checkpoint_shapes, map_checkpoint_key)
    groups, unexpected = _group_keys(mapped, keys, rules, state, _base_prefix(model, is_pretrained), select_converter)
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
                raise _duplicate(produced[target].sources[0], conv.sources[0], target)
            produced[target] = conv

    tied, duplicates = _resolve_tied(state, produced, adapters.tied_pairs(model) if is_pretrained else {})
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
    )


def _visit_order(
    checkpoint_shapes: Mapping[str, Any], map_checkpoint_key: Callable[[str], str | None] | None
) -> tuple[list[str], list[str], list[str]]:
    """The mapped keys in ``dot_natural_key`` order, the checkpoint keys they come from, and the skipped keys.

    Sorted by :func:`natural_order`'s strings, the same order (ties keep checkpoint order): tens of thousands of
    sort keys that are lists would wake the garbage collector's full collection.
    """
    keys, mapped, skipped = [], [], []
    for key in checkpoint_shapes:
        m = key if map_checkpoint_key is None else map_checkpoint_key(key)
        if m is None:
            skipped.append(key)
        else:
            keys.append(key)
            mapped.append(m)
    order_key: Callable[[str], Any] = natural_order if not any("\x00" in m for m in mapped) else dot_natural_key
    if map_checkpoint_key is None:
        keys.sort(key=order_key)
        return keys, keys, skipped
    order = sorted(range(len(keys)), key=lambda i: order_key(mapped[i]))
    return [mapped[i] for i in order], [keys[i] for i in order], skipped


def _base_prefix(model: torch.nn.Module, is_pretrained: bool) -> str | None:
    prefix = model.base_model_prefix if is_pretrained else getattr(model, "base_model_prefix", None)
    return prefix if isinstance(prefix, str) else None


def _group_keys(
    mapped_keys: list[str],
    keys: list[str],
    rules: list[Rule],
    state: Mapping[str, Any],
    base_prefix: str | None,
    select_converter: Callable[..., Any] | None,
) -> tuple[dict[str, _Group], list[tuple[str, str]]]:
    """Visit the keys in order: rename, pick a converter, add or strip the base model prefix, and group them
    by the model tensor they load (the first target of their converter). Returns the groups and the
    unexpected keys ``(checkpoint key, name it was renamed to)``."""
    renamings = RuleChain([r for r in rules if not r.is_converter])
    pick = converter_picker(RuleChain([r for r in rules if r.is_converter]), select_converter)
    prefixed = _prefixer(base_prefix, state)
    groups: dict[str, _Group] = {}
    unexpected: list[tuple[str, str]] = []
    via_prefix: set[str] = set()  # model tensors a plain key reached by adding or stripping the base prefix
    for mapped, key in zip(mapped_keys, keys):
        renamed, pattern, rule = pick(renamings.rename(mapped), key)
        plain, renamed = renamed, prefixed(renamed)
        if renamed not in state and mapped in state:
            plain, renamed, pattern, rule = mapped, prefixed(mapped), None, None
        if renamed not in state:
            unexpected.append((key, renamed))
            continue
        group = groups.get(renamed)
        if group is not None and (rule is None or group.rule is not rule):
            if rule is None and group.rule is None and (renamed != plain or renamed in via_prefix):
                # a head checkpoint's base.linear.* and linear.* into the base model: from_pretrained loads the
                # key visited first and drops this one without a word; it is reported as unexpected here
                unexpected.append((key, renamed))
                continue
            raise _duplicate(group.keys[0], key, renamed)
        if group is None:
            group = groups[renamed] = _Group(renamed, rule)
            if rule is None and renamed != plain:
                via_prefix.add(renamed)
        group.add(pattern if rule is not None else key, key)
    return groups, unexpected


def _prefixer(base_prefix: str | None, state: Mapping[str, Any]) -> Callable[[str], str]:
    """transformers' ``base_model_prefix`` handling: strip it or add it when that names a model tensor."""
    if base_prefix is None:
        return lambda key: key
    strip = re.compile(f"^{base_prefix}.")  # the very pattern transformers substitutes ("." is any character)

    def prefixed(key: str) -> str:
        if key.startswith(base_prefix):
            stripped = strip.sub("", key, count=1)
            if stripped in state:
                return stripped
        if f"{base_prefix}.{key}" in state:
            return f"{base_prefix}.{key}"
        return key

    return prefixed


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


def _make_conversion(group: _Group, specs: _Specs, state, model, runs: dict) -> Conversion:
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
            raise _duplicate(keys[0], keys[1], group.name)
    frozen_groups = tuple((p, tuple(keys)) for p, keys in group.patterns.items())
    if rule.hf:
        return hf.make_conversion(
            rule.impl, group.name, frozen_groups, sources, shapes, dtypes, state=state, model=model, runs=runs
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
    prefix, _, suffix = name.partition(patterns.target_patterns[0])
    targets = tuple(prefix + t + suffix for t in patterns.target_patterns)
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
    sig = signature(convert, arg_layout(ordered, sources), shapes, dtypes, (len(targets),))
    conv = Conversion(targets, sources, f"Convert({fn_name})", False, ordered, convert, None, sig, runner)
    meta = runs.get(sig)
    if meta is None:
        meta = runs[sig] = run_on_meta(conv, shapes, dtypes)
    return replace(conv, meta=meta)


def _resolve_tied(state, produced, hf_pairs: Mapping[str, str]) -> tuple[dict[str, str], list[Conversion]]:
    """Group names of one tensor object (and transformers' tied pairs); choose a canonical name per group:
    a loaded one (transformers' tie source first), else the tie source, else the first name."""
    parent: dict[str, str] = {}

    def find(n: str) -> str:
        while parent.get(n, n) != n:
            n = parent[n]
        return n

    def union(a: str, b: str) -> None:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[rb] = ra

    first_by_id: dict[int, str] = {}
    for name, tensor in state.items():
        if tensor is None:
            continue
        union(first_by_id.setdefault(id(tensor), name), name)
    preferred = set()
    for alias, source in hf_pairs.items():
        if alias in state and source in state:
            union(source, alias)
            preferred.add(source)
    members: dict[str, list[str]] = {}
    for name in state:
        members.setdefault(find(name), []).append(name)

    tied: dict[str, str] = {}
    duplicates: list[Conversion] = []
    for names in members.values():
        if len(names) < 2:
            continue
        loaded = sorted((n for n in names if n in produced), key=lambda n: n not in preferred)
        if loaded:
            canonical = loaded[0]
        else:
            canonical = next((n for n in names if n in preferred), names[0])
        for other in loaded[1:]:
            conv = produced[other]
            if len(conv.targets) != 1:
                raise ValueError(
                    f"model tensors {canonical!r} and {other!r} are one tensor but are loaded by different "
                    f"conversions ({produced[canonical].sources} and {conv.sources})"
                )
            duplicates.append(conv)
        tied.update({n: canonical for n in names if n != canonical})
    return tied, duplicates
