"""The sync's wire: a group of the trainer ranks (0..T-1) and an engine's workers (T..T+N-1), and its store.

Vocabulary:
    rendezvous: a ``TCPStore`` the engine's :class:`~loader.vllm.SyncEndpoint` hosts at 127.0.0.1 on a free port
        (its ``address``); trainer ranks and workers join it (as vLLM's weight-transfer engines form their
        stateless groups). Prepare's messages (each trainer rank's tensors and boxes, the workers' wants) and a
        push's announcements and refusals go through it as JSON values.
    trainer group: the trainer ranks one :meth:`SyncEndpoint.accept` takes. The endpoint takes groups one after
        another (a new one after the last ended, a peer failure included); each has its own keys, under
        ``group-G/`` (:func:`group_store`). Trainer rank ``r``'s ``G``-th arrival (its **ticket**, an ``add`` on
        ``joined/r``) belongs to group ``G``; where a group's rank ``r`` never arrived, the endpoint spends its
        ticket (:func:`skip_ticket`), so the next group's ranks again arrive under one number. A worker is
        handed its group's address, ``host:port/group-G`` (:func:`join_store` opens it there).
    transport: the group's backend for its members' devices (NCCL when every trainer rank's and the engine's
        tensors are on CUDA, gloo otherwise: :func:`~loader.distributed.collectives.transport_backend`), chosen
        by the endpoint and read by each member from its group's ``backend`` key (:class:`Wire`); a tensor not
        on the transport's device (a packet is packed in host memory) is staged through it.
    agreement: after every worker built its new layers, a ``MIN`` all-reduce of one flag over the whole group
        (the trainers' included): all kept, or all put back.
    peer failure: a collective or a store wait of a member that died, hung past the timeout or left: raised as
        :class:`~loader.errors.PeerFailure` (stage ``"sync"``) by every member still running.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._torch import gloo_backend, nccl_backend
from ..distributed.collectives import backend_device, transport_backend
from ..errors import PeerFailure

__all__ = [
    "HOST",
    "Wire",
    "device_type",
    "get_json",
    "group_store",
    "host_store",
    "join_group",
    "join_store",
    "open_tickets",
    "peer_errors",
    "put_json",
    "skip_ticket",
    "transport_backend",
]

#: where the engine hosts the rendezvous
HOST = "127.0.0.1"


def host_store(port: int, seconds: float) -> dist.TCPStore:
    """The engine's rendezvous, on ``port`` (0: a free one, its ``.port``)."""
    return dist.TCPStore(HOST, port, None, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=seconds))


def join_store(address: str, seconds: float) -> dist.Store:
    """A member's connection to the rendezvous at ``address`` (``"host:port"``; ``"host:port/prefix"``: its keys
    under ``prefix``, a trainer group's)."""
    where, _, prefix = address.partition("/")
    host, _, port = where.rpartition(":")
    with peer_errors(f"joining the rendezvous at {address}"):
        store = dist.TCPStore(host, int(port), None, is_master=False, timeout=timedelta(seconds=seconds))
    return dist.PrefixStore(prefix, store) if prefix else store


def group_store(root: dist.Store, group: int) -> dist.Store:
    """Trainer group ``group``'s keys of the rendezvous ``root`` (see the module)."""
    return dist.PrefixStore(group_prefix(group), root)


def group_prefix(group: int) -> str:
    return f"group-{group}"


def open_tickets(root: dist.Store, trainers: int) -> None:
    """(The endpoint, before its address is out) no trainer rank has arrived yet."""
    for r in range(trainers):
        root.set(f"joined/{r}", "0")


def join_group(address: str, rank: int, seconds: float) -> dist.Store:
    """Trainer rank ``rank``'s arrival at the rendezvous at ``address``: its group's keys (its ticket's)."""
    root = join_store(address, seconds)
    with peer_errors(f"arriving at the rendezvous at {address}"):
        return group_store(root, root.add(f"joined/{rank}", 1))


