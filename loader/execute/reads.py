"""Executing a rank's plan: read exactly the byte ranges its blocks need, copy them into model tensors.

Region reads are grouped per file in source order and read with ``os.preadv`` into the reused buffers of a
:class:`~.staging.StagingRing` (two of at most ``STAGING_BYTES`` each), or, for a host destination, straight
into the model tensor when the block is one contiguous run of the same dtype into a contiguous destination.
A buffer mirrors a stretch of the file: blocks read together (a batch) are read at their file offsets
relative to the batch's first byte, one call per run of touching byte ranges (bytes that several blocks need
are read once), and each block's values are a strided view of the buffer. A block of many runs (a column
shard) whose bytes no other block reads is read one call per page span (a stretch of runs whose gaps hold no
page the runs do not touch; its runs in closed form, :class:`regiontrace.executor.RunGrid`): either scattered, each run
straight into its destination row and each gap into a sink, or, where the cost model of
:mod:`loader.storage.scatter` says copying beats the kernel's cost per iovec (short runs), as its byte span into
a buffer and out in one strided copy. The ring copies each view into its destination: a plain strided copy
into host memory; for a CUDA destination a ``non_blocking`` copy out of pinned memory that overlaps the next
batch's reads (see :mod:`.staging`). No file is memory-mapped: a file that shrinks mid-load is a short read and a
``CheckpointError``, never a SIGBUS. Each file's identity (recorded with its header) is checked when it is
opened for data and again after its last read. Deferred conversions read their sources whole, run, and
copy the owned boxes of their outputs.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field

import torch

import regiontrace as rt
from regiontrace.executor import ReadLayout, dest_view, overlap_clusters, read_layout, split_span

from ..checkpoint import Checkpoint, TensorInfo, coalesce_ranges
from ..options import STAGING_BYTES
from ..plan import BlockRead
from ..plan.slots import TargetSlot, whole_boxes
from ..storage import RangeReader
from ..storage.capabilities import ScattersRuns, has
from .fills import is_fill, run_fills
from .pool import ReadPool, acquire, copy_threads, resolve_io_threads, submit_consecutive, submit_staged, torch_threads
from .routes import DIRECT, SCATTER, SPAN, Route, route_for
from .staging import GATHER_OVERREAD, Stage, StagingRing, align

#: a file this rank reads less than this fraction of is advised POSIX_FADV_RANDOM (readahead off for preads)
SPARSE_FRACTION = 0.5


def _scattered(executor: BlockExecutor, file: str, route: Route, dest: torch.Tensor, info: TensorInfo) -> None:
    """Read a ``SCATTER`` route's runs straight into ``dest`` (its view), the gaps into a sink, on a pool thread."""
    grid = info.run_grid(route.layout)
    read = functools.partial(executor.reader.read_runs_to, file, grid, route.targets(dest))
    executor.pool.submit(read, functools.partial(executor.progress, grid.count * grid.length), staged=False)


