"""The sync's wire: a gloo group of the trainer (rank 0) and an engine's workers (ranks 1..N), and its messages.

Vocabulary:
    rendezvous: a ``TCPStore`` the trainer hosts at 127.0.0.1 on a free port; each worker joins it as rank
        ``1 + its vLLM rank`` (as vLLM's weight-transfer engines form their stateless groups).
    packet: one worker's wants (:class:`~loader.vllm.sync_plan.Want`), each box C-contiguous in its wire dtype,
        as one byte buffer in want order; the trainer sends each worker its packet, the worker unpacks it.
    agreement: after every worker built its new layers, a ``MIN`` all-reduce of one flag over the group (the
        trainer's included): all kept, or all put back.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from .._torch import gloo_backend
from .sync_plan import Want

__all__ = ["Wire", "host_store", "join_store", "pack", "unpack"]

#: where the trainer hosts the rendezvous
HOST = "127.0.0.1"


def host_store(world: int, seconds: float) -> dist.TCPStore:
    """The trainer's rendezvous (rank 0), on a free port (its ``.port``)."""
    return dist.TCPStore(HOST, 0, world, is_master=True, wait_for_workers=False, timeout=_delta(seconds))


def join_store(port: int, world: int, seconds: float) -> dist.TCPStore:
    """A worker's connection to the trainer's rendezvous."""
    return dist.TCPStore(HOST, port, world, is_master=False, timeout=_delta(seconds))


def _delta(seconds: float):
    from datetime import timedelta

    return timedelta(seconds=seconds)


class Wire:
    """One member of the sync's gloo group (see the module)."""

    def __init__(self, store: dist.Store, rank: int, world: int, seconds: float):
        self.rank, self.world = rank, world
        self.group = gloo_backend(dist.PrefixStore("regiontrace-sync", store), rank, world, seconds)

    def send(self, packet: torch.Tensor, dst: int) -> None:
        self.group.send([packet], dst, 0).wait()

    def recv(self, nbytes: int) -> torch.Tensor:
        packet = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self.group.recv([packet], 0, 0).wait()
        return packet

    def agree(self, ok: bool) -> bool:
        """Whether every member is ``ok`` (see the module)."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([flag], options).wait()
        return bool(flag.item())


def pack(state: Mapping[str, torch.Tensor], wants: Sequence[Want]) -> torch.Tensor:
    """One worker's packet from the trainer's tensors (each box cast to its wire dtype)."""
    parts = []
    for want in wants:
        box = state[want.key].detach()
        for d, (o, n) in enumerate(zip(want.offsets, want.lengths)):
            box = box.narrow(d, o, n)
        parts.append(box.to(want.dtype).contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)


def unpack(packet: torch.Tensor, wants: Sequence[Want]) -> dict[str, torch.Tensor]:
    """The boxes of a packet, by want index (``"0"``, ``"1"`` …: the names the plan's blocks read)."""
    boxes, at = {}, 0
    for i, want in enumerate(wants):
        n = math.prod(want.lengths) * want.dtype.itemsize
        boxes[str(i)] = packet[at : at + n].view(want.dtype).reshape(want.lengths)
        at += n
    if at != packet.numel():
        raise ValueError(f"a sync packet of {packet.numel()} bytes, where the plan's boxes take {at}")
    return boxes
