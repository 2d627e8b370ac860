"""The exchange of one round of exchanged reads: every rank sends each peer the parcels of its shares that peer wants,
receives its own parcels, and checks what it received before any byte is used.

Vocabulary (as :mod:`.exchange_plan`: *share*, *parcel*, *holder*, *round*; plus):

- a *consignment*: what one rank sends another of one file in a round: its parcels of that file, concatenated in
  ascending order;
- a *checksum*: the ``zlib.crc32`` of one consignment as it leaves its sender; a sender's checksums follow its
  consignments to one peer, :data:`CHECKSUM_BYTES` each, little-endian.

A consignment whose bytes fail their checksum (a bad link, a bug, memory gone wrong) is a
:class:`~loader.errors.CheckpointError` naming the file and the sending rank.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from ..errors import CheckpointError
from ..storage.held import HeldFile, gather
from .exchange_plan import FilePlan, Ranges
from .peers import Peers

CHECKSUM_BYTES = 4
"""Bytes of the checksum after each consignment (``zlib.crc32``, little-endian)."""


def offsets_in(share_ranges: Ranges, starts: np.ndarray) -> np.ndarray:
    """Where bytes at ``starts`` lie in the concatenation of ``share_ranges``."""
    before = np.concatenate([[0], np.cumsum(share_ranges[:, 1] - share_ranges[:, 0])])
    k = np.searchsorted(share_ranges[:, 0], starts, side="right") - 1
    return before[k] + starts - share_ranges[k, 0]


def _outgoing(
    plans: dict[str, FilePlan], files: Sequence[str], fetched: dict[str, np.ndarray], peers: Peers
) -> list[np.ndarray]:
    """Per peer (index = rank), this rank's consignments to it, in file order, then their checksums."""
    rank = peers.rank
    sends = []
    for j in range(peers.world):
        out: list[tuple[str, Ranges]] = []
        for f in files:
            ranges = plans[f].sends(rank, j) if j != rank and f in fetched else None
            if ranges is not None and int((ranges[:, 1] - ranges[:, 0]).sum()):
                out.append((f, ranges))
        size = sum(int((r[:, 1] - r[:, 0]).sum()) + CHECKSUM_BYTES for _, r in out)
        send, at, sums = np.empty(size, dtype=np.uint8), 0, []
        for f, ranges in out:
            sizes = ranges[:, 1] - ranges[:, 0]
            n = int(sizes.sum())
            _place(send, at, fetched[f], offsets_in(plans[f].shares.of(rank), ranges[:, 0]), sizes)
            sums.append(zlib.crc32(memoryview(send[at : at + n])))
            at += n
        tail = np.array(sums, dtype="<u4").view(np.uint8)
        send[at : at + len(tail)] = tail
        sends.append(send)
    return sends


def exchange(
    plans: dict[str, FilePlan], files: Sequence[str], fetched: dict[str, np.ndarray], peers: Peers
) -> tuple[dict[str, HeldFile], int]:
    """Send every peer its parcels of this rank's shares, receive this rank's parcels (one
    :meth:`~.peers.Peers.all_to_all_bytes`), each consignment checked against its checksum. Collective.

    Args:
        plans: the round's plan of each of ``files``.
        files: the round's files, in the order every rank uses.
        fetched: ``{file: this rank's shares of it, concatenated}``.
        peers: the group.

    Returns:
        ``{file: HeldFile}`` of this rank's parcels (a buffer per holder: what it sent, or for this rank its own
        shares), and the bytes received from peers.

    Raises:
        CheckpointError: a consignment fails its checksum (naming the file and the sending rank).
        PeerFailure: a peer did not take part (hung, died) within the timeout.
    """
    rank, world = peers.rank, peers.world
    incoming: list[list[tuple[str, int]]] = [[] for _ in range(world)]  # per holder: (file, bytes), in file order
    for i in range(world):
        for f in files:
            n = int(plans[f].parcels[rank].sizes_from(i).sum()) if i != rank else 0
            if n:
                incoming[i].append((f, n))
    recv_sizes = [sum(n + CHECKSUM_BYTES for _, n in got) for got in incoming]
    received = peers.all_to_all_bytes(_outgoing(plans, files, fetched, peers), recv_sizes)
    cursor: dict[tuple[int, str], int] = {}  # where holder i's consignment of file f starts in received[i]
    for i, got in enumerate(incoming):
        check_received(received[i], got, i)
        pos = 0
        for f, n in got:
            cursor[(i, f)] = pos
            pos += n
    held: dict[str, HeldFile] = {}
    for f in files:
        p = plans[f].parcels[rank]
        if not len(p.starts):
            continue
        sizes = p.ends - p.starts
        offs = np.zeros(len(sizes), dtype=np.int64)
        for h in np.unique(p.holders).tolist():
            m = p.holders == h
            if h == rank:
                offs[m] = offsets_in(plans[f].shares.of(rank), p.starts[m])
            else:
                offs[m] = cursor[(h, f)] + np.concatenate([[0], np.cumsum(sizes[m])[:-1]])
        holders = np.unique(p.holders)  # a buffer per holder of this file's parcels: what it sent, or own shares
        buffers = tuple(fetched[f] if h == rank else received[h] for h in holders.tolist())
        held[f] = HeldFile(p.starts, p.ends, np.searchsorted(holders, p.holders).astype(np.int64), offs, buffers)
    return held, sum(n for got in incoming for _, n in got)


def check_received(buffer: np.ndarray, files: Sequence[tuple[str, int]], holder: int) -> None:
    """Check what ``holder`` sent (``buffer``): each file's consignment (``(file, bytes)`` in order), then their
    checksums.

    Raises:
        CheckpointError: a consignment does not match the checksum ``holder`` sent (naming the file and ``holder``).
    """
    payload = sum(n for _, n in files)
    sent = buffer[payload : payload + CHECKSUM_BYTES * len(files)].view("<u4")
    pos = 0
    for (f, n), expected in zip(files, sent.tolist()):
        got = zlib.crc32(memoryview(buffer[pos : pos + n]))
        if got != expected:
            why = f"the {n} bytes rank {holder} sent for exchanged reads fail their checksum (crc32 {got:08x}, sent"
            raise CheckpointError(f"{f}: {why} {expected:08x}): altered between its fetch and this rank", path=f)
        pos += n


def _place(dst: np.ndarray, at: int, src: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> None:
    """The bytes ``src[offsets[i]:offsets[i] + sizes[i]]`` one after another into ``dst`` from ``at``: gathered at
    once per distinct size."""
    if not len(sizes):
        return
    places = at + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    by_size = np.argsort(sizes, kind="stable")
    distinct, first = np.unique(sizes[by_size], return_index=True)
    for n, lo, hi in zip(distinct.tolist(), first.tolist(), [*first[1:].tolist(), len(sizes)]):
        m = by_size[lo:hi]
        gather(dst, places[m], src, offsets[m], n)
