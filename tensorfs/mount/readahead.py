"""How a mount has a reader's bytes in memory before it answers: at once when they are (a window
brought in before, a small tensor's resident pages), else brought in off the request thread; and a
window ahead of a stream of requests, never of a random reader.

A stream is a reader whose request begins where one of its last requests ended (or at the tensor's
first byte): the kernel's own read-ahead makes a sequential reader's requests so. Only then is a
window brought in past the request (and kept ahead of it as it is consumed); a random reader has
its requests alone brought in.
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
STREAMS = 4
"""Request ends remembered per open tensor: as many readers streaming through it at once are told apart."""


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
    ends: deque[int] = field(default_factory=lambda: deque(maxlen=STREAMS))
    """Where the last requests ended (offsets of the place's data)."""

    def in_shard(self, place: Place, offset: int) -> int:
        """An offset of the place's data as the offset of the same byte of the tensor in its own shard."""
        return self.origin + offset - place.start

    def streams(self, place: Place, low: int) -> bool:
        """Whether a request from `low` goes on from one before (or begins the tensor): a stream."""
        return low == place.start or low in self.ends


class ReadAhead:
    """A mount's presence: what its reads wait for before they are answered from the mapping."""

    def __init__(self, stats: Stats, prefetch: int, nursery: Callable[[], trio.Nursery | None]) -> None:
        self.stats = stats
        self.prefetch = prefetch
        """Bytes brought in ahead of a stream."""
        self._nursery = nursery
        self._prefetchers = trio.CapacityLimiter(2)

    def present(self, span: OpenTensor, place: Place, low: int, high: int) -> Plan[bytes | None]:
        """[low, high) of a place present and pinned: at once when it is known to be in memory (the
        window brought in before, or a small tensor's pages resident); else brought in off this
        thread, with a window ahead of a stream."""
        data = place.data
        if span.window is not data:  # switched to a fallback: what was known of its pages is not
            span.window, span.ready_from, span.ready_to = data, 0, 0
            span.ends.clear()
        streaming = span.streams(place, low)
        span.ends.append(high)
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
        copied: bytes | None = yield "present", functools.partial(data.pinned_or_copied, low, high, within=within)
        self.stats.page_waits += 1
        self.stats.page_wait_seconds += time.perf_counter() - waited
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
