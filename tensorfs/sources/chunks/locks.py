"""The chunk cache's lock protocol, in one place: which byte of an object's cache file each lock is,
what each means, and how a cache file is opened and held.

Several processes share one cache directory safely with open file description locks (F_OFD_SETLK:
a POSIX lock would be dropped when this process closes any other descriptor of the file, and
another process would then evict chunks from under our mapping, whose holes read as zeros):

- byte 0 (IN_USE) is held shared by every process that has the file open, and exclusively only to
  remove the file (`cache prune`): a file in use is never removed;
- each chunk's presence byte is held shared by a process while it answers from the chunk (pinned),
  and exclusively, briefly, by a process that evicts it: a chunk anyone answers from is never
  evicted, and a process that takes a chunk's presence byte anew looks at its record again (it may
  have been evicted, or fetched again by another process, meanwhile);
- each chunk's fetch byte is held exclusively by the one process that fetches the chunk, until the
  chunk is recorded: another that wants it waits, then finds it recorded.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from pathlib import Path

from ...errors import RemoteError
from ...utils.units import human_size

__all__ = [
    "can_remove",
    "hold_chunk",
    "holders",
    "in_use_elsewhere",
    "let_go_chunk",
    "let_go_fetch",
    "let_go_file",
    "let_go_room",
    "open_held",
    "take_fetch",
    "take_room",
    "take_to_evict",
]

_IN_USE = 0


def _presence_byte(chunk: int) -> int:
    return 1 + 2 * chunk


def _fetch_byte(chunk: int) -> int:
    return 2 + 2 * chunk


def _lock(fd: int, kind: int, start: int, *, wait: bool = False) -> bool:
    """Lock one byte of a cache file (F_RDLCK, F_WRLCK, or F_UNLCK); whether it was had."""
    flock = struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0)  # type, whence, start, length, pid (0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, flock)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def hold_chunk(fd: int, chunk: int) -> bool:
    """Hold a chunk against eviction while this process answers from it (shared); False when another
    process is evicting it just now."""
    return _lock(fd, fcntl.F_RDLCK, _presence_byte(chunk))


def let_go_chunk(fd: int, chunk: int) -> None:
    """Let go of what hold_chunk() (or take_to_evict()) held."""
    with contextlib.suppress(OSError):
        _lock(fd, fcntl.F_UNLCK, _presence_byte(chunk))


def take_to_evict(fd: int, chunk: int) -> bool:
    """Take a chunk to evict it (exclusive): False while any process answers from it."""
    return _lock(fd, fcntl.F_WRLCK, _presence_byte(chunk))


def take_fetch(fd: int, chunk: int) -> bool:
    """Be the one process that fetches a chunk (exclusive, until it is recorded); False if another is."""
    return _lock(fd, fcntl.F_WRLCK, _fetch_byte(chunk))


def let_go_fetch(fd: int, chunk: int) -> None:
    with contextlib.suppress(OSError):
        _lock(fd, fcntl.F_UNLCK, _fetch_byte(chunk))


def can_remove(fd: int) -> bool:
    """Whether no process has the file open (held while it is removed: then let_go_file())."""
    return _lock(fd, fcntl.F_WRLCK, _IN_USE)


def let_go_file(fd: int) -> None:
    with contextlib.suppress(OSError):
        _lock(fd, fcntl.F_UNLCK, _IN_USE)


def in_use_elsewhere(path: Path) -> bool:
    """Whether a process has the cache file at `path` open (this one's descriptors count as any)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        if not can_remove(fd):
            return True
        let_go_file(fd)
        return False
    finally:
        os.close(fd)


def holders(path: Path) -> list[int]:
    """The processes (of those this one may look at) that have `path` open: for messages."""
    found = []
    for process in Path("/proc").iterdir():
        if not process.name.isdigit() or int(process.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            for fd in (process / "fd").iterdir():
                if os.readlink(fd) == str(path):
                    found.append(int(process.name))
                    break
    return sorted(found)


def open_held(path: Path, size: int) -> int:
    """Open (or make, sized `size`: sparse) a cache file and hold it (IN_USE shared, while mapped:
    nobody removes it).

    A file removed by `cache prune` while we waited for the lock is left for a new one. RemoteError,
    with nothing left behind, when the file cannot be made (a file system that cannot hold the size).
    """
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            made = True
        except FileExistsError:
            try:
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # removed meanwhile
            except OSError as exc:
                raise RemoteError(f"cannot use the cache file {path}: {exc.strerror}") from None
            made = False
        except OSError as exc:
            raise RemoteError(f"cannot make the cache file {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or st.st_mode & 0o077:
                raise RemoteError(f"the cache file {path} is not this user's alone: remove it")
            _lock(fd, fcntl.F_RDLCK, _IN_USE, wait=True)
            if os.stat(path, follow_symlinks=False).st_ino != st.st_ino:
                os.close(fd)
                continue
            if st.st_size != size:
                os.ftruncate(fd, size)  # sparse: nothing is allocated yet
            return fd
        except FileNotFoundError:
            os.close(fd)
            continue
        except OSError as exc:
            os.close(fd)
            if made:
                with contextlib.suppress(OSError):
                    path.unlink()
            raise RemoteError(
                f"cannot make a cache file of {human_size(size)} in {path.parent}: {exc.strerror}"
            ) from None
        except BaseException:
            os.close(fd)
            raise


def take_room(fd: int) -> None:
    """Take the cache's room lock (its own file's byte 0; blocking): held while room is made and a
    chunk's blocks taken, so that every process on the cache keeps to one bound."""
    _lock(fd, fcntl.F_WRLCK, 0, wait=True)


def let_go_room(fd: int) -> None:
    _lock(fd, fcntl.F_UNLCK, 0)
