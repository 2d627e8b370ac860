"""The remote :class:`~loader.storage.base.Store`: a checkpoint folder at a URL, read through one backend.

A URL folder is never listed (:meth:`RemoteStore.list_names` is ``None``: the checkpoint logic looks for the
index, then ``model.safetensors``, by name); an object's existence, size and identity come from one
:meth:`~.backend.Backend.stat`, its bytes from ranged requests (retried on transient failures, see :mod:`.fetch`).
"""

from __future__ import annotations

from collections.abc import Mapping

from ...errors import CheckpointNotFoundError
from ..base import ObjectHead, ObjectIdentity
from ..untrusted import err
from .backend import Backend, RemoteOptions
from .fetch import with_retries
from .reader import RemoteReader


class RemoteStore:
    """A checkpoint folder at a URL (see :class:`~loader.storage.base.Store`).

    Args:
        root: The folder's URL (a trailing slash is dropped).
        backend: The backend speaking its protocol (shared with the readers; thread-safe).
        options: How its readers read (:class:`~.backend.RemoteOptions`).
    """

    remote = True

    def __init__(self, root: str, backend: Backend, options: RemoteOptions | None = None) -> None:
        self.root = root.rstrip("/")
        self.backend = backend
        self.options = options if options is not None else RemoteOptions()
        self._seen: dict[str, ObjectIdentity] = {}  # exists() answers, used once by the read that follows

    def __repr__(self) -> str:
        return f"RemoteStore({self.root!r})"

    def locate(self, name: str) -> str:
        return f"{self.root}/{name}"

    def exists(self, location: str) -> bool:
        identity = self._stat(location)
        if identity is not None:
            self._seen[location] = identity  # the read that follows need not ask again: its GET checks the identity
        return identity is not None

    def list_names(self) -> list[str] | None:
        return None

    def head(self, location: str, nbytes: int) -> ObjectHead:
        identity = self._found(location)
        end = min(nbytes, identity.size)
        data = self._get(location, 0, end, identity) if end > 0 else b""
        return ObjectHead(data, identity.size, identity)

    def read_range(self, location: str, start: int, end: int, identity: object) -> bytes:
        known = identity if isinstance(identity, ObjectIdentity) else self._found(location)
        if not 0 <= start <= end <= known.size:
            raise err(location, f"bytes [{start}, {end}) lie outside the object ({known.size} bytes)")
        return self._get(location, start, end, known) if end > start else b""

    def read_small(self, location: str, limit: int, what: str) -> bytes:
        identity = self._found(location)
        if identity.size > limit:
            raise err(location, f"{what} is {identity.size} bytes, over the {limit}-byte limit")
        return self._get(location, 0, identity.size, identity) if identity.size else b""

    def reader(self, identities: Mapping[str, object] | None = None) -> RemoteReader:
        return RemoteReader(self.backend, self.options, identities)

    def close(self) -> None:
        """Release the backend's connections."""
        self.backend.close()

    def _stat(self, location: str) -> ObjectIdentity | None:
        return with_retries(location, "stat", lambda: self.backend.stat(location), self.options)

    def _found(self, location: str) -> ObjectIdentity:
        identity = self._seen.pop(location, None) or self._stat(location)
        if identity is None:
            raise CheckpointNotFoundError(f"{location}: not found", path=location)
        return identity

    def _get(self, location: str, start: int, end: int, identity: ObjectIdentity) -> bytes:
        (data,) = with_retries(
            location,
            f"GET bytes [{start}, {end})",
            lambda: self.backend.get(location, [(start, end)], identity),
            self.options,
        )
        if len(data) != end - start:
            raise err(location, f"GET bytes [{start}, {end}): the backend returned {len(data)} bytes")
        return data
