"""Executing a rank's plan: read exactly the byte ranges its blocks need, copy them into model tensors.

Region reads are grouped per file in source order and read with ``os.preadv`` into bounded staging buffers
(at most ``STAGING_BYTES`` at a time), or straight into the model tensor when the block is one contiguous
run of the same dtype into a contiguous destination. A block of many short runs (a column shard) is read
as its byte span, one call per stretch of runs whose gaps hold no page the runs do not touch, then copied
out in one strided copy. No file is memory-mapped: a file that shrinks mid-load is a short read and a
``CheckpointError``, never a SIGBUS. Each file's identity (recorded with its header) is checked when it is
opened for data and again after its last read. Deferred conversions read their sources whole, run, and
copy the owned boxes of their outputs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import numpy as np
import torch

import regiontrace as rt
from regiontrace.execute import apply_casts, dest_view

from .checkpoint import FileReader, SafetensorsCheckpoint, TensorInfo, read_ranges, read_tensor
from .checkpoint.files import PAGE
from .plan import BlockRead, DeferredRead, deferred_inputs
from .targets import TargetSlot, box_view

STAGING_BYTES = 64 << 20
#: blocks reading more contiguous runs than this are read by byte span and copied in one strided copy
STRIDED_RUNS = 32
#: a file this rank reads less than this fraction of is advised POSIX_FADV_RANDOM (readahead off for preads)
SPARSE_FRACTION = 0.5


@dataclass(frozen=True)
class ReadLayout:
    """How a block's source elements sit in a packed staging buffer.

    ``runs`` are the flat element offsets of equal-length contiguous runs (``run`` elements each), read one
    after another; ``strides`` view the packed buffer in block index order (before ``flips``).
    """

    runs: tuple[int, ...]
    run: int
    strides: tuple[int, ...]
    flips: tuple[int, ...]


def read_layout(block: rt.RemapBlock) -> ReadLayout:
    """The packed read layout of ``block``: outer dims enumerated, inner contiguous dims kept as runs."""
    shape, strides = block.shape, block.src_strides
    flips = tuple(j for j, s in enumerate(strides) if s < 0 and shape[j] > 1)
    base = block.src_offset + sum((shape[j] - 1) * strides[j] for j in flips)
    dims = sorted((j for j in range(len(shape)) if strides[j] != 0 and shape[j] > 1), key=lambda j: -abs(strides[j]))
    packed = [0] * len(shape)
    run = 1
    while dims and abs(strides[dims[-1]]) == run:
        j = dims.pop()
        packed[j] = run
        run *= shape[j]
    weight = run
    for j in reversed(dims):
        packed[j] = weight
        weight *= shape[j]
    starts = [base]
    for j in dims:
        s = abs(strides[j])
        starts = [b + i * s for b in starts for i in range(shape[j])]
    return ReadLayout(tuple(starts), run, tuple(packed), flips)


def split_block(block: rt.RemapBlock, max_elems: int) -> list[rt.RemapBlock]:
    """Split ``block`` along its outermost source dim so each part reads at most ``max_elems`` elements."""
    if block.read_numel <= max_elems:
        return [block]
    dims = sorted((j for j in range(len(block.shape)) if block.shape[j] > 1), key=lambda j: -abs(block.src_strides[j]))
    j = dims[0]
    inner = block.numel // block.shape[j]
    step = max(1, max_elems // max(inner, 1))
    parts = []
    for a in range(0, block.shape[j], step):
        n = min(step, block.shape[j] - a)
        shape = block.shape[:j] + (n,) + block.shape[j + 1 :]
        dst = list(block.dst_offset)
        dst[block.dst_dims[j]] += a * block.dst_steps[j]
        offset = block.src_offset + a * block.src_strides[j]
        part = replace(block, shape=shape, src_offset=offset, dst_offset=tuple(dst))
        parts.extend(split_block(part, max_elems) if n == 1 and len(dims) > 1 else [part])
    return parts


def split_span(block: rt.RemapBlock, max_elems: int) -> list[rt.RemapBlock]:
    """:func:`split_block`, then split again each part whose source span exceeds ``max_elems`` (where it can)."""
    parts = []
    for part in split_block(block, max_elems):
        lo, hi = part.source_span()
        if hi - lo <= max_elems or part.read_numel <= 1:
            parts.append(part)
            continue
        sub = split_block(part, max(1, part.read_numel * max_elems // (hi - lo)))
        parts.extend([part] if len(sub) == 1 else [p for q in sub for p in split_span(q, max_elems)])
    return parts


def page_spans(starts: np.ndarray, length: int, page: int = PAGE) -> list[tuple[int, int]]:
    """Byte runs ``[s, s + length)`` merged into ranges whose gaps hold no page that no run touches.

    Reading such a range through its gaps reads no page more than the runs alone would.
    """
    starts = np.sort(starts)
    ends = starts + length
    cut = np.flatnonzero(starts[1:] // page - (ends[:-1] - 1) // page > 1) + 1
    firsts = np.concatenate(([0], cut))
    lasts = np.concatenate((cut - 1, [len(starts) - 1]))
    return list(zip(starts[firsts].tolist(), ends[lasts].tolist()))


def _direct_target(block: rt.RemapBlock, dest: torch.Tensor, layout: ReadLayout) -> torch.Tensor | None:
    """The destination view when the block can be pread straight into model memory, else None."""
    if block.casts or dest.dtype != block.source_dtype or len(layout.runs) != 1 or layout.flips:
        return None
    if dest.device.type != "cpu":
        return None
    view = dest_view(block, dest)
    if not view.is_contiguous():
        return None
    want = [0] * len(block.shape)
    acc = 1
    for j in range(len(block.shape) - 1, -1, -1):
        want[j] = acc if block.shape[j] > 1 else 0
        acc *= block.shape[j]
    packed = [p if block.shape[j] > 1 else 0 for j, p in enumerate(layout.strides)]
    if packed != want or any(s == 0 and n > 1 for s, n in zip(block.src_strides, block.shape)):
        return None
    return view


def _bytes_view(t: torch.Tensor) -> memoryview:
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def _alone(items: list[tuple[BlockRead, TensorInfo]]) -> list[bool]:
    """For items sorted by first byte: whether each one's byte span overlaps no other item's span."""
    cluster, sizes, end = [], [], -1  # clusters of overlapping spans
    for r, info in items:
        lo, hi = r.block.source_span()
        a, b = info.data_start + lo * info.itemsize, info.data_start + hi * info.itemsize
        if a >= end:
            sizes.append(0)
        sizes[-1] += 1
        cluster.append(len(sizes) - 1)
        end = max(end, b)
    return [sizes[c] == 1 for c in cluster]


class BlockExecutor:
    """Runs BlockReads against checkpoint files, tracking bytes read."""

    def __init__(
        self,
        checkpoint: SafetensorsCheckpoint,
        slots: Mapping[str, TargetSlot],
        reader: FileReader,
        *,
        staging_bytes: int = STAGING_BYTES,
        progress: Callable[[int], None] | None = None,
    ) -> None:
        self.checkpoint, self.slots, self.reader = checkpoint, slots, reader
        self.staging_bytes = staging_bytes
        self.progress = progress or (lambda n: None)
        self._stage: torch.Tensor | None = None  # reused staging buffer of span reads

    def run(self, reads: Iterable[BlockRead]) -> None:
        """Execute ``reads``, file by file in source order.

        Raises:
            CheckpointError: a file is short, or changed since its header was read (checked when it is
                opened and after its last read), naming the file.
        """
        identities = getattr(self.checkpoint, "identities", None) or {}
        by_file: dict[str, list[tuple[BlockRead, TensorInfo]]] = {}
        for r in reads:
            info = self.checkpoint[r.block.source]
            for block in split_span(r.block, max(1, self.staging_bytes // info.itemsize)):
                by_file.setdefault(info.file, []).append((BlockRead(r.target, r.local_box, block), info))
        for file, items in by_file.items():
            self.reader.expect(file, identities.get(file))
            self._run_file(file, items)
            self.reader.verify(file)  # rewritten during the reads: the bytes read may be garbage

    def _run_file(self, file: str, items: list[tuple[BlockRead, TensorInfo]]) -> None:
        items.sort(key=lambda it: it[1].data_start + it[0].block.source_span()[0] * it[1].itemsize)
        wanted = sum(r.block.read_numel * info.itemsize for r, info in items)
        if wanted < SPARSE_FRACTION * os.path.getsize(file):
            self.reader.advise_sparse(file)  # readahead would read what other ranks need
        batch, size = [], 0
        for (r, info), alone in zip(items, _alone(items)):
            dest = box_view(self.slots[r.target].local, r.local_box)
            layout = read_layout(r.block)
            # a block whose bytes may overlap another's is staged, where overlapping ranges are read once
            direct = _direct_target(r.block, dest, layout) if alone else None
            if direct is not None:
                start = info.data_start + layout.runs[0] * info.itemsize
                self.reader.pread_into(file, start, _bytes_view(direct))
                self.progress(direct.numel() * info.itemsize)
                continue
            lo, hi = r.block.source_span()
            if alone and len(layout.runs) > STRIDED_RUNS and (hi - lo) * info.itemsize <= self.staging_bytes:
                self._spanned(file, r, info, dest, layout)
                continue
            batch.append((r, info, dest, layout))
            size += len(layout.runs) * layout.run * info.itemsize
            if size >= self.staging_bytes:
                self._staged(file, batch)
                batch, size = [], 0
        if batch:
            self._staged(file, batch)

    def _spanned(self, file: str, r: BlockRead, info: TensorInfo, dest: torch.Tensor, layout: ReadLayout) -> None:
        """Read a block of many short runs by its byte span (gaps on pages it touches anyway) and copy it
        out in one strided copy: one read call per stretch of runs, not one per run."""
        item, block = info.itemsize, r.block
        lo, hi = block.source_span()
        base = info.data_start + lo * item
        if self._stage is None or self._stage.numel() < (hi - lo) * item:
            self._stage = torch.empty((hi - lo) * item, dtype=torch.uint8)
        stage = self._stage[: (hi - lo) * item]
        starts = info.data_start + np.asarray(layout.runs, dtype=np.int64) * item
        wanted = len(layout.runs) * layout.run * item
        spans = page_spans(starts, layout.run * item)
        if len(spans) > 1:  # queue every stretch's pages at once rather than one synchronous read after another
            for a, b in spans:
                self.reader.advise_willneed(file, a, b)
        self.reader.read_spans(file, spans, memoryview(stage.numpy()), base, wanted=wanted)
        flips = [j for j, st in enumerate(block.src_strides) if st < 0]
        first = block.src_offset + sum((block.shape[j] - 1) * block.src_strides[j] for j in flips) - lo
        src = torch.as_strided(stage.view(info.dtype), block.shape, [abs(st) for st in block.src_strides], first)
        if flips:
            src = src.flip(flips)
        dest_view(block, dest).copy_(apply_casts(src, block.casts))
        self.progress(wanted)

    def _staged(self, file: str, batch: list) -> None:
        ranges = []
        for _, info, _, layout in batch:
            nbytes = layout.run * info.itemsize
            ranges.extend(
                (info.data_start + s * info.itemsize, info.data_start + s * info.itemsize + nbytes) for s in layout.runs
            )
        views = read_ranges(file, ranges, max_gap=0, max_overread=1.0, reader=self.reader)
        pos = 0
        for r, info, dest, layout in batch:
            n = len(layout.runs)
            raw = bytearray().join(views[pos : pos + n])  # one copy out of the read buffers
            pos += n
            if raw:
                packed = torch.frombuffer(raw, dtype=torch.uint8).view(info.dtype)
                src = torch.as_strided(packed, r.block.shape, layout.strides)
            else:
                src = torch.empty(r.block.shape, dtype=info.dtype)
            if layout.flips:
                src = src.flip(layout.flips)
            dest_view(r.block, dest).copy_(apply_casts(src, r.block.casts))
            self.progress(len(raw))


def run_deferred(
    deferred: DeferredRead, checkpoint: SafetensorsCheckpoint, slots: Mapping[str, TargetSlot], reader: FileReader
) -> None:
    """Read the conversion's sources whole, run it for real, copy the owned boxes of its outputs.

    Raises:
        CheckpointError: a source file is short, or changed since its header was read.
    """
    identities = getattr(checkpoint, "identities", None) or {}
    for file in {checkpoint[k].file for k in deferred.conversion.sources}:
        reader.expect(file, identities.get(file))
    tensors = {k: read_tensor(checkpoint[k], reader) for k in deferred.conversion.sources}  # each verified
    apply_deferred(deferred, tensors, slots)


def apply_deferred(
    deferred: DeferredRead, tensors: Mapping[str, torch.Tensor], slots: Mapping[str, TargetSlot]
) -> None:
    """Run a deferred conversion on its real source tensors and copy the owned boxes of its outputs."""
    outs = deferred.conversion.run(deferred_inputs(deferred.conversion, tensors, slots))
    for target, g, lb in deferred.boxes:
        src = outs[target]
        for d, (a, b) in enumerate(g):
            src = src.narrow(d, a, b - a)
        box_view(slots[target].local, lb).copy_(src)
