"""Models on the meta device: allocate their tensors before a load, initialise what the checkpoint lacks after it.

:func:`materialize` replaces every meta parameter/buffer, in place on its module, by an empty tensor on a device
(a DTensor keeps its mesh and placements and allocates only its local shard; tied tensors stay one tensor).
:func:`initialize_rest` then gives the tensors the load did not write their values the way the model would: a
transformers ``PreTrainedModel`` runs its own ``initialize_weights`` (rotary ``inv_freq`` and the like), skipping
what was loaded, as ``from_pretrained`` does for a meta-initialised model.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from .plan.slots import storage_of

log = logging.getLogger("loader")


def on_meta(model: torch.nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` (a DTensor's local shard) is on the meta device."""
    tensors = [*model.parameters(), *model.buffers()]
    return any(storage_of(t).device.type == "meta" for t in tensors)


def materialize(model: torch.nn.Module, device: str | torch.device) -> dict[str, torch.Tensor]:
    """Replace each meta tensor of ``model`` by an uninitialised one on ``device``, in place.

    Returns:
        The new tensors by every name (parameters and all buffers, tied aliases included) that was on meta.
    """
    device = torch.device(device)
    done: dict[int, torch.Tensor] = {}  # id(old tensor) → its replacement: tied tensors stay tied
    made: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for prefix, mod in model.named_modules(remove_duplicate=False):
            for table in (mod._parameters, mod._buffers):
                for leaf, t in list(table.items()):
                    if t is None or storage_of(t).device.type != "meta":
                        continue
                    if id(t) not in done:
                        done[id(t)] = _empty_like(t, device)
                    table[leaf] = made[f"{prefix}.{leaf}" if prefix else leaf] = done[id(t)]
    return made


def _empty_like(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    data = t.data if isinstance(t, torch.nn.Parameter) else t
    local = getattr(data, "_local_tensor", None)
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
    """Initialise the materialised tensors the load did not write, through the model's own init.

    Args:
        model: the model :func:`materialize` was run on, now loaded.
        made: what :func:`materialize` returned.
        loaded: the names the load wrote (tied aliases included).
        strict: raise when a parameter or buffer is left uninitialised.

    Returns:
        The names left uninitialised (with ``strict=False``; they are logged too).

    Raises:
        ValueError: with ``strict``, naming each tensor nothing loaded or initialised.
    """
    loaded = set(loaded)
    done = {id(t) for name, t in made.items() if name in loaded}
    rest = {name: t for name, t in made.items() if id(t) not in done}
    if not rest:
        return ()
    versions = {name: storage_of(t)._version for name, t in rest.items()}
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedModel = ()
    if isinstance(model, PreTrainedModel):
        flagged = list({id(t): t for t in made.values() if id(t) in done}.values())
        for t in flagged:  # transformers' init functions skip these, as in from_pretrained
            t._is_hf_initialized = True
        try:
            model.initialize_weights()
        finally:
            for t in flagged:
                del t._is_hf_initialized
            for mod in model.modules():
                mod.__dict__.pop("_is_hf_initialized", None)
    # an init writes in place, which bumps the version counter of the tensor it wrote
    left = tuple(sorted(name for name, t in rest.items() if storage_of(t)._version == versions[name]))
    if left:
        shown = ", ".join(left[:8]) + (" …" if len(left) > 8 else "")
        message = (
            f"{len(left)} model tensor(s) from the meta device were neither loaded nor initialised by the "
            f"model: {shown}"
        )
        if strict:
            raise ValueError(message + " (pass strict=False to leave them uninitialised)")
        log.warning(message)
    return left
