"""Host-shared reads: the local files the ranks of one host read together, read with the kernel's readahead where,
between them, they read most of a file they share.

Vocabulary:

- a *host*: one kernel (its boot id), so one page cache;
- a file's *key*: its identity (device, inode, size, mtime, ctime): the same key on one host is the same cached
  pages;
- a rank's *coverage* of a file: the granules (:data:`GRANULE` bytes) holding a byte of its blocks' spans;
- a rank's *files*: ``{path: [key, size, coverage as hex]}`` of the local files it reads (:func:`post`);
- a *post*: what a rank publishes to its host's ranks: its host and its files (packed: :func:`pack`);
- a rank's *mates*: the ranks of its host that read local files (:func:`mates`).

A rank that reads a small part of a local file tells the kernel so (``POSIX_FADV_RANDOM``: no readahead), which
keeps its physical reads at the page bound. But ranks started on one host (``torchrun``) usually share one copy of
the checkpoint and one page cache: a tensor-parallel rank reads a quarter of each file, and its host's four ranks
read all of it. Read page by page, the file then lands in the page cache as 4 KiB folios (slower to copy out of on
every later load, and read from the disk in smaller requests); read with readahead, in large folios, and no byte is
read that the host's ranks do not need (bench/folio_probe.py, docs/loading.md "The page cache's folios").

A file is read with readahead on a rank when at least two of its mates read it (same key) and their coverages
together hold at least ``fraction`` of it (:func:`files_to_read_ahead`; :func:`read_ahead_shared` tells the
reader). The distributed load gathers every rank's post (:mod:`loader.load`: its host and its files, compressed).
A post that does not unpack to such files is a :class:`PostError` naming the rank that posted it and what is wrong
with it.
"""

from __future__ import annotations

import base64
import binascii
import json
import socket
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..checkpoint import Checkpoint
from ..plan import BlockRead
from ..storage import RangeReader
from ..storage.capabilities import ReadsAhead, capability
from .reads import SPARSE_FRACTION

#: bytes of a coverage granule (a 5 GB file is 4 800 of them: 600 bytes of bits, less once compressed)
GRANULE = 1 << 20

Post = dict[str, Any]


def host_id() -> str:
    """This host's kernel: its boot id (ranks in containers on one kernel share its page cache), else its name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return "boot:" + f.read().strip()
    except OSError:
        return "host:" + socket.gethostname()


def coverage(spans: Sequence[tuple[int, int]], size: int, granule: int = GRANULE) -> np.ndarray:
    """The granules of a ``size``-byte file holding a byte of ``spans`` (``bool``, one per granule)."""
    out = np.zeros(max(1, -(-size // granule)), dtype=bool)
    for a, b in spans:
        if b > a:
            out[a // granule : (b - 1) // granule + 1] = True
    return out


def _encode(bits: np.ndarray) -> str:
    return np.packbits(bits).tobytes().hex()  # compressed with the rest of the files (:func:`pack`)


def _decode(text: str, n: int) -> np.ndarray:
    return np.unpackbits(np.frombuffer(bytes.fromhex(text), dtype=np.uint8))[:n].astype(bool)


def post(checkpoint: Checkpoint, reads: Sequence[BlockRead]) -> Post:
    """This rank's post: the local files ``reads`` read (those of known identity), with their keys and coverage."""
    identities = checkpoint.identities
    spans: dict[str, list[tuple[int, int]]] = {}
    for r in reads:
        info = checkpoint[r.block.source]
        identity = identities.get(info.file)
        if getattr(identity, "inode", None) is None:  # a remote object, or an unknown identity: not shared here
            continue
        spans.setdefault(info.file, []).append(info.byte_span(*r.block.source_span()))
    files = {}
    for f, s in spans.items():
        i = identities[f]
        files[f] = [f"{i.device}:{i.inode}:{i.size}:{i.mtime_ns}:{i.ctime_ns}", i.size, _encode(coverage(s, i.size))]
    return {"host": host_id(), "files": files}


def pack(files: Mapping[str, Any]) -> str:
    """A rank's ``files`` as the text it posts (compressed: coverages of a TP rank are long runs of ones)."""
    return base64.b64encode(zlib.compress(json.dumps(files).encode())).decode()


class PostError(ValueError):
    """A rank's post of its files is not what :func:`pack` makes (names the rank, and what is wrong)."""


