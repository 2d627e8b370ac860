"""What the ranks of a transfer share, every wait bounded by the transfer's timeout.

Planning's values go through the process group's store, not a collective (:class:`Sharing`): every rank posts
its value and meets the others at an agreement point of the transfer's :class:`~loader.distributed.Session`,
so that a rank that never calls ``transfer_weights``, hangs or dies fails every other rank after ``timeout``
seconds, naming it (a collective would wait for the process group's own timeout, 30 minutes by default), and a
failure on one rank is raised on every rank. The ranks holding one model must hold each of its tensors alike
(:func:`check_views`, with the save's :func:`~loader.save.agreement.tensor_view`).

A replay, whose ranks already met at the planning, checks its models with one small integer per rank before its
rounds (:class:`Flags`: one ``all_to_all_single`` of a few int64 over the transfer's group, waiting at most
``timeout``); only when one says a rank failed, or the collective fails itself, do the ranks meet through the
store (:func:`fail_together`) to raise the same error on every rank, naming a rank that never arrived. Its
outcome after the rounds is agreed through the store (one verdict: a collective cut short by a dying rank would
reach only some ranks), by a :class:`~loader.distributed.ballot.Ballot` (no session: no heartbeat thread to start
and join on every step).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import pickle
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import Session, peer_errors
from ..distributed.collectives import all_to_all_tensor
from ..plan.slots import iter_model_tensors
from ..save.agreement import tensor_view

log = logging.getLogger("loader")

STAGE = "transferring"

#: model tensor name -> its view (:func:`~loader.save.agreement.tensor_view`)
Views = Mapping[str, str]


class Sharing:
    """The values the ranks of one transfer share, through ``session``'s store (None: one process, no peers).

    Each value stays in the store until every rank has passed the next point (then its poster deletes it), so
    that repeated transfers do not grow the store.
    """

    def __init__(self, session: Session | None) -> None:
        self.session = session
        self._posted: list[str] = []

    def share(self, name: str, value: Any, error: BaseException | None = None) -> list[Any]:
        """Every rank's ``value`` (index = rank). Collective over the transfer's group; ``name`` unique in it.

        Raises:
            Exception: ``error`` here or on another rank: the lowest failed rank's, on every rank.
            PeerFailure: a rank did not post within the timeout (naming it), died, or this rank came too late.
            RuntimeError: under torch's fake process group (no peers).
        """
        s = self.session
        if s is None:
            if error is not None:
                raise error
            return [value]
        if s.solo:
            raise RuntimeError(
                f"transfer_weights under torch's fake process group (rank {s.rank} of {s.world}): a fake world has no "
                "peers to send or receive the weights; plan it with loader.transfer.simulate_transfer instead"
            ) from error
        key = f"share/{name}/"
        if error is None:
            with peer_errors(STAGE, f"posting {name}"):
                s.store.set(key + str(s.rank), pickle.dumps(value))
        s.agree(error, STAGE, point=name)
        self._forget()  # every rank has passed the previous point: its values were read
        self._posted.append(key + str(s.rank))
        with peer_errors(STAGE, f"reading every rank's {name}"):
            return [pickle.loads(v) for v in s.store.multi_get([key + str(r) for r in range(s.world)])]

    def agree(self, error: BaseException | None, point: str) -> None:
        """An agreement point without values: ``error`` (or another rank's) raised on every rank."""
        if self.session is None:
            if error is not None:
                raise error
            return
        self.session.agree(error, STAGE, point=point)
        self._forget()

    @contextlib.contextmanager
    def stage(self, point: str) -> Iterator[None]:
        """Run the block as an agreement point of the transfer's stage: its exception (or another rank's) raised on
        every rank (:meth:`~loader.distributed.Session.stage`)."""
        if self.session is None:
            yield
            return
        with self.session.stage(STAGE, point=point):
            yield
        self._forget()

    def close(self) -> None:
        """After the transfer's last agreement point: delete this rank's values still in the store."""
        self._forget()

    def _forget(self) -> None:
        if self.session is None:
            return
        for key in self._posted:
            try:
                self.session.store.delete_key(key)
            except Exception:  # a store without deletion: the value stays, nothing else is affected
                log.debug("could not delete %s from the store", key, exc_info=True)
        self._posted.clear()


class Flags:
    """One integer per rank, every rank's on every rank, over the transfer's group ``group``: one
    ``all_to_all_single`` of int64 (each rank sends its value to every peer directly: a peer that died is a
    connection error on every rank, not only on its neighbours), waiting at most ``timeout`` seconds (None: no
    limit). Its buffers are made once (on ``device``: the group's) and reused."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: float | None, device: torch.device) -> None:
        world = dist.get_world_size(group)
        self.group, self.timeout = group, timeout
        self._send = torch.zeros(world, dtype=torch.int64, device=device)
        self._recv = torch.zeros(world, dtype=torch.int64, device=device)
        self._sizes = [1] * world

    def exchange(self, value: int, doing: str) -> list[int]:
        """Every rank's ``value`` (index = rank). Collective over the group.

        Raises:
            PeerFailure: the collective failed or timed out (``reason="connection"``).
        """
        self._send.fill_(value)
        with peer_errors(STAGE, doing):
            all_to_all_tensor(self._recv, self._send, self._sizes, self._sizes, group=self.group, timeout=self.timeout)
            return self._recv.tolist()


def fail_together(error: BaseException | None, timeout: float | None, group: dist.ProcessGroup | None) -> None:
    """The ranks of a replay that failed meet in a session of their own through the store: ``error`` (this
    rank's, None when another rank's flag said it failed) or another rank's raised on every rank; a rank that
    never arrives within ``timeout`` named in a :class:`~loader.errors.PeerFailure`. Called by every rank that saw
    the failure (a :class:`Flags` value, or a failed collective: every rank waiting on a peer sees it).

    Raises:
        Exception: always (the agreed error).
    """
    with Session(timeout, group) as session:
        session.agree(error, STAGE)
    if error is not None:
        raise error
    raise RuntimeError("a rank flagged a failed transfer but none was agreed through the store")


def model_views(model: torch.nn.Module | None) -> dict[str, str]:
    """Every tensor of ``model`` as every rank holding it must hold it (None: no tensors)."""
    if model is None:
        return {}
    return {name: tensor_view(t) for name, t in iter_model_tensors(model)}


def digest(views: Views) -> str:
    """Equal for equal views (in any order)."""
    return hashlib.sha256(json.dumps(sorted(views.items())).encode()).hexdigest()


def check_views(sharing: Sharing, digests: Sequence[tuple[str | None, str | None]], views: tuple[Views, Views]):
    """Raise on every rank when two ranks hold a tensor of one model differently (global shape, dtype,
    placements, mesh). ``digests``: every rank's ``(source, destination)`` digests (None: it holds no part of
    that model); ``views``: this rank's. Every rank computes the same outcome; only when the digests differ do
    the ranks share their views (ranks holding different tensors, e.g. pipeline stages, are no error).

    Raises:
        ValueError: naming the first tensor held differently and each rank's view of it.
    """
    if all(len({d[i] for d in digests if d[i] is not None}) <= 1 for i in (0, 1)):
        return
    every = sharing.share("views", views)
    for i, side in enumerate(("source", "destination")):
        message = disagreement(side, [v[i] if d[i] is not None else None for v, d in zip(every, digests)])
        if message is not None:
            raise ValueError(message)


def disagreement(side: str, views: Sequence[Views | None]) -> str | None:
    """The first tensor of one model that the ranks holding it (``views``: index = rank, None: holds none of
    the model) hold differently, with each rank's view; None when they agree."""
    names = dict.fromkeys(n for v in views if v is not None for n in v)
    for name in names:
        held = {r: v[name] for r, v in enumerate(views) if v is not None and name in v}
        if len(set(held.values())) > 1:
            listed = "; ".join(f"rank {r}: {view}" for r, view in held.items())
            return (
                f"the ranks hold {side} model tensor {name!r} differently ({listed}): every rank must hold the same "
                "tensor (global shape, dtype, placements); nothing was sent"
            )
    return None
