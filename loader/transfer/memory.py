"""The local memory a transfer reads and writes, checked before anything is sent: no tensor on the meta device,
no destination tensor overlapping another one it writes, none overlapping a source tensor it reads.

Overlap is of bytes, not of storages: views of one buffer (a flat parameter buffer) that do not overlap are
fine. Two strided views whose extents overlap are compared element by element (interleaved views, ``w[:, ::2]``
and ``w[:, 1::2]``, do not overlap).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from .plan import TransferPlan


@dataclass(frozen=True)
class Span:
    """A tensor's bytes in its storage: ``[start, stop)`` from the storage's start; ``side``: "source" (read) or
    "destination" (written)."""

    name: str
    side: str
    tensor: torch.Tensor
    start: int
    stop: int


def check_memory(
    plan: TransferPlan, rank: int, sources: Mapping[str, torch.Tensor], targets: Mapping[str, torch.Tensor]
) -> None:
    """Refuse what this rank's part of ``plan`` cannot do with its local tensors (``sources``, ``targets``: the
    source's and the destination's, by name).

    Raises:
        ValueError: a tensor read or written is on the meta device; two destination tensors written overlap in
            memory; a destination tensor written overlaps a source tensor read (naming both).
    """
    reads = sorted({plan.cells[m.block.source].tensor for m in plan.moves if m.src == rank})
    writes = sorted({m.target for m in plan.moves if m.dst == rank and not m.key})
    writes += sorted({t for f in plan.fallback if rank in f.ranks for t in f.targets} - set(writes))
    for side, names, tensors in (("source", reads, sources), ("destination", writes, targets)):
        for name in names:
            if tensors[name].device.type == "meta":
                raise ValueError(_meta_message(side, name))
    spans = [s for s in _spans("source", reads, sources) if s is not None]
    spans += [s for s in _spans("destination", writes, targets) if s is not None]
    pair = first_overlap(spans)
    if pair is not None:
        raise ValueError(_overlap_message(*pair))


def _meta_message(side: str, name: str) -> str:
    if side == "source":
        return (
            f"source model tensor {name!r} is on the meta device: it holds no values to send (load or materialise "
            "the source before transferring); nothing was sent"
        )
    return (
        f"destination model tensor {name!r} is on the meta device: nothing can be written into it (materialise it, "
        "e.g. model.to_empty(device=...), before transferring); nothing was sent"
    )


def _overlap_message(a: Span, b: Span) -> str:
    if a.side == b.side:
        return (
            f"destination model tensors {a.name!r} and {b.name!r} overlap in memory (views of one storage sharing "
            "bytes): each would overwrite values of the other; give each its own memory (views of one buffer are "
            "fine where they do not overlap); nothing was sent"
        )
    src, dst = (a, b) if a.side == "source" else (b, a)
    return (
        f"destination model tensor {dst.name!r} overlaps source model tensor {src.name!r} in memory: the transfer "
        "would overwrite what it reads; transfer from a copy of the source (or into another model); nothing was sent"
    )


def _spans(side: str, names: Iterable[str], tensors: Mapping[str, torch.Tensor]) -> Iterable[Span | None]:
    for name in names:
        t = tensors[name]
        if t.numel() == 0 or t.device.type == "meta":
            yield None
            continue
        size = t.element_size()
        start = t.storage_offset() * size
        extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
        yield Span(name, side, t, start, start + (extent + 1) * size)


def first_overlap(spans: Iterable[Span]) -> tuple[Span, Span] | None:
    """The first two spans that share a byte (and are not both sources), or None: per storage, a sweep over the
    spans sorted by start, each compared with the earlier ones still open."""
    by_storage: dict[tuple[str, int], list[Span]] = {}
    for s in spans:
        by_storage.setdefault((s.tensor.device.type, s.tensor.untyped_storage().data_ptr()), []).append(s)
    for group in by_storage.values():
        open_: list[Span] = []
        for s in sorted(group, key=lambda s: (s.start, s.stop)):
            open_ = [o for o in open_ if o.stop > s.start]
            for o in open_:
                if (o.side == "destination" or s.side == "destination") and _share_bytes(o, s):
                    return o, s
            open_.append(s)
    return None


def _share_bytes(a: Span, b: Span) -> bool:
    """Whether two spans of one storage whose extents overlap share a byte: at once when both are dense (they
    cover their extents), else element by element."""
    if a.stop <= b.start or b.stop <= a.start:
        return False
    if _dense(a.tensor) and _dense(b.tensor):
        return True
    starts_a, width_a = _element_bytes(a)
    starts_b, width_b = _element_bytes(b)
    # for each element of b, the first element of a that ends after b's element starts
    i = torch.searchsorted(starts_a, starts_b - width_a, right=True)
    inside = i < starts_a.numel()
    return bool((starts_a[i[inside]] < starts_b[inside] + width_b).any())


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its extent (non-overlapping and dense in some order of its dims)."""
    dims = sorted((abs(s), n) for n, s in zip(t.shape, t.stride()) if n > 1)
    expected = 1
    for stride, n in dims:
        if stride != expected:
            return False
        expected *= n
    return True


def _element_bytes(s: Span) -> tuple[torch.Tensor, int]:
    """The sorted byte offsets of ``s``'s elements in its storage, and their width."""
    t, size = s.tensor, s.tensor.element_size()
    offsets = torch.full((), t.storage_offset(), dtype=torch.int64)
    for n, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride
    return torch.sort(offsets.reshape(-1) * size).values, size
