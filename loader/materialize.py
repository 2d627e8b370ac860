"""Models on the meta device: plan against their meta tensors, allocate after, initialise what the checkpoint lacks.

:class:`MetaAllocation` is what ``load_hf_checkpoint(..., device=...)`` runs on a model with meta tensors once its
plan is made (every header, mapping and strictness check passed): :func:`materialize` replaces every meta
parameter/buffer, in place on its module, by a tensor on the device (a DTensor keeps its mesh and placements and
allocates only its local shard; tied tensors stay one tensor), the plan's slots are bound to the new tensors, and
:func:`initialize_rest` gives the tensors the checkpoint does not hold their values the way the model would,
before anything is read. When the load fails after that, :meth:`MetaAllocation.undo` puts the meta tensors back.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable

import torch

from ._torch import TorchDispatchMode, local_tensor, schema_arguments, tensor_tables
from .plan import RankPlan, TargetSlot
from .plan.slots import storage_of

log = logging.getLogger("loader")

#: ``(table, name, tensor)``: a module's ``_parameters`` or ``_buffers`` entry as it was before :func:`materialize`
Undo = list[tuple[dict, str, torch.Tensor]]


def on_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` (a DTensor's local shard) is on the meta device."""
    tensors = [*model.parameters(), *model.buffers()]
    return any(storage_of(t).device.type == "meta" for t in tensors)


def materialize(
    model: torch.nn.Module, device: str | torch.device, undo: Undo | None = None
) -> dict[str, torch.Tensor]:
    """Replace each meta tensor of ``model`` by an uninitialised one on ``device``, in place.

    Args:
        model: the module.
        device: where the new tensors are allocated.
        undo: when given, each replaced entry is appended to it as it was (see :meth:`MetaAllocation.undo`).

    Returns:
        The new tensors by every name (parameters and all buffers, tied aliases included) that was on meta.
    """
    device = torch.device(device)
    done: dict[int, torch.Tensor] = {}  # id(old tensor) → its replacement: tied tensors stay tied
    made: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for prefix, mod in model.named_modules(remove_duplicate=False):
            for table in tensor_tables(mod):
                for attr, t in list(table.items()):
                    if t is None or storage_of(t).device.type != "meta":
                        continue
                    if id(t) not in done:
                        done[id(t)] = _empty_like(t, device)
                    if undo is not None:
                        undo.append((table, attr, t))
                    table[attr] = made[f"{prefix}.{attr}" if prefix else attr] = done[id(t)]
    return made


