"""The bytes of a shard's file that no tensor holds (its header, the padding between tensors, a
checkpoint's zip records), kept in memory as they were validated: what a view serving the file as it
is gives of them (Gate.read_untensored)."""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable

__all__ = ["UntensoredBytes"]


class UntensoredBytes:
    """Runs [start, end) of one file, their bytes in one buffer (a model's headers take a few MiB)."""

    def __init__(self, runs: list[tuple[int, int]]) -> None:
        self._starts = array("Q", (start for start, _ in runs))
        self._ends = array("Q", (end for _, end in runs))
        self._at = array("Q", [0])  # where each run's bytes begin in the buffer
        for start, end in runs:
            self._at.append(self._at[-1] + end - start)
        self._bytes = bytearray(self._at[-1])

    def fill(self, read: Callable[[int, memoryview], None]) -> None:
        """Read every run: `read(offset, buffer)` fills a buffer from an offset of the file."""
        view = memoryview(self._bytes)
        for k, start in enumerate(self._starts):
            read(start, view[self._at[k] : self._at[k + 1]])

    def copy(self, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the file's bytes from `offset`, all within one run (ValueError if not)."""
        k = bisect_right(self._starts, offset) - 1
        if k < 0 or offset + len(buffer) > self._ends[k]:
            raise ValueError(f"bytes [{offset}, {offset + len(buffer)}) are not all of one run no tensor holds")
        at = self._at[k] + offset - self._starts[k]
        buffer[:] = self._bytes[at : at + len(buffer)]
