"""Composing traced conversions: a traced map over checkpoint keys, read through the inverse of another.

Vocabulary (as in :mod:`regiontrace.region`, plus):

- **f**: a conversion checked to be a bijection (an :class:`~regiontrace.Inverse`): its sources are the
  *keys* ``K`` (checkpoint tensors), its outputs the *targets* ``T`` (one model's tensors).
- **g**: any traced conversion that reads the keys: its outputs are the other model's tensors ``D``.
- **inverse region**: a key as a region over the targets (sources named after f's outputs); the *flat* inverse
  region is the same over the key's flat index, shape ``(numel,)``.
- **lattice**: the key elements one piece reads, ``base + sum(c_k * s_k)`` with ``0 <= c_k < n_k``; it is
  *chained* when, sorted by stride, each stride divides the next and the digits do not carry: then the flat
  index splits into *levels* (mixed-radix digits), one per lattice factor plus fixed gap digits.

:func:`inverse_regions` turns each piece of f (a box of a target onto a lattice of a key) into one piece over
the flat key (one factor per level) and reshapes it to the key's shape; :func:`compose` reads each piece of g
out of the flat inverse region (narrow to the lattice's span, reshape to its levels, narrow each level, permute
to the piece's factors) and places the result where the piece sits. Every step is an op of
:mod:`regiontrace.region` or :mod:`regiontrace.reshape`: cost follows pieces, never elements, and the result is
in the normal form. A lattice that is not chained (a carry, strides that do not divide) is split along the
factor with the fewest digits, one part per digit: exact, but that is where compactness is lost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from . import region as R
from .invert import Inverse
from .radix import Axis, Factor, digit_weights, normalize_axis
from .reshape import extend_full, reshape
from .tensor import Node, RegionTensor
from .values import Apply, Value

__all__ = ["compose", "inverse_regions"]

#: a lattice factor: (key stride > 0, count > 1, payload: the target step, or the index of the piece's factor)
Entry = tuple[int, int, int]
#: one level of a chained lattice, major first: (radix, lo, count, payloads major first; none for a gap digit)
Level = tuple[int, int, int, tuple[int, ...]]


def inverse_regions(inverse: Inverse) -> dict[str, RegionTensor]:
    """Each source (key) of a checked bijection as a RegionTensor over leaves named after its outputs.

    Running a conversion ``g`` on these instead of leaves traces ``g`` composed with the inverse (the same as
    :func:`compose` on the traced ``g``). Casts narrow back exactly what the forward run widened.

    Raises:
        ValueError: an output has no name (a single traced tensor: pass ``{name: tensor}`` to ``invert``).
    """
    flats = _flat_inverses(inverse)
    out = {}
    for name, (shape, dtype) in inverse.sources.items():
        region = reshape(flats[name], shape)
        region = R.finish_region(shape, _merge_points(list(region.pieces)), f"inverting onto {name!r}")
        out[name] = _wrap(region, dtype, {"key": name})
    return out


def compose(
    outputs: RegionTensor | Mapping[str, RegionTensor], inverse: Inverse
) -> RegionTensor | dict[str, RegionTensor]:
    """The traced conversion ``g`` read through the inverse of ``f``: every output element of ``g`` as an element
    of ``f``'s outputs.

    Args:
        outputs: the traced outputs of ``g`` by name (or a single RegionTensor); their leaves are ``f``'s sources.
        inverse: ``f`` checked to be a bijection (:func:`regiontrace.invert`), with named outputs.

    Returns:
        The same names (or a single RegionTensor) over leaves named after ``f``'s outputs; values ``g``
        computes by pointwise ops stay an :class:`~regiontrace.Apply` over the composed regions.

    Raises:
        ValueError: an output of ``g`` reads a source the inverse does not rebuild, or with another shape or
            dtype; an output of ``f`` has no name.
        Untraceable: a lattice needs more than :data:`~regiontrace.PIECE_BUDGET` pieces.
    """
    flats = _flat_inverses(inverse)
    single = isinstance(outputs, RegionTensor)
    outs = {None: outputs} if single else dict(outputs)
    result = {}
    for name, tensor in outs.items():
        value = _compose_value(tensor.value, flats, inverse)
        result[name] = _wrap(value, tensor.dtype, {"output": name})
    return result[None] if single else result


# ---------------------------------------------------------------------------------------------------
# lattices and levels


def _chain(base: int, entries: Sequence[Entry], numel: int, group: bool) -> tuple[int, list[Level]] | None:
    """``(start, levels)`` with ``base + sum(c_k * s_k) = start + mixed-radix digits``, or None (not chained).

    With ``group``, factors that continue each other (``s * n`` is the next stride) share one level.
    """
    groups: list[tuple[int, int, tuple[int, ...]]] = []
    for s, n, pay in sorted(entries):
        if group and groups and groups[-1][0] * groups[-1][1] == s:
            gs, gn, gp = groups[-1]
            groups[-1] = (gs, gn * n, (pay,) + gp)
        else:
            groups.append((s, n, (pay,)))
    if not groups:
        return base, []
    s1 = groups[0][0]
    levels: list[Level] = [(s1, base % s1, 1, ())] if s1 > 1 else []
    for (s, n, pays), nxt in zip(groups, groups[1:]):
        if nxt[0] % s:
            return None
        radix = nxt[0] // s
        lo = (base // s) % radix
        if lo + n > radix:
            return None
        levels.append((radix, lo, n, pays))
    top, n, pays = groups[-1]
    start = base // top * top
    if start + n * top > numel:
        return None
    levels.append((n, 0, n, pays))
    return start, levels[::-1]


def _split_choice(entries: Sequence[Entry]) -> int:
    """The factor to split a lattice that is not chained along: the fewest digits (then the largest stride)."""
    return min(range(len(entries)), key=lambda i: (entries[i][1], -entries[i][0]))


def _flat_inverses(inverse: Inverse) -> dict[str, R.Region]:
    """Per source of ``inverse``, its flat inverse region: shape ``(numel,)``, pieces reading the outputs."""
    pieces: dict[str, list[R.Piece]] = {name: [] for name in inverse.sources}
    for tname, tensor in inverse.outputs.items():
        if tname is None:
            raise ValueError("composing needs named outputs: invert {name: tensor}, not a single tensor")
        target = R.Source(tname, tuple(tensor.shape), tensor.dtype)
        for p in tensor.region.pieces:
            numel = math.prod(p.source.shape)
            casts = _narrowing(p)
            kbase, tbase, entries = p.base, 0, []
            for axis, tstride in zip(p.axes, R.contiguous_strides(tensor.shape)):
                weights = digit_weights(axis.factors)
                tbase += (axis.start + sum(f.lo * w for f, w in zip(axis.factors, weights))) * tstride
                for f, w in zip(axis.factors, weights):
                    s, n, t = f.stride, f.hi - f.lo, w * tstride
                    if n > 1 and s < 0:  # a flip: walk the key upwards, the target downwards
                        kbase, tbase, s, t = kbase + (n - 1) * s, tbase + (n - 1) * t, -s, -t
                    if n > 1:
                        entries.append((s, n, t))
            for tb, axis in _inverse_axes(kbase, tbase, _merge_entries(entries), numel):
                pieces[p.source.name].append(R.Piece(target, tb, (axis,), casts))
    flats = {}
    for name, (shape, _) in inverse.sources.items():
        found = sorted(pieces[name], key=lambda q: q.axes[0].start)
        flats[name] = R.finish_region((math.prod(shape),), found, f"inverting onto {name!r}")
    return flats


def _merge_entries(entries: list[Entry]) -> list[Entry]:
    """Merge lattice factors that continue each other on both sides (the key's and the target's)."""
    merged: list[Entry] = []
    for s, n, t in sorted(entries):
        if merged and merged[-1][0] * merged[-1][1] == s and merged[-1][2] * merged[-1][1] == t:
            merged[-1] = (merged[-1][0], merged[-1][1] * n, merged[-1][2])
        else:
            merged.append((s, n, t))
    return merged


def _inverse_axes(kbase: int, tbase: int, entries: list[Entry], numel: int) -> list[tuple[int, Axis]]:
    """The lattice ``kbase + sum(c_k * s_k)`` as axes over the flat key, each with its target base."""
    chained = _chain(kbase, entries, numel, group=False)
    if chained is not None:
        start, levels = chained
        factors = tuple(Factor(r, lo, lo + n, pays[0] if pays else 0) for r, lo, n, pays in levels)
        return [(tbase, normalize_axis(Axis(start, factors)))]
    k = _split_choice(entries)
    s, n, t = entries[k]
    rest = entries[:k] + entries[k + 1 :]
    out: list[tuple[int, Axis]] = []
    for c in range(n):
        out.extend(_inverse_axes(kbase + c * s, tbase + c * t, rest, numel))
        R.check_piece_budget(len(out), "inverting a lattice that is not chained")
    return out


def _narrowing(piece: R.Piece) -> tuple[torch.dtype, ...]:
    """The casts back from the output's dtype to the source's: exact on the values the forward casts produced."""
    return (piece.source.dtype,) if piece.casts else ()


# ---------------------------------------------------------------------------------------------------
# reading g's pieces through the inverse


def _compose_value(value: Value, flats: Mapping[str, R.Region], inverse: Inverse) -> Value:
    if isinstance(value, Apply):
        return replace(value, operands=tuple(_compose_value(o, flats, inverse) for o in value.operands))
    pieces: list[R.Piece] = []
    for p in value.pieces:
        src = p.source
        if src.name not in inverse.sources:
            raise ValueError(f"a piece reads source {src.name!r}, which the inverse does not rebuild")
        if inverse.sources[src.name] != (tuple(src.shape), src.dtype):
            shape, dtype = inverse.sources[src.name]
            raise ValueError(f"source {src.name!r} is read as {tuple(src.shape)} {src.dtype}, it is {shape} {dtype}")
        pieces.extend(_compose_piece(p, flats[src.name]))
        R.check_piece_budget(len(pieces), "composing")
    return R.finish_region(value.shape, _merge_points(pieces), "composing")


def _merge_points(pieces: list[R.Piece]) -> list[R.Piece]:
    """Merge pieces one coordinate wide along a dim, at consecutive coordinates and equally spaced bases (g's
    ``stack`` of per-expert keys read through a fused target: one piece, not one per expert)."""
    for d in range(len(pieces[0].axes) if pieces else 0):
        groups: dict[tuple, list[R.Piece]] = {}
        for q in pieces:
            key = (q.source, q.casts, q.axes[:d], q.axes[d + 1 :]) if not q.axes[d].factors else (id(q),)
            groups.setdefault(key, []).append(q)
        pieces = []
        for group in groups.values():
            group.sort(key=lambda q: q.axes[d].start)
            i = 0
            while i < len(group):
                j, step = i + 1, group[i + 1].base - group[i].base if i + 1 < len(group) else 0
                while (
                    j < len(group)
                    and group[j].axes[d].start == group[i].axes[d].start + j - i
                    and group[j].base == group[i].base + (j - i) * step
                ):
                    j += 1
                axes = list(group[i].axes)
                axes[d] = normalize_axis(Axis(axes[d].start, (Factor(j - i, 0, j - i, step),)))
                pieces.append(group[i].with_axes(axes) if j - i > 1 else group[i])
                i = j
    return pieces


def _compose_piece(p: R.Piece, flat: R.Region) -> list[R.Piece]:
    """The pieces of ``p`` read through the flat inverse region of its source."""
    slots, entries, flips, broadcast, base = [], [], [], [], p.base
    for d, axis in enumerate(p.axes):
        for j, f in enumerate(axis.factors):
            n = f.hi - f.lo
            if n <= 1:
                continue
            k = len(slots)
            slots.append((d, j))
            if f.stride == 0:
                broadcast.append(k)
                continue
            if f.stride < 0:
                base, stride = base + (n - 1) * f.stride, -f.stride
                flips.append(k)
            else:
                stride = f.stride
            entries.append((stride, n, k))
    counts = [p.axes[d].factors[j].hi - p.axes[d].factors[j].lo for d, j in slots]
    lattice = _read_lattice(flat, base, [(s, n, i) for i, (s, n, _) in enumerate(entries)])
    lattice = R.flip(lattice, [i for i, (_, _, k) in enumerate(entries) if k in flips])
    for k in broadcast:
        lattice = R.unsqueeze(lattice, k)
    if broadcast:
        lattice = R.expand(lattice, counts)
    out = []
    for q in lattice.pieces:
        out.extend(_place(p, slots, q))
    return out


def _read_lattice(flat: R.Region, base: int, entries: list[Entry]) -> R.Region:
    """The region of shape ``(n_k)`` (in ``entries`` order, payloads are their positions) reading
    ``flat[base + sum(c_k * s_k)]``."""
    numel = flat.shape[0]
    chained = _chain(base, entries, numel, group=True)
    if chained is None:
        k = _split_choice(entries)
        s, n, _ = entries[k]
        rest = [(s2, n2, i if i < k else i - 1) for s2, n2, i in entries[:k] + entries[k + 1 :]]
        parts, count = [], 0
        for c in range(n):
            parts.append(R.unsqueeze(_read_lattice(flat, base + c * s, rest), k))
            count += len(parts[-1].pieces)
            R.check_piece_budget(count, "composing with a lattice that is not chained")
        return R.cat(parts, k, [e[1] for e in entries])
    start, levels = chained
    x = R.narrow(flat, 0, start, start + math.prod(r for r, _, _, _ in levels))
    x = reshape(x, [r for r, _, _, _ in levels])
    for d, (r, lo, n, _) in enumerate(levels):
        if n != r:
            x = R.narrow(x, d, lo, lo + n)
    order = [i for _, _, _, pays in levels for i in pays]
    x = reshape(x, [entries[i][1] for i in order])
    return R.permute(x, [order.index(i) for i in range(len(entries))])


def _place(p: R.Piece, slots: Sequence[tuple[int, int]], q: R.Piece) -> list[R.Piece]:
    """Piece ``q`` of ``p``'s lattice (one dim per covered factor of ``p``) placed where ``p`` sits."""
    where = {slot: i for i, slot in enumerate(slots)}
    per_dim = []
    for d, axis in enumerate(p.axes):
        # the leading digits up to the first covered factor become the axis' start (no radix to fill exactly)
        first = next((j for j in range(len(axis.factors)) if (d, j) in where), len(axis.factors))
        weights = digit_weights(axis.factors)
        start = axis.start + sum(f.lo * w for f, w in zip(axis.factors[:first], weights))
        options: list[tuple[int, tuple[Factor, ...]]] = [(0, ())]
        if first < len(axis.factors):
            a = q.axes[where[d, first]]
            start += (axis.factors[first].lo + a.start) * weights[first]
            options = [(0, a.factors)]
        for j, f in enumerate(axis.factors[first + 1 :], first + 1):
            if (d, j) in where:
                a = q.axes[where[d, j]]
                parts = extend_full(Axis(f.lo + a.start, a.factors), f.radix)
            else:
                parts = [(0, (Factor(f.radix, f.lo, f.hi, 0),))]
            options = [(d1 + d2, f1 + f2) for d1, f1 in options for d2, f2 in parts]
        per_dim.append([(delta, Axis(start, fs)) for delta, fs in options])
    combos: list[tuple[int, tuple[Axis, ...]]] = [(0, ())]
    for opts in per_dim:
        combos = [(d1 + d2, axes + (a,)) for d1, axes in combos for d2, a in opts]
    R.check_piece_budget(len(combos), "composing")
    casts = _composed_casts(q, p)
    out = []
    for delta, axes in combos:
        new = R.normal_piece(replace(q, casts=casts), axes, delta)
        if new is not None:
            out.append(new)
    return out


def _composed_casts(q: R.Piece, p: R.Piece) -> tuple[torch.dtype, ...]:
    """Casts from ``q``'s source through ``p``'s: ``q`` narrows exactly to the key's values, so a cast of ``p``
    may start from ``q``'s source (a cast depends only on the value); without one, narrow to the key's dtype."""
    if not p.casts:
        return q.casts
    casts: tuple[torch.dtype, ...] = ()
    for dtype in p.casts:
        casts = R.append_cast(q.source.dtype, casts, dtype)
    return casts


def _wrap(value: Value, dtype: torch.dtype, params: dict) -> RegionTensor:
    meta = torch.empty(value.shape, dtype=dtype, device="meta")
    return RegionTensor(meta, value, Node("compose", tuple(value.shape), dtype, (), params))
