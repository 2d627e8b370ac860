"""The rules a save reverses for a model a load recorded its rules on: exactly those the load applied.

A load given rules records the ones that matched a checkpoint key (:data:`~loader.rules.keyplan.APPLIED_RULES`).
Saving that model without rules reverses them; saving it with rules reverses those of the given rules the load
applied (a rule that matched no checkpoint key was not applied, so reversing it would write keys the checkpoint
never had). A model no load recorded rules on saves with the rules given, as before.
"""

from __future__ import annotations

import logging
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

from ..rules import Convert, Rename
from ..rules.keyplan import APPLIED_RULES
from ..rules.keys import rules_in_order

log = logging.getLogger("loader")


def rules_to_reverse(
    model: torch.nn.Module,
    weights_mapping: Sequence[Any] | None,
    extra_weights_mapping: Sequence[Any],
    key_mapping: Mapping[str, str] | None,
) -> dict[str, Any] | None:
    """The rule arguments the save uses for ``model``, or None when no load recorded rules on it (then the given
    arguments stand)."""
    applied = getattr(model, APPLIED_RULES, None)
    if applied is None:
        return None
    if weights_mapping is None and not extra_weights_mapping and not key_mapping:
        chosen = list(applied)
    else:
        was_applied = {rule_key(r) for r in applied}
        given = rules_in_order(model, weights_mapping, extra_weights_mapping, key_mapping)
        chosen = [r for r in given if rule_key(r) in was_applied]
        skipped = [r for r in given if rule_key(r) not in was_applied]
        if skipped and weights_mapping is not None:
            log.warning(
                "save_hf_checkpoint: not reversing %d rule(s) the load of this model did not apply: %s",
                len(skipped),
                ", ".join(repr(r) for r in skipped[:4]) + (" …" if len(skipped) > 4 else ""),
            )
    return dict(weights_mapping=chosen, extra_weights_mapping=(), key_mapping=None)


def rule_key(rule: Any) -> Hashable:
    """What makes two rules the same rule: their kind and patterns (and a ``Convert``'s function, a transformers
    converter's operations)."""
    if isinstance(rule, Rename):
        return ("Rename", rule.source_pattern, rule.target_pattern)
    if isinstance(rule, Convert):
        return ("Convert", rule.source_patterns, rule.target_patterns, id(rule.fn))
    patterns = tuple(
        tuple(p) if isinstance(p, (list, tuple)) else p
        for p in (getattr(rule, "source_patterns", None), getattr(rule, "target_patterns", None))
    )
    return (type(rule).__qualname__, patterns, repr(getattr(rule, "operations", None)))
