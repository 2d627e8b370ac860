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

import numpy as np
import torch

import regiontrace as rt
from regiontrace.execute import apply_casts, dest_view

from ..checkpoint import FileReader, SafetensorsCheckpoint, TensorInfo, read_ranges
from ..plan import BlockRead
from ..plan.slots import TargetSlot, box_view
from .layout import ReadLayout, page_spans, read_layout, split_span

STAGING_BYTES = 64 << 20


#: blocks reading more contiguous runs than this are read by byte span and copied in one strided copy
STRIDED_RUNS = 32


#: a file this rank reads less than this fraction of is advised POSIX_FADV_RANDOM (readahead off for preads)
SPARSE_FRACTION = 0.5


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
    spans = []
    for r, info in items:
        lo, hi = r.block.source_span()
        spans.append((info.data_start + lo * info.itemsize, info.data_start + hi * info.itemsize))
    clusters = rt.layout.overlap_clusters(spans)
    sizes = [0] * (clusters[-1] + 1 if clusters else 0)
    for c in clusters:
        sizes[c] += 1
    return [sizes[c] == 1 for c in clusters]


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
