"""``save_hf_checkpoint``: write a (DTensor-sharded) model as a Hugging Face checkpoint in its original layout,
each rank writing only the byte ranges its local shards map to.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

import regiontrace as rt

from .._torch import root_mesh
from ..distributed.collectives import global_rank, group_rank_and_world
from ..execute import Rollback
from ..options import Rules, SaveOptions, timeout_seconds
from ..placements import slot_for
from ..report import human_bytes
from ..rules import dot_natural_key
from ..storage import is_url
from .agreement import RankAgreement
from .filelayout import SaveLayout, parse_size, plan_layout
from .sources import SaveMapping, SourceShapes, map_for_save
from .write import BlockWriter, commit, create_files, make_temp_folder, remove_folder, write_extras

log = logging.getLogger("loader")

Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True, repr=False)
class SaveReport:
    """What one rank's :func:`save_hf_checkpoint` did; ``str()`` and ``repr()`` are a one-line summary (counts,
    bytes, seconds), the fields hold the full key tuples.

    Attributes:
        path: the checkpoint folder.
        files: the safetensors files, in shard order.
        keys: every checkpoint key saved (all ranks together), natural-sorted.
        total_size: the index's ``metadata.total_size`` (the checkpoint's tensor bytes).
        bytes_written: tensor data bytes this rank wrote.
        header_bytes: header bytes this rank wrote (rank 0 only).
        writes: positional writes this rank made.
        written: model tensors this rank wrote (its shards of them), natural-sorted.
        derived_by: how the checkpoint keys were found: ``"revert_weight_conversion"``, ``"renames"`` or
            ``"source_shapes"``.
        rank: this rank. world: the number of ranks.
        seconds: wall time of the save on this rank.
    """

    path: str
    files: tuple[str, ...]
    keys: tuple[str, ...]
    total_size: int
    bytes_written: int
    header_bytes: int
    writes: int
    written: tuple[str, ...]
    derived_by: str
    rank: int
    world: int
    seconds: float = field(default=0.0, compare=False)  # timing: not part of what the save did

    def __str__(self) -> str:
        return (
            f"SaveReport({self.path!r}, rank {self.rank} of {self.world}: {len(self.keys)} keys in "
            f"{len(self.files)} files, {human_bytes(self.total_size)}; this rank wrote {len(self.written)} tensors, "
            f"{human_bytes(self.bytes_written)} in {self.writes} writes, {self.seconds:.2f} s)"
        )

    __repr__ = __str__


@dataclass(frozen=True)
class RankWrites:
    """What one rank writes: ``(block, values)`` pairs (the box's values, run backwards through the block)."""

    items: tuple[tuple[rt.RemapBlock, torch.Tensor], ...]
    written: tuple[str, ...]
    nbytes: int


def save_hf_checkpoint(
    model: torch.nn.Module,
    path: str,
    *,
    rules: Rules | None = None,
    options: SaveOptions | None = None,
    source_shapes: SourceShapes | str | os.PathLike | None = None,
    group: Any = None,
) -> SaveReport:
    """Save ``model`` as a Hugging Face safetensors checkpoint in the original layout, as ``save_pretrained`` does.

    Under ``torch.distributed`` every rank calls it with its (DTensor-sharded) model; each writes only the byte
    ranges its local shards map to (a tensor held by several ranks is written by the lowest of them). The
    files appear at ``path`` only once every rank has written its part.

    Args:
        model: the model (plain or DTensor tensors, materialised).
        path: the checkpoint folder (created; an existing one gets its weight files and index replaced).
        rules: the rules, as for ``load_hf_checkpoint`` (:class:`~loader.options.Rules`); None: the default (for
            a transformers ``PreTrainedModel``, transformers' conversion mapping).
        options: how the save runs and writes (:class:`~loader.options.SaveOptions`: file size, metadata,
            progress, timeout); None: the defaults.
        source_shapes: the checkpoint keys with their shapes (or ``(shape, dtype)``), or a checkpoint (a path or
            a :class:`~loader.checkpoint.Checkpoint`) to take keys, shapes and dtypes from: needed when they cannot
            be found from the model and the rules alone (a ``Convert`` rule).
        group: in a distributed run, the process group of the save (None: the default group): its ranks save the
            model together, its rank 0 writing the plain tensors and committing.

    Returns:
        A :class:`SaveReport` for this rank.

    Raises:
        ValueError: ``path`` is a URL (saving to object stores is out of scope); the layout cannot be derived, a
            conversion is not invertible, ``options.max_shard_size`` is not a size, a tensor's checkpoint key is
            ``__metadata__``, a tensor is a contiguous conj / neg view (its memory is not its values), or ranks
            hold a tensor differently (placements, kind, global shape, dtype, mesh): nothing is written.
        PeerFailure: in a distributed run, another rank hung past ``options.timeout``, died or left.
        OSError, RuntimeError: a write failed (on any rank, in a distributed run); ``path`` is left as it was
            (no folder, or the old checkpoint, whole).
        TimeoutError: another save into ``path`` was committing for more than ``options.timeout``.
    """
    started = time.perf_counter()
    if is_url(path):  # before anything is planned or written, on every rank
        raise ValueError(
            f"save_hf_checkpoint: {path!r} is a URL; saving to an object store or the Hub is not supported: save to a "
            "local folder, then upload it (e.g. `aws s3 sync`, `hf upload`)"
        )
    options = options if options is not None else SaveOptions()
    options = replace(options, metadata={"format": "pt", **(options.metadata or {})})
    rules = rules if rules is not None else Rules()
    rank, world = group_rank_and_world(group)
    if world > 1:
        return _save_distributed(model, path, rules, source_shapes, options, group)
    mapping, layout, writes = _prepare(model, rules, source_shapes, options, (rank, world, 0))
    with Rollback() as rollback:
        folder = make_temp_folder(path)
        rollback.add(lambda: remove_folder(folder))
        header = create_files(folder, layout)
        writer = _write(folder, layout, writes, options.progress)
        write_extras(folder, layout, model, _total_parameters(model))
        commit(folder, path, layout, timeout_seconds(options.timeout))
    return _report(path, mapping, layout, writer, header, writes, rank, world, started)


def plan_rank_writes(mapping: SaveMapping, rank: int, world: int, lead: int = 0) -> RankWrites:
    """What this rank writes: for every model tensor, its local shard's boxes when this rank is the lowest
    rank holding that shard (plain tensors: ``lead``, the rank 0 of the save's group), each box's inverse blocks;
    ranks are the world's, ``world`` the group's size.

    Raises:
        ValueError: a model tensor this rank writes is on the meta device, or is ``Partial``.
    """

    def local_shard(target: str, tensor: torch.Tensor) -> tuple[tuple[tuple[Box, Box], ...], torch.Tensor] | None:
        if _writer(tensor, rank, world, lead) != rank:
            return None
        slot = slot_for(target, tensor)
        if slot.local is not None and slot.local.device.type == "meta" and slot.boxes:
            raise ValueError(f"model tensor {target!r} is on the meta device: it has no values to save")
        return slot.boxes, slot.local

    return collect_writes(mapping, local_shard)


def collect_writes(
    mapping: SaveMapping,
    local_shard: Callable[[str, torch.Tensor], tuple[tuple[tuple[Box, Box], ...], torch.Tensor] | None],
) -> RankWrites:
    """What a rank writes, given ``local_shard(name, model tensor)``: the ``(global box, local box)`` pairs
    and the local tensor of each model tensor this rank writes (None: another rank writes it)."""
    items, written, nbytes = [], [], 0
    for saved in mapping.conversions:
        for target in saved.targets:
            shard = local_shard(target, mapping.tensors[target])
            if shard is None:
                continue
            boxes, local = shard
            local = _with_values_in_memory(target, local)
            for global_box, local_box in boxes:
                if any(b <= a for a, b in global_box):
                    continue
                values = _box_view(local, local_box)
                for block in mapping.blocks(saved, target, global_box):
                    items.append((block, values))
                    nbytes += block.numel * block.source_dtype.itemsize
            if boxes:
                written.append(target)
    return RankWrites(tuple(items), tuple(sorted(written, key=dot_natural_key)), nbytes)


# ---------------------------------------------------------------------------------------------------


def _prepare(
    model: torch.nn.Module, rules: Rules, source_shapes: Any, options: SaveOptions, ranks: tuple[int, int, int]
) -> tuple[SaveMapping, SaveLayout, RankWrites]:
    """``ranks``: this rank (the world's), the group's size and the world's rank of its rank 0."""
    max_shard_size = parse_size(options.max_shard_size)  # a bad one is refused first: nothing planned or created
    mapping = map_for_save(model, rules, source_shapes=source_shapes)
    layout = plan_layout(mapping.specs, max_shard_size=max_shard_size, metadata=options.metadata)
    return mapping, layout, plan_rank_writes(mapping, *ranks)


def _write(folder: str, layout: SaveLayout, writes: RankWrites, progress: bool | None) -> BlockWriter:
    bar = _progress_bar(progress, writes.nbytes)
    try:
        with BlockWriter(folder, layout, on_write=bar.update if bar else None) as writer:
            with torch.no_grad():
                for block, values in writes.items:
                    writer.write_block(block, values)
    finally:
        if bar:
            bar.close()
    return writer


def _save_distributed(
    model: torch.nn.Module, path: str, rules: Rules, source_shapes: Any, options: SaveOptions, group: Any = None
) -> SaveReport:
    """Plan on every rank of ``group``; its rank 0 creates the files; every rank writes its shards; rank 0 commits.
    Each is a stage of the save's session: a failure or a hang anywhere fails every rank, and the save's rollback
    removes the unfinished folder."""
    from ..distributed import Session

    started = time.perf_counter()
    folder = header = writer = None
    with Session(options.timeout, group) as session, Rollback() as rollback:
        rank, world, store = session.rank, session.world, session.store
        with session.stage("preparing"):
            me, lead = global_rank(group, rank), global_rank(group, 0)
            mapping, layout, writes = _prepare(model, rules, source_shapes, options, (me, world, lead))
            agreement = RankAgreement(mapping.tensors, layout)
            agreement.publish(store, rank)
            if rank == 0:
                folder = make_temp_folder(path)
                remove = rollback.add(lambda: remove_folder(folder))
                header = create_files(folder, layout)
                store.set("save/folder", folder)
        with session.stage("writing"):
            folder = folder if rank == 0 else store.get("save/folder").decode()
            if agreement.check(store, rank, world):  # else another rank raises: write nothing
                writer = _write(folder, layout, writes, options.progress)
        with session.stage("finishing"):
            if rank == 0:
                write_extras(folder, layout, model, _total_parameters(model))
                commit(folder, path, layout, timeout_seconds(options.timeout))
                rollback.drop(remove)  # committed: the folder is the checkpoint
    return _report(path, mapping, layout, writer, header or 0, writes, rank, world, started)


def _writer(tensor: torch.Tensor, rank: int, world: int, lead: int = 0) -> int | None:
    """The rank that writes ``tensor``'s shard held here: the lowest rank holding the same shard (None: none; a
    plain tensor: ``lead``)."""
    data = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
    if world == 1 or not hasattr(data, "device_mesh"):
        return lead
    from torch.distributed.tensor import Replicate

    mesh = data.device_mesh
    if mesh.get_coordinate() is None:
        return None
    root, placements = _on_root(mesh, tuple(data.placements))
    coord = root.get_coordinate()
    index = tuple(slice(None) if isinstance(p, Replicate) else c for p, c in zip(placements, coord))
    return int(root.mesh[index].min())


def writer_coordinate(placements: Sequence[Any], coord: Sequence[int]) -> tuple[int, ...]:
    """The coordinate of the lowest rank holding the shard at ``coord`` of a row-major ``0 … n-1`` mesh: 0 on
    every ``Replicate`` mesh dim (as :func:`_writer` picks on a real mesh)."""
    from torch.distributed.tensor import Replicate

    return tuple(0 if isinstance(p, Replicate) else int(c) for p, c in zip(placements, coord))


def _on_root(mesh: Any, placements: tuple) -> tuple[Any, tuple]:
    """The placements over the root mesh (``Replicate`` on the dims the submesh lacks: the replicas there hold the
    same shard); the mesh itself when its dims cannot be named on the root."""
    from torch.distributed.tensor import Replicate

    root = root_mesh(mesh)
    if root is mesh:
        return mesh, placements
    names, root_names = mesh.mesh_dim_names, root.mesh_dim_names
    if not names or not root_names or any(n not in root_names for n in names):
        return mesh, placements
    out: list[Any] = [Replicate()] * root.ndim
    for name, p in zip(names, placements):
        out[root_names.index(name)] = p
    return root, tuple(out)


def _with_values_in_memory(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a copy with its conjugate or negative bit resolved where ``save_pretrained`` writes the
    resolved values (a non-contiguous view: its ``.contiguous()`` copy resolves them).

    Raises:
        ValueError: a contiguous tensor with the conjugate or negative bit: ``save_pretrained`` (safetensors) would
            write its memory, which holds other values than the tensor (the unconjugated or unnegated ones).
    """
    if not (t.is_conj() or t.is_neg()):
        return t
    if t.is_contiguous():
        bit, fix = ("conjugate", "resolve_conj") if t.is_conj() else ("negative", "resolve_neg")
        raise ValueError(
            f"model tensor {name!r} has its {bit} bit set (a lazy view): its memory holds other values than the "
            f"tensor, and save_pretrained would write that memory; resolve it first (param.data = "
            f"param.data.{fix}()) to save its values"
        )
    return t.resolve_conj().resolve_neg()


def _box_view(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (a, b) in enumerate(box):
        if a != 0 or b != t.shape[d]:
            t = t.narrow(d, a, b - a)
    return t.detach()


def _total_parameters(model: torch.nn.Module) -> int:
    counter = getattr(model, "num_parameters", None)
    if callable(counter):
        return int(counter())
    return sum(math.prod(p.shape) for p in model.parameters())


def _progress_bar(enabled: bool | None, total: int):
    if enabled is False or (enabled is None and not sys.stderr.isatty()):
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc="saving", leave=False)


def _report(path, mapping, layout, writer, header, writes, rank, world, started) -> SaveReport:
    report = SaveReport(
        path=os.fspath(path),
        files=tuple(f.name for f in layout.files),
        keys=tuple(sorted(layout.tensors, key=dot_natural_key)),
        total_size=layout.total_size,
        bytes_written=writer.bytes_written if writer else 0,
        header_bytes=header or 0,
        writes=writer.writes if writer else 0,
        written=writes.written,
        derived_by=mapping.derived_by,
        rank=rank,
        world=world,
        seconds=time.perf_counter() - started,
    )
    log.info("rank %d: wrote %d of %d checkpoint bytes to %s", rank, report.bytes_written, layout.data_bytes, path)
    return report
