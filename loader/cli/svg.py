"""The plan picture as a plain SVG string (no dependencies).

Top: one bar per rank — bytes it reads (its colour) against what reading every touched checkpoint tensor
whole would cost (grey), with a tick at the bytes of its own shards. Below, one row per model tensor (tensors
with an identical plan share a row): the tensor split by owning rank, and each checkpoint tensor it is loaded
from with the boxes every rank reads. Boxes several ranks share are striped in their colours; tensors of
3 or more dims are drawn as slabs of their last two dims (e.g. one panel per expert).
"""

from __future__ import annotations

from collections.abc import Sequence

from .canvas import Canvas, draw, frame, shorten, svg_text
from .common import human_bytes
from .geometry import PlanView, SourceView, TensorView

WIDTH = 1280
MARGIN = 24
TEXT_W = 300
TARGET_X = MARGIN + TEXT_W + 12
TARGET_W, TARGET_H = 220, 110
SOURCES_X = TARGET_X + TARGET_W + 56
CELL_W, CELL_H = 112, 84
CELL_LABEL = 28
MAX_SOURCES = 10
FONT = 'font-family="Helvetica, Arial, sans-serif"'


# ---------------------------------------------------------------------------------------------------
# rows


def _signature(v: TensorView) -> tuple:
    def rects(d: dict) -> tuple:
        return tuple(sorted((r, tuple(x)) for r, x in d.items()))

    return (
        v.shape,
        v.placement,
        v.deferred,
        rects(v.owners),
        tuple((s.shape, s.whole, rects(s.reads)) for s in v.sources),
    )


def _group(views: Sequence[TensorView]) -> list[list[TensorView]]:
    groups: dict[tuple, list[TensorView]] = {}
    for v in views:
        groups.setdefault(_signature(v), []).append(v)
    return list(groups.values())


def _distinct_parts(names: Sequence[str]) -> list[str]:
    """The dotted components that differ between names (``q_proj``, ``k_proj`` …)."""
    parts = [n.split(".") for n in names]
    pre = 0
    while all(len(p) > pre + 1 for p in parts) and len({p[pre] for p in parts}) == 1:
        pre += 1
    post = 0
    while all(len(p) > pre + post + 1 for p in parts) and len({p[-1 - post] for p in parts}) == 1:
        post += 1
    return [".".join(p[pre : len(p) - post]) for p in parts]


def _source_labels(view: TensorView) -> list[str]:
    names = [s.name for s in view.sources]
    if len(names) == 1:
        return [".".join(names[0].split(".")[-2:])]
    parts = [n.split(".") for n in names]
    pre = 0
    while all(len(p) > pre + 2 for p in parts) and len({p[pre] for p in parts}) == 1:
        pre += 1
    return [".".join(p[pre:]) for p in parts]


def _chips(cv: Canvas, x: float, y: float, per_rank: dict[int, int], order: Sequence[int], width: float) -> float:
    """``r0 1.5 KiB  r1 1.5 KiB ...`` in rank colours, wrapping; returns the y after the last line."""
    cx = x
    for r in order:
        if r not in per_rank:
            continue
        text = f"r{r} {human_bytes(per_rank[r])}"
        w = 6.2 * len(text) + 22
        if cx + w > x + width and cx > x:
            cx, y = x, y + 15
        cv.add(f'<rect x="{cx:.1f}" y="{y - 9:.1f}" width="10" height="10" rx="2" fill="{cv.colour(r)}"/>')
        cv.add(svg_text(cx + 13, y, text, 11, "#343a40"))
        cx += w
    return y + 15


