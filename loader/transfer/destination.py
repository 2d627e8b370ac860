"""``TensorDestination``: a trainer's pushes (:class:`loader.vllm.EngineSync`) into plain local tensors of other
processes, each destination rank receiving exactly the boxes it holds.

The destination ranks run in processes of their own, in their own ``torch.distributed`` world or none. They play
the engine's workers' part of the sync's protocol (:mod:`loader.vllm.sync_wire`: member ``trainers + rank`` of
each trainer group's wire) and destination rank 0 also the :class:`~loader.vllm.SyncEndpoint`'s: it hosts the
rendezvous, takes each trainer group's prepare, publishes the plan. The trainer side is unchanged:
``EngineSync(dest.address, model)`` on every trainer rank, then ``push()`` or ``push(delta=True)``.

Vocabulary (as in :mod:`loader.vllm.sync_pieces`, plus):

- **destination tensor**: what ``tensors`` maps a trainer key to on this rank: a DTensor (its placements give
  this rank's boxes, :func:`loader.placements.slot_for`), a plain tensor (held whole: replicated), or a
  ``(local tensor, global shape, offsets)`` triple (one box described by hand).
- **wants**: this rank's boxes of every destination tensor, in its dtype (the trainer casts to it once, before
  sending); a push receives them into buffers of the destination's own (its last wants are a delta's base) and
  copies them into the destination tensors only once every member of the group agreed: the tensors hold the old
  values or the new, never a mix.
- **destination keys**: the rendezvous keys of the destination ranks' own messages, under ``destination/`` of the
  group's keys (the trainers never read them).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..distributed.collectives import broadcast_tensor, pick_device
from ..errors import PeerFailure
from ..placements import slot_for
from ..vllm.sync_pieces import plan_pieces
from ..vllm.sync_plan import Want
from ..vllm.sync_push import header, receive_wants, stats
from ..vllm.sync_report import SyncReport
from ..vllm.sync_wire import (
    HOST,
    Wire,
    device_type,
    get_json,
    group_store,
    host_store,
    join_store,
    open_tickets,
    put_json,
    refusals,
    skip_ticket,
    transport_backend,
    wait_push,
)

__all__ = ["DestinationTensor", "TensorDestination", "destination_wants"]

#: a destination tensor (see the module): a DTensor, a plain tensor, or ``(local, global shape, offsets)``
DestinationTensor = torch.Tensor | tuple[torch.Tensor, Sequence[int], Sequence[int]]

Box = tuple[tuple[int, int], ...]


def _held(key: str, entry: DestinationTensor) -> tuple[torch.Tensor, tuple[int, ...], list[tuple[Box, Box]]]:
    """A destination tensor's local tensor, global shape and ``(global box, local box)`` pairs on this rank."""
    if isinstance(entry, tuple):
        local, shape, offsets = entry[0], tuple(entry[1]), tuple(entry[2])
        if len(shape) != local.dim() or len(offsets) != local.dim():
            raise ValueError(f"destination tensor {key!r}: a {local.dim()}-d shard, shape {shape}, offsets {offsets}")
        box = tuple((o, o + n) for o, n in zip(offsets, local.shape))
        if any(a < 0 or b > s for (a, b), s in zip(box, shape)):
            raise ValueError(f"destination tensor {key!r}: its shard {list(box)} is outside its global shape {shape}")
        return local, shape, [(box, tuple((0, n) for n in local.shape))]
    slot = slot_for(key, entry)
    return slot.local, tuple(slot.shape), [(tuple(g), tuple(lb)) for g, lb in slot.boxes]


