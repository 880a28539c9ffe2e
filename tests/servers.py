"""Real servers for the tests of remote models, on 127.0.0.1 only, all their state in a temporary directory.

- SeaweedFS and nginx, whose runners are the benchmark's (tensorfs/testing/servers.py): a real
  distributed object store with an S3 API, and static files over HTTP with ranges, ETags and
  If-Match, for http(s):// models and the Hub's resolve layout.
- DroppingProxy: a loopback TCP proxy that cuts every connection after so many bytes.
- StallingProxy: a loopback TCP proxy that, told to, holds what the server sends after so many more
  bytes (a GET held mid-body) until it is let go.
- RequestGate: a loopback HTTP proxy that knows exactly how many requests are in flight, and holds
  those for ranges past a point until it is let go.
- HostileServer: a store (HTTP, S3's API, the Hub's) that lies on purpose, as a table of lies says
  (Lie: sizes, ranges, ETags, bodies, listings, names, redirects, statuses).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import itertools
import json
import re
import secrets
import socket
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qs, unquote
from xml.sax.saxutils import escape

from tensorfs.testing.servers import ACCESS_KEY, SECRET_KEY, Nginx, SeaweedFS, free_ports, stop, wait_http

__all__ = [
    "ACCESS_KEY", "BROKEN", "GUARDED", "HUB_API", "MOVED", "NO_ETAG", "PRIVATE", "SECRET_KEY", "TOKEN", "DroppingProxy", "HostileServer", "Lie", "Nginx", "RequestGate", "SeaweedFS", "StallingProxy", "free_ports", "stop",
    "wait_http",
]  # fmt: skip

TOKEN = "tensorfs-token"
PRIVATE = f'location /private/ {{ if ($http_authorization != "Bearer {TOKEN}") {{ return 401; }} }}'
"""An nginx location that needs the Hub's token (what the tests of hf:// tokens read from)."""
MOVED = "location /moved/ { rewrite ^/moved/(.*)$ /lfs/moved/$1 redirect; }"
"""An nginx location that redirects every request (as the Hub does, to where large files are kept)."""
GUARDED = "location = /guarded/tensors.sha256 { return 403; }"
"""A manifest the store refuses to show (as S3 does for a missing key to whoever may not list)."""
BROKEN = "location = /broken/m.safetensors { return 500; }"
"""A server error (with nginx's HTML page for a body)."""
NO_ETAG = "location /noetag/ { etag off; }"
"""An nginx location that sends no ETag (some servers do not): Last-Modified is all there is."""
HUB_API = "location /api/ { default_type application/json; try_files $uri.json =404; }"
"""The Hub's listing API (/api/models/ORG/NAME/tree/REV[/PATH]), answered from ....json files."""


