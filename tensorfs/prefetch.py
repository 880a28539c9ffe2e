"""Bringing tensors in ahead of their use, on worker threads: their pages read in (a local model) or
their chunks fetched (a remote one), and, when the model is verified, their hashes checked. The
model's prefetch(), tensors() and atensors() are built on it.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .catalogue.tables import Tables
    from .gate import Gate
    from .sources.remote import RemoteShard

RUN_BYTES = 16 << 20
"""Neighbouring tensors are brought in together up to this many bytes (one request, one job)."""
DEFAULT_AHEAD = 4
DEFAULT_AHEAD_BYTES = 1 << 30


class Lane:
    """Jobs run one at a time, in the order given, on a shared pool: a model is read fastest in order,
    and the next tensor is never slowed by the ones behind it sharing the disk (docs/performance.md).
    Cancelled when the pool is shut down before it runs them (the model closed)."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._queue: deque[tuple[Future[None], Callable[[], None]]] = deque()
        self._lock = threading.Lock()
        self._running = False

    def submit(self, job: Callable[[], None]) -> Future[None]:
        future: Future[None] = Future()
        with self._lock:
            self._queue.append((future, job))
            if self._running:
                return future
            self._running = True
        try:
            self._pool.submit(self._drain).add_done_callback(self._dropped)
        except RuntimeError:  # the pool is shut down: the model is closed
            self._cancel_all()
        return future

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._queue:
                    self._running = False
                    return
                future, job = self._queue.popleft()
            if future.set_running_or_notify_cancel():
                try:
                    job()
                except BaseException as error:  # the waiter raises it
                    future.set_exception(error)
                else:
                    future.set_result(None)

    def _dropped(self, drain: Future[None]) -> None:
        if drain.cancelled():
            self._cancel_all()

    def _cancel_all(self) -> None:
        with self._lock:
            queued, self._running = list(self._queue), False
            self._queue.clear()
        for future, _ in queued:
            future.cancel()


