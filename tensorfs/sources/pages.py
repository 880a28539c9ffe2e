"""Bringing a shard's pages into memory on a worker thread, so the trio thread never waits on a disk.

A read is answered with a slice of the shard's mmap, and the kernel copies from it on pyfuse3's
one trio thread: a page not yet in memory there would stall every other request while the disk
seeks. So before a range is answered it is populated (MADV_POPULATE_READ: read in and mapped) on
a worker thread. mmap.madvise holds the GIL through the call, so madvise is called through ctypes,
which lets it go.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os

from ..syscalls import libc

log = logging.getLogger(__name__)

MADV_WILLNEED = 3
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux 5.14+
PAGE = mmap.PAGESIZE

_madvise = libc.madvise
_populate_supported = True
_mincore = libc.mincore
RESIDENT_CHECK_MAX = 1 << 20
"""Ranges up to this size are asked about (mincore) before a worker thread is sent to read them in."""


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

    def __init__(self, view: memoryview) -> None:
        self.size = len(view)
        # The address only: no buffer export is kept, the model owns the mapping for the mount's life.
        self._address = _buffer_address(view) if self.size else 0
        if self.size:
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
