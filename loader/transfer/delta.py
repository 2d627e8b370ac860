"""Only what changed: a buffer's new value as the runs of elements that differ from the value last sent.

Vocabulary:

- **base**: what the receiver holds (the value last sent, bit for bit); the sender keeps a copy of it (the stated
  memory bound: one copy of every buffer it sends, in the receiver's dtype).
- **changed element**: one whose bits differ between base and new (compared as integers of the element's width,
  so ``-0.0`` against ``0.0`` and NaN payloads count as changes, and equal bits never do).
- **run**: a maximal stretch of consecutive changed elements.
- **Rice code** (parameter ``k``): a non-negative integer ``v`` as the ``k`` low bits of ``v`` and ``v >> k`` in
  unary, or, at ``cap`` or more, ``cap`` ones and ``v >> k`` in a fixed width (an **escape**: a long tail, such as
  a sign change among small steps, costs its bits, not its size in ones); a stream of them is three bit streams
  (all the low bits, all the unary codes, all the escapes), so that each is written and read with a handful of
  tensor ops. ``k`` and ``cap`` are chosen per stream as the ones that cost fewest bits: within a few hundredths
  of a bit of the entropy of geometric values (the gaps of scattered changes).
- **index**: the runs' positions: the gap before each run (minus one after the first) and its length minus one,
  two Rice streams.
- **values**: the changed elements, either ``raw`` (their bytes), or ``diff``: each as the zigzag of its integer
  difference ``new bits - old bits`` (element-width, wrapping; for floats of one sign the distance in ulps),
  minus one, as a Rice stream: an optimizer step that moves bf16 weights by an ulp or two costs ~2 bits a change.
  Whichever is smaller, per buffer.
- **delta**: the index and values; or, when that is not smaller, the whole buffer (``full``).

Random changes at random places cannot be sent in fewer bits than their entropy: a change at density ``p`` costs
about ``H(p) / p`` bits of position (11.4 at 0.1 %, 8.1 at 1 %, 4.7 at 10 %) besides its value; this encoding
comes within ~0.1 bit of that. Encoding and decoding are vectorized (a handful of tensor ops per buffer, no
Python loop over elements), and :func:`apply_delta` on the base gives ``new`` bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["Delta", "apply_delta", "encode_delta", "changed_elements"]

#: :meth:`Delta.to_bytes`' header: flags (1: full, 2: diff values), runs, index bytes, values bytes, changed
#: elements (LEB128 varints: 5 bytes for a small buffer)
HEADER = ("flags", "runs", "index_bytes", "values_bytes", "changed")
FULL, DIFF = 1, 2
#: integer views of each element width (bits compared, never values)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_EMPTY = torch.empty(0, dtype=torch.uint8)
#: at most this many values (evenly strided) choose a Rice stream's parameters
SAMPLE = 1 << 16


@dataclass(frozen=True)
class Delta:
    """A buffer's change: ``index`` (the runs' Rice streams) and ``values`` (the runs' elements: raw bytes, or
    with ``diff`` their differences as a Rice stream), or ``full`` with ``values`` the whole buffer.
    ``changed``: elements that differ (for the report)."""

    full: bool
    runs: int
    index: torch.Tensor
    values: torch.Tensor
    changed: int
    diff: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: :meth:`to_bytes`' size (its header's varints, the index and the values)."""
        return int(_varints(self._header()).numel() + self.index.numel() + self.values.numel())

    def _header(self) -> torch.Tensor:
        flags = FULL * int(self.full) + DIFF * int(self.diff)
        return torch.tensor([flags, self.runs, int(self.index.numel()), int(self.values.numel()), self.changed])

    def to_bytes(self) -> torch.Tensor:
        """The delta as one byte buffer (:data:`HEADER` as LEB128 varints, then the index, then the values): what
        a sender puts on the wire, :meth:`from_bytes` reads it back. Its size is :attr:`nbytes`."""
        return torch.cat([_varints(self._header()), self.index.reshape(-1), self.values.reshape(-1)])

    @staticmethod
    def from_bytes(data: torch.Tensor) -> Delta:
        """The delta :meth:`to_bytes` wrote.

        Raises:
            ValueError: ``data`` is shorter or longer than its header says.
        """
        try:
            start = _varint_end(data, len(HEADER))
        except ValueError:
            raise ValueError(f"a delta of {data.numel()} bytes has no header") from None
        flags, runs, n_index, n_values, changed = (int(v) for v in _read_varints(data[:start]))
        if start + n_index + n_values != data.numel():
            raise ValueError(f"a delta of {data.numel()} bytes whose header says {start} + {n_index} + {n_values}")
        if flags & ~(FULL | DIFF):
            raise ValueError(f"a delta whose header has unknown flags {flags}")
        index = data[start : start + n_index]
        values = data[start + n_index :].clone()  # its own storage: viewed as the elements' dtype
        return Delta(bool(flags & FULL), runs, index, values, changed, bool(flags & DIFF))


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(_INT[t.element_size()])


