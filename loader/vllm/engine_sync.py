"""``EngineSync``: a trainer's weights pushed into a running vLLM engine, each worker receiving exactly the boxes
its parameters take, from the trainer ranks holding them.

Two forms, one code: ``EngineSync(address, model)`` on every trainer rank (torchrun; FSDP2, TP/EP DTensors or
plain tensors), the engine's process running a :class:`~loader.vllm.SyncEndpoint` at ``address``; and
``EngineSync(llm, model)`` with the ``LLM`` in this process (one trainer rank, the endpoint run beside it).

Preparing (the constructor) sends each rank's tensor names, shapes, dtypes and local boxes to the endpoint; each
worker traces its model's ``load_weights`` over them (:mod:`loader.vllm.sync_plan`) and its wants come back; a
tensor that does not fit is a ``ValueError`` naming it on every trainer rank, before anything is sent. Each rank
then sends each worker the pieces of its wants that rank owns (:mod:`loader.vllm.sync_pieces`), cast once to the
engine's dtype; :meth:`EngineSync.push` with ``delta=True`` sends only the elements that changed since the last
push (each rank keeps a copy of the packets it last sent, in the engine's dtype).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..errors import PeerFailure
from ..placements import rank_and_world
from .sync_endpoint import SyncEndpoint
from .sync_pieces import local_parts, plan_pieces
from .sync_plan import Want
from .sync_push import header, prepare_outgoing, send_packets, stats
from .sync_report import SyncReport
from .sync_wire import Wire, device_type, get_json, join_group, put_json, refusals

__all__ = ["EngineSync", "SyncReport"]


class EngineSync:
    """Pushes ``trainer``'s ``state_dict()`` (this rank's shards of it) into an engine's workers (see the module).

    Args:
        engine: a :class:`~loader.vllm.SyncEndpoint`'s ``address`` (``"host:port"``), every trainer rank calling
            this collectively; or a running ``vllm.LLM`` of this process (started with
            ``worker_extension_cls="loader.vllm.SyncWorker"``).
        trainer: a module whose ``state_dict()`` keys are the checkpoint's keys (a transformers model), its
            tensors plain or DTensors (each rank sends its local shard).
        timeout: seconds a rendezvous, a send or a receive may take.
        digests: (an ``LLM`` engine) record each rebuilt parameter's digest in the reports.
        rank, trainers: this trainer rank and how many there are (default: ``torch.distributed``'s; 0 and 1 with
            an ``LLM``).

    Raises:
        ValueError: a trainer tensor that does not fit the engine's model (naming it); nothing was sent.
        PeerFailure: the endpoint or another member did not arrive within the timeout.
    """

    def __init__(
        self,
        engine: Any,
        trainer: torch.nn.Module,
        *,
        timeout: float = 300.0,
        digests: bool = False,
        rank: int | None = None,
        trainers: int | None = None,
    ):
        self.trainer, self.timeout, self.version, self.attempt = trainer, timeout, 0, 0
        self.endpoint = None if isinstance(engine, str) else SyncEndpoint(engine, timeout=timeout, digests=digests)
        if self.endpoint is not None:
            self.rank, self.trainers = 0, 1
            self.llm = engine
            _beside(self.endpoint.accept, lambda: self._prepare(self.endpoint.address), timeout)
        else:
            world = rank_and_world()
            self.rank = world[0] if rank is None else rank
            self.trainers = world[1] if trainers is None else trainers
            self._prepare(engine)

    def _prepare(self, address: str) -> None:
        self.store = join_group(address, self.rank, self.timeout)  # this rank's trainer group's keys
        state = self.trainer.state_dict()
        self.shapes = {k: (tuple(t.shape), t.dtype) for k, t in state.items()}
        keys = [(k, list(shape), str(dtype).removeprefix("torch.")) for k, (shape, dtype) in self.shapes.items()]
        prepare: dict = {"keys": keys, "trainers": self.trainers, "device": device_type(state.values())}
        try:
            prepare["parts"] = local_parts(state)[0]
        except ValueError as e:  # a placement with no boxes (Partial): every rank hears it from the endpoint
            prepare.update(parts={}, error=f"trainer rank {self.rank}: {e}")
        put_json(self.store, f"prepare/{self.rank}", prepare)
        plan = get_json(self.store, "plan", self.timeout, "waiting for the engine's plan")
        if "peer" in plan:  # another trainer rank of this group did not arrive
            raise PeerFailure(plan["peer"], stage="sync", ranks=tuple(plan["ranks"]), reason="timeout")
        if "error" in plan:
            raise ValueError(plan["error"])
        self.version = plan.get("version", 0)  # the version the engine serves: this group's pushes follow it
        everyone = [get_json(self.store, f"prepare/{r}", self.timeout, "reading the trainer ranks' boxes")["parts"]
                    for r in range(self.trainers)]  # fmt: skip
        self.wants = [[Want(k, tuple(o), tuple(n), getattr(torch, d)) for k, o, n, d in w] for w in plan["wants"]]
        self.shard_bytes = tuple(plan["shard_bytes"])
        self.mine = [[p for p in plan_pieces(w, everyone) if p.sender == self.rank] for w in self.wants]
        self.base: list[list[torch.Tensor] | None] = [None] * len(self.wants)
        self.wire = Wire(self.store, self.rank, self.trainers + len(self.wants), self.timeout)

    def push(self, delta: bool = False) -> SyncReport:
        """Send the trainer's current weights (every rank calls it); every worker serves them once this returns.
        With ``delta``, only the elements that changed since the last push travel (the first push is full).

        Raises:
            ValueError: a trainer tensor's shape or dtype is not the one prepared, or it is gone (naming it, on
                the rank that found it; naming the refusing rank's message on the others); nothing was sent.
            RuntimeError: a worker failed to build its new layers: every worker serves the old weights still
                (the version is not advanced; the message names each worker's error).
            PeerFailure: a trainer rank or a worker died or hung: the engine serves the old weights.
        """
        if self.endpoint is None:
            return self._push(delta)
        report = _beside(self.endpoint.receive, lambda: self._push(delta), self.timeout)
        got = self.endpoint.report
        return SyncReport(**{**vars(report), "worker_seconds": got.worker_seconds, "digests": got.digests})

    def _push(self, delta: bool) -> SyncReport:
        started = time.perf_counter()
        self.attempt += 1
        if self.rank == 0:
            put_json(self.store, f"push/{self.attempt}", self.version + 1)
        error, out = None, None
        try:
            state = self.trainer.state_dict()
            _check_unchanged(state, self.shapes)
            out = prepare_outgoing(local_parts(state)[1], self.mine, self.wants, self.base, delta)
        except Exception as e:  # refused on every rank before anything is sent (this rank raises its own error)
            error = e
            self.store.set(f"refused/{self.attempt}/{self.rank}", f"trainer rank {self.rank}: {e}")
        full = not delta or any(b is None for b in self.base)
        refused, full, version = header(self.wire, error is not None, full, self.version + 1)
        if refused:
            raise error or ValueError(refusals(self.store, self.attempt, self.trainers) + "; nothing was sent")
        sent = send_packets(self.wire, self.trainers, out, full)
        ok = self.wire.agree(True)
        total, changed = stats(self.wire, sent, out.changed)
        if not ok:
            raise RuntimeError("the push failed, the engine serves the old weights: " + self._failures(version))
        self.version, self.base = version, out.segments
        return SyncReport(version, total, self.shard_bytes, time.perf_counter() - started,
                          changed_bytes=changed, delta=not full)  # fmt: skip

    def _failures(self, version: int) -> str:
        keys = [f"failed/{version}/{w}" for w in range(len(self.wants))]
        return "; ".join(self.store.get(k).decode() for k in keys if self.store.check([k])) or "a worker failed"

    def verify(self, folder: str) -> tuple[dict[str, str], ...]:
        """(An ``LLM`` engine) per worker, the digests vLLM's own ``load_weights`` gives the parameters a push
        rebuilds from ``folder``'s safetensors (:meth:`SyncEndpoint.verify`, the engine's process otherwise)."""
        return self._endpoint().verify(folder)

    def versions(self) -> list[int]:
        """(An ``LLM`` engine) per worker, the version it serves (0: none pushed)."""
        return self._endpoint().versions()

    def close(self) -> None:
        """Leave the sync (an ``LLM`` engine: the workers forget their plans); the engine serves the last push."""
        if self.endpoint is not None:
            self.endpoint.close()
        self.wire, self.base = None, []

    def _endpoint(self) -> SyncEndpoint:
        if self.endpoint is None:
            raise RuntimeError("the engine is in another process: its SyncEndpoint answers this")
        return self.endpoint


def _beside(engine_side: Any, work: Any, timeout: float) -> Any:
    """Run ``engine_side()`` in a thread while ``work()`` runs here; ``work``'s result (its error first, then the
    engine side's)."""
    failed: list[BaseException] = []

    def drive() -> None:
        try:
            engine_side()
        except BaseException as e:  # re-raised on the caller's thread
            failed.append(e)

    thread = threading.Thread(target=drive, name="regiontrace-sync-endpoint", daemon=True)
    thread.start()
    try:
        result = work()
    finally:
        thread.join(timeout)
    if failed:
        raise failed[0]
    if thread.is_alive():
        raise TimeoutError(f"the engine's workers did not answer within {timeout} s")
    return result


def _check_unchanged(state: dict, shapes: dict) -> None:
    """Raises ValueError naming the first trainer tensor whose shape or dtype is not the prepared one."""
    for key, (shape, dtype) in shapes.items():
        t = state.get(key)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            now = "gone" if t is None else f"{tuple(t.shape)} {t.dtype}"
            raise ValueError(
                f"trainer tensor {key!r} is {now}, prepared as {shape} {dtype}: a sync pushes the tensors it was "
                "prepared for (make a new EngineSync); nothing was sent"
            )
