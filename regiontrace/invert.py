"""Inverting a traced conversion: check that it is a bijection, then scatter output values back into sources.

Loading runs a conversion forwards; saving runs it backwards. When every element of every source is read by
exactly one output element and every cast is an exact widening, the traced map is a bijection: the forward
:class:`~regiontrace.RemapBlock` s of an output box, run backwards, write each source element the box maps
from exactly once, with no hand-written reverse op.

:func:`invert` checks this per source with arithmetic on each piece's *source lattice* ``base + sum(d_k *
stride_k)``: a set of equal contiguous *runs*. The runs of all pieces that read a source, sorted, must tile
``[0, numel)`` with no gap and no overlap. The cost follows the runs, never the elements; when the runs are too
many (an interleave reads runs of one element), the flat index is regrouped into the mixed-radix *levels* the
strides define, and the levels most often covered whole go innermost (a de-interleave becomes two runs).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .compile import check_box
from .errors import NotInvertible
from .region import EXACT_WIDENINGS, Piece
from .remap_block import RemapBlock
from .scatter import scatter_blocks
from .tensor import RegionTensor

#: Most runs a source's check sorts; beyond it the level regrouping (or a plain count) decides.
RUN_BUDGET = 1 << 20

SourceSpec = tuple[Sequence[int], torch.dtype]
Sources = Mapping[str, RegionTensor | SourceSpec] | Iterable[RegionTensor]


class _Lattice(NamedTuple):
    """The source elements one piece reads: ``base + sum(d_k * stride_k)``, ``0 <= d_k < count_k``."""

    owner: int  # index of the output that reads them
    base: int
    factors: tuple[tuple[int, int], ...]  # (stride, count), strides positive and ascending, nested runs merged


@dataclass(frozen=True)
class Inverse:
    """A conversion checked to be a bijection: scatter output values back into their sources.

    Attributes:
        outputs: the traced outputs by name (``None`` for a single traced tensor).
        sources: ``(shape, dtype)`` of every source, by name.
    """

    outputs: Mapping[str | None, RegionTensor]
    sources: Mapping[str, tuple[tuple[int, ...], torch.dtype]]

    def blocks(self, target: str | None = None, box: Sequence[Sequence[int]] | None = None) -> tuple[RemapBlock, ...]:
        """The blocks of ``box`` of output ``target``: run backwards, they write the source elements it maps from.

        Raises:
            KeyError: no such output. ValueError: the box lies outside its shape.
        """
        return self._output(target).remap_blocks(box)

    def scatter(
        self,
        values: torch.Tensor,
        sources: MutableMapping[str, torch.Tensor],
        target: str | None = None,
        box: Sequence[Sequence[int]] | None = None,
    ) -> MutableMapping[str, torch.Tensor]:
        """Write the values of ``box`` of output ``target`` into the source elements that box maps from.

        Args:
            values: the box's values (box-shaped, any strides), e.g. the local shard a rank holds.
            sources: real C-contiguous source tensors, written in place; only the elements the box maps from change.
            target: the output's name (omit for a single traced tensor).
            box: half-open ``(start, stop)`` per dim of the output; default: the whole output.

        Returns:
            ``sources``.

        Raises:
            KeyError: no such output, or a source the box maps to is missing. ValueError: a shape differs.
        """
        blocks = self.blocks(target, box)
        expected = tuple(b - a for a, b in check_box(self._output(target).shape, box))
        if tuple(values.shape) != expected:
            raise ValueError(f"values have shape {tuple(values.shape)}, the box has shape {expected}")
        return scatter_blocks(blocks, values, sources)

    def unmaterialize(self, values: torch.Tensor | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Build every source from whole output values: the inverse of :func:`regiontrace.materialize`.

        Args:
            values: the real output tensors by name (or the tensor, for a single traced output).

        Returns:
            A new C-contiguous tensor per source, in the source's dtype, on the values' device.

        Raises:
            KeyError: an output's values are missing. ValueError: a shape differs.
        """
        values = {None: values} if isinstance(values, torch.Tensor) else values
        missing = [_label(name) for name in self.outputs if name not in values]
        if missing:
            raise KeyError(f"no values given for {', '.join(missing)}")
        device = next((v.device for v in values.values()), torch.device("cpu"))
        out = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in self.sources.items()}
        for name in self.outputs:
            self.scatter(values[name], out, target=name)
        return out

    def _output(self, target: str | None) -> RegionTensor:
        if target not in self.outputs:
            raise KeyError(f"no output {target!r}; the outputs are {sorted(map(str, self.outputs))}")
        return self.outputs[target]


