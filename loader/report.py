"""``LoadReport``: what a load did on one rank, made from the rank's plan and the bytes it read."""

from __future__ import annotations

import logging
import re
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import redact_url
from .plan import RankPlan
from .plan.gcpause import paused_gc
from .rules import dot_natural_key
from .rules.conversion import natural_order

log = logging.getLogger("loader")
#: at most this many (compacted) keys are named in a log line
SHOWN_KEYS = 12


@dataclass(frozen=True, repr=False)
class LoadReport:
    """What a load did on this rank; ``str()`` and ``repr()`` are a one-line summary (counts, bytes, seconds),
    the fields hold the full key tuples.

    Attributes:
        loaded_keys: model tensor names loaded (tied aliases included), natural-sorted.
        missing_keys: model tensors nothing loaded (only with ``strict=False``).
        unexpected_keys: checkpoint keys no rule maps to a model tensor, or whose tensor a key before them
            loads through the base model prefix (see :class:`~loader.rules.KeyPlan`); logged as one warning on
            rank 0, as ``from_pretrained`` does; natural-sorted.
        bytes_read: bytes this process read from checkpoint files (remotely: bytes fetched, the gaps coalesced
            requests read through included).
        traced: model tensors loaded by traced conversions (region reads, or value reads: pointwise ops).
        deferred: model tensors loaded through deferred (run-for-real) conversions.
        blocks: RemapBlocks executed (region reads and value reads' inputs).
        planned_bytes: bytes the plan needed.
        deferred_reasons: why each deferred conversion could not be traced.
        rank, world_size: this process's rank and the world size.
        cast_keys: ``(model tensor name, checkpoint dtype, model dtype)`` for each model tensor whose values were
            converted across kinds (integer <-> floating point, bool), natural-sorted; the checkpoint dtype is
            that of the values its conversion produced (the checkpoint tensor's, for a rename). Such a load
            also warns once (``UserWarning``). Casts within a kind (bf16 -> float32) are normal and not listed.
        seconds: wall time of the load on this rank (0.0 where the caller did not time it).
        requests: read requests this process made: read system calls locally, HTTP requests remotely.
        bytes_exchanged: bytes this process received from other ranks instead of reading them (exchanged
            reads: ``LoadOptions.exchange_reads``).
        certificates: per parameter, its coverage certificate (:func:`regiontrace.coverage`: which boxes each write
            wrote, none left unwritten or written twice), for a load through a module's own ``load_weights``
            (:func:`loader.load_engine_weights`); empty otherwise.
    """

    loaded_keys: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    bytes_read: int
    traced: tuple[str, ...]
    deferred: tuple[str, ...]
    blocks: int = 0
    planned_bytes: int = 0
    deferred_reasons: Mapping[str, str] = field(default_factory=dict)
    rank: int = 0
    world_size: int = 1
    cast_keys: tuple[tuple[str, torch.dtype, torch.dtype], ...] = ()
    seconds: float = field(default=0.0, compare=False)  # timing: not part of what the load did
    requests: int = field(default=0, compare=False)  # how the bytes were read, not what was loaded
    bytes_exchanged: int = field(default=0, compare=False)
    certificates: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __str__(self) -> str:
        casts = f", {len(self.cast_keys)} cast across kinds" if self.cast_keys else ""
        exchanged = f", {human_bytes(self.bytes_exchanged)} from peers" if self.bytes_exchanged else ""
        return (
            f"LoadReport(rank {self.rank} of {self.world_size}: {len(self.loaded_keys)} tensors loaded "
            f"({len(self.traced)} traced, {len(self.deferred)} deferred), {len(self.missing_keys)} missing, "
            f"{len(self.unexpected_keys)} unexpected{casts}; read {human_bytes(self.bytes_read)} of "
            f"{human_bytes(self.planned_bytes)} planned in {self.blocks} blocks{exchanged}, {self.seconds:.2f} s)"
        )

    __repr__ = __str__


