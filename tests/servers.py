"""Real servers on 127.0.0.1 for the remote-loading tests and benchmarks: nginx, moto's S3, a fault server.

Each is a context manager that starts the server as a child process in its own process group, waits until it
answers, yields its URL, and on exit stops the whole group (also when the body raised), so no process outlives
it. A server whose program is not installed raises :class:`ServerUnavailable` (tests turn it into a skip).

- ``nginx(root, limit_rate=, hub=)``: Debian's nginx serving ``root`` with single and multi-range responses
  (``max_ranges 1024``), strong ETags, ``If-Match``; ``hub=True`` adds the Hugging Face Hub's resolve URLs and the
  two API routes ``HfFileSystem`` reads (see :mod:`hub_layout`).
- ``s3_server()``: moto's server mode in a subprocess; ``put_folder`` uploads a folder with boto3, ``s3_env``
  gives the variables a client needs; ``throttle(upstream, limit_rate)`` puts a bandwidth-limiting nginx proxy in
  front of it (or of any server).
- ``fault_server(root)``: :mod:`fault_server`, a small HTTP/1.1 server whose misbehaviour is switched per path.

The nginx and fault servers yield a :class:`ServerUrl`: a ``str`` (the base URL, no trailing slash) that also
reads the server's request log, so tests and benchmarks can count requests and bytes on the wire.

What a client meets (seen with nginx 1.22.1, moto 5.2.1, huggingface_hub 2.4; tests/test_servers.py checks most):

- nginx, several ranges: a ``multipart/byteranges`` 206, parts in the order asked, overlapping or adjacent ranges
  not merged, about 116 bytes of part headers each; unsatisfiable ranges dropped (one left: a plain single-range
  206); ranges adding up to more than the file, or more than 1024 of them: 200 with the whole file. ``If-Match``
  mismatch: 412; ``If-Range`` mismatch: 200 with the whole file.
- moto: 206 + ``Content-Range`` + ``ETag`` for one range; several ranges: 200 with the whole object (as S3);
  ``If-Match`` mismatch: 412; unsigned requests: 403; ``Connection: close`` on every response (no keep-alive);
  an object uploaded in parts (boto3 above 8 MiB) has a multipart ETag ``"<md5>-<parts>"``.
- ``HfFileSystem`` reads whole 4 MiB blocks from a range's start (``cat_file``, ``cat_ranges``, a default
  ``open``); ``open(..., cache_type="none")`` asks for exactly the bytes read.
- ``tests/hf_models.py`` sets ``HF_HUB_OFFLINE=1`` for the whole test process: a Hub test against ``nginx(hub=True)``
  turns it off (``huggingface_hub.constants.HF_HUB_OFFLINE``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

from processes import HOST, child, on_free_port

HERE = Path(__file__).resolve().parent
#: dummy credentials moto accepts; ``s3_env`` hands them to clients
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


#: ``python -m moto.server`` that exits with the process that started it (see ``processes.exit_with_parent``)
MOTO = f"import sys; sys.path.insert(0, {str(HERE)!r}); import processes; processes.exit_with_parent(); "
MOTO += "import moto.server; moto.server.main(sys.argv[1:])"


_tokens = itertools.count()


class ServerUnavailable(RuntimeError):
    """The server's program is not installed here (tests skip with this message)."""


def serve(manager: contextlib.AbstractContextManager) -> Iterator:
    """Yield what a server context manager yields (for ``yield from`` in a pytest fixture); skip the test when the
    server's program is not installed."""
    with contextlib.ExitStack() as stack:
        try:
            value = stack.enter_context(manager)
        except ServerUnavailable as e:
            import pytest

            pytest.skip(str(e))
        yield value


class LoggedRequest(NamedTuple):
    """One request a server answered: ``status`` 0 when it never answered (``hang``, ``reset``)."""

    method: str
    path: str  # the URL path, query removed
    range: str | None  # the Range header as sent
    status: int
    bytes: int  # body bytes sent
    agent: str = ""  # the User-Agent header (nginx's logs)


class ServerUrl(str):
    """A server's base URL (``http://127.0.0.1:PORT``) that can also read the server's request log."""

    _read_log: Callable[[], list[LoggedRequest]]
    pid: int  #: the server's process (and process group) id

    def __new__(cls, url: str, read_log: Callable[[], list[LoggedRequest]], pid: int) -> ServerUrl:
        self = super().__new__(cls, url)
        self._read_log, self.pid = read_log, pid
        return self

    def __reduce__(self) -> tuple:  # to another process (a rank) it is the plain URL
        return str, (str(self),)

    def requests(self, path: str | None = None) -> list[LoggedRequest]:
        """Requests answered so far, oldest first; only those for URL path ``path`` when given."""
        return [r for r in self._read_log() if path is None or r.path == path]


# --- nginx -----------------------------------------------------------------------------------------------------

