"""Exchanged reads: bytes several ranks want interleaved (column shards) fetched once, each rank a contiguous chunk,
and exchanged over the process group (the plan: :mod:`.exchange_plan`).

Every rank publishes the byte ranges its reads want (``all_gather_object``) and computes the same plan. Then, round
by round (whole files, or a file over the budget in parts cut at tensor starts: at most :data:`ROUND_BYTES` held per
rank), each rank fetches its chunks through its reader (a few long requests instead of one per row), the ranks agree
that every fetch succeeded (through the session's store: a failed, hung or dead rank fails every rank, as at every
agreement point), exchange the pieces with one ``all_to_all_single``, and each rank executes the reads of the
tensors in the round's parts through a :class:`~loader.storage.held.HeldReader` serving its pieces from memory.
Wanted ranges outside shared extents are read as always, through the same reader.

Bytes fetched per rank are about its shard's bytes (each chunk as long as what its holder wants in the extent);
requests are a few per chunk; bytes over the process group are each rank's shard minus what it fetched itself.

Integrity: what a rank sends another of one file (its pieces of that file, concatenated) carries the ``zlib.crc32``
of those bytes as they leave it, 4 bytes after its payload; the receiver checks each before any byte is used, and a
mismatch (a bad link, a bug, memory gone wrong) is a :class:`~loader.errors.CheckpointError` naming the file and the
sending rank, agreed like every failure: every rank raises it.
"""

from __future__ import annotations

import datetime
import zlib
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from regiontrace import read_layout

from ..checkpoint import SafetensorsCheckpoint
from ..errors import CheckpointError, PeerFailure
from ..execute import execute_plan
from ..options import LoadOptions
from ..plan import BlockRead, RankPlan
from ..storage import RangeReader
from ..storage.held import HeldFile, HeldReader, gather
from .exchange_plan import FilePlan, Ranges, as_ranges, plan_files, rounds
from .session import LoadSession, peer_errors

CHECKSUM_BYTES = 4
"""Bytes of the checksum after each file's pieces one rank sends another (``zlib.crc32``, little-endian)."""

ROUND_BYTES = 1 << 30
"""Most bytes a rank holds for one round (its chunks and the pieces it receives), unless one tensor holds more (a
round of its own)."""


def wanted_ranges(checkpoint: SafetensorsCheckpoint, reads: Sequence[BlockRead]) -> dict[str, Ranges]:
    """``{file: the byte ranges reads want}``, each tensor's as :data:`~.exchange_plan.Ranges` (ranges of two
    tensors that touch are not merged: sharing is decided per tensor)."""
    by_tensor: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for r in reads:
        info = checkpoint[r.block.source]
        grid = read_layout(r.block).grid(info.itemsize, info.data_start)
        by_tensor.setdefault((info.file, info.data_start), []).extend(grid.touching())
    by_file: dict[str, list[Ranges]] = {}
    for (f, _), ranges in sorted(by_tensor.items()):
        by_file.setdefault(f, []).append(as_ranges(ranges))
    return {f: np.concatenate(v) for f, v in by_file.items()}


