"""Failing together: the outcome of each stage of a distributed load agreed through the process group's
store, with a timeout and a heartbeat (:class:`LoadSession`), so that a rank that fails, hangs or dies turns
into the same error on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from .._torch import default_store
from ..options import DEFAULT_TIMEOUT, timeout_seconds
from ..placements import rank_and_world
from .remote import Failure, decode_failure, encode_failure, remote_error

log = logging.getLogger("loader")

HEARTBEAT_LIMIT = 30.0
"""At most this many seconds without a heartbeat and a rank that had started the load is reported dead."""


_STAGES = {
    "resolving": "Resolving the checkpoint",
    "planning": "Planning the load",
    "reading": "Reading the checkpoint",
    "preparing": "Preparing the save",
    "writing": "Writing the checkpoint",
    "finishing": "Finishing the save",
    "transferring": "Transferring the weights",
}


_LOAD_IDS = itertools.count()

_SAVE_STAGES = ("preparing", "writing", "finishing")


def fake_world() -> bool:
    """Whether the default process group is torch's fake one (``init_process_group("fake")``): one process
    playing one rank of the world, with no peers and collectives that do nothing."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend() == "fake"


class Heartbeat:
    """A rank's heartbeat through the store: a background thread beats this rank's counter every
    ``dead_after / 5`` seconds and watches the next live rank's; a rank that started the load (one beat) and
    stops beating for ``dead_after`` seconds, without having marked its load done, is appended to the store's
    ``dead`` list, which every rank waiting at an agreement point reads."""

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
        """Stop beating and wait a little for the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(5.0, 2 * self.dead_after))

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
        while peer != self.rank:
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


class LoadSession:
    """The fail-together protocol of one distributed load, carried by the default process group's store.

    At each agreement point (end of planning, end of reading) every rank posts its outcome to the store and
    waits, at most ``timeout`` seconds, until every rank has posted. No collective is involved, so a rank
    that never arrives blocks nobody: the waiting ranks see in the store which ranks are missing. One
    verdict per agreement point is chosen by the store's compare-and-set and obeyed by every rank, a hung
    rank that resumes after the others gave up included. A background thread beats a per-rank counter and
    watches the next live rank's: a rank that started the load and stops beating for ``dead_after`` seconds
    (``min(timeout / 2, HEARTBEAT_LIMIT)``) is reported dead without waiting for the full timeout.

    Use as a context manager around the load (it starts and stops the heartbeat); collective: every rank of
    the default group opens one session per load, in the same order.

    Under torch's fake process group (:func:`fake_world`: dry runs, tests playing one rank at a time) there are
    no peers to agree with and its store cannot count: the session is ``solo`` — no heartbeat, an in-process
    store, and :meth:`agree` raises this rank's own error (a save refuses: it needs every rank's shards).

    Args:
        timeout: seconds (or a ``timedelta``) to wait at each agreement point; None waits without limit
            (dead ranks are still detected).
    """

    def __init__(self, timeout: float | datetime.timedelta | None = DEFAULT_TIMEOUT) -> None:
        self.rank, self.world = rank_and_world()
        self.timeout = timeout_seconds(timeout)
        self.dead_after = HEARTBEAT_LIMIT if self.timeout is None else min(HEARTBEAT_LIMIT, self.timeout / 2)
        self.solo = fake_world()
        store = dist.HashStore() if self.solo else default_store()
        self.store = dist.PrefixStore(f"loader/{next(_LOAD_IDS)}", store)
        self._heartbeat = Heartbeat(self.store, self.rank, self.world, self.dead_after)

    def __enter__(self) -> LoadSession:
        if self.solo:
            return self
        self._heartbeat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.solo:
            return
        try:
            self.store.set(f"done/{self.rank}", "1")  # before the beats stop: not to be taken for dead
        except Exception:
            log.debug("rank %d: could not mark the load done", self.rank, exc_info=True)
        self._heartbeat.stop()

    # -- agreement --------------------------------------------------------------------------------------

    def agree(self, error: BaseException | None, stage: str, *, bounded: bool = True, point: str = "") -> None:
        """Post this rank's outcome of ``stage``, wait for every rank's, and raise on every rank if any failed.

        Args:
            error: this rank's failure, or None.
            stage: ``"resolving"``, ``"planning"`` or ``"reading"``.
            bounded: wait at most the session's timeout (False: wait without limit, e.g. for a download;
                dead ranks are still detected).
            point: which agreement point of ``stage`` this is, when a stage has several (``""``: its end).

        Raises:
            Exception: some rank failed: the lowest failed rank's error as its own type when that is a builtin
                or one of the project's (with its attributes, e.g. ``path`` and ``key``), else as its nearest
                such base class or :class:`~loader.errors.RemoteError` (:mod:`.remote`); it carries ``rank``,
                ``stage``, ``remote_type`` and ``remote_traceback``, and lists the other failed ranks.
            PeerFailure: some rank did not arrive within the timeout, died, or this rank arrived after the
                others gave up waiting for it.
            RuntimeError: a save stage in a ``solo`` session (torch's fake process group).
        """
        if self.solo:
            self._agree_alone(error, stage)
            return
        with peer_errors(stage, "agreeing on the outcome through the store"):  # e.g. the store's host died
            verdict, failed = self._exchange(error, f"{stage}@{point}" if point else stage, bounded)
        if verdict == "ok":
            if failed:
                raise remote_error(failed, _STAGES[stage], stage) from error
            return
        reason, _, names = verdict.partition(":")
        raise _peer_failure(self, stage, reason, tuple(int(r) for r in names.split(",") if r)) from error

    def gather(self, name: str, value: str, stage: str = "reading", *, side: str | None = None) -> list[str]:
        """Every rank's ``value`` posted under ``name`` (index = rank), waiting at most the timeout. Collective; a
        ``solo`` session returns this rank's alone. ``side``: a larger value posted first, which only the ranks that
        want it fetch (:meth:`sides`), so that no rank reads every rank's.

        Raises:
            PeerFailure: a rank did not post its value within the timeout.
        """
        if self.solo:
            return [value]
        s, keys = self.store, [f"gather/{name}/{r}" for r in range(self.world)]
        with peer_errors(stage, f"gathering {name} from every rank"):
            if side is not None:
                s.set(f"side/{name}/{self.rank}", side)  # before the value: whoever saw the value finds the side
            s.set(keys[self.rank], value)
            if self.timeout is None:
                s.wait(keys)
            else:
                s.wait(keys, datetime.timedelta(seconds=self.timeout))
            return [v.decode() for v in s.multi_get(keys)]

    def from_rank_zero(self, name: str, value: str | None, stage: str = "planning") -> str:
        """Rank 0's ``value`` posted under ``name``, on every rank: rank 0 passes it, the others ``None`` and wait for
        it (at most the timeout; a rank reported dead stops the wait). Collective; a ``solo`` session returns ``value``.

        Raises:
            PeerFailure: rank 0 did not post within the timeout, or died.
        """
        if self.solo or self.rank == 0:
            if not self.solo:
                with peer_errors(stage, f"posting {name} to the other ranks"):
                    self.store.set(f"zero/{name}", value or "")
            return value or ""
        key, s = f"zero/{name}", self.store
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        delay = 0.001
        with peer_errors(stage, f"waiting for rank 0's {name}"):
            while not s.check([key]):
                if s.check(["dead"]):
                    dead = tuple(sorted({int(r) for r in s.get("dead").decode().split(",") if r}))
                    raise _peer_failure(self, stage, "died", dead)
                if deadline is not None and time.monotonic() >= deadline:
                    raise _peer_failure(self, stage, "timeout", (0,))
                time.sleep(delay)
                delay = min(2 * delay, poll_cap(self.world))
            return s.get(key).decode()

    def sides(self, name: str, ranks: list[int], stage: str = "reading") -> list[str]:
        """The ``side`` values ``ranks`` posted with :meth:`gather` under ``name`` (each of them passed ``side``), once
        this rank's gather has returned."""
        with peer_errors(stage, f"reading {name} from ranks {ranks}"):
            return [v.decode() for v in self.store.multi_get([f"side/{name}/{r}" for r in ranks])] if ranks else []

    def _agree_alone(self, error: BaseException | None, stage: str) -> None:
        """A ``solo`` session: this rank's outcome is the outcome; a save is refused."""
        if stage in _SAVE_STAGES:
            raise RuntimeError(
                f"save_hf_checkpoint under torch's fake process group (rank {self.rank} of {self.world}): a "
                "fake world has no peers to write the other ranks' shards, so no whole checkpoint can be "
                "saved; save from a real process group (gloo, nccl) or from one process"
            ) from error
        if error is not None:
            raise error

    def _exchange(self, error: BaseException | None, stage: str, bounded: bool) -> tuple[str, list[Failure]]:
        """Post this rank's outcome; the verdict and, when it is ``"ok"``, every failed rank's outcome."""
        s = self.store
        if error is not None:
            s.set(f"{stage}/failed/{s.add(f'{stage}/failed', 1)}", encode_failure(error, self.rank))
        s.set(f"{stage}/here/{self.rank}", "1")
        s.add(f"{stage}/count", 1)
        verdict = _verdict(s, stage, self.world, self.timeout if bounded else None)
        if verdict != "ok":
            return verdict, []
        count = s.add(f"{stage}/failed", 0)
        failed = [decode_failure(s.get(f"{stage}/failed/{i}")) for i in range(1, count + 1)]
        return verdict, sorted(failed, key=lambda f: (f.rank is None, f.rank or 0))


def check_same(name: str, values: list[str], stage: str = "reading") -> None:
    """Raise on every rank when the ranks' ``values`` of the setting ``name`` (index = rank) differ.

    Raises:
        ValueError: naming each rank's value.
    """
    if len(set(values)) > 1:
        listed = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
        raise ValueError(f"{_STAGES[stage]} failed: the ranks disagree on {name} ({listed}); give all the same")


def _verdict(store: Any, stage: str, world: int, timeout: float | None) -> str:
    """Wait for the verdict of ``stage``: ``"ok"`` once every rank posted, else the first one decided:
    ``"died:<ranks>"``, or past ``timeout`` ``"timeout:<the ranks that did not post>"``."""
    s, key = store, f"{stage}/verdict"
    deadline = None if timeout is None else time.monotonic() + timeout
    delay = 0.001
    while True:
        if s.add(f"{stage}/count", 0) == world:
            return _decide(s, key, "ok")
        if s.check([key]):
            return s.get(key).decode()
        if s.check(["dead"]):
            dead = sorted({int(r) for r in s.get("dead").decode().split(",") if r})
            return _decide(s, key, "died:" + ",".join(map(str, dead)))
        if deadline is not None and time.monotonic() >= deadline:
            missing = [r for r in range(world) if not s.check([f"{stage}/here/{r}"])]
            if missing:
                return _decide(s, key, "timeout:" + ",".join(map(str, missing)))
        time.sleep(delay)
        delay = min(2 * delay, poll_cap(world))


def poll_cap(world: int) -> float:
    """The longest sleep between two looks at the store while waiting for a verdict: 2 ms up to 8 ranks (a verdict
    seen within a few ms of the last rank's arrival: 3-45 ms of a 4-rank warm load were this wait at 50 ms), growing
    with the world to 50 ms (the store's host answers every rank's polls)."""
    return min(0.05, 0.002 * max(1.0, world / 8))


def _peer_failure(session: LoadSession, stage: str, reason: str, ranks: tuple[int, ...]) -> BaseException:
    """The :class:`~loader.errors.PeerFailure` ``session`` raises for a ``"timeout"`` or ``"died"`` verdict."""
    from ..errors import PeerFailure

    what, listed = _STAGES[stage], ", ".join(map(str, ranks))
    limit = "the timeout" if session.timeout is None else f"the {session.timeout:g} s timeout"  # ranks may differ
    if reason == "timeout" and session.rank in ranks:
        text = (
            f"{what} failed: this rank ({session.rank}) finished {stage} after the other ranks had stopped "
            f"waiting for it ({limit})"
        )
    elif reason == "timeout":
        text = (
            f"{what} failed: rank(s) {listed} did not finish {stage} within {limit} (hung, or slower "
            "than the timeout allows); every other rank stopped"
        )
    elif session.rank in ranks:
        text = (
            f"{what} failed: this rank ({session.rank}) was reported dead by its peers (its heartbeat "
            f"stopped for {session.dead_after:g} s)"
        )
    else:
        text = (
            f"{what} failed: a peer died during {stage}: rank(s) {listed} stopped responding (no "
            f"heartbeat for {session.dead_after:g} s: the process exited, was killed or froze)"
        )
    return PeerFailure(text, stage=stage, ranks=ranks, reason=reason)


def _decide(store: Any, key: str, verdict: str) -> str:
    """The verdict of an agreement point: the first one set wins, every rank reads the same."""
    return store.compare_set(key, "", verdict).decode()


@contextlib.contextmanager
def peer_errors(stage: str, doing: str) -> Iterator[None]:
    """Translate a failed collective or store operation (gloo's bare "Connection closed by peer", a timeout)
    into :class:`~loader.errors.PeerFailure` (``reason="connection"``)."""
    from ..errors import PeerFailure

    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as e:  # DistBackendError is a RuntimeError
        raise PeerFailure(
            f"{_STAGES[stage]} failed: a peer died or left the process group while {doing} ({type(e).__name__}: {e})",
            stage=stage,
            reason="connection",
        ) from e