NGINX_CONF = """\
{user}worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 1024; }}
http {{
    types {{ application/json json; text/plain txt; }}
    default_type application/octet-stream;
    log_format rt escape=json
        '{{"method":"$request_method","path":"$request_uri","range":"$http_range","status":$status,'
        '"bytes":$body_bytes_sent,"agent":"$http_user_agent"}}';
    access_log {tmp}/access.log rt;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    sendfile on;
    keepalive_requests 100000;
    max_ranges 1024;
    large_client_header_buffers 4 64k;  # a Range header of 1024 ranges is about 25 KiB (the default line: 8 KiB)
    etag on;
{maps}
    server {{
        listen {host}:{port};
        root {root};
{limit_rate}
{locations}
    }}
}}
"""


def nginx_binary() -> str:
    """The nginx program, or :class:`ServerUnavailable` naming how to install it."""
    found = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
    if found is None:
        raise ServerUnavailable("nginx is not installed (apt-get install nginx-light; .ci/run does)")
    return found


PROXY = """\
        location / {{
            proxy_pass {upstream};
            proxy_set_header Host $http_host;  # as the client sent (and signed: SigV4 signs the Host header)
            proxy_http_version 1.1;
            proxy_buffering on;  # with it off, limit_rate was not honoured here (nginx 1.22)
        }}"""


def nginx_config(
    root: Path | None, tmp: Path, port: int, *, limit_rate: int | None = None, hub: bool = False, upstream: str = ""
) -> str:
    """The whole nginx.conf: everything nginx writes lives under ``tmp``."""
    from hub_layout import hub_config

    if upstream:
        maps, locations = "", PROXY.format(upstream=upstream)
    else:
        maps, locations = hub_config(root, tmp) if hub else ("", "        location / { }")
    return NGINX_CONF.format(
        user="user root;\n" if os.geteuid() == 0 else "",  # root's default worker user (nobody) cannot read /tmp/...
        tmp=tmp,
        host=HOST,
        port=port,
        root=root or tmp,
        maps=maps,
        locations=locations,
        # proxy_limit_rate: a proxy reads its upstream at the rate too (limit_rate alone lets a buffered one burst)
        limit_rate=f"        limit_rate {limit_rate};\n        proxy_limit_rate {limit_rate};" if limit_rate else "",
    )


#: the URL path prefix of the requests that settle nginx's log before it is read (left out of what it returns)
LOG_SYNC = "/__log_sync__/"


def _access_log(path: Path, url: str) -> Callable[[], list[LoggedRequest]]:
    """nginx's access log, settled: nginx writes a request's line just after sending its last byte, so a client
    that has every byte may read the log before that line is there. One worker answers every request in turn, so
    once a request sent after them (to ``LOG_SYNC``) is logged, so is every request answered before it."""

    def rows() -> list[dict]:
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def read() -> list[LoggedRequest]:
        token = f"{LOG_SYNC}{os.getpid()}-{next(_tokens)}"
        try:
            urllib.request.urlopen(f"{url}{token}", timeout=60).close()
        except urllib.error.HTTPError:
            pass  # a 404 (or the proxied store's error) is logged as well
        for _ in range(600):  # hang guard
            logged = rows()
            if any(r["path"] == token for r in logged):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"nginx never logged {token}")
        return [
            LoggedRequest(
                r["method"], r["path"].split("?")[0], r["range"] or None, r["status"], r["bytes"], r.get("agent", "")
            )
            for r in logged
            if not r["path"].startswith(LOG_SYNC)
        ]

    return read


@contextlib.contextmanager
def nginx(root: str | os.PathLike, *, limit_rate: int | None = None, hub: bool = False) -> Iterator[ServerUrl]:
    """Serve folder ``root`` with Debian's nginx on 127.0.0.1; yields the base URL.

    ``limit_rate``: bytes per second per connection. ``hub``: Hugging Face Hub layout, ``root/{org}/{name}/{revision}/
    {file}`` served at ``/{org}/{name}/resolve/{revision}/{file}`` (see :mod:`hub_layout`).
    """
    with _nginx(Path(root).resolve(), limit_rate=limit_rate, hub=hub) as url:
        yield url


@contextlib.contextmanager
def throttle(upstream: str, limit_rate: int) -> Iterator[ServerUrl]:
    """nginx as a reverse proxy to ``upstream`` (moto's S3 endpoint, say), each connection at ``limit_rate`` bytes/s.

    Yields the proxy's base URL, to use as the endpoint instead of ``upstream``; its log counts the bytes sent.
    """
    with _nginx(None, limit_rate=limit_rate, upstream=upstream.rstrip("/")) as url:
        yield url


