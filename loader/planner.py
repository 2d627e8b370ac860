"""HFLoadPlanner: the load planner, usable directly (``load_hf_checkpoint``) or inside ``dcp.load``.

Inside ``torch.distributed.checkpoint.load`` it turns each RemapBlock into a ``ReadItem``. With
:class:`~loader.reader.SafetensorsReader` any block (strided, flipped, broadcast, cast) is executed by the
planner's own reader path; with torch's ``HuggingFaceStorageReader`` only blocks that read a plain box of a
checkpoint tensor can be expressed, and others raise a clear error.
"""

from __future__ import annotations

import datetime
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from regiontrace.execute import apply_casts, dest_view, source_view

from .checkpoint import SafetensorsCheckpoint, TensorInfo
from .execute import apply_deferred
from .plan import RankPlan, TraceCache, plan_rank
from .plan.slots import TargetSlot, box_view, model_slots
from .rules import Conversion, plan_keys


@dataclass(frozen=True)
class LoadReport:
    """What a load did on this rank.

    Attributes:
        loaded_keys: model tensor names loaded (tied aliases included), natural-sorted.
        missing_keys: model tensors nothing loaded (only with ``strict=False``).
        unexpected_keys: checkpoint keys no rule maps to a model tensor.
        bytes_read: bytes this process read from checkpoint files.
        traced: model tensors loaded by region reads.
        deferred: model tensors loaded through deferred (run-for-real) conversions.
        blocks: RemapBlocks executed.
        planned_bytes: bytes the plan needed.
        deferred_reasons: why each deferred conversion could not be traced.
        rank, world_size: this process's rank and the world size.
        cast_keys: ``(model tensor name, checkpoint dtype, model dtype)`` for each model tensor whose values were
            converted across kinds (integer <-> floating point, bool), natural-sorted; the checkpoint dtype is
            that of the values its conversion produced (the checkpoint tensor's, for a rename). Such a load
            also warns once (``UserWarning``). Casts within a kind (bf16 -> float32) are normal and not listed.
    """

    loaded_keys: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    bytes_read: int
    traced: tuple[str, ...]
    deferred: tuple[str, ...]
    blocks: int = 0
    planned_bytes: int = 0
    deferred_reasons: Mapping[str, str] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    cast_keys: tuple[tuple[str, torch.dtype, torch.dtype], ...] = ()


