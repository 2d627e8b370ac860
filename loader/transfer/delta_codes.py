"""The bit-level codes of :mod:`loader.transfer.delta`: Rice streams and LEB128 varints, on numpy arrays.

Vocabulary:

- **Rice code** (parameter ``k``): a non-negative integer ``v`` as its ``k`` low bits and ``v >> k`` (its **high
  part**) in unary (that many ones, then a zero), or, at ``cap`` or more, ``cap`` ones, a zero and the high part in
  ``width`` bits (an **escape**: a long tail, such as a sign change among small steps, costs its bits, not its size
  in ones).
- **stream**: ``n`` values' Rice codes as a head (varints ``k``, ``cap``, ``width`` and the unary part's bytes) and
  three bit arrays, each packed 8 bits a byte, the first in the low bit: the low parts as ``k`` **bit planes**
  (bit ``j`` of every value, then bit ``j + 1`` of every value: each plane is one shift and one pack), the unary
  codes, the escaped high parts (planes too). ``k`` and ``cap`` are the ones that cost fewest bits on an evenly
  strided sample of at most :data:`SAMPLE` values: within a few hundredths of a bit of the entropy of geometric
  values (the gaps of scattered changes).

Every step is a numpy pass over the values (no Python loop over them): numpy's ``packbits``, ``flatnonzero`` and
small-integer arithmetic run single-threaded at memory speed, which is what a push shares its cores with.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["SAMPLE", "read_rice", "read_varints", "rice", "rice_cost", "varints"]

#: at most this many values (evenly strided) choose a stream's parameters
SAMPLE = 1 << 16
_EMPTY = np.empty(0, dtype=np.uint8)
_Q = np.arange(65, dtype=np.float64)


def varints(values: Sequence[int]) -> bytes:
    """Non-negative integers as LEB128 bytes (7 bits a byte, the high bit set on all but each value's last)."""
    out = bytearray()
    for v in values:
        v = int(v)
        while v >= 0x80:
            out.append((v & 0x7F) | 0x80)
            v >>= 7
        out.append(v)
    return bytes(out)


def read_varints(data: np.ndarray, count: int) -> tuple[list[int], int]:
    """The first ``count`` LEB128 values of ``data`` and where they end.

    Raises:
        ValueError: ``data`` ends before ``count`` values, or a value has more than 9 bytes.
    """
    values, value, shift, at = [], 0, 0, 0
    for at, byte in enumerate(data[: 9 * count].tolist(), 1):
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            values.append(value)
            if len(values) == count:
                return values, at
            value, shift = 0, 0
        elif shift >= 63:
            raise ValueError("a delta's stream holds a value of more than 9 bytes")
    raise ValueError(f"a delta's stream does not start with {count} varints")


def rice_cost(v: np.ndarray) -> tuple[int, int, int, int, np.ndarray]:
    """``(k, cap, width, bits, high)``: the Rice parameter and the escape (a high part of ``cap`` or more ones is
    sent as ``cap`` ones and ``width`` bits; 0: none) that cost fewest bits on an evenly strided sample of at most
    :data:`SAMPLE` of the non-negative integers ``v`` (from a histogram of the high parts per ``k``, every ``k``
    at once), what they cost on all ``v``, and the high parts ``v >> k``."""
    n = v.size
    if not n:
        return 0, 0, 1, 0, v
    top = int(v.max()).bit_length()
    sample = v[:: max(1, n // SAMPLE)]
    m = sample.size
    middle = int(np.partition(sample, (m - 1) // 2)[(m - 1) // 2]).bit_length()
    ks = np.arange(max(0, middle - 4), min(62, middle + 6, top) + 1)  # past top every high part is 0: costlier
    shifted = sample[None, :] >> ks[:, None]
    plain = shifted.sum(axis=1, dtype=np.float64) + m
    rows = 65 * np.arange(ks.size)[:, None]
    counts = np.bincount((np.minimum(shifted, 64) + rows).ravel(), minlength=65 * ks.size)
    counts = counts.reshape(ks.size, 65).astype(np.float64)
    cost = counts * (_Q + 1)
    head = np.cumsum(cost, axis=1) - cost  # per k, the ones and zeros of the high parts below q
    above = m - (np.cumsum(counts, axis=1) - counts)  # per k, the high parts at or above q
    escaped = (head + above * (_Q + 1 + np.maximum(1, top - ks)[:, None]))[:, 1:]
    caps = escaped.argmin(axis=1) + 1
    best = (float("inf"), 0, 0)
    for i, k in enumerate(ks.tolist()):
        for c, bits in ((int(caps[i]), float(escaped[i, caps[i] - 1])), (0, float(plain[i]))):
            best = min(best, (bits + m * k, k, c))
    _, k, cap = best
    width = max(1, top - k)
    high = v >> k
    if cap:
        big = int(np.count_nonzero(high >= cap))
        bits = int(np.minimum(high, cap).sum()) + n + big * width
    else:
        bits = int(high.sum(dtype=np.float64)) + n
    return k, cap, width, bits + n * k, high


def rice(v: np.ndarray, limit: int | None = None) -> np.ndarray | None:
    """Non-negative integers ``v`` (int32 or int64) as a stream (see the module); None when it would not be smaller
    than ``limit`` bytes."""
    k, cap, width, bits, high = rice_cost(v)
    if limit is not None and bits / 8 >= limit:
        return None
    if cap:
        escaped = high >= cap
        ones = np.minimum(high, cap)
    else:
        escaped, ones = None, high
    ends = np.cumsum(ones + 1)  # each value's ones end with a zero
    unary = np.ones(int(ends[-1]) if ends.size else 0, dtype=np.bool_)
    unary[ends - 1] = False
    unary = np.packbits(unary, bitorder="little")
    escapes = _planes(high[escaped], width) if cap else _EMPTY
    head = np.frombuffer(varints([k, cap, width, unary.size]), dtype=np.uint8)
    return np.concatenate([head, _planes(v, k), unary, escapes])


def read_rice(data: np.ndarray, n: int) -> tuple[np.ndarray, int]:
    """The ``n`` values (int64) of the stream at the start of ``data``, and its bytes.

    Raises:
        ValueError: ``data`` is shorter than the stream, or the stream holds fewer than ``n`` values.
    """
    (k, cap, width, n_unary), start = read_varints(data, 4)
    n_low = (n * k + 7) // 8
    if k > 62 or width > 63 or start + n_low + n_unary > data.size:
        raise ValueError(f"a delta's stream of {n} values needs more than its {data.size} bytes")
    low = _read_planes(data[start : start + n_low], n, k)
    start += n_low
    zeros = np.flatnonzero(np.unpackbits(data[start : start + n_unary], bitorder="little") == 0)
    start += n_unary
    if zeros.size < n:
        raise ValueError(f"a delta's stream holds {zeros.size} values, not {n}")
    high = np.diff(zeros[:n], prepend=-1) - 1
    if cap:
        escaped = high == cap
        count = int(np.count_nonzero(escaped))
        end = start + (count * width + 7) // 8
        if end > data.size:
            raise ValueError(f"a delta's stream of {n} values needs {end} bytes, it has {data.size}")
        high[escaped] = _read_planes(data[start:end], count, width)
        start = end
    if k:
        high <<= k
        high |= low
    return high, start


def _planes(v: np.ndarray, width: int) -> np.ndarray:
    """The ``width`` low bits of ``v`` as bit planes (bit 0 of every value, then bit 1, ...), packed."""
    if not width or not v.size:
        return _EMPTY
    small = _small(width) or np.uint64
    low = v.astype(small)  # wraps: the low bits kept
    out = np.empty((width, v.size), dtype=np.bool_)
    for j in range(width):
        np.not_equal(low & low.dtype.type(1 << j), 0, out=out[j])
    return np.packbits(out.reshape(-1), bitorder="little")


def _read_planes(data: np.ndarray, n: int, width: int) -> np.ndarray:
    """:func:`_planes`' ``n`` values (int64), from exactly their bytes."""
    if not width or not n:
        return np.zeros(n, dtype=np.int64)
    planes = np.unpackbits(data, count=n * width, bitorder="little").reshape(width, n)
    small = _small(width) or np.uint64
    out = np.zeros(n, dtype=small)
    for j in range(width):
        out |= planes[j].astype(small) << small(j)
    return out.astype(np.int64) if small is not np.uint64 else out.view(np.int64)


def _small(width: int):
    """The smallest unsigned numpy integer holding ``width`` bits (None past 32: a uint64 view)."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if width <= 8 * np.dtype(dtype).itemsize:
            return dtype
    return None
