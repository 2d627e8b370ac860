"""Placements for a transformers model from its tensor-parallel plan, and sharding a model into DTensors.

The config's plan (``model.tp_plan``, i.e. ``config.base_model_tp_plan`` with the base-model prefix, plus the
head's entries) names a style per module or parameter pattern. Each style becomes the placement torch's
``DTensor`` would give the parameter under transformers' own style classes, on the LAST mesh dim:

=====================================================  ===========================  ==================
style                                                  weight (ndim >= 2)           1-D (bias)
=====================================================  ===========================  ==================
colwise, colwise_rep, colwise_gather_output            Shard(ndim - 2)              Shard(0)
rowwise, rowwise_rep, rowwise_split_input              Shard(ndim - 1)              Replicate
packed_colwise (fused gate_up)                         _StridedShard(ndim - 2, 2)   Shard(0)
packed_rowwise                                         _StridedShard(ndim - 1, 2)   Replicate
embedding_rowwise / embedding_colwise                  Shard(0) / Shard(1)          —
anything else (replicated_with_grad_allreduce, …)      Replicate                    Replicate
=====================================================  ===========================  ==================

Expert tensors (the expert-parallel plan, ``grouped_gemm``) are sharded over experts, ``Shard(0)``, on the
FIRST mesh dim of a 2-D mesh (then TP on the last); with ``experts="ep"`` on a 1-D mesh they are sharded over
experts only, with ``experts="tp"`` by their tensor-parallel style only.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

COLWISE = ("colwise", "colwise_rep", "colwise_gather_output")
ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input")


def style_placement(style: str, ndim: int) -> Any:
    """The placement of a parameter of ``ndim`` dims under a transformers TP ``style`` (one mesh dim)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    if ndim == 0:
        return Replicate()
    if style in COLWISE:
        return Shard(max(ndim - 2, 0))
    if style in ROWWISE:
        return Replicate() if ndim == 1 else Shard(ndim - 1)
    if style == "packed_colwise":
        return Shard(0) if ndim == 1 else _StridedShard(ndim - 2, split_factor=2)
    if style == "packed_rowwise":
        return Replicate() if ndim == 1 else _StridedShard(ndim - 1, split_factor=2)
    if style == "embedding_rowwise":
        return Shard(0)
    if style == "embedding_colwise":
        return Shard(min(1, ndim - 1))
    if style == "grouped_gemm":
        return Shard(0)
    return Replicate()


def _pattern(key: str) -> re.Pattern[str]:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def match_style(name: str, plan: Mapping[str, str]) -> str | None:
    """The style of parameter ``name``: a plan entry naming the parameter itself, else its module."""
    module = name.rpartition(".")[0]
    for key, style in plan.items():
        if _pattern(key).fullmatch(name):
            return style
    for key, style in plan.items():
        if _pattern(key).fullmatch(module):
            return style
    return None