def invert(outputs: RegionTensor | Mapping[str, RegionTensor], sources: Sources) -> Inverse:
    """Check that a traced conversion is a bijection between its sources' elements and its outputs' elements.

    Exact widening casts (``bfloat16 -> float32``, ``int32 -> int64``, ...) invert: the values a forward run
    produces narrow back unchanged. Any other cast is refused.

    Args:
        outputs: the traced outputs of one conversion by name, or a single traced tensor.
        sources: every source the conversion reads: names to ``(shape, dtype)`` or to leaves, or the leaves.

    Returns:
        An :class:`Inverse` that scatters output values back into the sources.

    Raises:
        NotInvertible: a source element is never written (dropped, e.g. by a slice) or written more than once
            (a broadcast, or a source used twice), a cast is not an exact widening, or an output is computed
            by pointwise ops; the message names the source and the output.
        ValueError: an output reads a source that is not given, or with another shape or dtype.
    """
    outs = {None: outputs} if isinstance(outputs, RegionTensor) else dict(outputs)
    specs = _source_specs(sources)
    names = list(outs)
    lattices: dict[str, list[_Lattice]] = {name: [] for name in specs}
    for owner, (oname, tensor) in enumerate(outs.items()):
        if not tensor.is_index_map:
            what = f"computed by `{tensor.value.name}`"
            raise NotInvertible(f"{_label(oname)} is {what}, not an index map: no exact inverse", reason="computed")
        for piece in tensor.region.pieces:
            src = piece.source
            if src.name not in specs:
                raise ValueError(f"{_label(oname)} reads source {src.name!r}, which is not among the sources")
            if (tuple(src.shape), src.dtype) != specs[src.name]:
                shape, dtype = specs[src.name]
                raise ValueError(
                    f"{_label(oname)} reads source {src.name!r} as {tuple(src.shape)} {src.dtype}, "
                    f"the sources give {shape} {dtype}"
                )
            _check_casts(oname, piece)
            lattices[src.name].append(_lattice(owner, oname, piece))
    for name, (shape, _) in specs.items():
        _verify_source(name, shape, lattices[name], names)
    return Inverse(outs, specs)


def unmaterialize(
    outputs: RegionTensor | Mapping[str, RegionTensor],
    values: torch.Tensor | Mapping[str, torch.Tensor],
    sources: Sources,
) -> dict[str, torch.Tensor]:
    """``invert(outputs, sources).unmaterialize(values)``: every source, rebuilt from whole output values.

    Raises:
        NotInvertible, ValueError, KeyError: as :func:`invert` and :meth:`Inverse.unmaterialize`.
    """
    return invert(outputs, sources).unmaterialize(values)


# ---------------------------------------------------------------------------------------------------
# the bijection check


def _verify_source(
    name: str, shape: Sequence[int], lattices: Sequence[_Lattice], owners: Sequence, run_budget: int = RUN_BUDGET
) -> None:
    """Check that ``lattices`` read every element of source ``name`` exactly once.

    Raises:
        NotInvertible: an element is never read, or read twice; or the runs exceed ``run_budget`` and no
            compact regrouping decides (the message says so).
    """
    shape = tuple(shape)
    numel = math.prod(shape)
    if numel == 0:
        return
    if not lattices:
        raise NotInvertible(
            f"source {name!r} {shape} is never written: no output reads it (the conversion drops it)",
            name,
            "dropped",
        )
    if len(lattices) == 1 and lattices[0].base == 0 and lattices[0].factors == ((1, numel),):
        return  # one piece reads the whole source in order: a rename, a reshape, one part of a cat or stack
    plain = sum(math.prod(n for _, n in _run_split(lat)[1]) for lat in lattices)
    tiled = _plain_runs(lattices) if plain <= run_budget else _level_runs(numel, lattices)
    if tiled is None:  # neither sorts within the budget: the count alone can still prove a drop or a repeat
        total = sum(math.prod(n for _, n in lat.factors) for lat in lattices)
        what = {-1: "some are never written (a slice?)", 1: "some are read twice (broadcast/expand?)"}
        reason = "dropped" if total < numel else "duplicate" if total > numel else "unverifiable"
        why = what.get((total > numel) - (total < numel), f"in {plain} runs with no compact regrouping to check")
        raise NotInvertible(
            f"source {name!r} {shape}: the outputs read {total} of {numel} elements: {why}", name, reason
        )
    _check_tiling(name, shape, tiled, owners)


