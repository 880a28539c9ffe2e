"""The bytes of a shard's file that no tensor holds (its header, the padding between tensors, a
checkpoint's zip records), kept in memory as they were validated: what a view serving the file as it
is gives of them (Gate.read_untensored)."""

from __future__ import annotations

import functools
import threading
from array import array
from bisect import bisect_right
from collections.abc import Callable

from ..catalogue.tables import Tables, file_gaps
from ..errors import ShardChangedError, TensorfsError, printable
from ..sources.shard import ShardData
from ..utils.identity import ShardKey
from .changes import Changes
from .plans import Plan, Refused

__all__ = ["KeptUntensored", "UntensoredBytes"]


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


class KeptUntensored:
    """Of each shard of a gate's model, the bytes no tensor holds, kept from their first read while its
    file was the one validated (the gate's lock held where a method says so)."""

    def __init__(self, tables: Tables, changes: Changes, lock: threading.RLock) -> None:
        self._tables = tables
        self._changes = changes
        self._lock = lock
        self._kept: dict[ShardKey, UntensoredBytes] = {}

    def of(self, shard: ShardKey) -> Plan[UntensoredBytes]:
        """The shard's bytes no tensor holds, as validated (read and kept first if need be: keep())."""
        kept = self._kept.get(shard)
        if kept is None:
            yield "read", functools.partial(self.keep, shard)
            kept = self._kept[shard]
        return kept

    def keep(self, shard: ShardKey) -> None:
        """Read and keep the bytes of a shard's file that no tensor holds (blocking), now, while it is
        the file validated: of() gives them from then on, whatever becomes of the file (a chmod is a
        change: its tensors are then held again to what they are held to, and these stay the
        validated ones). Refused when the file changed in place since it was opened."""
        if shard in self._kept:
            return
        data = self._tables.shard_data(shard)
        self._as_opened(shard, data)
        kept = UntensoredBytes(file_gaps(self._tables.shard_header(shard)))
        try:
            kept.fill(data.readinto)
        except TensorfsError as exc:
            raise ShardChangedError(
                f"{printable(str(shard))}: its bytes other than its tensors' cannot be read: {exc}"
            ) from None
        self._as_opened(shard, data)  # written while it was read: not the bytes validated
        with self._lock:
            self._kept.setdefault(shard, kept)

    def _as_opened(self, shard: ShardKey, data: ShardData) -> None:
        with self._lock:
            self._changes.notice(data)
            state = self._changes.seen(data)
            if state is not None and (state.changed or state.generation):
                raise Refused(
                    f"{printable(str(shard))}: changed in place since it was opened, before its bytes other than its "
                    "tensors' were read: they are not served (mount or open it again)"
                )
