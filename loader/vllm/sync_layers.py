"""A running vLLM model's layers as they were at load time, and rebuilt from new values (imports vLLM when used).

Vocabulary (as in :mod:`loader.vllm.sync_plan`, plus):

- **state**: what a layer holds: its parameters, buffers and the attributes its post-load processing set (a
  oneDNN handle's ``cpu_linear``), and its quantization method's attributes (a fused-MoE method's kernel, which
  the layer's runner holds the method for): shallow copies of both ``__dict__`` (:func:`snapshot`), put back by
  :func:`put_back`. Swapping states replaces attributes; no kernel tensor is written into.
- **rebuild**: a layer's load-time parameters made again (fresh tensors shaped by vLLM's reload metadata, the
  ``weight_loader``s and classes theirs), written from the trainer's values, then the layer's post-load
  processing run on them as on a first load (``quant_method.process_weights_after_loading``, a fused-MoE
  method's ``moe_kernel`` cleared first, as its constructor leaves it: a new kernel is built over the new
  tensors rather than the new values copied into the old kernel's): the layer's new state.

- **tie**: one parameter held under two names (a tied embedding: vLLM's ``lm_head.weight`` is
  ``model.embed_tokens.weight``); the first name a traversal reaches is the canonical one (as vLLM's
  ``AutoWeightsLoader`` picks it, loading that name and skipping the other). A layer holding the other name
  *follows*: its rebuild takes the canonical layer's new parameter (rebuilt before it) instead of a fresh one
  (:func:`follow`, :data:`FOLLOWS`), then runs its own post-load processing over it.

vLLM's own in-place reload (``reload_weights``) copies the processed values into the old kernel tensors' storage
(for CUDA graphs); the engine here runs eagerly, so a push replaces the states instead (which also serves
layers whose processed tensors change shape, vLLM's CPU experts).
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = [
    "FOLLOWS",
    "LayerState",
    "follow",
    "load_time_params",
    "load_time_view",
    "put_back",
    "rebuild",
    "snapshot",
    "ties",
]

#: a layer's state (see the module): its ``__dict__``, its quantization method's (None without one)
LayerState = tuple[dict[str, Any], dict[str, Any] | None]
#: the ``__dict__`` entries a snapshot copies (the others are kept by reference)
CONTAINERS = ("_parameters", "_buffers", "_non_persistent_buffers_set")
#: per following layer, its attributes that follow a tie: attribute -> (canonical layer, its attribute)
FOLLOWS: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, tuple[torch.nn.Module, str]]] = (
    weakref.WeakKeyDictionary()
)


def _copied(attrs: dict[str, Any]) -> dict[str, Any]:
    return {k: copy.copy(v) if k in CONTAINERS else v for k, v in attrs.items()}


def snapshot(module: torch.nn.Module) -> LayerState:
    """``module``'s state (see the module)."""
    method = vars(module).get("quant_method")
    return _copied(vars(module)), None if method is None else dict(vars(method))


def put_back(module: torch.nn.Module, state: LayerState) -> None:
    """Make ``state`` ``module``'s state again (every attribute the module or its method gained since dropped)."""
    attrs, method_attrs = state
    vars(module).clear()
    vars(module).update(_copied(attrs))
    if method_attrs is not None:
        vars(attrs["quant_method"]).clear()
        vars(attrs["quant_method"]).update(method_attrs)


