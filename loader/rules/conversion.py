"""The rule vocabulary: :class:`Rename` and :class:`Convert` (transformers' pattern semantics), and
:class:`Conversion`, one group of checkpoint keys producing model tensors, with its :class:`MetaRun`: the
conversion run once on meta tensors, shared by every conversion of the same :func:`signature`.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

import regiontrace as rt

#: a tensor's ``(shape, dtype)``
Spec = tuple[tuple[int, ...], torch.dtype]


def dot_natural_key(s: str) -> list[tuple]:
    """Sort key for state-dict names, identical to transformers' ``dot_natural_key``."""
    return [_natural_part(part) for part in s.split(".")]


def natural_order(s: str) -> str:
    """A string that sorts like :func:`dot_natural_key`: for names without NUL characters,
    ``natural_order(a) < natural_order(b)`` exactly when ``dot_natural_key(a) < dot_natural_key(b)`` (and equal
    when those are). Cheaper to compare, and no container for the garbage collector to track.

    Raises:
        ValueError: ``s`` contains a NUL character (sort by :func:`dot_natural_key` instead).
    """
    return "".join([_natural_code(part) for part in s.split(".")])


@functools.lru_cache(maxsize=1 << 16)
def _natural_code(part: str) -> str:
    """One part's code; codes are prefix-free, so their concatenations compare part by part. A number is
    ``\\x01``, its digit count, its digits (count first: longer is larger); a text part is ``\\x02``, the text,
    NUL, then NUL or the code of its trailing number ((1, text) sorts before (1, text, n))."""
    key = _natural_part(part)
    if key[0] == 0:
        return "\x01" + _number_code(key[1])
    if "\x00" in key[1]:
        raise ValueError(f"name part {part!r} contains a NUL character")
    return "\x02" + key[1] + "\x00" + ("\x01" + _number_code(key[2]) if len(key) == 3 else "\x00")


def _number_code(n: int) -> str:
    digits = str(n)
    return chr(0x30 + len(digits)) + digits


@functools.lru_cache(maxsize=1 << 16)
def _natural_part(part: str) -> tuple:
    """One dot-separated part's sort key (parts repeat across keys: cached)."""
    if part.isdigit():
        return (0, int(part))
    text = part.rstrip("0123456789")
    digits = part[len(text) :]
    return (1, text, int(digits)) if digits else (1, text)


def _process_target_pattern(pattern: str) -> tuple[str, str | None]:
    pattern = pattern.removeprefix("^")
    pattern = re.sub(r"\(\?.+?\)?\)", "", pattern)  # drop lookarounds
    captured = None
    match = re.search(r"\(.+?\)", pattern)
    if match:
        captured = match.group(0)
        pattern = pattern.replace(captured, r"\1", 1)
    return pattern.replace(r"\.", "."), captured


class Patterns:
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
        return renamed(key, match, self.compiled, self.source_patterns, self.target_patterns)


def renamed(
    key: str, match: re.Match, compiled: re.Pattern, source_patterns: Sequence[str], target_patterns: Sequence[str]
) -> tuple[str, str]:
    """``key`` renamed through ``match`` of ``compiled`` (the source patterns as ``(?P<g{i}>…)`` alternatives), as
    ``WeightTransform.rename_source_key`` does: the matched text becomes the first target pattern, its ``\\1``
    the matched source's first group. Returns the new key and the source pattern that matched."""
    name = match.lastgroup  # the matched alternative g{i}: its group encloses the others and closes last
    if name is None or name[0] != "g":  # (cannot happen for patterns compiled as above; transformers' own way)
        name = next(n for n, v in match.groupdict().items() if v is not None)
    replacement = target_patterns[0]
    if r"\1" in replacement:
        replacement = replacement.replace(r"\1", match.group(compiled.groupindex[name] + 1))
    return key.replace(match.group(0), replacement, 1), source_patterns[int(name[1:])]


