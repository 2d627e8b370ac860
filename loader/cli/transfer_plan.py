"""The transfer half of ``plan --transfer N``: moving the weights of the same model, FSDP-sharded (``Shard(0)``)
over N ranks, into the mesh's sharding (:func:`loader.transfer.simulate_transfer`): bytes per rank pair and per
rank against its shard bytes, and the plan time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..transfer import TransferFigures, simulate_transfer
from .common import human_bytes, table

#: the pair matrix is printed up to this many source and destination ranks (else a summary)
MATRIX_RANKS = 16


def transfer_plan(
    model: Any, mesh_shape: Sequence[int], placements: dict, src_ranks: int, *, colocated: bool = False
) -> TransferFigures:
    """``model`` moved from ``Shard(0)`` over ``src_ranks`` ranks into ``placements`` on ``mesh_shape``."""
    from torch.distributed.tensor import Shard

    return simulate_transfer(
        model,
        model,
        src_mesh_shape=(src_ranks,),
        src_placements=lambda name, shape: [Shard(0)],
        dst_mesh_shape=tuple(mesh_shape),
        dst_placements=placements,
        colocated=colocated,
    )


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.3f}" if b else "-"


def _role(f: TransferFigures, rank: int) -> str:
    return "+".join(n for n, rs in (("src", f.src_ranks), ("dst", f.dst_ranks)) if rank in rs)


def transfer_plan_text(f: TransferFigures) -> str:
    """The per-rank table (sent, received, shard bytes, received/shard), the pair matrix (or its summary) and
    the plan time."""
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
    lines = [
        f"transfer plan (transfer_weights from the same model, Shard(0) over {len(f.src_ranks)} rank(s) "
        f"{f.src_ranks[0]}–{f.src_ranks[-1]}, into this sharding on ranks {f.dst_ranks[0]}–{f.dst_ranks[-1]}, "
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


# ---------------------------------------------------------------------------------------------------
# the picture: bytes per rank pair as a matrix, received ÷ shard per destination rank as bars

_FONT = 'font-family="Helvetica, Arial, sans-serif"'


def _shade(x: float) -> str:
    """White (0) to deep blue (1)."""
    r, g, b = (int(255 + (c - 255) * x) for c in (33, 102, 172))
    return f"#{r:02x}{g:02x}{b:02x}"


def transfer_svg(f: TransferFigures, title: str = "Transfer plan") -> str:
    """A plain SVG: one cell per (source rank, destination rank), shaded by its bytes, and one bar per
    destination rank: bytes received against its shard bytes (the tick)."""
    from xml.sax.saxutils import escape

    srcs, dsts = f.src_ranks, f.dst_ranks
    cell = max(4, min(28, 640 // max(len(srcs), len(dsts))))
    left, top = 96, 84
    width, height = max(640, left + cell * len(dsts) + 40), top + cell * len(srcs) + 150
    big = max(f.pairs.values(), default=1)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" {_FONT} font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="16" y="24" font-size="16" font-weight="bold">{escape(title)}</text>',
        f'<text x="16" y="44">{len(srcs)} source rank(s) (rows) → {len(dsts)} destination rank(s) (columns): '
        f"bytes per pair, darkest {escape(human_bytes(big))}; plan {f.plan_seconds:.3f} s</text>",
        f'<text x="16" y="{top - 8}">src \\ dst</text>',
    ]
    step = max(1, 24 // cell)
    for j, d in enumerate(dsts):
        if j % step == 0:
            out.append(f'<text x="{left + j * cell + cell / 2}" y="{top - 8}" text-anchor="middle">{d}</text>')
    for i, s in enumerate(srcs):
        y = top + i * cell
        if i % step == 0:
            out.append(f'<text x="{left - 6}" y="{y + cell / 2 + 4}" text-anchor="end">{s}</text>')
        for j, d in enumerate(dsts):
            n = f.pairs.get((s, d), 0)
            fill = _shade(n / big) if n else "#f4f4f4"
            out.append(
                f'<rect x="{left + j * cell}" y="{y}" width="{cell - 1}" height="{cell - 1}" fill="{fill}">'
                f"<title>{s} → {d}: {escape(human_bytes(n))}</title></rect>"
            )
    y0 = top + cell * len(srcs) + 24
    out.append(f'<text x="16" y="{y0 + 12}">received ÷ shard (tick: 1.0)</text>')
    most = max([r.received / r.dst_shard_bytes for r in f.ranks if r.dst_shard_bytes] + [1.0])
    for j, d in enumerate(dsts):
        r = f.ranks[d]
        ratio = r.received / r.dst_shard_bytes if r.dst_shard_bytes else 0.0
        h = 90 * ratio / most
        x, base = left + j * cell, y0 + 110
        out.append(
            f'<rect x="{x}" y="{base - h}" width="{cell - 1}" height="{h}" fill="{_shade(0.8)}">'
            f"<title>rank {d}: received {escape(human_bytes(r.received))} of a "
            f"{escape(human_bytes(r.dst_shard_bytes))} shard ({ratio:.3f})</title></rect>"
        )
        tick = base - 90 / most
        out.append(f'<line x1="{x}" x2="{x + cell - 1}" y1="{tick}" y2="{tick}" stroke="black"/>')
    out.append("</svg>")
    return "\n".join(out)
