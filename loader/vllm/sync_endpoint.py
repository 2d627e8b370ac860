"""``SyncEndpoint``: the engine's end of a weight sync, in the process holding the ``LLM``.

The endpoint hosts the rendezvous (:mod:`loader.vllm.sync_wire`; its :attr:`SyncEndpoint.address` is what the
trainer ranks' :class:`~loader.vllm.EngineSync` connect to). Between ``generate`` calls the engine's process calls
:meth:`SyncEndpoint.accept` once per trainer group (the trainers' tensors and boxes arrive; each worker plans its
wants through ``collective_rpc``, the wants are published back; the workers join the group) and
:meth:`SyncEndpoint.receive` per push (drives the workers' receive; returns the version they serve). The engine
serves no request meanwhile.

Trainer groups come one after another: once a group is over (its trainers left, or a peer failure ended it), the
next :meth:`~SyncEndpoint.accept` takes the next group's ranks at the same address; the engine serves the last
good version until that group's first push, whose version follows it. Each group has its own keys, sync id and
transport group (gloo, or NCCL where the trainers' and the engine's tensors are all on CUDA).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..errors import PeerFailure
from .sync_pieces import plan_pieces
from .sync_plan import Want
from .sync_report import SyncReport
from .sync_wire import (
    HOST,
    get_json,
    group_prefix,
    group_store,
    host_store,
    open_tickets,
    put_json,
    refusals,
    skip_ticket,
    transport_backend,
    wait_push,
)

__all__ = ["SyncEndpoint"]


class SyncEndpoint:
    """The engine side of weight syncs, one trainer group after another (see the module).

    Args:
        llm: a running ``vllm.LLM`` started with ``worker_extension_cls="loader.vllm.SyncWorker"``.
        trainers: how many trainer ranks push (each calls :class:`~loader.vllm.EngineSync` on :attr:`address`).
        port: the rendezvous' port (0: a free one).
        host: the name or address the trainer ranks reach this machine by, the host of :attr:`address`
            (default ``127.0.0.1``: trainers on this host; the rendezvous listens on every interface).
        timeout: seconds a rendezvous, a collective or a wait for a peer may take.
        digests: record each rebuilt parameter's digest in the reports (a check; costs a pass over the bytes).
    """

    def __init__(
        self,
        llm: Any,
        *,
        trainers: int = 1,
        port: int = 0,
        timeout: float = 300.0,
        digests: bool = False,
        host: str = HOST,
    ):
        self.llm, self.trainers, self.timeout, self.digests = llm, trainers, timeout, digests
        self.id: str | None = None  # the sync the workers serve (the last group's that connected)
        self.group, self.attempt, self.version, self.over = 0, 0, 0, True
        self.root = host_store(port, timeout)
        open_tickets(self.root, trainers)
        self.address = f"{host}:{self.root.port}"
        self.store: Any = None  # the current group's keys
        self.report: SyncReport | None = None
        self.wants: list[list[Want]] = []
        self.backend = "gloo"

    def accept(self) -> None:
        """Take the next trainer group's prepare (see the module): plan every worker, publish the wants, form the
        group. Until it connects, the workers keep serving (and :meth:`versions` answers) the last group's sync.

        Raises:
            ValueError: a trainer tensor that does not fit the engine's model, or has no boxes (a ``Partial``
                placement), or trainer ranks that disagree (naming them); every trainer rank raises it too,
                nothing was sent.
            PeerFailure: a trainer rank did not arrive within the timeout (the group's other ranks raise it too).
        """
        self.group += 1
        store, self.over = group_store(self.root, self.group), True
        try:
            prepares = [get_json(store, f"prepare/{r}", self.timeout, f"waiting for trainer rank {r}'s prepare")
                        for r in range(self.trainers)]  # fmt: skip
        except PeerFailure as e:
            missing = [r for r in range(self.trainers) if not store.check([f"prepare/{r}"])]
            for r in missing:
                skip_ticket(self.root, r, self.group)  # its next arrival is the next group's
            said = f"trainer group {self.group}: trainer ranks {missing} did not arrive ({e})"
            put_json(store, "plan", {"peer": said, "ranks": missing})
            raise PeerFailure(said, stage="sync", ranks=tuple(missing), reason=e.reason) from e
        sync, planned = uuid.uuid4().hex, []
        try:
            self._plan(store, sync, prepares, planned)
        except ValueError as e:
            put_json(store, "plan", {"error": str(e)})
            if planned:  # some worker planned it: forget that plan
                self.llm.collective_rpc("regiontrace_sync_close", args=(sync,))
            raise
        parts = [p["parts"] for p in prepares]
        connect = (sync, f"{self.address}/{group_prefix(self.group)}", self.trainers, parts, self.timeout)
        self.llm.collective_rpc("regiontrace_sync_connect", args=connect)
        if self.id is not None:  # the last group's plan (and its broken or idle transport) is done with
            self.llm.collective_rpc("regiontrace_sync_close", args=(self.id,))
        self.id, self.store, self.attempt, self.over = sync, store, 0, False

    def _plan(self, store: Any, sync: str, prepares: list[dict], planned: list) -> None:
        keys = prepares[0]["keys"]
        for r, p in enumerate(prepares):
            if "error" in p:
                raise ValueError(p["error"])
            if p["keys"] != keys or p["trainers"] != self.trainers:
                raise ValueError(f"trainer rank {r} prepared other tensors (or world) than trainer rank 0")
        answers = sorted(self.llm.collective_rpc("regiontrace_sync_prepare", args=(sync, keys, self.digests)),
                         key=_rank)  # fmt: skip
        planned.extend(a for a in answers if "error" not in a)
        errors = [a["error"] for a in answers if "error" in a]
        if errors:
            raise ValueError(f"the trainer's tensors do not fit the engine's model: {errors[0]}")
        self.wants = [[Want(k, tuple(o), tuple(n), _dtype(d)) for k, o, n, d in a["wants"]] for a in answers]
        parts = [p["parts"] for p in prepares]
        for wants in self.wants:
            plan_pieces(wants, parts)  # every wanted element held by some trainer rank (else ValueError)
        self.shard_bytes = tuple(a["shard_bytes"] for a in answers)
        self.backend = transport_backend([engine_device(self.llm), *(p.get("device", "cpu") for p in prepares)])
        store.set("backend", self.backend)  # read by every member's Wire
        plan = {"wants": [a["wants"] for a in answers], "shard_bytes": self.shard_bytes, "version": self.version}
        put_json(store, "plan", plan)

    def receive(self, wait: float | None = None) -> int:
        """Take one push: wait (up to ``wait`` seconds, default the timeout) for the trainers to start it, drive
        the workers' receive, and return the version every worker serves (its :class:`SyncReport` in
        :attr:`report`).

        Raises:
            ValueError: a trainer rank refused the push (naming its tensor); nothing was sent, the old weights
                are served, the next push may follow.
            RuntimeError: a worker failed to build its new layers: every worker serves the old weights.
            PeerFailure: a trainer rank or a worker died or hung: every worker serves the old weights; the group
                is over (:meth:`accept` takes the next one).
            RuntimeError: no trainer group is connected (none accepted yet, or the last one is over).
        """
        if self.over:
            raise RuntimeError("no trainer group is connected to this endpoint: accept() takes the next one")
        self.attempt = wait_push(self.store, self.attempt, self.timeout if wait is None else wait)
        started = time.perf_counter()
        answers = sorted(self.llm.collective_rpc("regiontrace_sync_receive", args=(self.id, self.attempt)), key=_rank)
        peers = [a for a in answers if a["peer"]]
        if peers:
            self.over = True
            raise PeerFailure(f"worker {peers[0]['rank']}: {peers[0]['peer']}", stage="sync", reason=peers[0]["reason"])
        if any(a["refused"] for a in answers):
            raise ValueError(refusals(self.store, self.attempt, self.trainers))
        errors = [a["error"] for a in answers if a["error"]]
        if errors:
            raise RuntimeError("the push failed, the engine serves the old weights: " + "; ".join(errors))
        self.version = agreed(answers)
        self.llm.reset_prefix_cache()  # no cached block of the old weights is reused
        self.report = report(answers, self.version, time.perf_counter() - started, self.digests)
        return self.version

    def verify(self, folder: str) -> tuple[dict[str, str], ...]:
        """Per worker, the digests vLLM's own ``load_weights`` gives the parameters a push rebuilds, loading
        ``folder``'s safetensors (see :meth:`SyncWorker.regiontrace_sync_verify`)."""
        return tuple(self.llm.collective_rpc("regiontrace_sync_verify", args=(self._sync(), folder)))

    def versions(self) -> list[int]:
        """Per worker, the version it serves (0: none pushed; a worker the current group has not pushed to yet
        serves the last version an earlier group pushed)."""
        served = self.llm.collective_rpc("regiontrace_sync_version", args=(self._sync(),))
        return [v or self.version for v in served]

    def close(self) -> None:
        """Forget the workers' plans; the engine keeps serving the last weights pushed (a later :meth:`accept`
        takes another group)."""
        if self.id is not None:
            self.llm.collective_rpc("regiontrace_sync_close", args=(self.id,))
        self.id, self.over = None, True

    def _sync(self) -> str:
        if self.id is None:
            raise RuntimeError("no trainer group has connected to this endpoint (or it was closed)")
        return self.id


def report(answers: list[dict], version: int, seconds: float, digests: bool) -> SyncReport:
    """The push's :class:`SyncReport` from the workers' answers."""
    return SyncReport(
        version=version,
        bytes_sent=tuple(a["bytes"] for a in answers),
        shard_bytes=tuple(a["shard_bytes"] for a in answers),
        seconds=seconds,  # from the trainers' start of the push
        worker_seconds=tuple(a["seconds"] for a in answers),
        digests=tuple(a["digests"] for a in answers) if digests else None,
        changed_bytes=tuple(a["changed"] for a in answers),
        delta=answers[0]["delta"],
    )


def engine_device(llm: Any) -> str:
    """The device type the engine's workers hold their weights on (``"cuda"``, ``"cpu"``, ...)."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    return str(getattr(getattr(config, "device_config", None), "device_type", "cpu") or "cpu")


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _rank(answer: dict) -> int:
    return answer["rank"]


def agreed(answers: list[dict]) -> int:
    versions = {a["version"] for a in answers}
    if len(versions) != 1:
        raise RuntimeError(f"the engine's workers serve different versions: {sorted(versions)}")
    return versions.pop()
