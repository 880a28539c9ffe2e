"""Chunks whose bytes a manifest or a signature refused in this process, had again since: what they
are held to here instead of what they first summed to, and when they become the object's for every
process (once every byte of them is proven).

The cache records what each chunk summed to when it first came, and every process holds the chunk's
later fetches to it: a store cannot serve other bytes under the same version. When a reader held to
a manifest or a signature proves bytes of a chunk wrong, the first bytes were the lie: that reader's
process fetches the chunk again held to nothing (so that a store that lied once and is honest again
is read again), and only readers held to a manifest or a signature take what comes (each proves it).
Every other process, and every reader held to nothing, stays held to the first checksums until bytes
had again are proven, whole chunk by whole chunk: then those become the record."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .records import ChunkSum

__all__ = ["Chunks", "Refetched"]


@dataclass(frozen=True)
class Chunks:
    """How an object is cut into chunks here: their size, the object's, and which are present here."""

    size: int
    total: int
    here: Callable[[int], bool]


class Refetched:
    """Of one object version, in this process: each chunk refused here, what it summed to when it came
    again (None: not yet), and the ranges of it proven since. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[int, ChunkSum | None] = {}
        self._proven: dict[int, list[tuple[int, int]]] = {}

    def unhold(self, chunks: Iterable[int]) -> None:
        """These chunks' bytes were refused: held to nothing until they come again."""
        with self._lock:
            for chunk in chunks:
                self._sums[chunk] = None
                self._proven.pop(chunk, None)

    def holds(self, chunk: int) -> bool:
        return chunk in self._sums

    def sums(self, chunk: int) -> ChunkSum | None:
        """What the chunk is held to here (None: nothing yet); call only for a chunk it holds."""
        return self._sums.get(chunk)

    def came(self, chunk: int, sums: ChunkSum) -> None:
        """A chunk refused here came again, summing to `sums`: held to those from now on, here."""
        with self._lock:
            if chunk in self._sums and self._sums[chunk] is None:
                self._sums[chunk] = sums

    def proven(
        self, chunks: Chunks, start: int, end: int, header: int, holds_header: Callable[[], bool]
    ) -> list[tuple[int, ChunkSum]]:
        """Bytes [start, end) of the object, as it is held here now, are proven (a manifest's or a
        signature's digest matched): the chunks held here whose every byte is proven since they came
        again, with what they sum to (to record; then done()). A chunk's first `header` bytes, which no
        digest of a tensor covers, count when they are those the object was opened with (`holds_header`)."""
        found: list[tuple[int, ChunkSum]] = []
        if end <= start:
            return found
        for chunk in range(start // chunks.size, (end - 1) // chunks.size + 1):
            begin, stop = chunk * chunks.size, min(chunks.total, (chunk + 1) * chunks.size)
            with self._lock:
                sums = self._sums.get(chunk)
                if sums is None or not chunks.here(chunk):
                    continue
                covered = self._proven.setdefault(chunk, [])
                covered.append((max(begin, start), min(stop, end)))
                whole = _covers(covered, max(begin, min(header, stop)), stop)
            if whole and (begin >= header or holds_header()):
                found.append((chunk, sums))
        return found

    def done(self, chunk: int) -> None:
        """The chunk's bytes are the object's record now: held to it as any other."""
        with self._lock:
            self._sums.pop(chunk, None)
            self._proven.pop(chunk, None)

    def __bool__(self) -> bool:
        return bool(self._sums)


def _covers(ranges: list[tuple[int, int]], start: int, end: int) -> bool:
    """Whether `ranges` ([a, b) pairs) cover [start, end) without a gap."""
    reached = start
    for begin, stop in sorted(ranges):
        if begin > reached:
            return False
        reached = max(reached, stop)
    return reached >= end
