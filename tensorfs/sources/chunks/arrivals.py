"""The bytes of chunks still coming that may be answered as they land: a chunk its object version
never gave before has nothing to be checked against, so a read of its bytes need not wait for the
whole chunk (objects.py: CachedObject.copy_arriving). What of each such chunk is written so far, and
which copies wait for which bytes: a piece written wakes them only when it completes one's bytes."""

from __future__ import annotations

import threading

__all__ = ["Arrivals"]


class Arrivals:
    """Of one object's chunks being fetched, the ranges written so far; every method is called with
    the object's lock held (the lock of `condition`, which the copies wait on)."""

    def __init__(self, condition: threading.Condition) -> None:
        self._condition = condition
        self._written: dict[int, list[tuple[int, int]]] = {}
        """Chunk -> [start, end) of each part of its fetch begun, the last growing."""
        self._awaited: list[tuple[int, int, int]] = []
        """(chunk, start, end) of the bytes each waiting copy wants."""

    def begin(self, chunk: int) -> None:
        """A fetch of `chunk` whose bytes may be answered as they come begins."""
        self._written[chunk] = []

    def part(self, chunk: int, start: int) -> None:
        """The fetch goes on with a part of the chunk from `start`."""
        parts = self._written.get(chunk)
        if parts is not None:
            parts.append((start, start))

    def wrote(self, chunk: int, offset: int) -> None:
        """Bytes of the chunk's part under way are written up to `offset`: the copies whose bytes are
        then all there are woken."""
        parts = self._written.get(chunk)
        if not parts:
            return
        low = parts[-1][0]
        parts[-1] = (low, offset)
        if any(c == chunk and low <= a and b <= offset for c, a, b in self._awaited):
            self._condition.notify_all()

    def end(self, chunk: int) -> None:
        """The chunk's fetch is over (present, or failed: no copy of its bytes from now on)."""
        self._written.pop(chunk, None)

    def coming(self, chunk: int) -> bool:
        """Whether the chunk's bytes are being written by a fetch whose bytes may be answered."""
        return chunk in self._written

    def written(self, chunk: int, low: int, high: int) -> bool:
        """Whether bytes [low, high) of the chunk are written by its fetch under way."""
        parts = self._written.get(chunk)
        return parts is not None and any(a <= low and high <= b for a, b in parts)

    def wait(self, wanted: list[tuple[int, int, int]], timeout: float) -> None:
        """Wait (the lock held) for a piece that completes one of `wanted` (chunk, start, end), a
        fetch's end, or `timeout` seconds."""
        self._awaited += wanted
        try:
            self._condition.wait(timeout)
        finally:
            for item in wanted:
                self._awaited.remove(item)
