"""The threads that fetch chunks for every remote shard of a process, and what they count."""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import ClassVar

from ..errors import ObjectChanged, RemoteError, TensorfsError
from . import waits


def lower_this_thread(by: int) -> None:
    """Run this thread below those that answer requests (`by` nice levels more: per thread on Linux)."""
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + by))


def _yield_to_requests() -> None:
    """A fetch thread runs below the thread that answers requests (nice 10 more): with readers
    streaming cold data the CPUs are busy, and a `stat` must not wait behind fetches."""
    lower_this_thread(_FETCH_NICE)


_FETCH_NICE = 10


class RemoteCounters:
    """What this process's remote shards did, for the daemon's counters (fetch threads count too)."""

    NAMES = (
        "gets", "fetched_bytes", "fetch_failures", "cache_hits", "evicted_chunks", "evicted_bytes",
        "chunks_checked", "bad_chunks", "changed_chunks", "split_chunks", "arriving_reads",
    )  # fmt: skip

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.NAMES, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, count in counts.items():
                self._values[name] += count

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._values)


COUNTERS = RemoteCounters()


class Fetcher:
    """The threads that GET chunks, for every remote shard of a process (as many as --remote-concurrency)."""

    _pools: ClassVar[dict[int, ThreadPoolExecutor]] = {}
    _lock = threading.Lock()

    @classmethod
    def pool(cls, concurrency: int) -> ThreadPoolExecutor:
        with cls._lock:
            pool = cls._pools.get(concurrency)
            if pool is None:
                pool = cls._pools[concurrency] = ThreadPoolExecutor(
                    concurrency, thread_name_prefix="fetch", initializer=_yield_to_requests
                )
            return pool


def failed_future(exc: Exception) -> Future[None]:
    future: Future[None] = Future()
    future.set_exception(exc)
    return future


def wait(futures: list[Future[None]], limit: float | None = None) -> None:
    """Wait for every fetch (until the request's deadline for `limit`: waits.py); the first failure is
    raised (as the TensorfsError it is)."""
    first: Exception | None = None
    for future in futures:
        try:
            waits.wait_for(future, limit, lambda: "a fetch shared with other readers")
        except Exception as exc:  # each fetch's own error; the first is told (Ctrl-C is not a fetch's)
            if first is None:
                first = exc
    if first is not None:
        if isinstance(first, TensorfsError):
            raise first
        if isinstance(first, FileNotFoundError):  # its message names the object: "URL: not found (404)"
            raise ObjectChanged(f"{first}: gone since it was validated") from None
        raise RemoteError(f"fetch failed: {first!r}") from first
