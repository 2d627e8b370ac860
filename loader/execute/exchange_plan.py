"""Who fetches what, who sends what: the plan of exchanged reads, as pure functions of every rank's wanted ranges.

Vocabulary (per file; offsets are bytes of the file):

- *wanted* (:data:`Ranges`): a rank's byte ranges, an ``(n, 2)`` int64 array, ascending, disjoint, touching ones
  merged;
- an *extent*: a maximal stretch of bytes some rank wants (every rank's wanted ranges merged);
- a *shared extent*: an extent at least two ranks want, one of them in more than one range (interleaved wants;
  ranks that each want one range of it fetch their own);
- a *share* (:class:`Shares`): the contiguous stretch of a shared extent one rank, its *holder*, fetches, as long as
  the bytes that rank wants in it (scaled to the extent where wants overlap): each rank fetches about what it needs;
- a *parcel* (:class:`Parcels`): a wanted range cut at share bounds: the bytes one share's holder sends to one rank;
- a *section* (:class:`Section`): the bytes ``[lo, hi)`` of one file, cut at tensor starts, with the shares and
  parcels clipped to it: a file over the budget of a round is cut into sections;
- a *round*: sections fetched, exchanged and read together, each rank holding (its shares and parcels) at most a
  budget of bytes for them, unless a section is one tensor over the budget alone.

A column shard wants a short run of every row: fetched by each rank on its own it costs a request (or a multipart
part, or a page-spanning read) per row, though together the ranks want every byte once. Exchanged reads fetch such
bytes once, each rank one contiguous stretch, and exchange them over the process group (:mod:`.exchanged`).

This module lives in the execution layer, not in :mod:`loader.plan`: a :class:`~loader.plan.RankPlan` says which
bytes one rank reads into which tensors; this says which rank fetches them and who sends whom what, a way of
executing the ranks' plans together that changes none of them. It imports nothing of the project.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

#: a rank's wanted byte ranges of one file: ``(n, 2)`` int64, ascending, disjoint, touching ones merged
Ranges = np.ndarray

_EMPTY = np.zeros((0, 2), dtype=np.int64)

END = int(np.iinfo(np.int64).max)
"""The end of every file: a section ``[lo, END)`` runs to the file's end."""

SMALL_RANGE = 1 << 20
"""Bytes under which a wanted range costs more as a request of its own than inside an exchanged share (a request's
latency is worth about a MiB at the bandwidths of object stores: 20 ms at 50 MB/s)."""


@dataclass(frozen=True)
class Shares:
    """The shares of one file's shared extents: ``[starts[i], ends[i])`` is fetched by rank ``holders[i]``,
    ascending, disjoint, none empty."""

    starts: np.ndarray
    ends: np.ndarray
    holders: np.ndarray

    def of(self, rank: int) -> Ranges:
        """The shares ``rank`` fetches."""
        mine = self.holders == rank
        return np.stack([self.starts[mine], self.ends[mine]], axis=1)

    @property
    def nbytes(self) -> int:
        return int((self.ends - self.starts).sum())


@dataclass(frozen=True)
class Parcels:
    """One rank's wanted bytes inside shared extents, cut at share bounds: ``[starts[i], ends[i])`` comes from
    rank ``holders[i]``; ascending."""

    starts: np.ndarray
    ends: np.ndarray
    holders: np.ndarray

    def sizes_from(self, holder: int) -> np.ndarray:
        mine = self.holders == holder
        return self.ends[mine] - self.starts[mine]

    def from_holder(self, holder: int) -> Ranges:
        """The parcels ``holder`` sends, in the order it sends them (ascending)."""
        mine = self.holders == holder
        return np.stack([self.starts[mine], self.ends[mine]], axis=1)


