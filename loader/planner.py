"""HFLoadPlanner: the load planner, usable directly (``load_hf_checkpoint``) or inside ``dcp.load``.

:meth:`HFLoadPlanner.build_plan` returns this rank's plan as a value (:class:`~loader.plan.RankPlan`); its
hooks customise the rules and the trace. Inside ``torch.distributed.checkpoint.load`` it turns each RemapBlock
into a ``ReadItem``. With :class:`~loader.reader.SafetensorsReader` any block (strided, flipped, broadcast,
cast) is executed by the loader's own read path; with torch's ``HuggingFaceStorageReader`` only blocks that
read a plain box of a checkpoint tensor can be expressed, and others raise a clear error.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from regiontrace import copy_cast, dest_view, source_view

from .checkpoint import FileIdentity, SafetensorsCheckpoint, TensorInfo
from .execute import STAGING_BYTES, apply_deferred
from .placements import rank_and_world, slot_for
from .plan import BlockRead, DeferredRead, RankPlan, TraceCache, plan_rank
from .plan.gcpause import paused_gc
from .plan.slots import TargetSlot, box_view, model_slots
from .report import LoadReport, load_report
from .rules import Conversion, KeyPlan, plan_keys
from .rules.fp8 import dequantized_keyplan

__all__ = ["HFLoadPlanner", "LoadReport", "checkpoint_from_metadata"]


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


@dataclass
class _DcpLoad:
    """The state of one ``dcp.load``: the plan, what each ``ReadItem`` stands for, the deferred conversions'
    sources read so far, and the bytes read. ``boxes_only``: the storage reader reads plain boxes only."""

    plan: RankPlan
    boxes_only: bool
    items: dict[str, _BlockItem | _SourceItem] = field(default_factory=dict)
    pending: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    bytes_read: int = 0


class HFLoadPlanner(LoadPlanner):
    """Plans a Hugging Face checkpoint load into ``model`` through traced conversions.

    Args:
        model: the module loaded in place (its tensors keep their identity).
        weights_mapping: rules replacing the default ones (see :func:`loader.load_hf_checkpoint`).
        extra_weights_mapping: rules tried before all others.
        key_mapping: ``{regex: replacement}`` renames, like ``from_pretrained(key_mapping=...)``.
        strict: raise, before anything is read, when a model tensor is loaded by nothing.
        broadcast_replicated_tensors: in a distributed run, read regions several ranks need once and
            broadcast them.
        timeout: in a distributed run, seconds (or a ``timedelta``) each rank waits for the others where
            outcomes are agreed (inside ``dcp.load``: the end of reading); a hung or dead rank then fails the
            load with :class:`~loader.errors.PeerFailure`. None: no limit.
        staging_bytes: bytes per staging buffer reads land in (two are used: double-buffered; pinned for GPU
            targets).

    Override the hooks :meth:`default_weights_mapping`, :meth:`map_checkpoint_key`, :meth:`select_converter`,
    :meth:`supports_symbolic` and :meth:`target_slot` to customise planning.

    Attributes:
        cache: the traces, by signature, shared by every plan this planner builds (e.g. simulated ranks).

    The planner memoises the key plan of the last checkpoint it planned and the traces; everything a load
    executes and reports comes from the plan value :meth:`build_plan` returns.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        weights_mapping: Sequence[Any] | None = None,
        extra_weights_mapping: Sequence[Any] = (),
        key_mapping: Mapping[str, str] | None = None,
        strict: bool = True,
        broadcast_replicated_tensors: bool = False,
        timeout: float | datetime.timedelta | None = 300.0,
        staging_bytes: int = STAGING_BYTES,
    ) -> None:
        if staging_bytes < 1:
            raise ValueError(f"staging_bytes must be at least 1, got {staging_bytes}")
        self.model = model
        self.staging_bytes = staging_bytes
        self.weights_mapping = weights_mapping
        self.extra_weights_mapping = tuple(extra_weights_mapping)
        self.key_mapping = key_mapping
        self.strict = strict
        self.broadcast_replicated_tensors = broadcast_replicated_tensors
        self.timeout = timeout
        self.cache = TraceCache()
        self._key_plan_memo: tuple[SafetensorsCheckpoint, KeyPlan] | None = None
        self._dcp: _DcpLoad | None = None

    # -- hooks ---------------------------------------------------------------------------------------------

    def default_weights_mapping(self, model: torch.nn.Module) -> Sequence[Any] | None:
        """Rules used when none are given. None: transformers' own mapping for a ``PreTrainedModel``
        (``get_model_conversion_mapping``), no renames for any other module."""
        return None

    def map_checkpoint_key(self, key: str) -> str | None:
        """Rename a checkpoint key before any rule sees it; None skips the key."""
        return key

    def select_converter(
        self, source_pattern: str, target_name: str, candidates: list[Any], *, source_key: str | None = None
    ) -> Any:
        """Choose among several converter rules matching one checkpoint key (default: the first, like transformers).

        Args:
            source_pattern: the source pattern of the first candidate that matched the key.
            target_name: the name that candidate renames the key to.
            candidates: the matching rules, in precedence order.
            source_key: the checkpoint key as stored (before ``map_checkpoint_key`` and the renamings); an
                override may leave this keyword out of its signature.

        Returns:
            One of ``candidates``, or None for no conversion.
        """
        return candidates[0]

    def supports_symbolic(self, conversion: Conversion) -> bool:
        """Whether to trace ``conversion``; False sends it to a deferred read."""
        return True

    def target_slot(self, name: str, tensor: torch.Tensor) -> TargetSlot:
        """The slot (owned boxes) of one model tensor on this rank."""
        return slot_for(name, tensor)

    # -- planning -------------------------------------------------------------------------------------------

    def key_plan(self, checkpoint: SafetensorsCheckpoint) -> KeyPlan:
        """Which keys of ``checkpoint`` load which model tensors (:func:`~loader.rules.plan_keys` with this
        planner's rules and hooks); memoised for the last checkpoint object."""
        if self._key_plan_memo is not None and self._key_plan_memo[0] is checkpoint:
            return self._key_plan_memo[1]
        mapping = self.weights_mapping if self.weights_mapping is not None else self.default_weights_mapping(self.model)
        infos = checkpoint.tensors
        mapper = None if type(self).map_checkpoint_key is HFLoadPlanner.map_checkpoint_key else self.map_checkpoint_key
        selector = None if type(self).select_converter is HFLoadPlanner.select_converter else self.select_converter
        keyplan = plan_keys(
            self.model,
            {k: info.shape for k, info in infos.items()},
            checkpoint_dtypes={k: info.dtype for k, info in infos.items()},
            weights_mapping=mapping,
            extra_weights_mapping=self.extra_weights_mapping,
            key_mapping=self.key_mapping,
            map_checkpoint_key=mapper,
            select_converter=selector,
        )
        keyplan = dequantized_keyplan(keyplan, checkpoint, self.model)
        self._key_plan_memo = (checkpoint, keyplan)
        return keyplan

    @paused_gc()  # a few acyclic records per tensor: no full collections over the model meanwhile
    def build_plan(
        self,
        checkpoint: SafetensorsCheckpoint,
        slots: Mapping[str, TargetSlot] | None = None,
        *,
        check_devices: bool = True,
        values: bool = True,
    ) -> RankPlan:
        """Plan this rank's load of ``checkpoint``; validates everything, reads nothing.

        Args:
            checkpoint: validated checkpoint headers.
            slots: the model tensors as some rank sees them (default: this rank, from the model through
                :meth:`target_slot`).
            check_devices: refuse targets on the meta device (off for simulations).
            values: compile conversions ending in pointwise ops (FP8 dequantization) into value reads; False
                defers them.

        Returns:
            The plan: everything the load executes and reports.

        Raises:
            ValueError | CheckpointError: see :func:`~loader.plan.plan_rank`; nothing was read or written.
        """
        keyplan = self.key_plan(checkpoint)
        slots = dict(slots) if slots is not None else model_slots(self.model, self.target_slot)
        return plan_rank(
            keyplan,
            checkpoint,
            slots,
            strict=self.strict,
            supports_symbolic=self.supports_symbolic,
            cache=self.cache,
            check_devices=check_devices,
            values=values,
        )

    # -- torch.distributed.checkpoint LoadPlanner ---------------------------------------------------------

    def state_dict_for_load(self) -> dict[str, torch.Tensor]:
        """The ``state_dict`` argument for ``dcp.load`` (the model's tensors; this planner decides the rest)."""
        return dict(self.model.state_dict())

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        # metadata without our TensorInfo records comes from another reader (torch's HF reader): it reads
        # plain boxes only, which create_local_plan checks before anything is read
        storage = getattr(metadata, "storage_data", None) or {}
        boxes_only = not any(isinstance(i, TensorInfo) for i in storage.values())
        # inside dcp.load a ReadItem stands for bytes copied into a model tensor: values computed by pointwise ops
        # (FP8 dequantization) are deferred (their sources read whole, run for real)
        self._dcp = _DcpLoad(self.build_plan(checkpoint_from_metadata(metadata), values=False), boxes_only)

    def create_local_plan(self) -> LoadPlan:
        state = self._state()
        plan = state.plan
        blocks = [_BlockItem(r, r.block.source_box()) for r in plan.reads]
        if state.boxes_only:
            for item in blocks:
                if item.box is None:
                    raise _strided_error(item.read)
        items = []
        for i, item in enumerate(blocks):
            fqn = f"__block__/{i}"
            state.items[fqn] = item
            items.append(_block_item(fqn, item))
        for j, d in enumerate(plan.deferred):
            if not d.boxes:
                continue
            state.pending[j] = {}
            for key in d.conversion.sources:
                fqn = f"__deferred__/{j}/{key}"
                info = plan.checkpoint[key]
                state.items[fqn] = _SourceItem(j, key, torch.empty(info.shape, dtype=info.dtype))
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

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise ValueError(f"unexpected byte item {read_item.dest_index.fqn}: checkpoints here hold tensors only")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        state = self._state()
        item = state.items[read_item.dest_index.fqn]
        if isinstance(item, _SourceItem):
            return item.staged
        r = item.read
        if item.box is None:
            raise _strided_error(r)
        dest = _box_dest(item, state.plan.slots)
        if dest is None:  # staged: commit_tensor copies it into place
            return torch.empty(tuple(read_item.lengths), dtype=r.block.source_dtype)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        state = self._state()
        plan = state.plan
        item = state.items[read_item.dest_index.fqn]
        # checkpoint bytes (the tensor handed back may already be in the model's dtype)
        state.bytes_read += tensor.numel() * plan.checkpoint[read_item.storage_index.fqn].itemsize
        if isinstance(item, _BlockItem):
            r = item.read
            if _box_dest(item, plan.slots) is None:  # a staged box: copy it through the block, relative to the box
                dest = dest_view(r.block, box_view(plan.slots[r.target].local, r.local_box))
                copy_cast(dest, source_view(r.block.box_relative(), tensor), r.block.casts)
            return
        pending = state.pending[item.index]
        pending[item.key] = item.staged
        d = plan.deferred[item.index]
        if len(pending) == len(d.conversion.sources):
            apply_deferred(d, pending, plan.slots)
            del state.pending[item.index]

    # -- for SafetensorsReader and after dcp.load ---------------------------------------------------------

    def planned_reads(self, dcp_plan: LoadPlan) -> tuple[RankPlan, list[BlockRead], list[DeferredRead]]:
        """The plan of the current ``dcp.load`` and the reads the items of ``dcp_plan`` stand for (a storage reader
        that executes RemapBlocks itself, :class:`~loader.SafetensorsReader`, runs them instead of the items).

        Raises:
            RuntimeError: no ``dcp.load`` has been planned (``set_up_planner`` was not called).
        """
        state = self._state()
        reads, deferred = [], set()
        for read_item in dcp_plan.items:
            item = state.items[read_item.dest_index.fqn]
            if isinstance(item, _BlockItem):
                reads.append(item.read)
            else:
                deferred.add(item.index)
        return state.plan, reads, [state.plan.deferred[j] for j in sorted(deferred)]

    def add_bytes_read(self, nbytes: int) -> None:
        """Count ``nbytes`` read from checkpoint files for the current ``dcp.load`` (reported by :meth:`finish`)."""
        self._state().bytes_read += nbytes

    def finish(self, path: str = "") -> LoadReport:
        """After ``dcp.load``: record conversions on the model and return this rank's report.

        Raises:
            RuntimeError: ``dcp.load`` did not run with this planner.
        """
        state = self._state()
        state.plan.keyplan.record_on_model(self.model)
        rank, world = rank_and_world()
        return load_report(state.plan, state.bytes_read, rank, world)

    def _state(self) -> _DcpLoad:
        if self._dcp is None:
            raise RuntimeError("no dcp.load has been planned with this planner (set_up_planner was not called)")
        return self._dcp


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


def checkpoint_from_metadata(metadata: Metadata | None) -> SafetensorsCheckpoint:
    """Checkpoint headers from DCP metadata: ours (SafetensorsReader: with each file's identity as its header was
    read, which the reads check) or torch's HF reader's."""
    if metadata is None:
        raise ValueError("no checkpoint metadata")
    infos, identities = {}, {}
    for index, info in (metadata.storage_data or {}).items():
        if isinstance(info, TensorInfo):
            infos[index.fqn] = info
        elif isinstance(info, FileIdentity):
            identities[index.fqn] = info
    if infos:
        checkpoint = SafetensorsCheckpoint.from_infos(infos, root=getattr(metadata, "_root", "."))
        checkpoint.identities.update(identities)
        return checkpoint
    for key, md in metadata.state_dict_metadata.items():
        shape = tuple(md.size)
        dtype = md.properties.dtype
        size = math.prod(shape) * dtype.itemsize
        infos[key] = TensorInfo(key, "", dtype, shape, 0, size)
    return SafetensorsCheckpoint.from_infos(infos)
