"""Executing a rank's plan: read exactly the byte ranges its blocks need, copy them into model tensors.

Region reads are grouped per file in source order and read with ``os.pread`` into bounded staging buffers
(at most ``STAGING_BYTES`` at a time), or straight into the model tensor when the block is one contiguous
run of the same dtype into a contiguous destination. Deferred conversions read their sources whole, run,
and copy the owned boxes of their outputs.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import torch

import regiontrace as rt
from regiontrace.execute import apply_casts, dest_view, source_view

from .checkpoint import FileReader, SafetensorsCheckpoint, TensorInfo, read_ranges, read_tensor
from .plan import BlockRead, DeferredRead, deferred_inputs
from .targets import TargetSlot, box_view

STAGING_BYTES = 64 << 20
#: blocks reading more contiguous runs than this are copied from a memory map in one strided copy
MAPPED_RUNS = 32
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

    def __init__(self, checkpoint: SafetensorsCheckpoint, slots: Mapping[str, TargetSlot], reader: FileReader,
                 *, staging_bytes: int = STAGING_BYTES, progress: Callable[[int], None] | None = None) -> None:
        self.checkpoint, self.slots, self.reader = checkpoint, slots, reader
        self.staging_bytes = staging_bytes
        self.progress = progress or (lambda n: None)

    def run(self, reads: Iterable[BlockRead]) -> None:
        by_file: dict[str, list[tuple[BlockRead, TensorInfo]]] = {}
        for r in reads:
            info = self.checkpoint[r.block.source]
            for block in split_block(r.block, max(1, self.staging_bytes // info.itemsize)):
                by_file.setdefault(info.file, []).append((BlockRead(r.target, r.local_box, block), info))
        for file, items in by_file.items():
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
                if alone and len(layout.runs) > MAPPED_RUNS and info.data_start % info.itemsize == 0:
                    self._mapped(file, r, info, dest)
                    continue
                batch.append((r, info, dest, layout))
                size += len(layout.runs) * layout.run * info.itemsize
                if size >= self.staging_bytes:
                    self._staged(file, batch)
                    batch, size = [], 0
            if batch:
                self._staged(file, batch)

    def _mapped(self, file: str, r: BlockRead, info: TensorInfo, dest: torch.Tensor) -> None:
        """Copy a block of many small runs straight out of a memory map (one strided copy, no per-run calls)."""
        mapping = self.reader.mapping(file, info.data_end)
        lo, hi = r.block.source_span()
        self.reader.prefetch(file, info.data_start + lo * info.itemsize, info.data_start + hi * info.itemsize)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the map is read-only; it is only ever read
            whole = torch.frombuffer(mapping, dtype=torch.uint8, offset=info.data_start, count=info.nbytes)
        src = source_view(r.block, whole.view(info.dtype).view(info.shape))
        dest_view(r.block, dest).copy_(apply_casts(src, r.block.casts))
        nbytes = r.block.read_numel * info.itemsize
        self.reader.count(nbytes)
        self.progress(nbytes)

    def _staged(self, file: str, batch: list) -> None:
        ranges = []
        for _, info, _, layout in batch:
            nbytes = layout.run * info.itemsize
            ranges.extend((info.data_start + s * info.itemsize, info.data_start + s * info.itemsize + nbytes)
                          for s in layout.runs)
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


def run_deferred(deferred: DeferredRead, checkpoint: SafetensorsCheckpoint, slots: Mapping[str, TargetSlot],
                 reader: FileReader) -> None:
    """Read the conversion's sources whole, run it for real, copy the owned boxes of its outputs."""
    tensors = {k: read_tensor(checkpoint[k], reader) for k in deferred.conversion.sources}
    apply_deferred(deferred, tensors, slots)


def apply_deferred(deferred: DeferredRead, tensors: Mapping[str, torch.Tensor],
                   slots: Mapping[str, TargetSlot]) -> None:
    """Run a deferred conversion on its real source tensors and copy the owned boxes of its outputs."""
    outs = deferred.conversion.run(deferred_inputs(deferred.conversion, tensors, slots))
    for target, g, lb in deferred.boxes:
        src = outs[target]
        for d, (a, b) in enumerate(g):
            src = src.narrow(d, a, b - a)
        box_view(slots[target].local, lb).copy_(src)
