"""HTTP(S) objects through ``requests``: ``stat`` by ``HEAD``, ``get`` by a ranged ``GET``, every response checked.

Vocabulary: a *ranged GET* asks ``Range: bytes=a-b`` (several ranges comma-separated: a *multi-range* request,
answered as ``multipart/byteranges``, parsed by requests_toolbelt's ``MultipartDecoder``) with ``If-Match:
<etag>`` where the object has a strong ETag (``If-Range: <Last-Modified>`` where it has only that); its answer must
be ``206`` with the asked ``Content-Range`` (each part's, for a multi-range one), the exact length, and the same ETag
(else Last-Modified) as the object's identity.

What each answer becomes (the fetcher retries :class:`Transient`, gives up with a ``CheckpointError`` after):

======================================  ===============================================================
``206`` as asked                        the bytes
``200`` to a one-range request          ``CheckpointError``: the server ignores ``Range`` requests
``206`` parts to a multi-range          each asked range cut out of the part that covers it (parts in any
                                        order, one part covering several ranges: RFC 9110 allows both); a
                                        part no range asked, or a range no part covers: ``CheckpointError``
``200`` / one plain range not covering  the server cannot serve several ranges at once: this backend's
the ranges, to a multi-range            :attr:`~HttpBackend.multi_range` turns ``False`` (a debug log says
                                        so) and the ranges are fetched one by one
``404`` / ``410``                       ``stat``: ``None``; ``get``: ``CheckpointError`` (not found)
``401`` / ``403``                       ``CheckpointError``: access refused (no header is ever echoed)
``412``, another ETag or size, ``200``  ``CheckpointError``: the object changed
to ``If-Range``
``416``, another ``Content-Range``      ``CheckpointError``
``408``, ``429``, ``5xx``               :class:`Transient`
a reset, a timeout, a short body        :class:`Transient`
a body slower than ``min_rate``         :class:`Transient` (a request lasts ``timeout + bytes / min_rate``
                                        seconds at most, enforced while its body streams in)
======================================  ===============================================================

Headers the caller gave (``headers``, the Hub's token) go to the host asked only: a redirect to another host
(another scheme, host or port, as ``requests`` decides for ``Authorization``) is sent without them, unless
``forward_headers``.

Errors name the URL without its user info and secrets (:func:`~loader.errors.redact_url`: a presigned URL's
signature stays out of messages and logs; a transport error whose text held one loses its cause).
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import requests
import urllib3
from requests_toolbelt.multipart.decoder import (
    ImproperBodyPartContentException,
    MultipartDecoder,
    NonMultipartContentTypeException,
)

from ...errors import CheckpointError, redact_url
from ..base import ObjectIdentity
from .backend import ErrorMap, RemoteOptions, Transient
from .checks import assemble, changed, check_part, check_status, parse_content_range, range_header, read_within

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeaderNames:
    """Where a response tells an object's identity; the first header present wins.

    Attributes:
        etag: The ETag's headers (the Hub: ``X-Linked-Etag`` first, for files in LFS/Xet storage).
        size: The size's headers, read from ``HEAD`` answers (the Hub: ``X-Linked-Size`` first).
        version: A header naming the object's version (the Hub: ``X-Repo-Commit``); ``""``: Last-Modified is the
            version where there is no strong ETag.
        error_code: A header whose value on a ``404`` says more than "not found" (the Hub's ``X-Error-Code``:
            ``RepoNotFound``, ``RevisionNotFound``), raised as a ``CheckpointError`` instead of ``None``.
    """

    etag: tuple[str, ...] = ("ETag",)
    size: tuple[str, ...] = ("Content-Length",)
    version: str = ""
    error_code: str = ""


def identity_of(headers: Mapping[str, str], size: int, names: HeaderNames) -> ObjectIdentity:
    """The identity ``headers`` give: a strong ETag; the version from ``names.version``, else, without a strong
    ETag, Last-Modified (else the weak ETag)."""
    tag = next((headers[h] for h in names.etag if headers.get(h)), "")
    strong = tag if tag.startswith('"') else ""
    version = headers.get(names.version, "") if names.version else ""
    return ObjectIdentity(size, strong, version or ("" if strong else headers.get("Last-Modified") or tag))


def check_identity(name: str, headers: Mapping[str, str], identity: ObjectIdentity, names: HeaderNames) -> None:
    """Raise when a response's ETag (else version) differs from the object's identity."""
    got = identity_of(headers, identity.size, names)
    if identity.etag and got.etag and got.etag != identity.etag:
        raise changed(name, f"ETag {got.etag}, was {identity.etag}")
    if not identity.etag and identity.version and got.version and got.version != identity.version:
        raise changed(name, f"version {got.version!r}, was {identity.version!r}")


def told(backend: HttpBackend, name: str, headers: Mapping[str, str], size: int) -> ObjectIdentity:
    """The identity ``headers`` tell; the first time ``backend`` meets no strong validator (no ETag, a weak one), a
    warning naming the URL: a file replaced during the load is then told only by its size and its header's bytes
    (:mod:`.recheck`)."""
    identity = identity_of(headers, size, backend.names)
    if backend.warned or identity.etag or (backend.names.version and headers.get(backend.names.version)):
        return identity
    backend.warned = True
    tag, modified = headers.get("ETag") or "no ETag", headers.get("Last-Modified") or "no Last-Modified"
    log.warning(
        "%s: the server tells no strong validator (%s, %s): a file replaced during the load is detected only by "
        "its size and by its header, fetched again with its last request (said once per load)",
        redact_url(name),
        tag,
        modified,
    )
    return identity


def multipart_parts(name: str, content_type: str, body: bytes) -> list[tuple[str | None, bytes]]:
    """``(Content-Range, payload)`` of each part of a ``multipart/byteranges`` body (requests_toolbelt's decoder:
    it splits on the boundary; Python's email parser, line by line, reads about 14 MB/s)."""
    try:
        decoder = MultipartDecoder(body, content_type)
    except (NonMultipartContentTypeException, ImproperBodyPartContentException) as e:
        raise CheckpointError(f"{name}: a multipart/byteranges answer that does not parse: {e}", path=name) from e
    return [(part.headers.get(b"Content-Range", b"").decode("latin-1") or None, part.content) for part in decoder.parts]


def merged_headers(response: requests.Response) -> dict[str, str]:
    """The final response's headers, with the ``X-Linked-*`` / ``X-Repo-Commit`` of redirects before it (the
    Hub sends them on the redirect to its CDN)."""
    headers = requests.structures.CaseInsensitiveDict(response.headers)
    for earlier in response.history:
        for key, value in earlier.headers.items():
            if key.lower().startswith(("x-linked-", "x-repo-commit")) and key not in headers:
                headers[key] = value
    return headers


def is_multipart(r: requests.Response) -> bool:
    return r.headers.get("Content-Type", "").startswith("multipart/")


def covering_range(r: requests.Response, ranges: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The range of a plain (not multipart) 206 answer to a multi-range request where it covers every asked range
    (RFC 9110 lets a server coalesce them into one); ``None`` otherwise."""
    plain = parse_content_range(r.headers.get("Content-Range")) if r.status_code == 206 else None
    if plain is None or is_multipart(r) or not (plain[0] <= ranges[0][0] and ranges[-1][1] <= plain[1]):
        return None
    return plain[0], plain[1]


def answer_parts(
    name: str, r: requests.Response, plain: tuple[int, int] | None, body: bytes
) -> list[tuple[str | None, bytes]]:
    """The ``(Content-Range, payload)`` parts of a 206 answer to a multi-range request, for
    :func:`~.checks.assemble`: its one range where it is plain (``plain``: :func:`covering_range`), else its
    ``multipart/byteranges`` parts."""
    if plain is not None:
        return [(r.headers.get("Content-Range"), body)]
    return multipart_parts(name, r.headers["Content-Type"], body)


def read_body(r: requests.Response, nbytes: int, started: float, timeout: float, min_rate: float) -> bytes:
    """``r``'s body (``nbytes`` expected), refused (:class:`Transient`) once the request, ``started`` then, has
    lasted ``timeout + nbytes / min_rate`` seconds."""
    bound = lambda: f"{nbytes} bytes within timeout {timeout:g} s + bytes / min_rate {min_rate:g} B/s"
    deadline = started + timeout + nbytes / min_rate
    return read_within(lambda n: r.raw.read1(n, decode_content=False), deadline, bound)


class _Session(requests.Session):
    """A ``requests.Session`` that drops the caller's headers on a redirect to another host (``requests`` itself
    drops only ``Authorization``), unless told to forward them."""

    def __init__(self, private: Sequence[str], forward: bool) -> None:
        super().__init__()
        self.private, self.forward = tuple(private), forward

    def rebuild_auth(self, prepared_request: requests.PreparedRequest, response: requests.Response) -> None:
        super().rebuild_auth(prepared_request, response)
        if not self.forward and self.should_strip_auth(response.request.url, prepared_request.url):
            for header in self.private:
                prepared_request.headers.pop(header, None)


class transport_errors(ErrorMap):
    """A context manager: what ``requests``/``urllib3`` raise, as :class:`Transient` or ``CheckpointError``."""

    def translate(self, error: BaseException) -> None:
        text = f"{type(error).__name__}: {error}"
        safe = redact_url(text)
        cause = error if safe == text else None  # the library's exception names the URL whole: not chained
        if isinstance(error, requests.exceptions.SSLError):
            raise CheckpointError(f"{self.name}: TLS failed: {safe}", path=self.name) from cause
        transient = (requests.exceptions.ConnectionError, requests.exceptions.Timeout)
        transient += (requests.exceptions.ChunkedEncodingError, urllib3.exceptions.HTTPError, OSError)
        if isinstance(error, transient):
            raise Transient(safe) from cause
        if isinstance(error, requests.exceptions.RequestException):
            raise CheckpointError(f"{self.name}: {safe}", path=self.name) from cause


class HttpBackend:
    """HTTP(S) objects by URL (see the module's table); thread-safe (a ``requests.Session`` per thread).

    Args:
        options: Timeouts (``timeout``: connect, between bytes; ``min_rate``: a whole request) and pool size.
        headers: Sent with every request to the host asked (an ``Authorization``, say): see the module.
        verify: TLS certificate checking: ``True``, ``False`` or a CA bundle's path.
        auth: ``(user, password)`` for HTTP basic authentication.
        names: Where responses tell the identity.
        if_match: Send ``If-Match`` with the ETag (off where a redirect leads to a server with other ETags).
        forward_headers: Send ``headers`` on a redirect to another host too.
    """

    def __init__(
        self,
        options: RemoteOptions,
        *,
        headers: Mapping[str, str] | None = None,
        verify: bool | str = True,
        auth: tuple[str, str] | None = None,
        names: HeaderNames = HeaderNames(),
        if_match: bool = True,
        forward_headers: bool = False,
    ) -> None:
        self.multi_range = True
        self.recheck_heads, self.warned = True, False  # headers fetched again (.recheck); weak validators said once
        self.timeout, self.min_rate = options.request_timeout, options.min_rate
        self.private, self.forward_headers = tuple(headers or {}), forward_headers  # see _Session
        self.headers = {**dict(headers or {}), "Accept-Encoding": "identity"}
        self.verify, self.auth, self.if_match = verify, auth, if_match
        self.names = names
        self._local = threading.local()
        self._sessions: weakref.WeakSet[requests.Session] = weakref.WeakSet()  # a dead thread's goes with it
        self._lock = threading.Lock()

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = _Session(self.private, self.forward_headers)
            session.headers.update(self.headers)
            session.verify, session.auth = self.verify, self.auth
            with self._lock:
                self._sessions.add(session)
        return session

    def close(self) -> None:
        with self._lock:
            sessions, self._sessions = list(self._sessions), weakref.WeakSet()
        for session in sessions:
            session.close()
        self._local = threading.local()

    def stat(self, location: str) -> ObjectIdentity | None:
        return self.stat_url(location, redact_url(location))

    def get(self, location: str, ranges: Sequence[tuple[int, int]], identity: ObjectIdentity) -> list[bytes]:
        return self.get_url(location, redact_url(location), ranges, identity)

    def stat_url(self, url: str, name: str) -> ObjectIdentity | None:
        """:meth:`stat` of ``url``, naming ``name`` in errors: ``HEAD``, else a ``GET`` of its first byte."""
        with transport_errors(name), self._session().head(url, timeout=self.timeout, allow_redirects=True) as r:
            headers = merged_headers(r)
            if r.status_code in (404, 410):
                return self._missing(name, headers)
            size = next((headers[h] for h in self.names.size if headers.get(h, "").isdigit()), None)
            if r.status_code == 200 and size is not None:
                return told(self, name, headers, int(size))
            if r.status_code not in (405, 501):
                check_status(name, r.status_code)
        with transport_errors(name), self._send(url, [(0, 1)], None) as r:  # no HEAD or no size: the first byte
            if r.status_code in (404, 410):
                return self._missing(name, merged_headers(r))
            if r.status_code == 416:
                return ObjectIdentity(0)
            self._check_206(name, r)
            total = (parse_content_range(r.headers.get("Content-Range")) or (0, 0, None))[2]
            if total is None:
                raise CheckpointError(f"{name}: the server tells no size (no Content-Length, no Content-Range)")
            return told(self, name, merged_headers(r), total)

    def first(self, location: str, nbytes: int) -> tuple[ObjectIdentity, bytes] | None:
        return first_bytes(self, location, redact_url(location), nbytes)

    def _missing(self, name: str, headers: Mapping[str, str]) -> None:
        code = headers.get(self.names.error_code, "") if self.names.error_code else ""
        if code and code != "EntryNotFound":
            raise CheckpointError(f"{name}: {code} (HTTP 404)", path=name)
        return None

    def get_url(self, url: str, name: str, ranges: Sequence[tuple[int, int]], identity: ObjectIdentity) -> list[bytes]:
        """:meth:`get` of ``url``, naming ``name`` in errors."""
        if len(ranges) > 1 and self.multi_range:
            parts = self._get_multi(url, name, ranges, identity)
            if parts is not None:
                return parts
            self.multi_range = False
            log.debug("%s answers a multi-range request without multipart/byteranges: ranges one by one", name)
        return [self._get_one(url, name, a, b, identity) for a, b in ranges]

    def _send(self, url: str, ranges: Sequence[tuple[int, int]], identity: ObjectIdentity | None):
        headers = {"Range": range_header(ranges)}
        if self.if_match and identity is not None and identity.etag:
            headers["If-Match"] = identity.etag
        elif self.if_match and identity is not None and identity.version.endswith(" GMT"):  # Last-Modified alone
            headers["If-Range"] = identity.version  # a server honouring it sends the whole object if it changed
        return self._session().get(url, headers=headers, stream=True, timeout=self.timeout)

    def _check_206(self, name: str, r: requests.Response) -> None:
        check_status(name, r.status_code)
        if r.status_code == 200 and r.request.headers.get("If-Range"):
            raise changed(name, f"Last-Modified no longer {r.request.headers['If-Range']}: 200 to If-Range")
        if r.status_code == 200:
            raise CheckpointError(f"{name}: the server ignores Range requests (200 instead of 206)", path=name)
        encoding = r.headers.get("Content-Encoding", "identity").lower()
        if encoding != "identity":
            raise CheckpointError(f"{name}: a ranged answer with Content-Encoding {encoding}", path=name)

    def _get_one(self, url: str, name: str, start: int, end: int, identity: ObjectIdentity) -> bytes:
        started = time.monotonic()
        with transport_errors(name), self._send(url, [(start, end)], identity) as r:
            self._check_206(name, r)
            check_identity(name, merged_headers(r), identity, self.names)
            body = read_body(r, end - start, started, self.timeout, self.min_rate)
            return check_part(name, r.headers.get("Content-Range"), start, end, identity.size, body)

    def _get_multi(
        self, url: str, name: str, ranges: Sequence[tuple[int, int]], identity: ObjectIdentity
    ) -> list[bytes] | None:
        """The ranges from one multi-range request (:func:`answer_parts`); ``None`` when the server answers
        otherwise (200, a plain 206 not covering them)."""
        started = time.monotonic()
        with transport_errors(name), self._send(url, ranges, identity) as r:
            plain = covering_range(r, ranges)
            if r.status_code == 200 or (r.status_code == 206 and not is_multipart(r) and plain is None):
                return None  # the body is not read: closing the response drops the connection
            self._check_206(name, r)
            check_identity(name, merged_headers(r), identity, self.names)
            nbytes = plain[1] - plain[0] if plain else sum(b - a for a, b in ranges)
            body = read_body(r, nbytes, started, self.timeout, self.min_rate)
        return assemble(name, answer_parts(name, r, plain, body), ranges, identity.size)


def first_bytes(backend: HttpBackend, url: str, name: str, nbytes: int) -> tuple[ObjectIdentity, bytes] | None:
    """:meth:`HttpBackend.first` of ``url``, naming ``name`` in errors: the identity and first ``min(nbytes,
    size)`` bytes from one ranged ``GET`` (its ``Content-Range`` tells the size: no ``HEAD``); ``None`` when it
    does not exist."""
    started = time.monotonic()
    with transport_errors(name), backend._send(url, [(0, max(1, nbytes))], None) as r:
        headers = merged_headers(r)
        if r.status_code in (404, 410):
            return backend._missing(name, headers)
        if r.status_code == 416 or (r.status_code == 200 and r.headers.get("Content-Length") == "0"):
            total = (parse_content_range(r.headers.get("Content-Range")) or (0, 0, 0))[2]
            if total == 0:  # an empty object: no byte to send (nginx answers 200, others 416 "bytes */0")
                return told(backend, name, headers, 0), b""
        backend._check_206(name, r)
        got = parse_content_range(r.headers.get("Content-Range"))
        if got is None or got[2] is None:
            raise CheckpointError(f"{name}: a 206 answer without the object's size in Content-Range", path=name)
        identity = told(backend, name, headers, got[2])
        end = min(max(1, nbytes), identity.size)
        body = read_body(r, end, started, backend.timeout, backend.min_rate)
        return identity, check_part(name, r.headers.get("Content-Range"), 0, end, identity.size, body)[:nbytes]
