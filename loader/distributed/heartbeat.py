"""A rank's heartbeat through its session's store, so that a rank that stopped responding is found without waiting
for the full timeout.

Vocabulary: a *beat* is one increment of a rank's ``beat/<rank>`` counter; a rank is *done* once it set
``done/<rank>`` (its session exited: not to be taken for dead); the ``dead`` list names the ranks reported dead.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("loader")

HEARTBEAT_LIMIT = 30.0
"""At most this many seconds without a heartbeat and a rank that had started the flow is reported dead."""


class Heartbeat:
    """A background thread beats this rank's counter every ``dead_after / 5`` seconds and watches the next live
    rank's; a rank that started (one beat) and stops beating for ``dead_after`` seconds, without being done, is
    appended to the store's ``dead`` list, which every rank waiting at an agreement point reads.

    :meth:`stop` joins the thread: none outlives its session (a thread still using the store while the process
    group is destroyed, or the process exits, can abort the process)."""

    def __init__(self, store: Any, rank: int, world: int, dead_after: float) -> None:
        self.store, self.rank, self.world, self.dead_after = store, rank, world, dead_after
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._declared: set[int] = set()

    def start(self) -> None:
        """A first beat (before anything can hang), then the background thread."""
        self.store.add(f"beat/{self.rank}", 1)
        self._thread = threading.Thread(target=self._run, name="loader-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and join the thread (it wakes at once: its waits are on the stop event)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        seen: dict[int, tuple[int, float]] = {}
        try:
            while not self._stop.wait(self.dead_after / 5):
                self.store.add(f"beat/{self.rank}", 1)
                self._watch(seen)
        except Exception:
            log.debug("rank %d: heartbeat stopped", self.rank, exc_info=True)

    def _watch(self, seen: dict[int, tuple[int, float]]) -> None:
        """Watch the next rank's beats; past one declared dead, watch the one after it too."""
        peer = (self.rank + 1) % self.world
        while peer != self.rank and not self._stop.is_set():
            beats = self.store.add(f"beat/{peer}", 0)
            now = time.monotonic()
            if peer not in seen or seen[peer][0] != beats:
                seen[peer] = (beats, now)
                return
            if beats == 0 or now - seen[peer][1] < self.dead_after or self.store.check([f"done/{peer}"]):
                return  # not started yet (never called dead: it may just be late), alive, or finished
            if peer not in self._declared:
                self._declared.add(peer)
                log.warning(
                    "rank %d: rank %d stopped beating for %.1f s: reported dead", self.rank, peer, now - seen[peer][1]
                )
                self.store.append("dead", f"{peer},")
            peer = (peer + 1) % self.world
