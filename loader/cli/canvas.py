"""Drawing primitives of the plan picture: rank colours, a canvas that collects SVG elements and the stripe
patterns of rank sets, and a tensor's frame (its 2-D view on screen, as panels of its last two dims) filled with
the boxes each rank owns or reads."""

from __future__ import annotations

import colorsys
import math
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape

from .geometry import Rect, partition, view_shape

PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#86bcb6"]
MAX_SLABS = 16


def rank_colour(i: int) -> str:
    if i < len(PALETTE):
        return PALETTE[i]
    h = (i * 0.618033988749895) % 1.0
    r, g, b = colorsys.hls_to_rgb(h, 0.55, 0.55)
    return f"#{int(r * 255):02x}{int(g * 255):02x}{int(b * 255):02x}"


def svg_text(
    x: float,
    y: float,
    text: str,
    size: int = 12,
    fill: str = "#212529",
    weight: str = "normal",
    anchor: str = "start",
    title: str | None = None,
) -> str:
    tip = f"<title>{escape(title)}</title>" if title else ""
    return (
        f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" fill="{fill}" font-weight="{weight}" '
        f'text-anchor="{anchor}">{tip}{escape(text)}</text>'
    )


def shorten(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2 - 1] + "…" + text[-(n - n // 2) :]


class Canvas:
    """Collects SVG elements and the stripe patterns for sets of ranks."""

    def __init__(self, ranks: Sequence[int]) -> None:
        self.parts: list[str] = []
        self.index = {r: i for i, r in enumerate(ranks)}
        self.patterns: dict[tuple[int, ...], str] = {}

    def colour(self, rank: int) -> str:
        return rank_colour(self.index.get(rank, rank))

    def fill(self, ranks: tuple[int, ...]) -> str:
        if len(ranks) == 1:
            return self.colour(ranks[0])
        pid = "m" + "_".join(map(str, ranks))
        if ranks not in self.patterns:
            k = len(ranks)
            stripes = "".join(
                f'<rect x="{4 * j}" y="0" width="4" height="{4 * k}" fill="{self.colour(r)}"/>'
                for j, r in enumerate(ranks)
            )
            self.patterns[ranks] = (
                f'<pattern id="{pid}" patternUnits="userSpaceOnUse" width="{4 * k}" '
                f'height="{4 * k}" patternTransform="rotate(45)">{stripes}</pattern>'
            )
        return f"url(#{pid})"

    def add(self, s: str) -> None:
        self.parts.append(s)


# ---------------------------------------------------------------------------------------------------
# geometry of one drawn tensor


def _compress(a: float) -> float:
    """Aspect ratio, compressed beyond 1:4 so that extreme shapes stay visible."""
    if a > 4:
        return 4 * (a / 4) ** 0.25
    if a < 0.25:
        return 0.25 * (a / 0.25) ** 0.25
    return a


@dataclass(frozen=True)
class Frame:
    """A tensor's 2-D view on screen: ``slabs`` panels of ``rows x cols`` elements in a grid ``grid`` wide."""

    slabs: int
    rows: int
    cols: int
    pw: float
    ph: float
    grid: int = 1
    gap: float = 4.0

    @property
    def w(self) -> float:
        n = min(self.slabs, self.grid)
        return n * self.pw + (n - 1) * self.gap

    @property
    def h(self) -> float:
        n = -(-self.slabs // self.grid)
        return n * self.ph + (n - 1) * self.gap

    def origin(self, k: int) -> tuple[float, float]:
        return (k % self.grid) * (self.pw + self.gap), (k // self.grid) * (self.ph + self.gap)

    def pieces(self, rect: Rect) -> list[tuple[float, float, float, float]]:
        """Pixel rectangles ``(x, y, w, h)`` (relative to the frame) of a 2-D-view rectangle."""
        r0, r1, c0, c1 = rect
        out = []
        for k in range(r0 // self.rows, (r1 - 1) // self.rows + 1):
            a, b = max(r0, k * self.rows) - k * self.rows, min(r1, (k + 1) * self.rows) - k * self.rows
            ox, oy = self.origin(k)
            x0, x1 = ox + c0 / self.cols * self.pw, ox + c1 / self.cols * self.pw
            y0, y1 = oy + a / self.rows * self.ph, oy + b / self.rows * self.ph
            out.append((x0, y0, max(x1 - x0, 1.0), max(y1 - y0, 1.0)))
        return out


def frame(
    shape: Sequence[int],
    max_w: float,
    max_h: float,
    like: Frame | None = None,
    like_shape: Sequence[int] | None = None,
) -> Frame:
    """A panel per slab of the last two dims (up to 256, in the grid that draws them largest), else one."""
    rows, cols = view_shape(shape)
    slabs = math.prod(shape[:-2]) if len(shape) >= 3 else 1
    if not 2 <= slabs <= MAX_SLABS * MAX_SLABS:
        slabs = 1
    rows //= slabs
    a = _compress(rows / max(cols, 1))
    if like is not None and like_shape is not None and slabs <= MAX_SLABS and like.slabs <= MAX_SLABS:
        pw, ph = cols * like.pw / like.cols, rows * like.ph / like.rows
        if 8 <= pw and 8 <= ph and slabs * pw + (slabs - 1) * 4 <= max_w and ph <= max_h:
            return Frame(slabs, rows, cols, pw, ph, slabs, 4.0)
    if slabs <= MAX_SLABS:
        gap = 4.0
        pw = min((max_w - (slabs - 1) * gap) / slabs, max_h / a)
        ph = pw * a if len(shape) > 1 else min(max_h, 14.0)
        return Frame(slabs, rows, cols, max(pw, 6.0), max(ph, 6.0), slabs, gap)
    gap, tall = 2.0, max_h * 1.6
    best = None
    for grid in range(1, min(slabs, 32) + 1):
        n = -(-slabs // grid)
        pw = min((max_w - (grid - 1) * gap) / grid, (tall - (n - 1) * gap) / n / a)
        if pw > 0 and (best is None or pw > best[1]):
            best = (grid, pw)
    grid, pw = best
    return Frame(slabs, rows, cols, max(pw, 3.0), max(pw * a, 3.0), grid, gap)


def draw(
    cv: Canvas, x: float, y: float, fr: Frame, owners: dict[int, list[Rect]], order: Sequence[int], title: str
) -> None:
    cv.add(f"<g><title>{escape(title)}</title>")
    for k in range(fr.slabs):
        ox, oy = fr.origin(k)
        cv.add(f'<rect x="{x + ox:.1f}" y="{y + oy:.1f}" width="{fr.pw:.1f}" height="{fr.ph:.1f}" fill="#f1f3f5"/>')
    for rect, ranks in partition(owners, order):
        fill = cv.fill(ranks)
        for px, py, pw, ph in fr.pieces(rect):
            cv.add(f'<rect x="{x + px:.2f}" y="{y + py:.2f}" width="{pw:.2f}" height="{ph:.2f}" fill="{fill}"/>')
    stroke = 1.0 if fr.pw > 8 and fr.ph > 8 else 0
    for k in range(fr.slabs if stroke else 0):
        ox, oy = fr.origin(k)
        cv.add(
            f'<rect x="{x + ox:.1f}" y="{y + oy:.1f}" width="{fr.pw:.1f}" height="{fr.ph:.1f}" fill="none" '
            f'stroke="#495057" stroke-width="{stroke}"/>'
        )
    cv.add("</g>")
