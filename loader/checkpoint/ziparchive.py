"""A zip archive of stored (uncompressed) records, read by range from a :class:`~loader.storage.Store`: its end
records and central directory from the file's tail, then each record's local header, so that every record is known
by the byte span of its data in the file and nothing is downloaded whole.

Vocabulary: a *record* is one archive member: its name and the span ``[data_start, data_end)`` of its bytes. The
*central directory* lists the records; each record's *local header* precedes its bytes. What is read:

- the end-of-central-directory record (the last bytes, after at most a 64 KiB comment), and the zip64 end record
  its locator points at (zip64 is read: sizes and offsets past 4 GiB, in the central directory's zip64 extra
  fields and the local headers');
- every central directory entry: stored (method 0) only, not encrypted, one disk, UTF-8 or CP437 names, no two
  alike; each local header agrees with its entry (name, method; sizes, or zeros with a data descriptor after the
  data, as ``torch.save`` writes them);
- the records lie inside the file, before the central directory, and no two overlap.

Anything else is a :class:`~loader.errors.CheckpointError` naming the file and the record.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from ..errors import CheckpointError
from ..storage import Store
from ..storage.untrusted import err, short

#: bytes read from a file's end first: the end record with the longest comment, the zip64 locator, and the central
#: directory of most checkpoints
TAIL_BYTES = (64 << 10) + 22 + 20 + 56
#: bytes a remote archive's end is read first: the end records and a few records' directory (``torch.save``'s, a
#: DCP chunk's); an archive whose end records are not all in them is read again with :data:`TAIL_BYTES`
REMOTE_TAIL_BYTES = (4 << 10) + 22 + 20 + 56
#: a central directory larger than this is refused before it is read (a million records is ~80 MiB)
MAX_DIRECTORY_BYTES = 128 << 20
#: bytes of a local header read beyond its fixed part and name: ``torch.save`` pads its extra field to 64 bytes
LOCAL_SLACK = 128
#: local headers of a remote archive read at once (one request each run of them)
REMOTE_HEADER_THREADS = 16
#: a remote archive's local headers closer than this are read in one request (the data between them read through)
MERGE_GAP = 4 << 10
#: ... and in runs of at most this many bytes
MERGE_SPAN = 64 << 10
_EOCD = struct.Struct("<IHHHHIIH")  # signature, disk, cd disk, entries here, entries, cd size, cd offset, comment
_LOCATOR = struct.Struct("<IIQI")  # signature, disk of the zip64 end record, its offset, disks
_EOCD64 = struct.Struct("<IQHHIIQQQQ")  # signature, size, made by, needed, disk, cd disk, here, entries, size, offset
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_SIG_EOCD, _SIG_LOCATOR, _SIG_EOCD64 = 0x06054B50, 0x07064B50, 0x06064B50
_SIG_CENTRAL, _SIG_LOCAL = 0x02014B50, 0x04034B50
_MAX16, _MAX32 = 0xFFFF, 0xFFFFFFFF
_ZIP64_EXTRA = 0x0001
_ENCRYPTED, _DESCRIPTOR, _UTF8 = 0x1, 0x8, 0x800
_METHODS = {8: "deflate", 12: "bzip2", 14: "LZMA", 93: "zstd", 95: "xz", 99: "AES-encrypted"}


class Record(NamedTuple):
    """One stored member of an archive.

    Attributes:
        name: Its name in the archive.
        header: Byte offset of its local header.
        data_start: Byte offset of its first data byte (past the local header, name and extra field).
        size: Bytes of data.
    """

    name: str
    header: int
    data_start: int
    size: int

    @property
    def data_end(self) -> int:
        """One past its last data byte."""
        return self.data_start + self.size


class _Entry(NamedTuple):
    """A central directory entry: what the local header must agree with."""

    name: str
    raw_name: bytes
    flags: int
    method: int
    crc: int
    size: int
    header: int


def _tail(path: str, store: Store, size: int, identity: object, nbytes: int = TAIL_BYTES) -> tuple[bytes, int]:
    """The file's last ``nbytes`` bytes and the offset they start at."""
    start = max(0, size - nbytes)
    return store.read_range(path, start, size, identity), start