def natural_sorted(keys) -> tuple[str, ...]:  # noqa: ANN001
    from .rules import dot_natural_key

    return tuple(sorted(set(keys), key=dot_natural_key))


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

    Override the hooks :meth:`default_weights_mapping`, :meth:`map_checkpoint_key`, :meth:`select_converter`
    and :meth:`supports_symbolic` to customise planning.
    """

    def __init__(self, model: torch.nn.Module, *, weights_mapping: Sequence[Any] | None = None,
                 extra_weights_mapping: Sequence[Any] = (), key_mapping: Mapping[str, str] | None = None,
                 strict: bool = True, broadcast_replicated_tensors: bool = False,
                 timeout: float | datetime.timedelta | None = 300.0) -> None:
        self.model = model
        self.weights_mapping = weights_mapping
        self.extra_weights_mapping = tuple(extra_weights_mapping)
        self.key_mapping = key_mapping
        self.strict = strict
        self.broadcast_replicated_tensors = broadcast_replicated_tensors
        self.timeout = timeout
        self.cache = TraceCache()
        self.plan: RankPlan | None = None
        self.checkpoint: SafetensorsCheckpoint | None = None
        self.slots: dict[str, TargetSlot] = {}
        self.keyplan = None
        self._keyplan_for = None
        self.bytes_read = 0
        self._items: dict[str, tuple] = {}
        self._pending: dict[int, dict[str, torch.Tensor]] = {}
        self._boxes_only = False

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

    def supports_symbolic(self, transform: Conversion) -> bool:
        """Whether to trace ``transform``; False sends it to a deferred read."""
        return True

    # -- planning -------------------------------------------------------------------------------------------

    def target_slot(self, name: str, tensor: torch.Tensor) -> TargetSlot:
        """The slot (owned boxes) of one model tensor on this rank."""
        from .placements import slot_for

        return slot_for(name, tensor)

    def build_plan(self, checkpoint: SafetensorsCheckpoint, slots: Mapping[str, TargetSlot] | None = None,
                   *, check_devices: bool = True) -> RankPlan:
        """Plan this rank's load of ``checkpoint``; validates everything, reads nothing.

        Args:
            checkpoint: validated checkpoint headers.
            slots: the model tensors as some rank sees them (default: this rank, from the model).
            check_devices: refuse targets on the meta device (off for simulations).
        """
        self.checkpoint = checkpoint
        self.slots = dict(slots) if slots is not None else model_slots(self.model, self.target_slot)
        if self.keyplan is not None and self._keyplan_for is checkpoint:
            self.plan = plan_rank(self.keyplan, checkpoint, self.slots, strict=self.strict,
                                  supports_symbolic=self.supports_symbolic, cache=self.cache,
                                  check_devices=check_devices)
            return self.plan
        mapping = self.weights_mapping if self.weights_mapping is not None else self.default_weights_mapping(self.model)
        shapes = {k: checkpoint[k].shape for k in checkpoint.keys()}
        mapper = None if type(self).map_checkpoint_key is HFLoadPlanner.map_checkpoint_key else self.map_checkpoint_key
        selector = None if type(self).select_converter is HFLoadPlanner.select_converter else self.select_converter
        self.keyplan = plan_keys(self.model, shapes, weights_mapping=mapping,
                                 extra_weights_mapping=self.extra_weights_mapping, key_mapping=self.key_mapping,
                                 map_checkpoint_key=mapper, select_converter=selector)
        self._keyplan_for = checkpoint
        self.plan = plan_rank(self.keyplan, checkpoint, self.slots, strict=self.strict,
                              supports_symbolic=self.supports_symbolic, cache=self.cache,
                              check_devices=check_devices)
        return self.plan

    def report(self, bytes_read: int, rank: int = 0, world_size: int = 1) -> LoadReport:
        """This rank's :class:`LoadReport` of the load just executed; warns once when values changed kind."""
        plan = self.plan
        assert plan is not None and self.checkpoint is not None
        casts = _sorted_casts(plan.casts)
        if casts:
            _warn_casts(casts)
        return LoadReport(
            loaded_keys=natural_sorted(plan.loaded_keys), missing_keys=natural_sorted(plan.missing_keys),
            unexpected_keys=natural_sorted(plan.unexpected_keys), bytes_read=bytes_read,
            traced=natural_sorted(plan.traced), deferred=natural_sorted(plan.deferred_targets),
            blocks=len(plan.reads), planned_bytes=plan.planned_bytes(self.checkpoint),
            deferred_reasons={", ".join(d.conversion.targets): d.reason for d in plan.deferred},
            rank=rank, world_size=world_size, cast_keys=casts,
        )

    # -- torch.distributed.checkpoint LoadPlanner ---------------------------------------------------------

    def state_dict_for_load(self) -> dict[str, torch.Tensor]:
        """The ``state_dict`` argument for ``dcp.load`` (the model's tensors; this planner decides the rest)."""
        return dict(self.model.state_dict())

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        self._items.clear()
        self._pending.clear()
        self.bytes_read = 0
        # metadata without our TensorInfo records comes from another reader (torch's HF reader): it reads
        # plain boxes only, which create_local_plan checks before anything is read
        storage = getattr(metadata, "storage_data", None) or {}
        self._boxes_only = not any(isinstance(i, TensorInfo) for i in storage.values())
        self.build_plan(checkpoint_from_metadata(metadata))

    def create_local_plan(self) -> LoadPlan:
        assert self.plan is not None and self.checkpoint is not None
        items = []
        if self._boxes_only:
            for r in self.plan.reads:
                if r.block.source_box() is None:
                    raise _strided_error(r)
        for i, r in enumerate(self.plan.reads):
            fqn = f"__block__/{i}"
            self._items[fqn] = ("block", r)
            items.append(self._block_item(fqn, r))
        for j, d in enumerate(self.plan.deferred):
            if not d.boxes:
                continue
            self._pending[j] = {}
            for key in d.conversion.sources:
                fqn = f"__deferred__/{j}/{key}"
                info = self.checkpoint[key]
                self._items[fqn] = ("deferred", j, key, torch.empty(info.shape, dtype=info.dtype))
                zeros = torch.Size([0] * len(info.shape))
                items.append(ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, zeros), zeros,
                                      _storage_index(key, len(info.shape)), zeros, torch.Size(info.shape)))
        return LoadPlan(items)

    def _block_item(self, fqn: str, r) -> ReadItem:  # noqa: ANN001
        b = r.block
        box = b.source_box()
        if box is None:  # a strided read: only SafetensorsReader executes it (it asks this planner)
            lo, hi = b.source_span()
            offsets, lengths = _span_box(b.source_shape, lo, hi)
        else:
            offsets, lengths, _ = box
        zeros = torch.Size([0] * len(lengths))
        return ReadItem(LoadItemType.TENSOR, MetadataIndex(fqn, zeros), zeros,
                        _storage_index(b.source, len(b.source_shape)), torch.Size(offsets), torch.Size(lengths))

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise ValueError(f"unexpected byte item {read_item.dest_index.fqn}: checkpoints here hold tensors only")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        entry = self._items[read_item.dest_index.fqn]
        if entry[0] == "deferred":
            return entry[3]
        r = entry[1]
        b = r.block
        if b.source_box() is None:
            raise _strided_error(r)
        dest = self._box_dest(r)
        if dest is None:  # staged: commit_tensor copies it into place
            return torch.empty(tuple(read_item.lengths), dtype=b.source_dtype)
        return dest

    def _box_dest(self, r) -> torch.Tensor | None:  # noqa: ANN001
        """The model memory a box-shaped block writes, arranged as the source box; None when the block casts
        values or its writes are no view of that shape (block dims splitting one source dim)."""
        if r.block.casts:
            return None
        view = dest_view(r.block, box_view(self.slots[r.target].local, r.local_box))
        return _box_shaped(view, r.block.source_box())

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        entry = self._items[read_item.dest_index.fqn]
        # checkpoint bytes (the tensor handed back may already be in the model's dtype)
        self.bytes_read += tensor.numel() * self.checkpoint[read_item.storage_index.fqn].itemsize
        if entry[0] == "block":
            r = entry[1]
            if self._box_dest(r) is None:  # a staged box: copy it through the block, relative to the box
                dest = dest_view(r.block, box_view(self.slots[r.target].local, r.local_box))
                dest.copy_(apply_casts(source_view(r.block.box_relative(), tensor), r.block.casts))
            return
        _, j, key, staged = entry
        pending = self._pending[j]
        pending[key] = staged
        d = self.plan.deferred[j]
        if len(pending) == len(d.conversion.sources):
            apply_deferred(d, pending, self.slots)
            del self._pending[j]

    def finish(self, path: str = "") -> LoadReport:
        """After ``dcp.load``: record conversions on the model and return this rank's report."""
        from .placements import rank_and_world

        if self.keyplan is not None:
            self.keyplan.record_on_model(self.model)
        rank, world = rank_and_world()
        return self.report(self.bytes_read, rank, world)