def as_ranges(ranges: Sequence[tuple[int, int]] | np.ndarray) -> Ranges:
    """``ranges`` (any order, may touch or overlap) as :data:`Ranges`."""
    a = np.asarray(ranges, dtype=np.int64).reshape(-1, 2)
    a = a[a[:, 1] > a[:, 0]]
    if len(a) < 2:
        return a.copy()
    a = a[np.argsort(a[:, 0], kind="stable")]
    reach = np.maximum.accumulate(a[:, 1])
    new = np.ones(len(a), dtype=bool)
    new[1:] = a[1:, 0] > reach[:-1]
    firsts = np.flatnonzero(new)
    return np.stack([a[firsts, 0], np.maximum.reduceat(a[:, 1], firsts)], axis=1)


def _per_region(everyone: Sequence[Ranges], regions: Ranges) -> tuple[np.ndarray, np.ndarray]:
    """``(counts, bytes)``, each ``(len(regions), world)``: how many of each rank's ranges start in each region, and
    their bytes."""
    counts = np.zeros((len(regions), len(everyone)), dtype=np.int64)
    wanted = np.zeros((len(regions), len(everyone)), dtype=np.int64)
    for r, mine in enumerate(everyone):
        if len(mine):
            k = np.searchsorted(regions[:, 0], mine[:, 0], side="right") - 1
            counts[:, r] = np.bincount(k, minlength=len(regions))
            wanted[:, r] = np.bincount(k, weights=mine[:, 1] - mine[:, 0], minlength=len(regions))
    return counts, wanted


def _shared_groups(counts: np.ndarray, wanted: np.ndarray, small: int) -> np.ndarray:
    """Per tensor (rows: each rank's ranges and bytes in it), whether it is shared: it lies in a *group* (a maximal
    run of consecutive tensors each wanted by at least two ranks) where some rank wants at least two ranges of
    fewer than ``small`` bytes on average (a request each, for little)."""
    multi = (counts > 0).sum(axis=1) >= 2
    if not len(multi):
        return multi
    new = np.ones(len(multi), dtype=bool)
    new[1:] = multi[1:] != multi[:-1]
    group = np.cumsum(new) - 1
    n, b = (np.stack([np.bincount(group, weights=col) for col in x.T], axis=1) for x in (counts, wanted))
    fragmented = ((n >= 2) & (b < small * n)).any(axis=1)
    return fragmented[group] & multi


