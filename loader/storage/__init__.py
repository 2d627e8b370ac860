"""Storage: where a checkpoint's bytes come from (see :mod:`.base` for the vocabulary).

:class:`LocalStore` and :class:`FileReader` read local files with ``preadv`` (and write them: :mod:`.local_write`);
what a driver can do beyond the contract is declared and checked in :mod:`.capabilities`; :func:`open_store` picks
the driver for a location: a local path, or a URL (``s3://``, ``http(s)://``, ``hf://`` and other fsspec
protocols), whose drivers live in :mod:`.remote` and are imported only when such a URL is used.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..options import StorageOptions
from .base import ObjectHead, ObjectIdentity, RangeReader, Runs, Store
from .capabilities import ReadsDirect, Stages, capability
from .direct import DirectFileReader
from .local import IOV_MAX, PAGE, FileReader
from .local_files import FileIdentity
from .local_store import LocalStore
from .writing import ObjectWriter, Staging

#: ``scheme://``: a URL (one letter is a Windows drive, not a scheme)
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]+://")


def is_url(location: object) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(location, str) and _URL.match(location) is not None


def open_store(root: str, storage: StorageOptions | None = None) -> Store:
    """The :class:`Store` of the checkpoint folder ``root``: a :class:`LocalStore` for a path, a remote store for a
    URL, read as ``storage`` says (:class:`~loader.options.StorageOptions`: its backend settings, requests and
    revision).

    Raises:
        ValueError: URL-only storage options (backend settings, remote options, a revision) for a local path.
        ImportError: the URL's backend library is not installed (the ``remote`` extra).
    """
    storage = storage if storage is not None else StorageOptions()
    if not is_url(root):
        if storage.for_urls_only or storage.revision is not None:
            raise ValueError(
                f"storage options (backend, remote) and revision apply to URLs only, not to the local path {root!r}"
            )
        return LocalStore(root)
    from .remote import remote_store

    return remote_store(root, storage)


def stage(path: str) -> Staging:
    """A new staging area for the folder ``path``, from its store's write side (:class:`~.capabilities.Stages`).

    Raises:
        ValueError: the store has no write side (a URL), or ``path`` cannot be saved to (a file, a mount point).
    """
    store = open_store(path) if not is_url(path) else None
    stages = capability(store, Stages)
    if stages is None:
        raise ValueError(f"cannot save to {path!r}: its storage has no write side (a local folder has)")
    return stages.stage()


def open_staging(location: str, target: str = "") -> Staging:
    """The staging area named ``location`` (:attr:`~.writing.Staging.location`, perhaps made on another rank),
    committing over the folder ``target`` (empty: this caller only writes into it)."""
    from .local_write import LocalStaging

    return LocalStaging(location, target)


def open_reader(store: Store, identities: Mapping[str, object], *, direct_io: bool = False) -> RangeReader:
    """A new :class:`RangeReader` of ``store`` told ``identities``; with ``direct_io``, where the store declares
    direct reads (:class:`~.capabilities.ReadsDirect`: a local store), they bypass the page cache (a URL's reads
    have no page cache to bypass)."""
    direct = capability(store, ReadsDirect) if direct_io else None
    if direct is not None:
        return direct.direct_reader(identities)
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
    "ObjectWriter",
    "Staging",
    "Stages",
    "Store",
    "is_url",
    "open_reader",
    "open_staging",
    "open_store",
    "stage",
]