def _sorted_casts(casts) -> tuple[tuple[str, torch.dtype, torch.dtype], ...]:  # noqa: ANN001
    from .rules import dot_natural_key

    return tuple(sorted(set(casts), key=lambda c: dot_natural_key(c[0])))


def _warn_casts(casts: tuple[tuple[str, torch.dtype, torch.dtype], ...]) -> None:
    shown = ", ".join(f"{name} ({_dtype(a)} -> {_dtype(b)})" for name, a, b in casts[:8])
    more = f" and {len(casts) - 8} more" if len(casts) > 8 else ""
    warnings.warn(
        f"{len(casts)} model tensor(s) loaded from values of another kind (integer, floating point, bool), "
        f"converted by value: {shown}{more} (LoadReport.cast_keys lists them)",
        UserWarning,
        stacklevel=4,
    )


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _strided_error(r) -> ValueError:  # noqa: ANN001
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


def _box_shaped(view: torch.Tensor, box) -> torch.Tensor | None:  # noqa: ANN001
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
    """Checkpoint headers from DCP metadata: ours (SafetensorsReader) or torch's HF reader's."""
    if metadata is None:
        raise ValueError("no checkpoint metadata")
    infos = {}
    for index, info in (metadata.storage_data or {}).items():
        if isinstance(info, TensorInfo):
            infos[index.fqn] = info
    if infos:
        return SafetensorsCheckpoint.from_infos(infos, root=getattr(metadata, "_root", "."))
    for key, md in metadata.state_dict_metadata.items():
        shape = tuple(md.size)
        dtype = md.properties.dtype
        size = math.prod(shape) * dtype.itemsize
        infos[key] = TensorInfo(key, "", dtype, shape, 0, size)
    return SafetensorsCheckpoint.from_infos(infos)
