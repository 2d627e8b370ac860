"""The remote :class:`~loader.storage.base.Store`: a checkpoint folder at a URL, read through one backend.

A URL folder is never listed (:meth:`RemoteStore.list_names` is ``None``: the checkpoint logic looks for the
index, then ``model.safetensors``, by name); an object's existence, size and identity come with its first bytes
from one ranged ``GET`` where the backend has ``first`` (HTTP, S3; else one :meth:`~.backend.Backend.stat`), its
other bytes from ranged requests (retried on transient failures, see :mod:`.fetch`). The first bytes of every object
probed (:data:`FIRST_BYTES` for :meth:`RemoteStore.exists`, what :meth:`RemoteStore.head` asks) are kept and serve
every later read of them: a small index is read in that one request, and the readers (:meth:`RemoteStore.reader`)
serve a file's first data bytes from what its header's request already returned.

A query string is kept where the URL puts it: a folder URL's (``https://host/dir?sig=...``, a token signing the
whole folder) goes with every object's requests; a file's own (a presigned URL, :meth:`RemoteStore.sign`) with that
file's only. Beside a presigned file, an object the signature does not open (``config.json``: 401/403) counts as
absent, with a warning naming it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping

from ...errors import CheckpointNotFoundError, redact_url
from ..base import ObjectHead, ObjectIdentity
from ..capabilities import FetchesFirst, PinsVersions, capability
from ..untrusted import err
from .backend import Backend, RemoteOptions
from .checks import AccessRefused
from .fetch import with_retries
from .reader import RemoteReader

log = logging.getLogger(__name__)
FIRST_BYTES = 4 << 10
"""Bytes of the request that tells whether an object exists (:meth:`RemoteStore.exists`): small, so that a rank
fetches little it may not want, and whole small objects (an index, a config) in one request."""


class RemoteStore:
    """A checkpoint folder at a URL (see :class:`~loader.storage.base.Store`).

    Args:
        root: The folder's URL (a trailing slash is dropped; its query string, if any, goes with every object's).
        backend: The backend speaking its protocol (shared with the readers; thread-safe).
        options: How its readers read (:class:`~.backend.RemoteOptions`).
    """

    remote = True

    def __init__(self, root: str, backend: Backend, options: RemoteOptions | None = None) -> None:
        base, _, self.query = root.partition("?")
        self.root = base.rstrip("/")
        self._signed: set[str] = set()  # locations of presigned files (:meth:`sign`)
        self.backend = backend
        self.options = options if options is not None else RemoteOptions()
        self._heads: dict[str, ObjectHead] = {}  # every object's first bytes, as probed: serve later reads
        self._lock = threading.Lock()
        self._pinned: dict[str, ObjectIdentity] = {}  # identities given (another rank's): probed bound to them

    def __repr__(self) -> str:
        return f"RemoteStore({redact_url(self.root)!r})"

    def locate(self, name: str) -> str:
        return f"{self.root}/{name}" + (f"?{self.query}" if self.query else "")

    def sign(self, name: str, query: str) -> str:
        """The location of ``name`` with its own query string (a presigned file URL's: its requests carry it)."""
        location = f"{self.root}/{name}?{query}"
        self._signed.add(location)
        return location

    def exists(self, location: str) -> bool:
        try:
            return self._probe(location, FIRST_BYTES) is not None
        except AccessRefused:
            if not self._signed or location in self._signed:
                raise
            signed = ", ".join(redact_url(s) for s in sorted(self._signed))
            log.warning("%s: access refused beside the presigned %s: taken as absent", redact_url(location), signed)
            return False

    def list_names(self) -> list[str] | None:
        return None

    def head(self, location: str, nbytes: int) -> ObjectHead:
        known = self._probe(location, nbytes)
        if known is None:
            raise CheckpointNotFoundError(f"{location}: not found", path=location)
        end = min(nbytes, known.size)
        if len(known.data) >= end:
            return ObjectHead(known.data[:end], known.size, known.identity)
        rest = self._get(location, len(known.data), end, known.identity)
        return ObjectHead(known.data + rest, known.size, known.identity)

    def read_range(self, location: str, start: int, end: int, identity: object) -> bytes:
        known = identity if isinstance(identity, ObjectIdentity) else self._found(location)
        if not 0 <= start <= end <= known.size:
            raise err(location, f"bytes [{start}, {end}) lie outside the object ({known.size} bytes)")
        first = self._heads.get(location)
        if first is not None and first.identity == known:  # the bytes already fetched serve what they hold
            held = first.data[start:end]
            return held + (self._get(location, start + len(held), end, known) if start + len(held) < end else b"")
        return self._get(location, start, end, known) if end > start else b""

    def read_small(self, location: str, limit: int, what: str) -> bytes:
        identity = self._found(location)
        if identity.size > limit:
            raise err(location, f"{what} is {identity.size} bytes, over the {limit}-byte limit")
        return self.read_range(location, 0, identity.size, identity)

    def reader(self, identities: Mapping[str, object] | None = None) -> RemoteReader:
        with self._lock:
            heads = {loc: (h.identity, h.data) for loc, h in self._heads.items() if h.data}
        return RemoteReader(self.backend, self.options, identities, heads)

    def pin(self, identities: Mapping[str, ObjectIdentity]) -> None:
        """Read each of ``identities``' locations as that identity (another rank's): its first request is bound
        to it (``If-Match``, S3's ``VersionId``, the Hub's commit, which then pins the backend's) instead of
        probing what the object is now; a location the object no longer matches fails naming it."""
        self._pinned.update(identities)
        pins = capability(self.backend, PinsVersions)
        for identity in identities.values() if pins is not None else ():
            pins.pin(identity.version)

    def probed(self, location: str) -> ObjectIdentity | None:
        """The identity ``location`` was probed with so far (``None``: not probed, or not found)."""
        with self._lock:
            known = self._heads.get(location)
        return None if known is None else known.identity

    def close(self) -> None:
        """Release the backend's connections."""
        self.backend.close()

    def _stat(self, location: str) -> ObjectIdentity | None:
        return with_retries(location, "stat", lambda: self.backend.stat(location), self.options)

    def _probe(self, location: str, nbytes: int) -> ObjectHead | None:
        """The object's first bytes as kept (its size and identity), probed now if not yet: at least ``nbytes``
        of them where the backend fetches first bytes (``first``), none otherwise; ``None``: it does not exist."""
        with self._lock:
            known = self._heads.get(location)
        if known is not None:
            return known
        fetches = capability(self.backend, FetchesFirst)
        pinned = self._pinned.get(location)
        if pinned is not None:
            end = min(nbytes, pinned.size)
            head = ObjectHead(self._get(location, 0, end, pinned) if end else b"", pinned.size, pinned)
        elif fetches is None:
            identity = self._stat(location)
            head = None if identity is None else ObjectHead(b"", identity.size, identity)
        else:
            what = f"GET bytes [0, {nbytes})"
            got = with_retries(location, what, lambda: fetches.first(location, nbytes), self.options)
            head = None if got is None else ObjectHead(got[1], got[0].size, got[0])
        if head is not None:
            with self._lock:
                head = self._heads.setdefault(location, head)
        return head

    def _found(self, location: str) -> ObjectIdentity:
        head = self._probe(location, FIRST_BYTES)
        if head is None:
            raise CheckpointNotFoundError(f"{location}: not found", path=location)
        return head.identity

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
