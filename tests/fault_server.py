"""A small real HTTP/1.1 file server whose misbehaviour is switched per URL path.

Usage: ``python fault_server.py ROOT HOST PORT``.

Run as a subprocess by :func:`servers.fault_server` (a subprocess, not a thread of the test process: the loader's
reader threads and the server do not share a GIL, a ``hang`` handler blocked forever dies with the process, and
``reset`` is a real TCP RST). Standard library only.

Normal behaviour: files under ROOT, ``GET`` and ``HEAD``, keep-alive, a strong ``ETag`` (``"<mtime_ns>-<size>"``
in hex), ``Accept-Ranges: bytes``; ``Range: bytes=a-b`` / ``a-`` / ``-n`` gives 206 with ``Content-Range``,
several ranges give ``multipart/byteranges``, an unsatisfiable one 416; ``If-Match`` that does not match gives
412. Modes (:data:`MODES`), set per path by ``POST /__control__ {"path": "/f", "mode": {...}}``:

- ``ignore_range``: 200 with the whole body, whatever the Range header says.
- ``status``: always answer this status (404, 403, ...) with a short text body.
- ``fail_then_ok=N``: the next N requests get 500, later ones are normal.
- ``truncate``: headers promise the full Content-Length, half the body is sent, then the connection is closed.
- ``change_etag_after=K``: after K responses the object is "replaced": a new ETag, every byte XOR 0xFF.
- ``hang``: the request is read and never answered (the connection stays open until the server stops).
- ``reset``: the connection is closed with a TCP RST, no answer.
- ``trickle=B``: the body is sent at about B bytes per second (a slice every 50 ms).
- ``coalesce``: how a multi-range request is answered: ``"one"`` (one part from the first range's start to the
  last one's end), ``"plain"`` (the same as a plain 206), ``"reverse"`` (the parts in reverse order), ``"unasked"``
  (one more part, of bytes no range asked), ``"missing"`` (the last range's part left out).
- ``redirect="http://host:port"``: a 302 to that server, same path and query.
- ``refuse_header="Name"``: a 403 to a request that carries the header.
- ``require_query="k=v"``: a 403 to a request whose query string lacks ``k=v`` (a presigned URL's signature).
- ``alternate="other/file"``: another version of the object (a file under ROOT), served instead of it to requests
  with the header ``alternate_for=[name, value]`` (a server answering clients differently), or after
  ``alternate_after=K`` responses (replaced mid-load), or always when neither is given.
- ``validator``: the identity the answers tell: ``"strong"`` (the default: each version's own ETag), ``"none"`` (no
  ETag, no Last-Modified), ``"constant"`` (one strong ETag for every version), ``"weak"`` (one weak ETag and one
  Last-Modified for every version), ``"dated"`` (no ETag; each version's own Last-Modified, and ``If-Range`` honoured:
  the whole object, 200, when it names another).
- ``ignore_if_match``: ``If-Match`` is not looked at.
- ``relink_after=[K, link, target]``: after K responses the symlink ``ROOT/link`` points at ``target`` (a Hub
  branch that moves).

Paths ``[/prefix]/{org}/{name}/resolve/{revision}/{file}`` are the Hub's resolve URLs: the file
``ROOT[/prefix]/{org}/{name}/{revision}/{file}``, with ``X-Repo-Commit`` (the name of the folder the revision
links to, read at each request), ``X-Linked-Etag`` and ``X-Linked-Size``, and ``X-Error-Code: EntryNotFound`` on a
404.

``DELETE /__control__`` clears every mode, counter and the log; ``GET /__log__`` returns the request log as JSON
rows ``[method, path, range, status, body_bytes]`` (status 0: never answered).
"""

from __future__ import annotations

import email.utils
import json
import os
import re
import socket
import struct
import sys
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from processes import exit_with_parent

MODES = ("ignore_range", "status", "fail_then_ok", "truncate", "change_etag_after", "hang", "reset")
MODES += ("alternate", "alternate_for", "alternate_after", "validator", "ignore_if_match", "relink_after")
MODES += ("trickle", "coalesce", "redirect", "refuse_header", "require_query")
RESOLVE = re.compile(r"(?P<prefix>(/[^/]+)*?)/(?P<org>[^/]+)/(?P<repo>[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")
BOUNDARY = "fault-server-boundary"
FLIPPED = bytes(b ^ 0xFF for b in range(256))  # the "replaced" object's bytes: bytes.translate(FLIPPED)


class State:
    """Modes, per-path response counters and the request log, shared by the handler threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.modes: dict[str, dict] = {}
        self.served: dict[str, int] = {}  # responses per path since its mode was set
        self.log: list[list] = []
        self.stopping = threading.Event()

    def next_response(self, path: str) -> tuple[dict, int]:
        """The path's mode and how many responses it had before this one."""
        with self.lock:
            count = self.served.get(path, 0)
            self.served[path] = count + 1
            return dict(self.modes.get(path, {})), count


