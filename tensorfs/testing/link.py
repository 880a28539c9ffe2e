"""A distant, slow link on loopback, for the benchmark and the tests of read-ahead: a TCP proxy that
delays every byte by `delay` seconds each way and lets `rate` bytes/s through, shared by all its
connections (this kernel has no netem, and anyone can run this).

Each direction of a connection is a delay line: what comes in is stamped with when it may leave and
queued; at most `window` bytes wait in a direction (what a TCP window holds in flight), so a sender
feels the round trip as it would on a real link. The rate is one token bucket for every connection
and both directions: what a shared access link gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from types import TracebackType

PIECE = 64 << 10
"""Bytes read and sent at a time (the rate is kept in pieces this large)."""


class _Bucket:
    """`rate` bytes/s for all: each piece leaves when the ones before it have had their time."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0

    async def take(self, nbytes: int) -> None:
        now = time.monotonic()
        start = max(now, self.free_at)
        self.free_at = start + nbytes / self.rate
        if start > now:
            await asyncio.sleep(start - now)


class SlowLink:
    """Forwards 127.0.0.1:`port` to `target` (host, port) through the link; `with SlowLink(...) as link:`
    runs it on a thread of its own and stops it (every connection closed) at the end."""

    def __init__(
        self, target: tuple[str, int], delay: float = 0.025, rate: float = 200e6, window: int = 4 << 20
    ) -> None:
        self.target = target
        self.delay = delay
        self.rate = rate
        self.window = window
        self.port = 0
        self.bytes_sent = 0
        """Bytes the link carried toward clients (the server's answers)."""
        self.connections = 0
        """Connections clients opened through the link."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None

    @property
    def round_trip(self) -> float:
        return 2 * self.delay

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://127.0.0.1:{self.port}"

    def __enter__(self) -> SlowLink:
        self._thread = threading.Thread(target=self._run, name="slow-link", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._failure is not None or not self.port:
            raise RuntimeError(f"the slow link did not start: {self._failure!r}")
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # told by __enter__ (a bug's traceback is in its repr)
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        bucket = _Bucket(self.rate)
        tasks: set[asyncio.Task[None]] = set()

        async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            tasks.add(task)
            self.connections += 1
            try:
                await self._connection(reader, writer, bucket)
            except asyncio.CancelledError:
                writer.close()  # the link is stopping
            finally:
                tasks.discard(task)

        server = await asyncio.start_server(connected, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()
            server.close()
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _connection(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter, bucket: _Bucket
    ) -> None:
        await asyncio.sleep(self.round_trip)  # the TCP handshake's round trip over the link
        try:
            server_in, server_out = await asyncio.open_connection(*self.target)
        except OSError:
            client_out.close()
            return
        try:
            await asyncio.gather(
                self._direction(client_in, server_out, bucket, toward_client=False),
                self._direction(server_in, client_out, bucket, toward_client=True),
            )
        finally:
            for writer in (client_out, server_out):
                writer.close()
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await writer.wait_closed()

    async def _direction(
        self,
        source: asyncio.StreamReader,
        sink: asyncio.StreamWriter,
        bucket: _Bucket,
        *,
        toward_client: bool,
    ) -> None:
        """One direction: read into the delay line (at most `window` bytes in it), send from it when due."""
        line = _DelayLine(self.window)

        async def take_in() -> None:
            try:
                while True:
                    await line.room()
                    piece = await source.read(PIECE)
                    if not piece:
                        break
                    await line.put(time.monotonic() + self.delay, piece)
            except OSError:
                pass
            await line.end()

        taker = asyncio.create_task(take_in())
        try:
            while (due_piece := await line.get()) is not None:
                due, piece = due_piece
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                await bucket.take(len(piece))
                try:
                    sink.write(piece)
                    await sink.drain()
                except OSError:
                    return
                if toward_client:
                    self.bytes_sent += len(piece)
                await line.sent(len(piece))
            with contextlib.suppress(OSError):
                if sink.can_write_eof():
                    sink.write_eof()
        finally:  # the sink gone: nothing more is taken in
            taker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await taker


class _DelayLine:
    """Pieces in flight one way, each with when it may leave; at most `window` bytes of them."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.pieces: deque[tuple[float, bytes]] = deque()
        self.queued = 0
        self.ended = False
        self.changed = asyncio.Condition()

    async def room(self) -> None:
        async with self.changed:
            await self.changed.wait_for(lambda: self.queued < self.window)

    async def put(self, due: float, piece: bytes) -> None:
        async with self.changed:
            self.pieces.append((due, piece))
            self.queued += len(piece)
            self.changed.notify_all()

    async def end(self) -> None:
        async with self.changed:
            self.ended = True
            self.changed.notify_all()

    async def get(self) -> tuple[float, bytes] | None:
        """The next piece, or None once the line has ended and is empty."""
        async with self.changed:
            await self.changed.wait_for(lambda: bool(self.pieces) or self.ended)
            return self.pieces.popleft() if self.pieces else None

    async def sent(self, nbytes: int) -> None:
        async with self.changed:
            self.queued -= nbytes
            self.changed.notify_all()