class _Bringing:
    """One run of neighbouring tensors on its way in: read on the lane, then, when the model is
    verified, hashed on the pool, so that hashing takes the other cores while the lane reads on."""

    def __init__(
        self, gate: Gate, names: list[str], lane: Lane, pool: ThreadPoolExecutor, then: Callable[[], None]
    ) -> None:
        self._gate = gate
        self._names = names
        self._pool = pool
        self._then = then
        self._verified: Future[None] | None = None  # set on the lane, before its job is done
        self._read = lane.submit(self._read_in)

    def _read_in(self) -> None:
        self._gate.check_open()
        self._gate.bring_in(self._names)
        if self._gate.expected is None:
            self._then()
            return
        try:
            self._verified = self._pool.submit(self._verify)
        except RuntimeError:  # the pool is shut down
            self._gate.check_open()
            raise

    def _verify(self) -> None:
        for name in self._names:
            self._gate.check(name)
        self._then()

    def done(self) -> bool:
        """In (and verified), failed or cancelled."""
        if not self._read.done():
            return False
        return self._verified is None or self._verified.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done (at most `timeout` seconds): True if done; its failure raised as it is;
        ModelClosedError if the model was closed under it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            self._read.result(timeout)
            if self._verified is not None:
                self._verified.result(None if deadline is None else max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        except concurrent.futures.CancelledError:
            self._gate.check_open()  # cancelled by the model's close: say so
            return True  # cancelled on purpose
        return True

    def cancel(self) -> None:
        self._read.cancel()
        if self._verified is not None:
            self._verified.cancel()


class Prefetch:
    """Tensors being brought in (see Model.prefetch): done(), wait(), cancel(), and bytes done of total."""

    def __init__(self, gate: Gate, names: Sequence[str], pool: ThreadPoolExecutor) -> None:
        self._lock = threading.Lock()
        locate = gate.tables.locate
        self.bytes_total = sum(locate(name)[2] for name in names)
        """Bytes of the tensors to bring in."""
        self._bytes_done = 0
        lane = Lane(pool)
        self._runs = [
            _Bringing(gate, run, lane, pool, functools.partial(self._count, sum(locate(name)[2] for name in run)))
            for run in _runs(gate, names)
        ]

    @property
    def bytes_done(self) -> int:
        """Bytes of the tensors brought in (and verified) so far."""
        with self._lock:
            return self._bytes_done

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self._bytes_done += nbytes

    def done(self) -> bool:
        """Whether every tensor is in (or the prefetch failed, or was cancelled)."""
        return all(run.done() for run in self._runs)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done (at most `timeout` seconds): True if done. The first failure is raised (a
        tensor whose bytes cannot be had, or do not match the manifest), as it is."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for run in self._runs:
            if not run.wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True

    def cancel(self) -> None:
        """Bring in nothing more: what has not begun never begins (what has, ends soon)."""
        for run in self._runs:
            run.cancel()

    def __repr__(self) -> str:
        return f"<Prefetch {self.bytes_done} of {self.bytes_total} bytes{', done' if self.done() else ''}>"


def _runs(gate: Gate, names: Iterable[str]) -> list[list[str]]:
    """`names` in runs of neighbours of one shard (up to RUN_BYTES), in the order given."""
    runs: list[list[str]] = []
    last: tuple[object, int] | None = None  # (shard, end) of the run being made
    size = 0
    for name in names:
        shard, offset, nbytes = gate.tables.locate(name)
        if runs and last == (shard, offset) and size + nbytes <= RUN_BYTES:
            runs[-1].append(name)
            size += nbytes
        else:
            runs.append([name])
            size = nbytes
        last = (shard, offset + nbytes)
    return runs


class Window:
    """Tensors handed out in order while the next ones are brought in: at most `ahead` tensors and
    `ahead_bytes` bytes ahead of the one handed out (always the next one, whatever its size), read
    one after the other on a lane of their own."""

    def __init__(
        self,
        gate: Gate,
        names: Sequence[str],
        pool: ThreadPoolExecutor,
        make: Any,
        ahead: int,
        ahead_bytes: int,
    ) -> None:
        self._gate = gate
        self._names = names
        self._pool = pool
        self._lane = Lane(pool)
        self._make = make  # name -> the tensor, once it is in
        self._ahead = max(0, ahead)
        self._ahead_bytes = ahead_bytes
        self._pending: deque[tuple[str, int, _Bringing]] = deque()  # sent for, not handed out yet
        self._next = 0  # the next name to send for
        self._lock = threading.Lock()  # next() may run on a worker thread (atensors) while close() runs

    def _fill(self) -> None:
        in_window = sum(nbytes for _, nbytes, _ in self._pending)
        while self._next < len(self._names) and len(self._pending) <= self._ahead:
            name = self._names[self._next]
            nbytes = self._gate.tables.locate(name)[2]
            if self._pending and in_window + nbytes > self._ahead_bytes:
                break
            self._pending.append((name, nbytes, _Bringing(self._gate, [name], self._lane, self._pool, _nothing)))
            in_window += nbytes
            self._next += 1

    def next(self) -> tuple[str, Any] | None:
        """The next (name, tensor), once it is in; None at the end (blocking)."""
        with self._lock:
            self._fill()
            if not self._pending:
                return None
            name, _, bringing = self._pending.popleft()
            self._fill()  # the window moves on before this one is waited for
        bringing.wait()
        return name, self._make(name)

    def close(self) -> None:
        """Stop: nothing more is sent for, and what was sent for and has not begun never begins."""
        with self._lock:
            for _, _, bringing in self._pending:
                bringing.cancel()
            self._pending.clear()
            self._next = len(self._names)


def _nothing() -> None:
    pass


def iterate(window: Window) -> Iterator[tuple[str, Any]]:
    """The window's tensors, as a generator: leaving it early (break, an error) closes the window."""
    try:
        while (item := window.next()) is not None:
            yield item
    finally:
        window.close()


async def aiterate(window: Window) -> AsyncIterator[tuple[str, Any]]:
    """The same, waited for on a worker thread: under asyncio or trio (anyio), cancellable."""
    import anyio.to_thread

    try:
        while (item := await anyio.to_thread.run_sync(window.next, abandon_on_cancel=True)) is not None:
            yield item
    finally:
        window.close()


def fetch_plan(model: Tables, *, whole: bool) -> dict[RemoteShard, list[int]]:
    """The chunks to fetch to hold `model` in the cache, by remote shard: every chunk of its objects
    (`whole`), or only those of its tensors' bytes (a selection). Empty for a local model."""
    from .sources.remote import RemoteShard  # (a remote model's: imported when one is prefetched)

    wanted: dict[RemoteShard, list[int]] = {}
    for shard, entries in model.by_shard().items():
        data = model.shard_data(shard)
        if isinstance(data, RemoteShard):
            start = model.shard_header(shard).data_start
            everything = [(0, data.cached.version.size)] if whole else []
            wanted[data] = data.chunks_of(everything or [(start + b, start + e) for b, e, *_ in entries])
    return wanted