def parse_ranges(header: str | None, size: int) -> list[tuple[int, int]] | None:
    """``[(start, stop)]`` from a Range header; ``None`` for no/unparsable header; ``[]`` when unsatisfiable."""
    if not header or not header.startswith("bytes="):
        return None
    ranges = []
    for spec in header[6:].split(","):
        first, sep, last = spec.strip().partition("-")
        if not sep or not (first or last) or not (first + last).isdigit():
            return None
        if not first:
            start, stop = max(size - int(last), 0), size
        else:
            start, stop = int(first), min(int(last) + 1, size) if last else size
        if start < stop:
            ranges.append((start, stop))
    return ranges


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: FaultServer

    def log_message(self, format: str, *args: object) -> None:  # quiet: the log is /__log__
        pass

    def _record(self, status: int, sent: int) -> None:
        path = self.path.split("?")[0]
        with self.server.state.lock:
            self.server.state.log.append([self.command, path, self.headers.get("Range"), status, sent])

    def _send(self, status: int, headers: dict[str, str], body: bytes, *, promise: int | None = None) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body) if promise is None else promise))
        self._record(status, 0 if self.command == "HEAD" else len(body))  # logged before the client has it all
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, value: object) -> None:
        body = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        if self.path != "/__control__":
            return self._send(405, {}, b"method not allowed\n")
        request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        unknown = set(request["mode"]) - set(MODES)
        if unknown:
            return self._send(400, {}, f"unknown modes {sorted(unknown)}; known: {MODES}\n".encode())
        with self.server.state.lock:
            self.server.state.modes[request["path"]] = request["mode"]
            self.server.state.served[request["path"]] = 0
        self._json(None)

    def do_DELETE(self) -> None:
        state = self.server.state
        with state.lock:
            state.modes.clear()
            state.served.clear()
            state.log.clear()
        self._json(None)

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_GET(self) -> None:
        if self.path == "/__log__":
            with self.server.state.lock:
                return self._json(list(self.server.state.log))
        path = self.path.split("?")[0]
        mode, count = self.server.state.next_response(path)
        if mode.get("hang"):
            self._record(0, 0)
            self.server.state.stopping.wait()
            self.close_connection = True
            return
        if mode.get("reset"):
            self._record(0, 0)
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if "redirect" in mode:
            return self._send(302, {"Location": mode["redirect"] + self.path}, b"")
        query = urllib.parse.urlsplit(self.path).query.split("&")
        refused = mode.get("refuse_header") and self.headers.get(mode["refuse_header"]) is not None
        if refused or ("require_query" in mode and mode["require_query"] not in query):
            return self._send(403, {"Content-Type": "text/plain"}, b"fault server: a header it refuses\n")
        if "status" in mode:
            return self._send(int(mode["status"]), {"Content-Type": "text/plain"}, b"fault server: status mode\n")
        if count < int(mode.get("fail_then_ok", 0)):
            return self._send(500, {"Content-Type": "text/plain"}, b"fault server: fail_then_ok\n")
        self._serve_file(path, mode, count)
        self._relink(mode, count)

    def _version(self, path: str, mode: dict, count: int) -> tuple[Path, dict[str, str]]:
        """The file that answers ``path`` (its alternate where the mode says) and the Hub's headers."""
        name, hub = urllib.parse.unquote(path).lstrip("/"), {}
        match = RESOLVE.fullmatch("/" + name)
        if match is not None:
            repo = f"{match['prefix']}/{match['org']}/{match['repo']}".lstrip("/")
            revision = self.server.root / repo / match["rev"]
            name = f"{repo}/{match['rev']}/{match['file']}"
            hub = {"X-Repo-Commit": revision.resolve().name, "X-Error-Code": "EntryNotFound"}
        if "alternate" in mode:
            who = mode.get("alternate_for")
            after = mode.get("alternate_after")
            if (who is None and after is None) or (who and self.headers.get(who[0]) == who[1]):
                name = mode["alternate"]
            elif after is not None and count >= int(after):
                name = mode["alternate"]
        return self.server.root / name, hub

    def _relink(self, mode: dict, count: int) -> None:
        """``relink_after``: once the K-th response was sent, the link points at its new target."""
        if "relink_after" in mode and count + 1 >= int(mode["relink_after"][0]):
            _, link, target = mode["relink_after"]
            temporary = self.server.root / f"{link}.relinking"
            temporary.unlink(missing_ok=True)
            temporary.symlink_to(target)
            os.replace(temporary, self.server.root / link)

    def _serve_file(self, path: str, mode: dict, count: int) -> None:
        file, hub = self._version(path, mode, count)
        file = file.resolve()
        if not file.is_relative_to(self.server.root) or not file.is_file():
            return self._send(404, {"Content-Type": "text/plain", **hub}, b"not found\n")
        hub.pop("X-Error-Code", None)
        stat = file.stat()
        size, etag, replaced = stat.st_size, f'"{stat.st_mtime_ns:x}-{stat.st_size:x}"', False
        if "change_etag_after" in mode and count >= int(mode["change_etag_after"]):
            etag, replaced = etag[:-1] + '-replaced"', True
        validator = mode.get("validator", "strong")
        etag = {"none": "", "dated": "", "constant": '"constant"', "weak": 'W/"constant"'}.get(validator, etag)

        def read(start: int, stop: int) -> bytes:
            with open(file, "rb") as f:
                f.seek(start)
                data = f.read(stop - start)
            return data.translate(FLIPPED) if replaced else data

        headers = {"ETag": etag, "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        if not etag:
            del headers["ETag"]
        if validator == "weak":
            headers["Last-Modified"] = "Mon, 01 Dec 2025 00:00:00 GMT"
        if validator == "dated":
            headers["Last-Modified"] = email.utils.formatdate(stat.st_mtime + (1 if replaced else 0), usegmt=True)
        if hub:
            headers.update(hub, **{"X-Linked-Size": str(size)}, **({"X-Linked-Etag": etag} if etag else {}))
        if_match = None if mode.get("ignore_if_match") else self.headers.get("If-Match")
        if if_match and if_match.strip() != "*" and etag not in [t.strip() for t in if_match.split(",")]:
            return self._send(412, {"ETag": etag} if etag else {}, b"precondition failed\n")
        ranges = None if mode.get("ignore_range") else parse_ranges(self.headers.get("Range"), size)
        if_range = self.headers.get("If-Range") if validator == "dated" else None
        if if_range and if_range != headers["Last-Modified"]:
            ranges = None  # changed since: the whole object
        if ranges == []:
            return self._send(416, {"Content-Range": f"bytes */{size}"}, b"range not satisfiable\n")
        if not ranges:
            status, body = 200, read(0, size)
        elif len(ranges) == 1:
            (start, stop), status = ranges[0], 206
            body, headers["Content-Range"] = read(start, stop), f"bytes {start}-{stop - 1}/{size}"
        elif mode.get("coalesce") == "plain":
            start, stop, status = ranges[0][0], ranges[-1][1], 206
            body, headers["Content-Range"] = read(start, stop), f"bytes {start}-{stop - 1}/{size}"
        else:
            status, body = 206, self._multipart(read, size, coalesced(ranges, mode.get("coalesce", ""), size))
            headers["Content-Type"] = f"multipart/byteranges; boundary={BOUNDARY}"
        if mode.get("trickle") and self.command != "HEAD":
            return self._trickle(status, headers, body, float(mode["trickle"]))
        if mode.get("truncate") and self.command != "HEAD":
            self._send(status, headers, body[: len(body) // 2], promise=len(body))
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self._send(status, headers, body)

    def _trickle(self, status: int, headers: dict[str, str], body: bytes, rate: float) -> None:
        self.send_response(status)
        for key, value in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(key, value)
        self.end_headers()
        step, sent = max(1, int(rate / 20)), 0
        while sent < len(body) and not self.server.state.stopping.wait(0.05):
            try:
                self.wfile.write(body[sent : sent + step])
                self.wfile.flush()
            except OSError:  # the client gave up
                break
            sent += step
        self._record(status, min(sent, len(body)))
        self.close_connection = True

    @staticmethod
    def _multipart(read: Callable[[int, int], bytes], size: int, ranges: list[tuple[int, int]]) -> bytes:
        parts = []
        for start, stop in ranges:
            head = f"--{BOUNDARY}\r\nContent-Type: application/octet-stream\r\n"
            head += f"Content-Range: bytes {start}-{stop - 1}/{size}\r\n\r\n"
            parts.append(head.encode() + read(start, stop) + b"\r\n")
        return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def coalesced(ranges: list[tuple[int, int]], how: str, size: int) -> list[tuple[int, int]]:
    """The parts a multi-range answer sends for ``ranges`` (see the ``coalesce`` mode)."""
    if how == "one":
        return [(ranges[0][0], ranges[-1][1])]
    if how == "reverse":
        return ranges[::-1]
    if how == "unasked":
        return ranges + [(ranges[-1][1], min(ranges[-1][1] + 1, size))] if ranges[-1][1] < size else [(0, 1)] + ranges
    if how == "missing":
        return ranges[:-1]
    return ranges


class FaultServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, address: tuple[str, int]):
        self.root = root.resolve()
        self.state = State()
        super().__init__(address, Handler)


def main(argv: list[str]) -> None:
    exit_with_parent()
    root, host, port = Path(argv[0]), argv[1], int(argv[2])
    server = FaultServer(root, (host, port))
    try:
        server.serve_forever()
    finally:
        server.state.stopping.set()


if __name__ == "__main__":
    main(sys.argv[1:])
