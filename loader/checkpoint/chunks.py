"""Where a checkpoint tensor's elements are stored: chunks, encodings, and the byte arithmetic of an element's place.

Vocabulary:

- **key**: a checkpoint tensor's name; its *index space* is its shape.
- **chunk**: a sub-box of a key's index space stored in one place: ``box`` (``(start, stop)`` per dim),
  ``location`` (the file or object holding it) and ``offset`` (the byte offset of its first element); the
  elements inside a chunk are C-contiguous in the chunk's own shape. A key is stored as one chunk (a safetensors
  tensor: its box is the whole shape) or as several that tile its index space (a DCP checkpoint, a tensor split
  across files). A key's chunks form a piecewise source, as a region's pieces do.
- **source**: what a compiled block reads: a key stored in one chunk is its own source; chunk ``j`` of a key
  stored in several is the source named :func:`chunk_source` ``(key, j)``, whose :class:`TensorInfo` is that
  chunk alone (its shape the box's, stored in one chunk). Every source is one chunk.
- **encoding**: how a source's elements are coded in its bytes. :data:`PLAIN` (one element of ``dtype`` every
  ``itemsize`` bytes, native order) is the only one the executor reads; a packed format (int4 two to a byte, …)
  declares its own and plugs in as a packed source plus a value program that decodes it, as
  :mod:`loader.rules.fp8` dequantizes float8 codes with their scales. :func:`check_encodings` refuses the rest
  before any byte is read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..storage.untrusted import err

#: a box: ``(start, stop)`` per dim
Box = tuple[tuple[int, int], ...]
#: the element encoding the executor reads: one element of the dtype every ``itemsize`` bytes
PLAIN = "plain"
#: the encodings the executor knows (:func:`check_encodings`)
ENCODINGS = frozenset({PLAIN})
_CHUNK_SOURCE = re.compile(r"(.*)\[chunk (\d+)\]", re.DOTALL)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A sub-box of a key's index space stored contiguously in one place.

    Attributes:
        box: ``(start, stop)`` per dim of the key's index space.
        location: the file (or object URL) holding it.
        offset: absolute byte offset of its first element in ``location``; the elements follow C-contiguously
            in the chunk's own shape.
    """

    box: Box
    location: str
    offset: int

    @property
    def shape(self) -> tuple[int, ...]:
        """The box's extent per dim."""
        return tuple(b - a for a, b in self.box)

    @property
    def numel(self) -> int:
        """Elements in the box."""
        return math.prod(b - a for a, b in self.box)


def chunk_source(key: str, index: int) -> str:
    """The source name of chunk ``index`` of ``key`` (what the blocks reading it name)."""
    return f"{key}[chunk {index}]"


def parse_chunk_source(name: str) -> tuple[str, int] | None:
    """``(key, index)`` of a :func:`chunk_source` name; None for any other name."""
    m = _CHUNK_SOURCE.fullmatch(name) if name.endswith("]") else None
    return (m[1], int(m[2])) if m is not None else None


