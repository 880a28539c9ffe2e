"""How a mount has a reader's bytes in memory before it answers: at once when they are (a window
brought in before, a small tensor's resident pages), else brought in off the request thread; and a
window ahead of a stream of requests, never of a random reader.

A stream is a run of requests each beginning where the one before ended, begun at the tensor's
first byte or grown past STREAM_AFTER (the kernel's own read-ahead makes a sequential reader's
requests so; one read of a MiB by a random reader may come as several requests that follow each
other: no stream yet). Only a stream has a window brought in past its request (and kept ahead of it
as it is consumed). A random reader's request is read from the file into its answer, exactly its
bytes: bringing them in through the mapping read a fault's whole read-around from the disk (128 KiB
for 4 KiB: docs/performance.md).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from ..errors import TensorfsError
from ..gate import Gate, Place, Plan
from ..sources.shard import ShardData
from ..utils.identity import ShardKey
from .stats import Stats

__all__ = ["DEFAULT_PREFETCH", "SMALL_TENSOR", "OpenTensor", "ReadAhead"]

DEFAULT_PREFETCH = 32 << 20
SMALL_TENSOR = 1 << 20
"""Tensors up to this size are read without a worker thread when their pages are in memory already."""
INLINE_READ = 64 << 10
"""A random reader's request up to this size is read on the request thread itself, from a disk that
answers such reads within INLINE_BELOW: a hop to a worker thread and back costs about 0.1 ms here,
more than the read (docs/performance.md); a slower disk's are read on worker threads, as streams'."""
INLINE_BELOW = 0.0002
STREAMS = 4
"""Runs of requests remembered per open tensor: as many readers streaming through it at once are told apart."""
STREAM_AFTER = 4 << 20
"""Bytes a run of requests that follow each other grows to before it is a stream (unless it began at
the tensor's first byte): a random reader's 1 MiB read comes as up to 8 requests in a run."""


@dataclass(eq=False)
class OpenTensor:
    """An open tensor file: which of its bytes are known to be in memory where they are had, and
    where its readers' last requests ended."""

    name: str
    shard: ShardKey
    """Its own shard (the model's)."""
    origin: int
    """Where its bytes start in its own shard."""
    gate: Gate
    """The gate of the model that holds it (the tree's, or another whose file the view serves)."""
    window: ShardData | None = None
    """The source the window below is of (its own shard's, or its fallback copy's)."""
    ready_from: int = 0
    ready_to: int = 0
    prefetching: bool = False
    runs: deque[list[int]] = field(default_factory=lambda: deque(maxlen=STREAMS))
    """The last runs of requests, each [where it began, where it ends now] (offsets of the place's data)."""

    def in_shard(self, place: Place, offset: int) -> int:
        """An offset of the place's data as the offset of the same byte of the tensor in its own shard."""
        return self.origin + offset - place.start

    def streams(self, place: Place, low: int, high: int) -> bool:
        """Whether a request of [low, high) is part of a stream (see the module's docstring); it is
        counted in its run."""
        for run in self.runs:
            if run[1] == low:
                run[1] = high
                return run[0] == place.start or run[1] - run[0] >= STREAM_AFTER
        self.runs.append([low, high])
        return low == place.start


class ReadAhead:
    """A mount's presence: what its reads wait for before they are answered from the mapping."""

    def __init__(self, stats: Stats, prefetch: int, nursery: Callable[[], trio.Nursery | None]) -> None:
        self.stats = stats
        self.prefetch = prefetch
        """Bytes brought in ahead of a stream."""
        self._nursery = nursery
        self._prefetchers = trio.CapacityLimiter(2)
        self._disk_seconds = INLINE_BELOW  # how long a random reader's small read takes the disk (averaged)

    def present(self, span: OpenTensor, place: Place, low: int, high: int) -> Plan[bytes | None]:
        """[low, high) of a place present and pinned: at once when it is known to be in memory (the
        window brought in before, or a small tensor's pages resident); else brought in off this
        thread, with a window ahead of a stream."""
        data = place.data
        if span.window is not data:  # switched to a fallback: what was known of its pages is not
            span.window, span.ready_from, span.ready_to = data, 0, 0
            span.runs.clear()
        streaming = span.streams(place, low, high)
        ready = span.ready_from <= low < high <= span.ready_to
        small = place.nbytes <= SMALL_TENSOR
        if not ready and small:
            # A small tensor already in memory (mincore) is answered at once: for many small files
            # the hop to a worker thread and back would cost more than the whole rest of the read.
            ready = data.resident(low, high)
        nursery = self._nursery()
        if ready and data.pin(low, high):
            if nursery is not None and streaming and not small and self._running_out(span, place, high):
                span.prefetching = True  # a stream: the window ahead fetched meanwhile
                nursery.start_soon(self._prefetch, span, place)
            return None
        # Not known to be in memory: bring in this request, and a window ahead of a stream, off this thread.
        waited = time.perf_counter()
        within = (place.start, place.end)  # the source reads ahead past the tensor only for a reader going on
        if not streaming and not data.needs_ensure:  # a random reader of a file: exactly its bytes, read
            if high - low <= SMALL_TENSOR:  # here at once, when the page cache holds them (no hop)
                cached = data.read_cached(low, high - low)
                if cached is not None:
                    return cached
                if high - low <= INLINE_READ and self._disk_seconds < INLINE_BELOW:
                    return self._timed_read(data, low, high)  # the disk answers faster than a hop
            read: bytes = yield "present", functools.partial(self._timed_read, data, low, high)
            self._waited(waited)
            return read
        copied: bytes | None = yield "present", functools.partial(data.pinned_or_copied, low, high, within=within)
        self._waited(waited)
        if copied is not None:
            # No window ahead is waited for first: that kept a cold tensor's first bytes waiting for
            # four more chunks sharing the link (docs/performance.md).
            return copied
        until = min(place.end, data.window_end(high, self.prefetch)) if streaming else high
        if until > high:
            self.stats.prefetched(span.shard, span.in_shard(place, high), span.in_shard(place, until))
            try:  # a window ahead of a reader: its failure is no reader's failure (yet)
                if not (yield "ahead", functools.partial(data.ensure, high, until, ahead=True)):
                    until = high
            except (TensorfsError, OSError):
                until = high
        span.ready_from, span.ready_to = low, max(until, span.ready_to if span.ready_from <= low else 0)
        return None

    def _waited(self, since: float) -> None:
        """Count a request that waited on a worker thread for its bytes, from `since` (perf_counter)."""
        self.stats.page_waits += 1
        self.stats.page_wait_seconds += time.perf_counter() - since

    def _timed_read(self, data: ShardData, low: int, high: int) -> bytes:
        """Bytes [low, high) of a file, read; how long its disk takes to answer a random reader, kept
        (a moving average: on this thread, or on a worker's)."""
        start = time.perf_counter()
        read = data.read_exact(low, high - low)
        if high - low <= INLINE_READ:
            self._disk_seconds += (time.perf_counter() - start - self._disk_seconds) / 8
        return read

    def _running_out(self, span: OpenTensor, place: Place, high: int) -> bool:
        return span.ready_to < place.end and span.ready_to - high < self.prefetch // 2 and not span.prefetching

    async def _prefetch(self, span: OpenTensor, place: Place) -> None:
        data, begin, until = place.data, span.ready_to, min(place.end, span.ready_to + self.prefetch)
        try:
            # A reader that consumed its window: its source may read further ahead (ahead=False).
            self.stats.prefetched(span.shard, span.in_shard(place, begin), span.in_shard(place, until))
            try:
                ensure = functools.partial(data.ensure, begin, until, ahead=False, within=(place.start, place.end))
                done = await trio.to_thread.run_sync(ensure, limiter=self._prefetchers)
            except (TensorfsError, OSError):
                done = False
            if done and span.window is data and span.ready_from <= begin <= span.ready_to:  # still contiguous
                span.ready_to = max(span.ready_to, until)
        finally:
            span.prefetching = False
