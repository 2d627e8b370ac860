"""The transfer half of ``plan --transfer N``: moving the weights of the checkpoint's model, FSDP-sharded
(``Shard(0)``) over N ranks, into the mesh's sharding of the same model or of another destination
(``--transfer-to``, :class:`Destination`) (:func:`loader.transfer.simulate_transfer`): bytes per rank pair and
per rank against its shard bytes, and the plan time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from regiontrace.cli.common import CLIError, load_function

from ..placements import plan_placements
from ..simulate import PlacementsArg
from ..transfer import TransferFigures, TransferMeshes, simulate_transfer
from .common import human_bytes, table

#: the pair matrix is printed up to this many source and destination ranks (else a summary)
MATRIX_RANKS = 16


@dataclass(frozen=True)
class Destination:
    """The destination of ``plan --transfer`` when it is not the checkpoint's own model.

    Attributes:
        model: the destination model (meta is fine).
        rules: its rules from the checkpoint layout (``transfer_weights(dst_mapping=...)``).
        placements: its placements on the mesh, a mapping or a function of ``(name, shape)`` (None: its own
            TP plan, as ``plan_placements`` reads it; every tensor replicated when it has none).
    """

    model: torch.nn.Module
    rules: Any = None
    placements: PlacementsArg | None = None

    @property
    def name(self) -> str:
        return type(self.model).__name__


def load_destination(ref: str, config: Any) -> Destination:
    """``--transfer-to MODULE:FUNCTION``: ``FUNCTION(config)`` called under ``torch.device("meta")``, returning
    the model, ``(model, rules)`` or ``(model, rules, placements)``.

    Raises:
        CLIError: it returns something else.
    """
    with torch.device("meta"):
        made = load_function(ref)(config)
    parts = made if isinstance(made, tuple) else (made,)
    if not 1 <= len(parts) <= 3 or not isinstance(parts[0], torch.nn.Module):
        raise CLIError(
            f"--transfer-to {ref} returned {type(made).__name__}: return the destination model, (model, rules) or "
            "(model, rules, placements)"
        )
    return Destination(*parts)


def transfer_plan(
    model: Any,
    mesh_shape: Sequence[int],
    placements: dict,
    src_ranks: int,
    *,
    colocated: bool = False,
    dest: Destination | None = None,
) -> TransferFigures:
    """``model`` moved from ``Shard(0)`` over ``src_ranks`` ranks into ``placements`` on ``mesh_shape`` (or into
    ``dest``, by its rules, on its placements over ``mesh_shape``)."""
    from torch.distributed.tensor import Shard

    dst_model, dst_placements, rules = model, placements, None
    if dest is not None:
        dst_model, rules = dest.model, dest.rules
        dst_placements = dest.placements if dest.placements is not None else plan_placements(dest.model, mesh_shape)[0]
    return simulate_transfer(
        model,
        dst_model,
        dst_mapping=rules,
        meshes=TransferMeshes(
            src_mesh_shape=(src_ranks,),
            src_placements=lambda name, shape: [Shard(0)],
            dst_mesh_shape=tuple(mesh_shape),
            dst_placements=dst_placements,
            colocated=colocated,
        ),
    )


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else "-"


def _role(f: TransferFigures, rank: int) -> str:
    return "+".join(n for n, rs in (("src", f.src_ranks), ("dst", f.dst_ranks)) if rank in rs)


def transfer_plan_text(f: TransferFigures, into: str = "this sharding") -> str:
    """The per-rank table (sent, received, shard bytes, received/shard), the pair matrix (or its summary) and
    the plan time; ``into``: what the destination is."""
    rows = [
        [
            r.rank,
            _role(f, r.rank),
            human_bytes(r.src_shard_bytes) if r.src_shard_bytes else "-",
            human_bytes(r.dst_shard_bytes) if r.dst_shard_bytes else "-",
            human_bytes(r.sent),
            human_bytes(r.received),
            _ratio(r.received, r.dst_shard_bytes),
            human_bytes(r.local),
        ]
        for r in f.ranks
    ]
    placed = "after them" if f.dst_ranks[0] >= len(f.src_ranks) else "on the same ranks (colocated)"
    source = "the same model" if into == "this sharding" else "the checkpoint's model"
    lines = [
        f"transfer plan (transfer_weights from {source}, Shard(0) over {len(f.src_ranks)} rank(s) "
        f"{f.src_ranks[0]}–{f.src_ranks[-1]}, into {into} on ranks {f.dst_ranks[0]}–{f.dst_ranks[-1]}, "
        f"{placed}; simulated, no data):",
        table(
            ["rank", "holds", "src shard", "dst shard", "sent", "received", "received/shard", "local"],
            rows,
            right=[True, False] + [True] * 6,
        ),
        "",
        _pairs_text(f),
        "",
        f"{f.moves} strided copies, {human_bytes(f.bytes_moved)} between ranks, "
        f"{human_bytes(sum(r.local for r in f.ranks))} copied within ranks; {f.transferred} tensor(s) traced, "
        f"{f.fallback} moved whole",
        "plan time of one rank (what each computes: its own moves): "
        + ", ".join(f"{t:.3f} s (rank {r})" for r, t in f.rank_plan_seconds.items())
        + f"; of the whole world (this simulation): {f.plan_seconds:.3f} s; mapping both models to the "
        f"checkpoint layout (once, on one rank of each): {f.map_seconds:.3f} s",
    ]
    return "\n".join(lines)


def _pairs_text(f: TransferFigures) -> str:
    srcs, dsts = f.src_ranks, f.dst_ranks
    if len(srcs) <= MATRIX_RANKS and len(dsts) <= MATRIX_RANKS:
        rows = [[s, *(human_bytes(f.pairs[s, d]) if (s, d) in f.pairs else "." for d in dsts)] for s in srcs]
        return "bytes per rank pair (rows: source ranks, columns: destination ranks; '.': nothing):\n" + table(
            ["src \\ dst", *map(str, dsts)], rows
        )
    per_dst = [sum(1 for (_, d) in f.pairs if d == r) for r in dsts]
    per_src = [sum(1 for (s, _) in f.pairs if s == r) for r in srcs]
    big = max(f.pairs.values(), default=0)
    return (
        f"bytes per rank pair: {len(f.pairs)} of {len(srcs) * len(dsts)} pairs carry bytes; each destination "
        f"rank receives from {min(per_dst)}–{max(per_dst)} source rank(s), each source rank sends to "
        f"{min(per_src)}–{max(per_src)}; the largest pair {human_bytes(big)} (--json for every pair)"
    )


def transfer_plan_json(f: TransferFigures) -> dict[str, Any]:
    """The simulated transfer as JSON-ready values."""
    return {
        "world": f.world,
        "src_ranks": list(f.src_ranks),
        "dst_ranks": list(f.dst_ranks),
        "pairs": [{"src": s, "dst": d, "bytes": n} for (s, d), n in sorted(f.pairs.items())],
        "ranks": [
            {
                "rank": r.rank,
                "sent": r.sent,
                "received": r.received,
                "local": r.local,
                "src_shard_bytes": r.src_shard_bytes,
                "dst_shard_bytes": r.dst_shard_bytes,
            }
            for r in f.ranks
        ],
        "moves": f.moves,
        "transferred": f.transferred,
        "fallback": f.fallback,
        "plan_seconds": f.plan_seconds,
        "map_seconds": f.map_seconds,
    }
