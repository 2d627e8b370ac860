"""Which checkpoint keys feed which model tensors, through which conversion.

``plan_keys`` reproduces the key handling of transformers' ``from_pretrained`` (5.x,
``core_model_loading.convert_and_load_state_dict_in_model``):

* checkpoint keys are visited in ``dot_natural_key`` order;
* every renaming rule is applied in turn (they chain), then at most one converter rule (the first that
  matches);
* the model's ``base_model_prefix`` is added or stripped when that makes the key a model tensor name
  (a ``ForCausalLM`` model from base-model keys and the reverse), and a key that already is a model tensor
  name but was renamed away from it is kept as it is;
* converter matches are grouped by their (first) target tensor name, one converter instance per group.

Rules are our :class:`Rename` / :class:`Convert`, or transformers ``WeightRenaming`` / ``WeightConverter``
objects (including ``PrefixChange`` and scoped sub-model transforms), used as they are. transformers is
optional: this module imports without it, transformers-specific code lives in :mod:`loader.rules.hf`.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import hf
from .conversion import Conversion, Convert, Rename, _Patterns, dot_natural_key


@dataclass
class KeyPlan:
    conversions: list[Conversion]
    #: checkpoint keys no rule maps to a model tensor
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

    def by_target(self) -> dict[str, Conversion]:
        return {t: c for c in self.conversions for t in c.targets}

    def record_on_model(self, model: torch.nn.Module) -> None:
        """Record the applied rules on ``model`` the way ``from_pretrained`` does, so that
        ``save_pretrained`` writes the checkpoint layout back.

        transformers sets ``model._weight_conversions`` to the transforms that matched a checkpoint key
        (``was_used()``), in mapping order; ``save_pretrained`` reverses them (``revert_weight_conversion``).
        Our ``Rename`` is recorded as a ``WeightRenaming``; a ``Convert`` has no reverse and is not recorded
        (its tensors are saved in the model layout). No-op for modules that are not a transformers
        ``PreTrainedModel``."""
        hf.record_on_model(model, self.used_rules)


class _Rule:
    """A rule with its own matching state (transformers transforms are copied: they record use and some,
    like ``GroupWeightRename``, keep state across keys)."""

    def __init__(self, orig: Any):
        self.orig = orig
        self.our_used = False
        if isinstance(orig, (Rename, Convert)):
            self.hf, self.impl, self.is_converter = False, orig, isinstance(orig, Convert)
            return
        hf = _hf()
        kind = hf.rule_kind(orig) if hf is not None else None
        if kind is None:
            raise TypeError(f"not a rule: {orig!r} (expected Rename, Convert, WeightRenaming or WeightConverter)")
        self.hf, self.impl, self.is_converter = True, hf.fresh_copy(orig), kind == "converter"

    def rename(self, key: str) -> tuple[str, str | None]:
        if self.hf:
            return self.impl.rename_source_key(key)
        new_key, pattern = self.impl._patterns.rename(key)
        if pattern is not None:
            self.our_used = True
        return new_key, pattern

    def probe(self, key: str) -> tuple[str, str | None]:
        """Like :meth:`rename` without recording a use."""
        if self.hf:
            return _hf().probe(self.impl, key)
        return self.impl._patterns.rename(key)

    @property
    def used(self) -> bool:
        return self.impl.was_used() if self.hf else self.our_used

    @property
    def source_patterns(self) -> list[str]:
        return self.impl.source_patterns if self.hf else self.impl._patterns.source_patterns

    @property
    def target_patterns(self) -> list[str]:
        return self.impl.target_patterns if self.hf else self.impl._patterns.target_patterns


def _hf():  # noqa: ANN202
    return hf if hf.AVAILABLE else None


class _Group:
    __slots__ = ("items", "name", "rule")

    def __init__(self, name: str, rule: _Rule | None):
        self.name, self.rule = name, rule
        self.items: dict[str, list[tuple[int, str]]] = {}  # pattern -> [(visit index, checkpoint key)]

    def add(self, pattern: str, index: int, key: str) -> None:
        self.items.setdefault(pattern, []).append((index, key))

    def first_key(self) -> str:
        return min(ik for keys in self.items.values() for ik in keys)[1]


def _duplicate(first: str, second: str, target: str) -> ValueError:
    return ValueError(f"checkpoint keys {first!r} and {second!r} both map to model tensor {target!r}")


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
    weights_mapping: Sequence[Any] | None = None,
    extra_weights_mapping: Sequence[Any] = (),
    key_mapping: Mapping[str, str] | None = None,
    map_checkpoint_key: Callable[[str], str | None] | None = None,
    select_converter: Callable[..., Any] | None = None,
) -> KeyPlan:
    """Decide which checkpoint keys load which model tensors, exactly like transformers' ``from_pretrained``.

    Args:
        model: the module to load into (its ``state_dict(keep_vars=True)`` names are the model tensors).
        checkpoint_shapes: checkpoint key -> shape.
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

    Raises:
        ValueError: two checkpoint keys feed one model tensor, a conversion produces a name that is not a
            model tensor, or a ``Convert`` group lacks one of its source patterns.
    """
    hf = _hf()
    is_pretrained = hf is not None and hf.is_pretrained_model(model)
    rules = [
        _Rule(r)
        for r in [
            *extra_weights_mapping,
            *_default_rules(model, hf, is_pretrained, weights_mapping, key_mapping),
        ]
    ]
    renamings = [r for r in rules if not r.is_converter]
    converters = [r for r in rules if r.is_converter]
    # as transformers does, a group runs the *last* transformers converter with the matched source pattern
    pattern_to_converter = {p: r for r in converters if r.hf for p in r.source_patterns}
    state = model.state_dict(keep_vars=True)
    base_prefix = model.base_model_prefix if is_pretrained else getattr(model, "base_model_prefix", None)
    if not isinstance(base_prefix, str):
        base_prefix = None

    def add_or_strip_prefix(key: str) -> str:
        if base_prefix is None:
            return key
        stripped = re.sub(f"^{base_prefix}.", "", key, count=1)
        if key.startswith(base_prefix) and stripped in state:
            return stripped
        if f"{base_prefix}.{key}" in state:
            return f"{base_prefix}.{key}"
        return key

    select = _selector(select_converter)

    def pick_converter(key: str, source_key: str) -> tuple[str, str | None, _Rule | None]:
        if select is None:
            for conv in converters:
                renamed, pattern = conv.rename(key)
                if pattern is not None:
                    return renamed, pattern, pattern_to_converter[pattern] if conv.hf else conv
            return key, None, None
        candidates = [(conv, *conv.probe(key)) for conv in converters]
        candidates = [c for c in candidates if c[2] is not None]
        if not candidates:
            return key, None, None
        chosen = candidates[0][0]
        if len(candidates) > 1:
            choice = select(candidates[0][2], candidates[0][1], [c[0].orig for c in candidates], source_key)
            if choice is None:
                return key, None, None
            matches = [c[0] for c in candidates if c[0].orig is choice]
            if not matches:
                raise ValueError(f"select_converter returned {choice!r}, which is not one of the candidates")
            chosen = matches[0]
        renamed, pattern = chosen.rename(key)
        return renamed, pattern, chosen

    items: list[tuple[str, str]] = []
    skipped: list[str] = []
    for key in checkpoint_shapes:
        mapped = key if map_checkpoint_key is None else map_checkpoint_key(key)
        if mapped is None:
            skipped.append(key)
        else:
            items.append((mapped, key))
    items.sort(key=lambda item: dot_natural_key(item[0]))

    groups: dict[str, _Group] = {}
    unexpected: list[tuple[str, str]] = []  # (checkpoint key, name it was renamed to)
    for index, (mapped, key) in enumerate(items):
        renamed = mapped
        for renaming in renamings:
            renamed, _ = renaming.rename(renamed)
        renamed, pattern, rule = pick_converter(renamed, key)
        renamed = add_or_strip_prefix(renamed)
        if renamed not in state and mapped in state:
            renamed, pattern, rule = add_or_strip_prefix(mapped), None, None
        if renamed not in state:
            unexpected.append((key, renamed))
            continue
        group = groups.get(renamed)
        if group is not None and (rule is None or group.rule is not rule):
            raise _duplicate(group.first_key(), key, renamed)
        if group is None:
            group = groups[renamed] = _Group(renamed, rule)
        group.add(pattern if rule is not None else key, index, key)

    shapes = {key: tuple(int(d) for d in shape) for key, shape in checkpoint_shapes.items()}
    conversions = [_make_conversion(g, shapes, state, model, hf) for g in groups.values()]

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

    tied, duplicates = _resolve_tied(state, produced, hf.tied_pairs(model) if is_pretrained else {})
    if duplicates:
        conversions = [c for c in conversions if all(c is not d for d in duplicates)]
        for dup in duplicates:
            del produced[dup.targets[0]]
    missing = [n for n in state if n not in produced and not (n in tied and tied[n] in produced)]

    ignored_missing: list[str] = []
    ignored_unexpected: list[str] = []
    if is_pretrained:
        missing_re, unexpected_re = hf.ignore_regexes(model)
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
    )


def _selector(select_converter: Callable[..., Any] | None) -> Callable[[str, str, list, str], Any] | None:
    """``select_converter`` as ``f(pattern, target, candidates, key)``, passing ``source_key=`` where accepted."""
    if select_converter is None:
        return None
    try:
        params = inspect.signature(select_converter).parameters.values()
    except (TypeError, ValueError):  # no signature to inspect (a builtin): the documented 3-argument call
        params = ()
    if any(p.name == "source_key" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return lambda pattern, target, candidates, key: select_converter(pattern, target, candidates, source_key=key)
    return lambda pattern, target, candidates, key: select_converter(pattern, target, candidates)


def _make_conversion(group: _Group, shapes, state, model, hf) -> Conversion:
    ordered = [(p, [k for _, k in sorted(keys)]) for p, keys in group.items.items()]
    sources = tuple(k for _, k in sorted(ik for keys in group.items.values() for ik in keys))
    rule = group.rule
    if rule is None:
        (key,) = sources
        return Conversion((group.name,), sources, "rename", True, ((key, sources),), (shapes[key],))
    for pattern, keys in ordered:
        if len(keys) > 1 and "*" not in pattern:
            raise _duplicate(keys[0], keys[1], group.name)
    frozen_groups = tuple((p, tuple(keys)) for p, keys in ordered)
    if rule.hf:
        return hf.make_conversion(rule.impl, group.name, frozen_groups, sources, shapes, state, model)
    return _make_convert_conversion(rule.orig, rule.impl._patterns, group.name, frozen_groups, sources, shapes)


def _make_convert_conversion(convert: Convert, patterns: _Patterns, name, groups, sources, shapes) -> Conversion:
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

    try:
        meta = {k: torch.empty(shapes[k], device="meta") for k in sources}
        target_shapes = tuple(tuple(v.shape) for v in runner(meta).values())
    except Exception:  # noqa: BLE001 - shapes are a best-effort prediction
        target_shapes = None
    fn_name = getattr(convert.fn, "__qualname__", type(convert.fn).__name__)
    return Conversion(targets, sources, f"Convert({fn_name})", False, ordered, target_shapes, convert, runner)


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
