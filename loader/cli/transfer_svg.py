"""The picture of ``plan --transfer N --transfer-svg FILE``: the bytes per (source rank, destination rank) pair as
a matrix, each cell shaded by its bytes and labelled with them (human-readable), and one bar per destination
rank, labelled with the rank, for what it receives against its shard bytes (the tick: each element once)."""

from __future__ import annotations

from xml.sax.saxutils import escape

from ..transfer import TransferFigures
from .canvas import svg_text
from .common import human_bytes

_FONT = 'font-family="Helvetica, Arial, sans-serif"'
#: cells are labelled with their bytes up to this many ranks a side (beyond: too small to read; hover)
LABELLED_RANKS = 16
BAR_HEIGHT = 90


def _shade(x: float) -> str:
    """White (0) to deep blue (1)."""
    r, g, b = (int(255 + (c - 255) * x) for c in (33, 102, 172))
    return f"#{r:02x}{g:02x}{b:02x}"


def transfer_svg(f: TransferFigures, title: str = "Transfer plan") -> str:
    """A plain SVG of ``f``: the pair matrix (cells labelled with their bytes up to :data:`LABELLED_RANKS` ranks a
    side) and the bars of received ÷ shard bytes per destination rank, each under its rank number."""
    srcs, dsts = f.src_ranks, f.dst_ranks
    labelled = len(srcs) <= LABELLED_RANKS and len(dsts) <= LABELLED_RANKS
    cw = 60 if labelled else max(4, min(28, 640 // max(len(srcs), len(dsts))))  # cell width
    ch = 22 if labelled else cw
    left, top = 96, 84
    width = max(640, left + cw * len(dsts) + 40)
    y0 = top + ch * len(srcs) + 24  # the bars' caption
    height = y0 + BAR_HEIGHT + 64
    big = max(f.pairs.values(), default=1)
    hover = "" if labelled else " (hover a cell for its bytes)"
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" {_FONT} font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        svg_text(16, 24, title, size=16, weight="bold"),
        svg_text(
            16,
            44,
            f"{len(srcs)} source rank(s) (rows) → {len(dsts)} destination rank(s) (columns): bytes per pair, darkest "
            f"{human_bytes(big)}{hover}; plan {f.plan_seconds:.3f} s",
            size=11,
        ),
        svg_text(16, top - 8, "src \\ dst", size=11),
    ]
    step = max(1, 24 // cw)
    for j, d in enumerate(dsts):
        if j % step == 0:
            out.append(svg_text(left + j * cw + cw / 2, top - 8, str(d), size=11, anchor="middle"))
    for i, s in enumerate(srcs):
        y = top + i * ch
        if i % step == 0:
            out.append(svg_text(left - 6, y + ch / 2 + 4, str(s), size=11, anchor="end"))
        for j, d in enumerate(dsts):
            out += _cell(f.pairs.get((s, d), 0), big, s, d, left + j * cw, y, cw, ch, labelled)
    out += _bars(f, left, y0, cw, labelled)
    out.append("</svg>")
    return "\n".join(out)


def _cell(n: int, big: int, s: int, d: int, x: float, y: float, w: float, h: float, labelled: bool) -> list[str]:
    """One pair's cell: shaded by ``n`` bytes of ``big``, its bytes written inside when ``labelled``."""
    shade = n / big if n else 0.0
    fill = _shade(shade) if n else "#f4f4f4"
    out = [
        f'<rect x="{x}" y="{y}" width="{w - 1}" height="{h - 1}" fill="{fill}">'
        f"<title>{s} → {d}: {escape(human_bytes(n))}</title></rect>"
    ]
    if labelled:
        ink = "white" if shade > 0.55 else "#212529"
        label = human_bytes(n) if n else "·"
        out.append(svg_text(x + (w - 1) / 2, y + h / 2 + 3, label, size=9, fill=ink, anchor="middle"))
    return out


def _bars(f: TransferFigures, left: float, y0: float, cw: float, labelled: bool) -> list[str]:
    """One bar per destination rank: received ÷ its shard bytes, the tick at 1.0, the rank under it (and the
    ratio above it when ``labelled``)."""
    out = [svg_text(16, y0 + 12, "received ÷ shard per destination rank (tick: 1.0, each element once)", size=11)]
    most = max([r.received / r.dst_shard_bytes for r in f.ranks if r.dst_shard_bytes] + [1.0])
    base = y0 + 24 + BAR_HEIGHT
    step = max(1, 24 // int(cw))
    for j, d in enumerate(f.dst_ranks):
        r = f.ranks[d]
        ratio = r.received / r.dst_shard_bytes if r.dst_shard_bytes else 0.0
        h = BAR_HEIGHT * ratio / most
        x = left + j * cw
        out.append(
            f'<rect x="{x}" y="{base - h}" width="{cw - 1}" height="{h}" fill="{_shade(0.8)}">'
            f"<title>rank {d}: received {escape(human_bytes(r.received))} of a "
            f"{escape(human_bytes(r.dst_shard_bytes))} shard ({ratio:.3f})</title></rect>"
        )
        tick = base - BAR_HEIGHT / most
        out.append(f'<line x1="{x}" x2="{x + cw - 1}" y1="{tick}" y2="{tick}" stroke="black"/>')
        if labelled:
            out.append(svg_text(x + (cw - 1) / 2, base - h - 4, f"{ratio:.3f}", size=9, anchor="middle"))
        if j % step == 0:
            name = f"rank {d}" if labelled else str(d)
            out.append(svg_text(x + (cw - 1) / 2, base + 14, name, size=10, anchor="middle"))
    return out
