"""Storage: where a checkpoint's bytes come from (see :mod:`.base` for the vocabulary).

:class:`LocalStore` and :class:`FileReader` read local files with ``preadv``; :func:`open_store` picks the driver
for a location: a local path, or a URL (``s3://``, ``http(s)://``, ``hf://`` and other fsspec protocols), whose
drivers live in :mod:`.remote` and are imported only when such a URL is used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from .base import ObjectHead, ObjectIdentity, RangeReader, Runs, Store
from .direct import DirectFileReader
from .local import IOV_MAX, PAGE, FileIdentity, FileReader, LocalStore

#: ``scheme://``: a URL (one letter is a Windows drive, not a scheme)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")


def is_url(location: object) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(location, str) and _URL.match(location) is not None


def open_store(root: str, storage_options: Mapping[str, object] | None = None, *, revision: str | None = None) -> Store:
    """The :class:`Store` of the checkpoint folder ``root``: a :class:`LocalStore` for a path, a remote store for a
    URL (``storage_options`` are passed to its backend; ``revision`` is an ``hf://`` repo's branch, tag or commit).

    Raises:
        ValueError: ``storage_options`` given for a local path.
        ImportError: the URL's backend library is not installed (the ``remote`` extra).
    """
    if not is_url(root):
        if storage_options or revision is not None:
            raise ValueError(f"storage_options and revision apply to URLs only, not to the local path {root!r}")
        return LocalStore(root)
    from .remote import remote_store

    return remote_store(root, dict(storage_options or {}), revision=revision)


def open_reader(store: Store, identities: Mapping[str, object], *, direct_io: bool = False) -> RangeReader:
    """A new :class:`RangeReader` of ``store`` told ``identities``; with ``direct_io`` a local store's reads use
    ``O_DIRECT`` (:class:`~.direct.DirectFileReader`; a URL's reads have no page cache to bypass)."""
    if direct_io and isinstance(store, LocalStore):
        return DirectFileReader(identities)  # type: ignore[arg-type]
    return store.reader(identities)


__all__ = [
    "IOV_MAX",
    "PAGE",
    "DirectFileReader",
    "FileIdentity",
    "FileReader",
    "LocalStore",
    "ObjectHead",
    "ObjectIdentity",
    "RangeReader",
    "Runs",
    "Store",
    "is_url",
    "open_reader",
    "open_store",
]
