"""Any other filesystem fsspec knows (``gs://``, ``az://``, ``file://``, ``memory://`` ...): ``fs.info`` and
``fs.cat_file``.

Vocabulary: the backend options are the filesystem's own (``fsspec.filesystem(protocol, **options)``: gcsfs'
``token``, adlfs' ``account_name`` ...). An object's identity is its size with the ``etag`` (any case) and a version
(``generation``, ``VersionId``, ``version_id``, else a modification time) that ``fs.info`` gives.

A ranged read through ``cat_file`` returns bytes only, no headers, so the answer itself cannot show which version
of the object it came from: each :meth:`~FsspecBackend.get` checks the length of each answer and then stats the
object again (one more ``fs.info``): bytes read before a stat that still shows the identity are that identity's
(twice the requests of the other backends, for never loading a replaced object's bytes silently).
What each failure becomes: ``FileNotFoundError`` → ``None`` from ``stat``, a ``CheckpointError`` from ``get``;
``PermissionError`` → ``CheckpointError`` (access refused); a short answer, ``TimeoutError``, ``ConnectionError``
and other ``OSError`` → :class:`Transient`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import fsspec

from ...errors import CheckpointError
from ..base import ObjectIdentity
from .backend import ErrorMap, Transient
from .checks import changed

#: ``fs.info`` keys that name a version, first present wins
VERSION_KEYS = ("generation", "VersionId", "version_id", "mtime", "LastModified", "last_modified", "updated", "created")


def info_identity(info: Mapping[str, object]) -> ObjectIdentity:
    """The identity of an ``fs.info`` answer."""
    lower = {str(k).lower(): v for k, v in info.items()}
    etag = str(lower.get("etag") or "")
    version = next((str(info[k]) for k in VERSION_KEYS if info.get(k) not in (None, "")), "")
    return ObjectIdentity(int(info["size"]), etag, version)


class fs_errors(ErrorMap):
    """A context manager: a filesystem's exceptions as :class:`Transient` or ``CheckpointError`` naming ``name``."""

    def translate(self, error: BaseException) -> None:
        name = self.name
        if isinstance(error, FileNotFoundError):
            raise CheckpointError(f"{name}: not found", path=name) from error
        if isinstance(error, PermissionError):
            raise CheckpointError(f"{name}: access refused ({error})", path=name) from error
        if isinstance(error, (IsADirectoryError, NotADirectoryError, ValueError)):
            raise CheckpointError(f"{name}: {type(error).__name__}: {error}", path=name) from error
        if isinstance(error, (TimeoutError, ConnectionError, OSError)):
            raise Transient(f"{type(error).__name__}: {error}") from error


class FsspecBackend:
    """Objects of one fsspec filesystem by URL (see the module's docstring).

    Args:
        protocol: The filesystem's protocol (``gs``, ``file`` ...).
        backend_options: Passed to ``fsspec.filesystem``.

    Raises:
        ImportError: the filesystem's package is not installed (fsspec's message names it).
        ValueError: fsspec knows no such protocol.
    """

    multi_range = False

    def __init__(self, protocol: str, backend_options: Mapping[str, object] | None = None) -> None:
        self.protocol = protocol
        self.fs = fsspec.filesystem(protocol, **dict(backend_options or {}))

    def close(self) -> None:
        pass  # fsspec caches its filesystem instances and their connections

    def _path(self, location: str) -> str:
        return self.fs._strip_protocol(location)

    def stat(self, location: str) -> ObjectIdentity | None:
        try:
            with fs_errors(location):
                info = self.fs.info(self._path(location))
        except CheckpointError as e:
            if isinstance(e.__cause__, FileNotFoundError):
                return None
            raise
        if info.get("type", "file") != "file":
            raise CheckpointError(f"{location}: not a file ({info.get('type')})", path=location)
        return info_identity(info)

    def get(self, location: str, ranges: Sequence[tuple[int, int]], identity: ObjectIdentity) -> list[bytes]:
        out = []
        for start, end in ranges:
            if end > identity.size:
                raise CheckpointError(
                    f"{location}: bytes {start}-{end - 1} past its {identity.size} bytes", path=location
                )
            with fs_errors(location):
                data = self.fs.cat_file(self._path(location), start=start, end=end)
            if len(data) != end - start:
                raise Transient(f"{len(data)} bytes received of bytes {start}-{end - 1}")
            out.append(bytes(data))
        now = self.stat(location)
        if now != identity:
            why = "gone" if now is None else f"size {now.size}, etag {now.etag!r}, version {now.version!r}"
            raise changed(
                location, f"now {why}; was size {identity.size}, etag {identity.etag!r}, {identity.version!r}"
            )
        return out
