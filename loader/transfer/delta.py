"""Only what changed: a buffer's new value as the runs of elements that differ from the value last sent.

Vocabulary:

- **base**: what the receiver holds (the value last sent, bit for bit); the sender keeps a copy of it (the stated
  memory bound: one copy of every buffer it sends, in the receiver's dtype).
- **changed element**: one whose bits differ between base and new (compared as integers of the element's width,
  so ``-0.0`` against ``0.0`` and NaN payloads count as changes, and equal bits never do).
- **run**: consecutive elements sent together: changed elements, with unchanged gaps between them merged in when
  sending the gap costs no more than starting a new run (:data:`MERGE_BYTES`).
- **delta**: the runs as LEB128 varints — per run its distance from the end of the previous one, doubled, plus 1
  when the run is one element long; then the lengths of the longer runs — followed by the runs' elements; or,
  when that is not smaller, the whole buffer (``full``). A scattered change costs its element and about two
  bytes (about ``log2`` of the gap: the entropy of where it is, rounded up to whole bytes).

Encoding and decoding are vectorized (a handful of tensor ops per buffer, no Python loop over elements), and
:func:`apply_delta` on the base gives ``new`` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Delta", "apply_delta", "encode_delta", "changed_elements"]

#: an unchanged gap is sent with its run when its bytes are at most this (about the varints of a new run)
MERGE_BYTES = 4
#: :meth:`Delta.to_bytes`' header: full, runs, index bytes, values bytes, changed elements (int64 each)
HEADER = ("full", "runs", "index_bytes", "values_bytes", "changed")
HEADER_BYTES = 8 * len(HEADER)
#: integer views of each element width (bits compared, never values)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Delta:
    """A buffer's change: ``index`` (varint bytes: gap, length per run) and ``values`` (the runs' elements as
    bytes), or ``full`` with ``values`` the whole buffer. ``changed``: elements that differ (for the report)."""

    full: bool
    runs: int
    index: torch.Tensor
    values: torch.Tensor
    changed: int

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: the varints and the elements (the 8-byte run count included)."""
        return int(self.index.numel() + self.values.numel()) + (0 if self.full else 8)

    def to_bytes(self) -> torch.Tensor:
        """The delta as one byte buffer (:data:`HEADER` int64 fields, then the index, then the values): what a
        sender puts on the wire, :meth:`from_bytes` reads it back. Its size is ``nbytes + HEADER_BYTES - 8``."""
        fields = [int(self.full), self.runs, int(self.index.numel()), int(self.values.numel()), self.changed]
        head = torch.tensor(fields, dtype=torch.int64).view(torch.uint8)
        return torch.cat([head, self.index.reshape(-1), self.values.reshape(-1)])

    @staticmethod
    def from_bytes(data: torch.Tensor) -> Delta:
        """The delta :meth:`to_bytes` wrote.

        Raises:
            ValueError: ``data`` is shorter or longer than its header says.
        """
        if data.numel() < HEADER_BYTES:
            raise ValueError(f"a delta of {data.numel()} bytes has no header ({HEADER_BYTES} bytes)")
        full, runs, n_index, n_values, changed = (int(v) for v in data[:HEADER_BYTES].view(torch.int64))
        if min(runs, n_index, n_values, changed) < 0 or HEADER_BYTES + n_index + n_values != data.numel():
            raise ValueError(f"a delta of {data.numel()} bytes whose header says {n_index} + {n_values}")
        index = data[HEADER_BYTES : HEADER_BYTES + n_index]
        values = data[HEADER_BYTES + n_index :].clone()  # its own storage: viewed as the elements' dtype
        return Delta(bool(full), runs, index, values, changed)


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(_INT[t.element_size()])


def changed_elements(base: torch.Tensor, new: torch.Tensor) -> int:
    """How many elements' bits differ."""
    return int((_ints(base) != _ints(new)).sum())