@dataclass(frozen=True)
class TensorInfo:
    """Where one checkpoint tensor lives: its dtype, shape, encoding and chunks.

    A tensor stored in one chunk in the plain encoding (every safetensors tensor) is a :class:`TensorInfo` and keeps
    that chunk's place in ``file``, ``data_start`` and ``data_end``; one stored in several chunks, or in an encoding
    of its own, is a :class:`StoredTensorInfo` (:meth:`of_chunks`), which lists its chunks in ``split`` (``file``,
    ``data_start`` and ``data_end`` then None: it is read through its chunks' sources, :meth:`chunk_info`).

    Attributes:
        key: Tensor name in the checkpoint.
        file: Location of the file holding it (one chunk), else None.
        dtype: Torch dtype of the elements.
        shape: Tensor shape.
        data_start: Absolute byte offset of the first byte in ``file`` (``8 + header_len + begin``), else None.
        data_end: Absolute byte offset one past the last byte, else None.
        encoding: How the elements are coded (:data:`PLAIN`; see the module).
        split: The chunks of a tensor stored in several; ``()`` for one.
    """

    key: str
    file: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_start: int | None
    data_end: int | None
    # fields of a StoredTensorInfo only: a header's thousands of plain one-chunk infos are built without them
    encoding: ClassVar[str] = PLAIN
    split: ClassVar[tuple[Chunk, ...]] = ()

    @classmethod
    def of_chunks(
        cls, key: str, dtype: torch.dtype, shape: tuple[int, ...], chunks: Iterable[Chunk], encoding: str = PLAIN
    ) -> TensorInfo:
        """A tensor stored as ``chunks``, which must tile its index space: a :class:`TensorInfo` for one chunk of
        the whole shape in the plain encoding, else a :class:`StoredTensorInfo`.

        Raises:
            CheckpointError: a chunk lies outside the shape, two overlap, or they leave elements uncovered.
        """
        chunks, shape = tuple(chunks), tuple(shape)
        where = chunks[0].location if chunks else key
        for c in chunks:
            if len(c.box) != len(shape) or any(not (0 <= a <= b <= n) for (a, b), n in zip(c.box, shape)):
                raise err(c.location, f"chunk box {c.box} does not lie in shape {shape}", key)
        for i, c in enumerate(chunks):
            for d in chunks[i + 1 :]:
                if c.numel and d.numel and all(a < y and x < b for (a, b), (x, y) in zip(c.box, d.box)):
                    raise err(c.location, f"chunk boxes {c.box} and {d.box} overlap", key)
        covered = sum(c.numel for c in chunks)
        if covered != math.prod(shape):
            raise err(where, f"chunks cover {covered} of the {math.prod(shape)} elements of shape {shape}", key)
        if len(chunks) == 1 and chunks[0].box == tuple((0, n) for n in shape):
            c, nbytes = chunks[0], math.prod(shape) * dtype.itemsize
            if encoding == PLAIN:
                return TensorInfo(key, c.location, dtype, shape, c.offset, c.offset + nbytes)
            return StoredTensorInfo(key, c.location, dtype, shape, c.offset, c.offset + nbytes, encoding)
        return StoredTensorInfo(key, None, dtype, shape, None, None, encoding, chunks)

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        """Its chunks: ``split``, or the one chunk of the whole shape at ``data_start`` in ``file``."""
        if self.split:
            return self.split
        return (Chunk(tuple((0, n) for n in self.shape), self.file, self.data_start),)  # type: ignore[arg-type]

    @property
    def location(self) -> str | None:
        """The file errors name: ``file``, or the first chunk's location (None: a tensor without bytes)."""
        return self.split[0].location if self.split else self.file

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data (every chunk's; a tensor without a place: its elements')."""
        if self.data_start is None or self.data_end is None:
            return math.prod(self.shape) * self.dtype.itemsize
        return self.data_end - self.data_start

    def byte_at(self, element: int) -> int:
        """The absolute byte offset of flat element ``element`` (one chunk: C order from ``data_start``)."""
        return self.data_start + element * self.dtype.itemsize  # type: ignore[operator]

    def byte_span(self, lo: int, hi: int) -> tuple[int, int]:
        """The absolute byte span ``[start, end)`` of flat elements ``[lo, hi)`` (one chunk)."""
        item, start = self.dtype.itemsize, self.data_start
        return start + lo * item, start + hi * item  # type: ignore[operator]

    def run_grid(self, layout: Any) -> Any:
        """The byte runs of ``layout`` (a :class:`~regiontrace.executor.ReadLayout` of a block reading this
        one-chunk source) in its file: ``layout.grid(itemsize, data_start)``."""
        return layout.grid(self.dtype.itemsize, self.data_start)

    def spans(self) -> tuple[tuple[str, int, int], ...]:
        """``(location, start, end)``: the byte span of each chunk."""
        if not self.split:
            return ((self.file, self.data_start, self.data_end),)  # type: ignore[return-value]
        item = self.dtype.itemsize
        return tuple((c.location, c.offset, c.offset + c.numel * item) for c in self.split)

    def elements_in(self, nbytes: int) -> int:
        """How many whole elements ``nbytes`` bytes hold (at least 1)."""
        return max(1, nbytes // self.dtype.itemsize)

    def chunk_info(self, index: int) -> TensorInfo:
        """Chunk ``index`` as its own source: a one-chunk :class:`TensorInfo` named :func:`chunk_source`."""
        c = self.chunks[index]
        name = chunk_source(self.key, index) if self.split else self.key
        end = c.offset + c.numel * self.dtype.itemsize
        if self.encoding == PLAIN:
            return TensorInfo(name, c.location, self.dtype, c.shape, c.offset, end)
        return StoredTensorInfo(name, c.location, self.dtype, c.shape, c.offset, end, self.encoding)


@dataclass(frozen=True)
class StoredTensorInfo(TensorInfo):
    """A :class:`TensorInfo` stored as several chunks (``split``), or in an encoding other than :data:`PLAIN`."""

    encoding: str = PLAIN
    split: tuple[Chunk, ...] = ()


def check_encodings(infos: Iterable[TensorInfo]) -> None:
    """Refuse a tensor whose encoding the executor does not read, naming its file and key.

    Raises:
        CheckpointError: an encoding not in :data:`ENCODINGS`.
    """
    for info in infos:
        if info.encoding not in ENCODINGS:
            raise err(
                info.location,  # type: ignore[arg-type]
                f"element encoding {info.encoding!r} is not one the loader reads (known: {sorted(ENCODINGS)}); a "
                "packed format needs a value program that decodes it",
                info.key,
            )


def source_info(tensors: Mapping[str, TensorInfo], name: str, memo: dict[str, TensorInfo]) -> TensorInfo:
    """The :class:`TensorInfo` of source ``name``: a key's own, or a chunk's (kept in ``memo``).

    Raises:
        KeyError: ``name`` is neither a key nor a chunk source of one.
    """
    info = memo.get(name)
    if info is not None:
        return info
    parsed = parse_chunk_source(name)
    if parsed is None or parsed[0] not in tensors or not tensors[parsed[0]].split:
        raise KeyError(name)
    key, index = parsed
    if index >= len(tensors[key].split):
        raise KeyError(name)
    info = memo[name] = tensors[key].chunk_info(index)
    return info