def destination_wants(
    tensors: Mapping[str, DestinationTensor], keys: Sequence[tuple[str, Sequence[int], str]]
) -> tuple[list[Want], list[tuple[torch.Tensor, Box]]]:
    """This rank's wants of the trainer's tensors ``keys`` (``(key, shape, dtype name)``), in the destination
    tensors' dtypes, and where each lands: ``(local tensor, local box)``.

    Raises:
        ValueError: a trainer tensor no destination tensor takes, a destination tensor no trainer tensor writes,
            another global shape, or a floating-point tensor into a non-floating one (or back), naming it.
    """
    trainer = {k: (tuple(shape), getattr(torch, d)) for k, shape, d in keys}
    for key in tensors:
        if key not in trainer:
            raise ValueError(f"destination tensor {key!r} is written by no trainer tensor")
    wants, lands = [], []
    for key, (shape, dtype) in trainer.items():
        if key not in tensors:
            raise ValueError(f"trainer tensor {key!r} has no destination tensor")
        local, global_shape, boxes = _held(key, tensors[key])
        if global_shape != shape:
            raise ValueError(f"trainer tensor {key!r} is {list(shape)}, its destination tensor {list(global_shape)}")
        if dtype.is_floating_point != local.dtype.is_floating_point:
            raise ValueError(f"trainer tensor {key!r} is {dtype}, its destination tensor {local.dtype}")
        for g, lb in boxes:
            if math.prod(b - a for a, b in g):  # a box of no elements receives nothing
                wants.append(Want(key, tuple(a for a, _ in g), tuple(b - a for a, b in g), local.dtype))
                lands.append((local, lb))
    return wants, lands