@contextlib.contextmanager
def _nginx(root: Path | None, **config: object) -> Iterator[ServerUrl]:
    binary = nginx_binary()
    with tempfile.TemporaryDirectory(prefix="nginx-") as tmp_name:
        tmp = Path(tmp_name)

        def start(port: int) -> contextlib.AbstractContextManager:
            (tmp / "nginx.conf").write_text(nginx_config(root, tmp, port, **config))
            argv = [binary, "-p", str(tmp), "-e", str(tmp / "error.log"), "-c", str(tmp / "nginx.conf")]
            guarded = [sys.executable, str(HERE / "processes.py"), *argv, "-g", "daemon off;"]  # see guard()
            return child(guarded, port, tmp / "stderr.log", polite=signal.SIGQUIT)

        with on_free_port(start) as (port, pid):
            yield ServerUrl(f"http://{HOST}:{port}", _access_log(tmp / "access.log", f"http://{HOST}:{port}"), pid)


# --- moto's S3 -------------------------------------------------------------------------------------------------


def s3_env(endpoint_url: str) -> dict[str, str]:
    """Environment variables that point boto3 / s3fs / the AWS CLI at ``endpoint_url`` with the dummy keys."""
    return {**S3_CREDENTIALS, "AWS_ENDPOINT_URL": endpoint_url, "AWS_ENDPOINT_URL_S3": endpoint_url}


@contextlib.contextmanager
def s3_server() -> Iterator[str]:
    """moto's S3 server (``python -m moto.server``) in a subprocess on 127.0.0.1; yields its endpoint URL."""
    try:
        import moto.server  # noqa: F401  (only to know it is there; the server runs in the child)
    except ImportError as e:
        raise ServerUnavailable(f"moto's server mode is not installed (pip install 'moto[server]'): {e}") from e
    env = {**os.environ, **S3_CREDENTIALS}
    with tempfile.TemporaryDirectory(prefix="moto-") as tmp:

        def start(port: int) -> contextlib.AbstractContextManager:
            argv = [sys.executable, "-c", MOTO, "-H", HOST, "-p", str(port)]
            return child(argv, port, Path(tmp) / "moto.log", env=env)

        with on_free_port(start) as (port, _):
            yield f"http://{HOST}:{port}"


def s3_client(endpoint_url: str):
    """A boto3 S3 client for ``endpoint_url`` with the dummy credentials."""
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        aws_access_key_id=S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=S3_CREDENTIALS["AWS_DEFAULT_REGION"],
    )


def put_folder(endpoint_url: str, bucket: str, prefix: str, folder: str | os.PathLike) -> str:
    """Create ``bucket`` (if new) and upload every file under ``folder`` to ``prefix/<relative path>``.

    Returns the folder's URL, ``s3://bucket/prefix``. Bucket names follow S3's rules (3-63 characters).
    """
    client = s3_client(endpoint_url)
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        client.create_bucket(Bucket=bucket)
    folder = Path(folder)
    prefix = prefix.strip("/")
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        key = "/".join(filter(None, [prefix, path.relative_to(folder).as_posix()]))
        client.upload_file(str(path), bucket, key)
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


# --- the fault server ------------------------------------------------------------------------------------------


class FaultControl:
    """Switches the fault server's behaviour per URL path and reads its request log.

    Modes (:data:`fault_server.MODES`): ``ignore_range``, ``status=404|403``, ``fail_then_ok=N``, ``truncate``,
    ``change_etag_after=K``, ``hang``, ``reset``. Counters (``fail_then_ok``, ``change_etag_after``) start when
    the mode is set.
    """

    def __init__(self, base_url: str):
        self.base_url = base_url

    def _call(self, method: str, route: str, body: dict | None = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + route, data=data, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as e:
            raise ValueError(f"fault server {route}: {e.code} {e.read().decode(errors='replace').strip()}") from None

    def set(self, path: str, **mode: object) -> None:
        """Give URL path ``path`` (``/model.safetensors``) the faults ``mode`` (replacing its previous ones)."""
        self._call("POST", "/__control__", {"path": path, "mode": mode})

    def clear(self) -> None:
        """Every path back to normal, counters and request log emptied."""
        self._call("DELETE", "/__control__")

    def log(self) -> list[LoggedRequest]:
        """Requests so far (control requests excluded), oldest first."""
        return [LoggedRequest(*row) for row in self._call("GET", "/__log__")]


@contextlib.contextmanager
def fault_server(root: str | os.PathLike) -> Iterator[tuple[ServerUrl, FaultControl]]:
    """Serve ``root`` with :mod:`fault_server` in a subprocess; yields ``(base_url, control)``."""
    with tempfile.TemporaryDirectory(prefix="faults-") as tmp:

        def start(port: int) -> contextlib.AbstractContextManager:
            argv = [sys.executable, str(HERE / "fault_server.py"), str(Path(root).resolve()), HOST, str(port)]
            return child(argv, port, Path(tmp) / "faults.log")

        with on_free_port(start) as (port, pid):
            control = FaultControl(f"http://{HOST}:{port}")
            yield ServerUrl(control.base_url, control.log, pid), control