def _spanned(
    executor: BlockExecutor, file: str, r: BlockRead, info: TensorInfo, dest: torch.Tensor, route: Route
) -> None:
    """Read a ``SPAN`` route's block of many short runs by its byte span (gaps on pages it touches anyway), one call per
    stretch of runs, and copy it out in one strided copy (``dest``: the route's view)."""
    if route.parts:  # too sparse to copy its span to a device, too large to pack beside it: parts that fit both
        for block in split_span(r.block, info.elements_in(executor.staging_bytes * 3 // 4)):
            part = BlockRead(r.target, r.local_box, block)
            executor._spanned_part(file, part, info, dest_view(block, dest), read_layout(block))
        return
    executor._spanned_part(file, r, info, dest, route.layout)


def _whole_copy(r: BlockRead, local: torch.Tensor) -> bool:
    """Whether ``r`` copies its whole source, in order and unchanged, into the whole of ``local``, a contiguous
    host tensor of the source's dtype: what :func:`_direct_target` finds for such a block, found without
    building a view (once per tensor of a checkpoint of many small tensors)."""
    b = r.block
    shape = b.shape
    if b.casts or b.src_offset or shape != b.source_shape or local.dtype != b.source_dtype:
        return False
    dims, zeros, strides = _identity(shape)
    return (
        b.dst_dims == dims
        and b.dst_offset == zeros
        and b.src_strides == strides
        and all(s == 1 for s in b.dst_steps)
        and r.local_box == whole_boxes(shape)[0][1]
        and local.shape == shape
        and local.device.type == "cpu"
        and local.is_contiguous()
    )


@functools.lru_cache(maxsize=256)
def _identity(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The block dims, destination offset and source strides of a block copying a C-contiguous ``shape`` whole."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(range(len(shape))), (0,) * len(shape), tuple(reversed(strides))


def _bytes_view(t: torch.Tensor) -> memoryview:
    if t.dim() and t.numel() and t.is_contiguous():  # the usual case: its bytes without a reshape
        return memoryview(t.view(torch.uint8).numpy()).cast("B")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _bytes_of(tensors: dict[str, memoryview], target: str, local: torch.Tensor) -> memoryview:
    """The bytes of ``local`` (contiguous), kept in ``tensors`` under ``target``: made once per file, not per block."""
    view = tensors.get(target)
    if view is None:
        view = tensors[target] = _bytes_view(local)
    return view


def _byte_spans(items: list[tuple[BlockRead, TensorInfo]]) -> list[tuple[int, int]]:
    """Each item's byte span ``[lo, hi)`` in its file."""
    spans = []
    for r, info in items:
        lo, hi = r.block.source_span()
        spans.append(info.byte_span(lo, hi))
    return spans


def _sorted_by_start(items: list[tuple[BlockRead, TensorInfo]]) -> list[tuple[int, int]]:
    """Sort ``items`` in place by first byte (stable); their byte spans in that order (each computed once)."""
    spans = _byte_spans(items)
    order = sorted(range(len(items)), key=lambda i: spans[i][0])
    items[:] = [items[i] for i in order]
    return [spans[i] for i in order]


def _alone(spans: list[tuple[int, int]]) -> list[bool]:
    """For byte spans sorted by start: whether each one overlaps no other."""
    clusters = overlap_clusters(spans)
    sizes = [0] * (clusters[-1] + 1 if clusters else 0)
    for c in clusters:
        sizes[c] += 1
    return [sizes[c] == 1 for c in clusters]


def _byte_ranges(items: list[tuple[BlockRead, TensorInfo]]) -> list[tuple[int, int]]:
    """The byte ranges ``items`` read, in order: each block's runs, touching ones merged (a remote reader fetches
    these ahead)."""
    out = []
    for r, info in items:
        out.extend(info.run_grid(read_layout(r.block)).touching())
    return out


def _pack_bytes(block: rt.RemapBlock, span: int, wanted: int, room: int) -> int:
    """Bytes to reserve for packing ``block`` on the host before a copy to a device: its values' bytes when its
    span is sparse (more than :data:`~.staging.GATHER_OVERREAD` times the ``wanted`` bytes it reads) and they
    fit in ``room``, else 0 (its span is gathered on the device). Decided for every destination, so that host
    loads batch exactly as device loads do."""
    packed = block.numel * block.source_dtype.itemsize  # broadcast dims are packed expanded
    return packed if span > GATHER_OVERREAD * wanted and align(packed) <= room else 0


class _DirectReads:
    """Reads straight into model memory, gathered while their bytes follow one another in the file, then read by
    :meth:`~loader.checkpoint.RangeReader.pread_consecutive`: one call for many small tensors side by side."""

    def __init__(self, read: Callable[[str, int, list[memoryview]], None], file: str) -> None:
        self.read, self.file = read, file
        self.start = self.end = 0
        self.views: list[memoryview] = []

    def add(self, start: int, view: memoryview) -> None:
        if self.views and start != self.end:
            self.flush()
        if not self.views:
            self.start = self.end = start
        self.views.append(view)
        self.end += view.nbytes

    def flush(self) -> None:
        if self.views:
            self.read(self.file, self.start, self.views)
            self.views = []


@dataclass
class _Batch:
    """Blocks read together into one buffer: file bytes ``[base, end)`` at offset 0, then their pack areas."""

    base: int = 0
    end: int = 0
    pack: int = 0
    items: list = field(default_factory=list)

    def need(self, start: int, end: int, pack: int) -> int:
        """Bytes the buffer needs with a block of bytes ``[start, end)`` and ``pack`` bytes of pack area added."""
        if not self.items:
            return align(end - start) + align(pack)
        return align(max(self.end, end) - self.base) + self.pack + align(pack)

    def add(self, item: tuple, start: int, end: int, pack: int) -> None:
        if not self.items:
            self.base, self.end = start, end
        self.end = max(self.end, end)
        self.pack += align(pack)
        self.items.append((*item, start, pack))


class BlockExecutor:
    """Runs BlockReads against checkpoint files, tracking bytes read.

    Args:
        checkpoint: the checkpoint the reads' sources are in.
        slots: the target slots by name (their ``local`` tensors are written, on any device).
        reader: the open file reader (counts the bytes read).
        staging_bytes: bytes per staging buffer at most (blocks are split to fit).
        progress: called with the bytes of each block once it is read.
        staging: a ring of staging buffers to use (e.g. shared by several executors, so that pinned buffers
            are allocated once); its ``capacity`` then replaces ``staging_bytes``. Default: a new
            :class:`~.staging.StagingRing` of two buffers of ``staging_bytes`` (for several I/O threads,
            ``io_threads + 1`` buffers sharing that budget).
        io_threads: threads reading independent blocks at once (:mod:`.pool`); None: from the CPU share.
        routes: how each block is read (:mod:`.routes`): the routes the executor keeps for the plan
            (:func:`.routes.routes_of`), decided by its earlier loads.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        slots: Mapping[str, TargetSlot],
        reader: RangeReader,
        *,
        staging_bytes: int = STAGING_BYTES,
        progress: Callable[[int], None] | None = None,
        staging: StagingRing | None = None,
        io_threads: int | None = 1,
        routes: MutableMapping | None = None,
    ) -> None:
        self.checkpoint, self.slots, self.reader = checkpoint, slots, reader
        self.routes = {} if routes is None else routes
        self.threads = resolve_io_threads(io_threads)
        self.ring = staging if staging is not None else StagingRing.for_threads(staging_bytes, self.threads)
        self.staging_bytes = self.ring.capacity
        self.progress = progress or (lambda n: None)

    def run(self, reads: Iterable[BlockRead], *, finish: bool = True) -> None:
        """Execute ``reads``, file by file in source order; every copy has finished when it returns.

        Args:
            reads: the block reads.
            finish: wait for every copy to a device before returning; False leaves them queued (work queued
                after them on the device's stream sees their values; :meth:`StagingRing.finish` waits).

        A read whose block reads a constant source (:mod:`.fills`) fills its destination, reading no byte.

        Raises:
            CheckpointError: a file is short, or changed since its header was read (checked when it is
                opened and after its last read), naming the file.
        """
        identities = self.checkpoint.identities
        by_file: dict[str, list[tuple[BlockRead, TensorInfo]]] = {}
        targets, hint, fills = set(), 0, []
        for r in reads:
            if is_fill(r):  # a constant block: filled, no byte read
                fills.append(r)
                continue
            info = self.checkpoint[r.block.source]
            targets.add(r.target)
            for block in split_span(r.block, info.elements_in(self.staging_bytes)):
                part = r if block is r.block else BlockRead(r.target, r.local_box, block)  # most blocks fit whole
                by_file.setdefault(info.file, []).append((part, info))
                if hint < self.staging_bytes:
                    lo, hi = block.source_span()
                    hint += align((hi - lo) * info.itemsize)
        locals_ = (self.slots[t].local for t in targets)
        self.ring.prepare({t.device for t in locals_ if t is not None}, hint)
        run_fills(fills, self.slots)
        try:  # our copies with torch's threads at this thread's part of the CPU share (none oversubscribed)
            with torch_threads(copy_threads(self.threads)), ReadPool(self.threads) as self.pool:
                for file, items in by_file.items():
                    self.reader.expect(file, identities.get(file))
                    self._run_file(file, items)
                self.pool.drain()
            for file in by_file:
                self.reader.verify(file)  # rewritten during the reads: the bytes read may be garbage
        finally:
            if finish:
                self.ring.finish()  # no copy may land after run returns (rollback restores after a failure)

    def _run_file(self, file: str, items: list[tuple[BlockRead, TensorInfo]]) -> None:
        spans = _sorted_by_start(items)
        wanted = sum(r.block.read_numel * info.itemsize for r, info in items)
        identity = self.checkpoint.identities.get(file)
        size = identity.size if identity is not None else os.path.getsize(file)
        # sparse: readahead would read what other ranks need
        self.reader.will_read(file, lambda: _byte_ranges(items), sparse=wanted < SPARSE_FRACTION * size)
        consecutive = functools.partial(submit_consecutive, self.pool, self.reader, self.progress)
        cap, batch, direct_reads = self.staging_bytes, _Batch(), _DirectReads(consecutive, file)
        scatter, tensors = has(self.reader, ScattersRuns), {}
        for (r, info), alone in zip(items, _alone(spans)):
            local = self.slots[r.target].local
            host = self.ring.link_for(local) is None
            if alone and host and _whole_copy(r, local):
                direct_reads.add(info.data_start, _bytes_view(local))  # the common case, without building views
                continue
            route = route_for(self.routes, r, info, local, alone=alone, capacity=cap, host=host, scatter=scatter)
            layout, item = route.layout, info.itemsize
            if route.kind == DIRECT:  # into a contiguous tensor: a slice of its bytes, no view built
                view = _bytes_view(route.dest(local)) if route.at is None else _bytes_of(tensors, r.target, local)
                direct_reads.add(info.byte_at(layout.base), view[route.at or 0 :][: layout.run * item])
                continue
            dest = route.dest(local)  # no view built by narrowing
            if route.kind == SCATTER:
                _scattered(self, file, route, dest, info)  # the runs straight into place, the gaps into a sink
            elif route.kind == SPAN:
                _spanned(self, file, r, info, dest, route)
            else:
                span, want = (layout.end - layout.base) * item, layout.count * layout.run * item
                start = info.byte_at(layout.base)
                pack = _pack_bytes(r.block, span, want, cap - align(span))
                if batch.items and (batch.need(start, start + span, pack) > cap or (start - batch.base) % item):
                    self._staged(file, batch)  # full, or the block's values would not be aligned for its dtype
                    batch = _Batch()
                batch.add((r, info, dest, layout), start, start + span, pack)
        if batch.items:
            self._staged(file, batch)
        direct_reads.flush()

    def _spanned_part(self, file: str, r: BlockRead, info: TensorInfo, out: torch.Tensor, layout: ReadLayout) -> None:
        item = info.itemsize
        span, wanted = (layout.end - layout.base) * item, layout.count * layout.run * item
        pack = _pack_bytes(r.block, span, wanted, self.staging_bytes - align(span))
        stage = acquire(self.pool, self.ring, align(span) + align(pack))
        runs = info.run_grid(layout)  # the runs in closed form: page spans without listing them
        read = functools.partial(self.reader.read_runs, file, runs, stage.bytes[:span], runs.first, wanted=wanted)
        deliver = functools.partial(self._deliver, stage, r, info, out, layout, 0, align(span) if pack else None)
        submit_staged(self.pool, self.ring, stage, read, deliver, functools.partial(self.progress, wanted), [out])

    def _staged(self, file: str, batch: _Batch) -> None:
        """Read a batch's runs at their offsets from ``batch.base`` (touching ranges in one call), copy each out."""
        stage = acquire(self.pool, self.ring, batch.need(batch.base, batch.end, 0))
        ranges = []
        for _, info, _, layout, _, _ in batch.items:
            ranges.extend(info.run_grid(layout).touching())

        def read() -> None:
            for a, b, _ in coalesce_ranges(ranges, max_gap=0, max_overread=1.0):
                self.reader.pread_into(file, a, stage.bytes[a - batch.base : b - batch.base])

        def deliver() -> None:
            pack_at = align(batch.end - batch.base)
            for r, info, dest, layout, start, pack in batch.items:
                out, at = dest_view(r.block, dest), start - batch.base
                self._deliver(stage, r, info, out, layout, at, pack_at if pack else None)
                pack_at += align(pack)

        wanted = sum(layout.count * layout.run * info.itemsize for _, info, _, layout, _, _ in batch.items)
        done = functools.partial(self.progress, wanted)
        submit_staged(self.pool, self.ring, stage, read, deliver, done, [it[2] for it in batch.items])

    def _deliver(
        self, stage: Stage, r: BlockRead, info: TensorInfo, out: torch.Tensor, layout: ReadLayout, at: int, pack_at
    ) -> None:
        """Copy the block whose first byte is at ``stage.data[at]`` into ``out``, its own view of its destination."""
        src = torch.as_strided(stage.data.view(info.dtype), layout.shape, layout.steps, at // info.itemsize)
        self.ring.deliver(stage, src, layout.flips, out, r.block.casts, pack_at)
