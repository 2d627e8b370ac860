"""Simulating the load plan of any rank of a large mesh in one process, without reading anything.

The model may live on the meta device; its tensors' placements come from DTensors (e.g. a model
parallelised under torch's fake process group for one rank) or from an explicit ``placements`` mapping.
Each simulated rank's slots are computed with DTensor's own sharding arithmetic, and traces are shared
across ranks (one trace per conversion shape signature).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._torch import root_mesh
from .checkpoint import Checkpoint, SafetensorsCheckpoint
from .options import Rules
from .placements import is_dtensor, shard_boxes
from .plan import RankPlan
from .plan.slots import Box, TargetSlot, full_box, iter_model_tensors
from .planner import HFLoadPlanner
from .rules import Conversion
from .rules.fp8 import weight_of_scale

#: the endings of the scale names :func:`~loader.rules.fp8.weight_of_scale` knows (a cheap test before it)
_SCALE_ENDINGS = ("_scale_inv", ".scale", ".qscale_weight")

#: what a rank holds of one tensor: ``(global box, local box)`` pairs (:func:`~loader.placements.shard_boxes`)
Boxes = tuple[tuple[Box, Box], ...]


@dataclass(frozen=True)
class RankFigures:
    """The plan of one simulated rank.

    Attributes:
        rank: global rank; coordinate: its mesh coordinate.
        blocks: RemapBlocks it executes.
        bytes_read: checkpoint bytes its plan reads (region reads by element, deferred sources whole).
        shard_bytes: bytes of its local shards, in checkpoint dtype (the least any loader must read).
        whole_tensor_bytes: bytes it would read loading every source tensor it touches whole.
        traced: model tensors it loads by traced conversions (region or value reads); deferred: through deferred
            conversions.
        deferred_conversions: number of deferred conversions it runs.
    """

    rank: int
    coordinate: tuple[int, ...]
    blocks: int
    bytes_read: int
    shard_bytes: int
    whole_tensor_bytes: int
    traced: int
    deferred: int
    deferred_conversions: int


#: per model tensor name, placements over a mesh: a mapping (names absent are replicated) or a function of
#: (name, global shape)
PlacementsArg = Mapping[str, Sequence[Any]] | Callable[[str, tuple[int, ...]], Sequence[Any]]


@dataclass(frozen=True)
class MeshPlacements:
    """A mesh and the placements of a model's tensors over it: what each of its ranks holds, without processes.

    The one derivation the simulators share (loads, saves, transfers, the ``plan`` command): see
    :func:`mesh_placements`.
    """

    mesh_shape: tuple[int, ...]
    placements: PlacementsArg

    @property
    def world(self) -> int:
        """The number of ranks of the mesh."""
        return math.prod(self.mesh_shape)

    def of(self, name: str, shape: tuple[int, ...]) -> Sequence[Any] | None:
        """The placements of model tensor ``name`` of global ``shape`` (None or empty: replicated)."""
        return self.placements(name, shape) if callable(self.placements) else self.placements.get(name)

    def boxes(self, shape: tuple[int, ...], coordinate: Sequence[int], placements: Sequence[Any] | None) -> Boxes:
        """``(global box, local box)`` pairs that ``coordinate`` holds of a tensor of ``shape`` placed so (the whole
        tensor when ``placements`` is None or empty)."""
        if placements:
            return shard_boxes(shape, self.mesh_shape, coordinate, placements)
        return ((full_box(shape), full_box(shape)),)


def mesh_placements(
    model: torch.nn.Module, mesh_shape: Sequence[int] | None = None, placements: PlacementsArg | None = None
) -> MeshPlacements:
    """The mesh and placements a simulation of ``model`` uses: those given, else its DTensors' (root mesh and
    placements, :func:`model_placements`), else one rank holding everything."""
    found_mesh, found = model_placements(model)
    return MeshPlacements(tuple(mesh_shape or found_mesh or (1,)), found if placements is None else placements)


def coordinate_of(rank: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """The mesh coordinate of ``rank`` (row-major, like ``DeviceMesh``)."""
    coord = []
    for n in reversed(mesh_shape):
        coord.append(rank % n)
        rank //= n
    return tuple(reversed(coord))


def model_placements(model: torch.nn.Module) -> tuple[tuple[int, ...] | None, dict[str, Any]]:
    """Mesh shape and placements of a model's DTensors (plain tensors are replicated).

    A DTensor on a submesh (``mesh["tp"]``, as ``parallelize_module`` is often given) is expressed over its
    root mesh: each placement goes to the root dim of the same name, ``Replicate`` elsewhere.

    Raises:
        ValueError: DTensors on different root meshes, a root mesh whose ranks are not ``0 … n-1`` in
            row-major order, or a submesh whose dims cannot be mapped to its root's (pass ``mesh_shape`` and
            ``placements`` to :func:`simulate_load` instead).
    """
    mesh_shape, placements = None, {}
    for name, t in iter_model_tensors(model):
        data = t.data if isinstance(t, torch.nn.Parameter) else t
        if not is_dtensor(data):
            continue
        mesh = data.device_mesh
        root = root_mesh(mesh)
        shape = tuple(root.shape)
        if mesh_shape is not None and shape != mesh_shape:
            raise ValueError(
                f"model tensor {name!r} is on a mesh of shape {shape}, others on {mesh_shape}: "
                "pass mesh_shape and placements"
            )
        if root.mesh.flatten().tolist() != list(range(math.prod(shape))):
            raise ValueError(
                f"model tensor {name!r}: its mesh does not hold ranks 0 … n-1 in row-major order: "
                "pass mesh_shape and placements"
            )
        mesh_shape = shape
        pl = tuple(data.placements)
        placements[name] = pl if root is mesh else _on_root(name, pl, mesh, root)
    return mesh_shape, placements


def _on_root(name: str, placements: tuple, mesh: Any, root: Any) -> tuple:
    from torch.distributed.tensor import Replicate

    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or any(n not in root_names for n in names):
        raise ValueError(
            f"model tensor {name!r} is on a submesh {names} whose dims are not dims of its root mesh "
            f"{root_names}: pass mesh_shape and placements"
        )
    dims = [root_names.index(n) for n in names]
    if dims != sorted(dims) and sum(1 for p in placements if not isinstance(p, Replicate)) > 1:
        raise ValueError(
            f"model tensor {name!r}: submesh {names} reorders its root's dims {root_names}: "
            "pass mesh_shape and placements"
        )
    out: list[Any] = [Replicate()] * len(root_names)
    for d, p in zip(dims, placements):
        out[d] = p
    return tuple(out)


def simulate_plans(
    model: torch.nn.Module,
    checkpoint: str | Checkpoint,
    *,
    mesh_shape: Sequence[int] | None = None,
    placements: Mapping[str, Sequence[Any]] | Callable[[str, tuple[int, ...]], Sequence[Any]] | None = None,
    ranks: Sequence[int] | None = None,
    planner: HFLoadPlanner | None = None,
    rules: Rules | None = None,
) -> Iterator[tuple[int, tuple[int, ...], RankPlan]]:
    """Plan ranks of a mesh without loading anything: ``(rank, mesh coordinate, plan)`` per rank, lazily.

    Arguments as :func:`simulate_load`. The key plan and the traces are shared by all ranks.
    """
    if isinstance(checkpoint, str):
        checkpoint = SafetensorsCheckpoint.open(checkpoint)
    mesh = mesh_placements(model, mesh_shape, placements)
    planner = planner or HFLoadPlanner(model, rules=rules)
    tensors = dict(iter_model_tensors(model))
    for rank in ranks if ranks is not None else range(mesh.world):
        coord = coordinate_of(rank, mesh.mesh_shape)
        slots = {}
        for name, t in tensors.items():
            shape = tuple(t.shape)
            slots[name] = TargetSlot(name, shape, t.dtype, None, mesh.boxes(shape, coord, mesh.of(name, shape)))
        yield rank, coord, planner.build_plan(checkpoint, slots, check_devices=False)


def simulate_load(
    model: torch.nn.Module,
    checkpoint: str | Checkpoint,
    *,
    mesh_shape: Sequence[int] | None = None,
    placements: Mapping[str, Sequence[Any]] | Callable[[str, tuple[int, ...]], Sequence[Any]] | None = None,
    ranks: Sequence[int] | None = None,
    planner: HFLoadPlanner | None = None,
    rules: Rules | None = None,
) -> list[RankFigures]:
    """Plan ranks of a mesh without loading anything.

    Args:
        model: the model (any device, meta included).
        checkpoint: a checkpoint path, or header-only :class:`SafetensorsCheckpoint` (``from_infos``).
        mesh_shape: the mesh (default: the model's DTensors' mesh).
        placements: per model tensor name, placements over the mesh (a mapping or a function of name and
            shape); names absent are replicated. Default: the model's DTensor placements.
        ranks: ranks to simulate (default: all).
        planner: a configured :class:`HFLoadPlanner` (default: one of ``rules``).
        rules: the :class:`~loader.options.Rules` of the default planner.

    Returns:
        One :class:`RankFigures` per simulated rank.
    """
    itemsizes: dict[int, tuple[Conversion, int]] = {}
    return [
        rank_figures(plan, rank, coord, itemsizes)
        for rank, coord, plan in simulate_plans(
            model,
            checkpoint,
            mesh_shape=mesh_shape,
            placements=placements,
            ranks=ranks,
            planner=planner,
            rules=rules,
        )
    ]


def rank_figures(
    plan: RankPlan, rank: int, coordinate: tuple[int, ...], itemsizes: dict[int, tuple[Conversion, int]] | None = None
) -> RankFigures:
    """The :class:`RankFigures` of one simulated rank's plan.

    Args:
        plan: the rank's plan.
        rank, coordinate: the rank and its mesh coordinate.
        itemsizes: a cache of each conversion's widest source itemsize, shared across ranks.
    """
    checkpoint, slots = plan.checkpoint, plan.slots
    itemsizes = {} if itemsizes is None else itemsizes
    shard_bytes = 0
    for conv in plan.conversions:
        item = itemsizes.get(id(conv))
        if item is None or item[0] is not conv:  # once per conversion, not per rank
            named = [k for k in conv.sources if k.endswith(_SCALE_ENDINGS)]
            sources = set(conv.sources) if named else set()
            scales = {k for k in named if weight_of_scale(k) in sources}
            values = [k for k in conv.sources if k not in scales] or conv.sources  # FP8: the codes, not their scales
            item = itemsizes[id(conv)] = (conv, max(checkpoint[k].itemsize for k in values))
        shard_bytes += sum(slots[t].local_numel for t in conv.targets) * item[1]
    blocks = plan.block_reads()
    touched = {b.source for _, b in blocks} | {k for d in plan.deferred if d.boxes for k in d.conversion.sources}
    return RankFigures(
        rank=rank,
        coordinate=coordinate,
        blocks=len(blocks),
        bytes_read=plan.planned_bytes(),
        shard_bytes=shard_bytes,
        whole_tensor_bytes=sum(checkpoint[k].nbytes for k in touched),
        traced=len(set(plan.traced)),
        deferred=len(set(plan.deferred_targets)),
        deferred_conversions=sum(1 for d in plan.deferred if d.boxes),
    )