def _run_split(lat: _Lattice) -> tuple[int, tuple[tuple[int, int], ...]]:
    """``(run length, outer factors)``: the stride-1 factor is one contiguous run, the others enumerate runs."""
    inner = bool(lat.factors) and lat.factors[0][0] == 1
    return (lat.factors[0][1] if inner else 1), lat.factors[inner:]


def _plain_runs(lattices: Sequence[_Lattice]) -> tuple:
    return (*_runs((lat.owner, lat.base, *_run_split(lat)) for lat in lattices), lambda x: x)


def _runs(items: Iterable[tuple[int, int, int, Sequence[tuple[int, int]]]]) -> tuple[np.ndarray, ...]:
    """``(starts, lengths, owners)`` of runs given as ``(owner, first start, length, [(stride, count), ...])``."""
    starts, lengths, owners = [], [], []
    for owner, start, run, outer in items:
        s = np.array([start], dtype=np.int64)
        for stride, count in outer:
            s = (s[:, None] + np.arange(count, dtype=np.int64) * stride).reshape(-1)
        starts.append(s)
        lengths.append(np.full(s.size, run, dtype=np.int64))
        owners.append(np.full(s.size, owner, dtype=np.int64))
    return np.concatenate(starts), np.concatenate(lengths), np.concatenate(owners)


