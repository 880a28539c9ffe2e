"""Watching the files a model's bytes come from for changes (inotify through ctypes, and fstat): its
shards, and the fallback copies it serves from.

Each shard is watched through its open descriptor (/proc/self/fd/N), so the watch is on the very
file that was validated and mapped, even if its path was replaced in between. Events are read
without blocking: the gate drains them before it hands out a tensor's bytes, so a change that
finished before a request reached the daemon (or a call the library) is known when it is answered.

Any change the kernel reports of a file is taken for a change of its bytes (Change.CONTENT): a
new size, mtime or ctime, and every inotify event but a move or a deletion (an IN_ATTRIB as the
file's status tells, below). inotify does not see writes through a shared mapping; the kernel
moves the file's mtime and ctime at the first such write to each clean page, so check() also
compares the shard's size and times with what was last seen. The mtime can be set back (utime);
the ctime cannot, but a chmod moves it as a write does, and nothing tells the two apart (the
inode's change counter, statx's STATX_CHANGE_COOKIE, is the kernel's own: not given to user
space), so a chmod, a chown or a touch is a change too. One ctime move is told apart: one with a
new link count and nothing else (the file unlinked, or its path replaced by a rename: the mount
keeps serving the file it validated).
Not seen: writes to pages a shared mapping has dirtied already and that were not yet written back
(no fault, so no new time; see docs/guarantees.md).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import itertools
import logging
import os
import select
import struct
import threading
import time
import weakref
from collections.abc import Hashable, Iterable

from ..fs.syscalls import libc

log = logging.getLogger(__name__)

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_MOVE_SELF = 0x800
IN_DELETE_SELF = 0x400
IN_Q_OVERFLOW = 0x4000
IN_IGNORED = 0x8000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_MASK = IN_MODIFY | IN_ATTRIB | IN_MOVE_SELF | IN_DELETE_SELF
_CHECK_EVERY = 0.001  # seconds between looks at a watched shard's size and times
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len (of the name that follows; 0 for a watched file)


class Change(enum.Enum):
    CONTENT = "content"
    """Its bytes may have changed: written, truncated, or anything else of it changed (its ctime:
    a write through a shared mapping whose mtime was set back leaves nothing else)."""
    MOVED = "moved"
    DELETED = "deleted"


class _Inotify:
    """The process's one inotify instance, shared by every ShardWatch (each model's, each fallback's):
    closing an instance that held a watch waits for the kernel to tear it down (8 ms here; a model's
    close took 10 ms more than safetensors': docs/performance.md), removing a watch does not. A file
    watched by several (a shard of two models open at once) has one watch (the kernel's: one a file),
    let go of when the last lets go of it. Events are read without blocking by whichever asks first,
    and kept for each that watches their file."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.overflows = 0
        """How many times the kernel's queue overflowed: every watch then looks at its files."""
        self._reset()

    def _reset(self) -> None:
        self.fd = -1
        self._ready = select.poll()  # asked before every tensor read: cheaper than a read that fails
        self._watchers: dict[int, dict[int, list[int]]] = {}  # watch descriptor -> watcher -> masks not taken
        self._let_go: list[tuple[int, int]] = []  # of watchers nobody closed, let go of at the next use

    def add(self, path: bytes, watcher: int) -> int:
        """A watch on `path` for `watcher` (the instance made on first use); OSError when there is none."""
        with self._lock:
            if self.fd < 0:
                fd = libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
                if fd < 0:
                    raise _os_error("inotify_init1")
                self.fd = fd
                self._ready.register(fd, select.POLLIN)
            wd = int(libc.inotify_add_watch(self.fd, path, _MASK))
            if wd < 0:
                raise _os_error("inotify_add_watch")
            self._watchers.setdefault(wd, {}).setdefault(watcher, [])
            return wd

    def remove(self, watcher: int, wds: Iterable[int]) -> None:
        """`watcher` lets go of these watches (its events not yet taken dropped)."""
        with self._lock:
            self._remove([(wd, watcher) for wd in wds])

    def remove_later(self, watcher: int, wds: Iterable[int]) -> None:
        """remove(), from a finalizer (a model nobody closed): it may run in the middle of anything
        this thread does, holding the lock; done at the next use."""
        self._let_go.extend((wd, watcher) for wd in list(wds))

    def _remove(self, watches: Iterable[tuple[int, int]]) -> None:
        for wd, watcher in watches:
            watchers = self._watchers.get(wd)
            if watchers is None or watchers.pop(watcher, None) is None or watchers:
                continue
            del self._watchers[wd]
            if self.fd >= 0:
                libc.inotify_rm_watch(self.fd, wd)  # (a watch the kernel dropped already: EINVAL)

    def take(self, watcher: int, wds: Iterable[int]) -> list[tuple[int, int]]:
        """`watcher`'s events of these watches since it last took them, (watch descriptor, mask) in
        order; at once (nothing waited for) when there is none."""
        with self._lock:
            self._drain()
            found: list[tuple[int, int]] = []
            for wd in wds:
                watchers = self._watchers.get(wd, {})
                masks = watchers.get(watcher)
                if masks:
                    found += [(wd, mask) for mask in masks]
                    if any(mask & IN_IGNORED for mask in masks):  # the kernel dropped the watch: told, gone
                        del watchers[watcher]
                        if not watchers:
                            del self._watchers[wd]
                    else:
                        masks.clear()
            return found

    def _drain(self) -> None:
        if self._let_go:
            self._remove(self._let_go)
            self._let_go = []
        while self.fd >= 0 and self._ready.poll(0):
            try:
                data = os.read(self.fd, 64 << 10)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.EINTR:
                    continue
                raise
            position = 0
            while position + _EVENT.size <= len(data):
                wd, mask, _, length = _EVENT.unpack_from(data, position)
                position += _EVENT.size + length
                if mask & IN_Q_OVERFLOW:  # events were lost: what the sizes and times tell must do
                    self.overflows += 1
                    continue
                for masks in self._watchers.get(wd, {}).values():  # (a watch let go of meanwhile: nobody)
                    masks.append(mask)

    def forget(self) -> None:
        """In a forked child: the instance is its parent's (reading it would take the parent's events)."""
        if self.fd >= 0:
            os.close(self.fd)  # (the parent's still holds it: nothing is torn down)
        self._lock = threading.Lock()  # (a lock held in the parent at the fork stays held here)
        self._reset()


_inotify = _Inotify()
os.register_at_fork(after_in_child=_inotify.forget)
_watchers = itertools.count()


class ShardWatch:
    """inotify watches on open files, each known by a key of the caller's; changes() drains what
    happened, never blocking."""

    def __init__(self, files: Iterable[tuple[Hashable, int, os.stat_result]] = ()) -> None:
        """`files` is (key, open descriptor, status when validated) for every file to watch (add() more).

        What happened between the validation and the watch is found by the first changes(),
        which compares every file with its status when validated. Without inotify (none left,
        say: fs.inotify.max_user_watches), changes are still seen by the files' sizes and times,
        checked before each read; a warning says so.
        """
        self._shards: dict[int, list[Hashable]] = {}  # watch descriptor -> the files it watches
        self._fds: dict[Hashable, int] = {}
        self.paths: list[Hashable] = []
        self._seen: dict[Hashable, Status] = {}
        self._unchecked: list[Hashable] = []  # since validation: compared at the next changes()
        self._checked_at: dict[Hashable, float] = {}
        self._inotify = True  # until it fails: then sizes and times only
        self._overflows = _inotify.overflows
        self._watcher = next(_watchers)
        self._closer = weakref.finalize(self, _inotify.remove_later, self._watcher, self._shards.keys())
        for key, fd, st in files:
            self.add(key, fd, st)

    @property
    def _watching(self) -> bool:
        return self._inotify and bool(self._shards)

    def add(self, key: Hashable, fd: int, validated: os.stat_result) -> None:
        """Watch one more open file (its status when validated: a change since is told by changes())."""
        self._fds[key] = fd
        self.paths.append(key)
        self._seen[key] = _times_of(validated)
        self._unchecked.append(key)
        self._checked_at[key] = 0.0
        if not self._inotify:
            return
        try:
            wd = _inotify.add(f"/proc/self/fd/{fd}".encode(), self._watcher)
            self._shards.setdefault(wd, []).append(key)
        except OSError as exc:
            log.warning(
                "cannot watch the shards with inotify (%s: %s): changes are seen by size and times only", key, exc
            )
            self.close()
            self._inotify = False

    def fileno(self) -> int:
        """The inotify descriptor to wait on; -1 when there is none."""
        return _inotify.fd if self._watching else -1

    def check(self, path: Hashable, *, at_once: bool = False) -> list[Change]:
        """What changed in shard `path` since it was last seen (by its size and times): a new size,
        mtime or ctime is a change of its bytes (a write whose mtime was set back leaves only the
        ctime). `at_once`: look now, even within a millisecond of the last look."""
        if self._watching and not at_once and path in self._checked_at:
            # inotify tells of every write but those through a mapping: for those (whose first
            # write to a clean page alone moves the mtime anyway) a look each millisecond will do.
            moment = time.monotonic()
            if moment - self._checked_at[path] < _CHECK_EVERY:
                return []
            self._checked_at[path] = moment
        fd = self._fds.get(path)
        if fd is None:  # not a file watched here (an object in a store: its ETag tells)
            return []
        now = _times(fd)
        before = self._seen[path]
        if now == before:
            return []
        self._seen[path] = now
        return [Change.CONTENT] if _bytes_may_differ(before, now) else []

    def changes(self) -> list[tuple[Hashable, Change]]:
        """Every change reported since the last call, in order; [] at once when there is none."""
        found: list[tuple[Hashable, Change]] = []
        if self._unchecked:  # between validation and the watch, nothing reported it: compare now
            unchecked, self._unchecked = self._unchecked, []
            found.extend((path, change) for path in unchecked for change in self.check(path, at_once=True))
        if not self._watching:
            return found
        events = _inotify.take(self._watcher, list(self._shards))
        if _inotify.overflows != self._overflows:
            self._overflows = _inotify.overflows
            log.warning(
                "inotify's queue overflowed (fs.inotify.max_queued_events): changes to the shards "
                "since are looked for by their sizes and times"
            )
            found.extend((path, change) for path in self.paths for change in self.check(path, at_once=True))
        for wd, mask in events:
            for path in self._shards.get(wd, ()):
                if mask & IN_ATTRIB:  # a chmod, a touch, a hidden write, or a link count: its status tells
                    found.extend((path, change) for change in self.check(path, at_once=True))
                found.extend((path, change) for change in _changes_of(mask))
            if mask & IN_IGNORED:
                self._shards.pop(wd, None)  # the watch is gone (file deleted, or its file system unmounted)
        for path in {path for path, _ in found}:
            self._seen[path] = _times(self._fds[path])  # reported: check() need not say it again
        return found

    def close(self) -> None:
        self._closer.detach()
        if self._shards:
            _inotify.remove(self._watcher, list(self._shards))
            self._shards.clear()


def _os_error(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


Status = tuple[int, int, int, int]
"""What tells a file's changes: its size, mtime_ns, ctime_ns and link count."""


def _times(fd: int) -> Status:
    return _times_of(os.fstat(fd))


def _times_of(st: os.stat_result) -> Status:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_nlink


def _bytes_may_differ(before: Status, now: Status) -> bool:
    """A new size, mtime or ctime; but a ctime moved with the link count and nothing else is an
    unlink, a link, or the path replaced by a rename (the bytes are the same)."""
    if now[:2] != before[:2]:
        return True
    return now[2] != before[2] and now[3] == before[3]


def _changes_of(mask: int) -> list[Change]:
    changes = []
    if mask & IN_MODIFY:
        changes.append(Change.CONTENT)
    if mask & IN_MOVE_SELF:
        changes.append(Change.MOVED)
    if mask & IN_DELETE_SELF:
        changes.append(Change.DELETED)
    return changes
