"""The write plan of any rank of a mesh, computed in one process without a process group or any data.

As :func:`loader.simulate.simulate_load` does for loads: the model may live on the meta device, its placements
come from its DTensors or an explicit mapping, and each rank's local shard boxes are DTensor's own arithmetic.
The writes come from the save's own code (:func:`~loader.save.api.collect_writes` and a
:class:`~loader.save.write.BlockWriter` that counts its writes instead of making them), so the figures are the
ones a real ``save_hf_checkpoint`` on that rank reports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..options import Rules, SaveOptions
from .api import Box, collect_writes, writer_coordinate
from .filelayout import SaveLayout, plan_layout
from .sources import SaveMapping, SourceShapes, map_for_save
from .write import BlockWriter

if TYPE_CHECKING:
    from ..simulate import MeshPlacements

Placements = Mapping[str, Sequence[Any]] | Callable[[str, tuple[int, ...]], Sequence[Any]]


@dataclass(frozen=True)
class WriteFigures:
    """The write plan of one rank.

    Attributes:
        rank: global rank; coordinate: its mesh coordinate.
        bytes_written: tensor data bytes it writes (what ``SaveReport.bytes_written`` will say).
        shard_bytes: bytes of the local shards it is the lowest holder of, in checkpoint dtype (what it must
            write: a replicated shard is written once, by the lowest rank holding it).
        local_bytes: bytes of all its local shards, in checkpoint dtype.
        writes: positional writes (``SaveReport.writes``; coalesced runs of file bytes).
        files: the checkpoint files it writes into, in shard order.
        tensors: model tensors it writes (its shards of them).
    """

    rank: int
    coordinate: tuple[int, ...]
    bytes_written: int
    shard_bytes: int
    local_bytes: int
    writes: int
    files: tuple[str, ...]
    tensors: int


def plan_writes(
    model: torch.nn.Module,
    *,
    mesh_shape: Sequence[int] | None = None,
    placements: Placements | None = None,
    ranks: Sequence[int] | None = None,
    rules: Rules | None = None,
    options: SaveOptions | None = None,
    source_shapes: SourceShapes | str | None = None,
) -> list[WriteFigures]:
    """The write plan of ranks of a mesh, as ``save_hf_checkpoint`` would run it on each (nothing is written).

    Args:
        model: the model (any device, meta included; plain tensors or DTensors).
        mesh_shape: the mesh (default: the model's DTensors' mesh, else one rank).
        placements: per model tensor name, placements over the mesh (a mapping or a function of name and
            shape); names absent are replicated. Default: the model's DTensor placements.
        ranks: ranks to plan (default: all).
        rules, options, source_shapes: as for ``save_hf_checkpoint`` (of the options, ``max_shard_size``).

    Returns:
        One :class:`WriteFigures` per rank.

    Raises:
        ValueError: the layout cannot be derived or a conversion is not invertible (as the save would).
    """
    from ..simulate import coordinate_of, mesh_placements

    mesh = mesh_placements(model, mesh_shape, placements)
    mapping = map_for_save(model, rules, source_shapes=source_shapes)
    max_shard_size = (options or SaveOptions()).max_shard_size
    layout = plan_layout(mapping.specs, max_shard_size=max_shard_size, metadata={"format": "pt"})
    out = []
    for rank in ranks if ranks is not None else range(mesh.world):
        coord = coordinate_of(rank, mesh.mesh_shape)
        out.append(_rank_figures(mapping, layout, mesh, rank, coord))
    return out


def _rank_figures(
    mapping: SaveMapping,
    layout: SaveLayout,
    mesh: MeshPlacements,
    rank: int,
    coord: tuple[int, ...],
) -> WriteFigures:
    itemsize = _checkpoint_itemsizes(mapping)
    local_bytes = shard_bytes = 0

    def local_shard(name: str, tensor: torch.Tensor) -> tuple[tuple[tuple[Box, Box], ...], torch.Tensor] | None:
        nonlocal local_bytes, shard_bytes
        shape = tuple(tensor.shape)
        pl = tuple(mesh.of(name, shape) or ())
        boxes = mesh.boxes(shape, coord, pl)
        writer = writer_coordinate(pl, coord) if pl else tuple(0 for _ in coord)
        numel = sum(math.prod(b - a for a, b in g) for g, _ in boxes)
        local_bytes += numel * itemsize[name]
        if writer != coord:
            return None
        shard_bytes += numel * itemsize[name]
        local_shape = [max((lb[d][1] for _, lb in boxes), default=0) for d in range(len(shape))]
        return boxes, torch.empty(local_shape, dtype=tensor.dtype, device="meta")

    writes = collect_writes(mapping, local_shard)
    counter = BlockWriter(None, layout)
    for block, values in writes.items:
        counter.write_block(block, values)
    order = [f.name for f in layout.files]
    return WriteFigures(
        rank=rank,
        coordinate=coord,
        bytes_written=counter.bytes_written,
        shard_bytes=shard_bytes,
        local_bytes=local_bytes,
        writes=counter.writes,
        files=tuple(sorted(counter.files, key=order.index)),
        tensors=len(writes.written),
    )


def _checkpoint_itemsizes(mapping: SaveMapping) -> dict[str, int]:
    """Each model tensor's checkpoint itemsize (the widest of its conversion's checkpoint tensors)."""
    dtypes = {spec.key: spec.dtype for spec in mapping.specs}
    out = {}
    for saved in mapping.conversions:
        size = max(dtypes[k].itemsize for k in saved.sources)
        out.update(dict.fromkeys(saved.targets, size))
    return out