def _end(path: str, store: Store, size: int, identity: object) -> tuple[bytes, int, tuple[int, int, int, int]]:
    """``(tail, its offset, the directory's span)``; a remote archive's tail is read small first (its end records
    and directory are a few hundred bytes in a checkpoint), then as a local one's where they are not all in it."""
    if store.remote and size > REMOTE_TAIL_BYTES:
        tail, base = _tail(path, store, size, identity, REMOTE_TAIL_BYTES)
        try:
            return tail, base, _directory_span(path, tail, base, size)
        except CheckpointError:
            pass  # a long comment, or a zip64 end record farther back: read as much as a local archive
    tail, base = _tail(path, store, size, identity)
    return tail, base, _directory_span(path, tail, base, size)


def _end_record(path: str, tail: bytes, base: int, size: int) -> int:
    """The offset in ``tail`` of the end-of-central-directory record (its comment runs exactly to the end)."""
    pos = len(tail) - _EOCD.size
    while pos >= 0:
        pos = tail.rfind(b"PK\x05\x06", 0, pos + 4)
        if pos < 0:
            break
        if pos + _EOCD.size <= len(tail) and base + pos + _EOCD.size + _EOCD.unpack_from(tail, pos)[7] == size:
            return pos
        pos -= 1
    raise err(path, f"not a zip archive: no end-of-central-directory record in its last {len(tail)} bytes")


def _directory_span(path: str, tail: bytes, base: int, size: int) -> tuple[int, int, int, int]:
    """``(entries, directory offset, directory size, where the end records start)`` from the end records."""
    pos = _end_record(path, tail, base, size)
    _, disk, cd_disk, here, entries, cd_size, cd_offset, _ = _EOCD.unpack_from(tail, pos)
    end_start = base + pos
    locator = pos - _LOCATOR.size
    if locator >= 0 and struct.unpack_from("<I", tail, locator)[0] == _SIG_LOCATOR:
        _, _, at, disks = _LOCATOR.unpack_from(tail, locator)
        if disks > 1:
            raise err(path, f"zip64 locator names {disks} disks: a multi-disk archive is not read")
        if not (0 <= at - base and at + _EOCD64.size <= base + locator):
            raise err(path, f"zip64 end record at {at} lies outside the bytes before its locator")
        fields = _EOCD64.unpack_from(tail, at - base)
        if fields[0] != _SIG_EOCD64:
            raise err(path, f"zip64 locator points at {at}, which holds no zip64 end record")
        z_disk, z_cd_disk, z_here, z_entries, z_size, z_offset = fields[4:]
        for name, plain, wide in (
            ("entries", entries, z_entries),
            ("directory size", cd_size, z_size),
            ("directory offset", cd_offset, z_offset),
            ("entries on disk", here, z_here),
        ):
            if plain not in (_MAX16, _MAX32) and plain != wide:
                raise err(path, f"end record's {name} {plain} disagrees with the zip64 end record's {wide}")
        disk, cd_disk, here, entries, cd_size, cd_offset = z_disk, z_cd_disk, z_here, z_entries, z_size, z_offset
        end_start = at
    elif _MAX32 in (cd_size, cd_offset) or entries == _MAX16:
        raise err(path, "end record holds zip64 sentinels but the archive has no zip64 end record")
    if disk or cd_disk or here != entries:
        raise err(path, "a multi-disk archive (spanned or split zip) is not read")
    if cd_size > MAX_DIRECTORY_BYTES:
        raise err(path, f"central directory of {cd_size} bytes exceeds the {MAX_DIRECTORY_BYTES}-byte limit")
    if cd_offset + cd_size > end_start:
        raise err(path, f"central directory [{cd_offset}, {cd_offset + cd_size}) runs into its end records")
    return entries, cd_offset, cd_size, end_start


def _zip64(path: str, name: str, extra: bytes, values: list[int], wide: Iterable[bool]) -> list[int]:
    """``values`` with each one ``wide`` marks (a 32-bit field at its sentinel) taken from the zip64 extra field."""
    fields = _extra_fields(path, name, extra)
    wanted = [i for i, w in enumerate(wide) if w]
    if not wanted:
        return values
    data = fields.get(_ZIP64_EXTRA)
    if data is None or len(data) < 8 * len(wanted):
        raise err(path, f"record {short.repr(name)}: a field at its zip64 sentinel, and no zip64 extra field for it")
    out = list(values)
    for j, i in enumerate(wanted):
        out[i] = struct.unpack_from("<Q", data, 8 * j)[0]
    return out


