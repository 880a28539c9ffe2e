"""Fingerprints of the bytes a file served: the CRC-32C of each block of it, taken from the file soon
after its bytes were first handed out.

A file's status changes without its bytes (chmod, chown, touch, a link made and removed, the same
bytes written again), and nothing the kernel tells tells the two apart (sources/watch.py). Where no
manifest or signature can tell, the bytes served so far are read again and compared with their
fingerprints: all alike, the file is the one served and serving goes on; one other, or a block
served and not fingerprinted yet, it is not. Fingerprints are taken off the serving path, on a
thread of low priority (a mount's flush, every second: the CRC would cost a first read half its
speed on the two cores it shares with the reader), and kept only if no change of the file was seen
from the bytes' serving to their reading. Blocks are read from the file (never the mapping: a block
cut from the file would kill the process that touched it), in pieces of at most a MiB.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from array import array
from collections.abc import Callable, Iterator

import crc32c

__all__ = ["BLOCK", "Fingerprints", "prepare"]

BLOCK = 64 << 10
"""The bytes one fingerprint covers: a random 4 KiB reader's are read 16 times over to be taken (the
kernel's read-around brings in as much), a sequential reader's take 16 CRCs a MiB."""
_PIECE = 1 << 20
_UNTOUCHED, _SERVED, _TAKEN = 0, 1, 2

Read = Callable[[int, memoryview], None]
"""readinto(offset, buffer) of the file (ShardData.readinto: ShardChangedError when the bytes are gone)."""


class Fingerprints:
    """Of one file of `size` bytes, each BLOCK's state: never served, served (its fingerprint to take),
    or fingerprinted (its CRC-32C kept). Thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        blocks = -(-size // BLOCK)
        self._state = bytearray(blocks)
        self._sums = array("I", bytes(4 * blocks))
        self._lock = threading.Lock()

    def served(self, start: int, end: int) -> None:
        """Bytes [start, end) go out: their blocks' fingerprints are to be taken (quick: the serving
        thread tells it)."""
        if end <= start:
            return
        first, stop = start // BLOCK, (min(end, self.size) - 1) // BLOCK + 1
        with self._lock:
            blocks = self._state[first:stop]
            if _UNTOUCHED in blocks:
                self._state[first:stop] = blocks.replace(b"\0", b"\1")

    def pending(self) -> int:
        """How many bytes were served whose fingerprints are not taken yet (rounded to blocks)."""
        with self._lock:
            return self._state.count(_SERVED) * BLOCK

    def take(self, read: Read) -> dict[int, int]:
        """The fingerprints of the blocks served and not fingerprinted, read from the file now
        (blocking); kept only by keep(), once the caller knows the file did not change meanwhile."""
        with self._lock:
            waiting = [block for block, state in enumerate(self._state) if state == _SERVED]
        found: dict[int, int] = {}
        for first, stop in _runs(waiting):
            found.update(self._sums_of(read, first, stop))
        return found

    def keep(self, found: dict[int, int]) -> None:
        with self._lock:
            for block, crc in found.items():
                self._sums[block] = crc
                self._state[block] = _TAKEN

    def differs(self, read: Read) -> int | None:
        """Where the first block served is that is not as its fingerprint says (blocking): one served
        and never fingerprinted counts (nothing can tell it is); None when every one is as it was.
        ShardChangedError (from `read`) when the file is shorter."""
        with self._lock:
            unproven = self._state.find(_SERVED)
            taken = [block for block, state in enumerate(self._state) if state == _TAKEN]
        if unproven >= 0:
            return unproven * BLOCK
        for first, stop in _runs(taken):
            for block, crc in self._sums_of(read, first, stop).items():
                if crc != self._sums[block]:
                    return block * BLOCK
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


def _runs(blocks: list[int]) -> Iterator[tuple[int, int]]:
    """Runs of consecutive blocks (first, stop), each at most _PIECE bytes."""
    start = 0
    while start < len(blocks):
        end = start + 1
        while end < len(blocks) and blocks[end] == blocks[end - 1] + 1 and (end - start + 1) * BLOCK <= _PIECE:
            end += 1
        yield blocks[start], blocks[end - 1] + 1
        start = end


_BUFFERS: queue.LifoQueue[memoryview] = queue.LifoQueue()
_BUFFER_COUNT = 2
"""Pieces read at once, by every file's fingerprints in the process: the daemon's memory stays what
it was however many bytes it serves (buffers made once, reused)."""
_made = 0
_making = threading.Lock()


def prepare() -> None:
    """Make the buffers fingerprints are read into now (a mount, as it starts: its memory and mappings
    are then what they stay, however many bytes it serves)."""
    global _made
    with _making:
        while _made < _BUFFER_COUNT:
            _made += 1
            _BUFFERS.put(memoryview(bytearray(_PIECE)))


@contextlib.contextmanager
def _piece() -> Iterator[memoryview]:
    """A buffer of _PIECE bytes, borrowed (waited for when every one is lent)."""
    prepare()
    buffer = _BUFFERS.get()
    try:
        yield buffer
    finally:
        _BUFFERS.put(buffer)
