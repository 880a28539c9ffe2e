"""Reads that failed waiting on a store, remembered for the readers the kernel held behind them.

The kernel lets one reader at a time ask for a page of a file: the others wait on the page's lock,
and when the read fails, the next of them finds the page still missing and asks the daemon again.
Each would wait a --remote-timeout of its own, one after another (six readers of a stalled file:
answered at 10, 20, ... 60 s). A failure is remembered instead, and a read of its range answered at
once with it, until the file is opened again (a new reader asks the store again) or FAILED_FOR
passes (a reader that keeps the file open does too). Not where the next read may be answered from
elsewhere (a model with fallbacks: the gate turns to one when its store fails).
"""

from __future__ import annotations

import collections
import time

from ..errors import RemoteError

__all__ = ["FAILED_FOR", "FailedReads"]

FAILED_FOR = 5.0
"""Seconds a failed read answers the reads of its range without asking the store again."""
RANGES_KEPT = 16
"""Failed ranges remembered of one file (the oldest forgotten first)."""
FILES_KEPT = 4096
"""Files whose failures are remembered at once (the oldest forgotten first)."""


class FailedReads:
    """The reads of each file (by handle) that failed waiting on a store, while they answer others."""

    def __init__(self) -> None:
        self._files: collections.OrderedDict[int, list[tuple[int, int, float, RemoteError]]] = collections.OrderedDict()

    def check(self, fh: int, offset: int, size: int) -> None:
        """Raise the error of a remembered failure whose range meets [offset, offset + size)."""
        ranges = self._files.get(fh)
        if not ranges:
            return
        now = time.monotonic()
        for start, end, until, error in ranges:
            if now < until and start < offset + size and offset < end:
                raise error.with_traceback(None)

    def failed(self, fh: int, offset: int, size: int, error: RemoteError) -> None:
        """A read of [offset, offset + size) failed with `error`: remember it."""
        now = time.monotonic()
        ranges = [kept for kept in self._files.pop(fh, []) if kept[2] > now][-(RANGES_KEPT - 1) :]
        ranges.append((offset, offset + size, now + FAILED_FOR, error))
        self._files[fh] = ranges
        while len(self._files) > FILES_KEPT:
            self._files.popitem(last=False)

    def opened(self, fh: int) -> None:
        """The file was opened again: its next reads ask the store again."""
        self._files.pop(fh, None)
