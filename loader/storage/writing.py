"""The write side of storage: a folder's new objects staged, then published over it in one step.

Vocabulary:

- a *staging* area (:class:`Staging`) holds the new objects of one folder (its *target*) until the *commit*
  publishes them all at once (the local driver: one atomic swap of two folders, the user's other files carried
  over, under a lock: :mod:`.local_commit`); an *abort* removes them, leaving the target as it was;
- an *object writer* (:class:`ObjectWriter`): positioned writes into one staged object (created at its full size
  first), *sync* (its bytes on stable storage), then close;
- the staging area's *location* names it to other ranks, which open it with :func:`~loader.storage.open_staging`
  and write their own byte ranges into its objects.

A store declares a write side with :class:`~.capabilities.Stages` (:meth:`~.local.LocalStore.stage`); a driver for
an object store implements these two protocols (a multipart upload per object, the commit publishing the index
last), and the save above it stays as it is.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class ObjectWriter(Protocol):
    """Positioned writes into one staged object (thread-safe: no shared file position)."""

    def pwrite(self, offset: int, data: memoryview) -> None:
        """Write all of ``data`` at byte ``offset``."""
        ...

    def sync(self) -> None:
        """Put the bytes written so far on stable storage (``fsync``)."""
        ...

    def close(self) -> None:
        """Release the object (its bytes stay staged)."""
        ...


@runtime_checkable
class Staging(Protocol):
    """A folder's new objects, published over it by one :meth:`commit` (see the module).

    Attributes:
        location: What names the staging area (other ranks open it by it; local: the staging folder).
        target: The folder :meth:`commit` publishes over.
        folder: A local folder whose files are staged objects, for libraries that write files by path
            (``save_pretrained``); local: :attr:`location` itself.
    """

    location: str
    target: str
    folder: str

    def create(self, name: str, size: int, head: bytes) -> None:
        """A new object ``name`` of ``size`` bytes (space reserved where the storage allows), ``head`` written at 0.

        Raises:
            FileExistsError: it exists already.
        """
        ...

    def open(self, name: str) -> ObjectWriter:
        """A writer of the staged object ``name`` (created before, by this rank or another)."""
        ...

    def put(self, name: str, data: bytes) -> None:
        """A whole small object (an index)."""
        ...

    def commit(self, timeout: float | None = None) -> None:
        """Publish every staged object over :attr:`target` in one step (the staging area is gone after it).

        Raises:
            TimeoutError: another commit into the target held it for more than ``timeout`` seconds.
            OSError: the commit failed; the target holds its old objects, whole.
        """
        ...

    def abort(self) -> None:
        """Remove every staged object (best effort: a failure is already being raised)."""
        ...
