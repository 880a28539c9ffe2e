"""Fingerprints of the bytes a file served: the CRC-32C of each block of it, taken from the file as
its bytes were first handed out.

A file's status changes without its bytes (chmod, chown, touch, a link made and removed, the same
bytes written again), and nothing the kernel tells tells the two apart (sources/watch.py). Where no
manifest or signature can tell, the bytes served so far are read again and compared with their
fingerprints: all alike, the file is the one served and serving goes on; one differs, it is not.
Blocks are read from the file (never the mapping: a block cut from the file would kill the process
that touched it), in pieces of at most a MiB.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from array import array
from collections.abc import Callable, Iterator

import crc32c

__all__ = ["BLOCK", "Fingerprints"]

BLOCK = 64 << 10
"""The bytes one fingerprint covers: a random 4 KiB reader reads 16 times what it is served at most
(the kernel's read-around brings in as much), a sequential one 16 CRCs a MiB."""
_PIECE = 1 << 20

Read = Callable[[int, memoryview], None]
"""readinto(offset, buffer) of the file (ShardData.readinto: ShardChangedError when the bytes are gone)."""


class Fingerprints:
    """The CRC-32C of each BLOCK of one file of `size` bytes that was served (taken before it was)."""

    def __init__(self, size: int) -> None:
        self.size = size
        blocks = -(-size // BLOCK)
        self._taken = bytearray(blocks)
        self._sums = array("I", bytes(4 * blocks))
        self._lock = threading.Lock()

    def covers(self, start: int, end: int) -> bool:
        """Whether every block of [start, end) has its fingerprint (quick: a serving thread asks)."""
        if end <= start:
            return True
        return self._taken.find(0, start // BLOCK, (end - 1) // BLOCK + 1) < 0

    def take(self, read: Read, start: int, end: int) -> dict[int, int]:
        """The fingerprints of the blocks of [start, end) not taken yet, read from the file now
        (blocking); kept only by keep(), once the caller knows the file did not change meanwhile."""
        found: dict[int, int] = {}
        first, last = start // BLOCK, (min(end, self.size) - 1) // BLOCK
        block = first
        while block <= last:
            if self._taken[block]:
                block += 1
                continue
            stop = block
            while stop <= last and not self._taken[stop] and (stop - block + 1) * BLOCK <= _PIECE:
                stop += 1
            found.update(self._sums_of(read, block, stop))
            block = stop
        return found

    def keep(self, found: dict[int, int]) -> None:
        with self._lock:
            for block, crc in found.items():
                self._sums[block] = crc
                self._taken[block] = 1

    def differs(self, read: Read) -> int | None:
        """The offset of the first block served whose bytes are not what they were (blocking); None
        when every one is as it was. ShardChangedError (from `read`) when the file is shorter."""
        with self._lock:
            taken = [block for block, flag in enumerate(self._taken) if flag]
        run_start = 0
        while run_start < len(taken):
            run_end = run_start + 1
            while (
                run_end < len(taken)
                and taken[run_end] == taken[run_end - 1] + 1
                and (run_end - run_start + 1) * BLOCK <= _PIECE
            ):
                run_end += 1
            first, stop = taken[run_start], taken[run_end - 1] + 1
            for block, crc in self._sums_of(read, first, stop).items():
                if crc != self._sums[block]:
                    return block * BLOCK
            run_start = run_end
        return None

    def _sums_of(self, read: Read, first: int, stop: int) -> dict[int, int]:
        """The CRC-32C of blocks first..stop-1, read from the file in one piece (at most _PIECE)."""
        begin, end = first * BLOCK, min(self.size, stop * BLOCK)
        with _piece() as whole:
            buffer = whole[: end - begin]
            read(begin, buffer)
            return {
                block: crc32c.crc32c(buffer[(block - first) * BLOCK : (block - first + 1) * BLOCK])
                for block in range(first, stop)
            }


_BUFFERS: queue.LifoQueue[memoryview] = queue.LifoQueue()
_BUFFER_COUNT = 2
"""Pieces read at once, by every file's fingerprints in the process: the CRC takes a core each, and
the daemon's memory stays what it was however many bytes it serves (buffers made once, reused)."""
_made = 0
_making = threading.Lock()


@contextlib.contextmanager
def _piece() -> Iterator[memoryview]:
    """A buffer of _PIECE bytes, borrowed (waited for when every one is lent)."""
    global _made
    with _making:
        if _made < _BUFFER_COUNT and _BUFFERS.empty():
            _made += 1
            _BUFFERS.put(memoryview(bytearray(_PIECE)))
    buffer = _BUFFERS.get()
    try:
        yield buffer
    finally:
        _BUFFERS.put(buffer)