def skip_ticket(root: dist.Store, rank: int, group: int) -> None:
    """(The endpoint) group ``group``'s rank ``rank`` never arrived: its ticket is spent, the rank's next arrival
    is the next group's (a no-op where it has arrived since)."""
    root.compare_set(f"joined/{rank}", str(group - 1), str(group))


def device_type(tensors: Iterable[torch.Tensor]) -> str:
    """``"cuda"`` when every one of ``tensors`` is on CUDA (and there is one), else ``"cpu"``."""
    kinds = {t.device.type for t in tensors}
    return "cuda" if kinds == {"cuda"} else "cpu"


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


def wait_push(store: dist.Store, attempt: int, seconds: float) -> int:
    """Wait up to ``seconds`` for the trainers to announce push ``attempt + 1``; its number (a push that never
    started leaves the count at ``attempt``: a later wait is for the same push).

    Raises:
        PeerFailure: no push announced within ``seconds``.
    """
    get_json(store, f"push/{attempt + 1}", seconds, "waiting for a push")
    return attempt + 1


def refusals(store: dist.Store, attempt: int, trainers: int) -> str:
    """The messages of the trainer ranks that refused push ``attempt``."""
    keys = [f"refused/{attempt}/{r}" for r in range(trainers)]
    said = [store.get(k).decode() for k in keys if store.check([k])]
    return "; ".join(said) or f"a trainer rank refused push {attempt}"


class Wire:
    """One member of the sync's group (see the module); every operation raises :class:`~loader.errors.PeerFailure`
    when a peer is gone.

    Args:
        backend: ``"gloo"`` or ``"nccl"``; default: the store's ``backend`` key (the endpoint's choice, see the
            module), gloo without one.
    """

    def __init__(self, store: dist.Store, rank: int, world: int, seconds: float, backend: str | None = None):
        self.rank, self.world = rank, world
        self.backend = backend or stored_backend(store)
        self.device = backend_device(self.backend)  # (ValueError for a backend but gloo and NCCL)
        make = nccl_backend if self.device.type == "cuda" else gloo_backend
        with peer_errors(f"forming the sync's group ({world} members, {self.backend})"):
            self.group = make(dist.PrefixStore("regiontrace-sync", store), rank, world, seconds)

    def exchange(self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]) -> None:
        """Send each ``(tensor, member)`` of ``sends`` and receive each of ``recvs``, all at once (each through the
        transport's device where it is not there)."""
        with peer_errors("sending and receiving a push's packets"):
            staged = [(self._on(t), dst) for t, dst in sends if t.numel()]
            landing = [(t, self._on(t, copy=False), src) for t, src in recvs if t.numel()]
            works = [self.group.send([t], dst, 0) for t, dst in staged]
            works += [self.group.recv([buffer], src, 0) for _, buffer, src in landing]
            for work in works:
                work.wait()
            for t, buffer, _ in landing:
                if buffer is not t:
                    t.copy_(buffer)

    def _on(self, t: torch.Tensor, copy: bool = True) -> torch.Tensor:
        """``t`` itself where it is on the transport's device; else a copy there (an empty one: ``copy=False``)."""
        if t.device == self.device:
            return t
        return t.to(self.device) if copy else torch.empty_like(t, device=self.device)

    def allreduce(self, values: Sequence[int], op: Any, doing: str) -> list[int]:
        """``values`` reduced over the group by ``op`` (``torch.distributed.ReduceOp``)."""
        flag = torch.tensor(list(values), dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = op
        with peer_errors(doing):
            self.group.allreduce([flag], options).wait()
        return flag.tolist()

    def agree(self, ok: bool) -> bool:
        """Whether every member is ``ok`` (see the module)."""
        return bool(self.allreduce([1 if ok else 0], dist.ReduceOp.MIN, "agreeing on a push")[0])


def stored_backend(store: dist.Store) -> str:
    """The transport the store's ``backend`` key names (the endpoint's choice); gloo without one."""
    return store.get("backend").decode() if store.check(["backend"]) else "gloo"