def tensor_spans(checkpoint: SafetensorsCheckpoint, files: set[str]) -> dict[str, Ranges]:
    """``{file: its tensors' byte spans, ascending}`` for ``files`` (empty tensors left out)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for key in checkpoint:
        info = checkpoint[key]
        if info.file in files and info.nbytes:
            spans.setdefault(info.file, []).append((info.data_start, info.data_start + info.nbytes))
    return {f: np.array(sorted(s), dtype=np.int64).reshape(-1, 2) for f, s in spans.items()}


def exchanged_reads(
    plan: RankPlan,
    reader: RangeReader,
    reads: Sequence[BlockRead],
    options: LoadOptions,
    session: LoadSession,
    round_bytes: int | None = None,
    *,
    error: BaseException | None = None,
) -> tuple[list[BlockRead], BaseException | None, int]:
    """Execute the reads of the files with shared extents, round by round (see the module; ``round_bytes``: the
    budget of a round, :data:`ROUND_BYTES` when None; ``error``: this rank's failure so far, agreed first).
    Collective.

    Returns:
        The reads left (files without shared extents: the caller executes them), this rank's error from its last
        round (not agreed yet: the caller's next agreement point carries it), and the bytes received from peers.

    Raises:
        Exception | PeerFailure: agreed at a round's start: a rank's fetch or earlier round failed, or a rank
            hung or died (every rank raises the same).
    """
    mine: dict[str, Ranges] = {}
    try:
        if error is None:
            mine = wanted_ranges(plan.checkpoint, reads)
    except Exception as e:  # agreed below: every rank raises, none hangs in the gather
        error = e
    session.agree(error, "reading", point="wanted")
    identities = getattr(plan.checkpoint, "identities", None) or {}
    everyone: list[Any] = [None] * session.world
    with peer_errors("reading", "gathering the byte ranges every rank reads"):
        dist.all_gather_object(everyone, (mine, {f: repr(identities.get(f)) for f in mine}))
    wanted = agreed_files(everyone)
    spans = tensor_spans(plan.checkpoint, {f for w in wanted for f in w})
    plans = plan_files(wanted, spans)
    by_file: dict[str, list[tuple[int, BlockRead]]] = {}  # each read with its tensor's start
    for r in reads:
        info = plan.checkpoint[r.block.source]
        by_file.setdefault(info.file, []).append((info.data_start, r))
    received = 0
    budget = ROUND_BYTES if round_bytes is None else round_bytes
    for k, parts in enumerate(rounds(plans, session.world, budget, spans)):
        round_plans = {p.file: plans[p.file].part(p.lo, p.hi) for p in parts}  # one part of a file per round
        files = list(round_plans)
        fetched: dict[str, np.ndarray] = {}
        if error is None:
            try:
                fetched = fetch_chunks(plan.checkpoint, reader, round_plans, files, session.rank)
            except Exception as e:  # agreed next
                error = e
        session.agree(error, "reading", point=f"round{k}")
        try:
            with peer_errors("reading", "exchanging fetched bytes"):
                held, n = exchange(round_plans, files, fetched, session.rank, session.world, session.timeout)
        except PeerFailure as e:  # a rank that never reached the exchange (hung, died) is named by the store
            session.agree(e, "reading", point=f"exchange{k}")
            raise
        except CheckpointError as e:  # a piece failed its checksum: agreed at the next round's start, or by the caller
            error, held, n = e, {}, 0
        received += n
        try:
            if error is not None:
                continue
            round_reads = [r for p in parts for at, r in by_file.get(p.file, ()) if p.lo <= at < p.hi]
            execute_plan(
                plan,
                HeldReader(reader, held),
                replace(options, rollback=False),
                reads=round_reads,
                deferred=(),
                values=(),
            )
        except Exception as e:  # agreed at the next round's start, or by the caller
            error = e
    return [r for r in reads if plan.checkpoint[r.block.source].file not in plans], error, received


def agreed_files(everyone: Sequence[tuple[dict[str, Ranges], dict[str, str]]]) -> list[dict[str, Ranges]]:
    """Every rank's wanted ranges of the files every rank wanting them knows by the same identity: a file whose
    header two ranks read from different objects (replaced in between) is fetched by each rank on its own."""
    seen: dict[str, set[str]] = {}
    for _, ids in everyone:
        for f, i in ids.items():
            seen.setdefault(f, set()).add(i)
    return [{f: r for f, r in wants.items() if len(seen[f]) == 1} for wants, _ in everyone]


def fetch_chunks(
    checkpoint: SafetensorsCheckpoint, reader: RangeReader, plans: dict[str, FilePlan], files: Sequence[str], rank: int
) -> dict[str, np.ndarray]:
    """``{file: its chunks that rank fetches, concatenated}`` for ``files``, read through ``reader``."""
    identities = getattr(checkpoint, "identities", None) or {}
    out = {}
    for f in files:
        mine = plans[f].chunks.of(rank)
        if not len(mine):
            continue
        spans = [(int(a), int(b)) for a, b in mine]
        reader.expect(f, identities.get(f))
        reader.will_read(f, lambda spans=spans: spans, sparse=True)
        buf = np.empty(int((mine[:, 1] - mine[:, 0]).sum()), dtype=np.uint8)
        pos = 0
        for a, b in spans:
            reader.pread_into(f, a, memoryview(buf[pos : pos + b - a]))
            pos += b - a
        reader.verify(f)
        out[f] = buf
    return out


def _offsets_in(chunk_ranges: Ranges, starts: np.ndarray) -> np.ndarray:
    """Where bytes at ``starts`` lie in the concatenation of ``chunk_ranges``."""
    before = np.concatenate([[0], np.cumsum(chunk_ranges[:, 1] - chunk_ranges[:, 0])])
    k = np.searchsorted(chunk_ranges[:, 0], starts, side="right") - 1
    return before[k] + starts - chunk_ranges[k, 0]


def exchange(
    plans: dict[str, FilePlan],
    files: Sequence[str],
    fetched: dict[str, np.ndarray],
    rank: int,
    world: int,
    timeout: float | None = None,
) -> tuple[dict[str, HeldFile], int]:
    """Send every rank its pieces of this rank's chunks, receive this rank's pieces (one ``all_to_all_single``), each
    file's pieces from one rank checked against the checksum that rank sent (see the module). Collective.

    Returns:
        ``{file: HeldFile}`` of this rank's pieces, and the bytes received from other ranks.

    Raises:
        CheckpointError: the pieces of a file some rank sent fail their checksum (naming the file and that rank).
    """
    # what goes out: per peer (in rank order), per file, its pieces of this rank's chunks, ascending, then checksums
    send_sizes = [0] * world
    outgoing: list[tuple[str, int, Ranges]] = []
    for j in range(world):
        for f in files:
            ranges = plans[f].sends(rank, j) if j != rank and f in fetched else None
            if ranges is not None and int((ranges[:, 1] - ranges[:, 0]).sum()):
                outgoing.append((f, j, ranges))
                send_sizes[j] += int((ranges[:, 1] - ranges[:, 0]).sum()) + CHECKSUM_BYTES
    send = np.empty(sum(send_sizes), dtype=np.uint8)
    at, sums = 0, {j: [] for j in range(world)}
    for i, (f, j, ranges) in enumerate(outgoing):
        sizes = ranges[:, 1] - ranges[:, 0]
        n = int(sizes.sum())
        _place(send, at, fetched[f], _offsets_in(plans[f].chunks.of(rank), ranges[:, 0]), sizes)
        sums[j].append(zlib.crc32(memoryview(send[at : at + n])))
        at += n
        if i + 1 == len(outgoing) or outgoing[i + 1][1] != j:  # the last file for peer j: its checksums follow
            tail = np.array(sums[j], dtype="<u4").view(np.uint8)
            send[at : at + len(tail)] = tail
            at += len(tail)
    # what comes in: per holder, per file, its bytes of the file, then a checksum per file
    incoming: dict[int, list[tuple[str, int]]] = {i: [] for i in range(world)}
    for i in range(world):
        for f in files:
            n = int(plans[f].pieces[rank].sizes_from(i).sum()) if i != rank else 0
            if n:
                incoming[i].append((f, n))
    recv_sizes = [sum(n + CHECKSUM_BYTES for _, n in incoming[i]) for i in range(world)]
    recv = _all_to_all(send, send_sizes, recv_sizes, timeout)
    starts = np.concatenate([[0], np.cumsum(recv_sizes)])[:-1]
    cursor: dict[tuple[int, str], int] = {}  # where holder i's bytes of file f start in recv
    for i, got in incoming.items():
        check_received(recv, int(starts[i]), got, i)
        pos = int(starts[i])
        for f, n in got:
            cursor[(i, f)] = pos
            pos += n
    held: dict[str, HeldFile] = {}
    for f in files:
        p = plans[f].pieces[rank]
        if not len(p.starts):
            continue
        sizes = p.ends - p.starts
        offs = np.zeros(len(sizes), dtype=np.int64)
        for h in np.unique(p.holders).tolist():
            m = p.holders == h
            if h == rank:
                offs[m] = _offsets_in(plans[f].chunks.of(rank), p.starts[m])
            else:
                offs[m] = cursor[(h, f)] + np.concatenate([[0], np.cumsum(sizes[m])[:-1]])
        own = fetched.get(f, np.zeros(0, dtype=np.uint8))
        of = (p.holders == rank).astype(np.int64)  # 1: this rank's own chunk, 0: received
        held[f] = HeldFile(p.starts, p.ends, of, offs, (recv, own))
    return held, sum(n for got in incoming.values() for _, n in got)


def check_received(recv: np.ndarray, start: int, files: Sequence[tuple[str, int]], holder: int) -> None:
    """Check what ``holder`` sent, from ``recv[start:]``: each file's bytes (``(file, bytes)`` in order), then their
    checksums.

    Raises:
        CheckpointError: a file's bytes do not match the checksum ``holder`` sent (naming the file and ``holder``).
    """
    payload = sum(n for _, n in files)
    sent = recv[start + payload : start + payload + CHECKSUM_BYTES * len(files)].view("<u4")
    pos = start
    for (f, n), expected in zip(files, sent.tolist()):
        got = zlib.crc32(memoryview(recv[pos : pos + n]))
        if got != expected:
            why = f"the {n} bytes rank {holder} sent for exchanged reads fail their checksum (crc32 {got:08x}, sent"
            raise CheckpointError(f"{f}: {why} {expected:08x}): altered between its fetch and this rank", path=f)
        pos += n


def _place(dst: np.ndarray, at: int, src: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> None:
    """The pieces ``src[offsets[i]:offsets[i] + sizes[i]]`` one after another into ``dst`` from ``at``: gathered at
    once per distinct size."""
    if not len(sizes):
        return
    places = at + np.concatenate([[0], np.cumsum(sizes)[:-1]])
    by_size = np.argsort(sizes, kind="stable")
    distinct, first = np.unique(sizes[by_size], return_index=True)
    for n, lo, hi in zip(distinct.tolist(), first.tolist(), [*first[1:].tolist(), len(sizes)]):
        m = by_size[lo:hi]
        gather(dst, places[m], src, offsets[m], n)


def _all_to_all(send: np.ndarray, send_sizes: list[int], recv_sizes: list[int], timeout: float | None) -> np.ndarray:
    """``all_to_all_single`` of bytes, waiting at most ``timeout`` seconds; on this rank's GPU under NCCL (untested
    here), else on the CPU."""
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    out = torch.empty(sum(recv_sizes), dtype=torch.uint8, device=device)
    all_to_all_bytes(out, torch.from_numpy(send).to(device), recv_sizes, send_sizes, timeout=timeout)
    return out.cpu().numpy()


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
