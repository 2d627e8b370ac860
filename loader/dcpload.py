"""The state of one ``dcp.load`` with :class:`~loader.HFLoadPlanner`: what each ``ReadItem`` stands for, and the
checkpoint as it travels in DCP's ``Metadata``.

A RemapBlock becomes one ``ReadItem`` (a plain box of its source, or the span of a strided read that only
:class:`~loader.SafetensorsReader` executes); a value read (pointwise ops over regions) one ``ReadItem`` per input
block, executed by :class:`~loader.SafetensorsReader` only; a deferred conversion one ``ReadItem`` per whole source. The
checkpoint's headers, file identities and root travel in the metadata's ``storage_data``
(:func:`checkpoint_metadata`, read back by :func:`checkpoint_from_metadata`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from regiontrace.executor import copy_cast, dest_view, source_view

from .checkpoint import Checkpoint, SafetensorsCheckpoint, TensorInfo
from .execute import apply_deferred, run_fills
from .options import StorageOptions
from .plan import BlockRead, DeferredRead, RankPlan, ValueRead
from .plan.rank import value_blocks
from .plan.slots import TargetSlot, box_view
from .storage import FileIdentity, ObjectIdentity, is_url, open_store

__all__ = ["CheckpointRoot", "DcpLoad", "checkpoint_from_metadata", "checkpoint_metadata"]

#: the ``storage_data`` key of the checkpoint's :class:`CheckpointRoot`
ROOT_INDEX = MetadataIndex("__checkpoint_root__")


@dataclass(frozen=True)
class CheckpointRoot:
    """The checkpoint's folder, carried in the metadata's ``storage_data`` (under :data:`ROOT_INDEX`)."""

    path: str


def checkpoint_metadata(checkpoint: Checkpoint) -> Metadata:
    """DCP metadata of ``checkpoint``: one chunk per tensor; ``storage_data`` holds each tensor's
    :class:`~loader.checkpoint.TensorInfo`, each file's :class:`~loader.checkpoint.FileIdentity` (checked by the
    reads) and the :class:`CheckpointRoot`."""
    sd_md: dict = {}
    storage: dict = {}
    for key, info in checkpoint.tensors.items():
        zeros = torch.Size([0] * len(info.shape))
        sd_md[key] = TensorStorageMetadata(
            TensorProperties(dtype=info.dtype),
            torch.Size(info.shape),
            [ChunkStorageMetadata(zeros, torch.Size(info.shape))],
        )
        storage[MetadataIndex(key, zeros)] = info
    for file, identity in checkpoint.identities.items():
        storage[MetadataIndex(file)] = identity
    storage[ROOT_INDEX] = CheckpointRoot(checkpoint.root)
    return Metadata(state_dict_metadata=sd_md, storage_data=storage)


def holds_headers(metadata: Metadata | None) -> bool:
    """Whether ``metadata`` carries our headers (:func:`checkpoint_metadata`), not another reader's."""
    return any(isinstance(v, TensorInfo) for v in (getattr(metadata, "storage_data", None) or {}).values())


@dataclass(frozen=True)
class _BlockItem:
    """A ``ReadItem`` standing for one region read; ``box`` is its :meth:`~regiontrace.RemapBlock.source_box`
    (None for a strided read), computed once."""

    read: BlockRead
    box: tuple | None


@dataclass(frozen=True)
class _SourceItem:
    """A ``ReadItem`` standing for one whole source tensor of the deferred conversion ``plan.deferred[index]``,
    read into ``staged``."""

    index: int
    key: str
    staged: torch.Tensor


@dataclass(frozen=True)
class _ValueItem:
    """A ``ReadItem`` standing for one input block of the value read ``plan.values[index]`` (only
    :class:`~loader.SafetensorsReader` executes value reads: it asks the planner for them)."""

    index: int