@paused_gc()  # one tuple per key, no cycles: no full collections over the model meanwhile
def load_report(
    plan: RankPlan,
    bytes_read: int,
    rank: int = 0,
    world_size: int = 1,
    seconds: float = 0.0,
    requests: int = 0,
    *,
    exchanged: int = 0,
) -> LoadReport:
    """The :class:`LoadReport` of ``plan``, executed; warns once when values changed kind, and logs the unexpected
    checkpoint keys (rank 0 only: every rank has the same).

    Args:
        plan: the rank's plan.
        bytes_read: bytes this process read from checkpoint files.
        rank, world_size: this process's rank and the world size.
        seconds: wall time of the load.
        requests: read requests made.
        exchanged: bytes received from other ranks (exchanged reads).

    Returns:
        The report.
    """
    casts = tuple(sorted(set(plan.casts), key=lambda c: dot_natural_key(c[0])))
    if casts:
        _warn_casts(casts)
    if plan.unexpected_keys and rank == 0:
        keys = natural_sorted(plan.unexpected_keys)
        log.warning(
            "%d checkpoint key(s) of %s are unexpected: no model tensor loads from them (%s); fine when loading "
            "from another task or architecture, not when you expect the same one (LoadReport.unexpected_keys "
            "lists them)",
            len(keys),
            redact_url(plan.checkpoint.root),
            compact_keys(keys),
        )
    loaded = natural_sorted(plan.loaded_keys)
    return LoadReport(
        loaded_keys=loaded,
        missing_keys=natural_sorted(plan.missing_keys),
        unexpected_keys=natural_sorted(plan.unexpected_keys),
        bytes_read=bytes_read,
        traced=_sorted_as(plan.traced, loaded),
        deferred=natural_sorted(plan.deferred_targets),
        blocks=plan.block_count,
        planned_bytes=plan.planned_bytes(),
        deferred_reasons={", ".join(d.conversion.targets): d.reason for d in plan.deferred},
        rank=rank,
        world_size=world_size,
        cast_keys=casts,
        seconds=seconds,
        requests=requests,
        bytes_exchanged=exchanged,
    )


def _sorted_as(keys: Iterable[str], done: tuple[str, ...]) -> tuple[str, ...]:
    """``natural_sorted(keys)``, which is ``done`` when ``keys`` are its keys (the traced tensors of a load that
    traced everything: not sorted twice)."""
    distinct = set(keys)
    return done if len(distinct) == len(done) and distinct.issuperset(done) else natural_sorted(distinct)


def natural_sorted(keys: Iterable[str]) -> tuple[str, ...]:
    """Distinct ``keys`` in ``dot_natural_key`` order (sorted by :func:`~loader.rules.conversion.natural_order`'s
    strings, the same order, unless a key holds a NUL: no list per key for the garbage collector to walk)."""
    distinct = set(keys)
    return tuple(sorted(distinct, key=natural_order if not any("\x00" in k for k in distinct) else dot_natural_key))


_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")  # a dot-delimited integer: a layer or expert index


def compact_keys(keys: Iterable[str], shown: int = SHOWN_KEYS) -> str:
    """``keys`` for a log line, compacted as transformers' load report does: keys that differ only in their
    dot-delimited integers are one entry (``layers.{1, 2}.mlp.weight``, ``experts.{0...63}.w``), at most ``shown``
    entries, then how many more."""
    patterns: dict[str, list[set[int]]] = {}
    for key in keys:
        sets = patterns.setdefault(_INDEX.sub("*", key), [])
        for i, n in enumerate(_INDEX.findall(key)):
            if i == len(sets):
                sets.append(set())
            sets[i].add(int(n))
    out = []
    for pattern, sets in patterns.items():
        parts = pattern.split("*")
        text = parts[0]
        for values, part in zip(sets, parts[1:]):
            text += _indices(sorted(values)) + part
        out.append(text)
    more = f" and {len(out) - shown} more" if len(out) > shown else ""
    return ", ".join(out[:shown]) + more


def _indices(values: list[int]) -> str:
    if len(values) == 1:
        return str(values[0])
    if len(values) > 4 and values == list(range(values[0], values[-1] + 1)):
        return f"{{{values[0]}...{values[-1]}}}"
    return "{" + ", ".join(map(str, values)) + "}"


def human_bytes(n: int) -> str:
    """``n`` bytes as ``"512 B"``, ``"4.2 KiB"``, ``"1.5 GiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _warn_casts(casts: tuple[tuple[str, torch.dtype, torch.dtype], ...]) -> None:
    shown = ", ".join(f"{name} ({_dtype(a)} -> {_dtype(b)})" for name, a, b in casts[:8])
    more = f" and {len(casts) - 8} more" if len(casts) > 8 else ""
    warnings.warn(
        f"{len(casts)} model tensor(s) loaded from values of another kind (integer, floating point, bool), "
        f"converted by value: {shown}{more} (LoadReport.cast_keys lists them)",
        UserWarning,
        stacklevel=4,
    )


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
