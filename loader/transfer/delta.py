"""Only what changed: a buffer's new value as the runs of elements that differ from the value last sent.

Vocabulary:

- **base**: what the receiver holds (the value last sent, bit for bit); the sender keeps a copy of it (the stated
  memory bound: one copy of every buffer it sends, in the receiver's dtype).
- **changed element**: one whose bits differ between base and new (compared as integers of the element's width,
  so ``-0.0`` against ``0.0`` and NaN payloads count as changes, and equal bits never do).
- **run**: a maximal stretch of consecutive changed elements.
- **Rice stream**: non-negative integers as Rice codes with escapes, their parameters chosen per stream as the
  ones that cost fewest bits (:mod:`loader.transfer.delta_codes`).
- **index**: the runs' positions: the gap before each run (minus one after the first) and its length minus one,
  two Rice streams.
- **values**: the changed elements, either ``raw`` (their bytes), or ``diff``: each as the zigzag of its integer
  difference ``new bits - old bits`` (element-width, wrapping; for floats of one sign the distance in ulps),
  minus one, as a Rice stream: an optimizer step that moves bf16 weights by an ulp or two costs ~2 bits a change.
  Whichever is smaller, per buffer.
- **delta**: the index and values; or, when that is not smaller, the whole buffer (``full``).

Random changes at random places cannot be sent in fewer bits than their entropy: a change at density ``p`` costs
about ``H(p) / p`` bits of position (11.4 at 0.1 %, 8.1 at 1 %, 4.7 at 10 %) besides its value; this encoding
comes within ~0.1 bit of that. Encoding is one comparison pass over the buffer (8 bytes at a time: an unchanged
buffer costs that alone) and a handful of numpy passes over the changes; applying, a handful of passes over the
changes; :func:`apply_delta` on the base gives ``new`` bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from .delta_codes import read_rice, read_varints, rice, varints

__all__ = ["Delta", "Written", "apply_delta", "encode_delta", "changed_elements"]

#: :meth:`Delta.to_bytes`' header: flags (1: full, 2: diff values), runs, index bytes, values bytes, changed
#: elements (LEB128 varints: 5 bytes for a small buffer)
HEADER = ("flags", "runs", "index_bytes", "values_bytes", "changed")
FULL, DIFF = 1, 2
#: integer views of each element width (bits compared, never values)
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: signed numpy views of each element width (differences wrap at the element's width)
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_EMPTY = torch.empty(0, dtype=torch.uint8)


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
        return len(self._header()) + int(self.index.numel() + self.values.numel())

    def _header(self) -> bytes:
        flags = FULL * int(self.full) + DIFF * int(self.diff)
        return varints([flags, self.runs, int(self.index.numel()), int(self.values.numel()), self.changed])

    def to_bytes(self) -> torch.Tensor:
        """The delta as one byte buffer (:data:`HEADER` as LEB128 varints, then the index, then the values): what
        a sender puts on the wire, :meth:`from_bytes` reads it back. Its size is :attr:`nbytes`."""
        head = torch.frombuffer(bytearray(self._header()), dtype=torch.uint8)
        return torch.cat([head, self.index.reshape(-1), self.values.reshape(-1)])

    @staticmethod
    def from_bytes(data: torch.Tensor) -> Delta:
        """The delta :meth:`to_bytes` wrote.

        Raises:
            ValueError: ``data`` is shorter or longer than its header says.
        """
        try:
            (flags, runs, n_index, n_values, changed), start = read_varints(_np(data), len(HEADER))
        except ValueError:
            raise ValueError(f"a delta of {data.numel()} bytes has no header") from None
        if start + n_index + n_values != data.numel():
            raise ValueError(f"a delta of {data.numel()} bytes whose header says {start} + {n_index} + {n_values}")
        if flags & ~(FULL | DIFF):
            raise ValueError(f"a delta whose header has unknown flags {flags}")
        index = data[start : start + n_index]
        values = data[start + n_index :].clone()  # its own storage: viewed as the elements' dtype
        return Delta(bool(flags & FULL), runs, index, values, changed, bool(flags & DIFF))


def _ints(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(_INT[t.element_size()])


def _np(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's numpy view (shared memory); a copy of any other."""
    return t.detach().cpu().numpy()


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
    an, bn = _np(a).view(_SIGNED[size]), _np(b).view(_SIGNED[size])
    where = _changed(an, bn)
    if not where.size:
        return Delta(False, 0, _EMPTY, _EMPTY, 0)
    whole = b.view(torch.uint8)
    step = np.diff(where)
    breaks = np.flatnonzero(step != 1)  # the last changed element of each run but the last
    gaps = np.concatenate([where[:1], step[breaks] - 2])
    lengths = np.diff(np.concatenate([[-1], breaks, [where.size - 1]])) - 1
    index = np.concatenate([rice(gaps), rice(lengths)])
    moved = bn[where]
    values, diff = moved.view(np.uint8), False
    d = (moved - an[where]).astype(np.int32 if size <= 2 else np.int64)  # wraps at the element's width
    z = (d << 1) ^ (d >> (8 * d.itemsize - 1))  # zigzag: 0, -1, 1, -2, ... -> 0, 1, 2, 3, ...
    if size < 8 or bool((z > 0).all()):  # every difference fits a non-negative integer (8-byte ones may not)
        z -= 1
        coded = rice(z, limit=values.size)
        if coded is not None and coded.size < values.size:
            values, diff = coded, True
    if index.size + values.size >= whole.numel():
        return Delta(True, 0, _EMPTY, whole.clone(), int(where.size))
    return Delta(False, int(breaks.size) + 1, torch.from_numpy(index), torch.from_numpy(values), int(where.size), diff)