class Rename:
    """Rename checkpoint keys: ``source_pattern`` (a regex, ``*.`` wildcards, one capturing group usable as
    ``\\1`` in the target) is replaced by ``target_pattern`` wherever it first matches. Same semantics as
    transformers' ``WeightRenaming``; all renames apply in turn, before at most one :class:`Convert`."""

    __slots__ = ("_patterns", "source_pattern", "target_pattern")

    def __init__(self, source_pattern: str, target_pattern: str):
        self.source_pattern = source_pattern
        self.target_pattern = target_pattern
        self._patterns = Patterns(source_pattern, target_pattern)

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
    ``i`` is named like the group's name with ``target_patterns[0]`` replaced by ``target_patterns[i]``, ``\\1`` in
    each the text it stood for in the group's name (the matched source's first group).
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
        self._patterns = Patterns(self.source_patterns, self.target_patterns)

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        return f"Convert({list(self.source_patterns)}, {list(self.target_patterns)}, fn={name})"


@dataclass(frozen=True)
class MetaRun:
    """A conversion run once on meta tensors: what it produces, without data.

    Attributes:
        shapes, dtypes: each source's shape and dtype, in ``Conversion.sources`` order.
        outputs: ``(shape, dtype)`` of each target, in ``Conversion.targets`` order (None for a target the run
            did not produce); None when the run raised.
        error: the exception the run raised, else None.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[torch.dtype, ...]
    outputs: tuple[Spec | None, ...] | None
    error: BaseException | None = None


@dataclass(frozen=True)
class Conversion:
    """One group: checkpoint keys ``sources`` produce model tensors ``targets``."""

    targets: tuple[str, ...]
    sources: tuple[str, ...]
    description: str
    is_rename: bool = False
    #: ``(source pattern, keys)`` in the order the conversion receives them (a rename: ``((key, (key,)),)``).
    groups: tuple[tuple[str, tuple[str, ...]], ...] = field(default=(), compare=False, repr=False)
    #: the conversion rule (our Rename/Convert or a transformers transform; ``None`` for a plain key match).
    rule: Any = field(default=None, compare=False, repr=False)
    #: the conversion run on meta tensors (shared by every conversion of the same :attr:`signature`).
    meta: MetaRun | None = field(default=None, compare=False, repr=False)
    #: equal for conversions that compute the same index map from sources of the same shapes and dtypes
    #: (layers of one structure); ``None``: shared with no other conversion.
    signature: Hashable | None = field(default=None, compare=False, repr=False)
    #: computes the targets from ``{source key: tensor}`` (any conversion but a rename): what :meth:`run` calls.
    runner: Callable[[Mapping[str, Any]], dict[str, Any]] | None = field(default=None, compare=False, repr=False)

    @property
    def target_shapes(self) -> tuple[tuple[int, ...], ...] | None:
        """Shape of each target, from the meta run (``None`` when it failed or left a target out)."""
        outs = self.meta.outputs if self.meta is not None else None
        if outs is None or any(o is None for o in outs):
            return None
        return tuple(o[0] for o in outs if o is not None)

    def run(self, tensors: Mapping[str, Any]) -> dict[str, Any]:
        """Apply the conversion to checkpoint tensors given by key; returns ``{target name: tensor}``.

        Values may be any tensor-like objects torch functions accept (e.g. ``torch.Tensor`` subclasses); they
        are passed to the conversion as they are (no dtype/device cast)."""
        if self.is_rename:
            return {self.targets[0]: tensors[self.sources[0]]}
        assert self.runner is not None
        return self.runner(tensors)


def rule_name(conv: Conversion) -> str:
    """The rule of ``conv`` for a message: our :class:`Rename`/:class:`Convert` as written, a transformers rule by its
    operations."""
    return repr(conv.rule) if isinstance(conv.rule, (Rename, Convert)) else conv.description


def source_cast(rule: Any, dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a rule's floating-point sources are cast to before its ops run, or None (not cast).

    transformers casts every floating-point source to the dtype of the group's first target (``dtype``) before
    its ops run, so for its rules we do the same (non-index ops then round exactly as ``from_pretrained``); our
    ``Convert`` functions get the checkpoint dtype."""
    if not type(rule).__module__.startswith("transformers") or not dtype.is_floating_point:
        return None
    return dtype


