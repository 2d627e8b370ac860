"""Hugging Face Hub files by ``hf://`` URL: the Hub's resolve URLs, read by the HTTP backend.

Vocabulary: a location is ``hf://[datasets/|spaces/]org/name[@revision]/path`` (a revision with slashes is
URL-quoted, ``@refs%2Fpr%2F1``, or written as ``@refs/pr/1``); its *resolve URL* is
``{endpoint}/{org}/{name}/resolve/{revision}/{path}`` (``huggingface_hub.hf_hub_url``), ``endpoint`` being the
``endpoint`` backend option, else ``HF_ENDPOINT`` as the environment says when the store is opened, else the
Hub's. Requests carry ``huggingface_hub.utils.build_hf_headers`` (``HF_TOKEN`` or the ``token`` option; never
echoed; ``requests`` drops it on a redirect to another host, the Hub's CDN).

An object's identity is ``X-Linked-Etag`` / ``X-Linked-Size`` where the Hub sends them (files in LFS/Xet
storage, on the redirect to its CDN), else ``ETag`` / ``Content-Length``, with ``X-Repo-Commit`` as its version:
later reads go to the resolve URL of that commit (a commit's files never change) and are checked against the
ETag; no ``If-Match`` is sent (the CDN's own ETags differ from the Hub's). The revision is resolved once per
backend: the first answer that names a commit pins it (:attr:`HubBackend.commit`), and every later request of the
backend, whatever file, goes to that commit's resolve URLs (a branch that moves meanwhile changes nothing);
:meth:`HubBackend.pin` sets it from outside (another rank's). ``HF_HUB_OFFLINE=1`` refuses
``hf://`` URLs. A 404 that names a missing repo or revision (``X-Error-Code``) is a ``CheckpointError``.
"""

from __future__ import annotations

import os
import re
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from huggingface_hub import constants, hf_hub_url
from huggingface_hub.utils import build_hf_headers

from ...errors import CheckpointError
from ..base import ObjectIdentity
from .backend import RemoteOptions
from .http import HeaderNames, HttpBackend, first_bytes

#: backend options
OPTIONS = ("token", "endpoint", "headers", "verify", "forward_headers")
HUB_HEADERS = HeaderNames(
    etag=("X-Linked-Etag", "ETag"),
    size=("X-Linked-Size", "Content-Length"),
    version="X-Repo-Commit",
    error_code="X-Error-Code",
)
_COMMIT = re.compile(r"[0-9a-f]{40}")
_REPO_TYPES = {"datasets": "dataset", "spaces": "space"}
_SPECIAL_REFS = re.compile(r"refs/(pr|convert)/[^/]+")


@dataclass(frozen=True)
class HubPath:
    """A parsed ``hf://`` location.

    Attributes:
        repo_id: ``org/name``.
        repo_type: ``"model"``, ``"dataset"`` or ``"space"``.
        revision: The URL's ``@revision``, ``None`` when it has none.
        path: The file's path in the repo (``""`` for the repo itself).
    """

    repo_id: str
    repo_type: str
    revision: str | None
    path: str


def check_revision(url: str, revision: str) -> str:
    """``revision`` if it is a plain branch, tag or commit name (no ``..`` component, absolute path, backslash or
    NUL byte, as local revisions are checked).

    Raises:
        CheckpointError: naming ``url`` and the revision.
    """
    parts = revision.split("/")
    if not revision or "\0" in revision or "\\" in revision or revision.startswith("/") or ".." in parts:
        raise CheckpointError(f"{url}: revision {revision!r} is not a branch, tag or commit name", path=url)
    return revision


