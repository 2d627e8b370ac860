"""The collectives a distributed flow uses, each over a ``group`` (None: the default one) and on a ``device``: every
rank's bytes (:meth:`Collectives.all_gather_bytes`), bytes to and from every rank (:meth:`Collectives.all_to_all_bytes`,
:func:`all_to_all_tensor`) and one rank's tensor to the others (:func:`broadcast_tensor`), each waiting at most a
timeout (None: no limit) rather than the process group's own (30 minutes by default).

Vocabulary:

- *group*: a ``torch.distributed`` process group; ranks are the group's (0 … size - 1), :func:`global_rank` maps one
  to the world's.
- *device*: where a collective's buffers live: the CPU under gloo, a CUDA device under NCCL (:func:`pick_device`,
  the one place that chooses).

:class:`Collectives` is the execution layer's :class:`~loader.execute.peers.Peers`: the read drivers talk to the
other ranks only through it. Every operation here is collective over its group.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .verdicts import peer_errors


def group_rank_and_world(group: Any = None) -> tuple[int, int]:
    """This process's rank in ``group`` and the group's size (0, 1 outside ``torch.distributed``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def global_rank(group: Any, rank: int) -> int:
    """The world's rank of ``group``'s rank ``rank`` (itself for the default group)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def pick_device(group: Any = None, tensors: Iterable[torch.Tensor | None] = ()) -> torch.device:
    """Where a collective's buffers over ``group`` live: under NCCL the CUDA device of the first CUDA tensor of
    ``tensors`` (else the current one), under any other backend the CPU."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend(group) != "nccl":
        return torch.device("cpu")
    found = next((t.device for t in tensors if t is not None and t.device.type == "cuda"), None)
    return found or torch.device("cuda", torch.cuda.current_device())


def transport_backend(devices: Iterable[str]) -> str:
    """The backend of a group formed outside ``torch.distributed``'s (a weight sync's, :mod:`loader.vllm.sync_wire`)
    for its members' device types (``"cuda"``, ``"cpu"``, ...): NCCL when every one is ``"cuda"``, gloo otherwise."""
    kinds = set(devices)
    return "nccl" if kinds == {"cuda"} else "gloo"


def backend_device(backend: str) -> torch.device:
    """Where such a group's buffers live: the current CUDA device under NCCL, the CPU under gloo.

    Raises:
        ValueError: another backend.
    """
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend == "gloo":
        return torch.device("cpu")
    raise ValueError(f"a group of its own is formed over gloo or nccl, not {backend!r}")


def _wait(work: Any, timeout: float | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout))


def all_to_all_tensor(
    out: torch.Tensor,
    send: torch.Tensor,
    out_sizes: list[int],
    send_sizes: list[int],
    *,
    group: Any = None,
    timeout: float | None = None,
) -> None:
    """``all_to_all_single`` of byte buffers with exact split sizes (index = the group's rank), waiting at most
    ``timeout`` seconds."""
    work = dist.all_to_all_single(
        out, send, output_split_sizes=out_sizes, input_split_sizes=send_sizes, group=group, async_op=True
    )
    _wait(work, timeout)


def broadcast_tensor(tensor: torch.Tensor, src: int, *, group: Any = None, timeout: float | None = None) -> None:
    """``tensor`` of ``group``'s rank ``src`` into ``tensor`` on every rank of ``group`` (a non-contiguous one
    through a contiguous copy)."""
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    _wait(dist.broadcast(buf, src=global_rank(group, src), group=group, async_op=True), timeout)
    if buf is not tensor:
        tensor.copy_(buf)


