"""Storage capabilities: what a store, a reader or a remote backend can do beyond its contract, declared here and
checked here only.

Vocabulary:

- a *capability* is a small runtime-checkable protocol: one method (or one flag) a driver implements or not;
- a driver *declares* a capability by implementing it (nothing to register); a reader that cannot honour one in
  some configuration is another class without it, built by composition (:class:`~.direct.DirectFileReader` has no
  readahead), never a method set to ``None``;
- a capability is *checked* with :func:`capability` (the object, typed as that protocol, or ``None``), :func:`has`
  or one of the flag functions (:func:`is_remote`, :func:`multi_range`, :func:`rechecks_heads`) — in this module
  only: no other module probes a storage object with ``getattr``/``hasattr`` (tests/test_architecture.py).

The capabilities, by who declares them:

=================== ======================= =====================================================================
who                 capability              what it does
=================== ======================= =====================================================================
range reader        :class:`ReadsAhead`     told which files this host's ranks read most of: readahead kept
range reader        :class:`ScattersRuns`   reads a block's runs straight into place (one ``preadv`` of iovecs)
range reader        :class:`ProbesCache`    tells whether a byte is in the page cache, without reading it
store               :class:`ReadsDirect`    a reader bypassing the page cache (``O_DIRECT``)
store               :class:`RemembersProbes` the identity an object was probed with (to agree on versions)
store               :class:`Closes`         holds connections to release
store               :class:`Stages`         the write side: a staging area committed over the folder
store               :class:`Remote`         bytes come over a network (flag ``remote``)
remote backend      :class:`MultiRange`     one request may carry several ranges (flag ``multi_range``)
remote backend      :class:`RechecksHeads`  its validators prove little: headers fetched again (flag)
remote backend      :class:`FetchesFirst`   an object's first bytes with its identity in one request
remote backend      :class:`PinsVersions`   requests bound to one version (a Hub commit)
=================== ======================= =====================================================================

The write side (:class:`Stages`) hands out a :class:`~.writing.Staging`: objects created at full size,
positioned writes, fsync, then one commit that publishes them all (or an abort that removes them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from .base import ObjectIdentity, RangeReader, Runs
    from .writing import Staging

C = TypeVar("C")


@runtime_checkable
class ReadsAhead(Protocol):
    """A reader that keeps the kernel's readahead for files this host's ranks read most of together."""

    def read_ahead(self, files: Iterable[str]) -> None:
        """Read ``files`` with readahead even where a rank's own reads are sparse."""
        ...


@runtime_checkable
class ScattersRuns(Protocol):
    """A reader that reads a block's runs straight into place (the gaps into a sink)."""

    def read_runs_to(self, file: str, runs: Runs, to: np.ndarray, spans: list | None = None) -> None:
        """Read each run into the address ``to[i]`` (``spans``: ``runs.spans(PAGE)`` when known)."""
        ...


@runtime_checkable
class ProbesCache(Protocol):
    """A reader that tells whether a file's byte is in the page cache without waiting for the disk."""

    def cached(self, file: str, offset: int) -> bool | None:
        """Whether the byte at ``offset`` is cached (None: the kernel cannot tell)."""
        ...


@runtime_checkable
class ReadsDirect(Protocol):
    """A store whose files can be read bypassing the page cache."""

    def direct_reader(self, identities: Mapping[str, object] | None = None) -> RangeReader:
        """A new reader that reads with ``O_DIRECT`` (buffered where the filesystem refuses it)."""
        ...


@runtime_checkable
class RemembersProbes(Protocol):
    """A store that remembers the identity each object was first probed with."""

    def probed(self, location: str) -> ObjectIdentity | None:
        """That identity (None: not probed, or not found)."""
        ...


@runtime_checkable
class Closes(Protocol):
    """A store holding connections to release."""

    def close(self) -> None:
        """Release them."""
        ...


@runtime_checkable
class Stages(Protocol):
    """A store with a write side: new objects staged, then published over the folder in one commit."""

    def stage(self) -> Staging:
        """A new, empty staging area for the folder."""
        ...


@runtime_checkable
class Remote(Protocol):
    """A store whose bytes come over a network (no listing, no page cache): flag ``remote``."""

    remote: bool


@runtime_checkable
class MultiRange(Protocol):
    """A remote backend one request of which may carry several ranges (it may turn this off as it learns)."""

    multi_range: bool


@runtime_checkable
class RechecksHeads(Protocol):
    """A remote backend whose validators prove little: a file's header is fetched again with its last request."""

    recheck_heads: bool


@runtime_checkable
class FetchesFirst(Protocol):
    """A remote backend that fetches an object's first bytes with its size and identity in one request."""

    def first(self, location: str, nbytes: int) -> tuple[ObjectIdentity, bytes] | None:
        """``(identity, first bytes)``, or None where the object does not exist."""
        ...


@runtime_checkable
class PinsVersions(Protocol):
    """A remote backend whose requests can be bound to one version of the whole folder (a Hub commit)."""

    def pin(self, version: str) -> str:
        """Bind every later request to ``version``; returns what it is bound to."""
        ...


#: every declared capability (tests/test_architecture.py collects their member names from here)
CAPABILITIES: tuple[type, ...] = (
    ReadsAhead,
    ScattersRuns,
    ProbesCache,
    ReadsDirect,
    RemembersProbes,
    Closes,
    Stages,
    Remote,
    MultiRange,
    RechecksHeads,
    FetchesFirst,
    PinsVersions,
)


def members(kind: type) -> frozenset[str]:
    """The attribute names a capability declares (its methods and flags)."""
    names = set(getattr(kind, "__annotations__", {}))
    names.update(n for n, v in vars(kind).items() if callable(v) and not n.startswith("_"))
    return frozenset(names)


def capability(obj: object, kind: type[C]) -> C | None:
    """``obj`` as the capability ``kind`` when it declares it, else None."""
    return obj if isinstance(obj, kind) else None  # type: ignore[return-value]


def has(obj: object, kind: type) -> bool:
    """Whether ``obj`` declares the capability ``kind``."""
    return isinstance(obj, kind)


def is_remote(store: object) -> bool:
    """Whether ``store``'s bytes come over a network (:class:`Remote`, and its flag set)."""
    return isinstance(store, Remote) and bool(store.remote)


def multi_range(backend: object) -> bool:
    """Whether one request of ``backend`` may carry several ranges now (:class:`MultiRange`, and its flag set)."""
    return isinstance(backend, MultiRange) and bool(backend.multi_range)


def rechecks_heads(backend: object) -> bool:
    """Whether ``backend``'s answers need a file's header fetched again (:class:`RechecksHeads`, flag set)."""
    return isinstance(backend, RechecksHeads) and bool(backend.recheck_heads)


def close_store(store: object) -> None:
    """Release ``store``'s connections where it holds any (:class:`Closes`)."""
    if isinstance(store, Closes):
        store.close()


__all__ = [
    "CAPABILITIES",
    "Closes",
    "FetchesFirst",
    "MultiRange",
    "PinsVersions",
    "ProbesCache",
    "ReadsAhead",
    "ReadsDirect",
    "RechecksHeads",
    "RemembersProbes",
    "Remote",
    "ScattersRuns",
    "Stages",
    "capability",
    "close_store",
    "has",
    "is_remote",
    "members",
    "multi_range",
    "rechecks_heads",
]
