"""The peers of a distributed load's read drivers over ``torch.distributed``: :class:`SessionPeers`, the
:class:`~loader.execute.peers.Peers` of :mod:`loader.execute.exchanged`, and :func:`all_to_all_bytes` of byte
tensors with a timeout. Collectives only: the drivers themselves are the execution layer's.

Vocabulary (as :mod:`loader.execute.peers`): a *peer*, *agreeing* at a *point* (of the session's stage).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from . import peer_errors


def all_to_all_bytes(
    out: torch.Tensor,
    send: torch.Tensor,
    out_sizes: list[int],
    send_sizes: list[int],
    *,
    group: Any = None,
    timeout: float | None = None,
) -> None:
    """``all_to_all_single`` of byte buffers with exact split sizes, waiting at most ``timeout`` seconds (None: no
    limit) instead of the process group's own (30 minutes by default). Collective."""
    work = dist.all_to_all_single(
        out, send, output_split_sizes=out_sizes, input_split_sizes=send_sizes, group=group, async_op=True
    )
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout=datetime.timedelta(seconds=timeout))


class SessionPeers:
    """The ranks of ``session`` as :class:`~loader.execute.peers.Peers`, in its stage ``stage``: collectives over
    the default process group (a failed one is a :class:`~loader.errors.PeerFailure`), agreement through the
    session's store.

    Args:
        session: the load's session (its ``rank``, ``world``, ``timeout`` and ``agree``).
        stage: the stage the drivers run in (named in errors and agreement points).
    """

    def __init__(self, session: Any, stage: str = "reading") -> None:
        self.session, self.stage = session, stage
        self.rank, self.world, self.timeout = session.rank, session.world, session.timeout
        self._carried: BaseException | None = None

    def carry(self, error: BaseException | None) -> None:
        """Post ``error`` (this rank's, from a step before the drivers) at the next agreement point."""
        self._carried = self._carried or error

    def agree(self, error: BaseException | None, point: str) -> None:
        """Agree on the outcome of ``point`` (this rank's error, or one it carried) through the session's store."""
        error, self._carried = error or self._carried, None
        self.session.agree(error, self.stage, point=point)

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` (index = rank)."""
        everyone: list[Any] = [None] * self.world
        with peer_errors(self.stage, "gathering the byte ranges every rank reads"):
            dist.all_gather_object(everyone, bytes(data))
        return everyone

    def all_to_all_bytes(self, sends: Sequence[np.ndarray], recv_sizes: Sequence[int]) -> list[np.ndarray]:
        """``sends[j]`` to rank ``j``, and what each rank sent this one: one ``all_to_all_single``, on this rank's
        GPU under NCCL (untested here), else on the CPU, waiting at most the timeout."""
        nccl = dist.get_backend() == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
        send = np.concatenate([np.zeros(0, dtype=np.uint8), *sends])
        out = torch.empty(int(sum(recv_sizes)), dtype=torch.uint8, device=device)
        with peer_errors(self.stage, "exchanging fetched bytes"):
            all_to_all_bytes(
                out,
                torch.from_numpy(send).to(device),
                [int(n) for n in recv_sizes],
                [len(s) for s in sends],
                timeout=self.timeout,
            )
        got = out.cpu().numpy()
        bounds = np.concatenate([[0], np.cumsum(recv_sizes)]).astype(np.int64).tolist()
        return [got[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
