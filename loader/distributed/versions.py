"""One version per load: every rank of a distributed load from a URL reads the same version of every file.

Every rank opens the checkpoint (its index and its files' headers) at once; rank 0 then posts the identities it
read — size, ETag, S3's ``VersionId`` or the Hub's commit, and a CRC of each file's header — through the session's
store, and every other rank compares its own with them. A rank that read another version of a file (an object
replaced between two ranks' reads, a server answering ranks differently, a Hub branch that moved) opens the
checkpoint again bound to rank 0's identities (``If-Match``, ``VersionId``, the commit's resolve URLs:
:meth:`~loader.storage.remote.RemoteStore.pin`): it then reads rank 0's version, or fails naming the file, and the
planning agreement that follows raises that failure on every rank. No rank uses a byte before the identities
are agreed; every later read is bound to them. Local checkpoints are not compared (each host may hold its own
copy: its own inodes and times).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping

from ..checkpoint import Checkpoint
from ..checkpoint.folder import INDEX_NAME
from ..errors import CheckpointError, redact_url
from ..storage import ObjectIdentity
from ..storage.capabilities import RemembersProbes, capability, close_store
from .session import Session

log = logging.getLogger("loader")

Opener = Callable[[Mapping[str, ObjectIdentity] | None], Checkpoint]


def identities_of(checkpoint: Checkpoint) -> dict[str, ObjectIdentity]:
    """The remote identities a checkpoint was opened with: its files' and its index's."""
    out = {f: i for f, i in checkpoint.identities.items() if isinstance(i, ObjectIdentity)}
    probes = capability(checkpoint.store, RemembersProbes)
    index = probes.probed(checkpoint.store.locate(INDEX_NAME)) if probes is not None else None
    if index is not None:
        out[checkpoint.store.locate(INDEX_NAME)] = index
    return out


def encode(identities: Mapping[str, ObjectIdentity]) -> str:
    """``identities`` as JSON text (what rank 0 posts)."""
    return json.dumps({loc: [i.size, i.etag, i.version, i.head_bytes, i.head_crc] for loc, i in identities.items()})


def decode(text: str) -> dict[str, ObjectIdentity]:
    """:func:`encode`'s text read back."""
    rows = json.loads(text).items()
    return {loc: ObjectIdentity(int(s), str(e), str(v), int(n), int(c)) for loc, (s, e, v, n, c) in rows}


def _fields(identity: ObjectIdentity | None) -> tuple | None:
    if identity is None:
        return None
    return identity.size, identity.etag, identity.version, identity.head_bytes, identity.head_crc


def differences(mine: Mapping[str, ObjectIdentity], theirs: Mapping[str, ObjectIdentity]) -> list[str]:
    """The locations whose identities differ between ``mine`` and ``theirs`` (or that only one of them holds)."""
    return sorted(loc for loc in {*mine, *theirs} if _fields(mine.get(loc)) != _fields(theirs.get(loc)))


def describe(identity: ObjectIdentity | None) -> str:
    """An identity in words, for errors."""
    if identity is None:
        return "not read"
    parts = [f"{identity.size} bytes", f"ETag {identity.etag}" if identity.etag else "no ETag"]
    parts += [f"version {identity.version}"] if identity.version else []
    parts += [f"header CRC {identity.head_crc:08x}"] if identity.head_bytes else []
    return ", ".join(parts)


def open_agreed(session: Session, opener: Opener, *, remote: bool) -> Checkpoint:
    """The checkpoint ``opener(None)`` opens, at rank 0's version of every file (see the module); collective for
    a ``remote`` checkpoint, ``opener(None)`` alone otherwise.

    Args:
        session: The load's session (a ``solo`` one compares nothing).
        opener: Opens the checkpoint, bound to the given identities (``None``: as the objects are now).
        remote: Whether the checkpoint is at a URL (every rank must pass the same).

    Raises:
        CheckpointError: this rank cannot read rank 0's version of a file (it was replaced and the store keeps
            no old versions; the server answers this rank other bytes under the same identity), naming it.
        Exception: what ``opener`` raised (rank 0's failure is then every rank's, through the planning agreement).
    """
    if not remote or session.solo or session.world < 2:
        return opener(None)
    if session.rank == 0:
        try:
            checkpoint = opener(None)
        except BaseException:
            session.from_rank_zero("versions", "", "planning")  # the others stop waiting: its error is agreed next
            raise
        posted = identities_of(checkpoint)
        session.from_rank_zero("versions", encode(posted), "planning")
        log.debug("rank 0: posted the identities of %d object(s) for the other ranks to read", len(posted))
        return checkpoint
    checkpoint, error = None, None
    try:
        checkpoint = opener(None)
    except Exception as e:  # perhaps another version than rank 0's: opened again at rank 0's below
        error = e
    posted = session.from_rank_zero("versions", None, "planning")
    if not posted:  # rank 0 failed: its error is what every rank raises at the planning agreement
        if error is not None:
            raise error
        assert checkpoint is not None
        return checkpoint
    theirs = decode(posted)
    if checkpoint is not None and not differences(identities_of(checkpoint), theirs):
        return checkpoint
    was = "failed to open" if checkpoint is None else f"read {_listed(identities_of(checkpoint), theirs)}"
    log.warning("rank %d: %s; opening again at rank 0's versions", session.rank, was)
    if checkpoint is not None:
        close_store(checkpoint.store)  # its connections: the checkpoint is not used
    checkpoint = opener(theirs)
    mine = identities_of(checkpoint)
    differ = differences(mine, theirs)  # the same objects, read bound to rank 0's identities: nothing else
    if differ:
        loc = differ[0]
        raise CheckpointError(
            f"{redact_url(loc)}: rank {session.rank} cannot read rank 0's version: it reads other bytes than rank 0 "
            f"under the same identity, or another set of files (rank 0: {describe(theirs.get(loc))}; rank "
            f"{session.rank}: {describe(mine.get(loc))}): the server answers the ranks differently, and every rank "
            "of a load must read one version",
            path=redact_url(loc),
        )
    return checkpoint


def _listed(mine: Mapping[str, ObjectIdentity], theirs: Mapping[str, ObjectIdentity]) -> str:
    """The files this rank read at another version than rank 0, in words."""
    differ = differences(mine, theirs)
    shown = "; ".join(
        f"{redact_url(loc)} ({describe(mine.get(loc))}, rank 0: {describe(theirs.get(loc))})" for loc in differ[:3]
    )
    return f"another version than rank 0 of {len(differ)} file(s): {shown}"
