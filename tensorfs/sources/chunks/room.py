"""The room a cache directory has for chunks: the lock every process takes to make it (room.lock),
the blocks its object files hold on disk against its bound, and the eviction of least recently used
chunks that nobody uses, here or in any other process (the lock protocol: locks.py). What waits for
room, and for how long, is the cache's (chunks.py): here is how room is measured and made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from ...errors import RemoteError
from ...fs.guarded import UnsafeLocation, check_private_file
from ...fs.syscalls import punch_hole
from ...utils.units import human_size
from ..fetching import COUNTERS
from .full import CacheFull
from .locks import holders, in_use_elsewhere, let_go_chunk, let_go_room, take_room, take_to_evict
from .objects import CachedObject
from .records import Records

__all__ = ["OBJECTS_DIR", "ROOM_LOCK", "Room"]

log = logging.getLogger("tensorfs.sources.chunkcache")  # one logger for the cache's messages

OBJECTS_DIR = "objects"
ROOM_LOCK = "room.lock"
_BLOCK = 4096  # the unit a file system allocates in

Evicted = list[tuple[int, int, int]]
"""Chunks of one object, as (chunk, chunk size, its bytes)."""


class Room:
    """One cache directory's room for chunks, as this process makes it (a cache's own)."""

    def __init__(
        self,
        directory: Path,
        limit: int | None,
        records: Records,
        objects: Mapping[str, CachedObject],
        lock: threading.RLock,
    ) -> None:
        self.directory = directory
        self.limit = limit
        self.records = records
        self._objects = objects  # the cache's objects open in this process, by id (its own mapping)
        self.condition = threading.Condition(lock)  # told when pinned chunks are let go, or rows saved
        self._waiting = 0
        self._freeings = 0  # chunks let go, fetches ended, rows saved: times room may have come
        self._freeings_lock = threading.Lock()
        self._fd = -1  # the lock file every process takes to make room (a bounded cache)
        self._pid = 0
        self._mutex = threading.Lock()  # and its threads one at a time (a lock file's lock is the process's)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Held (by one thread of one process at a time) while room is made and a chunk's blocks taken."""
        self.records.db()
        with self._mutex:
            if self._fd < 0 or self._pid != os.getpid():
                path = self.directory / ROOM_LOCK
                try:
                    check_private_file(path, what="the cache's lock file")
                    self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                except (OSError, UnsafeLocation) as exc:
                    why = getattr(exc, "strerror", None) or exc
                    raise RemoteError(f"cannot use the cache {self.directory}: {why}") from None
                self._pid = os.getpid()
            fd = self._fd
            take_room(fd)
            try:
                yield
            finally:
                let_go_room(fd)

    def fits(self, requester: CachedObject, nbytes: int) -> bool:
        """Whether `nbytes` more fit under the bound, once least recently used chunks that nobody
        uses are evicted to make room (call with the room lock held)."""
        if self.limit is None:
            return True
        need = -(-nbytes // _BLOCK) * _BLOCK  # whole blocks
        held = self.disk_usage()
        if held + need > self.limit:
            slack = min(self.limit // 16, 8 * requester.chunk_size)
            self.evict(held + need - self.limit + slack)
            held = self.disk_usage()
        return held + need <= self.limit

    def take(self, requester: CachedObject, chunks: list[int]) -> None:
        """Take the blocks of `chunks` of `requester`'s file, all or none (call with the room lock held;
        CacheFull when the disk has no room). Blocks taken before one was refused are given back, as
        an eviction gives them back, unless a reader here holds their chunk or fetches it (another
        claim took them): kept, they were held by no chunk, present or waiting to be recorded, that
        anything could evict, and a disk they filled refused every read."""
        taken: list[int] = []
        try:
            for chunk in chunks:
                requester.file.allocate(chunk * requester.chunk_size, requester.chunk_bytes(chunk))
                taken.append(chunk)
        except CacheFull:
            for chunk in taken:
                if requester.take(chunk):
                    try:
                        requester.file.free(chunk * requester.chunk_size, requester.chunk_bytes(chunk))
                    finally:
                        requester.taken(chunk, True)
            raise

    def wait(self, left: float) -> None:
        """Wait (the cache's lock held) until chunks are let go or saved, or a moment passes."""
        self._waiting += 1
        try:
            self.condition.wait(max(0.0, min(left, 0.1)))
        finally:
            self._waiting -= 1

    @property
    def freeings(self) -> int:
        """How many times room may have come (see freed): a claim that found none, and sees this
        unchanged since it looked, knows nothing was let go meanwhile."""
        with self._freeings_lock:
            return self._freeings

    @property
    def waiting(self) -> int:
        """Fetches waiting for chunks in use to be let go."""
        return self._waiting

    def freed(self) -> None:
        """Chunks were let go, a fetch ended or rows were saved: a fetch waiting for room may find it now."""
        with self._freeings_lock:
            self._freeings += 1
        if self._waiting:
            with self.condition:
                self.condition.notify_all()

    def disk_usage(self) -> int:
        """Bytes the object files hold on disk (their blocks): every process's chunks, recorded or not."""
        total = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self.directory / OBJECTS_DIR) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total

    def what_holds(self, requester: CachedObject) -> str:
        """Why no room could be made: what holds the cache, in words (against its bound, or its disk's room)."""
        mine = sum(cached.pinned_bytes() for cached in self._objects.values())
        others = sorted(
            {pid for oid in self._in_use_by_others() for pid in holders(self.directory / OBJECTS_DIR / oid)}
        )
        by = f"readers in this process hold {human_size(mine)}" if mine else "no reader of this process holds any"
        if others:
            by += f"; processes {', '.join(map(str, others))} use it too (their chunks in use stay)"
        bound = f"{human_size(self.limit)}, " if self.limit is not None else "its disk full, "
        remedy = "raise --cache-size" if self.limit is not None else "make room on its disk"
        return (
            f"{requester.version.url}: no room in the cache {self.directory} ({bound}"
            f"{human_size(self.disk_usage())} on disk) for another chunk of {human_size(requester.chunk_size)}: "
            f"{by}; {remedy}, or read less at once"
        )

    def _in_use_by_others(self) -> list[str]:
        found = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.directory / OBJECTS_DIR) as entries:
            for entry in entries:
                if in_use_elsewhere(self.directory / OBJECTS_DIR / entry.name):
                    found.append(entry.name)
        return found

    def evict(self, wanted: int) -> int:
        """Punch out least recently used chunks, `wanted` bytes' worth if there are; the bytes freed
        (call with the room lock held)."""
        freed, kept = 0, 0  # kept: rows passed over (in use), which the next query skips by its offset
        while freed < wanted:
            rows = self.records.least_used(kept)
            if not rows:
                break
            by_object: dict[str, Evicted] = {}
            for oid, chunk, chunk_size, nbytes in rows:
                by_object.setdefault(oid, []).append((chunk, chunk_size, nbytes))
            for oid, chunks in by_object.items():
                evicted = self.evict_from(oid, chunks, wanted - freed)
                freed += sum(nbytes for _, _, nbytes in evicted)
                COUNTERS.add(evicted_chunks=len(evicted), evicted_bytes=sum(nbytes for _, _, nbytes in evicted))
                kept += len(chunks) - len(evicted)
                if freed >= wanted:
                    break
        return freed

    def evict_from(self, oid: str, chunks: Evicted, wanted: int) -> Evicted:
        """Evict the object's chunks (chunk, chunk size, its bytes; least recently used first) that
        nobody uses now, up to `wanted` bytes: those evicted (call with the room lock held)."""
        ours = self._objects.get(oid)
        if ours is not None:
            fd, close = ours.file.fd, False
        else:
            try:
                fd, close = os.open(self.directory / OBJECTS_DIR / oid, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC), True
            except FileNotFoundError:  # the file is gone: so are its chunks
                self.records.forget_chunks(oid)
                return chunks
            except OSError as exc:
                log.warning("could not evict from the cache file %s: %s", oid, exc.strerror)
                return []
        evicted: Evicted = []
        try:
            for chunk, chunk_size, nbytes in chunks:
                if ours is not None and not ours.take(chunk):
                    continue  # pinned, or being fetched, here
                gone = False
                try:
                    if not take_to_evict(fd, chunk):
                        continue  # another process answers from it now
                    try:
                        # Its record first, before the lock goes: whoever takes the lock next sees it gone (and a
                        # chunk not punched after all is only blocks left over, never a hole that is recorded).
                        with self.records.transaction() as db:
                            db.execute("DELETE FROM chunks WHERE object=? AND chunk=?", (oid, chunk))
                        gone = True
                        punch_hole(fd, chunk * chunk_size, chunk_size)
                    finally:
                        let_go_chunk(fd, chunk)
                finally:
                    if ours is not None:
                        ours.taken(chunk, gone)
                evicted.append((chunk, chunk_size, nbytes))
                if sum(n for _, _, n in evicted) >= wanted:
                    break
        except OSError as exc:
            log.warning("could not evict from the cache file %s: %s", oid, exc.strerror)
        finally:
            if close:
                os.close(fd)
        return evicted

    def close(self) -> None:
        with self._mutex:
            if self._fd >= 0 and self._pid == os.getpid():
                with contextlib.suppress(OSError):
                    os.close(self._fd)
            self._fd = -1
