"""Placements: where each model tensor's local shard sits in the global tensor (DTensor geometry).

A rank owns, per model tensor, a union of boxes of the global tensor (one box for ``Shard``/``Replicate``,
several for ``_StridedShard``), computed with DTensor's own arithmetic. These become the
:class:`~loader.plan.TargetSlot` a plan is made for.

Building a sharded model to load into (the demo's, the tests' and the benches' one way to do it):
placements per tensor from a transformers model's own tensor-parallel plan (:func:`plan_placements`) or from
name globs (:func:`placements_matching`); :func:`shard_module` then makes the named tensors DTensors whose
local shards have the shapes DTensor gives this rank. A transformers plan (``model.tp_plan``, i.e.
``config.base_model_tp_plan`` with the base-model prefix, plus the head's entries) names a style per module
or parameter pattern; each style becomes the placement transformers' own style classes give the parameter,
on the LAST mesh dim:

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

import fnmatch
import functools
import itertools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ._torch import StridedShard, local_shape, local_tensor, shard_size_and_offsets, tensor_tables
from .plan.slots import Box, TargetSlot, whole_boxes


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size (0, 1 outside ``torch.distributed``)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` (or its ``.data``) is a DTensor, by type name (no DTensor import)."""
    return type(getattr(t, "data", t)).__name__ == "DTensor" or type(t).__name__ == "DTensor"


def shard_runs(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> list[list[tuple[int, int, int]]]:
    """The global indices a mesh coordinate owns, per tensor dim, as runs ``(global start, stop, local start)``.

    Follows DTensor exactly (``torch.chunk`` sizes, several mesh dims on one tensor dim applied left to right,
    ``_StridedShard``'s strided indices).

    Raises:
        ValueError: a ``Partial`` placement (there is nothing to load into a pending reduction).
    """
    from torch.distributed.tensor import Partial
    from torch.distributed.tensor.placement_types import Shard

    local = list(global_shape)
    offsets: dict[int, torch.Tensor] = {}
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Partial):
            raise ValueError(f"placement {p} is Partial: a checkpoint cannot be loaded into a pending reduction")
        if not isinstance(p, (Shard, StridedShard)):
            continue
        if p.dim < 0:  # DTensor normalises negative dims; explicit placements may not be
            dim = p.dim + len(global_shape)
            p = StridedShard(dim, split_factor=p.split_factor) if isinstance(p, StridedShard) else Shard(dim)
        size, idx = shard_size_and_offsets(
            local[p.dim], mesh_shape[mesh_dim], coordinate[mesh_dim], p, offsets.get(p.dim), global_shape[p.dim]
        )
        local[p.dim] = size
        offsets[p.dim] = idx[:size] if size else idx[:0]
    runs = []
    for d, n in enumerate(global_shape):
        if d not in offsets:
            runs.append([(0, n, 0)] if n else [])
            continue
        # maximal runs of consecutive global indices, found vectorised (a dim may hold ~10^5 indices)
        idx = offsets[d]
        if not idx.numel():
            runs.append([])
            continue
        breaks = (torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1).tolist()
        starts, ends = [0] + breaks, breaks + [idx.numel()]
        firsts, lasts = idx[starts].tolist(), idx[[e - 1 for e in ends]].tolist()
        runs.append([(a, b + 1, pos) for a, b, pos in zip(firsts, lasts, starts)])
    return runs


def shard_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[tuple[Box, Box], ...]:
    """``(global box, local box)`` pairs of the local shard at ``coordinate`` (a union of boxes).

    Cached per (shape, mesh, coordinate, placements): every layer of a model repeats the same few.
    """
    key = (tuple(global_shape), tuple(mesh_shape), tuple(coordinate), tuple((type(p), p) for p in placements))
    try:
        return _shard_boxes_cached(*key)
    except TypeError:  # an unhashable placement: compute it uncached
        return _shard_boxes(global_shape, mesh_shape, coordinate, placements)


@functools.lru_cache(maxsize=65536)
def _shard_boxes_cached(
    global_shape: tuple, mesh_shape: tuple, coordinate: tuple, typed_placements: tuple
) -> tuple[tuple[Box, Box], ...]:
    return _shard_boxes(global_shape, mesh_shape, coordinate, [p for _, p in typed_placements])