def parse_hf_url(url: str) -> HubPath:
    """The parts of ``hf://[datasets/|spaces/]org/name[@revision][/path]``.

    Raises:
        CheckpointError: not such a URL, or a revision that is not a plain name.
    """
    rest = url.partition("://")[2].strip("/")
    first, _, tail = rest.partition("/")
    repo_type = _REPO_TYPES.get(first, "model")
    if first in _REPO_TYPES:
        rest = tail
    org, _, rest = rest.partition("/")
    name, _, path = rest.partition("/")
    name, at, revision = name.partition("@")
    if at:
        special = _SPECIAL_REFS.match(f"{revision}/{path}")
        if revision == "refs" and special:
            revision, path = special[0], f"{revision}/{path}"[special.end() :].lstrip("/")
        revision = check_revision(url, urllib.parse.unquote(revision))
    if not org or not name or "@" in org:
        raise CheckpointError(f"{url}: not an hf://org/name[@revision]/path URL", path=url)
    return HubPath(f"{org}/{name}", repo_type, revision if at else None, path)


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (as the environment says now, or as huggingface_hub read it) forbids the Hub."""
    value = os.environ.get("HF_HUB_OFFLINE")
    return constants.HF_HUB_OFFLINE if value is None else value.strip().upper() in ("1", "ON", "YES", "TRUE")


class HubBackend:
    """Hub files by ``hf://`` location (see the module's docstring); thread-safe.

    Args:
        options: The HTTP backend's timeouts.
        backend_options: ``token``, ``endpoint``, ``headers`` (more headers), ``verify`` (TLS).
        revision: The revision of locations without ``@revision`` (``"main"`` when ``None``); a location whose
            own revision differs is refused.
    """

    def __init__(
        self, options: RemoteOptions, backend_options: Mapping[str, object] | None = None, revision: str | None = None
    ) -> None:
        opts = dict(backend_options or {})
        unknown = sorted(set(opts) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown backend settings for hf:// {unknown}; known: {', '.join(OPTIONS)}")
        self.revision = None if revision is None else check_revision("hf://", revision)
        self.endpoint = str(opts.get("endpoint") or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        headers = build_hf_headers(token=opts.get("token"), headers=dict(opts.get("headers") or {}))
        verify = opts.get("verify", True)
        forward = bool(opts.get("forward_headers", False))  # the token and headers, on the CDN's redirect too
        self.http = HttpBackend(
            options, headers=headers, verify=verify, names=HUB_HEADERS, if_match=False, forward_headers=forward
        )
        self.commit: str | None = self.revision if self.revision and _COMMIT.fullmatch(self.revision) else None
        self._lock = threading.Lock()

    @property
    def multi_range(self) -> bool:
        return self.http.multi_range

    def close(self) -> None:
        self.http.close()

    def resolve_url(self, location: str, commit: str | None = None) -> str:
        """The resolve URL of ``location`` (at ``commit`` when given, else at its revision).

        Raises:
            CheckpointError: ``HF_HUB_OFFLINE`` is set; the location's revision differs from the backend's.
        """
        if hub_offline():
            raise CheckpointError(f"{location}: HF_HUB_OFFLINE is set; hf:// URLs read from the Hub", path=location)
        hub = parse_hf_url(location)
        if hub.revision is not None and self.revision is not None and hub.revision != self.revision:
            why = f"names revision {hub.revision!r} but revision={self.revision!r} was asked"
            raise CheckpointError(f"{location}: {why}", path=location)
        revision = commit or self.commit or hub.revision or self.revision or "main"
        return hf_hub_url(hub.repo_id, hub.path, repo_type=hub.repo_type, revision=revision, endpoint=self.endpoint)

    def pin(self, commit: str) -> str:
        """Read every later file at ``commit`` (the first commit pinned stays); returns the commit pinned."""
        if not _COMMIT.fullmatch(commit):
            return self.commit or ""
        with self._lock:
            if self.commit is None:
                self.commit = commit
            return self.commit

    def stat(self, location: str) -> ObjectIdentity | None:
        pinned = self.commit
        identity = self.http.stat_url(self.resolve_url(location, pinned), location)
        if identity is None or pinned is not None or not _COMMIT.fullmatch(identity.version):
            return identity
        commit = self.pin(identity.version)
        if commit != identity.version:  # another file's answer pinned another commit first: ask at that one
            return self.http.stat_url(self.resolve_url(location, commit), location)
        return identity

    def first(self, location: str, nbytes: int) -> tuple[ObjectIdentity, bytes] | None:
        """:meth:`stat` and the first ``nbytes`` bytes in one ``GET`` (no ``HEAD``), pinned as :meth:`stat` pins."""
        pinned = self.commit
        got = first_bytes(self.http, self.resolve_url(location, pinned), location, nbytes)
        if got is None or pinned is not None or not _COMMIT.fullmatch(got[0].version):
            return got
        commit = self.pin(got[0].version)
        if commit != got[0].version:  # another file's answer pinned another commit first: ask at that one
            return first_bytes(self.http, self.resolve_url(location, commit), location, nbytes)
        return got

    def get(self, location: str, ranges: Sequence[tuple[int, int]], identity: ObjectIdentity) -> list[bytes]:
        commit = identity.version if _COMMIT.fullmatch(identity.version) else None
        return self.http.get_url(self.resolve_url(location, commit), location, ranges, identity)
