"""``EngineSync``: a trainer's weights pushed into a running vLLM engine of the same process (its ``LLM``), each
worker receiving exactly the boxes its parameters take.

The engine is started with ``worker_extension_cls="loader.vllm.SyncWorker"``. Preparing (the constructor) sends
the trainer's tensor names, shapes and dtypes to every worker; each traces its model's ``load_weights`` over them
(:mod:`loader.vllm.sync_plan`) and answers its wants; a tensor that does not fit is a ``ValueError`` naming it,
before anything is sent. Then every worker joins the trainer's gloo group (:mod:`loader.vllm.sync_wire`).
:meth:`EngineSync.push` sends each worker its packet while a thread drives the workers' receive (``collective_rpc``
blocks until they return), and answers a :class:`SyncReport`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .sync_plan import Want
from .sync_wire import Wire, host_store, pack

__all__ = ["EngineSync", "SyncReport"]


@dataclass(frozen=True)
class SyncReport:
    """One push.

    Attributes:
        version: the version every worker serves now (1 after the first push).
        bytes_sent: per worker (by vLLM rank), the bytes sent to it.
        shard_bytes: per worker, the bytes of the parameters the push rebuilt there (its shard).
        seconds: the push's wall time, packing to the workers' answer.
        worker_seconds: per worker, its rebuild's time (unpack, write, post-load processing).
        digests: per worker, each rebuilt parameter's digest before processing (when the sync records them).
    """

    version: int
    bytes_sent: tuple[int, ...]
    shard_bytes: tuple[int, ...]
    seconds: float
    worker_seconds: tuple[float, ...]
    digests: tuple[dict[str, str], ...] | None = None

    @property
    def ratios(self) -> tuple[float, ...]:
        """Per worker, bytes sent ÷ its shard bytes (1.0: exactly its parameters' bytes)."""
        return tuple(b / s if s else 0.0 for b, s in zip(self.bytes_sent, self.shard_bytes))


class EngineSync:
    """Pushes ``trainer``'s ``state_dict()`` into ``llm``'s workers (see the module).

    Args:
        llm: a running ``vllm.LLM`` started with ``worker_extension_cls="loader.vllm.SyncWorker"``.
        trainer: a module whose ``state_dict()`` keys are the checkpoint's keys (a transformers model).
        timeout: seconds a rendezvous, a send or a receive may take.
        digests: record each rebuilt parameter's digest in the reports (a check; costs a pass over the bytes).

    Raises:
        ValueError: a trainer tensor that does not fit the engine's model (naming it); nothing was sent.
    """

    def __init__(self, llm: Any, trainer: torch.nn.Module, *, timeout: float = 300.0, digests: bool = False):
        self.llm, self.trainer, self.timeout = llm, trainer, timeout
        self.version, self.id = 0, uuid.uuid4().hex
        self.shapes = {k: (tuple(t.shape), t.dtype) for k, t in trainer.state_dict().items()}
        keys = [(k, list(shape), str(dtype).removeprefix("torch.")) for k, (shape, dtype) in self.shapes.items()]
        answers = sorted(llm.collective_rpc("regiontrace_sync_prepare", args=(self.id, keys, digests)), key=_rank)
        errors = [a["error"] for a in answers if "error" in a]
        if errors:
            llm.collective_rpc("regiontrace_sync_close", args=(self.id,))
            raise ValueError(f"the trainer's tensors do not fit the engine's model: {errors[0]}")
        self.wants = [[Want(k, tuple(o), tuple(n), getattr(torch, d)) for k, o, n, d in a["wants"]] for a in answers]
        world = 1 + len(answers)
        self._store = host_store(world, timeout)
        connect = (self.id, self._store.port, world, timeout)
        self.wire = self._beside("regiontrace_sync_connect", connect, self._join)[1]

    def _join(self) -> Wire:
        return Wire(self._store, 0, len(self.wants) + 1, self.timeout)

    def _beside(self, method: str, args: tuple, work: Callable[[], Any]) -> tuple[list, Any]:
        """Run the workers' ``method`` in a thread while ``work()`` runs here; (their answers by rank, its result)."""
        answers: list = []
        failed: list[BaseException] = []

        def drive() -> None:
            try:
                answers.extend(self.llm.collective_rpc(method, args=args))
            except BaseException as e:  # re-raised on the caller's thread
                failed.append(e)

        thread = threading.Thread(target=drive, name=f"regiontrace-{method}", daemon=True)
        thread.start()
        try:
            result = work()
        finally:
            thread.join(self.timeout)
        if failed:
            raise RuntimeError(f"the engine's workers failed in {method}") from failed[0]
        if thread.is_alive():
            raise TimeoutError(f"the engine's workers did not answer {method} within {self.timeout} s")
        return sorted(answers, key=_rank), result

    def push(self) -> SyncReport:
        """Send the trainer's current weights; every worker serves them once this returns.

        Raises:
            ValueError: a trainer tensor's shape or dtype is not the one prepared, or it is gone (naming it);
                nothing was sent.
            RuntimeError: a worker failed to build its new layers: every worker serves the old weights still
                (the version is not advanced; the message names each worker's error).
        """
        started = time.perf_counter()
        state = self.trainer.state_dict()
        _check_unchanged(state, self.shapes)
        with torch.no_grad():
            packets = [pack(state, wants) for wants in self.wants]
        version = self.version + 1

        def send() -> None:
            for rank, packet in enumerate(packets):
                if packet.numel():
                    self.wire.send(packet, 1 + rank)
            self.wire.agree(True)

        answers, _ = self._beside("regiontrace_sync_receive", (self.id, version), send)
        errors = [a["error"] for a in answers if a["error"]]
        if errors:
            raise RuntimeError("the push failed, the engine serves the old weights: " + "; ".join(errors))
        self.version = version
        self.llm.reset_prefix_cache()  # no cached block of the old weights is reused
        return SyncReport(
            version=_agreed(answers),
            bytes_sent=tuple(p.numel() for p in packets),
            shard_bytes=tuple(a["shard_bytes"] for a in answers),
            seconds=time.perf_counter() - started,
            worker_seconds=tuple(a["seconds"] for a in answers),
            digests=tuple(a["digests"] for a in answers) if answers[0]["digests"] is not None else None,
        )

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
        self.wire = None


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


def _rank(answer: dict) -> int:
    return answer["rank"]


def _agreed(answers: list[dict]) -> int:
    versions = {a["version"] for a in answers}
    if len(versions) != 1:
        raise RuntimeError(f"the engine's workers serve different versions: {sorted(versions)}")
    return versions.pop()
