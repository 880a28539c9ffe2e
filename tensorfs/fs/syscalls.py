"""The few system calls Python's os module lacks, through ctypes: one libc handle for all of tensorfs.

ctypes releases the GIL for the call, which is why even madvise goes through here (mmap.madvise holds it).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import struct

libc = ctypes.CDLL(None, use_errno=True)
"""The C library of this process (calls through it let the GIL go)."""

_SYS_OPENAT2 = 437  # the same number on every architecture (the generic syscall table)
RESOLVE_NO_XDEV = 0x01
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_BENEATH = 0x08

_syscall = libc.syscall
_syscall.restype = ctypes.c_long

libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
libc.fallocate.restype = ctypes.c_int
libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
libc.madvise.restype = ctypes.c_int
libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p)
libc.mincore.restype = ctypes.c_int
libc.inotify_init1.argtypes = (ctypes.c_int,)
libc.inotify_add_watch.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32)
libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
libc.mmap.restype = ctypes.c_void_p
libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
libc.munmap.restype = ctypes.c_int
libc.renameat2.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint)
libc.renameat2.restype = ctypes.c_int
_MAP_FAILED = ctypes.c_void_p(-1).value
FALLOC_FL_KEEP_SIZE = 1
FALLOC_FL_PUNCH_HOLE = 2
RENAME_NOREPLACE = 1

_openat2_missing = False


def openat2(dir_fd: int, path: str | bytes, flags: int, resolve: int) -> int:
    """openat2(2): `path` opened relative to `dir_fd` with RESOLVE_* restrictions; OSError as os.open's.

    OSError(ENOSYS) on a kernel older than 5.6 (the caller then walks the path itself).
    """
    global _openat2_missing
    if _openat2_missing:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))
    name = os.fsencode(path)
    how = struct.pack("QQQ", flags, 0, resolve)  # struct open_how: flags, mode, resolve
    fd = _syscall(_SYS_OPENAT2, ctypes.c_int(dir_fd), ctypes.c_char_p(name), ctypes.c_char_p(how), len(how))
    if fd < 0:
        code = ctypes.get_errno()
        if code == errno.ENOSYS:
            _openat2_missing = True
        raise OSError(code, os.strerror(code), os.fsdecode(name))
    return int(fd)


def renameat2(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str, flags: int) -> None:
    """renameat2(2): `src` (in the directory `src_dir_fd`) renamed to `dst` (in `dst_dir_fd`), neither
    name's symlink followed; with RENAME_NOREPLACE, EEXIST if `dst` exists. OSError as os.rename's
    (EINVAL where the file system cannot honour `flags`)."""
    if libc.renameat2(src_dir_fd, os.fsencode(src), dst_dir_fd, os.fsencode(dst), flags) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), src, None, dst)


def fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    """fallocate(2); OSError when it fails (EOPNOTSUPP where the file system has none)."""
    if libc.fallocate(fd, mode, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free the blocks of [offset, offset + length) of a file, keeping its size (it reads as zeros there)."""
    fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, length)


def map_private(fd: int, size: int) -> int:
    """mmap(2) of the first `size` bytes of `fd`, private and writable (copy on write: no write reaches
    the file); its address. Unlike Python's mmap, no duplicate of the descriptor is kept."""
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address is None or address == _MAP_FAILED:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(address)


def unmap(address: int, size: int) -> None:
    libc.munmap(address, size)
