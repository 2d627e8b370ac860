"""The local :class:`~.base.Store`: a checkpoint folder on a local filesystem, read by :class:`~.local.FileReader`
(or, bypassing the page cache, :class:`~.direct.DirectFileReader`) and written through :mod:`.local_write`.

Vocabulary: a *location* is an absolute path; an object's *head* is its first bytes, read with its size and
:class:`~.local_files.FileIdentity` (one open, advised ``POSIX_FADV_RANDOM``: a header read must not pull the data
after it into the page cache).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .base import ObjectHead, RangeReader
from .direct import DirectFileReader
from .local import FileReader
from .local_files import FileIdentity, IdentityChecks, open_checked
from .local_write import LocalStaging
from .untrusted import err, open_regular_file, pread_exact


class LocalStore:
    """A local checkpoint folder (see :class:`~.base.Store`): locations are absolute paths. Declares direct reads
    (:meth:`direct_reader`) and a write side (:meth:`stage`) (:mod:`.capabilities`)."""

    remote = False

    def __init__(self, root: str) -> None:
        self.root = os.path.abspath(root)

    def __repr__(self) -> str:
        return f"LocalStore({self.root!r})"

    def locate(self, name: str) -> str:
        return os.path.join(self.root, name)

    def exists(self, location: str) -> bool:
        return os.path.lexists(location)

    def list_names(self) -> list[str] | None:
        try:
            return os.listdir(self.root)
        except OSError as e:
            raise err(self.root, f"cannot list the folder: {e.strerror or e}") from e

    def head(self, location: str, nbytes: int) -> ObjectHead:
        fd, st = open_regular_file(location)
        try:
            if hasattr(os, "posix_fadvise"):  # a header read must not pull the data after it into the page cache
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            data = pread_exact(fd, location, min(nbytes, st.st_size), 0)
        finally:
            os.close(fd)
        return ObjectHead(data, st.st_size, FileIdentity.of(st))

    def read_range(self, location: str, start: int, end: int, identity: object) -> bytes:
        fd = open_checked(location, IdentityChecks({location: identity} if identity is not None else None))
        try:
            return pread_exact(fd, location, end - start, start)
        finally:
            os.close(fd)

    def read_small(self, location: str, limit: int, what: str) -> bytes:
        fd, st = open_regular_file(location)
        try:
            if st.st_size > limit:
                raise err(location, f"{what} is {st.st_size} bytes, over the {limit}-byte limit")
            return pread_exact(fd, location, st.st_size, 0)
        finally:
            os.close(fd)

    def reader(self, identities: Mapping[str, object] | None = None) -> FileReader:
        return FileReader(identities)  # type: ignore[arg-type]

    def direct_reader(self, identities: Mapping[str, object] | None = None) -> RangeReader:
        """A reader bypassing the page cache (``O_DIRECT``: :class:`~.direct.DirectFileReader`)."""
        return DirectFileReader(identities)  # type: ignore[arg-type]

    def stage(self) -> LocalStaging:
        """A new staging folder beside the folder, published over it on commit (:class:`~.local_write.LocalStaging`).

        Raises:
            ValueError: the folder is a file, a mount point or holds one (nothing created).
        """
        return LocalStaging.beside(self.root)
