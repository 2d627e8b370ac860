"""What :func:`~loader.rules.keys.plan_keys` decides: the :class:`KeyPlan` value, and the attribute a load records
the rules it applied under (:data:`APPLIED_RULES`)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import hf
from .conversion import Conversion, Rename

#: the attribute a load records the given rules it applied under (see :meth:`KeyPlan.record_on_model`)
APPLIED_RULES = "_regiontrace_applied_rules"


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
    #: given rules (``weights_mapping``, ``extra_weights_mapping``) that matched no checkpoint key: a typo in a
    #: source pattern, named by :meth:`unmatched_note` where tensors go missing
    unmatched_rules: list[Any] = field(default_factory=list, repr=False)

    def unmatched_note(self, checkpoint_keys: Iterable[str]) -> str:
        """A sentence naming each given rule that matched no checkpoint key, its source patterns and the checkpoint
        keys nearest them (``""`` when every rule matched): the likely cause of a model tensor nothing loads."""
        if not self.unmatched_rules:
            return ""
        keys = list(checkpoint_keys)
        parts = []
        for rule in self.unmatched_rules[:4]:
            patterns = _source_patterns(rule)
            near = list(dict.fromkeys(k for p in patterns for k in nearest_keys(p, keys)))[:3]
            parts.append(f"{rule!r} (source patterns {patterns}; nearest checkpoint keys: {near or 'none'})")
        more = f" and {len(self.unmatched_rules) - 4} more" if len(self.unmatched_rules) > 4 else ""
        return f"; these rules matched no checkpoint key: {', '.join(parts)}{more}"

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


def _source_patterns(rule: Any) -> list[str]:
    if isinstance(rule, Rename):
        return [rule.source_pattern]
    return list(getattr(rule, "source_patterns", ()))


def nearest_keys(pattern: str, keys: Sequence[str], n: int = 3) -> list[str]:
    """The checkpoint keys nearest a source pattern (:func:`difflib.get_close_matches` of the pattern's text against
    each key's last dot parts, as many as the pattern has): what a typo in it probably meant."""
    text = re.sub(r"\\(.)", r"\1", pattern.replace("*.", "").strip("^$"))  # "attn\\.qkv" -> "attn.qkv"
    depth = text.count(".") + 1
    tails: dict[str, str] = {}
    for key in keys:
        tails.setdefault(".".join(key.split(".")[-depth:]), key)
    return [tails[t] for t in difflib.get_close_matches(text, list(tails), n=n, cutoff=0.6)]