def unpack(text: str, rank: int | None = None) -> dict[str, Any]:
    """The ``files`` of a :func:`pack` text, posted by ``rank`` (named in errors), checked.

    Raises:
        PostError: not base64, not zlib, not JSON, or not ``{path: [key, size, coverage as hex]}`` (naming
            ``rank``, what is wrong and the start of what it posted).
    """
    who = "a rank" if rank is None else f"rank {rank}"

    def bad(what: str) -> PostError:
        shown = text[:60] + ("..." if len(text) > 60 else "")
        return PostError(f"{who} posted a list of its files that {what} ({len(text)} characters: {shown!r})")

    try:
        raw = zlib.decompress(base64.b64decode(text, validate=True))
    except (binascii.Error, ValueError) as e:
        raise bad(f"is not base64 ({e})") from None
    except zlib.error as e:
        raise bad(f"is not compressed with zlib ({e})") from None
    try:
        files = json.loads(raw)
    except ValueError as e:
        raise bad(f"is not JSON ({e})") from None
    wrong = _wrong_files(files)
    if wrong:
        raise bad(wrong)
    return files


def _wrong_files(files: object) -> str:
    """What makes ``files`` other than ``{path: [key, size, coverage as hex]}`` (``""``: nothing)."""
    if not isinstance(files, dict):
        return f"is a JSON {type(files).__name__}, not an object of files"
    for path, entry in files.items():
        if not (isinstance(entry, list) and len(entry) == 3):
            return f"gives {path!r} {json.dumps(entry)[:40]}, not [key, size, coverage]"
        key, size, bits = entry
        if not isinstance(key, str) or isinstance(size, bool) or not isinstance(size, int) or size < 0:
            shown = f"the key {json.dumps(key)[:40]} and size {json.dumps(size)[:20]}"
            return f"gives {path!r} {shown}: not a string and a size"
        n = max(1, -(-size // GRANULE))
        if not isinstance(bits, str) or len(bits) != 2 * -(-n // 8):
            return f"gives {path!r} a coverage that is not {-(-n // 8)} bytes of hex for its {size} bytes"
        try:
            bytes.fromhex(bits)
        except ValueError:
            return f"gives {path!r} a coverage that is not hex"
    return ""


def mates(posts: Sequence[Mapping[str, Any]], rank: int) -> list[int]:
    """The ranks of ``rank``'s host (``posts[r]["host"]``) that read local files (``posts[r]["files"]`` true),
    ascending; ``rank`` among them when it reads any."""
    host = posts[rank]["host"]
    return [r for r, p in enumerate(posts) if p["host"] == host and p["files"]]


def files_to_read_ahead(files: Sequence[Mapping[str, Any]], index: int, fraction: float) -> set[str]:
    """The files of ``files[index]`` that rank reads with readahead, given the files of every rank of its host
    (:func:`mates`): read (same key) by at least two of them, whose coverages together hold at least ``fraction`` of
    the file. Every rank of the host computes its own from the same files."""
    coded: dict[tuple[str, int], list[str]] = {}  # every mate's coverage of each key
    for theirs in files:
        for key, size, bits in theirs.values():
            coded.setdefault((key, size), []).append(bits)
    out = set()
    for path, (key, size, _) in files[index].items():
        readers = coded[(key, size)]
        if len(readers) < 2:
            continue
        n = max(1, -(-size // GRANULE))
        union = np.zeros(n, dtype=bool)
        for bits in readers:
            union |= _decode(bits, n)
        if union.sum() >= fraction * n:
            out.add(path)
    return out


def read_ahead_shared(posts: Sequence[Mapping[str, Any]], reader: RangeReader, rank: int) -> int:
    """Tell ``reader`` to read with readahead the local files ``rank``'s mates read most of together; how many of
    its files that is (0: it reads no local file, or ``reader`` keeps no readahead).

    Args:
        posts: every rank's post (index = rank): its ``host``, and its ``files`` as :func:`pack` made them, or None.
        reader: this rank's reader.
        rank: this rank.

    Raises:
        PostError: a mate's files do not unpack (raised on that host's ranks only: the caller agrees it).
    """
    ahead = capability(reader, ReadsAhead)
    if posts[rank]["files"] is None or ahead is None:
        return 0
    ranks = mates(posts, rank)
    together = [unpack(posts[r]["files"], r) for r in ranks]
    files = files_to_read_ahead(together, ranks.index(rank), SPARSE_FRACTION)
    ahead.read_ahead(files)
    return len(files)