def changed_elements(base: torch.Tensor, new: torch.Tensor) -> int:
    """How many elements' bits differ."""
    return int((_ints(base) != _ints(new)).sum())


def encode_delta(base: torch.Tensor, new: torch.Tensor) -> Delta:
    """``new`` against ``base`` (same shape and dtype) as a :class:`Delta`, the smallest of the runs with raw
    values, the runs with differences, and the whole.

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
        return Delta(False, 0, _EMPTY, _EMPTY, 0)
    breaks = torch.nonzero(where[1:] - where[:-1] > 1).reshape(-1)  # a new run after these changed elements
    starts = torch.cat([where[:1], where[breaks + 1]])
    ends = torch.cat([where[breaks], where[-1:]]) + 1
    previous_end = torch.cat([torch.full((1,), -1, dtype=ends.dtype), ends[:-1]])
    index = torch.cat([_rice(starts - previous_end - 1), _rice(ends - starts - 1)])
    values, diff = b[where].view(torch.uint8), False
    z = _zigzag(b[where].to(torch.int64) - a[where].to(torch.int64), 8 * size)
    if bool((z > 0).all()):  # every difference fits a non-negative int64 (8-byte ones may not)
        coded = _rice(z - 1, limit=values.numel())
        if coded is not None and coded.numel() < values.numel():
            values, diff = coded, True
    if index.numel() + values.numel() >= whole.numel():
        return Delta(True, 0, _EMPTY, whole.clone(), int(where.numel()))
    return Delta(False, int(starts.numel()), index, values.clone(), int(where.numel()), diff)


def apply_delta(target: torch.Tensor, delta: Delta) -> None:
    """Write ``delta`` into ``target`` (holding the base) in place: afterwards it holds ``new`` bit for bit.

    Raises:
        ValueError: the delta does not fit ``target`` (runs past its end, a size that does not match).
    """
    flat = target.reshape(-1)  # a view of a contiguous target (written through)
    if not target.is_contiguous():
        raise ValueError("a delta is applied to a contiguous tensor")
    size = target.element_size()
    ints = flat.view(_INT[size])
    if delta.full:
        if delta.values.numel() != ints.numel() * size:
            raise ValueError(f"a whole buffer of {delta.values.numel()} bytes for {ints.numel()} elements")
        ints.copy_(delta.values.view(ints.dtype))
        return
    if delta.runs == 0:
        return
    gaps, used = _read_rice(delta.index, delta.runs)
    lengths, more = _read_rice(delta.index[used:], delta.runs)
    if used + more != delta.index.numel():
        raise ValueError(f"a delta's index holds {delta.index.numel()} bytes, not {delta.runs} runs' worth")
    lengths = lengths + 1
    starts = torch.cumsum(gaps + 1 + torch.cat([torch.full((1,), -1, dtype=gaps.dtype), lengths[:-1]]), 0)
    elements = int(lengths.sum())
    if int(starts[-1] + lengths[-1]) > ints.numel():
        raise ValueError(f"a delta of {delta.runs} runs ({elements} elements) does not fit {ints.numel()} elements")
    where = _ranges(starts, lengths, elements)
    if not delta.diff:
        if elements * size != delta.values.numel():
            raise ValueError(f"a delta of {elements} elements with {delta.values.numel()} bytes of values")
        ints[where] = delta.values.view(ints.dtype)
        return
    z, used = _read_rice(delta.values, elements)
    if used != delta.values.numel():
        raise ValueError(f"a delta of {elements} elements with {delta.values.numel()} bytes of differences")
    d = ((z + 1) >> 1) ^ -((z + 1) & 1)
    ints[where] = (ints[where].to(torch.int64) + d).to(ints.dtype)  # wraps at the element's width


def _zigzag(d: torch.Tensor, bits: int) -> torch.Tensor:
    """Differences wrapped to signed ``bits``-bit integers, zigzagged (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...)."""
    if bits < 64:
        half = 1 << (bits - 1)
        d = (d + half) % (2 * half) - half
    return (d << 1) ^ (d >> 63)


def _ranges(starts: torch.Tensor, lengths: torch.Tensor, total: int) -> torch.Tensor:
    """The element indices of the runs, concatenated (``arange`` per run, vectorized)."""
    offsets = torch.cumsum(lengths, 0) - lengths
    return torch.repeat_interleave(starts - offsets, lengths, output_size=total) + torch.arange(total)


def _rice(v: torch.Tensor, limit: int | None = None) -> torch.Tensor | None:
    """Non-negative int64 ``v`` as a Rice stream with escapes (:func:`_rice_cost` picks ``k`` and ``cap``): varints
    ``k``, ``cap``, the escapes' width and the unary bytes, then the ``k``-bit low parts, the unary high parts (bits
    little-endian in each byte), the escaped high parts. None when it would not be smaller than ``limit`` bytes."""
    k, cap, width, bits = _rice_cost(v)
    if limit is not None and bits / 8 >= limit:
        return None
    high = v >> k
    escaped = high >= cap if cap else torch.zeros_like(high, dtype=torch.bool)
    ones = torch.where(escaped, cap, high)
    unary = torch.ones(v.numel() + int(ones.sum()), dtype=torch.bool)
    unary[torch.cumsum(ones + 1, 0) - 1] = False  # each value's ones end with a zero
    streams = [_pack(_bits(v, k)), _pack(unary), _pack(_bits(high[escaped], width))]
    return torch.cat([_varints(torch.tensor([k, cap, width, streams[1].numel()])), *streams])


def _rice_cost(v: torch.Tensor) -> tuple[int, int, int, int]:
    """``(k, cap, width, bits)``: the Rice parameter and the escape (a high part of ``cap`` or more ones is sent as
    ``cap`` ones and ``width`` bits; 0: none) that cost fewest bits on an evenly strided sample of at most
    :data:`SAMPLE` values (from a histogram of the high parts per ``k``), and what they cost on all ``v``."""
    n = v.numel()
    if not n:
        return 0, 0, 1, 0
    top = int(v.max()).bit_length()
    sample = v[:: max(1, n // SAMPLE)]
    middle = int(sample.kthvalue((sample.numel() + 1) // 2).values).bit_length()
    q = torch.arange(65, dtype=torch.float64)
    best = (float("inf"), 0, 0)
    for k in range(max(0, middle - 4), min(62, middle + 6) + 1):
        counts = torch.bincount((sample >> k).clamp(max=64), minlength=65).double()
        head = torch.cumsum(counts * (q + 1), 0) - counts * (q + 1)  # the ones and zeros of the high parts below q
        above = sample.numel() - (torch.cumsum(counts, 0) - counts)  # high parts at or above q
        escaped = (head + above * (q + 1 + max(1, top - k)))[1:]
        cap = int(escaped.argmin()) + 1
        plain = float((sample >> k).double().sum()) + sample.numel()
        for c, bits in ((cap, float(escaped[cap - 1])), (0, plain)):
            best = min(best, (bits + sample.numel() * k, k, c))
    _, k, cap = best
    width = max(1, top - k)
    high = v >> k
    if cap:
        bits = int(high.clamp(max=cap).sum()) + n + int((high >= cap).sum()) * width
    else:
        bits = int(high.double().sum()) + n
    return k, cap, width, bits + n * k


def _bits(v: torch.Tensor, width: int) -> torch.Tensor:
    """The ``width`` low bits of each of ``v``, low first, as bools."""
    if not width:
        return torch.empty(0, dtype=torch.bool)
    return ((v[:, None] >> torch.arange(width)) & 1).reshape(-1).bool()


def _read_rice(data: torch.Tensor, n: int) -> tuple[torch.Tensor, int]:
    """The ``n`` values of the Rice stream at the start of ``data``, and its bytes.

    Raises:
        ValueError: ``data`` is shorter than the stream, or the stream holds fewer than ``n`` values.
    """
    start = _varint_end(data, 4)
    k, cap, width, n_unary = (int(x) for x in _read_varints(data[:start]))
    n_low = (n * k + 7) // 8
    if k > 62 or width > 63 or start + n_low + n_unary > data.numel():
        raise ValueError(f"a delta's stream of {n} values needs more than its {data.numel()} bytes")
    low = _unpack(data[start : start + n_low])[: n * k].view(n, k).to(torch.int64)
    start += n_low
    zeros = torch.nonzero(~_unpack(data[start : start + n_unary])).reshape(-1)
    start += n_unary
    if zeros.numel() < n:
        raise ValueError(f"a delta's stream holds {zeros.numel()} values, not {n}")
    zeros = zeros[:n]
    high = zeros - torch.cat([torch.full((1,), -1, dtype=zeros.dtype), zeros[:-1]]) - 1
    if cap:
        escaped = high == cap
        count = int(escaped.sum())
        end = start + (count * width + 7) // 8
        if end > data.numel():
            raise ValueError(f"a delta's stream of {n} values needs {end} bytes, it has {data.numel()}")
        bits = _unpack(data[start:end])[: count * width].view(count, width).to(torch.int64)
        high[escaped] = (bits << torch.arange(width)).sum(1)
        start = end
    return (high << k) | (low << torch.arange(k)).sum(1), start


def _pack(bits: torch.Tensor) -> torch.Tensor:
    """Bools as bytes, 8 a byte, the first in the low bit (the last byte padded with zeros)."""
    return torch.from_numpy(np.packbits(bits.numpy(), bitorder="little"))


def _unpack(data: torch.Tensor) -> torch.Tensor:
    """:func:`_pack`'s bools (the padding included)."""
    return torch.from_numpy(np.unpackbits(data.contiguous().numpy(), bitorder="little")).bool()


def _varint_end(data: torch.Tensor, count: int) -> int:
    """Where the first ``count`` varints of ``data`` end (a few header bytes: read one by one)."""
    seen = 0
    for i, byte in enumerate(data[: 10 * count].tolist()):
        seen += byte < 0x80
        if seen == count:
            return i + 1
    raise ValueError(f"a delta's stream does not start with {count} varints")


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
