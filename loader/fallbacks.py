"""Fallbacks said once: conversions that do not trace and so move whole tensors (a load's deferred reads, a
transfer's keys moved whole) are logged, one warning of the ``loader`` logger per rule and reason."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .plan.rank import REJECTED_BY_HOOK
from .report import compact_keys, natural_sorted
from .rules import Conversion
from .rules.conversion import rule_name

log = logging.getLogger("loader")

#: what a load's fallback costs
READ_WHOLE = (
    "its sources are read whole on every rank that loads a part of these tensors, and it runs for real "
    "(LoadReport.deferred lists them)"
)
#: what a transfer's fallback costs
MOVED_WHOLE = (
    "its checkpoint keys are moved whole to every destination rank that holds a part of these tensors, and it "
    "runs there for real (TransferReport.fallback lists them)"
)


def log_fallbacks(untraced: Iterable[tuple[Conversion, str]], cost: str) -> None:
    """One warning per rule and reason among ``(conversion, why it does not trace)``, naming the model tensors, the
    rule, the op that stopped the trace and ``cost``; none for conversions a ``supports_symbolic`` hook rejected
    (the caller's choice)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for conv, reason in untraced:
        if reason != REJECTED_BY_HOOK:
            groups.setdefault((rule_name(conv), reason), []).extend(conv.targets)
    for (rule, reason), targets in groups.items():
        log.warning(
            "%d model tensor(s) load through a conversion that does not trace: %s via %s (%s); %s",
            len(targets),
            compact_keys(natural_sorted(targets)),
            rule,
            reason,
            cost,
        )
