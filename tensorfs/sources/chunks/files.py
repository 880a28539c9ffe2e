"""One object version's file in the chunk cache, as bytes on a disk: opened held (locks.py), mapped,
its blocks taken and freed, its bytes written and read back. Which chunks of it are present, pinned
or coming is the object's (objects.py)."""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
from pathlib import Path

from ...errors import ObjectChanged, RemoteError
from ...fs.syscalls import fallocate, punch_hole
from ..pages import Pages
from .full import disk_full, full
from .locks import open_held
from .records import Summing

__all__ = ["ObjectFile"]

_CHECK_PIECE = 1 << 20  # a chunk is read back in pieces this large to be summed


class ObjectFile:
    """The cache file of one object version (`url`, `size` bytes) in the cache `directory`."""

    def __init__(self, path: Path, url: str, size: int, directory: Path) -> None:
        self.path = path
        self.url = url
        self.size = size
        self.directory = directory
        self.fd = open_held(path, size)
        try:
            self._mapping = mmap.mmap(self.fd, size, access=mmap.ACCESS_READ) if size else None
        except OSError as exc:
            os.close(self.fd)
            raise RemoteError(f"{url}: cannot map its cache file {path}: {exc.strerror}") from None
        self.view = memoryview(self._mapping) if self._mapping is not None else memoryview(b"")
        self.pages = Pages(self.view)

    def allocate(self, offset: int, nbytes: int) -> None:
        """Take the blocks of [offset, offset + nbytes) now (CacheFull when the disk has none)."""
        try:
            fallocate(self.fd, 0, offset, nbytes)
        except OSError as exc:
            if disk_full(exc):
                raise full(self.directory, self.url) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise self.unwritable(exc) from None

    def free(self, offset: int, nbytes: int) -> None:
        """Give back the blocks of [offset, offset + nbytes) (a hole: nothing half-written stays)."""
        with contextlib.suppress(OSError):
            punch_hole(self.fd, offset, nbytes)

    def unwritable(self, exc: OSError) -> RemoteError:
        """A write of the file that failed, in the cache's words (CacheFull for want of room)."""
        if disk_full(exc):
            return full(self.directory, self.url)
        return RemoteError(f"{self.url}: cannot write the cache: {exc.strerror}")

    def write(self, offset: int, piece: bytes) -> int:
        """Write `piece` at `offset`, all of it; where it ends."""
        view = memoryview(piece)
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written
        return offset

    def readinto(self, offset: int, buffer: memoryview) -> None:
        done, size = 0, len(buffer)
        while done < size:
            count = os.preadv(self.fd, [buffer[done:]], offset + done)
            if count == 0:
                raise self._shorter()
            done += count

    def copy(self, start: int, end: int) -> bytes:
        """Bytes [start, end) of the file, read into new bytes (none zeroed first: a read's answer)."""
        pieces: list[bytes] = []
        offset = start
        while offset < end:
            piece = os.pread(self.fd, end - offset, offset)
            if not piece:
                raise self._shorter()
            pieces.append(piece)
            offset += len(piece)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def holds(self, offset: int, expected: bytes, length: int) -> bool:
        """Whether the file's `length` bytes from `offset` are `expected` (False if they cannot be read)."""
        if len(expected) != length:
            return False
        try:
            return self.copy(offset, offset + length) == expected
        except (OSError, RemoteError):
            return False

    def summed(self, begin: int, end: int, summing: Summing) -> Summing:
        """`summing` of bytes [begin, end) of the file, read back a piece at a time."""
        buffer = bytearray(min(_CHECK_PIECE, end - begin))
        for start in range(begin, end, _CHECK_PIECE):
            piece = memoryview(buffer)[: min(_CHECK_PIECE, end - start)]
            self.readinto(start, piece)
            summing.update(piece)
        return summing

    def _shorter(self) -> ObjectChanged:
        return ObjectChanged(f"{self.url}: its cache file is shorter than the object")

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.view.release()
            if self._mapping is not None:
                self._mapping.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)  # and with it every lock of this process on the file
        self.fd = -1