def _shard_boxes(
    global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[tuple[Box, Box], ...]:

    runs = shard_runs(global_shape, mesh_shape, coordinate, placements)
    if any(not r for r in runs) and global_shape:
        return ()
    pairs = []
    for combo in itertools.product(*runs):
        g = tuple((a, b) for a, b, _ in combo)
        loc = tuple((lp, lp + b - a) for a, b, lp in combo)
        pairs.append((g, loc))
    return tuple(pairs)


def slot_for(name: str, tensor: torch.Tensor) -> TargetSlot:
    """The slot of ``tensor`` on this rank: a DTensor's local shard boxes, or the whole tensor."""
    data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor  # (each .data is a new object)
    # a DTensor's .data is a dispatched op (a warm load builds every slot): asked for once, its local shard kept
    local = None if type(data) is torch.Tensor else local_tensor(data)
    if local is None:  # plain_slot without asking for .data again
        shape = tuple(data.shape)
        return TargetSlot(name, shape, data.dtype, data, whole_boxes(shape))
    mesh = data.device_mesh
    coord = mesh.get_coordinate()
    shape = tuple(data.shape)
    if coord is None:
        return TargetSlot(name, shape, data.dtype, local, ())
    try:
        boxes = shard_boxes(shape, tuple(mesh.shape), coord, data.placements)
    except ValueError as e:
        raise ValueError(f"model tensor {name!r}: {e}") from None
    return TargetSlot(name, shape, data.dtype, local, boxes)


# ---------------------------------------------------------------------------------------------------
# building sharded models

COLWISE = ("colwise", "colwise_rep", "colwise_gather_output")
ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input")

Placements = tuple[Placement, ...]


def style_placement(style: str, ndim: int) -> Placement:
    """The placement of a parameter of ``ndim`` dims under a transformers TP ``style`` (one mesh dim)."""
    if ndim == 0:
        return Replicate()
    if style in COLWISE:
        return Shard(max(ndim - 2, 0))
    if style in ROWWISE:
        return Replicate() if ndim == 1 else Shard(ndim - 1)
    if style == "packed_colwise":
        return Shard(0) if ndim == 1 else StridedShard(ndim - 2, split_factor=2)
    if style == "packed_rowwise":
        return Replicate() if ndim == 1 else StridedShard(ndim - 1, split_factor=2)
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
    """The style of parameter ``name`` in a TP/EP ``plan``: an entry naming the parameter itself, else its
    module (``*`` in a plan key stands for a layer or expert number)."""
    module = name.rpartition(".")[0]
    for key, style in plan.items():
        if _pattern(key).fullmatch(name):
            return style
    for key, style in plan.items():
        if _pattern(key).fullmatch(module):
            return style
    return None


def model_plans(model: nn.Module) -> tuple[dict[str, str], dict[str, str]]:
    """``(tp_plan, ep_plan)`` of a transformers model, with full parameter-name patterns."""
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


def plan_placements(
    model: nn.Module, mesh_shape: Sequence[int], *, experts: str | None = None
) -> tuple[dict[str, Placements], dict[str, str]]:
    """Placements of every sharded tensor of ``model`` on ``mesh_shape`` from its own TP/EP plans.

    Args:
        model: a transformers model (any device, meta included), or any module with ``tp_plan``/``_ep_plan``.
        mesh_shape: 1-D (TP) or 2-D (EP x TP) mesh.
        experts: "ep" or "tp" for expert tensors (default: "ep" on a 2-D mesh, "tp" on a 1-D mesh).

    Returns:
        ``({name: placements}, {name: the style it came from})`` for the tensors not fully replicated.
    """
    if len(mesh_shape) not in (1, 2):
        raise ValueError(f"mesh {tuple(mesh_shape)}: use a 1-D (TP) or 2-D (EP x TP) mesh")
    experts = experts or ("ep" if len(mesh_shape) == 2 else "tp")
    tp, ep = model_plans(model)
    out: dict[str, Placements] = {}
    why: dict[str, str] = {}
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


def placements_matching(model: nn.Module, patterns: Mapping[str, Sequence[Placement]]) -> dict[str, Placements]:
    """Placements of the parameters of ``model`` whose names match a glob of ``patterns`` (the first that
    matches, in order; ``*`` matches dots too): e.g. ``{"*.o_proj.weight": [Replicate(), Shard(1)]}``.
    Parameters that match no pattern are left out (they stay plain, replicated tensors)."""
    out: dict[str, Placements] = {}
    for name, _ in model.named_parameters():
        for pattern, pl in patterns.items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = tuple(pl)
                break
    return out


def placement_text(placements: Sequence[Placement]) -> str:
    """A short form for tables: ``[R, S(0), S(1, strided x2)]``."""
    parts = []
    for p in placements:
        if isinstance(p, Replicate):
            parts.append("R")
        elif isinstance(p, StridedShard):
            parts.append(f"S({p.dim}, strided x{p.split_factor})")
        elif isinstance(p, Shard):
            parts.append(f"S({p.dim})")
        else:
            parts.append(str(p))
    return "[" + ", ".join(parts) + "]"


def shard_module(
    model: nn.Module,
    mesh: DeviceMesh,
    placements: Mapping[str, Sequence[Placement]],
    *,
    fill: float | None = float("nan"),
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Make the named tensors of ``model`` DTensors with the given placements on ``mesh``, in place.

    Each DTensor's local shard has the shape DTensor computes for this rank's mesh coordinate; it is new
    memory on ``device``. Every other tensor still on the meta device is materialised there (uninitialised,
    one tensor at a time: no whole copy of a large model). Floating tensors are then filled with ``fill``
    (NaN by default, so that a loader must write every element; ``None`` leaves them uninitialised).
    ``device="meta"`` keeps everything on meta, for planning without memory.

    Args:
        model: any module, on meta or materialised; tied tensors stay tied.
        mesh: the device mesh (one dim per placement).
        placements: state-dict name (parameter or buffer) → one placement per mesh dim.

    Returns:
        ``model`` itself. DTensor parameters do not require grad.
    """
    device = torch.device(device)
    known = model.state_dict(keep_vars=True)
    missing = sorted(set(placements) - set(known))
    if missing:
        raise KeyError(f"no tensor named {missing[0]!r} in the model ({len(missing)} placement(s) name none)")
    placed = {id(known[name]): pl for name, pl in placements.items()}  # by tensor: tied names share one
    done: dict[int, torch.Tensor] = {}  # id(old tensor) → its replacement: tied tensors stay tied
    with torch.no_grad():
        for mod in model.modules():
            for table in tensor_tables(mod):
                for attr, t in list(table.items()):
                    if t is not None:
                        if id(t) not in done:
                            done[id(t)] = _replacement(t, mesh, placed.get(id(t)), device, fill)
                        table[attr] = done[id(t)]
    return model


def _replacement(
    t: torch.Tensor,
    mesh: DeviceMesh,
    pl: Sequence[Placement] | None,
    device: torch.device,
    fill: float | None,
) -> torch.Tensor:
    """The new tensor for ``t``: a DTensor when placed, else ``t`` itself (materialised if on meta)."""
    is_param = isinstance(t, nn.Parameter)
    if pl is not None:
        local = torch.empty(local_shape(t.shape, mesh, pl), dtype=t.dtype, device=device)
        _fill(local, fill)
        stride = torch.empty(t.shape, device="meta").stride()
        new = DTensor.from_local(local, mesh, list(pl), run_check=False, shape=t.shape, stride=stride)
        return nn.Parameter(new, requires_grad=False) if is_param else new
    if t.device.type == "meta" and device.type != "meta":
        new = torch.empty(t.shape, dtype=t.dtype, device=device)
        t = nn.Parameter(new, requires_grad=t.requires_grad) if is_param else new
    _fill(t, fill)
    return t


def _fill(t: torch.Tensor, fill: float | None) -> None:
    if fill is not None and t.device.type != "meta" and t.is_floating_point():
        t.fill_(fill)
