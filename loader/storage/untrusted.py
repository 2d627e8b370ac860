"""Reading untrusted checkpoint input: every failure is a :class:`~loader.errors.CheckpointError` naming the file.

- :func:`open_regular_file` opens without blocking and refuses anything but a regular file (a FIFO, device,
  directory, socket; a symlink loop or a NUL byte in the name) before a byte is read;
- :func:`pread_exact` reads an exact byte count or reports the truncation;
- :func:`loads_json` decodes UTF-8 JSON, refusing duplicate keys and nesting too deep for the parser (a
  ``RecursionError`` otherwise), with the garbage collector paused: building millions of containers would
  otherwise trigger it over and over, rescanning the growing tree each time (most of the time of a
  million-entry header).
"""

from __future__ import annotations

import gc
import json
import os
import reprlib
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ..errors import CheckpointError

#: flags for reading checkpoint data (descriptors that :func:`open_regular_file` already vetted)
OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
#: flags for a first open: never block (a FIFO would wait for a writer), never become a controlling tty
_PROBE_FLAGS = OPEN_FLAGS | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
_FILE_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}
#: ``short.repr(x)``: a repr cut to a readable length, for values from a file in messages
short = reprlib.Repr()
short.maxstring, short.maxother, short.maxlist, short.maxtuple = 120, 120, 8, 8


def err(path: str, message: str, key: str | None = None) -> CheckpointError:
    """A :class:`CheckpointError` whose message starts with ``path`` (and ``key``, when given)."""
    where = f"{path}: tensor {short.repr(key)}: " if key is not None else f"{path}: "
    return CheckpointError(where + message, path=path, key=key)


def open_regular_file(path: str) -> tuple[int, os.stat_result]:
    """Open ``path`` read-only without blocking, and check through that descriptor that it is a regular file.

    Symlinks are followed (their target may be anywhere). A FIFO does not block the open, and nothing is
    read from anything but a regular file.

    Args:
        path: The file.

    Returns:
        ``(fd, fstat result)``; the caller closes ``fd``.

    Raises:
        CheckpointError: ``path`` cannot be opened (missing, a symlink loop, no permission, a NUL byte in
            the name) or is not a regular file (a directory, FIFO, device or socket).
    """
    try:
        fd = os.open(path, _PROBE_FLAGS)
    except ValueError:  # embedded NUL byte: the message shows it escaped
        raise CheckpointError(f"{short.repr(path)}: file name holds a NUL byte", path=path) from None
    except OSError as e:
        raise err(path, f"cannot open: {e.strerror or e}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = _FILE_KINDS.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise err(path, f"is {kind}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def pread_exact(fd: int, path: str, size: int, offset: int) -> bytes:
    """Read exactly ``size`` bytes at ``offset``.

    Raises:
        CheckpointError: the file ends first.
    """
    reads: list[bytes] = []
    got = 0
    while got < size:
        data = os.pread(fd, size - got, offset + got)
        if not data:
            raise err(path, f"truncated: expected {size} bytes at offset {offset}, got {got}")
        reads.append(data)
        got += len(data)
    return b"".join(reads)


def read_json_file(path: str, limit: int, what: str) -> object:
    """Read and parse a small JSON file (an index, a config), refusing it before reading when over ``limit``.

    Raises:
        CheckpointError: not a regular file, over ``limit`` bytes, or not valid UTF-8 JSON (see :func:`loads_json`).
    """
    fd, st = open_regular_file(path)
    try:
        if st.st_size > limit:
            raise err(path, f"{what} is {st.st_size} bytes, over the {limit}-byte limit")
        raw = pread_exact(fd, path, st.st_size, 0)
    finally:
        os.close(fd)
    return loads_json(path, raw, what)


@contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (restored on exit if it was enabled)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


class DuplicateKeyError(ValueError):
    """A JSON object names one key twice."""


def strict_dict(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``dict(pairs)``, refusing a key given twice (a ``json`` ``object_pairs_hook``)."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKeyError(f"duplicate JSON key {short.repr(k)}")
            seen.add(k)
    return out


def loads_json(
    path: str, raw: bytes, what: str, hook: Callable[[list[tuple[str, object]]], object] = strict_dict
) -> object:
    """Decode UTF-8 JSON of a checkpoint file, mapping every failure to one :class:`CheckpointError`.

    Args:
        path: The file, for the message.
        raw: Its bytes.
        what: ``"header"`` or ``"index"``, for the message.
        hook: ``object_pairs_hook``; the default builds dicts and refuses duplicate keys.

    Raises:
        CheckpointError: not UTF-8, not JSON, a duplicate key, or nested too deeply.
    """
    try:
        text = raw.decode("utf-8")
        with gc_paused():
            return json.loads(text, object_pairs_hook=hook)
    except RecursionError:
        raise err(path, f"{what} is not valid UTF-8 JSON: nested too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise err(path, f"{what} is not valid UTF-8 JSON: {short.repr(str(e))[1:-1]}") from None
