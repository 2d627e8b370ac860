"""One rollback transaction per flow: what a flow changed is put back when it fails.

Vocabulary: an *undo* is a step that puts back one change (a tensor's values, a folder created); the *flow* that
opens the :class:`Rollback` owns it and passes it down, so that each change is registered once, where it is made, and
undone once, by the flow, however deep the failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import TracebackType

import torch

from ..plan import RankPlan

log = logging.getLogger("loader")


class Rollback:
    """Undo steps registered during a flow, run last first when the flow's block raises (any exception: a failure
    agreed on every rank, an interrupt), forgotten when it completes.

    Args:
        enabled: False: :meth:`keep` and :meth:`keep_tensors` copy nothing (a flow without rollback still registers
            its other undo steps, e.g. removing an unfinished folder).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._undo: list[Callable[[], None]] = []

    def __enter__(self) -> Rollback:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if kind is None:
            self._undo.clear()
        else:
            self.undo()

    def undo(self) -> None:
        """Run every undo step, last first, and forget them (an undo that fails is logged: the flow's own failure
        is being raised)."""
        undo, self._undo = self._undo, []
        for step in reversed(undo):
            try:
                step()
            except Exception:
                log.warning("an undo step of a failed flow failed", exc_info=True)

    def add(self, undo: Callable[[], None]) -> Callable[[], None]:
        """Run ``undo`` if the flow fails; returns it (for :meth:`drop`)."""
        self._undo.append(undo)
        return undo

    def drop(self, undo: Callable[[], None]) -> None:
        """Forget ``undo``: the change it would undo became final (e.g. a committed folder)."""
        self._undo = [u for u in self._undo if u is not undo]

    def keep_tensors(self, tensors: Mapping[str, torch.Tensor | None]) -> None:
        """Copy ``tensors`` now and put the copies back if the flow fails (when enabled)."""
        if not self.enabled:
            return
        saved = {n: (t, t.detach().clone()) for n, t in tensors.items() if t is not None}

        def restore() -> None:
            with torch.no_grad():
                for target, value in saved.values():
                    target.copy_(value)

        self.add(restore)

    def keep(self, plan: RankPlan) -> None:
        """Keep every local tensor ``plan`` writes (its traced and deferred targets)."""
        names = set(plan.traced) | set(plan.deferred_targets)
        self.keep_tensors({n: plan.slots[n].local for n in names})
