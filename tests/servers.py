"""Real servers for the tests of remote models, on 127.0.0.1 only, all their state in a temporary directory.

- SeaweedFS and nginx, whose runners are the benchmark's (tensorfs/testing/servers.py): a real
  distributed object store with an S3 API, and static files over HTTP with ranges, ETags and
  If-Match, for http(s):// models and the Hub's resolve layout.
- DroppingProxy: a loopback TCP proxy that cuts every connection after so many bytes.
- StallingProxy: a loopback TCP proxy that, told to, holds what the server sends after so many more
  bytes (a GET held mid-body) until it is let go.
- RequestGate: a loopback HTTP proxy that knows exactly how many requests are in flight, and holds
  those for ranges past a point until it is let go.
- HostileServer: an HTTP store that lies on purpose (more bytes than asked, encodings, other bytes
  under one ETag, endless bodies).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import re
import socket
import threading
import urllib.parse
from pathlib import Path

from tensorfs.testing.servers import ACCESS_KEY, SECRET_KEY, Nginx, SeaweedFS, free_ports, stop, wait_http

__all__ = [
    "ACCESS_KEY", "BROKEN", "GUARDED", "HUB_API", "MOVED", "NO_ETAG", "PRIVATE", "SECRET_KEY", "TOKEN", "DroppingProxy", "HostileServer", "Nginx", "RequestGate", "SeaweedFS", "StallingProxy", "free_ports", "stop",
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


class HostileServer:
    """An HTTP server on 127.0.0.1 that serves the files under `root` as a store would (ranges, ETags,
    If-Match, HEAD), and lies when told to: the faults a test sets are made to really happen on the wire.

    - `padding[name] = n`: ranged answers of that file carry n bytes more than the range (Content-Length too).
    - `encoded.add(name)`: answers of that file come gzip-compressed (Content-Encoding: gzip).
    - `replaced[name] = data`: other bytes served under the file's first ETag (as a store that changed
      an object in place would).
    - `announced[name] = n`: a GET of that file says it holds n bytes and streams zeros until the
      client stops reading (what was sent is counted in `sent`).
    - `ignores_if_match`: If-Match is not looked at (as some servers and proxies do): whatever the
      file holds now is served under its ETag now (`etags[name]`, which a test sets when it changes it).
    - `redirects[name] = url`: every request of that name is answered 302 Found, to `url`.
    - `endless_listing[bucket] = n`: an S3 listing (ListObjectsV2) of that bucket never ends: every
      page holds n more objects under the prefix asked and says there are more (pages served are
      counted in `pages_listed`).
    - `grown[name] = data`: GETs of that file answer with `data` (under its ETag), HEADs still with the
      file's own size: more than a HEAD announced comes.

    With `certificate` (a certificate and its key, PEM files), it speaks HTTPS.
    """

    def __init__(self, root: Path, certificate: tuple[Path, Path] | None = None) -> None:
        import http.server
        import ssl

        self.root = root
        self.padding: dict[str, int] = {}
        self.encoded: set[str] = set()
        self.replaced: dict[str, bytes] = {}
        self.announced: dict[str, int] = {}
        self.etags: dict[str, str] = {}
        self.redirects: dict[str, str] = {}
        self.sent: dict[str, int] = {}
        self.requests: list[tuple[str, str, str, str]] = []
        """(method, file, Range, Accept-Encoding) of every request."""
        self.headers: list[dict[str, str]] = []
        """Every request's headers (names in lower case), in the order the requests came."""
        self.ignores_if_match = False
        self.endless_listing: dict[str, int] = {}
        self.pages_listed = 0
        self.grown: dict[str, bytes] = {}
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
                name = self.path.lstrip("/").split("?")[0]
                headers = self.headers
                server.headers.append({key.lower(): value for key, value in headers.items()})
                server.requests.append(
                    (self.command, name, headers.get("Range", ""), headers.get("Accept-Encoding", ""))
                )
                if name in server.redirects:
                    self.send_response(302)
                    self.send_header("Location", server.redirects[name])
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                if name in server.endless_listing and query.get("list-type") == ["2"]:
                    self._list_endlessly(name, query, server.endless_listing[name])
                    return
                path = server.root / name
                if not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                original = path.read_bytes()
                etag = server.etags.setdefault(name, f'"{hashlib.md5(original).hexdigest()}"')
                data = server.replaced.get(name, original)
                if body and name in server.grown:
                    data = server.grown[name]
                if self.headers.get("If-Match") not in (None, etag) and not server.ignores_if_match:
                    self.send_response(412)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if name in server.announced:
                    self._endless(name, server.announced[name], body)
                    return
                start, end, status = 0, len(data), 200
                ranged = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
                if ranged:
                    start = int(ranged[1])
                    end = min(len(data), int(ranged[2]) + 1) if ranged[2] else len(data)
                    if start >= len(data):
                        self.send_response(416)
                        self.send_header("Content-Range", f"bytes */{len(data)}")
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    status = 206
                payload = data[start:end] + b"\0" * (server.padding.get(name, 0) if ranged else 0)
                self.send_response(status)
                if name in server.encoded:
                    payload = gzip.compress(payload)
                    self.send_header("Content-Encoding", "gzip")
                if ranged:
                    self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(payload)))
                self.send_header("ETag", etag)
                self.send_header("Last-Modified", "Mon, 01 Jan 2024 00:00:00 GMT")
                self.end_headers()
                if body:
                    self._send(name, payload)

            def _list_endlessly(self, bucket: str, query: dict[str, list[str]], count: int) -> None:
                prefix = query.get("prefix", [""])[0]
                first = int(query.get("continuation-token", ["0"])[0])
                contents = "".join(
                    f"<Contents><Key>{prefix}o{first + i:012d}</Key><LastModified>2024-01-01T00:00:00.000Z"
                    f"</LastModified><ETag>&quot;e&quot;</ETag><Size>1</Size></Contents>"
                    for i in range(count)
                )
                page = (
                    '<?xml version="1.0" encoding="UTF-8"?>'
                    '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                    f"<Name>{bucket}</Name><Prefix>{prefix}</Prefix><KeyCount>{count}</KeyCount>"
                    f"<MaxKeys>{count}</MaxKeys><IsTruncated>true</IsTruncated>"
                    f"<NextContinuationToken>{first + count}</NextContinuationToken>{contents}</ListBucketResult>"
                ).encode()
                server.pages_listed += 1
                self.send_response(200)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def _endless(self, name: str, size: int, body: bool) -> None:
                self.send_response(200)
                self.send_header("Content-Length", str(size))
                self.send_header("ETag", server.etags[name])
                self.end_headers()
                if body:
                    block = b"\0" * (1 << 20)
                    for _ in range(0, size, len(block)):
                        if not self._send(name, block):
                            return

            def _send(self, name: str, data: bytes) -> bool:
                try:
                    self.wfile.write(data)
                except OSError:
                    return False
                server.sent[name] = server.sent.get(name, 0) + len(data)
                return True

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
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
        self._server.shutdown()
        self._server.server_close()