def shares(everyone: Sequence[Ranges], tensors: Ranges | None = None, small: int = SMALL_RANGE) -> Shares:
    """The shares of one file, from every rank's wanted ranges (index = rank): each shared extent cut into one
    share per rank wanting it, in rank order, each as long as that rank's wanted bytes in it (scaled).

    Args:
        everyone: every rank's wanted ranges of the file.
        tensors: the file's tensors' byte spans (ascending; no wanted range crosses one's end): sharing is then
            decided per *group*, a maximal run of consecutive tensors each wanted by at least two ranks: shared
            when a rank wants it in several ranges of under ``small`` bytes on average (column shards; row shards
            of small tensors); the extents are the wanted bytes of shared tensors, merged across touching tensors.
            So a TP layer's row and column shards are fetched in a few shares together, while whole experts (one
            rank each) are fetched by their ranks, and break groups. None: sharing decided per extent (shared
            when a rank wants more than one range of it).
        small: see ``tensors``.
    """
    world = len(everyone)
    extents = as_ranges(np.concatenate([_EMPTY, *everyone]))
    if not len(extents):
        return Shares(*(np.zeros(0, dtype=np.int64),) * 3)
    regions = extents if tensors is None else np.asarray(tensors, dtype=np.int64).reshape(-1, 2)
    counts, wanted = _per_region(everyone, regions)
    shared = ((counts > 0).sum(axis=1) >= 2) & (counts.max(axis=1) >= 2)
    if tensors is None:
        ext, wanted = extents[shared], wanted[shared]
    else:
        shared = _shared_groups(counts, wanted, small)
        starts = regions[:, 0]
        inside = [m[shared[np.searchsorted(starts, m[:, 0], side="right") - 1]] if len(m) else m for m in everyone]
        ext = as_ranges(np.concatenate([_EMPTY, *inside]))
        wanted = _per_region(inside, ext)[1]
    size = (ext[:, 1] - ext[:, 0])[:, None]
    cum = np.concatenate([np.zeros((len(ext), 1), dtype=np.int64), np.cumsum(wanted, axis=1)], axis=1)
    # exact integers (Python's: size * cum overflows int64 past ~3 GB extents): the last bound is the extent's end
    bounds = ext[:, :1] + (size.astype(object) * cum.astype(object) // cum[:, -1:].astype(object)).astype(np.int64)
    starts, ends = bounds[:, :-1].ravel(), bounds[:, 1:].ravel()
    holders = np.tile(np.arange(world, dtype=np.int64), len(ext))
    keep = ends > starts
    return Shares(starts[keep], ends[keep], holders[keep])


def parcels(wanted: Ranges, file_shares: Shares) -> Parcels:
    """``wanted`` (one rank's ranges of the file) inside the shares, cut at share bounds, with each parcel's holder.

    A wanted range lies in one extent, so it is either inside the shares (a shared extent) or outside all."""
    c = file_shares
    if not len(wanted) or not len(c.starts):
        return Parcels(*(np.zeros(0, dtype=np.int64),) * 3)
    k = np.searchsorted(c.starts, wanted[:, 0], side="right") - 1
    inside = (k >= 0) & (wanted[:, 0] < c.ends[np.maximum(k, 0)])
    w = wanted[inside]
    if not len(w):
        return Parcels(*(np.zeros(0, dtype=np.int64),) * 3)
    cuts = np.concatenate([c.starts, c.ends])
    cuts = cuts[(cuts > w[0, 0]) & (cuts < w[-1, 1])]
    points = np.sort(np.concatenate([w[:, 0], w[:, 1], cuts]))
    points = points[np.concatenate([[True], points[1:] != points[:-1]])]  # np.unique hashes: slower here
    lo, hi = points[:-1], points[1:]
    owner = np.searchsorted(w[:, 0], lo, side="right") - 1
    keep = (owner >= 0) & (lo < w[np.maximum(owner, 0), 1])
    lo, hi = lo[keep], hi[keep]
    return Parcels(lo, hi, c.holders[np.searchsorted(c.starts, lo, side="right") - 1])


@dataclass(frozen=True)
class FilePlan:
    """One file's exchange: its shares and every rank's parcels (index = rank)."""

    shares: Shares
    parcels: tuple[Parcels, ...]

    def sends(self, holder: int, to: int) -> Ranges:
        """The parcels ``holder`` sends to rank ``to`` (ascending)."""
        return self.parcels[to].from_holder(holder)

    def cost(self, rank: int) -> int:
        """Bytes ``rank`` holds for this file's exchange: its shares and the parcels it receives (its parcels of its
        own shares are read there)."""
        c, p = self.shares, self.parcels[rank]
        mine, received = c.holders == rank, p.holders != rank
        return int((c.ends[mine] - c.starts[mine]).sum() + (p.ends[received] - p.starts[received]).sum())

    def held_below(self, offsets: np.ndarray) -> np.ndarray:
        """``(world, len(offsets))``: the bytes of each rank's :meth:`cost` below each offset (ascending)."""
        c = self.shares
        out = np.empty((len(self.parcels), len(offsets)), dtype=np.int64)
        for r, p in enumerate(self.parcels):
            mine, received = c.holders == r, p.holders != r
            out[r] = _below(c.starts[mine], c.ends[mine], offsets) + _below(
                p.starts[received], p.ends[received], offsets
            )
        return out

    def section(self, lo: int, hi: int) -> FilePlan:
        """This plan restricted to the bytes ``[lo, hi)``: shares and parcels clipped (one across a bound is cut,
        each side kept by its holder)."""
        c = self.shares
        return FilePlan(
            Shares(*_clip(c.starts, c.ends, c.holders, lo, hi)),
            tuple(Parcels(*_clip(p.starts, p.ends, p.holders, lo, hi)) for p in self.parcels),
        )


def _clip(starts: np.ndarray, ends: np.ndarray, holders: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, ...]:
    """The ranges ``[starts, ends)`` (with their holders) clipped to ``[lo, hi)``, the empty ones dropped."""
    s, e = np.maximum(starts, lo), np.minimum(ends, hi)
    keep = e > s
    return s[keep], e[keep], holders[keep]


def _below(starts: np.ndarray, ends: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The bytes of the ascending, disjoint ranges ``[starts, ends)`` below each offset."""
    if not len(starts):
        return np.zeros(len(offsets), dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(ends - starts)])
    k = np.searchsorted(starts, offsets)  # the ranges starting below each offset; the last may reach past it
    return cum[k] - np.where(k > 0, np.maximum(ends[np.maximum(k - 1, 0)] - offsets, 0), 0)


def plan_files(
    everyone: Sequence[Mapping[str, Ranges]], tensors: Mapping[str, Ranges] | None = None
) -> dict[str, FilePlan]:
    """The exchange of every file some rank wants shared bytes of, from every rank's ``{file: wanted}``, by file
    name (every rank computes the same); ``tensors``: ``{file: its tensors' byte spans}`` (see :func:`shares`)."""
    files = sorted({f for wants in everyone for f in wants})
    out = {}
    for f in files:
        wants = [w.get(f, _EMPTY) for w in everyone]
        c = shares(wants, None if tensors is None else tensors.get(f))
        if len(c.starts):
            out[f] = FilePlan(c, tuple(parcels(w, c) for w in wants))
    return out


class Section(NamedTuple):
    """The bytes ``[lo, hi)`` of ``file`` (see the module): the reads of the tensors starting there, and its plan's
    shares and parcels clipped to it (:meth:`FilePlan.section`)."""

    file: str
    lo: int
    hi: int


def sections(
    file: str, plan: FilePlan, tensor_starts: np.ndarray | None, budget: int
) -> list[tuple[Section, np.ndarray]]:
    """``file`` cut at tensor starts into sections of at most ``budget`` bytes held per rank (greedily, each as long
    as fits), each with what every rank holds for it (``(world,)``); a tensor over the budget is a section of its own
    (with the tensors after it that hold nothing). One section when the file fits or its tensors are unknown."""
    whole = plan.held_below(np.array([END]))[:, 0]
    if tensor_starts is None or whole.max() <= budget:
        return [(Section(file, 0, END), whole)]
    bounds = np.unique(np.concatenate([[0], tensor_starts, [END]]))
    held = plan.held_below(bounds)

    def furthest(i: int, limit: np.ndarray) -> int:  # the last bound up to which every rank holds at most limit
        return min(int(np.searchsorted(row, lim, side="right")) for row, lim in zip(held, limit.tolist())) - 1

    cuts = [0]
    while cuts[-1] < len(bounds) - 1:
        i = cuts[-1]
        j = furthest(i, held[:, i] + budget)
        cuts.append(j if j > i else furthest(i, held[:, i + 1]))  # j == i: the next tensor alone is over
    if len(cuts) > 2 and not (held[:, cuts[1]] - held[:, 0]).any():  # tensors holding nothing first: with the next
        del cuts[1]
    return [(Section(file, int(bounds[i]), int(bounds[j])), held[:, j] - held[:, i]) for i, j in zip(cuts, cuts[1:])]


def rounds(
    plans: Mapping[str, FilePlan], world: int, budget: int, tensors: Mapping[str, Ranges] | None = None
) -> list[list[Section]]:
    """Every file's :func:`sections` (``tensors``: ``{file: its tensors' byte spans}``), in name order, grouped so that
    no rank holds more than ``budget`` bytes for one round (a section over the budget alone is a round of its own;
    two sections of one file are never in one round). Every rank computes the same."""
    groups: list[list[Section]] = []
    held = np.zeros(world, dtype=np.int64)
    for f in sorted(plans):
        spans = None if tensors is None or f not in tensors else np.asarray(tensors[f]).reshape(-1, 2)
        for section, cost in sections(f, plans[f], None if spans is None else spans[:, 0], budget):
            if groups and (held + cost).max() <= budget:
                groups[-1].append(section)
                held += cost
            else:
                groups.append([section])
                held = cost
    return groups