def _extra_fields(path: str, name: str, extra: bytes) -> dict[int, bytes]:
    fields, pos = {}, 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if pos + 4 + n > len(extra):
            raise err(path, f"record {short.repr(name)}: extra field {tag:#06x} runs past the extra data")
        fields.setdefault(tag, extra[pos + 4 : pos + 4 + n])
        pos += 4 + n
    return fields


def _decode(path: str, raw: bytes, flags: int) -> str:
    try:
        return raw.decode("utf-8" if flags & _UTF8 else "cp437")
    except UnicodeDecodeError:
        raise err(path, f"record name {short.repr(raw)} is flagged UTF-8 but is not") from None


def _entries(path: str, data: bytes, count: int) -> list[_Entry]:
    """Parse ``count`` central directory entries from ``data`` (exactly the directory)."""
    out, pos, seen = [], 0, set()
    for i in range(count):
        if pos + _CENTRAL.size > len(data):
            raise err(path, f"central directory truncated: entry {i} of {count} runs past its {len(data)} bytes")
        f = _CENTRAL.unpack_from(data, pos)
        if f[0] != _SIG_CENTRAL:
            raise err(path, f"central directory entry {i} of {count} has a bad signature at directory byte {pos}")
        flags, method, crc, csize, usize, nlen, xlen, clen, disk, header = (
            f[3],
            f[4],
            f[7],
            f[8],
            f[9],
            f[10],
            *f[11:14],
            f[16],
        )
        end = pos + _CENTRAL.size + nlen + xlen + clen
        if end > len(data):
            raise err(path, f"central directory truncated: entry {i} of {count} runs past its {len(data)} bytes")
        raw = data[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen]
        name = _decode(path, raw, flags)
        extra = data[pos + _CENTRAL.size + nlen : pos + _CENTRAL.size + nlen + xlen]
        wide = (usize == _MAX32, csize == _MAX32, header == _MAX32)
        usize, csize, header = _zip64(path, name, extra, [usize, csize, header], wide)
        _check_entry(path, name, flags, method, csize, usize, disk)
        if name in seen:
            raise err(path, f"record {short.repr(name)} appears twice in the central directory")
        seen.add(name)
        out.append(_Entry(name, raw, flags, method, crc, usize, header))
        pos = end
    if pos != len(data):
        raise err(path, f"central directory holds {len(data) - pos} bytes after its {count} entries")
    return out


def _where(name: str) -> str:
    """How an error names a record (made only when one is raised: an archive holds thousands)."""
    return f"record {short.repr(name)}"


def _check_entry(path: str, name: str, flags: int, method: int, csize: int, usize: int, disk: int) -> None:
    if flags & _ENCRYPTED:
        raise err(path, f"{_where(name)} is encrypted: not read")
    if method != 0:
        what = _METHODS.get(method, f"method {method}")
        raise err(path, f"{_where(name)} is compressed ({what}): only stored (uncompressed) records are read in place")
    if csize != usize:
        raise err(path, f"{_where(name)} is stored but its compressed size {csize} differs from its size {usize}")
    if disk:
        raise err(path, f"{_where(name)} starts on disk {disk}: a multi-disk archive is not read")


def _window(entry: _Entry, end: int) -> tuple[int, int]:
    """The bytes read for ``entry``'s local header: its fixed part, name and :data:`LOCAL_SLACK`, up to ``end``."""
    return entry.header, min(end, entry.header + _LOCAL.size + len(entry.raw_name) + LOCAL_SLACK)


