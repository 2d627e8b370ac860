"""Exchanged reads, the read driver: bytes several ranks want interleaved (column shards) fetched once, each rank a
contiguous share, exchanged between the ranks, and read by each rank from memory.

Vocabulary (as :mod:`.exchange_plan`: *wanted*, *shared extent*, *share*, *parcel*, *section*, *round*; and
:mod:`.peers`: *peer*, *agreeing* at a *point*).

Every rank publishes the byte ranges its reads want (:meth:`~.peers.Peers.all_gather_bytes`) and computes the same
plan. Then, round by round (whole files, or a file over the budget in sections cut at tensor starts: at most
:attr:`~loader.options.LoadOptions.exchange_round_bytes` held per rank), each rank fetches its shares through its
reader (a few long requests instead of one per row), the ranks agree that every fetch succeeded (a failed, hung or
dead rank fails every rank), exchange the parcels (:func:`~.exchange.exchange`), and each rank executes the reads
of the tensors in the round's sections through a :class:`~loader.storage.held.HeldReader` serving its parcels from
memory. Wanted ranges outside shared extents are left to the caller, read as always through the same reader.

Value reads (:class:`~loader.plan.ValueRead`: a packed int4 or FP8 weight dequantized from its codes and scales)
want their inputs' bytes as block reads do, and are executed in the round whose sections hold all their inputs: a
packed column shard (a short run of every row of the codes and of the group scales) is exchanged like a bf16 one.

Bytes fetched per rank are about its slot's bytes (each share as long as what its holder wants in the extent);
requests are a few per share; bytes between ranks are each rank's slot minus what it fetched itself.

The driver talks to the other ranks only through :class:`~.peers.Peers`; a failure is an exception, agreed before it
leaves the driver (at the next round's start, or after the last round): every rank raises the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import replace

import numpy as np

import regiontrace as rt
from regiontrace.executor import is_constant, read_layout

from ..checkpoint import Checkpoint
from ..errors import PeerFailure
from ..options import LoadOptions
from ..plan import BlockRead, RankPlan, ValueRead
from ..storage import RangeReader
from ..storage.held import HeldReader
from .exchange import exchange
from .exchange_plan import FilePlan, Ranges, Section, as_ranges, plan_files, rounds
from .peers import Peers
from .run import execute_plan


def value_blocks(v: ValueRead) -> list[rt.RemapBlock]:
    """The blocks of ``v``'s program's inputs that read the checkpoint (constant ones read no byte)."""
    return [b for i in v.program.inputs for b in i.blocks if not is_constant(b.source)]


def wanted_ranges(checkpoint: Checkpoint, blocks: Iterable[rt.RemapBlock]) -> dict[str, Ranges]:
    """``{file: the byte ranges blocks want}``, each tensor's as :data:`~.exchange_plan.Ranges` (ranges of two
    tensors that touch are not merged: sharing is decided per tensor)."""
    by_tensor: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for block in blocks:
        info = checkpoint[block.source]
        grid = info.run_grid(read_layout(block))
        by_tensor.setdefault((info.file, info.data_start), []).extend(grid.touching())
    by_file: dict[str, list[Ranges]] = {}
    for (f, _), ranges in sorted(by_tensor.items()):
        by_file.setdefault(f, []).append(as_ranges(ranges))
    return {f: np.concatenate(v) for f, v in by_file.items()}


def tensor_spans(checkpoint: Checkpoint, files: set[str]) -> dict[str, Ranges]:
    """``{file: its tensors' byte spans, ascending}`` for ``files`` (empty tensors left out)."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for key in checkpoint:
        info = checkpoint[key]
        if info.split:  # stored as several chunks: a span each
            for location, start, end in info.spans():
                if location in files and end > start:
                    spans.setdefault(location, []).append((start, end))
        elif info.file in files and info.nbytes:
            spans.setdefault(info.file, []).append((info.data_start, info.data_start + info.nbytes))
    return {f: np.array(sorted(s), dtype=np.int64).reshape(-1, 2) for f, s in spans.items()}


def encode_wanted(wanted: dict[str, Ranges], identities: dict[str, str]) -> bytes:
    """A rank's wanted ranges and its files' identities (as text) as the bytes it publishes: a JSON header (its
    length first, 8 bytes little-endian), then every file's ranges as ``int64``, in the header's order."""
    header = json.dumps([[f, len(r), identities[f]] for f, r in wanted.items()]).encode()
    body = b"".join(np.ascontiguousarray(r, dtype="<i8").tobytes() for r in wanted.values())
    return len(header).to_bytes(8, "little") + header + body


def decode_wanted(data: bytes) -> tuple[dict[str, Ranges], dict[str, str]]:
    """What :func:`encode_wanted` made."""
    n = int.from_bytes(data[:8], "little")
    ranges = np.frombuffer(data, dtype="<i8", offset=8 + n).astype(np.int64)
    wanted, identities, at = {}, {}, 0
    for f, count, identity in json.loads(data[8 : 8 + n]):
        wanted[f] = ranges[2 * at : 2 * (at + count)].reshape(-1, 2)
        identities[f] = identity
        at += count
    return wanted, identities


def agreed_files(everyone: Sequence[tuple[dict[str, Ranges], dict[str, str]]]) -> list[dict[str, Ranges]]:
    """Every rank's wanted ranges of the files every rank wanting them knows by the same identity: a file whose
    header two ranks read from different objects (replaced in between) is fetched by each rank on its own."""
    seen: dict[str, set[str]] = {}
    for _, ids in everyone:
        for f, i in ids.items():
            seen.setdefault(f, set()).add(i)
    return [{f: r for f, r in wants.items() if len(seen[f]) == 1} for wants, _ in everyone]


def fetch_shares(
    checkpoint: Checkpoint, reader: RangeReader, plans: dict[str, FilePlan], files: Sequence[str], rank: int
) -> dict[str, np.ndarray]:
    """``{file: its shares that rank fetches, concatenated}`` for ``files``, read through ``reader``."""
    identities = checkpoint.identities
    out = {}
    for f in files:
        mine = plans[f].shares.of(rank)
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


def _publish(
    plan: RankPlan, reads: Sequence[BlockRead], values: Sequence[ValueRead], peers: Peers
) -> list[dict[str, Ranges]]:
    """Every rank's wanted ranges (of its block reads and its value reads' inputs) of the files every rank knows by
    one identity (:func:`agreed_files`): computed, agreed (a rank that could not fails every rank), then gathered."""
    mine: dict[str, Ranges] = {}
    error = None
    try:
        blocks = [r.block for r in reads] + [b for v in values for b in value_blocks(v)]
        mine = wanted_ranges(plan.checkpoint, blocks)
    except Exception as e:  # agreed next: every rank raises, none hangs in the gather
        error = e
    peers.agree(error, "wanted")
    identities = plan.checkpoint.identities
    data = encode_wanted(mine, {f: repr(identities.get(f)) for f in mine})
    return agreed_files([decode_wanted(d) for d in peers.all_gather_bytes(data)])


def _round_of_values(
    checkpoint: Checkpoint, values: Sequence[ValueRead], plans: dict[str, FilePlan], groups: list[list[Section]]
) -> dict[int, list[ValueRead]]:
    """``{round: the value reads executed in it}``: a value read whose inputs lie in files with shares is executed in
    the first round whose sections hold every such input's tensor (its inputs in other files are read through the
    reader there); one whose inputs no round holds together (a file cut between them), or none of whose inputs has
    shares, is left to the caller."""
    where: dict[tuple[str, int], int] = {}  # (file, tensor start) -> its round, found per section

    def round_of(file: str, start: int) -> int:
        k = where.get((file, start))
        if k is None:
            found = (n for n, g in enumerate(groups) for sec in g if sec.file == file and sec.lo <= start < sec.hi)
            k = where[(file, start)] = next(found, -1)
        return k

    out: dict[int, list[ValueRead]] = {}
    for v in values:
        infos = [checkpoint[b.source] for b in value_blocks(v)]
        rounds_ = {round_of(i.file, i.data_start) for i in infos if i.file in plans}
        if len(rounds_) == 1 and -1 not in rounds_:
            out.setdefault(rounds_.pop(), []).append(v)
    return out


def exchanged_reads(
    plan: RankPlan,
    reader: RangeReader,
    reads: Sequence[BlockRead],
    options: LoadOptions,
    peers: Peers,
    values: Sequence[ValueRead] = (),
) -> tuple[list[BlockRead], list[ValueRead], int]:
    """Execute the reads of the files with shared extents, round by round (see the module). Collective.

    Args:
        plan: this rank's plan.
        reader: the open reader (shares are fetched through it; held bytes served in front of it).
        reads: this rank's block reads (of ``plan``).
        options: how to execute the reads (``rollback`` is the caller's: off here); ``exchange_round_bytes``: the
            most bytes a rank holds for one round (its shares and the parcels it receives), unless one tensor holds
            more (a round of its own).
        peers: the group.
        values: this rank's value reads (of ``plan``): their inputs' bytes are wanted as a block read's are (a
            packed int4 column shard: a short run of every row of its codes and scales), and each is executed in
            the round holding its inputs.

    Returns:
        The block reads left (files without shared extents) and the value reads left (see
        :func:`_round_of_values`): the caller executes them; and the bytes received from peers.

    Raises:
        Exception | PeerFailure: agreed (every rank raises the same): a rank could not say what it wants, a rank's
            fetch or round failed (agreed at the next round's start, or after the last), or a rank never reached
            an exchange (hung, died).
    """
    wanted = _publish(plan, reads, values, peers)
    spans = tensor_spans(plan.checkpoint, {f for w in wanted for f in w})
    plans = plan_files(wanted, spans)
    by_file: dict[str, list[tuple[int, BlockRead]]] = {}  # each read with its tensor's start
    for r in reads:
        info = plan.checkpoint[r.block.source]
        by_file.setdefault(info.file, []).append((info.data_start, r))
    groups = rounds(plans, peers.world, options.exchange_round_bytes, spans)
    by_round = _round_of_values(plan.checkpoint, values, plans, groups)
    error: BaseException | None = None
    received = 0
    for k, sections in enumerate(groups):
        round_plans = {s.file: plans[s.file].section(s.lo, s.hi) for s in sections}  # one section of a file a round
        files = list(round_plans)
        fetched: dict[str, np.ndarray] = {}
        if error is None:
            try:
                fetched = fetch_shares(plan.checkpoint, reader, round_plans, files, peers.rank)
            except Exception as e:  # agreed next
                error = e
        peers.agree(error, f"round{k}")
        try:
            held, n = exchange(round_plans, files, fetched, peers)
        except PeerFailure as e:  # a rank that never reached the exchange (hung, died) is named by the agreement
            peers.agree(e, f"exchange{k}")
            raise
        except Exception as e:  # a consignment failed its checksum: agreed at the next round's start, or after the last
            error, held, n = e, {}, 0
        received += n
        try:
            if error is not None:
                continue
            round_reads = [r for s in sections for at, r in by_file.get(s.file, ()) if s.lo <= at < s.hi]
            execute_plan(
                plan,
                HeldReader(reader, held),
                replace(options, rollback=False),
                reads=round_reads,
                deferred=(),
                values=by_round.get(k, ()),
            )
        except Exception as e:  # agreed at the next round's start, or after the last
            error = e
    peers.agree(error, "exchanged")
    done = {id(v) for vs in by_round.values() for v in vs}
    left = [r for r in reads if plan.checkpoint[r.block.source].file not in plans]
    return left, [v for v in values if id(v) not in done], received
