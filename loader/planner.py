"""HFLoadPlanner: the load planner, usable directly (``load_hf_checkpoint``) or inside ``dcp.load``.

It only plans: the plan as a value (:meth:`HFLoadPlanner.build_plan` → :class:`~loader.plan.RankPlan`, by
:func:`plan_model_keys` and :func:`~loader.plan.plan_rank`), asking the hooks that customise it
(:class:`~loader.hooks.PlanHooks`, a separate strategy object: ``HFLoadPlanner(model, hooks=...)``), and the
adapter to torch's ``LoadPlanner`` interface, whose per-load state is a :class:`~loader.dcpload.DcpLoad`. Inside
``torch.distributed.checkpoint.load`` each RemapBlock becomes a ``ReadItem``. With
:class:`~loader.reader.SafetensorsReader` any block (strided, flipped, broadcast, cast) is executed by the
loader's own read path, and the reader counts the bytes it read; with torch's ``HuggingFaceStorageReader`` only
blocks that read a plain box of a checkpoint tensor can be expressed, and others raise a clear error. How a load
runs and reads is no planning setting: it is the :class:`~loader.options.LoadOptions` of ``load_hf_checkpoint``,
or inside ``dcp.load`` of the :class:`~loader.SafetensorsReader`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from .checkpoint import Checkpoint
from .dcpload import DcpLoad, checkpoint_from_metadata, holds_headers
from .fallbacks import READ_WHOLE, log_fallbacks
from .hooks import PlanHooks
from .options import Rules
from .placements import rank_and_world
from .plan import BlockRead, DeferredRead, RankPlan, TraceCache, ValueRead, plan_rank
from .plan.cache import PLANS, PlanCache
from .plan.gcpause import paused_gc
from .plan.rank import VALUE_BYTES
from .plan.slots import TargetSlot, model_slots
from .report import LoadReport, load_report
from .rules import KeyPlan, plan_keys
from .rules.awq import awq_scheme
from .rules.fp8 import dequantized_keyplan
from .rules.gptq import gptq_scheme, qlinear_keyplan
from .rules.int4 import unpacked_keyplan
from .rules.mxfp4 import mxfp4_keyplan

__all__ = ["HFLoadPlanner", "LoadReport", "PlanHooks", "Rules", "checkpoint_from_metadata", "plan_model_keys"]

#: the packed-linear formats a dense model dequantizes on load, by ``quant_method``
LINEAR_SCHEMES = {"gptq": gptq_scheme, "awq": awq_scheme}

#: the hooks whose answers no plan key sees (``target_slot``'s are keyed: the slots are): a planner overriding one
#: plans every load anew
UNKEYED_HOOKS = ("default_weights_mapping", "map_checkpoint_key", "select_converter", "supports_symbolic")


def plan_model_keys(model: torch.nn.Module, checkpoint: Checkpoint, rules: Rules, hooks: PlanHooks) -> KeyPlan:
    """Which keys of ``checkpoint`` load which tensors of ``model`` (:func:`~loader.rules.plan_keys` with
    ``rules`` and ``hooks``; FP8, MXFP4, GPTQ, AWQ and packed int checkpoints dequantized)."""
    mapping = rules.weights_mapping if rules.weights_mapping is not None else hooks.default_weights_mapping(model)

    def plan(shapes: Mapping[str, Any], dtypes: Mapping[str, Any]) -> KeyPlan:
        return plan_keys(
            model,
            shapes,
            checkpoint_dtypes=dtypes,
            weights_mapping=mapping,
            extra_weights_mapping=rules.extra_weights_mapping,
            key_mapping=rules.key_mapping,
            map_checkpoint_key=hooks.map_checkpoint_key if hooks.overridden("map_checkpoint_key") else None,
            select_converter=hooks.select_converter if hooks.overridden("select_converter") else None,
        )

    decoded = (
        mxfp4_keyplan(checkpoint, model, plan)
        or qlinear_keyplan(checkpoint, model, plan, LINEAR_SCHEMES)
        or unpacked_keyplan(checkpoint, model, plan)
    )
    return dequantized_keyplan(decoded, checkpoint, model)


@runtime_checkable
class CountingReader(Protocol):
    """A storage reader that counts what it read in the current ``dcp.load`` (:class:`~loader.SafetensorsReader`)."""

    bytes_read: int
    requests: int
    bytes_exchanged: int


class HFLoadPlanner(LoadPlanner):
    """Plans a Hugging Face checkpoint load into ``model`` through traced conversions.

    Args:
        model: the module loaded in place (its tensors keep their identity).
        rules: the :class:`~loader.options.Rules` (with ``strict``); None: the default rules, strict.
        hooks: the :class:`~loader.hooks.PlanHooks` asked while planning (subclass it to override
            ``default_weights_mapping``, ``map_checkpoint_key``, ``select_converter``, ``supports_symbolic`` or
            ``target_slot``); None: the defaults.

    Attributes:
        rules: the :class:`~loader.options.Rules`.
        hooks: the :class:`~loader.hooks.PlanHooks`.
        cache: the traces, by signature, shared by every plan this planner builds (e.g. simulated ranks).
        plan_cache: the :class:`~loader.plan.cache.PlanCache` a plan of this model's own slots is kept in and taken
            from (default: the process's, so that a second load of the same model and checkpoint plans nothing);
            None plans every load anew.

    The planner memoises the last checkpoint's key plan and the traces, and keeps plans in :attr:`plan_cache`; a load
    executes and reports the plan value :meth:`build_plan` returns.
    """

    def __init__(self, model: torch.nn.Module, *, rules: Rules | None = None, hooks: PlanHooks | None = None) -> None:
        self.model = model
        self.rules = rules if rules is not None else Rules()
        self.hooks = hooks if hooks is not None else PlanHooks()
        self.cache = TraceCache()
        self.plan_cache: PlanCache | None = PLANS
        self._key_plan_memo: tuple[Checkpoint, KeyPlan] | None = None
        self._dcp: DcpLoad | None = None

    # -- planning -------------------------------------------------------------------------------------------

    def key_plan(self, checkpoint: Checkpoint) -> KeyPlan:
        """:func:`plan_model_keys` of this planner's model, rules and hooks; memoised for the last checkpoint."""
        if self._key_plan_memo is None or self._key_plan_memo[0] is not checkpoint:
            self._key_plan_memo = (checkpoint, plan_model_keys(self.model, checkpoint, self.rules, self.hooks))
        return self._key_plan_memo[1]

    @paused_gc()  # a few acyclic records per tensor: no full collections over the model meanwhile
    def build_plan(
        self,
        checkpoint: Checkpoint,
        slots: Mapping[str, TargetSlot] | None = None,
        *,
        check_devices: bool = True,
        values: bool = True,
    ) -> RankPlan:
        """Plan this rank's load of ``checkpoint``; validates everything, reads nothing.

        Args:
            checkpoint: validated checkpoint headers.
            slots: the model tensors as some rank sees them (default: this rank, from the model through the
                hook ``target_slot``).
            check_devices: refuse targets on the meta device (off for simulations).
            values: compile conversions ending in pointwise ops (FP8 dequantization) into value reads; False
                defers them.

        Returns:
            The plan: everything the load executes and reports; for this rank's own slots, the plan kept in
            :attr:`plan_cache` when nothing it follows from changed (:func:`~loader.plan.cache.plan_key`).

        Raises:
            ValueError | CheckpointError: see :func:`~loader.plan.plan_rank`; nothing was read or written.
        """
        make = functools.partial(_plan_rank, self, checkpoint, check_devices=check_devices, values=values)
        if slots is not None:  # another rank's view (a simulation): nothing logged
            return make(slots)
        return _own_plan(self, checkpoint, make, (self.rules.strict, check_devices, values))

    # -- torch.distributed.checkpoint LoadPlanner ---------------------------------------------------------

    def state_dict_for_load(self) -> dict[str, torch.Tensor]:
        """The ``state_dict`` argument for ``dcp.load`` (the model's tensors; this planner decides the rest)."""
        return dict(self.model.state_dict())

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        self.metadata = metadata
        self.is_coordinator = is_coordinator
        # metadata without our headers comes from another reader (torch's HF reader): it reads plain boxes only,
        # checked by create_local_plan, and pointwise values (a norm's + 1, FP8 dequantization) are deferred there:
        # its ReadItems stand for bytes copied into a model tensor. SafetensorsReader runs value reads itself
        boxes_only = not holds_headers(metadata)
        plan = self.build_plan(checkpoint_from_metadata(metadata), values=not boxes_only)
        self._dcp = DcpLoad(plan, boxes_only=boxes_only)

    def create_local_plan(self) -> LoadPlan:
        return self._state().local_plan()

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        self._state().fill_constants()  # every rank's plan agreed: the padding, before another reader's reads
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise ValueError(f"unexpected byte item {read_item.dest_index.fqn}: checkpoints here hold tensors only")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self._state().resolve(read_item)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        self._state().commit(read_item, tensor)

    # -- for SafetensorsReader and after dcp.load ---------------------------------------------------------

    def planned_reads(
        self, dcp_plan: LoadPlan
    ) -> tuple[RankPlan, list[BlockRead], list[DeferredRead], list[ValueRead]]:
        """The plan of the current ``dcp.load`` and the block, deferred and value reads ``dcp_plan``'s items stand
        for, for a reader running RemapBlocks itself (:class:`~loader.SafetensorsReader`); RuntimeError before
        ``set_up_planner``."""
        state = self._state()
        return (state.plan, *state.planned_reads(dcp_plan))

    def finish(self, reader: CountingReader | StorageReader | None = None) -> LoadReport:
        """After ``dcp.load``: record conversions on the model and return this rank's report, with the bytes
        ``reader`` (the load's :class:`~loader.SafetensorsReader`) counted; for another storage reader (or None): the
        bytes of the items it committed.

        Raises:
            RuntimeError: ``dcp.load`` did not run with this planner.
        """
        state = self._state()
        state.plan.keyplan.record_on_model(self.model)
        rank, world = rank_and_world()
        if not isinstance(reader, CountingReader):
            return load_report(state.plan, state.bytes_read, rank, world)
        return load_report(
            state.plan, reader.bytes_read, rank, world, requests=reader.requests, exchanged=reader.bytes_exchanged
        )

    def _state(self) -> DcpLoad:
        if self._dcp is None:
            raise RuntimeError("no dcp.load has been planned with this planner (set_up_planner was not called)")
        return self._dcp


def _own_plan(planner: HFLoadPlanner, checkpoint: Checkpoint, make, settings: tuple) -> RankPlan:
    """The plan of this rank's own slots: the one kept in ``planner.plan_cache`` where allowed, else ``make``'s; its
    fallbacks logged (:func:`~loader.fallbacks.log_fallbacks`) on rank 0 (every rank has the same conversions)."""
    hooks = planner.hooks
    if planner.plan_cache is None or any(hooks.overridden(h) for h in UNKEYED_HOOKS):
        plan = make(model_slots(planner.model, hooks.target_slot))
    else:
        plan = planner.plan_cache.planned(planner.model, hooks.target_slot, checkpoint, planner.rules, settings, make)
    plan.look_up_sources()  # a lazily placed source (a DCP chunk) refused here, in the planning stage
    if rank_and_world()[0] == 0:
        log_fallbacks(((d.conversion, d.reason) for d in plan.deferred), READ_WHOLE)
    return plan


def _plan_rank(
    planner: HFLoadPlanner,
    checkpoint: Checkpoint,
    slots: Mapping[str, TargetSlot],
    *,
    check_devices: bool,
    values: bool,
) -> RankPlan:
    """:func:`~loader.plan.plan_rank` with ``planner``'s key plan, settings, hooks and traces."""
    return plan_rank(
        planner.key_plan(checkpoint),
        checkpoint,
        dict(slots),
        strict=planner.rules.strict,
        supports_symbolic=planner.hooks.supports_symbolic,
        cache=planner.cache,
        check_devices=check_devices,
        value_bytes=VALUE_BYTES if values else None,
    )