def broadcast_among(
    tensor: torch.Tensor,
    src: int,
    ranks: Sequence[int],
    *,
    group: Any = None,
    timeout: float | None = None,
    tag: int = 0,
) -> None:
    """``tensor`` of ``group``'s rank ``src`` into ``tensor`` on the group's ``ranks`` (``src`` among them), point to
    point over ``group``: no process group of ``ranks`` is made (torch's ``new_group`` of overlapping rank sets made
    by their ranks alone deadlocks; made by every rank it would involve ranks outside them). Called by ``ranks``
    only, each in one order shared by all ranks (then the first unfinished broadcast always has its ranks ready)."""
    me = dist.get_rank(group)
    buf = tensor if tensor.is_contiguous() else tensor.contiguous()
    if me == src:
        works = [dist.isend(buf, dst=global_rank(group, r), group=group, tag=tag) for r in ranks if r != src]
        for work in works:
            _wait(work, timeout)
        return
    _wait(dist.irecv(buf, src=global_rank(group, src), group=group, tag=tag), timeout)
    if buf is not tensor:
        tensor.copy_(buf)


class Collectives:
    """This rank's end of the collectives over ``group``: the :class:`~loader.execute.peers.Peers` the read drivers
    use (:meth:`~loader.distributed.session.Session.peers` binds one to a stage of its session).

    Args:
        group: the process group (None: the default one).
        timeout: seconds each collective may wait (None: no limit).
        device: where the buffers live (default: :func:`pick_device` of ``group``).
        agreement: how :meth:`agree` agrees on an outcome at a point (``agreement(error, point)``, a session's); None:
            no peers to agree with (this rank's error is raised).
        stage: the stage a failed collective is a :class:`~loader.errors.PeerFailure` of (None: raised as it is).
    """

    def __init__(
        self,
        group: Any = None,
        *,
        timeout: float | None = None,
        device: torch.device | None = None,
        agreement: Callable[[BaseException | None, str], None] | None = None,
        stage: str | None = None,
    ) -> None:
        self.group, self.timeout, self.stage = group, timeout, stage
        self.rank, self.world = group_rank_and_world(group)
        self.device = device if device is not None else pick_device(group)
        self._agreement = agreement

    def agree(self, error: BaseException | None, point: str) -> None:
        """This rank's outcome of ``point`` agreed with every rank's: the same error raised on every rank."""
        if self._agreement is not None:
            self._agreement(error, point)
        elif error is not None:
            raise error

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (index = rank): the sizes, then the bytes padded to the longest."""
        if self.world < 2:
            return [bytes(data)]
        with self._failing("gathering bytes from every rank"):
            size = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
            sizes = [torch.empty_like(size) for _ in range(self.world)]
            _wait(dist.all_gather(sizes, size, group=self.group, async_op=True), self.timeout)
            lengths = [int(s.item()) for s in sizes]
            longest = max(lengths)
            mine = torch.zeros(longest, dtype=torch.uint8)
            if data:
                mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            mine = mine.to(self.device)
            out = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.world)]
            _wait(dist.all_gather(out, mine, group=self.group, async_op=True), self.timeout)
        return [o[:n].cpu().numpy().tobytes() for o, n in zip(out, lengths)]

    def all_to_all_bytes(self, sends: Sequence[np.ndarray], recv_sizes: Sequence[int]) -> list[np.ndarray]:
        """``sends[j]`` (``uint8``) to rank ``j``; what each rank ``i`` sent this one (``recv_sizes[i]`` bytes), views
        of one buffer."""
        parts = [np.asarray(s, dtype=np.uint8).reshape(-1) for s in sends]
        send = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
        out = torch.empty(int(sum(recv_sizes)), dtype=torch.uint8, device=self.device)
        with self._failing("sending bytes to every rank"):
            all_to_all_tensor(
                out,
                torch.from_numpy(send).to(self.device),
                [int(n) for n in recv_sizes],
                [len(p) for p in parts],
                group=self.group,
                timeout=self.timeout,
            )
        got = out.cpu().numpy()
        starts = np.concatenate([[0], np.cumsum(recv_sizes)]).astype(np.int64).tolist()
        return [got[a:b] for a, b in zip(starts[:-1], starts[1:])]

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        """``src``'s ``tensor`` on every rank of ``group`` (None: this one's; ``src`` is that group's rank)."""
        with self._failing("broadcasting a tensor"):
            broadcast_tensor(tensor, src, group=self.group if group is None else group, timeout=self.timeout)

    def _failing(self, doing: str) -> contextlib.AbstractContextManager:
        return peer_errors(self.stage, doing) if self.stage is not None else contextlib.nullcontext()