@dataclass
class DcpLoad:
    """The state of one ``dcp.load``: the plan, what each ``ReadItem`` stands for, the deferred conversions'
    sources read so far, and the bytes of the items committed (what a storage reader that counts nothing itself
    read: torch's). ``boxes_only``: the storage reader reads plain boxes only (its plan then holds no value reads:
    they are deferred)."""

    plan: RankPlan
    boxes_only: bool
    items: dict[str, _BlockItem | _SourceItem | _ValueItem] = field(default_factory=dict)
    pending: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    bytes_read: int = 0

    def local_plan(self) -> LoadPlan:
        """The ``LoadPlan`` of this rank: one ``ReadItem`` per block read, one per input block of a value read, one
        per source of a deferred conversion.

        Raises:
            ValueError: a strided read or a value read, and the storage reader reads plain boxes only.
        """
        plan = self.plan
        blocks = [_BlockItem(r, r.block.source_box()) for r in plan.reads]
        if self.boxes_only:
            for item in blocks:
                if item.box is None:
                    raise _strided_error(item.read)
        items = []
        for i, item in enumerate(blocks):
            fqn = f"__block__/{i}"
            self.items[fqn] = item
            items.append(_block_item(fqn, item))
        for j, v in enumerate(plan.values):
            if self.boxes_only:
                raise _value_error(v)
            for k, b in enumerate(value_blocks(v)):  # constant inputs are filled, not read
                fqn = f"__value__/{j}/{k}"
                self.items[fqn] = _ValueItem(j)
                items.append(_block_item(fqn, _BlockItem(BlockRead(v.target, v.local_box, b), b.source_box())))
        for j, d in enumerate(plan.deferred):
            if not d.boxes:
                continue
            self.pending[j] = {}
            for key in d.conversion.sources:
                fqn = f"__deferred__/{j}/{key}"
                info = plan.checkpoint[key]
                self.items[fqn] = _SourceItem(j, key, torch.empty(info.shape, dtype=info.dtype))
                zeros = torch.Size([0] * len(info.shape))
                items.append(
                    ReadItem(
                        LoadItemType.TENSOR,
                        MetadataIndex(fqn, zeros),
                        zeros,
                        _storage_index(key, len(info.shape)),
                        zeros,
                        torch.Size(info.shape),
                    )
                )
        return LoadPlan(items)

    def fill_constants(self) -> None:
        """Run the plan's constant fills (no byte read) when another storage reader reads the boxes: it runs none
        of the plan itself (:class:`~loader.SafetensorsReader` runs them with the reads)."""
        if self.boxes_only:
            run_fills(self.plan.fills, self.plan.slots)

    def resolve(self, read_item: ReadItem) -> torch.Tensor:
        """The tensor ``read_item``'s bytes land in: model memory, or a staging tensor."""
        item = self.items[read_item.dest_index.fqn]
        if isinstance(item, _SourceItem):
            return item.staged
        if isinstance(item, _ValueItem):
            raise _value_error(self.plan.values[item.index])
        r = item.read
        if item.box is None:
            raise _strided_error(r)
        dest = _box_dest(item, self.plan.slots)
        if dest is None:  # staged: commit copies it into place
            return torch.empty(tuple(read_item.lengths), dtype=r.block.source_dtype)
        return dest

    def commit(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        """``read_item``'s bytes were read into ``tensor``: copy a staged box into place, run a deferred conversion
        once all its sources are in."""
        plan = self.plan
        item = self.items[read_item.dest_index.fqn]
        if isinstance(item, _ValueItem):
            raise _value_error(plan.values[item.index])
        # checkpoint bytes (the tensor handed back may already be in the model's dtype)
        self.bytes_read += tensor.numel() * plan.checkpoint[read_item.storage_index.fqn].itemsize
        if isinstance(item, _BlockItem):
            r = item.read
            if _box_dest(item, plan.slots) is None:  # a staged box: copy it through the block, relative to the box
                dest = dest_view(r.block, box_view(plan.slots[r.target].local, r.local_box))
                copy_cast(dest, source_view(r.block.box_relative(), tensor), r.block.casts)
            return
        pending = self.pending[item.index]
        pending[item.key] = item.staged
        d = plan.deferred[item.index]
        if len(pending) == len(d.conversion.sources):
            apply_deferred(d, pending, plan.slots)
            del self.pending[item.index]

    def planned_reads(self, dcp_plan: LoadPlan) -> tuple[list[BlockRead], list[DeferredRead], list[ValueRead]]:
        """The block reads, deferred conversions and value reads the items of ``dcp_plan`` stand for."""
        reads, deferred, values = [], set(), set()
        for read_item in dcp_plan.items:
            item = self.items[read_item.dest_index.fqn]
            if isinstance(item, _BlockItem):
                reads.append(item.read)
            elif isinstance(item, _ValueItem):
                values.add(item.index)
            else:
                deferred.add(item.index)
        plan = self.plan
        return reads, [plan.deferred[j] for j in sorted(deferred)], [plan.values[j] for j in sorted(values)]


def _block_item(fqn: str, item: _BlockItem) -> ReadItem:
    b, box = item.read.block, item.box
    if box is None:  # a strided read: only SafetensorsReader executes it (it asks the planner for the reads)
        lo, hi = b.source_span()
        offsets, lengths = _span_box(b.source_shape, lo, hi)
    else:
        offsets, lengths, _ = box
    zeros = torch.Size([0] * len(lengths))
    return ReadItem(
        LoadItemType.TENSOR,
        MetadataIndex(fqn, zeros),
        zeros,
        _storage_index(b.source, len(b.source_shape)),
        torch.Size(offsets),
        torch.Size(lengths),
    )


def _box_dest(item: _BlockItem, slots: Mapping[str, TargetSlot]) -> torch.Tensor | None:
    """The model memory a box-shaped block writes, arranged as the source box; None when the block casts
    values or its writes are no view of that shape (block dims splitting one source dim)."""
    r = item.read
    if r.block.casts:
        return None
    view = dest_view(r.block, box_view(slots[r.target].local, r.local_box))
    return _box_shaped(view, item.box)


def _strided_error(r: BlockRead) -> ValueError:
    return ValueError(
        f"{r.target!r} reads {r.block.source!r} through a strided (non-box) region; torch's "
        "HuggingFaceStorageReader reads boxes only: use loader.SafetensorsReader"
    )


def _value_error(v: ValueRead) -> ValueError:
    return ValueError(
        f"{v.target!r} is computed by pointwise ops over checkpoint regions (a value read), which only "
        "loader.SafetensorsReader executes"
    )


def _storage_index(key: str, ndim: int) -> MetadataIndex:
    return MetadataIndex(fqn=key, offset=torch.Size([0] * ndim))


def _span_box(shape: tuple[int, ...], lo: int, hi: int) -> tuple[list[int], list[int]]:
    """A box of whole leading-dim rows covering the flat interval ``[lo, hi)``."""
    if not shape:
        return [], []
    row = math.prod(shape[1:])
    a, b = lo // max(row, 1), -(-hi // max(row, 1))
    return [a] + [0] * (len(shape) - 1), [b - a] + list(shape[1:])


def _box_shaped(view: torch.Tensor, box: tuple) -> torch.Tensor | None:
    """Arrange a block's destination view in source-dim order with the source box's lengths; None when the
    block dims do not walk one source dim each."""
    offsets, lengths, dims = box
    if len(set(dims)) != len(dims):
        return None
    order = sorted(range(len(dims)), key=lambda j: dims[j])
    view = view.permute(order) if order else view
    walked = sorted(dims)
    for d in range(len(lengths)):
        if d not in walked:
            view = view.unsqueeze(d)
    return view if tuple(view.shape) == tuple(lengths) else None


def checkpoint_from_metadata(metadata: Metadata | None, storage: StorageOptions | None = None) -> SafetensorsCheckpoint:
    """Checkpoint headers from DCP metadata: ours (SafetensorsReader: with each file's identity as its header was
    read, which the reads check) or torch's HF reader's. A URL root is read through its store, opened with
    ``storage`` (:class:`~loader.options.StorageOptions`)."""
    if metadata is None:
        raise ValueError("no checkpoint metadata")
    infos, identities = {}, {}
    for index, info in (metadata.storage_data or {}).items():
        if isinstance(info, TensorInfo):
            infos[index.fqn] = info
        elif isinstance(info, (FileIdentity, ObjectIdentity)):
            identities[index.fqn] = info
    if infos:
        root = _root(metadata)
        store = open_store(root, storage) if is_url(root) else None
        checkpoint = SafetensorsCheckpoint.from_infos(infos, root=root, store=store)
        checkpoint.identities.update(identities)
        return checkpoint
    for key, md in metadata.state_dict_metadata.items():
        shape = tuple(md.size)
        dtype = md.properties.dtype
        size = math.prod(shape) * dtype.itemsize
        infos[key] = TensorInfo(key, "", dtype, shape, 0, size)
    return SafetensorsCheckpoint.from_infos(infos)


def _root(metadata: Metadata) -> str:
    root = (metadata.storage_data or {}).get(ROOT_INDEX)
    return root.path if isinstance(root, CheckpointRoot) else "."
