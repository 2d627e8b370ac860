"""The identity each remote object's requests are made against (the remote reader's half that knows objects).

Vocabulary: an object's identity is *expected* when the reader was told it (recorded with the header), else its
*head's* (its first bytes fetched with the store's probe), else *stat'ed* once, at its first request; every request
is then bound to it, and the backend checks every response against it.
"""

from __future__ import annotations

import threading

from ...errors import redact_url
from ..base import ObjectIdentity
from ..untrusted import err
from .backend import Backend, RemoteOptions
from .fetch import with_retries
from .heads import Heads


class Identities:
    """The identity of each object a reader reads (thread-safe).

    Args:
        backend, options: The reader's backend and options (a stat, retried).
        heads: The first bytes already fetched (their identities).
    """

    __slots__ = ("_backend", "_heads", "_known", "_lock", "_options")

    def __init__(self, backend: Backend, options: RemoteOptions, heads: Heads) -> None:
        self._backend, self._options, self._heads = backend, options, heads
        self._known: dict[str, ObjectIdentity] = {}
        self._lock = threading.Lock()

    def expect(self, location: str, identity: object | None) -> None:
        """Require ``location`` to have ``identity`` (an :class:`~loader.storage.ObjectIdentity`; None: ignored).

        Raises:
            TypeError: ``identity`` is no ``ObjectIdentity`` (a local file's, say).
        """
        if identity is None:
            return
        if not isinstance(identity, ObjectIdentity):
            raise TypeError(f"{redact_url(location)}: a remote object's identity is an ObjectIdentity: {identity!r}")
        with self._lock:
            self._known[location] = identity

    def known(self, location: str) -> ObjectIdentity | None:
        """The identity known for ``location`` so far (None: none yet)."""
        return self._known.get(location)

    def of(self, location: str) -> ObjectIdentity:
        """The identity requests for ``location`` are made against: expected, else its head's, else stat'ed once.

        Raises:
            CheckpointError: it does not exist, or the stat failed.
        """
        identity = self._known.get(location)
        if identity is None:
            found = self._heads.identity(location) or stat_identity(self._backend, self._options, location)
            with self._lock:
                identity = self._known.setdefault(location, found)
        return identity


def stat_identity(backend: Backend, options: RemoteOptions, location: str) -> ObjectIdentity:
    """The object's identity, from one ``stat`` (retried).

    Raises:
        CheckpointError: it does not exist, or the stat failed.
    """
    identity = with_retries(location, "stat", lambda: backend.stat(location), options)
    if identity is None:
        raise err(location, "not found (404)")
    return identity
