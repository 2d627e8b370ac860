"""PlanHooks: the customisable decisions of load planning, as one small strategy object.

A hook is asked while the plan is built; the defaults follow transformers' ``from_pretrained``. Subclass
:class:`PlanHooks`, override any of them, and give an instance to the planner:
``HFLoadPlanner(model, hooks=MyHooks())``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .placements import slot_for
from .plan.slots import TargetSlot
from .rules import Conversion

__all__ = ["PlanHooks"]


class PlanHooks:
    """The decisions a load plan asks for; override any method to customise planning.

    :meth:`map_checkpoint_key` and :meth:`select_converter` are consulted only when overridden (the default
    path of :func:`~loader.rules.plan_keys` is faster).
    """

    def default_weights_mapping(self, model: torch.nn.Module) -> Sequence[Any] | None:
        """Rules used when none are given. None: transformers' own mapping for a ``PreTrainedModel``
        (``get_model_conversion_mapping``), no renames for any other module."""
        return None

    def map_checkpoint_key(self, key: str) -> str | None:
        """Rename a checkpoint key before any rule sees it; None skips the key."""
        return key

    def select_converter(
        self, source_pattern: str, target_name: str, candidates: list[Any], *, source_key: str | None = None
    ) -> Any:
        """Choose among several converter rules matching one checkpoint key (default: the first, like transformers).

        Args:
            source_pattern: the source pattern of the first candidate that matched the key.
            target_name: the name that candidate renames the key to.
            candidates: the matching rules, in precedence order.
            source_key: the checkpoint key as stored (before ``map_checkpoint_key`` and the renamings); an
                override may leave this keyword out of its signature.

        Returns:
            One of ``candidates``, or None for no conversion.
        """
        return candidates[0]

    def supports_symbolic(self, conversion: Conversion) -> bool:
        """Whether to trace ``conversion``; False sends it to a deferred read."""
        return True

    def target_slot(self, name: str, tensor: torch.Tensor) -> TargetSlot:
        """The slot (owned boxes) of one model tensor on this rank."""
        return slot_for(name, tensor)

    def overridden(self, name: str) -> bool:
        """Whether hook ``name`` is overridden (its default is then not taken as a shortcut)."""
        return getattr(type(self), name) is not getattr(PlanHooks, name)