class MetaAllocation:
    """Allocates a meta model for a plan made against its meta tensors; puts the meta tensors back on failure.

    Args:
        model: the model, some of its tensors on the meta device.
        device: where to allocate them.
        strict: raise (before anything is read) when a tensor is neither loaded nor initialised by the model.
        slot_for: the planner's :meth:`~loader.HFLoadPlanner.target_slot`, to bind the plan to the new tensors.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: str | torch.device,
        *,
        strict: bool,
        slot_for: Callable[[str, torch.Tensor], TargetSlot],
    ) -> None:
        self.model, self.device, self.strict, self.slot_for = model, device, strict, slot_for
        self._undo: Undo = []

    def __call__(self, plan: RankPlan) -> RankPlan:
        """Allocate the meta tensors, initialise those ``plan`` does not load; returns ``plan`` bound to them.

        Raises:
            ValueError: with ``strict``, naming each tensor nothing loads or initialises (nothing read yet).
        """
        made = materialize(self.model, self.device, self._undo)
        slots = dict(plan.slots)
        for name, t in made.items():
            if name in slots:  # the plan's reads are compiled for the boxes of the meta tensor: the same ones
                old, slots[name] = slots[name], self.slot_for(name, t)
                if (slots[name].shape, slots[name].dtype, slots[name].boxes) != (old.shape, old.dtype, old.boxes):
                    raise RuntimeError(f"target_slot gave {name!r} other boxes once allocated than on meta")
        initialize_rest(self.model, made, plan.loaded_keys, strict=self.strict)
        return dataclasses.replace(plan, slots=slots)

    def undo(self) -> None:
        """Put every meta tensor back where :meth:`__call__` replaced it (the model is as it was)."""
        for table, attr, t in reversed(self._undo):
            table[attr] = t
        self._undo.clear()


def _empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    local = local_tensor(data)
    if local is not None:  # a DTensor: only this rank's shard
        from torch.distributed.tensor import DTensor

        new = DTensor.from_local(
            torch.empty(local.shape, dtype=local.dtype, device=device),
            data.device_mesh,
            data.placements,
            run_check=False,
            shape=data.shape,
            stride=data.stride(),
        )
    else:
        new = torch.empty(data.shape, dtype=data.dtype, device=device)
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(new, requires_grad=t.requires_grad)
    return new


def initialize_rest(
    model: torch.nn.Module, made: dict[str, torch.Tensor], loaded: Iterable[str], *, strict: bool
) -> tuple[str, ...]:
    """Initialise the materialised tensors the load does not write, the way the model would.

    Each is zeroed first, then: a transformers ``PreTrainedModel`` runs its ``initialize_weights`` (skipping every
    other tensor, as ``from_pretrained`` does); what is still untouched gets ``reset_parameters()`` of the module
    holding it, where defined (torch's convention for meta-device models; the module's other tensors are kept).
    A tensor counts as initialised when an init wrote its memory (through any alias, ``.data`` included).

    Args:
        model: the model :func:`materialize` was run on.
        made: what :func:`materialize` returned.
        loaded: the names the load writes (tied aliases included).
        strict: raise when a tensor is left neither loaded nor initialised.

    Returns:
        The names left neither loaded nor initialised: zeros (with ``strict=False``; they are logged too).

    Raises:
        ValueError: with ``strict``, naming each such tensor.
    """
    loaded = set(loaded)
    done = {id(t) for name, t in made.items() if name in loaded}
    rest = {id(t): t for t in made.values() if id(t) not in done}
    if not rest:
        return ()
    with torch.no_grad():
        for t in rest.values():
            storage_of(t).zero_()
    with _Writes() as writes:
        if _is_transformers_model(model):
            _transformers_init(model, rest)
        _reset_parameters(model, rest, done, writes)
    left = tuple(sorted(name for name, t in made.items() if id(t) in rest and not writes.wrote(t)))
    if left:
        shown = ", ".join(left[:8]) + (" …" if len(left) > 8 else "")
        message = (
            f"{len(left)} model tensor(s) from the meta device were neither loaded nor initialised by the "
            f"model: {shown}"
        )
        if strict:
            raise ValueError(message + " (pass strict=False to load them as zeros)")
        log.warning(message + "; they hold zeros")
    return left


def _is_transformers_model(model: torch.nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(model, PreTrainedModel)


def _transformers_init(model: torch.nn.Module, rest: dict[int, torch.Tensor]) -> None:
    """``model.initialize_weights()`` with every tensor but ``rest`` flagged as initialised (as ``from_pretrained``
    flags what it loaded); the flags it did not carry before are removed after."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in rest}
    flagged = [t for t in tensors.values() if not hasattr(t, "_is_hf_initialized")]
    modules = [m for m in model.modules() if "_is_hf_initialized" not in m.__dict__]
    for t in flagged:
        t._is_hf_initialized = True
    try:
        model.initialize_weights()
    finally:
        for t in flagged:
            del t._is_hf_initialized
        for m in modules:
            m.__dict__.pop("_is_hf_initialized", None)


def _reset_parameters(model: torch.nn.Module, rest: dict[int, torch.Tensor], loaded: set[int], writes: _Writes) -> None:
    """``reset_parameters()`` of each module holding a ``rest`` tensor no init wrote yet; the module's tensors that
    are neither such a tensor nor ``loaded`` (overwritten by the load anyway) keep their values."""
    for mod in model.modules():
        reset = getattr(mod, "reset_parameters", None)
        own = [t for table in tensor_tables(mod) for t in table.values() if t is not None and id(t) in rest]
        if not callable(reset) or all(writes.wrote(t) for t in own):
            continue
        pending = {i for i, t in rest.items() if not writes.wrote(t)}  # its submodules' too: not restored below
        kept = {id(t): t for t in [*mod.parameters(), *mod.buffers()] if id(t) not in pending and id(t) not in loaded}
        saved = [(storage_of(t), storage_of(t).clone()) for t in kept.values()]
        with torch.no_grad():
            reset()
            for t, value in saved:
                t.copy_(value)


class _Writes(TorchDispatchMode):
    """Records the memory every op writes (its mutated arguments: in-place, ``out=``), through any alias."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for i, arg in enumerate(schema_arguments(func)):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else kwargs.get(arg.name)
                for t in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(t, torch.Tensor):
                        self.storages.add(_storage_ptr(t))
        return func(*args, **kwargs)

    def wrote(self, t: torch.Tensor) -> bool:
        """Whether an op wrote the memory of ``t`` (a tensor without elements needs no init)."""
        return storage_of(t).numel() == 0 or _storage_ptr(t) in self.storages


def _storage_ptr(t: torch.Tensor) -> int:
    return storage_of(t).untyped_storage().data_ptr()