def _info(module: torch.nn.Module) -> Any:
    """vLLM's reload record of ``module`` (its load-time tensors on meta), or None when it recorded none."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    info = LAYERWISE_INFO.get(module)
    return info if info is not None and (info.restore_metadata[0] or info.restore_metadata[1]) else None


def _on_meta(module: torch.nn.Module) -> None:
    """``module``'s load-time tensors back on the meta device (vLLM's ``restore_layer_on_meta``), where recorded."""
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    info = _info(module)
    if info is not None:
        restore_layer_on_meta(module, info)


@contextlib.contextmanager
def load_time_view(model: torch.nn.Module) -> Iterator[None]:
    """Every layer of ``model`` holding its load-time parameters on meta for the ``with`` block (a trace's view);
    every layer's state put back on exit, also on an error."""
    saved = [(m, snapshot(m)) for m in model.modules()]
    try:
        for module, _ in saved:
            _on_meta(module)
        yield
    finally:
        for module, state in saved:
            put_back(module, state)


def load_time_params(module: torch.nn.Module) -> list[str]:
    """The names of ``module``'s loadable parameters, in a :func:`load_time_view`."""
    from vllm.model_executor.model_loader.reload.meta import SKIP_LOAD_TENSORS

    return [n for n, _ in module.named_parameters(recurse=False) if n not in SKIP_LOAD_TENSORS]


def ties(model: torch.nn.Module) -> dict[str, str]:
    """``model``'s tied parameters as they are now (outside a :func:`load_time_view`, which holds each layer's own
    meta tensors): each name after the first of a parameter held by two layers -> the first (see the module). A
    layer reached under two names (vLLM's fused-MoE layer holds its router, ``experts.gate``, which is ``gate``)
    is one layer, not a tie."""
    first: dict[int, tuple[str, tuple[int, str]]] = {}
    out: dict[str, str] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            name, slot = f"{prefix}.{attr}" if prefix else attr, (id(module), attr)
            canonical, its_slot = first.setdefault(id(param), (name, slot))
            if its_slot != slot:
                out[name] = canonical
    return out


def follow(model: torch.nn.Module, alias: str, canonical: str) -> None:
    """Make ``model``'s parameter ``alias`` follow ``canonical`` in a :func:`rebuild` of its layer."""
    owner, _, attr = alias.rpartition(".")
    source, _, source_attr = canonical.rpartition(".")
    FOLLOWS.setdefault(model.get_submodule(owner), {})[attr] = (model.get_submodule(source), source_attr)


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor shaped as ``tensor`` (on the CPU when it is a meta tensor), with its class and attributes."""
    device = torch.device("cpu") if tensor.is_meta else tensor.device
    fresh = torch.empty_strided(tuple(tensor.shape), tuple(tensor.stride()), dtype=tensor.dtype, device=device)
    fresh.__class__ = tensor.__class__
    fresh.__dict__ = tensor.__dict__.copy()
    return fresh


def rebuild(
    module: torch.nn.Module, attrs: list[str], write: Callable[[str, torch.Tensor], None], vllm_config: Any
) -> None:
    """Rebuild ``module`` (see the module): its load-time parameters ``attrs`` fresh, ``write(attr, tensor)``
    filling each (an attribute that follows a tie takes the canonical layer's parameter, unwritten), then its
    post-load processing. Buffers it does not load keep their current tensors. The caller
    keeps the old state (:func:`snapshot`) to put back on an error."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    buffers = dict(module.named_buffers(recurse=False))
    _on_meta(module)
    for name, buffer in list(module.named_buffers(recurse=False)):
        if buffer.is_meta and name in buffers:
            setattr(module, name, buffers[name])
    follows = FOLLOWS.get(module, {})
    for attr in attrs:
        if attr in follows:
            source, source_attr = follows[attr]
            setattr(module, attr, source.get_parameter(source_attr))
            continue
        param = _fresh(module.get_parameter(attr))
        write(attr, param)
        setattr(module, attr, param)
    if hasattr(module, "_already_called_process_weights_after_loading"):
        delattr(module, "_already_called_process_weights_after_loading")
    method = getattr(module, "quant_method", None)
    if isinstance(method, QuantizeMethodBase):
        if "moe_kernel" in vars(method):
            method.moe_kernel = None  # a first processing: a new kernel over the new tensors
        with set_current_vllm_config(vllm_config):
            method.process_weights_after_loading(module)
        if hasattr(module, "update_param_tp_status"):
            module.update_param_tp_status()