def _narrow(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (a, b) in enumerate(box):
        t = t.narrow(d, a, b - a)
    return t


def _encoded(wants: Sequence[Want]) -> list:
    return [(w.key, w.offsets, w.lengths, str(w.dtype).removeprefix("torch.")) for w in wants]


def _decoded(wants: Sequence) -> list[Want]:
    return [Want(k, tuple(o), tuple(n), getattr(torch, d)) for k, o, n, d in wants]


class TensorDestination:
    """Plain local tensors that trainer ranks' :class:`~loader.vllm.EngineSync` push into (see the module).

    Every destination rank constructs it collectively, then calls :meth:`accept` once per trainer group and
    :meth:`receive` once per push.

    Args:
        tensors: per trainer key, this rank's destination tensor (see the module).
        trainers: how many trainer ranks push.
        rank, world: this destination rank and how many there are (default: ``torch.distributed``'s).
        address: the rendezvous (``"host:port"``). Rank 0 hosts it (at this port; without one at ``port``, 0: a
            free one) and its :attr:`address` is what the trainers connect to; the other ranks join it. Without
            one on every rank of a world of several, rank 0's address is broadcast over ``torch.distributed``'s
            default group (collective; its rank 0 is destination rank 0). Its host is the name the trainers
            reach rank 0's machine by (the rendezvous listens on every interface); without an address,
            ``127.0.0.1``.
        timeout: seconds a rendezvous, a collective or a wait for a peer may take.
    """

    def __init__(
        self,
        tensors: Mapping[str, DestinationTensor],
        *,
        trainers: int = 1,
        rank: int | None = None,
        world: int | None = None,
        address: str | None = None,
        port: int = 0,
        timeout: float = 300.0,
    ):
        here = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        self.rank = here[0] if rank is None else rank
        self.world = here[1] if world is None else world
        self.tensors, self.trainers, self.timeout = dict(tensors), trainers, timeout
        self.group, self.attempt, self.version, self.over = 0, 0, 0, True
        self.report: SyncReport | None = None
        self.wire: Wire | None = None
        if self.rank == 0:
            self.root = host_store(int(address.rpartition(":")[2]) if address else port, timeout)
            open_tickets(self.root, trainers)
            self.address = address or f"{HOST}:{self.root.port}"  # as given: the host the trainers reach
        if address is None and self.world > 1:
            address = _broadcast_address(self.address if self.rank == 0 else "", timeout)
        if self.rank != 0:
            if address is None:
                raise ValueError(f"destination rank {self.rank}: no address (rank 0's rendezvous) and no world")
            self.root, self.address = join_store(address, timeout), address

    def accept(self) -> None:
        """Take the next trainer group's prepare (every destination rank, collectively): check that every trainer
        tensor fits a destination tensor, publish the wants, form the group's wire.

        Raises:
            ValueError: a trainer tensor that does not fit (naming it), or trainer ranks that disagree; every
                trainer and destination rank raises it, nothing was sent.
            PeerFailure: a trainer or destination rank did not arrive within the timeout.
        """
        self.group += 1
        store, self.over, self.wire = group_store(self.root, self.group), True, None
        if self.rank == 0:
            word = _prepared(self.root, store, self.group, self.trainers, self.timeout)
        else:  # rank 0's wait may take a timeout per trainer rank
            word = get_json(store, "destination/prepared", (self.trainers + 1) * self.timeout, "waiting for rank 0")
        if "peer" in word:
            raise PeerFailure(word["peer"], stage="sync", ranks=tuple(word["ranks"]), reason="timeout")
        if "error" in word:
            raise ValueError(word["error"])
        prepares = [get_json(store, f"prepare/{r}", self.timeout, "reading a prepare") for r in range(self.trainers)]
        try:
            wants, lands = destination_wants(self.tensors, prepares[0]["keys"])
            mine = {"wants": _encoded(wants), "device": device_type(t for t, _ in lands) if wants else "cpu"}
        except ValueError as e:
            wants, lands, mine = [], [], {"error": f"destination rank {self.rank}: {e}"}
        put_json(store, f"destination/{self.rank}", mine)
        if self.rank == 0:
            _publish(store, prepares, self.world, self.version, self.timeout)
        waits = 1 if self.rank == 0 else self.world + 1  # rank 0's wait may take a timeout per destination rank
        plan = get_json(store, "plan", waits * self.timeout, "waiting for destination rank 0's plan")
        if "peer" in plan:
            raise PeerFailure(plan["peer"], stage="sync", ranks=tuple(plan["ranks"]), reason="timeout")
        if "error" in plan:
            raise ValueError(plan["error"])
        self.wants, self.lands, self.shard_bytes = wants, lands, tuple(plan["shard_bytes"])
        self.pieces = plan_pieces(wants, [p["parts"] for p in prepares])
        self.wire = Wire(store, self.trainers + self.rank, self.trainers + self.world, self.timeout)
        self.store, self.attempt, self.base, self.over = store, 0, None, False

    def receive(self, wait: float | None = None) -> int:
        """Take one push (every destination rank): wait (up to ``wait`` seconds, default the timeout) for the
        trainers to start it, receive this rank's wants, agree, write them into the destination tensors; the
        version they now hold (this push's :class:`~loader.vllm.SyncReport` in :attr:`report`).

        Raises:
            ValueError: a trainer rank refused the push (naming its tensor); nothing was sent or written.
            RuntimeError: a destination rank failed to receive: every destination tensor keeps its old values.
            PeerFailure: a trainer or destination rank died or hung: every destination tensor keeps its old
                values; the group is over (:meth:`accept` takes the next one).
            RuntimeError: no trainer group is connected.
        """
        if self.over or self.wire is None:
            raise RuntimeError("no trainer group is connected to this destination: accept() takes the next one")
        self.attempt = wait_push(self.store, self.attempt, self.timeout if wait is None else wait)
        try:
            return self._push(self.wire, time.perf_counter())
        except PeerFailure:
            self.over = True
            raise

    def _push(self, wire: Wire, started: float) -> int:
        refused, full, version = header(wire, False, self.base is None, 0)
        if refused:
            raise ValueError(refusals(self.store, self.attempt, self.trainers))
        error, new = None, None
        try:
            new, _ = receive_wants(wire, self.trainers, self.pieces, self.wants, self.base, full)
        except PeerFailure:
            raise
        except Exception as e:  # this rank says no: every rank keeps its old values
            error = f"destination rank {self.rank}: {type(e).__name__}: {e}"
            self.store.set(f"failed/{version}/{self.rank}", error)
        try:
            ok = wire.agree(error is None)
        except PeerFailure:
            _forget(new, self.base)
            raise
        if ok:
            with torch.no_grad():
                for (local, box), value in zip(self.lands, new):
                    _narrow(local, box).copy_(value)
            self.version, self.base = version, new
        else:
            _forget(new, self.base)
        sent, changed = stats(wire, [0] * self.world, [0] * self.world)
        if not ok:
            raise RuntimeError("the push failed, the destination keeps its old values: " + self._failures(version))
        self.report = SyncReport(self.version, sent, self.shard_bytes, time.perf_counter() - started,
                                 changed_bytes=changed, delta=not full)  # fmt: skip
        return self.version

    def _failures(self, version: int) -> str:
        keys = [f"failed/{version}/{d}" for d in range(self.world)]
        return "; ".join(self.store.get(k).decode() for k in keys if self.store.check([k])) or "another rank failed"

    def close(self) -> None:
        """Leave the current group (the destination tensors keep the last values pushed; a later :meth:`accept`
        takes the next group)."""
        self.wire, self.base, self.over = None, None, True


def _forget(received: Any, base: Any) -> None:
    """A push that is not kept: where the wire applied its deltas in place to ``base`` (the wants last received),
    they are put back (``undo``); a wire that received into new buffers left ``base`` as it was."""
    if received is not None and received is base:
        received.undo()


def _broadcast_address(address: str, timeout: float) -> str:
    """Destination rank 0's ``address``, on every rank of ``torch.distributed``'s default group."""
    buf = torch.zeros(256, dtype=torch.uint8, device=pick_device())
    if address:
        buf[: len(address)] = torch.tensor(list(address.encode()), dtype=torch.uint8)
    broadcast_tensor(buf, 0, timeout=timeout)
    return bytes(buf.cpu().tolist()).rstrip(b"\0").decode()


def _prepared(root: Any, store: Any, group: int, trainers: int, timeout: float) -> dict:
    """(Rank 0) wait for every trainer rank's prepare, as :meth:`~loader.vllm.SyncEndpoint.accept` does; tell the
    other destination ranks (and, on a failure, the trainers) what came."""
    try:
        prepares = [get_json(store, f"prepare/{r}", timeout, f"waiting for trainer rank {r}'s prepare")
                    for r in range(trainers)]  # fmt: skip
    except PeerFailure as e:
        missing = [r for r in range(trainers) if not store.check([f"prepare/{r}"])]
        for r in missing:
            skip_ticket(root, r, group)  # its next arrival is the next group's
        word = {"peer": f"trainer group {group}: trainer ranks {missing} did not arrive ({e})", "ranks": missing}
        put_json(store, "plan", word)
        put_json(store, "destination/prepared", word)
        return word
    word: dict = {}
    for r, p in enumerate(prepares):
        if "error" in p:
            word = {"error": p["error"]}
        elif p["keys"] != prepares[0]["keys"] or p["trainers"] != trainers:
            word = {"error": f"trainer rank {r} prepared other tensors (or world) than trainer rank 0"}
        if word:
            put_json(store, "plan", word)
            break
    put_json(store, "destination/prepared", word)
    return word


def _publish(store: Any, prepares: Sequence[dict], world: int, version: int, timeout: float) -> None:
    """(Rank 0) every destination rank's wants checked against the trainer ranks' boxes, published as the plan."""
    try:
        answers = [get_json(store, f"destination/{d}", timeout, f"waiting for destination rank {d}'s wants")
                   for d in range(world)]  # fmt: skip
    except PeerFailure as e:
        put_json(store, "plan", {"peer": str(e), "ranks": []})
        return
    try:
        errors = [a["error"] for a in answers if "error" in a]
        if errors:
            raise ValueError(errors[0])
        wants = [_decoded(a["wants"]) for a in answers]
        for w in wants:
            plan_pieces(w, [p["parts"] for p in prepares])  # every wanted element held by some trainer rank
    except ValueError as e:
        put_json(store, "plan", {"error": f"the trainer's tensors do not fit the destination: {e}"})
        return
    devices = [a["device"] for a in answers] + [p.get("device", "cpu") for p in prepares]
    store.set("backend", transport_backend(devices))  # read by every member's Wire
    shard_bytes = [sum(w.nbytes for w in ws) for ws in wants]
    put_json(store, "plan", {"wants": [a["wants"] for a in answers], "shard_bytes": shard_bytes, "version": version})