def encode_delta(base: torch.Tensor, new: torch.Tensor) -> Delta:
    """``new`` against ``base`` (same shape and dtype) as a :class:`Delta`, the smaller of the runs and the whole.

    Raises:
        ValueError: shapes or dtypes differ.
    """
    if base.shape != new.shape or base.dtype != new.dtype:
        raise ValueError(f"a delta needs equal shapes and dtypes: {tuple(base.shape)} {base.dtype} against "
                         f"{tuple(new.shape)} {new.dtype}")  # fmt: skip
    size = new.element_size()
    a, b = _ints(base), _ints(new)
    where = torch.nonzero(a != b).reshape(-1)
    whole = b.view(torch.uint8)
    if where.numel() == 0:
        return Delta(False, 0, torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8), 0)
    gaps = where[1:] - where[:-1] - 1
    breaks = torch.nonzero(gaps * size > MERGE_BYTES).reshape(-1)  # a new run after these changed elements
    starts = torch.cat([where[:1], where[breaks + 1]])
    ends = torch.cat([where[breaks], where[-1:]]) + 1
    lengths = ends - starts
    previous_end = torch.cat([torch.zeros(1, dtype=ends.dtype), ends[:-1]])
    single = lengths == 1
    index = _varints(torch.cat([(starts - previous_end) * 2 + single.to(starts.dtype), lengths[~single]]))
    elements = int(lengths.sum())
    if index.numel() + elements * size + 8 >= whole.numel():
        return Delta(True, 0, torch.empty(0, dtype=torch.uint8), whole.clone(), int(where.numel()))
    picked = b[_ranges(starts, lengths, elements)]
    return Delta(False, int(starts.numel()), index, picked.view(torch.uint8).clone(), int(where.numel()))


def apply_delta(target: torch.Tensor, delta: Delta) -> None:
    """Write ``delta`` into ``target`` (holding the base) in place: afterwards it holds ``new`` bit for bit.

    Raises:
        ValueError: the delta does not fit ``target`` (runs past its end, a size that does not match).
    """
    flat = target.reshape(-1)  # a view of a contiguous target (written through)
    if not target.is_contiguous():
        raise ValueError("a delta is applied to a contiguous tensor")
    ints = flat.view(_INT[target.element_size()])
    if delta.full:
        if delta.values.numel() != ints.numel() * target.element_size():
            raise ValueError(f"a whole buffer of {delta.values.numel()} bytes for {ints.numel()} elements")
        ints.copy_(delta.values.view(ints.dtype))
        return
    if delta.runs == 0:
        return
    fields = _read_varints(delta.index)
    heads = fields[: delta.runs]
    gaps, single = heads >> 1, (heads & 1).bool()
    if fields.numel() != delta.runs + int((~single).sum()):
        raise ValueError(f"a delta's index holds {fields.numel()} values, not {delta.runs} runs' worth")
    lengths = torch.ones_like(gaps)
    lengths[~single] = fields[delta.runs :]
    starts = torch.cumsum(gaps + torch.cat([torch.zeros(1, dtype=lengths.dtype), lengths[:-1]]), 0)
    elements = int(lengths.sum())
    if elements * target.element_size() != delta.values.numel() or (
        delta.runs and int(starts[-1] + lengths[-1]) > ints.numel()
    ):
        raise ValueError(f"a delta of {delta.runs} runs ({elements} elements) does not fit {ints.numel()} elements")
    ints[_ranges(starts, lengths, elements)] = delta.values.view(ints.dtype)


def _ranges(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """The element indices of the runs, concatenated (``arange`` per run, vectorized)."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths, output_size=total) + torch.arange(total)


def _varints(values: torch.Tensor) -> torch.Tensor:
    """Non-negative int64 values as LEB128 bytes (7 bits a byte, the high bit set on all but each value's last)."""
    counts = torch.ones_like(values)
    rest = values >> 7
    while bool((rest > 0).any()):
        counts += (rest > 0).to(counts.dtype)
        rest = rest >> 7
    total = int(counts.sum())
    owner = torch.repeat_interleave(torch.arange(values.numel()), counts, output_size=total)
    first = torch.cumsum(counts, 0) - counts
    position = torch.arange(total) - first[owner]
    digits = (values[owner] >> (7 * position)) & 0x7F
    more = position < (counts[owner] - 1)
    return (digits | (more.to(digits.dtype) << 7)).to(torch.uint8)


def _read_varints(data: torch.Tensor) -> torch.Tensor:
    """The LEB128 values in ``data``.

    Raises:
        ValueError: ``data`` ends inside a value, or a value has more than 9 bytes.
    """
    data = data.to(torch.int64)
    last = (data & 0x80) == 0
    if data.numel() and not bool(last[-1]):
        raise ValueError("a delta's index ends inside a value")
    count = int(last.sum())
    owner = torch.cumsum(last.to(torch.int64), 0) - last.to(torch.int64)
    first = torch.zeros(count, dtype=torch.int64).scatter_reduce(
        0, owner, torch.arange(data.numel()), "amin", include_self=False
    )
    position = torch.arange(data.numel()) - first[owner]
    if data.numel() and int(position.max()) > 8:
        raise ValueError("a delta's index holds a value of more than 9 bytes")
    return torch.zeros(count, dtype=torch.int64).index_add_(0, owner, (data & 0x7F) << (7 * position))
