"""The verdict of an agreement point, decided through a session's store: every rank posts its outcome of a stage,
the first verdict set (``"ok"``, ``"died:<ranks>"``, ``"timeout:<ranks>"``) is the one every rank obeys, and the
exceptions it turns into (the failed rank's error, or :class:`~loader.errors.PeerFailure`).

Vocabulary: an *outcome* is one rank's result of a stage (None, or its failure as :mod:`.remote` encodes it); to
*post* is to set a value in the store for the other ranks; a *point* is one agreement point of a stage
(``"reading@round3"``; the stage's name alone: its end).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from ..errors import PeerFailure
from .remote import Failure, decode_failure, encode_failure

#: every stage of a distributed flow, in words
STAGES = {
    "resolving": "Resolving the checkpoint",
    "planning": "Planning the load",
    "reading": "Reading the checkpoint",
    "preparing": "Preparing the save",
    "writing": "Writing the checkpoint",
    "finishing": "Finishing the save",
    "transferring": "Transferring the weights",
}

SAVE_STAGES = ("preparing", "writing", "finishing")


def post_outcome(
    store: Any, error: BaseException | None, point: str, rank: int, world: int, timeout: float | None
) -> tuple[str, list[Failure]]:
    """Post this rank's outcome of ``point``; the verdict and, when it is ``"ok"``, every failed rank's outcome
    (lowest rank first)."""
    s = store
    if error is not None:
        s.set(f"{point}/failed/{s.add(f'{point}/failed', 1)}", encode_failure(error, rank))
    s.set(f"{point}/here/{rank}", "1")
    s.add(f"{point}/count", 1)
    verdict = wait_verdict(s, point, world, timeout)
    if verdict != "ok":
        return verdict, []
    count = s.add(f"{point}/failed", 0)
    failed = [decode_failure(s.get(f"{point}/failed/{i}")) for i in range(1, count + 1)]
    return verdict, sorted(failed, key=lambda f: (f.rank is None, f.rank or 0))


def wait_verdict(store: Any, point: str, world: int, timeout: float | None) -> str:
    """Wait for the verdict of ``point``: ``"ok"`` once every rank posted, else the first one decided:
    ``"died:<ranks>"``, or past ``timeout`` ``"timeout:<the ranks that did not post>"``."""
    s, key = store, f"{point}/verdict"
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while True:
        if s.add(f"{point}/count", 0) == world:
            return decide(s, key, "ok")
        if s.check([key]):
            return s.get(key).decode()
        if s.check(["dead"]):
            return decide(s, key, "died:" + ",".join(map(str, dead_ranks(s))))
        if deadline is not None and time.monotonic() >= deadline:
            missing = [r for r in range(world) if not s.check([f"{point}/here/{r}"])]
            if missing:
                return decide(s, key, "timeout:" + ",".join(map(str, missing)))
        time.sleep(delay)
        delay = min(2 * delay, poll_cap(world))


def dead_ranks(store: Any) -> tuple[int, ...]:
    """The ranks the store's ``dead`` list names, ascending (call once ``store.check(["dead"])``)."""
    return tuple(sorted({int(r) for r in store.get("dead").decode().split(",") if r}))


def poll_cap(world: int) -> float:
    """The longest sleep between two looks at the store while waiting for a verdict: 2 ms up to 8 ranks (a verdict
    seen within a few ms of the last rank's arrival: 3-45 ms of a 4-rank warm load were this wait at 50 ms), growing
    with the world to 50 ms (the store's host answers every rank's polls)."""
    return min(0.05, 0.002 * max(1.0, world / 8))


def decide(store: Any, key: str, verdict: str) -> str:
    """The verdict of an agreement point: the first one set wins, every rank reads the same."""
    return store.compare_set(key, "", verdict).decode()


def peer_failure(
    stage: str, reason: str, ranks: tuple[int, ...], *, rank: int, timeout: float | None, dead_after: float
) -> PeerFailure:
    """The :class:`~loader.errors.PeerFailure` rank ``rank`` raises for a ``"timeout"`` or ``"died"`` verdict."""
    what, listed = STAGES[stage], ", ".join(map(str, ranks))
    limit = "the timeout" if timeout is None else f"the {timeout:g} s timeout"  # ranks may differ
    if reason == "timeout" and rank in ranks:
        text = (
            f"{what} failed: this rank ({rank}) finished {stage} after the other ranks had stopped "
            f"waiting for it ({limit})"
        )
    elif reason == "timeout":
        text = (
            f"{what} failed: rank(s) {listed} did not finish {stage} within {limit} (hung, or slower "
            "than the timeout allows); every other rank stopped"
        )
    elif rank in ranks:
        text = (
            f"{what} failed: this rank ({rank}) was reported dead by its peers (its heartbeat stopped for "
            f"{dead_after:g} s)"
        )
    else:
        text = (
            f"{what} failed: a peer died during {stage}: rank(s) {listed} stopped responding (no "
            f"heartbeat for {dead_after:g} s: the process exited, was killed or froze)"
        )
    return PeerFailure(text, stage=stage, ranks=ranks, reason=reason)


@contextlib.contextmanager
def peer_errors(stage: str, doing: str) -> Iterator[None]:
    """Translate a failed collective or store operation (gloo's bare "Connection closed by peer", a timeout)
    into :class:`~loader.errors.PeerFailure` (``reason="connection"``)."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as e:  # DistBackendError is a RuntimeError
        raise PeerFailure(
            f"{STAGES[stage]} failed: a peer died or left the process group while {doing} ({type(e).__name__}: {e})",
            stage=stage,
            reason="connection",
        ) from e


def check_same(name: str, values: list[str], stage: str = "reading") -> None:
    """Raise on every rank when the ranks' ``values`` of the setting ``name`` (index = rank) differ.

    Raises:
        ValueError: naming each rank's value.
    """
    if len(set(values)) > 1:
        listed = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ValueError(f"{STAGES[stage]} failed: the ranks disagree on {name} ({listed}); give all the same")
