"""Writing a :class:`~loader.save.filelayout.SaveLayout` through the storage's write side
(:class:`~loader.storage.Staging`): preallocated files, headers, positional writes of the byte ranges a rank's
shards map to, and the commit that makes the checkpoint appear (the local driver's:
:mod:`loader.storage.local_commit`). No file is touched here but through the storage.

A block is written with one positioned write per run of contiguous file bytes: straight from the model tensor's
memory when the block reads a contiguous source range in order (a rename, a whole expert of a fused tensor, a
row shard), else from a staging copy in source order (:func:`regiontrace.executor.packed_source_runs`), at most
``staging_bytes`` at a time (a block is cut along its outer dims to fit).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

import regiontrace as rt
from regiontrace.executor import PackedRuns, dest_view, packed_source_runs, split_block

from ..storage import ObjectWriter, open_staging, stage
from .filelayout import SaveLayout, TensorPlace

#: Most bytes of packed values one cut of a block stages before it is written.
STAGING_BYTES = 64 << 20


def make_temp_folder(path: str) -> str:
    """A new empty staging folder ``<path>.tmp-XXXXXXXX`` next to ``path`` (:func:`loader.storage.stage`); ``path``
    a file, a mount point or holding one is refused (``ValueError``) first."""
    return stage(path).location


def create_files(folder: str, layout: SaveLayout) -> int:
    """Create every file of ``layout`` in ``folder`` at its full size (blocks reserved where the filesystem
    allows) with its header written; returns the header bytes written."""
    staging = open_staging(folder)
    for f in layout.files:
        staging.create(f.name, f.size, f.header)
    return sum(len(f.header) for f in layout.files)


def write_extras(folder: str, layout: SaveLayout, model: torch.nn.Module, total_parameters: int | None) -> None:
    """The index (several files only), ``config.json`` and ``generation_config.json`` as ``save_pretrained``
    writes them (the config records the model's dtype and class, on a copy: the model's config is untouched)."""
    text = layout.index_json(total_parameters)
    staging = open_staging(folder)
    if text is not None:
        staging.put(layout.index_name, text.encode("utf-8"))
    from ..rules import hf as hf_rules

    if not hf_rules.is_pretrained_model(model):
        return
    import copy

    config = copy.deepcopy(model.config)
    config.dtype = str(model.dtype).split(".")[1]
    config.architectures = [model.__class__.__name__.removeprefix("FSDP")]
    config.save_pretrained(staging.folder)
    if model.can_generate():
        model.generation_config.save_pretrained(staging.folder)


def commit(folder: str, path: str, layout: SaveLayout, timeout: float | None = None) -> None:
    """Make the checkpoint in ``folder`` appear at ``path`` in one step (the staging area's commit, locally
    :func:`loader.storage.local_commit.commit_folder`: under a lock, an existing folder's non-checkpoint files
    carried over, then one atomic swap of the two folders); ``timeout``: most seconds to wait for another save's
    commit into ``path``."""
    open_staging(folder, path).commit(timeout)


def remove_folder(folder: str | None) -> None:
    """Remove an unfinished save's folder (best effort: a failed save is already being raised)."""
    if folder:
        open_staging(folder).abort()


class BlockWriter:
    """Positional writes of model values into the files of a layout (opened lazily, write-only), a RemapBlock at
    a time (:meth:`write_block`).

    Args:
        folder: the folder holding the preallocated files; None counts the writes without making them (the
            values may then be meta tensors: :func:`loader.save.plan_writes`).
        layout: their layout.
        staging_bytes: most bytes of packed values staged at once.
        on_write: called with the byte count of every write (progress).
    """

    def __init__(
        self,
        folder: str | None,
        layout: SaveLayout,
        staging_bytes: int = STAGING_BYTES,
        on_write: Callable[[int], None] | None = None,
    ) -> None:
        self.folder, self.layout, self.staging_bytes = folder, layout, staging_bytes
        self.on_write = on_write
        self.bytes_written = 0
        self.writes = 0
        self.files: set[str] = set()
        self._staging = open_staging(folder) if folder is not None else None
        self._writers: dict[str, ObjectWriter] = {}

    def __enter__(self) -> BlockWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        writers, self._writers = self._writers, {}
        for w in writers.values():
            w.close()

    def write_block(self, block: rt.RemapBlock, values: torch.Tensor) -> None:
        """Write the source elements ``block`` maps ``values`` (the box's values) to."""
        place = self.layout.tensors[block.source]
        if block.numel == 0:
            return
        for cut in split_block(block, max(1, self.staging_bytes // place.itemsize)):  # no broadcast: reads = writes
            direct = _direct_view(cut, values)
            if direct is not None:  # the model's own memory (a device tensor: one staged copy of the cut)
                offset, view = direct
                self._write(place, offset, view.numel() * place.itemsize, view)
            else:
                self._write_runs(place, packed_source_runs(cut, values))

    def _write_runs(self, place: TensorPlace, runs: PackedRuns) -> None:
        data = _as_bytes(runs.values) if self.folder is not None else None
        starts = runs.starts.numpy()
        length = runs.run_length
        breaks = np.flatnonzero(np.diff(starts) != length) + 1  # runs that continue each other: one write
        firsts = np.concatenate(([0], breaks))
        lasts = np.concatenate((breaks, [len(starts)]))
        nbytes = length * place.itemsize
        for a, b in zip(firsts.tolist(), lasts.tolist()):
            self._write(
                place, int(starts[a]), (b - a) * nbytes, None if data is None else data[a * nbytes : b * nbytes]
            )

    def _write(self, place: TensorPlace, element: int, nbytes: int, data: memoryview | torch.Tensor | None) -> None:
        offset = place.start + element * place.itemsize
        if offset < place.start or offset + nbytes > place.start + place.nbytes:
            raise RuntimeError(f"write of {nbytes} bytes at {offset} lies outside tensor {place.key!r}")
        if self._staging is not None:
            writer = self._writers.get(place.file)
            if writer is None:
                writer = self._writers[place.file] = self._staging.open(place.file)
            writer.pwrite(offset, _as_bytes(data) if isinstance(data, torch.Tensor) else data)
        self.bytes_written += nbytes
        self.writes += 1
        self.files.add(place.file)
        if self.on_write is not None:
            self.on_write(nbytes)


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor (copied to the CPU first if needed), without a copy on the CPU."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    if flat.numel() and flat.stride(-1) != 1:  # a size-1 tensor may be "contiguous" with any stride
        flat = flat.clone(memory_format=torch.contiguous_format)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _direct_view(block: rt.RemapBlock, values: torch.Tensor) -> tuple[int, torch.Tensor] | None:
    """``(first source element, values view)`` when the block writes one contiguous source range in order from
    contiguous model memory of the source dtype: the bytes can be written as they are."""
    if block.casts or values.dtype != block.source_dtype:
        return None
    dims = [j for j, n in enumerate(block.shape) if n > 1]
    if any(block.src_strides[j] <= 0 for j in dims):
        return None
    dims.sort(key=lambda j: -block.src_strides[j])
    expected = 1
    for j in reversed(dims):
        if block.src_strides[j] != expected:
            return None
        expected *= block.shape[j]
    view = dest_view(block, values)
    view = view.permute([j for j, n in enumerate(block.shape) if n <= 1] + dims)
    if not view.is_contiguous():
        return None
    return block.src_offset, view
