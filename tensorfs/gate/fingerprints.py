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

__all__ = ["BLOCK", "PAGE", "Fingerprints", "prepare"]

BLOCK = 64 << 10
"""The bytes one fingerprint covers where a request served the whole of them (a stream's 16 CRCs a MiB)."""
PAGE = 4096
"""What a fingerprint covers at the edges of what was served (a random reader's 4 KiB is read back as
4 KiB, not as the 64 KiB around it: that read-back halved a cold random reader's rate)."""
_PIECE = 1 << 20
_UNTOUCHED, _SERVED, _TAKEN = 0, 1, 2

Read = Callable[[int, memoryview], None]
"""readinto(offset, buffer) of the file (ShardData.readinto_exact: ShardChangedError when the bytes are gone)."""


class Fingerprints:
    """Of one file of `size` bytes, what was served: whole BLOCKs, each never served, served (its
    fingerprint to take) or fingerprinted (its CRC-32C kept); and the PAGEs served of blocks served
    in part, each with its CRC-32C once taken. Thread-safe."""

    def __init__(self, size: int) -> None:
        self.size = size
        blocks = -(-size // BLOCK)
        self._state = bytearray(blocks)
        self._sums = array("I", bytes(4 * blocks))
        self._pages: dict[int, int | None] = {}  # page -> its CRC-32C (None: to take)
        self._lock = threading.Lock()

    def served(self, start: int, end: int) -> None:
        """Bytes [start, end) go out: their fingerprints are to be taken (quick: the serving thread
        tells it). Whole blocks are marked; the pages at the edges, where a block is served in part."""
        end = min(end, self.size)
        if end <= start:
            return
        first = -(-start // BLOCK)
        stop = self._blocks_to(end)
        with self._lock:
            if first < stop:
                blocks = self._state[first:stop]
                if _UNTOUCHED in blocks:
                    self._state[first:stop] = blocks.replace(b"\0", b"\1")
            for low, high in ((start, min(end, first * BLOCK)), (max(start, stop * BLOCK), end)):
                for page in range(low // PAGE, -(-high // PAGE)):
                    if self._state[page * PAGE // BLOCK] == _UNTOUCHED and page not in self._pages:
                        self._pages[page] = None

    def _blocks_to(self, end: int) -> int:
        """The blocks before `end` whole (the last block of the file is whole at its end)."""
        return -(-end // BLOCK) if end >= self.size else end // BLOCK

    def pending(self) -> int:
        """How many bytes were served whose fingerprints are not taken yet (rounded to blocks and pages)."""
        with self._lock:
            pages = sum(crc is None for crc in self._pages.values())
            return self._state.count(_SERVED) * BLOCK + pages * PAGE

    def take(self, read: Read) -> tuple[dict[int, int], dict[int, int]]:
        """The fingerprints of the blocks and pages served and not fingerprinted, read from the file
        now (blocking); kept only by keep(), once the caller knows the file did not change meanwhile."""
        with self._lock:
            blocks = [block for block, state in enumerate(self._state) if state == _SERVED]
            pages = sorted(page for page, crc in self._pages.items() if crc is None)
        found_blocks: dict[int, int] = {}
        for first, stop in _runs(blocks, BLOCK):
            found_blocks.update(self._sums_of(read, first, stop, BLOCK))
        found_pages: dict[int, int] = {}
        for first, stop in _runs(pages, PAGE):
            found_pages.update(self._sums_of(read, first, stop, PAGE))
        return found_blocks, found_pages

    def keep(self, found: tuple[dict[int, int], dict[int, int]]) -> None:
        blocks, pages = found
        with self._lock:
            for block, crc in blocks.items():
                self._sums[block] = crc
                self._state[block] = _TAKEN
            self._pages.update(pages)

    def differs(self, read: Read) -> int | None:
        """Where the first byte served is whose block or page is not as its fingerprint says
        (blocking): one served and never fingerprinted counts (nothing can tell it is); None when
        every one is as it was. ShardChangedError (from `read`) when the file is shorter."""
        with self._lock:
            unproven = self._state.find(_SERVED)
            if unproven >= 0:
                return unproven * BLOCK
            if None in self._pages.values():
                return min(page for page, crc in self._pages.items() if crc is None) * PAGE
            blocks = [block for block, state in enumerate(self._state) if state == _TAKEN]
            pages = dict(self._pages)
        for first, stop in _runs(blocks, BLOCK):
            for block, crc in self._sums_of(read, first, stop, BLOCK).items():
                if crc != self._sums[block]:
                    return block * BLOCK
        for first, stop in _runs(sorted(pages), PAGE):
            for page, crc in self._sums_of(read, first, stop, PAGE).items():
                if crc != pages[page]:
                    return page * PAGE
        return None

    def _sums_of(self, read: Read, first: int, stop: int, unit: int) -> dict[int, int]:
        """The CRC-32C of units first..stop-1 (blocks or pages), read from the file in one piece."""
        from crc32c import crc32c  # imported by prepare() already (here: the name)

        begin, end = first * unit, min(self.size, stop * unit)
        with _piece() as whole:
            buffer = whole[: end - begin]
            read(begin, buffer)
            return {
                index: crc32c(buffer[(index - first) * unit : (index - first + 1) * unit])
                for index in range(first, stop)
            }


def _runs(indices: list[int], unit: int) -> Iterator[tuple[int, int]]:
    """Runs of consecutive indices (first, stop), each at most _PIECE bytes of units of `unit`."""
    start = 0
    while start < len(indices):
        end = start + 1
        while end < len(indices) and indices[end] == indices[end - 1] + 1 and (end - start + 1) * unit <= _PIECE:
            end += 1
        yield indices[start], indices[end - 1] + 1
        start = end


_BUFFERS: queue.LifoQueue[memoryview] = queue.LifoQueue()
_BUFFER_COUNT = 2
"""Pieces read at once, by every file's fingerprints in the process: the daemon's memory stays what
it was however many bytes it serves (buffers made once, reused)."""
_made = 0
_making = threading.Lock()


def prepare() -> None:
    """Make the buffers fingerprints are read into now (a mount, as it starts: its memory and mappings
    are then what they stay, however many bytes it serves). crc32c is imported here, not at the top:
    it takes tens of ms, which a command that fingerprints nothing need not wait."""
    import crc32c  # noqa: F401

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