def _changed(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The indices of the elements whose bits differ: compared 8 bytes at a time first (half the work of the
    elements' own width for bf16), then within the changed words where few changed, elementwise where many did."""
    per = 8 // a.itemsize
    whole = a.size - a.size % per
    if per == 1 or not whole or a.ctypes.data % 8 or b.ctypes.data % 8:
        return np.flatnonzero(a != b)
    wa, wb = a[:whole].view(np.int64), b[:whole].view(np.int64)
    stride = max(1, wa.size >> 12)
    if np.count_nonzero(wa[::stride] != wb[::stride]) * 8 > wa[::stride].size:
        return np.flatnonzero(a != b)  # dense (as a sample of words says): one elementwise pass
    words = np.flatnonzero(wa != wb)
    if words.size * 8 > wa.size:  # dense after all: refining every changed word would cost more
        return np.flatnonzero(a != b)
    inside = np.flatnonzero((wa[words] ^ wb[words]).view(a.dtype) != 0)
    tail = np.flatnonzero(a[whole:] != b[whole:]) + whole
    return np.concatenate([words[inside // per] * per + inside % per, tail])


@dataclass(frozen=True)
class Written:
    """The elements :func:`apply_delta` wrote: ``where`` (their indices, ascending; None: every element) and, when
    asked for, ``old``: their bits before (the target's integer view), which :meth:`undo` writes back."""

    where: np.ndarray | None
    old: np.ndarray | None = None

    def undo(self, target: torch.Tensor) -> None:
        """Put the elements written back in ``target`` (the tensor written): it holds the base again.

        Raises:
            ValueError: nothing was kept (``apply_delta(..., keep=False)``).
        """
        if self.old is None:
            raise ValueError("a delta applied without keep=True cannot be undone")
        with _elements(target) as flat:
            if self.where is None:
                flat[...] = self.old
            else:
                flat[self.where] = self.old


def apply_delta(target: torch.Tensor, delta: Delta, keep: bool = False) -> Written:
    """Write ``delta`` into ``target`` (holding the base) in place: afterwards it holds ``new`` bit for bit. Returns
    what it wrote (with ``keep``, the old bits too: :meth:`Written.undo`).

    Raises:
        ValueError: the delta does not fit ``target`` (runs past its end, a size that does not match).
    """
    if not target.is_contiguous():
        raise ValueError("a delta is applied to a contiguous tensor")
    size, numel = target.element_size(), target.numel()
    data = _np(delta.values)
    if delta.full:
        if data.size != numel * size:
            raise ValueError(f"a whole buffer of {data.size} bytes for {numel} elements")
        with _elements(target) as flat:
            old = flat.copy() if keep else None
            flat[...] = data.view(flat.dtype)
        return Written(None, old)
    if delta.runs == 0:
        return Written(np.empty(0, dtype=np.int64), np.empty(0, dtype=_SIGNED[size]) if keep else None)
    where = _positions(_np(delta.index), delta.runs, numel)
    with _elements(target) as flat:
        if not delta.diff:
            if where.size * size != data.size:
                raise ValueError(f"a delta of {where.size} elements with {data.size} bytes of values")
            old = flat[where] if keep else None
            flat[where] = data.view(flat.dtype)
            return Written(where, old)
        z, used = read_rice(data, where.size)
        if used != data.size:
            raise ValueError(f"a delta of {where.size} elements with {data.size} bytes of differences")
        z += 1
        old = flat[where]
        flat[where] = old + ((z >> 1) ^ -(z & 1)).astype(flat.dtype)  # wraps at the element's width
    return Written(where, old if keep else None)


@contextlib.contextmanager
def _elements(target: torch.Tensor) -> Iterator[np.ndarray]:
    """A contiguous ``target``'s elements as signed integers of their width, written through (a CPU tensor's own
    memory; another device's through a host copy, copied back on exit)."""
    ints = target.detach().reshape(-1).view(_INT[target.element_size()])
    host = ints if ints.device.type == "cpu" else ints.cpu()
    yield host.numpy().view(_SIGNED[target.element_size()])
    if host is not ints:
        ints.copy_(host)


def _positions(index: np.ndarray, runs: int, numel: int) -> np.ndarray:
    """The changed elements' indices the runs of ``index`` (two Rice streams) cover, checked against ``numel``.

    Raises:
        ValueError: the streams do not hold ``runs`` runs, or the runs do not fit ``numel`` elements.
    """
    if runs > numel:
        raise ValueError(f"a delta of {runs} runs does not fit {numel} elements")
    gaps, used = read_rice(index, runs)
    lengths, more = read_rice(index[used:], runs)
    if used + more != index.size:
        raise ValueError(f"a delta's index holds {index.size} bytes, not {runs} runs' worth")
    if min(int(gaps.min()), int(lengths.min())) < 0 or max(int(gaps.max()), int(lengths.max())) >= numel:
        raise ValueError(f"a delta of {runs} runs with a gap or a length that does not fit {numel} elements")
    lengths += 1  # below numel each: the sums below cannot overflow
    starts = np.cumsum(gaps + 1 + np.concatenate([[-1], lengths[:-1]]))
    elements = int(lengths.sum())
    if int(starts[-1] + lengths[-1]) > numel:
        raise ValueError(f"a delta of {runs} runs ({elements} elements) does not fit {numel} elements")
    if elements == runs:  # every run one element (scattered changes)
        return starts
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(elements)