def _level_runs(numel: int, lattices: Sequence[_Lattice]) -> tuple | None:
    """Runs after regrouping the flat index into the levels the strides define (None: no such regrouping).

    When the strides and run ends of all lattices form a divisibility chain ``1 | L1 | L2 | ... | numel``,
    each lattice fixes the digit of some levels and covers others fully. The tiling check does not depend on the
    order of the levels, so the levels most often covered fully go innermost and become long runs.
    """
    bounds = {1, numel}
    for lat in lattices:
        for stride, count in lat.factors:
            bounds.update((stride, stride * count))
    levels = sorted(bounds)
    if levels[-1] != numel or any(b % a for a, b in zip(levels, levels[1:])):
        return None
    index = {v: i for i, v in enumerate(levels)}
    radix = [b // a for a, b in zip(levels, levels[1:])]
    m = len(radix)
    patterns = []
    for lat in lattices:
        full = [False] * m
        for stride, count in lat.factors:
            i, k = index[stride], index[stride * count]
            if any(full[i:k]) or (lat.base // stride) % count:
                return None  # factors share a level, or the base carries into a covered one
            full[i:k] = [True] * (k - i)
        patterns.append((lat, full))
    covered = [sum(full[i] for _, full in patterns) for i in range(m)]
    perm = sorted(range(m), key=lambda i: (-covered[i], i))  # innermost first
    weight = [0] * m
    acc = 1
    for i in perm:
        weight[i], acc = acc, acc * radix[i]
    items, total = [], 0
    for lat, full in patterns:
        run, j = 1, 0
        while j < m and full[perm[j]]:
            run, j = run * radix[perm[j]], j + 1
        outer = [(weight[i], radix[i]) for i in perm[j:] if full[i]]
        total += math.prod(n for _, n in outer)
        if total > RUN_BUDGET:
            return None
        start = sum((lat.base // levels[i]) % radix[i] * weight[i] for i in range(m) if not full[i])
        items.append((lat.owner, start, run, outer))

    def locate(x: int) -> int:  # a position in the regrouped order -> the flat source offset
        return sum((x // weight[i]) % radix[i] * levels[i] for i in range(m))

    return (*_runs(items), locate)


def _check_tiling(name: str, shape: tuple[int, ...], tiled: tuple, owners: Sequence[str | None]) -> None:
    """Raise unless the runs ``[start, start + length)`` of ``tiled`` tile ``[0, numel)`` exactly."""
    starts, lengths, who, locate = tiled
    numel = math.prod(shape)
    order = np.argsort(starts, kind="stable")
    s, e, who = starts[order], starts[order] + lengths[order], who[order]
    reach = np.maximum.accumulate(e)
    before = np.concatenate(([0], reach[:-1]))
    bad = np.flatnonzero(s != before)
    if not bad.size and reach[-1] == numel:
        return
    union = int(np.maximum(e - np.maximum(s, before), 0).sum())
    i = int(bad[0]) if bad.size else None
    if i is None or s[i] > before[i]:
        at = int(before[i]) if i is not None else int(reach[-1])
        raise NotInvertible(
            f"source {name!r} {shape}: {numel - union} of {numel} elements are never written, the first at "
            f"index {_index(locate(at), shape)}: the conversion drops them (a slice?)",
            name,
            "dropped",
        )
    j = int(np.flatnonzero(e[:i] > s[i])[0])
    by = _label(owners[who[i]]) if who[i] == who[j] else f"outputs {owners[who[j]]!r} and {owners[who[i]]!r}"
    raise NotInvertible(
        f"source {name!r} {shape}: {int(lengths.sum()) - union} extra reads, the first of index "
        f"{_index(locate(int(s[i])), shape)} read twice by {by} (broadcast/expand, or the source used twice)",
        name,
        "duplicate",
    )


# ---------------------------------------------------------------------------------------------------
# helpers


def _lattice(owner: int, oname: str | None, piece: Piece) -> _Lattice:
    base, factors = piece.base, []
    for dim, axis in enumerate(piece.axes):
        for f in axis.factors:
            count = f.hi - f.lo
            if count <= 1:
                continue
            if f.stride == 0:
                raise NotInvertible(
                    f"{_label(oname)} reads elements of source {piece.source.name!r} {count} times each along "
                    f"output dim {dim}: a broadcast (expand/repeat) has no inverse",
                    piece.source.name,
                    "broadcast",
                )
            if f.stride < 0:  # a flip reads the same elements
                base += (count - 1) * f.stride
            factors.append((abs(f.stride), count))
    factors.sort()
    merged: list[tuple[int, int]] = []
    for stride, count in factors:
        if merged and merged[-1][0] * merged[-1][1] == stride:
            merged[-1] = (merged[-1][0], merged[-1][1] * count)
        else:
            merged.append((stride, count))
    return _Lattice(owner, base, tuple(merged))


def _check_casts(oname: str | None, piece: Piece) -> None:
    chain = (piece.source.dtype,) + piece.casts
    for a, b in zip(chain, chain[1:]):
        if (a, b) not in EXACT_WIDENINGS:
            raise NotInvertible(
                f"{_label(oname)} reads source {piece.source.name!r} ({piece.source.dtype}) through a cast "
                f"{a} -> {b}, which is not exact: its inverse cannot restore the source values (only exact "
                "widenings such as bfloat16 -> float32 invert)",
                piece.source.name,
                "cast",
            )


def _source_specs(sources: Sources) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    items = sources.items() if isinstance(sources, Mapping) else ((None, t) for t in sources)
    specs = {}
    for key, value in items:
        if isinstance(value, RegionTensor):
            if value.node.op != "leaf":
                raise ValueError(f"source {key!r} is a traced result ({value.node.op}), not a leaf")
            name = value.node.params["name"]
            if key is not None and key != name:
                raise ValueError(f"source key {key!r} holds the leaf named {name!r}")
            specs[name] = (tuple(value.shape), value.dtype)
        else:
            shape, dtype = value
            specs[key] = (tuple(int(n) for n in shape), dtype)
    return specs


def _index(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(int(i) for i in np.unravel_index(flat, shape))


def _label(name: str | None) -> str:
    return "the output" if name is None else f"output {name!r}"