def _tensor_row(cv: Canvas, group: list[TensorView], y: float, order: Sequence[int]) -> float:
    """Draw one row (a model tensor, or several with the same plan) at ``y``; returns its height."""
    view = group[0]
    shape_text = "×".join(map(str, view.shape)) or "scalar"
    cv.add(svg_text(MARGIN, y + 14, shorten(view.name, 44), 13, weight="bold", title=view.name))
    ty = y + 14
    if len(group) > 1:
        others = _distinct_parts([v.name for v in group])
        ty += 16
        cv.add(
            svg_text(
                MARGIN,
                ty,
                shorten("same plan: " + ", ".join(others[1:]), 48),
                12,
                "#1c7ed6",
                title="\n".join(v.name for v in group[1:]),
            )
        )
    cv.add(svg_text(MARGIN, ty + 17, f"{shape_text}  {view.dtype}", 12, "#495057"))
    cv.add(svg_text(MARGIN, ty + 33, f"placement {view.placement}", 12, "#495057"))
    ty += 38
    if view.deferred:
        text = f"deferred: {view.deferred.removeprefix('Untraceable: ')}"
        cv.add(
            svg_text(MARGIN, ty + 13, text if len(text) <= 50 else text[:49] + "…", 11, "#c92a2a", title=view.deferred)
        )
        ty += 16
    per_rank: dict[int, int] = {}
    for s in view.sources:
        for r, b in s.read_bytes.items():
            per_rank[r] = per_rank.get(r, 0) + b
    cv.add(
        svg_text(MARGIN, ty + 15, "checkpoint bytes read" + (" (each)" if len(group) > 1 else "") + ":", 11, "#868e96")
    )
    text_bottom = _chips(cv, MARGIN, ty + 31, per_rank, order, TEXT_W - 10)

    fr = frame(view.shape, TARGET_W, TARGET_H)
    draw(cv, TARGET_X, y + 6, fr, view.owners, order, f"{view.name} {shape_text}: parts by owning rank")
    dims = "dim 0" if len(view.shape) == 3 else f"dims 0-{len(view.shape) - 3}"
    slabs = f"; a panel per index of {dims}" if fr.slabs > 1 else ""
    cv.add(svg_text(TARGET_X, y + fr.h + 20, f"model tensor by owner{slabs}", 10, "#868e96"))

    shown = view.sources[:MAX_SOURCES]
    labels = _source_labels(view)
    per_row = max(int((WIDTH - MARGIN - SOURCES_X) // CELL_W), 1)
    arrow_y = y + 6 + fr.h / 2
    cv.add(
        f'<line x1="{SOURCES_X - 10}" y1="{arrow_y:.1f}" x2="{TARGET_X + fr.w + 8:.1f}" y2="{arrow_y:.1f}" '
        f'stroke="#adb5bd" stroke-width="2" marker-end="url(#arrow)"/>'
    )
    row_h = 0.0
    frames = [frame(s.shape, CELL_W - 16, CELL_H, fr, view.shape) for s in shown]
    line_h = max((f.h for f in frames), default=0) + CELL_LABEL + 8
    for i, (s, label, sf) in enumerate(zip(shown, labels, frames)):
        cx = SOURCES_X + (i % per_row) * CELL_W
        cy = y + 6 + (i // per_row) * line_h
        tip = f"{s.name} {'×'.join(map(str, s.shape))} {s.dtype}, {human_bytes(s.nbytes)}; read by " + ", ".join(
            f"rank {r} {human_bytes(b)}" for r, b in sorted(s.read_bytes.items())
        )
        draw(cv, cx, cy, sf, s.reads, order, tip)
        cv.add(svg_text(cx, cy + sf.h + 12, shorten(label, 20), 10, "#343a40", title=s.name))
        cv.add(svg_text(cx, cy + sf.h + 24, _source_note(s), 10, "#868e96"))
        row_h = (i // per_row + 1) * line_h
    if len(view.sources) > MAX_SOURCES:
        cv.add(
            svg_text(
                SOURCES_X,
                y + 6 + row_h + 6,
                f"… and {len(view.sources) - MAX_SOURCES} more checkpoint tensors, read the same way",
                11,
                "#868e96",
            )
        )
        row_h += 20
    return max(text_bottom - y, fr.h + 30, row_h) + 16


def _source_note(s: SourceView) -> str:
    total = sum(s.read_bytes.values())
    if s.whole:
        return f"{human_bytes(s.nbytes)}, read whole"
    times = total / max(s.nbytes, 1)
    return f"{human_bytes(s.nbytes)}, read {times:.2g}×" if times != 1 else f"{human_bytes(s.nbytes)}, read once"


def _rank_bars(cv: Canvas, view: PlanView, y: float) -> float:
    figures = [f for f in view.figures if f.rank in view.ranks]
    if not figures:
        return y
    top = max(max(f.whole_tensor_bytes, f.bytes_read) for f in figures) or 1
    bar_x, bar_w = MARGIN + 150, 480
    cv.add(svg_text(MARGIN, y, "checkpoint bytes each rank reads", 13, weight="bold"))
    lx = bar_x + bar_w + 16
    cv.add(f'<rect x="{lx}" y="{y - 10}" width="16" height="10" fill="#868e96"/>')
    cv.add(svg_text(lx + 20, y, "reads", 11, "#495057"))
    cv.add(f'<line x1="{lx + 62}" y1="{y - 12}" x2="{lx + 62}" y2="{y + 1}" stroke="#212529" stroke-width="1.5"/>')
    cv.add(svg_text(lx + 68, y, "its own shards", 11, "#495057"))
    cv.add(f'<rect x="{lx + 150}" y="{y - 10}" width="16" height="10" fill="#dee2e6"/>')
    cv.add(svg_text(lx + 170, y, "reading each touched tensor whole", 11, "#495057"))
    y += 10
    for f in figures:
        colour = cv.colour(f.rank)
        coord = ",".join(map(str, f.coordinate))
        cv.add(f'<rect x="{MARGIN}" y="{y + 3}" width="12" height="12" rx="2" fill="{colour}"/>')
        cv.add(svg_text(MARGIN + 18, y + 13, f"rank {f.rank}  ({coord})", 12))
        ww, rw, sw = (v / top * bar_w for v in (f.whole_tensor_bytes, f.bytes_read, f.shard_bytes))
        cv.add(f'<rect x="{bar_x}" y="{y + 2}" width="{max(ww, 1):.1f}" height="14" fill="#dee2e6"/>')
        cv.add(f'<rect x="{bar_x}" y="{y + 2}" width="{max(rw, 1):.1f}" height="14" fill="{colour}"/>')
        cv.add(
            f'<line x1="{bar_x + sw:.1f}" y1="{y}" x2="{bar_x + sw:.1f}" y2="{y + 18}" stroke="#212529" '
            f'stroke-width="1.5"/>'
        )
        cv.add(
            svg_text(
                lx,
                y + 13,
                f"{human_bytes(f.bytes_read)}  ·  shards {human_bytes(f.shard_bytes)}  ·  whole "
                f"{human_bytes(f.whole_tensor_bytes)}   ({f.blocks} blocks)",
                11,
                "#343a40",
            )
        )
        y += 21
    return y + 8


def render(view: PlanView) -> str:
    """The SVG document for a :class:`~regiontrace.cli.geometry.PlanView`."""
    cv = Canvas(view.ranks)
    y = MARGIN + 8
    cv.add(svg_text(MARGIN, y + 12, view.title, 20, weight="bold"))
    cv.add(svg_text(MARGIN, y + 34, view.subtitle, 12, "#495057"))
    y += 62
    y = _rank_bars(cv, view, y)
    cv.add(f'<line x1="{MARGIN}" y1="{y}" x2="{WIDTH - MARGIN}" y2="{y}" stroke="#dee2e6"/>')
    y += 22
    cv.add(svg_text(TARGET_X, y, "model tensor, split by rank", 12, "#495057", "bold"))
    cv.add(svg_text(SOURCES_X, y, "← checkpoint tensors: the boxes each rank reads", 12, "#495057", "bold"))
    cv.add(svg_text(WIDTH - MARGIN, y, "stripes: several ranks · grey: nobody", 11, "#868e96", anchor="end"))
    y += 14
    replicated = [t for t in view.tensors if t.replicated and len(t.shape) <= 1]
    for group in _group([t for t in view.tensors if t not in replicated]):
        y += _tensor_row(cv, group, y, view.ranks)
        cv.add(f'<line x1="{MARGIN}" y1="{y - 8}" x2="{WIDTH - MARGIN}" y2="{y - 8}" stroke="#e9ecef"/>')
    if replicated:
        y += 8
        cv.add(svg_text(MARGIN, y + 4, "replicated on every rank (each reads them whole):", 12, "#495057", "bold"))
        y += 6
        line, lines = "", []
        for t in replicated:
            item = f"{t.name} ({'×'.join(map(str, t.shape)) or 'scalar'})"
            if line and len(line) + len(item) > 160:
                lines.append(line)
                line = ""
            line += ("  ·  " if line else "") + item
        lines.append(line)
        for ln in lines:
            y += 16
            cv.add(svg_text(MARGIN, y, ln, 11, "#495057"))
        y += 10
    if view.hidden or view.note:
        y += 12
        note = view.note or (
            f"{view.hidden} more model tensors not drawn (other layers plan the same way; choose with --tensor)"
        )
        cv.add(svg_text(MARGIN, y, note, 11, "#868e96"))
        y += 6
    height = int(y + MARGIN)
    defs = (
        '<marker id="arrow" viewBox="0 0 10 10" refX="8" refY="5" markerWidth="7" markerHeight="7" '
        'orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" fill="#adb5bd"/></marker>'
        + "".join(cv.patterns.values())
    )
    head = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" {FONT}>'
    )
    return (
        "\n".join(
            [
                head,
                f"<defs>{defs}</defs>",
                f'<rect width="{WIDTH}" height="{height}" fill="#ffffff"/>',
                *cv.parts,
                "</svg>",
            ]
        )
        + "\n"
    )
