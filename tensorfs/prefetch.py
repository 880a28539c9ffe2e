"""Bringing tensors in ahead of their use, on worker threads: their pages read in (a local model) or
their chunks fetched (a remote one), and, when the model is verified, their hashes checked. The
model's prefetch(), tensors() and atensors() are built on it.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .model import Model

RUN_BYTES = 16 << 20
"""Neighbouring tensors are brought in together up to this many bytes (one request, one job)."""
DEFAULT_AHEAD = 4
DEFAULT_AHEAD_BYTES = 1 << 30


class Prefetch:
    """Tensors being brought in (see Model.prefetch): done(), wait(), cancel(), and bytes done of total."""

    def __init__(self, model: Model, names: Sequence[str], pool: ThreadPoolExecutor) -> None:
        self._model = model
        self._cancelled = threading.Event()
        self._lock = threading.Lock()
        self.bytes_total = sum(model.locate(name)[2] for name in names)
        """Bytes of the tensors to bring in."""
        self._bytes_done = 0
        self._futures = [pool.submit(self._run, run) for run in _runs(model, names)]

    @property
    def bytes_done(self) -> int:
        """Bytes of the tensors brought in (and verified) so far."""
        with self._lock:
            return self._bytes_done

    def _run(self, names: list[str]) -> None:
        if self._cancelled.is_set():
            return
        self._model._bring_in(names)
        with self._lock:
            self._bytes_done += sum(self._model.locate(name)[2] for name in names)

    def done(self) -> bool:
        """Whether every tensor is in (or the prefetch failed, or was cancelled)."""
        return all(future.done() for future in self._futures)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done (at most `timeout` seconds): True if done. The first failure is raised (a
        tensor whose bytes cannot be had, or do not match the manifest), as it is."""
        finished, pending = concurrent.futures.wait(self._futures, timeout)
        for future in self._futures:
            if future in finished and not future.cancelled() and future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        return not pending

    def cancel(self) -> None:
        """Bring in nothing more: what has not begun never begins (what has, ends soon)."""
        self._cancelled.set()
        for future in self._futures:
            future.cancel()

    def __repr__(self) -> str:
        return f"<Prefetch {self.bytes_done} of {self.bytes_total} bytes{', done' if self.done() else ''}>"


def _runs(model: Model, names: Iterable[str]) -> list[list[str]]:
    """`names` in runs of neighbours of one shard (up to RUN_BYTES), in the order given."""
    runs: list[list[str]] = []
    last: tuple[object, int] | None = None  # (shard, end) of the run being made
    size = 0
    for name in names:
        shard, offset, nbytes = model.locate(name)
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
    `ahead_bytes` bytes ahead of the one handed out (always the next one, whatever its size)."""

    def __init__(
        self,
        model: Model,
        names: Sequence[str],
        pool: ThreadPoolExecutor,
        make: Any,
        ahead: int,
        ahead_bytes: int,
    ) -> None:
        self._model = model
        self._names = names
        self._pool = pool
        self._make = make  # name -> the tensor, once it is in
        self._ahead = max(0, ahead)
        self._ahead_bytes = ahead_bytes
        self._pending: deque[tuple[str, int, Future[None]]] = deque()  # brought in, not handed out yet
        self._next = 0  # the next name to send for
        self._cancelled = threading.Event()
        self._lock = threading.Lock()  # next() may run on a worker thread (atensors) while close() runs

    def _fill(self) -> None:
        in_window = sum(nbytes for _, nbytes, _ in self._pending)
        while self._next < len(self._names) and len(self._pending) <= self._ahead:
            name = self._names[self._next]
            nbytes = self._model.locate(name)[2]
            if self._pending and in_window + nbytes > self._ahead_bytes:
                break
            self._pending.append((name, nbytes, self._pool.submit(self._bring, name)))
            in_window += nbytes
            self._next += 1

    def _bring(self, name: str) -> None:
        if not self._cancelled.is_set():
            self._model._bring_in([name])

    def next(self) -> tuple[str, Any] | None:
        """The next (name, tensor), once it is in; None at the end (blocking)."""
        with self._lock:
            self._fill()
            if not self._pending:
                return None
            name, _, future = self._pending.popleft()
            self._fill()  # the window moves on before this one is waited for
        future.result()
        return name, self._make(name)

    def close(self) -> None:
        """Stop: nothing more is sent for, and what was sent for and has not begun never begins."""
        self._cancelled.set()
        with self._lock:
            for _, _, future in self._pending:
                future.cancel()
            self._pending.clear()
            self._next = len(self._names)


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