def cast_like_transformers(rule: Any, tensors: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
    """Sources as a rule's ops receive them (see :func:`source_cast`): real tensors or RegionTensors."""
    to = source_cast(rule, dtype)
    if to is None:
        return dict(tensors)
    return {k: t.to(to) if t.is_floating_point() else t for k, t in tensors.items()}


def decoding(
    conv: Conversion,
    decoders: Mapping[str, Callable[[Mapping[str, Any]], Any]],
    stored: tuple[str, ...],
    dtype: torch.dtype,
    *,
    rule: Any,
    description: str,
    key: Hashable,
) -> Conversion:
    """``conv`` reading the ``stored`` tensors in place of its sources named in ``decoders`` (each decoded from
    them to ``dtype`` first, then cast as transformers casts), its rule wrapped as ``rule``, its description
    suffixed, its signature (when it has one) extended by ``key``."""
    others = tuple(k for k in conv.sources if k not in decoders)

    def run(tensors: Mapping[str, Any]) -> dict[str, Any]:
        given = {k: tensors[k] for k in others}
        given.update((k, decode(tensors)) for k, decode in decoders.items())
        return conv.run(cast_like_transformers(conv.rule, given, dtype))

    return dataclasses.replace(
        conv,
        sources=others + stored,
        description=f"{conv.description} ({description})",
        is_rename=False,
        rule=rule,
        meta=None,
        signature=None if conv.signature is None else (conv.signature, key),
        runner=run,
    )


def run_on_meta(conv: Conversion, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[torch.dtype, ...]) -> MetaRun:
    """Run ``conv`` on meta tensors of the given shape and dtype per source (device moves stay on meta).

    Returns:
        The :class:`MetaRun`; an exception the conversion raises is recorded in it, not raised.
    """
    if conv.is_rename:
        return MetaRun(shapes, dtypes, ((shapes[0], dtypes[0]),))
    tensors = meta_tensors(conv.sources, shapes, dtypes)
    try:
        out = rt.run_on_meta(conv.run, tensors)
        return MetaRun(shapes, dtypes, tuple(spec_of(out[t]) if t in out else None for t in conv.targets))
    except Exception as e:
        return MetaRun(shapes, dtypes, None, meta_failure(conv, e))


def meta_failure(conv: Conversion, error: Exception) -> Exception:
    """What planning raises when ``conv`` failed on meta tensors: torch's "no data" errors (a function copying its
    inputs into memory it allocated, or mixing them with real tensors) as a ``ValueError`` naming the rule and its
    targets; any other exception as it is, with a note naming them."""
    where = f"{rule_name(conv)} for {', '.join(conv.targets[:4])}{' …' if len(conv.targets) > 4 else ''}"
    if isinstance(error, (NotImplementedError, RuntimeError)) and re.search(r"\bmeta\b", str(error)):
        wrapped = ValueError(
            f"{where} failed on meta tensors (shapes, no data), which planning runs it on: "
            f"{type(error).__name__}: {error}. It writes its inputs into a tensor of real memory it made "
            "(torch.zeros(...), torch.empty(...)) or mixes them with one: build that tensor from the inputs "
            "(w.new_zeros(...), torch.zeros_like(w), F.pad, torch.cat) so that it follows their device"
        )
        wrapped.__cause__ = error
        return wrapped
    error.add_note(f"raised by {where} on meta tensors (planning)")
    return error


def meta_tensors(keys: Sequence[str], shapes: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype]) -> dict:
    """``{key: empty meta tensor}`` of the given shapes and dtypes."""
    return {k: torch.empty(s, dtype=d, device="meta") for k, s, d in zip(keys, shapes, dtypes)}


def spec_of(tensor: Any) -> Spec:
    """A tensor's ``(shape, dtype)``."""
    return tuple(tensor.shape), tensor.dtype


def source_feed(groups: Sequence[tuple[str, Sequence[str]]], sources: Sequence[str]) -> tuple:
    """How ``sources`` feed a conversion: ``(pattern, count)`` per group when the groups list the sources in
    order, else ``(pattern, positions in sources)`` — part of a :func:`signature`."""
    flat = [k for _, keys in groups for k in keys]
    if flat == list(sources):
        return tuple((p, len(keys)) for p, keys in groups)
    position = {k: i for i, k in enumerate(sources)}
    return tuple((p, tuple(position[k] for k in keys)) for p, keys in groups)


def signature(
    rule: Hashable,
    feed: tuple,
    shapes: tuple[tuple[int, ...], ...],
    dtypes: tuple[torch.dtype, ...],
    context: tuple = (),
) -> tuple:
    """The signature of a conversion: its rule (the object itself), how sources feed it (``feed``:
    :func:`source_feed`), their shapes and dtypes, and anything else its run may read (``context``). Conversions
    with equal signatures run alike."""
    return (rule, feed, shapes, dtypes, context)
