"""Remote stores: checkpoint folders at URLs (``https://``, ``s3://``, ``hf://``, other fsspec protocols), read by
ranged requests.

The protocol-independent half: :mod:`.requests_plan` (which requests fetch a file's wanted ranges: the cost
model), :mod:`.fetch` (running them: concurrency, retries, accounting), :mod:`.window` and :mod:`.reader` (the
:class:`RemoteReader`: fetched ahead within a window, reads served from the fetched spans; :mod:`.identities`:
the identity each request is bound to), :mod:`.store` (the :class:`RemoteStore`). The protocols' half:
:mod:`.backend` (the contract) and :mod:`.backends` (one per scheme, each importing its library only when such a
URL is used).
"""

from __future__ import annotations

from ...options import RemoteOptions, StorageOptions
from .backend import Backend, Transient
from .reader import RemoteReader
from .store import RemoteStore


def remote_store(url: str, storage: StorageOptions) -> RemoteStore:
    """The :class:`RemoteStore` of the folder ``url``, read as ``storage.remote`` says, its backend (picked by the
    URL's scheme) given ``storage.backend`` and ``storage.revision``.

    Raises:
        ValueError: a backend setting unknown to the backend; a revision for a URL not ``hf://``.
        ImportError: the scheme's library is not installed (the ``remote`` extra).
    """
    from .backends import make_backend

    root = url.rstrip("/")
    return RemoteStore(root, make_backend(root, storage.backend, storage.revision, storage.remote), storage.remote)


__all__ = ["Backend", "RemoteOptions", "RemoteReader", "RemoteStore", "Transient", "remote_store"]
