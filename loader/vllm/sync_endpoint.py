"""``SyncEndpoint``: the engine's end of a weight sync, in the process holding the ``LLM``.

The endpoint hosts the rendezvous (:mod:`loader.vllm.sync_wire`; its :attr:`SyncEndpoint.address` is what the
trainer ranks' :class:`~loader.vllm.EngineSync` connect to). Between ``generate`` calls the engine's process calls
:meth:`SyncEndpoint.accept` once (the trainers' tensors and boxes arrive; each worker plans its wants through
``collective_rpc``, the wants are published back; the workers join the group) and :meth:`SyncEndpoint.receive`
per push (drives the workers' receive; returns the version they serve). The engine serves no request meanwhile.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from ..errors import PeerFailure
from .sync_pieces import plan_pieces
from .sync_plan import Want
from .sync_report import SyncReport
from .sync_wire import HOST, get_json, host_store, put_json

__all__ = ["SyncEndpoint"]


class SyncEndpoint:
    """The engine side of one weight sync (see the module).

    Args:
        llm: a running ``vllm.LLM`` started with ``worker_extension_cls="loader.vllm.SyncWorker"``.
        trainers: how many trainer ranks push (each calls :class:`~loader.vllm.EngineSync` on :attr:`address`).
        port: the rendezvous' port (0: a free one).
        timeout: seconds a rendezvous, a collective or a wait for a peer may take.
        digests: record each rebuilt parameter's digest in the reports (a check; costs a pass over the bytes).
    """

    def __init__(self, llm: Any, *, trainers: int = 1, port: int = 0, timeout: float = 300.0, digests: bool = False):
        self.llm, self.trainers, self.timeout, self.digests = llm, trainers, timeout, digests
        self.id, self.attempt, self.version = uuid.uuid4().hex, 0, 0
        self.store = host_store(port, timeout)
        self.address = f"{HOST}:{self.store.port}"
        self.report: SyncReport | None = None
        self.wants: list[list[Want]] = []

    def accept(self) -> None:
        """Take the trainers' prepare (see the module): plan every worker, publish the wants, form the group.

        Raises:
            ValueError: a trainer tensor that does not fit the engine's model, or trainer ranks that disagree
                (naming them); every trainer rank raises it too, nothing was sent.
            PeerFailure: a trainer rank did not arrive within the timeout.
        """
        prepares = [get_json(self.store, f"prepare/{r}", self.timeout, f"waiting for trainer rank {r}'s prepare")
                    for r in range(self.trainers)]  # fmt: skip
        keys, parts = prepares[0]["keys"], [p["parts"] for p in prepares]
        try:
            self._plan(keys, prepares)
        except ValueError as e:
            put_json(self.store, "plan", {"error": str(e)})
            self.llm.collective_rpc("regiontrace_sync_close", args=(self.id,))
            raise
        connect = (self.id, self.address, self.trainers, parts, self.timeout)
        self.llm.collective_rpc("regiontrace_sync_connect", args=connect)

    def _plan(self, keys: list, prepares: list[dict]) -> None:
        for r, p in enumerate(prepares):
            if "error" in p:
                raise ValueError(p["error"])
            if p["keys"] != keys or p["trainers"] != self.trainers:
                raise ValueError(f"trainer rank {r} prepared other tensors (or world) than trainer rank 0")
        answers = sorted(self.llm.collective_rpc("regiontrace_sync_prepare", args=(self.id, keys, self.digests)),
                         key=_rank)  # fmt: skip
        errors = [a["error"] for a in answers if "error" in a]
        if errors:
            raise ValueError(f"the trainer's tensors do not fit the engine's model: {errors[0]}")
        self.wants = [[Want(k, tuple(o), tuple(n), _dtype(d)) for k, o, n, d in a["wants"]] for a in answers]
        parts = [p["parts"] for p in prepares]
        for wants in self.wants:
            plan_pieces(wants, parts)  # every wanted element held by some trainer rank (else ValueError)
        self.shard_bytes = tuple(a["shard_bytes"] for a in answers)
        put_json(self.store, "plan", {"wants": [a["wants"] for a in answers], "shard_bytes": self.shard_bytes})

    def receive(self, wait: float | None = None) -> int:
        """Take one push: wait (up to ``wait`` seconds, default the timeout) for the trainers to start it, drive
        the workers' receive, and return the version every worker serves (its :class:`SyncReport` in
        :attr:`report`).

        Raises:
            ValueError: a trainer rank refused the push (naming its tensor); nothing was sent, the old weights
                are served, the next push may follow.
            RuntimeError: a worker failed to build its new layers: every worker serves the old weights.
            PeerFailure: a trainer rank or a worker died or hung: every worker serves the old weights; the sync is
                over (a new endpoint and :class:`~loader.vllm.EngineSync` make another).
        """
        self.attempt += 1
        get_json(self.store, f"push/{self.attempt}", self.timeout if wait is None else wait, "waiting for a push")
        started = time.perf_counter()
        answers = sorted(self.llm.collective_rpc("regiontrace_sync_receive", args=(self.id, self.attempt)), key=_rank)
        peers = [a for a in answers if a["peer"]]
        if peers:
            raise PeerFailure(f"worker {peers[0]['rank']}: {peers[0]['peer']}", stage="sync", reason=peers[0]["reason"])
        if any(a["refused"] for a in answers):
            raise ValueError(refusals(self.store, self.attempt, self.trainers))
        errors = [a["error"] for a in answers if a["error"]]
        if errors:
            raise RuntimeError("the push failed, the engine serves the old weights: " + "; ".join(errors))
        self.version = agreed(answers)
        self.llm.reset_prefix_cache()  # no cached block of the old weights is reused
        self.report = SyncReport(
            version=self.version,
            bytes_sent=tuple(a["bytes"] for a in answers),
            shard_bytes=tuple(a["shard_bytes"] for a in answers),
            seconds=time.perf_counter() - started,  # from the trainers' start of the push
            worker_seconds=tuple(a["seconds"] for a in answers),
            digests=tuple(a["digests"] for a in answers) if self.digests else None,
            changed_bytes=tuple(a["changed"] for a in answers),
            delta=answers[0]["delta"],
        )
        return self.version

    def verify(self, folder: str) -> tuple[dict[str, str], ...]:
        """Per worker, the digests vLLM's own ``load_weights`` gives the parameters a push rebuilds, loading
        ``folder``'s safetensors (see :meth:`SyncWorker.regiontrace_sync_verify`)."""
        return tuple(self.llm.collective_rpc("regiontrace_sync_verify", args=(self.id, folder)))

    def versions(self) -> list[int]:
        """Per worker, the version it serves (0: none pushed)."""
        return self.llm.collective_rpc("regiontrace_sync_version", args=(self.id,))

    def close(self) -> None:
        """Forget the workers' plans; the engine keeps serving the last weights pushed."""
        self.llm.collective_rpc("regiontrace_sync_close", args=(self.id,))


def refusals(store: Any, attempt: int, trainers: int) -> str:
    """The messages of the trainer ranks that refused push ``attempt``."""
    keys = [f"refused/{attempt}/{r}" for r in range(trainers)]
    said = [store.get(k).decode() for k in keys if store.check([k])]
    return "; ".join(said) or f"a trainer rank refused push {attempt}"


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
