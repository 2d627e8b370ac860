"""Matching checkpoint keys against rules, as transformers does, with a shortcut for keys no rule matches.

A :class:`Rule` is one rule with its own matching state (transformers transforms are copied: they record use,
and some, like ``GroupWeightRename``, keep state across keys). :class:`RuleChain` applies the renaming rules
in turn (:meth:`RuleChain.rename`) or finds the first converter rule that matches (:meth:`RuleChain.first`).

Most rules match by one regular-expression search of the key (our :class:`Rename`/:class:`Convert`,
transformers' ``WeightRenaming``/``WeightConverter``/``PrefixChange`` without a scope): for those, one search
of all their patterns joined as alternatives finds a match exactly when one of them matches, so a key that no
rule touches — most keys, for renamings — costs one search instead of one per rule. Rules matched otherwise
(scoped, stateful or custom ``rename_source_key``) are always asked one by one. A key a rule's search matched is
renamed from that match, as ``rename_source_key`` would (same replacement, use recorded).
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import hf
from .conversion import Convert, Rename, renamed

#: a named group's opening, made non-capturing when patterns are joined (their ``g0``, ``g1`` … would clash)
_NAMED_GROUP = re.compile(r"\(\?P<\w+>")
#: backreferences and conditionals refer to group numbers, which joining shifts: such patterns are not joined
_GROUP_REFERENCE = re.compile(r"\\\d|\(\?P=|\(\?\(")


def hf_adapters() -> Any:
    """The transformers adapters (:mod:`loader.rules.hf`) when transformers is installed, else None."""
    return hf if hf.AVAILABLE else None


class Rule:
    """One rule with its own matching state.

    Args:
        orig: our :class:`Rename`/:class:`Convert`, or a transformers ``WeightRenaming``/``WeightConverter``.

    Raises:
        TypeError: ``orig`` is not a rule.
    """

    __slots__ = ("hf", "impl", "is_converter", "orig", "our_used", "regex")

    def __init__(self, orig: Any) -> None:
        self.orig = orig
        self.our_used = False
        if isinstance(orig, (Rename, Convert)):
            self.hf, self.impl, self.is_converter = False, orig, isinstance(orig, Convert)
            self.regex: re.Pattern | None = orig._patterns.compiled
            return
        adapters = hf_adapters()
        kind = adapters.rule_kind(orig) if adapters is not None else None
        if kind is None:
            raise TypeError(f"not a rule: {orig!r} (expected Rename, Convert, WeightRenaming or WeightConverter)")
        self.hf, self.impl, self.is_converter = True, adapters.fresh_copy(orig), kind == "converter"
        self.regex = self.impl.compiled_sources if _matches_by_search(self.impl) else None

    def rename(self, key: str) -> tuple[str, str | None]:
        """``(renamed key, matched source pattern)``, or ``(key, None)``; records a use."""
        if self.hf:
            return self.impl.rename_source_key(key)
        new_key, pattern = self.impl._patterns.rename(key)
        if pattern is not None:
            self.our_used = True
        return new_key, pattern

    def renamed(self, key: str, match: re.Match) -> tuple[str, str]:
        """:meth:`rename` of a key that :attr:`regex` matched (``match``): what ``rename`` returns, and the use
        recorded the same way."""
        if self.hf:
            if not self.impl._was_used:
                self.impl._was_used = True
            return renamed(key, match, self.regex, self.impl.source_patterns, self.impl.target_patterns)
        self.our_used = True
        return renamed(key, match, self.regex, self.impl._patterns.source_patterns, self.impl._patterns.target_patterns)

    def probe(self, key: str) -> tuple[str, str | None]:
        """Like :meth:`rename` without recording a use."""
        if self.hf:
            return hf.probe(self.impl, key)
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


def _matches_by_search(transform: Any) -> bool:
    """Whether a transformers transform matches a key by one search of ``compiled_sources`` and nothing else."""
    core = sys.modules.get("transformers.core_model_loading")
    return (
        core is not None
        and type(transform).rename_source_key is core.WeightTransform.rename_source_key
        and transform.scope_prefix is None
    )


class RuleChain:
    """Rules applied to keys in order; renamings skip with one search the keys none of them matches.

    Args:
        rules: the renaming rules, or the converter rules, in precedence order.
    """

    def __init__(self, rules: Sequence[Rule]) -> None:
        self.rules = list(rules)
        self._any = _joined([r.regex for r in self.rules]) if self.rules else _never

    def rename(self, key: str) -> str:
        """``key`` after every rule in turn (renamings chain)."""
        if self._any is not None and self._any(key) is None:
            return key
        for rule in self.rules:
            key, _ = rule.rename(key)
        return key

    def first(self, key: str) -> tuple[str, str | None, Rule | None]:
        """The first rule that matches ``key``: ``(renamed key, matched source pattern, rule)``, or
        ``(key, None, None)`` (converters: at most one applies)."""
        for rule in self.rules:
            if rule.regex is None:
                new_key, pattern = rule.rename(key)
                if pattern is not None:
                    return new_key, pattern, rule
                continue
            match = rule.regex.search(key)
            if match is not None:
                return (*rule.renamed(key, match), rule)
        return key, None, None


def _never(key: str) -> None:
    return None


def _joined(patterns: Sequence[re.Pattern | None]) -> Callable[[str], re.Match | None] | None:
    """One search that finds a match exactly when one of ``patterns`` matches the key; None when a pattern
    cannot be joined (a rule not matched by search, inline global flags, group references)."""
    parts = []
    for p in patterns:
        if p is None or p.flags != re.UNICODE or _GROUP_REFERENCE.search(p.pattern):
            return None
        body, named = _NAMED_GROUP.subn("(?:", p.pattern)
        if named != len(p.groupindex):  # "(?P<" text that is no group opening: leave the pattern alone
            return None
        parts.append(f"(?:{body})")
    try:
        return re.compile("|".join(parts)).search
    except re.error:
        return None


def converter_picker(
    converters: RuleChain, select_converter: Callable[..., Any] | None = None
) -> Callable[[str, str], tuple[str, str | None, Rule | None]]:
    """``pick(key, source_key) -> (renamed key, matched pattern, rule)``: the converter a renamed key goes to.

    Without ``select_converter`` the first converter that matches (transformers' rule); for a transformers
    converter, as transformers does, the *last* transformers converter with the matched source pattern runs the
    group. With it, the hook chooses among several matching converters (see :func:`loader.rules.plan_keys`).
    """
    pattern_to_converter = {p: r for r in converters.rules if r.hf for p in r.source_patterns}
    select = _selector(select_converter)

    def first(key: str, source_key: str) -> tuple[str, str | None, Rule | None]:
        renamed, pattern, rule = found = converters.first(key)
        if rule is not None and rule.hf:
            return renamed, pattern, pattern_to_converter[pattern]
        return found

    def selected(key: str, source_key: str) -> tuple[str, str | None, Rule | None]:
        candidates = [(conv, *conv.probe(key)) for conv in converters.rules]
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

    return first if select is None else selected


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