def _local(path: str, store: Store, entry: _Entry, end: int, identity: object, head: bytes) -> Record:
    """The record of ``entry`` from its local header, whose :func:`_window` is ``head`` (a long extra field: one
    more read)."""
    if len(head) < _LOCAL.size:
        raise err(
            path, f"{_where(entry.name)}: local header at {entry.header} runs past the next record or the directory"
        )
    sig, _, flags, method, _, _, crc, csize, usize, nlen, xlen = _LOCAL.unpack_from(head)
    if sig != _SIG_LOCAL:
        raise err(path, f"{_where(entry.name)}: no local header at {entry.header} (bad signature)")
    data_start = entry.header + _LOCAL.size + nlen + xlen
    if data_start + entry.size > end:
        raise err(
            path,
            f"{_where(entry.name)}: data [{data_start}, {data_start + entry.size}) overlaps the next record or the "
            "directory",
        )
    if len(head) < _LOCAL.size + nlen + xlen:
        head += store.read_range(path, entry.header + len(head), data_start, identity)
    raw = head[_LOCAL.size : _LOCAL.size + nlen]
    if raw != entry.raw_name or method != entry.method or (flags ^ entry.flags) & (_UTF8 | _ENCRYPTED):
        got = f"name {short.repr(raw)}, method {method}, flags {flags:#x}"
        raise err(path, f"{_where(entry.name)}: local header ({got}) disagrees with the central directory")
    extra = head[_LOCAL.size + nlen : _LOCAL.size + nlen + xlen]
    usize, csize = _zip64(path, entry.name, extra, [usize, csize], (usize == _MAX32, csize == _MAX32))
    deferred = flags & _DESCRIPTOR and (crc, csize, usize) == (0, 0, 0)  # sizes in a data descriptor after the data
    if not deferred and (crc, csize, usize) != (entry.crc, entry.size, entry.size):
        got = f"crc {crc:#x}, sizes {csize}/{usize}"
        raise err(
            path,
            f"{_where(entry.name)}: local header ({got}) disagrees with the central directory's "
            f"({entry.crc:#x}, {entry.size})",
        )
    return Record(entry.name, entry.header, data_start, entry.size)


def read_records(path: str, store: Store, size: int, identity: object, *, threads: bool = True) -> dict[str, Record]:
    """Every record of the stored zip archive ``path`` (``size`` bytes, as ``identity``), by name, in file order.
    ``threads``: whether a remote ``store``'s runs of local headers are read in threads (off for one whose small
    reads come from memory or the page cache: they gain nothing from them).

    Raises:
        CheckpointError: not a zip archive, or one this reader refuses (see the module), naming the record.
    """
    if size < _EOCD.size:
        raise err(path, f"not a zip archive: {size} bytes, shorter than an end-of-central-directory record")
    tail, base, (count, cd_offset, cd_size, _) = _end(path, store, size, identity)
    if cd_offset >= base:
        directory = tail[cd_offset - base : cd_offset - base + cd_size]
    else:
        directory = store.read_range(path, cd_offset, cd_offset + cd_size, identity)
    entries = sorted(_entries(path, directory, count), key=lambda e: e.header)
    ends = [e.header for e in entries[1:]] + [cd_offset]
    for entry, end in zip(entries, ends):
        if entry.header >= end:
            raise err(
                path,
                f"record {short.repr(entry.name)}: local header at {entry.header} overlaps the next or the directory",
            )

    windows = [_window(e, end) for e, end in zip(entries, ends)]
    groups = _groups(windows, MERGE_GAP, MERGE_SPAN) if store.remote else [[i] for i in range(len(windows))]

    def read(group: list[int]) -> list[Record]:
        start, stop = windows[group[0]][0], windows[group[-1]][1]
        held = tail[start - base : stop - base] if start >= base else store.read_range(path, start, stop, identity)
        heads = [held[windows[i][0] - start : windows[i][1] - start] for i in group]
        return [_local(path, store, entries[i], ends[i], identity, h) for i, h in zip(group, heads)]

    if threads and store.remote and len(groups) > 1:
        with ThreadPoolExecutor(min(REMOTE_HEADER_THREADS, len(groups))) as pool:
            records = [r for rs in pool.map(read, groups) for r in rs]
    else:
        records = [r for group in groups for r in read(group)]
    return {r.name: r for r in records}


def _groups(windows: list[tuple[int, int]], gap: int, span: int) -> list[list[int]]:
    """The windows' indices in runs read together: each next one within ``gap`` bytes of the run's end, a run
    ``span`` bytes at most."""
    groups: list[list[int]] = []
    for i, (start, stop) in enumerate(windows):
        run = groups[-1] if groups else None
        if run and start - windows[run[-1]][1] <= gap and stop - windows[run[0]][0] <= span:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
