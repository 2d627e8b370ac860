"""The sync's wire: a gloo group of the trainer ranks (0..T-1) and an engine's workers (T..T+N-1), and its store.

Vocabulary:
    rendezvous: a ``TCPStore`` the engine's :class:`~loader.vllm.SyncEndpoint` hosts at 127.0.0.1 on a free port
        (its ``address``); trainer ranks and workers join it (as vLLM's weight-transfer engines form their
        stateless groups). Prepare's messages (each trainer rank's tensors and boxes, the workers' wants) and a
        push's announcements and refusals go through it as JSON values.
    agreement: after every worker built its new layers, a ``MIN`` all-reduce of one flag over the whole group
        (the trainers' included): all kept, or all put back.
    peer failure: a collective or a store wait of a member that died, hung past the timeout or left: raised as
        :class:`~loader.errors.PeerFailure` (stage ``"sync"``) by every member still running.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._torch import gloo_backend
from ..errors import PeerFailure

__all__ = ["HOST", "Wire", "get_json", "host_store", "join_store", "peer_errors", "put_json"]

#: where the engine hosts the rendezvous
HOST = "127.0.0.1"


def host_store(port: int, seconds: float) -> dist.TCPStore:
    """The engine's rendezvous, on ``port`` (0: a free one, its ``.port``)."""
    return dist.TCPStore(HOST, port, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=seconds))


def join_store(address: str, seconds: float) -> dist.TCPStore:
    """A member's connection to the rendezvous at ``address`` (``"host:port"``)."""
    host, _, port = address.rpartition(":")
    with peer_errors(f"joining the rendezvous at {address}"):
        return dist.TCPStore(host, int(port), None, is_master=False, timeout=timedelta(seconds=seconds))


@contextlib.contextmanager
def peer_errors(doing: str) -> Iterator[None]:
    """A failed collective or store operation (gloo's "Connection closed by peer", a timeout) as
    :class:`~loader.errors.PeerFailure`."""
    try:
        yield
    except PeerFailure:
        raise
    except RuntimeError as e:  # DistBackendError and DistStoreError are RuntimeErrors
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        reason = "timeout" if "timed out" in text.lower() or "timeout" in text.lower() else "connection"
        raise PeerFailure(
            f"weight sync failed: a peer died, hung or left the group while {doing} ({type(e).__name__}: {text})",
            stage="sync",
            reason=reason,
        ) from e


def put_json(store: dist.Store, key: str, value: Any) -> None:
    store.set(key, json.dumps(value))


def get_json(store: dist.Store, key: str, seconds: float, doing: str) -> Any:
    """``key``'s value, waiting up to ``seconds`` for it (:class:`~loader.errors.PeerFailure` past that)."""
    with peer_errors(doing):
        store.wait([key], timedelta(seconds=seconds))
        return json.loads(store.get(key))


class Wire:
    """One member of the sync's gloo group (see the module); every operation raises
    :class:`~loader.errors.PeerFailure` when a peer is gone."""

    def __init__(self, store: dist.Store, rank: int, world: int, seconds: float):
        self.rank, self.world = rank, world
        with peer_errors(f"forming the sync's group ({world} members)"):
            self.group = gloo_backend(dist.PrefixStore("regiontrace-sync", store), rank, world, seconds)

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Send each ``(tensor, member)`` of ``sends`` and receive each of ``recvs``, all at once."""
        with peer_errors("sending and receiving a push's packets"):
            works = [self.group.send([t], dst, 0) for t, dst in sends if t.numel()]
            works += [self.group.recv([t], src, 0) for t, src in recvs if t.numel()]
            for work in works:
                work.wait()

    def allreduce(self, values: Sequence[int], op: Any, doing: str) -> list[int]:
        """``values`` reduced over the group by ``op`` (``torch.distributed.ReduceOp``)."""
        flag = torch.tensor(list(values), dtype=torch.int64)
        options = dist.AllreduceOptions()
        options.reduceOp = op
        with peer_errors(doing):
            self.group.allreduce([flag], options).wait()
        return flag.tolist()

    def agree(self, ok: bool) -> bool:
        """Whether every member is ``ok`` (see the module)."""
        return bool(self.allreduce([1 if ok else 0], dist.ReduceOp.MIN, "agreeing on a push")[0])