def model_plans(model: torch.nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """``(tp_plan, ep_plan)`` with full parameter-name patterns."""
    tp = dict(getattr(model, "tp_plan", None) or {})
    ep = dict(getattr(model, "_ep_plan", None) or {})
    config = getattr(model, "config", None)
    prefix = getattr(model, "base_model_prefix", "")
    has_base = prefix and hasattr(model, prefix)
    if not tp and config is not None:
        base = getattr(config, "base_model_tp_plan", None) or {}
        tp = {(f"{prefix}.{k}" if has_base else k): v for k, v in base.items()}
    if not ep and config is not None:
        base = getattr(config, "base_model_ep_plan", None) or {}
        ep = {(f"{prefix}.{k}" if has_base else k): v for k, v in base.items()}
    return tp, ep


def plan_placements(model: torch.nn.Module, mesh_shape: Sequence[int], *, experts: str | None = None
                    ) -> tuple[dict[str, tuple], dict[str, str]]:
    """Placements of every sharded parameter of ``model`` on ``mesh_shape``, and the style each came from.

    Args:
        model: a transformers model (any device, meta included).
        mesh_shape: 1-D (TP) or 2-D (EP x TP) mesh.
        experts: "ep" or "tp" for expert tensors (default: "ep" on a 2-D mesh, "tp" on a 1-D mesh).

    Returns:
        ``({name: placements}, {name: description})`` for the parameters that are not fully replicated.
    """
    from torch.distributed.tensor import Replicate

    if len(mesh_shape) not in (1, 2):
        raise ValueError(f"mesh {tuple(mesh_shape)}: use a 1-D (TP) or 2-D (EP x TP) mesh")
    experts = experts or ("ep" if len(mesh_shape) == 2 else "tp")
    tp, ep = model_plans(model)
    out, why = {}, {}
    for name, t in model.state_dict(keep_vars=True).items():
        ndim = t.dim()
        tp_style = match_style(name, tp)
        ep_style = match_style(name, ep) if experts == "ep" else None
        tp_p = style_placement(tp_style, ndim) if tp_style else Replicate()
        if ep_style == "grouped_gemm":
            ep_p = style_placement(ep_style, ndim)
            if len(mesh_shape) == 1:
                pl, desc = (ep_p,), "grouped_gemm (EP)"
            else:
                pl, desc = (ep_p, tp_p), f"grouped_gemm (EP) x {tp_style or 'replicated'} (TP)"
        else:
            pl = (tp_p,) if len(mesh_shape) == 1 else (Replicate(), tp_p)
            desc = f"{tp_style} (TP)" if tp_style else ""
        if all(isinstance(p, Replicate) for p in pl):
            continue
        out[name], why[name] = pl, desc
    return out, why


def placement_text(placements: Sequence[Any]) -> str:
    parts = []
    for p in placements:
        kind = type(p).__name__
        if kind == "Replicate":
            parts.append("R")
        elif kind == "_StridedShard":
            parts.append(f"S({p.dim}, strided x{p.split_factor})")
        elif kind == "Shard":
            parts.append(f"S({p.dim})")
        else:
            parts.append(str(p))
    return "[" + ", ".join(parts) + "]"


def generic_name(name: str) -> str:
    """``model.layers.3.mlp.experts.7.w1`` → ``model.layers.*.mlp.experts.*.w1``."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


# ---------------------------------------------------------------------------------------------------
# building models


def read_config(checkpoint: str, config_file: str | None, model_type: str | None) -> Any:
    """A transformers config: ``config_file`` or the checkpoint's ``config.json``, optionally as ``model_type``."""
    from transformers import AutoConfig

    from .common import CLIError

    path = config_file or (os.path.join(checkpoint, "config.json") if os.path.isdir(checkpoint) else
                           os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "config.json"))
    data: dict[str, Any] = {}
    if os.path.isfile(path):
        with open(path) as f:
            data = json.load(f)
    elif config_file:
        raise CLIError(f"no such config file: {config_file}")
    elif not model_type:
        raise CLIError(f"no config.json next to {checkpoint}: pass --config FILE or --model-type TYPE")
    model_type = model_type or data.get("model_type")
    if not model_type:
        raise CLIError(f"{path} has no model_type: pass --model-type TYPE")
    data = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(model_type, **data)
    except (ValueError, KeyError) as e:
        raise CLIError(f"unknown model type {model_type!r} (transformers knows e.g. llama, mixtral, qwen3_moe, "
                       "deepseek_v3)") from e


def model_class(config: Any) -> Any:
    """The class named by ``config.architectures`` (else the causal-LM auto class, else ``AutoModel``)."""
    import transformers

    for arch in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, arch, None)
        if cls is not None:
            return cls
    for auto in (transformers.AutoModelForCausalLM, transformers.AutoModel):
        try:
            auto._model_mapping[type(config)]
            return auto
        except KeyError:
            continue
    return transformers.AutoModel


def build_meta_model(config: Any, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """The model of ``config`` on the meta device (no memory, no initialisation)."""
    cls = model_class(config)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    with torch.device("meta"):
        if hasattr(cls, "from_config"):
            return cls.from_config(config, **kwargs)
        return cls._from_config(config, **kwargs)


def shard_module(model: torch.nn.Module, mesh: Any, placements: Mapping[str, Sequence[Any]],
                 fill: float = float("nan")) -> torch.nn.Module:
    """Materialise ``model`` on CPU (filled with ``fill``) and make the named parameters DTensors.

    Each DTensor's local shard has the shape DTensor computes for this rank (``fill`` too), so that a
    loader must write every element.
    """
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(t.device.type == "meta" for t in model.state_dict(keep_vars=True).values()):
        model = model.to_empty(device="cpu")
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            if t.is_floating_point():
                t.fill_(fill)
    for name, pl in placements.items():
        mod_name, _, leaf = name.rpartition(".")
        mod = model.get_submodule(mod_name) if mod_name else model
        p = getattr(mod, leaf)
        local_shape, _ = compute_local_shape_and_global_offset(tuple(p.shape), mesh, pl)
        local = torch.full(local_shape, fill, dtype=p.dtype)
        stride = torch.empty(p.shape, device="meta").stride()
        dt = DTensor.from_local(local, mesh, list(pl), run_check=False, shape=p.shape, stride=stride)
        if isinstance(p, torch.nn.Parameter):
            setattr(mod, leaf, torch.nn.Parameter(dt, requires_grad=False))
        else:
            mod.register_buffer(leaf, dt)
    return model
