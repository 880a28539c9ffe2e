"""Bringing a shard's pages into memory on a worker thread, so the trio thread never waits on a disk.

A read is answered with a slice of the shard's mmap, and the kernel copies from it on pyfuse3's
one trio thread: a page not yet in memory there would stall every other request while the disk
seeks. So before a range is answered it is populated (MADV_POPULATE_READ: read in and mapped) on
a worker thread. mmap.madvise holds the GIL through the call, so madvise is called through ctypes,
which lets it go.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import threading

from ..fs.syscalls import libc

log = logging.getLogger(__name__)

MADV_WILLNEED = 3
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux 5.14+
PAGE = mmap.PAGESIZE

_madvise = libc.madvise
_populate_supported = True
_mincore = libc.mincore
RESIDENT_CHECK_MAX = 1 << 20
"""Ranges up to this size are asked about (mincore) before a worker thread is sent to read them in."""
_LOW_BIT = bytes(byte & 1 for byte in range(256))  # mincore's bit of a page in memory; the others are reserved
HANDOVER_UNIT = 2 << 20
"""The pages a mount has served are let go 2 MiB at a time, aligned: the page cache holds a file's bytes
in folios of up to 2 MiB here (huge-page advice, large folios), and a folio only partly in a range
that is dropped stays (docs/performance.md)."""


class _PyBuffer(ctypes.Structure):
    _fields_ = (
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    )


_get_buffer = ctypes.pythonapi.PyObject_GetBuffer
_get_buffer.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
_release_buffer = ctypes.pythonapi.PyBuffer_Release
_release_buffer.argtypes = (ctypes.POINTER(_PyBuffer),)


def _buffer_address(view: memoryview) -> int:
    """Where a (read-only) buffer's bytes are: ctypes' from_buffer wants a writable one."""
    buffer = _PyBuffer()
    if _get_buffer(view, ctypes.byref(buffer), 0) != 0:
        raise OSError("no buffer")
    try:
        return int(buffer.buf or 0)
    finally:
        _release_buffer(ctypes.byref(buffer))


class Pages:
    """The pages of one mapping (a shard file, or an object's cache file)."""

    def __init__(self, view: memoryview, *, advise: bool = True) -> None:
        self.size = len(view)
        # The address only: no buffer export is kept, the model owns the mapping for the mount's life.
        self._address = _buffer_address(view) if self.size else 0
        if self.size and advise:
            # Huge pages where the page cache has large folios: fewer pages for the kernel to pin
            # and copy from per reply (docs/performance.md). Advice only.
            _madvise(self._address, self.size, MADV_HUGEPAGE)

    def resident(self, start: int, end: int) -> bool:
        """Whether every page of [start, end) is in the page cache (mincore: no wait, no read).

        A small read of a file already cached is then answered at once on the trio thread: its
        copy takes a minor fault at most, where a hop to a worker thread costs far more."""
        start = max(0, start - start % PAGE)
        end = min(end, self.size)
        if end <= start:
            return True
        if end - start > RESIDENT_CHECK_MAX:
            return False
        pages = -(-(end - start) // PAGE)
        vector = ctypes.create_string_buffer(pages)
        if _mincore(self._address + start, end - start, vector) != 0:
            return False
        return all(byte & 1 for byte in vector.raw)

    def let_go(self, fd: int, start: int, end: int) -> None:
        """Drop [start, end) of the mapped file (`fd`) from memory: unmapped here (MADV_DONTNEED), then out
        of the page cache where nobody else maps it and it is clean (POSIX_FADV_DONTNEED: dirty pages
        stay, to be written back). The file keeps the bytes; a later read brings them in again."""
        start = max(0, start - start % PAGE)
        end = min(end, self.size)
        if end <= start:
            return
        _madvise(self._address + start, end - start, MADV_DONTNEED)
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)

    def resident_bytes(self) -> int:
        """How many bytes of the whole mapping are in the page cache (mincore, whole pages)."""
        if not self.size:
            return 0
        vector = ctypes.create_string_buffer(-(-self.size // PAGE))
        if _mincore(self._address, self.size, vector) != 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return vector.raw.translate(_LOW_BIT).count(1) * PAGE

    def populate(self, start: int, end: int) -> bool:
        """Read [start, end) of the shard into memory and map it; False if that failed (e.g. truncated)."""
        global _populate_supported
        start = max(0, start - start % PAGE)
        end = min(end, self.size)
        if end <= start:
            return True
        advice = MADV_POPULATE_READ if _populate_supported else MADV_WILLNEED
        if _madvise(self._address + start, end - start, advice) == 0:
            return True
        code = ctypes.get_errno()
        if code == errno.EINVAL and advice == MADV_POPULATE_READ:
            _populate_supported = False  # an older kernel: ask for readahead instead
            log.info("MADV_POPULATE_READ unsupported; prefetching with MADV_WILLNEED")
            return self.populate(start, end)
        log.debug("madvise(%d, %d) of a shard failed: %s", start, end - start, os.strerror(code))
        return False


class Handover:
    """What of a mapping a mount has served, by aligned unit: once every byte of a unit has gone to the
    kernel (which keeps it in the mounted file's own pages), the source's copy of it is let go, so the
    page cache holds each byte once. Bytes served twice (the same range through a tensor's file and
    the synthesized model) count twice: a unit let go early costs a read from disk, never a wrong byte."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._served: dict[int, int] = {}  # unit -> bytes served of it since it was last let go
        self._whole: list[tuple[int, int]] = []  # units served whole, not taken yet
        self._lock = threading.Lock()  # counted on the serving thread, taken on another

    def served(self, start: int, end: int) -> list[tuple[int, int]]:
        """Count [start, end) served; the ranges of the units it completed, kept until taken()."""
        whole = []
        unit = HANDOVER_UNIT
        for first in range(start - start % unit, min(end, self.size), unit):
            last = min(first + unit, self.size)
            count = self._served.get(first, 0) + min(end, last) - max(start, first)
            if count >= last - first:
                self._served.pop(first, None)
                whole.append((first, last))
            else:
                self._served[first] = count
        if whole:
            with self._lock:
                self._whole += whole
        return whole

    def taken(self) -> list[tuple[int, int]]:
        """The units served whole since the last call, to let go of (off the thread that serves)."""
        with self._lock:
            whole, self._whole = self._whole, []
        return whole
