"""Which checkpoint keys gather into one model tensor, the way transformers' ``from_pretrained`` visits them.

The keys are visited in ``dot_natural_key`` order (:func:`visit_order`); each is renamed, given at most one
converter, and has the model's ``base_model_prefix`` added or stripped when that names a model tensor (unless, in
a checkpoint holding prefixed keys, the key names a model tensor itself); the keys are then grouped by the model
tensor they load (:func:`group_keys`: one :class:`KeyGroup` per converter instance).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .conversion import dot_natural_key, natural_order
from .matching import Rule, RuleChain, converter_picker

log = logging.getLogger("loader")


class KeyGroup:
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


def duplicate_error(first: str, second: str, target: str) -> ValueError:
    return ValueError(f"checkpoint keys {first!r} and {second!r} both map to model tensor {target!r}")


def visit_order(
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


def base_prefix(model: torch.nn.Module, is_pretrained: bool) -> str | None:
    prefix = model.base_model_prefix if is_pretrained else getattr(model, "base_model_prefix", None)
    return prefix if isinstance(prefix, str) else None


def group_keys(
    mapped_keys: list[str],
    keys: list[str],
    rules: list[Rule],
    state: Mapping[str, Any],
    base_prefix: str | None,
    select_converter: Callable[..., Any] | None,
) -> tuple[dict[str, KeyGroup], list[tuple[str, str]]]:
    """Visit the keys in order: rename, pick a converter, add or strip the base model prefix, and group them
    by the model tensor they load (the first target of their converter). Returns the groups and the
    unexpected keys ``(checkpoint key, name it was renamed to)``."""
    renamings = RuleChain([r for r in rules if not r.is_converter])
    pick = converter_picker(RuleChain([r for r in rules if r.is_converter]), select_converter)
    head_layout = base_prefix is not None and any(k.startswith(f"{base_prefix}.") for k in mapped_keys)
    prefixed = _prefixer(base_prefix, state, head_layout)
    groups: dict[str, KeyGroup] = {}
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
            raise duplicate_error(group.keys[0], key, renamed)
        if group is None:
            group = groups[renamed] = KeyGroup(renamed, rule)
            if rule is None and renamed != plain:
                via_prefix.add(renamed)
        group.add(pattern if rule is not None else key, key)
    _warn_kept(base_prefix, state, head_layout, groups)
    return groups, unexpected


def _prefixer(base_prefix: str | None, state: Mapping[str, Any], head_layout: bool) -> Callable[[str], str]:
    """transformers' ``base_model_prefix`` handling: strip it or add it when that names a model tensor — except
    for a key that names a model tensor itself in a checkpoint holding prefixed keys (``head_layout``: a
    checkpoint of the model's own layout), which stays: a head's ``linear.*`` beside its base's ``base.linear.*``
    load where they are named, not exchanged."""
    if base_prefix is None:
        return lambda key: key
    from_pretrained = _hf_prefixer(base_prefix, state)
    if not head_layout:
        return from_pretrained
    return lambda key: key if key in state else from_pretrained(key)


def _hf_prefixer(base_prefix: str, state: Mapping[str, Any]) -> Callable[[str], str]:
    """What ``from_pretrained`` (5.x, ``rename_source_key``) does, key by key."""
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


def _warn_kept(
    base_prefix: str | None, state: Mapping[str, Any], head_layout: bool, groups: Mapping[str, KeyGroup]
) -> None:
    """Log the plain keys loaded where they are named that ``from_pretrained`` would move through the prefix."""
    if not head_layout:
        return
    from_pretrained = _hf_prefixer(base_prefix, state)
    moved = [(k, from_pretrained(k)) for name, g in groups.items() if g.rule is None for k in g.keys if k == name]
    moved = [(k, m) for k, m in moved if m != k]
    if moved:
        log.warning(
            "%d checkpoint key(s) name a model tensor both with and without base_model_prefix %r: each is "
            "loaded into (or saved from) the tensor it names, where transformers' from_pretrained would load it "
            "into the one after the arrow (%s)",
            len(moved),
            base_prefix,
            ", ".join(f"{k!r} -> {m!r}" for k, m in moved[:8]) + (", …" if len(moved) > 8 else ""),
        )
