"""The rule vocabulary: :class:`Rename` and :class:`Convert` (transformers' pattern semantics), and
:class:`Conversion`, one group of checkpoint keys producing model tensors.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def dot_natural_key(s: str) -> list[tuple]:
    """Sort key for state-dict names, identical to transformers' ``dot_natural_key``."""
    parts: list[tuple] = []
    for part in s.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            text = part.rstrip("0123456789")
            digits = part[len(text) :]
            parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


def _process_target_pattern(pattern: str) -> tuple[str, str | None]:
    pattern = pattern.removeprefix("^")
    pattern = re.sub(r"\(\?.+?\)?\)", "", pattern)  # drop lookarounds
    captured = None
    match = re.search(r"\(.+?\)", pattern)
    if match:
        captured = match.group(0)
        pattern = pattern.replace(captured, r"\1", 1)
    return pattern.replace(r"\.", "."), captured


class _Patterns:
    """Source/target patterns with exactly the matching and replacement rules of a transformers
    ``WeightTransform``: sources are regexes in which ``*.`` means "any characters, then a dot"; the longest
    source is tried first; a source ending in an alphanumeric character must end on a name boundary; the
    matched text is replaced by the first target, in which ``\\1`` is the source's first group."""

    __slots__ = ("compiled", "source_patterns", "target_patterns")

    def __init__(self, sources: str | Sequence[str], targets: str | Sequence[str]):
        sources = [sources] if isinstance(sources, str) else list(sources)
        targets = [targets] if isinstance(targets, str) else list(targets)
        if not sources or not targets:
            raise ValueError("a rule needs at least one source and one target pattern")
        original_targets = list(targets)
        groups = []
        for i, pattern in enumerate(targets):
            targets[i], captured = _process_target_pattern(pattern)
            if captured is not None:
                groups.append(captured)
        if len(set(groups)) > 1:
            raise ValueError(f"target patterns {original_targets} use different capturing groups {set(groups)}")
        group = groups[0] if groups else None
        for i, pattern in enumerate(sources):
            if r"\1" in pattern:
                if group is None:
                    raise ValueError(f"source pattern {pattern!r} uses \\1 but no target has a capturing group")
                pattern = pattern.replace(r"\1", group, 1)
            if len(sources) == len(targets) and original_targets[i].startswith("^") and not pattern.startswith("^"):
                pattern = "^" + pattern
            sources[i] = pattern
        branches = []
        for i, pattern in sorted(enumerate(sources), key=lambda item: -len(item[1])):
            body = pattern.replace("*.", r".*\.")
            if re.search(r"[a-zA-Z0-9]$", body):
                body += r"(?!\w)"
            branches.append(f"(?P<g{i}>{body})")
        self.compiled = re.compile("|".join(branches))
        self.source_patterns = sources
        self.target_patterns = targets

    def rename(self, key: str) -> tuple[str, str | None]:
        match = self.compiled.search(key)
        if match is None:
            return key, None
        name = next(n for n, v in match.groupdict().items() if v is not None)
        replacement = self.target_patterns[0]
        if r"\1" in replacement:
            replacement = replacement.replace(r"\1", match.group(self.compiled.groupindex[name] + 1))
        return key.replace(match.group(0), replacement, 1), self.source_patterns[int(name[1:])]


class Rename:
    """Rename checkpoint keys: ``source_pattern`` (a regex, ``*.`` wildcards, one capturing group usable as
    ``\\1`` in the target) is replaced by ``target_pattern`` wherever it first matches. Same semantics as
    transformers' ``WeightRenaming``; all renames apply in turn, before at most one :class:`Convert`."""

    __slots__ = ("_patterns", "source_pattern", "target_pattern")

    def __init__(self, source_pattern: str, target_pattern: str):
        self.source_pattern = source_pattern
        self.target_pattern = target_pattern
        self._patterns = _Patterns(source_pattern, target_pattern)

    def rename(self, key: str) -> str:
        """The key after this rule alone (unchanged when it does not match)."""
        return self._patterns.rename(key)[0]

    def __repr__(self) -> str:
        return f"Rename({self.source_pattern!r}, {self.target_pattern!r})"


class Convert:
    """Convert checkpoint tensors with any torch code.

    A key matching one of ``source_patterns`` (same syntax as :class:`Rename`) is renamed by replacing
    the matched text with ``target_patterns[0]``; keys renamed to the same name form one group (e.g. all
    experts of one layer). ``fn`` is called with one argument per source pattern, in pattern order: the
    list of that pattern's tensors in natural key order when the pattern contains ``*``, else its single
    tensor. It returns one tensor per target pattern (a tensor for one target, else a tuple/list); target
    ``i`` is named like the group's name with ``target_patterns[0]`` replaced by ``target_patterns[i]``.
    """

    __slots__ = ("_patterns", "fn", "source_patterns", "target_patterns")

    def __init__(self, source_patterns: str | Sequence[str], target_patterns: str | Sequence[str], fn: Callable):
        self.source_patterns = (source_patterns,) if isinstance(source_patterns, str) else tuple(source_patterns)
        self.target_patterns = (target_patterns,) if isinstance(target_patterns, str) else tuple(target_patterns)
        if any("*" in t for t in self.target_patterns):
            raise ValueError(f"'*' is not supported in Convert target patterns: {self.target_patterns}")
        if not callable(fn):
            raise TypeError(f"Convert fn must be callable, got {fn!r}")
        self.fn = fn
        self._patterns = _Patterns(self.source_patterns, self.target_patterns)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"Convert({list(self.source_patterns)}, {list(self.target_patterns)}, fn={name})"


@dataclass(frozen=True)
class Conversion:
    """One group: checkpoint keys ``sources`` produce model tensors ``targets``."""

    targets: tuple[str, ...]
    sources: tuple[str, ...]
    description: str
    is_rename: bool = False
    #: ``(source pattern, keys)`` in the order the conversion receives them (a rename: ``((key, (key,)),)``).
    groups: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), compare=False, repr=False)
    #: shape of each target, as predicted at planning time (``None`` when it could not be predicted).
    target_shapes: tuple[tuple[int, ...], ...] | None = field(default=None, compare=False, repr=False)
    #: the conversion rule (our Rename/Convert or a transformers transform; ``None`` for a plain key match).
    rule: Any = field(default=None, compare=False, repr=False)
    _runner: Callable[[Mapping[str, Any]], dict[str, Any]] | None = field(default=None, compare=False, repr=False)

    def run(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Apply the conversion to checkpoint tensors given by key; returns ``{target name: tensor}``.

        Values may be any tensor-like objects torch functions accept (e.g. ``torch.Tensor`` subclasses); they
        are passed to the conversion as they are (no dtype/device cast)."""
        if self.is_rename:
            return {self.targets[0]: tensors[self.sources[0]]}
        assert self._runner is not None
        return self._runner(tensors)