class _LoopbackProxy:
    """Forwards 127.0.0.1:port to a server's port on loopback; what each connection does is the
    subclass's (`_take`)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}/{path.lstrip('/')}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            self._take(client)

    def _take(self, client: socket.socket) -> None:
        raise NotImplementedError

    def _connect(self, client: socket.socket) -> socket.socket:
        """The server's end of a client's connection, both kept for cut()."""
        server = socket.create_connection(("127.0.0.1", self.target))
        with self._lock:
            self._open += [client, server]
        return server

    @staticmethod
    def _end(*ends: socket.socket) -> None:
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)
            end.close()

    def cut(self) -> None:
        """Close every connection open now (a client's next request needs a new one)."""
        with self._lock:
            ends, self._open = self._open, []
        for end in ends:
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._closed = True
        self._listener.close()


class DroppingProxy(_LoopbackProxy):
    """Forwards 127.0.0.1:port to a server's port, cutting each connection after `limit` bytes back;
    the next `refuse` connections (when set) are closed at once, as by a store that is down."""

    def __init__(self, target: int, limit: int) -> None:
        self.limit = limit
        self.refuse = 0
        self.connections = 0
        super().__init__(target)

    def _take(self, client: socket.socket) -> None:
        self.connections += 1
        if self.refuse > 0:
            self.refuse -= 1
            client.close()
            return
        server = self._connect(client)
        threading.Thread(target=self._pump, args=(client, server, None), daemon=True).start()
        threading.Thread(target=self._pump, args=(server, client, self.limit), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, limit: int | None) -> None:
        sent = 0
        try:
            while limit is None or sent < limit:
                data = source.recv(min(65536, limit - sent) if limit is not None else 65536)
                if not data:
                    break
                sink.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            self._end(source, sink)


class StallingProxy(_LoopbackProxy):
    """Forwards 127.0.0.1:port to a server's port; `stall_after(n)` holds whatever the server sends
    once n more bytes have gone to the clients (all connections together), until `release()`: a GET
    held mid-body for as long as a test likes, the connection open and nothing lost. A server that
    refuses the proxy's connection has the client's closed at once."""

    def __init__(self, target: int) -> None:
        self.sent = 0
        """Bytes sent toward clients (the servers' answers)."""
        self.requests = 0
        """Requests the clients sent (pieces that begin with an HTTP method)."""
        self.holding = threading.Event()
        """Set once the bytes allowed have all gone: from then on a connection that has more is held."""
        self._limit: int | None = None
        self._go = threading.Event()
        self._go.set()
        super().__init__(target)

    def stall_after(self, nbytes: int) -> None:
        """Let `nbytes` more bytes go to the clients, then hold the rest (until release())."""
        with self._lock:
            self._limit = self.sent + nbytes
            self.holding.clear()
            self._go.clear()

    def release(self) -> None:
        with self._lock:
            self._limit = None
            self._go.set()

    def _take(self, client: socket.socket) -> None:
        try:
            server = self._connect(client)
        except OSError:  # the server is down: so is the connection
            client.close()
            return
        threading.Thread(target=self._requests, args=(client, server), daemon=True).start()
        threading.Thread(target=self._answers, args=(server, client), daemon=True).start()

    def _requests(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                if data.startswith((b"GET ", b"HEAD ")):
                    with self._lock:
                        self.requests += 1
                sink.sendall(data)
        except OSError:
            pass
        finally:
            self._end(source, sink)

    def _answers(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while not self._closed:
                with self._lock:
                    allowed = 65536 if self._limit is None else min(65536, self._limit - self.sent)
                if allowed <= 0:
                    self.holding.set()
                    self._go.wait(0.05)
                    continue
                data = source.recv(allowed)
                if not data:
                    break
                sink.sendall(data)
                with self._lock:
                    self.sent += len(data)
        except OSError:
            pass
        finally:
            self._end(source, sink)

    def close(self) -> None:
        super().close()
        self.release()
        self.cut()


class RequestGate(_LoopbackProxy):
    """Forwards 127.0.0.1:port to an HTTP/1.1 server's port and knows, exactly, which requests are in
    flight: from the moment a request's head reaches the gate until just before the last byte of its
    answer is sent on (a client cannot have its answer, and ask again, any sooner), or its connection
    closes. `hold_from(offset)` keeps the requests for ranges that begin at or past `offset` from the
    server until `release()`: in flight, for as long as a test likes, whatever the machine's speed.

    One request at a time on a connection, no request bodies, answers framed by Content-Length: what
    an object store's client and nginx do (anything else fails the test that meets it)."""

    def __init__(self, target: int) -> None:
        self._changed = threading.Condition()
        self._hold_from: int | None = None
        self.in_flight = 0
        self.most_in_flight = 0
        """The most requests in flight at once since the gate opened, or since reset()."""
        self.held = 0
        """Requests held now."""
        self.ranges: list[tuple[str, int | None]] = []
        """(path, first byte of its Range or None) of every request, in the order they came."""
        self.failure: str | None = None
        super().__init__(target)

    def hold_from(self, offset: int) -> None:
        with self._changed:
            self._hold_from = offset

    def release(self) -> None:
        with self._changed:
            self._hold_from = None
            self._changed.notify_all()

    def reset(self) -> None:
        """Count the most in flight from now on."""
        with self._changed:
            self.most_in_flight = self.in_flight

    def wait_held(self, count: int, timeout: float) -> bool:
        """Wait until `count` requests are held at once (at most `timeout` seconds): whether they are."""
        with self._changed:
            return self._changed.wait_for(lambda: self.held >= count, timeout)

    def _take(self, client: socket.socket) -> None:
        try:
            server = self._connect(client)
        except OSError:
            client.close()
            return
        methods: list[str] = []  # of the requests on this connection not answered yet (one, for HTTP/1.1)
        threading.Thread(target=self._requests, args=(client, server, methods), daemon=True).start()
        threading.Thread(target=self._answers, args=(server, client, methods), daemon=True).start()

    def _fail(self, why: str) -> None:
        with self._changed:
            self.failure = self.failure or why

    def _requests(self, source: socket.socket, sink: socket.socket, methods: list[str]) -> None:
        pending = b""
        try:
            while (message := self._head(source, pending)) is not None:
                head, pending = message
                method, path = head.split(b" ", 2)[:2]
                ranged = re.search(rb"(?im)^range:\s*bytes=(\d+)-", head)
                start = int(ranged[1]) if ranged else None
                with self._changed:
                    methods.append(method.decode())
                    self.ranges.append((path.decode(), start))
                    self.in_flight += 1
                    self.most_in_flight = max(self.most_in_flight, self.in_flight)
                    if self._held(start):
                        self.held += 1
                        self._changed.notify_all()
                        self._changed.wait_for(lambda start=start: not self._held(start) or self._closed)
                        self.held -= 1
                sink.sendall(head + b"\r\n\r\n")
        except OSError:
            pass
        finally:
            self._end(source, sink)

    @staticmethod
    def _head(source: socket.socket, pending: bytes) -> tuple[bytes, bytes] | None:
        """The next request's or answer's head (without its blank line) and what came after it; None
        when the connection closes first."""
        while b"\r\n\r\n" not in pending:
            data = source.recv(65536)
            if not data:
                return None
            pending += data
        head, _, rest = pending.partition(b"\r\n\r\n")
        return head, rest

    def _held(self, start: int | None) -> bool:
        return self._hold_from is not None and (start or 0) >= self._hold_from

    def _answers(self, source: socket.socket, sink: socket.socket, methods: list[str]) -> None:
        pending = b""
        try:
            while (message := self._head(source, pending)) is not None:
                head, pending = message
                status = int(head.split(b" ", 2)[1])
                if re.search(rb"(?im)^transfer-encoding:", head):
                    self._fail(f"an answer not framed by Content-Length: {head!r}")
                    return
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                with self._changed:
                    method = methods.pop(0) if methods else "?"
                body = 0 if method == "HEAD" or status in (204, 304) or length is None else int(length[1])
                head += b"\r\n\r\n"
                if body == 0:
                    self._answered()
                    sink.sendall(head)
                    continue
                sink.sendall(head)
                while body > 0:
                    if not pending:
                        pending = source.recv(min(65536, body))
                        if not pending:
                            return
                    piece, pending = pending[:body], pending[body:]
                    body -= len(piece)
                    if body == 0:
                        self._answered()  # before its last byte goes: then the client may ask again
                    sink.sendall(piece)
        except OSError:
            pass
        finally:
            with self._changed:  # what this connection had in flight ends with it
                self.in_flight -= len(methods)
                methods.clear()
            self._end(source, sink)

    def _answered(self) -> None:
        with self._changed:
            self.in_flight -= 1

    def close(self) -> None:
        super().close()
        with self._changed:
            self._hold_from = None
            self._changed.notify_all()
        self.cut()


LieKind = Literal["size", "range", "etag", "body", "listing", "name", "redirect", "status"]


@dataclass(frozen=True)
class Lie:
    """One falsehood a HostileServer tells: of `target` (a file's path under its root, as every API
    names it: bucket/key for S3, ORG/NAME/PATH for the Hub; "*" for every file or listing), what it
    falsifies, and how (`value`). A test's lies are a list of these, set before or while it runs:

    - size, N: the file is said to hold N bytes (a HEAD, a GET's Content-Length and Content-Range's
      total, a listing's size); a GET sends its bytes then zeros up to N, as long as the client reads
      (what was sent is counted in `sent`).
    - range, N (an int): ranged answers carry N bytes more than asked (Content-Length too);
      "ignored": a 200 with the whole file; "shifted": the bytes from one further, said to be those
      asked; "short": half the range, said to be half the range.
    - etag, '"x"': that ETag from now on (as for an object changed in place); "fresh": a new ETag for
      every answer; "none": no ETag at all; "unchecked": If-Match not looked at (whatever the file
      holds now is served under its ETag now).
    - body, bytes: these bytes served instead, under the file's first ETag (a store that changed an
      object in place); ("GET", bytes): these bytes to GETs only, a HEAD still saying the file's own
      size (a file grown past what was announced); "gzip": compressed (Content-Encoding: gzip); "cut": the connection closed
      halfway through the body; "stall": half the body, then nothing (until the server closes).
    - listing (of a prefix, or "*"): "garbage": an answer that is not a listing; "loop": S3's
      continuation token given back forever; "huge": more files than any listing takes, a thousand a page; "trickle": one file a page, forever; "negative":
      every size said -1; "sizes":
      each size said 7 bytes more; of a file: "omitted": left out of every listing.
    - name, NAME: a file NAME listed beside the others (S3 and the Hub's API), whose GET is b"{}"; a
      NAME ending in '/' is a folder to the Hub's API (to S3's, a key of that name holding nothing: a
      folder marker, as the S3 console makes; "" is the listed prefix's own).
    - redirect, URL: every request answered 302 Found, to URL ("loop": to itself).
    - status, CODE: every request answered CODE, with an HTML page for a body.
    """

    what: LieKind
    target: str = "*"
    value: Any = None

    def of(self, path: str) -> bool:
        return self.target in ("*", path)


class HostileServer:
    """An HTTP server on 127.0.0.1 that serves the files under `root` as a store would (ranges, ETags,
    If-Match, HEAD), through three APIs at once: plain HTTP (/PATH), S3 path-style (/BUCKET/KEY, and
    ListObjectsV2: /BUCKET?list-type=2), and the Hub (/ORG/NAME/resolve/REV/PATH, and its listing
    /api/models/ORG/NAME/tree/REV/PATH); and lies as its table of lies says (`lies`, Lie), each
    made to really happen on the wire. Nothing outside `root` is ever served.

    With `certificate` (a certificate and its key, PEM files), it speaks HTTPS.
    """

    def __init__(self, root: Path, certificate: tuple[Path, Path] | None = None, lies: Iterable[Lie] = ()) -> None:
        import http.server
        import ssl

        self.root = root
        self.lies: list[Lie] = list(lies)
        self.etags: dict[str, str] = {}
        """Each file's ETag as first answered (a file changed on disk keeps it: see Lie etag)."""
        self.sent: dict[str, int] = {}
        self.requests: list[tuple[str, str, str, str]] = []
        """(method, file, Range, Accept-Encoding) of every request."""
        self.paths: list[str] = []
        """Every request's path, as it came."""
        self.headers: list[dict[str, str]] = []
        """Every request's headers (names in lower case), in the order the requests came."""
        self._closing = threading.Event()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(body=False)

            def do_GET(self) -> None:
                self._answer(body=True)

            def _answer(self, *, body: bool) -> None:
                server.paths.append(self.path)
                path, _, query = self.path.partition("?")
                headers = self.headers
                server.headers.append({key.lower(): value for key, value in headers.items()})
                name, listing = server._route(unquote(path.lstrip("/")), parse_qs(query))
                server.requests.append(
                    (self.command, name, headers.get("Range", ""), headers.get("Accept-Encoding", ""))
                )
                status = server._told("status", name)
                if status is not None:
                    page = f"<html><body>{status}</body></html>".encode()
                    self._head(int(status), {"Content-Type": "text/html", "Content-Length": str(len(page))})
                    self._send(name, page if body else b"")
                    return
                redirect = server._told("redirect", name)
                if redirect is not None:
                    where = self.path if redirect == "loop" else redirect
                    self._head(302, {"Location": where, "Content-Length": "0"})
                    return
                if listing is not None:
                    document = listing()
                    self._head(200, {"Content-Type": "application/xml", "Content-Length": str(len(document))})
                    self._send(name, document if body else b"")
                    return
                data = server._content(name)
                if data is None:
                    self._head(404, {"Content-Length": "0"})
                    return
                etag = server._etag(name, data)
                asked = self.headers.get("If-Match")
                if asked not in (None, etag) and server._told("etag", name, "unchecked") is None:
                    self._head(412, {"Content-Length": "0"})
                    return
                replaced = server._told("body", name)
                if isinstance(replaced, bytes):
                    data = replaced
                elif isinstance(replaced, tuple) and body:
                    data = replaced[1]
                announced = server._told("size", name)
                size = len(data) if announced is None else int(announced)
                self._file(name, data, size, etag, body)

            def _file(self, name: str, data: bytes, size: int, etag: str | None, body: bool) -> None:
                start, end, status = 0, size, 200
                ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                how = server._told("range", name)
                if ranged and how != "ignored":
                    start = int(ranged[1])
                    end = min(size, int(ranged[2]) + 1) if ranged[2] else size
                    if start >= size:
                        self._head(416, {"Content-Range": f"bytes */{size}", "Content-Length": "0"})
                        return
                    status = 206
                said = (start, end)  # what Content-Range says is sent
                if status == 206 and how == "shifted":
                    start, end = start + 1, end + 1
                elif status == 206 and how == "short":
                    end = start + max(1, (end - start) // 2)
                    said = (start, end)
                padding = how if status == 206 and isinstance(how, int) else 0
                fields = {"Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT"}
                if etag is not None:
                    fields["ETag"] = etag
                if status == 206:
                    fields["Content-Range"] = f"bytes {said[0]}-{said[1] - 1}/{size}"
                encoding = server._told("body", name) == "gzip"
                if encoding or end - start + padding <= 1 << 20:  # small: made whole
                    payload = self._slice(data, start, end) + b"\0" * padding
                    if encoding:
                        payload = gzip.compress(payload)
                        fields["Content-Encoding"] = "gzip"
                    fields["Content-Length"] = str(len(payload))
                    self._head(status, fields)
                    if body:
                        self._body(name, [payload])
                    return
                fields["Content-Length"] = str(end - start + padding)
                self._head(status, fields)
                if body:
                    blocks = (self._slice(data, at, min(end, at + (1 << 20))) for at in range(start, end, 1 << 20))
                    self._body(name, itertools.chain(blocks, [b"\0" * padding]))

            @staticmethod
            def _slice(data: bytes, start: int, end: int) -> bytes:
                """Bytes [start, end) of the file, zeros past its end (a size said larger)."""
                piece = data[start:end]
                return piece + b"\0" * (end - start - len(piece))

            def _body(self, name: str, pieces: Iterable[bytes]) -> None:
                how = server._told("body", name)
                if how in ("cut", "stall"):
                    whole = b"".join(pieces)
                    self._send(name, whole[: len(whole) // 2])
                    if how == "stall":
                        server._closing.wait()
                    self.close_connection = True
                    with contextlib.suppress(OSError):
                        self.connection.shutdown(socket.SHUT_RDWR)
                    return
                for piece in pieces:
                    if not self._send(name, piece):
                        return

            def _head(self, status: int, fields: dict[str, str]) -> None:
                self.send_response(status)
                for key, value in fields.items():
                    self.send_header(key, value)
                self.end_headers()

            def _send(self, name: str, data: bytes) -> bool:
                try:
                    self.wfile.write(data)
                except OSError:
                    return False
                server.sent[name] = server.sent.get(name, 0) + len(data)
                return True

        class Server(http.server.ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                if not isinstance(sys.exc_info()[1], OSError):  # a client gone (its reads cut): nothing to say
                    super().handle_error(request, client_address)

        self._server = Server(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.scheme = "http"
        if certificate is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*certificate)
            self._server.socket = context.wrap_socket(self._server.socket, server_side=True)
            self.scheme = "https"
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    # -- what the server answers, and the lies it tells ---------------------------------------

    def _told(self, what: LieKind, path: str, value: Any = None) -> Any:
        """The value of the last lie of this kind about `path` (with `value`: that lie's, if told), or None."""
        found = None
        for lie in list(self.lies):
            if lie.what == what and lie.of(path) and (value is None or lie.value == value):
                found = lie.value
        return found

    def _route(self, path: str, query: dict[str, list[str]]) -> tuple[str, Callable[[], bytes] | None]:
        """(the file a request names, as a path under the root; a maker of the listing it asks for, if any)."""
        hub = re.fullmatch(r"api/models/([^/]+/[^/]+)/tree/[^/]+(?:/(.*))?", path)
        if hub:
            directory = f"{hub[1]}/{hub[2]}".rstrip("/") if hub[2] else hub[1]
            return directory, lambda: self._hub_tree(directory)
        resolve = re.fullmatch(r"([^/]+/[^/]+)/resolve/[^/]+/(.*)", path)
        if resolve:
            return f"{resolve[1]}/{resolve[2]}", None
        if query.get("list-type") == ["2"]:
            bucket = path.rstrip("/")
            prefix = query.get("prefix", [""])[0]
            token = query.get("continuation-token", [""])[0]
            return f"{bucket}/{prefix}".rstrip("/"), lambda: self._s3_listing(bucket, prefix, token)
        return path, None

    def _content(self, name: str) -> bytes | None:
        """A file's bytes as they are now: one under the root (never out of it), or a listed name's b"{}"."""
        for lie in self.lies:
            if lie.what == "name" and name.endswith(f"/{lie.value}"):
                return b"" if name.endswith("/") else b"{}"  # a folder marker holds nothing
        parts = name.split("/")
        if not name or any(part in ("", ".", "..") for part in parts) or "\0" in name:
            return None
        path = self.root.joinpath(*parts)
        if not path.is_file() or path.is_symlink() or not path.resolve().is_relative_to(self.root.resolve()):
            return None
        return path.read_bytes()

    def _etag(self, name: str, data: bytes) -> str | None:
        first = self.etags.setdefault(name, f'"{hashlib.md5(data).hexdigest()}"')
        told = next((lie.value for lie in reversed(self.lies) if lie.what == "etag" and lie.of(name)
                     and lie.value != "unchecked"), None)  # fmt: skip
        if told == "none":
            return None
        if told == "fresh":
            return f'"{secrets.token_hex(8)}"'
        return told if isinstance(told, str) and told != "unchecked" else first

    def _listed(self, directory: str) -> list[tuple[str, int, str | None]]:
        """The files under `directory` (every level, paths under the root), with their sizes and
        ETags as the listings say them: the lies' names among them, the omitted left out."""
        base = self.root / directory if directory else self.root
        files = sorted(
            str(path.relative_to(self.root))
            for path in (base.rglob("*") if base.is_dir() else [])
            if path.is_file() and not path.is_symlink()
        )
        files += [f"{directory}/{lie.value}" for lie in self.lies if lie.what == "name" and lie.of(directory)]
        listed = []
        for path in files:
            data = self._content(path)
            if data is None or self._told("listing", path, "omitted") is not None:
                continue
            said = self._told("size", path)
            size = int(said) if said is not None else len(data)
            size += 7 if self._told("listing", directory, "sizes") else 0
            size = -1 if self._told("listing", directory, "negative") else size
            listed.append((path, size, self._etag(path, data)))
        return listed

    def _s3_listing(self, bucket: str, prefix: str, token: str) -> bytes:
        how = self._told("listing", f"{bucket}/{prefix}".rstrip("/"))
        if how == "garbage":
            return b"<ListBucketResult><Contents><Key>unterminated"
        if how == "huge":  # a thousand a page, forever
            page = int(token or 0)
            keys = [(f"{bucket}/{prefix}x{page:08d}-{k:04d}.json", 2, None) for k in range(1000)]
            return _s3_page(bucket, prefix, keys, str(page + 1))
        if how == "trickle":  # one a page, forever
            page = int(token or 0)
            return _s3_page(bucket, prefix, [(f"{bucket}/{prefix}x{page:08d}.json", 2, None)], str(page + 1))
        directory = f"{bucket}/{prefix}".rstrip("/")
        listed = [entry for entry in self._listed(directory) if entry[0].startswith(f"{bucket}/{prefix}")]
        start = int(token or 0)
        following = None if start + 1000 >= len(listed) else str(start + 1000)
        if how == "loop":
            following = token or "0"
        return _s3_page(bucket, prefix, listed[start : start + 1000], following)

    def _hub_tree(self, directory: str) -> bytes:
        """The Hub's listing of a directory: its files and folders, paths from the repository's root."""
        repo = "/".join(directory.split("/")[:2])
        inner = directory[len(repo) + 1 :]
        below = f"{inner}/" if inner else ""
        how = self._told("listing", directory)
        if how == "garbage":
            return b'[{"path": "unterminated'
        if how == "huge":
            return json.dumps(
                [{"type": "file", "path": f"{below}x{k:07d}.json", "size": 2} for k in range(150_000)]
            ).encode()
        items: list[dict[str, Any]] = []
        named = {f"{directory}/{lie.value}" for lie in self.lies if lie.what == "name" and lie.of(directory)}
        for path, size, _ in self._listed(directory):
            within = path[len(directory) + 1 :]
            if path in named and within.endswith("/"):  # a name said to be a folder's
                items.append({"type": "directory", "path": below + within.rstrip("/"), "oid": "0"})
                continue
            if "/" in within and path not in named:  # a folder's file: the folder, listed once
                folder = {"type": "directory", "path": below + within.split("/")[0], "oid": "0"}
                if folder not in items:
                    items.append(folder)
                continue
            items.append({"type": "file", "path": below + within, "size": size, "oid": "0"})
        return json.dumps(items).encode()


def _s3_page(bucket: str, prefix: str, files: list[tuple[str, int, str | None]], following: str | None) -> bytes:
    """One page of ListObjectsV2's answer."""
    contents = "".join(
        f"<Contents><Key>{escape(path.removeprefix(f'{bucket}/'))}</Key><LastModified>2024-01-01T00:00:00.000Z"
        f"</LastModified>{f'<ETag>{escape(etag)}</ETag>' if etag else ''}<Size>{size}</Size>"
        "<StorageClass>STANDARD</StorageClass></Contents>"
        for path, size, etag in files
        if not re.search(r"[\x00-\x08\x0b\x0c\x0e-\x1f]", path)  # XML cannot hold them (nor, so, S3's listing)
    )
    more = (
        f"<IsTruncated>true</IsTruncated><NextContinuationToken>{following}</NextContinuationToken>"
        if following
        else "<IsTruncated>false</IsTruncated>"
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>{bucket}</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>{len(files)}</KeyCount><MaxKeys>1000</MaxKeys>"
        f"{more}{contents}</ListBucketResult>"
    ).encode()
