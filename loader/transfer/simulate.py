"""Simulating a weight transfer on meta models: bytes per rank pair and plan time, for any two meshes.

Nothing is allocated or sent: each model's parts on every rank of its mesh come from placements
(:func:`loader.placements.shard_boxes`, DTensor's own arithmetic, no process group), the two sides are mapped
as :func:`~loader.transfer.transfer_weights` maps them, and :func:`~loader.transfer.plan_transfer` is run once for
the whole world (the figures) and once for each of a few ranks (``rank=``: what each rank of a real transfer
computes), each timed.

Vocabulary:

- **world**: the source's mesh ranks first (``0 … S-1``), then the destination's (``S … S+D-1``,
  disaggregated), or the destination's on the same ranks from 0 (colocated).
- **shard bytes**: what a rank holds of a model, in that model's dtypes: the least a destination rank can
  receive (every element once), what a source rank can hold to send.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..plan import TraceCache
from ..plan.slots import iter_model_tensors
from ..simulate import PlacementsArg, coordinate_of, mesh_placements
from .plan import Slot, Slots, TransferPlan, plan_transfer
from .sides import as_rules, dest_side, source_side


@dataclass(frozen=True)
class RankTransfer:
    """One rank of a simulated transfer.

    Attributes:
        rank: world rank.
        sent: payload bytes it sends (to itself included); received: payload bytes it receives.
        local: the part of both that stays on the rank (a copy, no message).
        src_shard_bytes: bytes it holds of the source (0: none); dst_shard_bytes: of the destination.
    """

    rank: int
    sent: int
    received: int
    local: int
    src_shard_bytes: int
    dst_shard_bytes: int

    @property
    def received_ratio(self) -> float | None:
        """Bytes received ÷ destination shard bytes (1.0: each element once); None on a rank without any."""
        return self.received / self.dst_shard_bytes if self.dst_shard_bytes else None


@dataclass(frozen=True)
class TransferFigures:
    """A simulated transfer.

    Attributes:
        world: ranks in all; src_ranks, dst_ranks: the world ranks holding each model.
        pairs: payload bytes per ``(source rank, destination rank)``, a rank to itself included.
        ranks: one :class:`RankTransfer` per world rank.
        moves: strided copies in the plan; transferred: destination tensors moved region by region;
            fallback: destination tensors computed from keys moved whole.
        map_seconds: mapping both models to the checkpoint layout (done once, on a lead rank of each);
            plan_seconds: :func:`plan_transfer` for the whole world.
        rank_plan_seconds: world rank -> :func:`plan_transfer` for that rank alone (what it computes in a
            transfer), for the ranks timed.
        plan: the whole world's plan.
    """

    world: int
    src_ranks: tuple[int, ...]
    dst_ranks: tuple[int, ...]
    pairs: Mapping[tuple[int, int], int]
    ranks: tuple[RankTransfer, ...]
    moves: int
    transferred: int
    fallback: int
    map_seconds: float
    plan_seconds: float
    rank_plan_seconds: Mapping[int, float]
    plan: TransferPlan = field(repr=False, compare=False)

    @property
    def bytes_moved(self) -> int:
        """Payload bytes between different ranks (messages)."""
        return sum(n for (s, d), n in self.pairs.items() if s != d)


def mesh_parts(
    model: torch.nn.Module, mesh_shape: Sequence[int] | None = None, placements: PlacementsArg | None = None
) -> list[Slots]:
    """What each rank of a mesh holds of ``model`` (any device, meta included), index = rank in the mesh.

    Args:
        mesh_shape: the mesh (default: the model's DTensors' root mesh, else one rank).
        placements: per tensor name, placements over the mesh (default: the model's DTensor placements);
            names absent are replicated.
    """
    mesh = mesh_placements(model, mesh_shape, placements)
    tensors = [(name, tuple(t.shape), t.dtype) for name, t in iter_model_tensors(model)]
    out = []
    for rank in range(mesh.world):
        coord = coordinate_of(rank, mesh.mesh_shape)
        parts: dict[str, Slot] = {}
        for name, shape, dtype in tensors:
            parts[name] = (shape, dtype, mesh.boxes(shape, coord, mesh.of(name, shape)))
        out.append(parts)
    return out


def parts_bytes(parts: Slots) -> int:
    """Bytes of a rank's parts, each tensor in its dtype."""
    return sum(
        sum(math.prod(b - a for a, b in g) for g, _ in boxes) * dtype.itemsize for _, dtype, boxes in parts.values()
    )


@dataclass(frozen=True)
class TransferMeshes:
    """The two sides of a simulated transfer: each one's mesh and placements, and where the destination's ranks are.

    Attributes:
        src_mesh_shape, src_placements: the source's mesh and placements, as ``mesh_shape`` and ``placements`` of
            :func:`loader.simulate.simulate_load` (None: the model's DTensors'; none: one rank); e.g. FSDP over 64
            ranks: ``(64,)`` and ``lambda name, shape: [Shard(0)]``.
        dst_mesh_shape, dst_placements: the destination's.
        colocated: the destination's mesh on world ranks ``0 …`` like the source's (default: after them).
    """

    src_mesh_shape: Sequence[int] | None = None
    src_placements: PlacementsArg | None = None
    dst_mesh_shape: Sequence[int] | None = None
    dst_placements: PlacementsArg | None = None
    colocated: bool = False


def simulate_transfer(
    src: torch.nn.Module,
    dst: torch.nn.Module,
    *,
    src_mapping: Any = None,
    dst_mapping: Any = None,
    source_shapes: Any = None,
    meshes: TransferMeshes | None = None,
    timed_ranks: Sequence[int] | None = None,
) -> TransferFigures:
    """Plan a transfer of ``src`` into ``dst`` for every rank of two meshes, without data or processes.

    Args:
        src, dst: the two models, on any device (meta included), plain or DTensor-sharded.
        src_mapping, dst_mapping, source_shapes: as for :func:`~loader.transfer.transfer_weights`.
        meshes: the two sides' meshes and placements, and where the destination's ranks are
            (:class:`TransferMeshes`); None: each model's DTensors' (none: one rank), the destination after the
            source.
        timed_ranks: world ranks whose own plans are timed (default: the first source rank and the first
            destination rank).

    Returns:
        The :class:`TransferFigures`.

    Raises:
        ValueError: as ``transfer_weights`` before anything is sent (shapes, dtypes, keys, a source conversion
            that is not a bijection).
    """
    meshes = meshes if meshes is not None else TransferMeshes()
    src_parts = mesh_parts(src, meshes.src_mesh_shape, meshes.src_placements)
    dst_parts = mesh_parts(dst, meshes.dst_mesh_shape, meshes.dst_placements)
    offset = 0 if meshes.colocated else len(src_parts)
    world = max(len(src_parts), offset + len(dst_parts))
    src_world = [src_parts[r] if r < len(src_parts) else {} for r in range(world)]
    dst_world = [dst_parts[r - offset] if 0 <= r - offset < len(dst_parts) else {} for r in range(world)]
    t0 = time.perf_counter()
    cache = TraceCache()  # one trace per signature for both sides, as in transfer_weights
    source = source_side(src, as_rules(src_mapping), source_shapes=source_shapes, cache=cache)
    dest, _ = dest_side(dst, as_rules(dst_mapping), source.keys, cache)
    t1 = time.perf_counter()
    plan = plan_transfer(source, dest, src_world, dst_world)
    t2 = time.perf_counter()
    rank_seconds = {}
    for r in dict.fromkeys((0, offset) if timed_ranks is None else timed_ranks):
        t = time.perf_counter()
        plan_transfer(source, dest, src_world, dst_world, rank=r)
        rank_seconds[r] = time.perf_counter() - t
    pairs = dict(plan.pair_bytes())
    sent, received = [0] * world, [0] * world
    for (s, d), n in pairs.items():
        sent[s] += n
        received[d] += n
    ranks = tuple(
        RankTransfer(
            rank=r,
            sent=sent[r],
            received=received[r],
            local=pairs.get((r, r), 0),
            src_shard_bytes=parts_bytes(src_world[r]),
            dst_shard_bytes=parts_bytes(dst_world[r]),
        )
        for r in range(world)
    )
    return TransferFigures(
        world=world,
        src_ranks=tuple(range(len(src_parts))),
        dst_ranks=tuple(range(offset, offset + len(dst_parts))),
        pairs=pairs,
        ranks=ranks,
        moves=len(plan.moves),
        transferred=len(plan.transferred),
        fallback=sum(len(f.targets) for f in plan.fallback),
        map_seconds=t1 - t0,
        plan_seconds=t2 - t1,
        rank_plan_seconds=rank_seconds,
        plan=plan,
    )
