"""The local cache of remote objects: one sparse file per object version, what is present recorded in
SQLite; this process's view of it (ChunkCache), one object's file in it (objects.py), what is
recorded (records.py), its room and what is evicted for it (room.py), the locks every process takes
in it (locks.py).

Layout of a cache directory (this user's alone; shared safely by several processes):

    objects.sqlite   objects (URL, ETag, size, header, chunk size), chunks present, every chunk's
                     checksums as it first came, models resolved
    objects/ID       one sparse file per object version (ID: sha256 of URL, ETag and size)
    room.lock        taken by whoever makes room, in any process

No byte is taken from the cache that is not the object's:

- A chunk is written only inside its own range: a server that sends more than was asked is an
  error, and a failed fetch frees only its own chunk.
- Each chunk's checksums are computed as it arrives and kept with the object for as long as the
  object is cached, also after the chunk is evicted: the same version must always give the same
  bytes, so a chunk fetched again that sums otherwise is refused (a store that serves other bytes
  under one ETag), and so is a chunk whose file bytes no longer sum to them (the file changed on
  disk: a miss, fetched again, never data). The checksum is a CRC-32C (what changes by accident
  shows, at a small cost: the processor's own instruction, three times zlib's CRC-32), and a
  SHA-256 too where a manifest is in force: a store that means to send other bytes under one ETag
  cannot forge that one. Once any process kept a chunk's SHA-256, every process checks the chunk
  against it, whether or not a manifest is in force there: bytes fetched again are the very bytes
  that came first, which, under a manifest, are the bytes it verified.
- A process checks every chunk it did not fetch itself before it first uses it, and again whenever
  the chunk was recorded anew since (evicted and fetched again by another process): each record
  carries a token of the fetch that made it.
- A chunk counts as present only once its bytes are written and flushed to disk (fdatasync) and its
  row committed: a process killed mid-chunk leaves a chunk that is fetched again, never a hole
  taken for data.

The cache is bounded by the blocks its files hold on disk (least recently used chunks go first,
their bytes freed by punching holes). A chunk's blocks are allocated before it is fetched, under a
lock that every process takes to make room, so several processes on one cache keep to one bound.
A hole reads as zeros through a mapping, so a chunk is never evicted while anything may answer from
it (the lock protocol: locks.py).

The cache knows nothing of stores: an object is opened with the way to fetch its bytes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import RemoteError
from ...fs.guarded import UnsafeLocation, make_private_file, private_directory
from ..store import default_cache_dir
from .full import CacheFull, NoRoomNow, disk_full, full
from .locks import can_remove, in_use_elsewhere
from .objects import SAVE_AT_LEAST_EVERY, CachedObject, Fetch
from .records import DB_NAME, ChunkSum, Pending, Records
from .refetched import Refetched
from .room import OBJECTS_DIR, Room

if TYPE_CHECKING:
    from ..store import ObjectVersion

__all__ = ["OBJECTS_DIR", "CacheEntry", "ChunkCache", "default_cache_dir", "object_id"]

log = logging.getLogger("tensorfs.sources.chunkcache")  # one logger for the cache's messages


def object_id(url: str, etag: str, size: int) -> str:
    return hashlib.sha256(f"{url}\0{etag}\0{size}".encode("utf-8", "surrogateescape")).hexdigest()[:32]


@dataclass(frozen=True)
class CacheEntry:
    """An object in the cache, as `tensorfs cache ls` shows it."""

    id: str
    url: str
    etag: str
    size: int
    cached: int
    """Bytes present (whole chunks)."""
    used: float
    in_use: bool
    """Mapped by a process (a mount, a command) now."""


class ChunkCache:
    """The cache of remote objects' chunks in one directory, as this process uses it."""

    def __init__(self, directory: Path, limit: int | None = None) -> None:
        self.directory = directory
        self.limit = limit
        self.records = Records(directory, self.check_directory)
        self._lock = threading.RLock()  # the objects open here, what waits to be recorded, room
        self._checked_directory = False
        self._objects: dict[str, CachedObject] = {}  # open in this process, by id
        self._pending: Pending = {}  # chunks written, not yet recorded
        self._recording = 0  # saves under way that record chunks (taken out of _pending, not yet recorded)
        self._saving = threading.Lock()
        self._touched: dict[str, set[int]] = {}  # chunks served, their use not yet committed
        self._full_said = False  # a save found no room for its rows, and said so
        self._saved_at = time.monotonic()
        self._timer: threading.Timer | None = None  # a save to come, for chunks written meanwhile
        self.room = Room(directory, limit, self.records, self._objects, self._lock)
        """The cache's room: its lock, its bound, what is evicted for it."""
        self.refetched: dict[str, Refetched] = {}
        """Chunks refused in this process and had again, by object (refetched.py): kept while it runs."""

    def check_directory(self) -> None:
        """The directory must be this user's alone (UnsafeLocation, a RemoteError, if not): made if missing."""
        if self._checked_directory:
            return
        try:
            private_directory(self.directory, what="the cache")
            private_directory(self.directory / OBJECTS_DIR, what="the cache")
            make_private_file(self.directory / DB_NAME, what="the cache database")
        except UnsafeLocation as exc:
            raise RemoteError(str(exc)) from None
        self._checked_directory = True

    def db(self) -> Any:
        """The database, opened (RemoteError when the cache cannot be used)."""
        return self.records.db()

    # -- objects ---------------------------------------------------------------------------
    def open_object(self, version: ObjectVersion, header: bytes | None, chunk_size: int, fetch: Fetch) -> CachedObject:
        """The cache file of `version`, made if new, mapped, and held (shared lock) until closed;
        `fetch(start, end, write)` gets bytes of it from where it is stored.

        `header` (the object's first 8 + N bytes, for --offline) is recorded with a new object.
        RemoteError when the file cannot be made (nothing is left behind then).
        """
        oid = object_id(version.url, version.etag, version.size)
        with self._lock:
            found = self._objects.get(oid)
            if found is not None:
                found.users += 1
                return found
            known = self.records.chunk_size_of(oid)
            path = self.directory / OBJECTS_DIR / oid
            cached = CachedObject(self, oid, version, path, known or chunk_size, fetch)  # RemoteError: nothing made
            try:
                _, present, sums = self.records.object_opened(
                    oid, version.url, version.etag, version.size, version.mtime, cached.chunk_size, header
                )
            except BaseException:
                cached.close()
                raise
            cached.known(sums)
            cached.clear_orphans(set(present))
            self._objects[oid] = cached
            return cached

    def header_of(self, url: str, etag: str, size: int) -> tuple[bytes, float] | None:
        """The header cached of an object version, and its Last-Modified (for --offline)."""
        return self.records.header_of(object_id(url, etag, size))

    def remember_model(self, source: str, description: dict[str, Any]) -> None:
        self.records.remember_model(source, description)

    def recall_model(self, source: str) -> dict[str, Any] | None:
        return self.records.recall_model(source)

    # -- what is recorded --------------------------------------------------------------------
    def record(self, cached: CachedObject, chunk: int, nbytes: int, digest: ChunkSum, token: int) -> None:
        """A chunk written: it is recorded (for other processes, and after a crash) at the next save(),
        within SAVE_AT_LEAST_EVERY seconds however this process goes on (another that wants the chunk
        waits until it is recorded)."""
        with self._lock:
            self._pending.setdefault(cached.id, {})[chunk] = (nbytes, digest, token)
            due = time.monotonic() - self._saved_at > SAVE_AT_LEAST_EVERY
            if not due and self._timer is None:
                self._timer = threading.Timer(SAVE_AT_LEAST_EVERY, self._save_in_time)
                self._timer.name = "tensorfs-cache-save"
                self._timer.daemon = True
                self._timer.start()
        if due:  # nobody saved for a while: this thread does
            self.save()

    def _save_in_time(self) -> None:
        """What a process that fetched and then went quiet (no daemon saves for it) left to record."""
        with self._lock:
            self._timer = None
        self.save(wait=True)

    def pending(self, oid: str, chunk: int) -> bool:
        """Whether this process wrote the chunk and has not recorded it yet (it holds it: nobody evicts it)."""
        with self._lock:
            return chunk in self._pending.get(oid, ())

    def touch(self, cached: CachedObject, chunks: range) -> None:
        with self._lock:
            self._touched.setdefault(cached.id, set()).update(chunks)

    def save(self, *, wait: bool = False) -> bool:
        """Record what was written (flushed to disk first: the row never comes before the bytes) and used.

        The flush runs with no lock held, so fetches go on meanwhile; one save at a time: False when
        another thread saves just now (and this one did not), unless `wait`: then after it; False too
        when the disk had no room for the rows: the chunks wait to be saved again, as before.
        """
        if not self._saving.acquire(blocking=wait):
            return False
        try:
            with self._lock:
                pending, self._pending = self._pending, {}
                touched, self._touched = self._touched, {}
                self._saved_at = time.monotonic()
                written = {oid: self._objects.get(oid) for oid in pending}
                # A chunk of a file closed meanwhile cannot be flushed: it is not recorded (fetched again).
                pending = {oid: chunks for oid, chunks in pending.items() if written[oid] is not None}
                opened = [cached.file for cached in written.values() if cached is not None]
                files = [os.dup(file.fd) for file in opened if file.fd >= 0]
                self._recording += bool(pending)
            saved = True
            try:
                if pending or touched:
                    saved = self._commit(pending, touched, files)
            finally:
                if saved:
                    for oid, chunks in pending.items():  # recorded (or given up): others may fetch them now
                        cached = written[oid]
                        if cached is not None:
                            cached.recorded(chunks)
                with self._lock:
                    if not saved:
                        # No room for their rows: still this process's to record (their fetch locks
                        # held), evictable once recorded. Given up, their blocks would stay taken
                        # with nothing to evict them by, and a full disk would stay full.
                        for oid, chunks in pending.items():
                            self._pending.setdefault(oid, {}).update(chunks)
                        for oid, used in touched.items():
                            self._touched.setdefault(oid, set()).update(used)
                    self._recording -= bool(pending)
                    self.room.freed()
        finally:
            self._saving.release()
        return saved

    def _commit(self, pending: Pending, touched: dict[str, set[int]], files: list[int]) -> bool:
        """Flush the files, then write the rows; False when the disk had no room for them."""
        try:
            for fd in files:
                os.fdatasync(fd)  # the bytes on disk before the rows that say they are
        except OSError as exc:
            if disk_full(exc):  # as for the rows: kept to be saved once there is room
                return self._no_room(full(self.directory))
            log.warning("could not flush the cache files: %s (their new chunks will be fetched again)", exc.strerror)
            pending = {}
        finally:
            for fd in files:
                os.close(fd)
        try:
            self.records.commit(pending, touched)
        except CacheFull as exc:
            return self._no_room(exc)
        except RemoteError as exc:
            log.warning("could not record chunks in the cache: %s (they will be fetched again)", exc)
        self._full_said = False
        return True

    # -- room -------------------------------------------------------------------------------
    def reserve(self, requester: CachedObject, chunk: int, nbytes: int, *, wait: bool = True) -> None:
        """Take the blocks of a chunk about to be fetched (freeing least recently used chunks first
        to keep under the bound). The blocks are taken at once (fallocate), so that every process
        counts them.

        With no room, `wait` waits for chunks in use to be let go (a while: then CacheFull, as when
        the disk is full); without `wait`, NoRoomNow at once, the disk's being full too (a fetch
        ahead of readers: a reader that joined it claims room itself, see CachedObject.ensure_pinned).
        """
        deadline = time.monotonic() + requester.room_wait
        while True:
            with self.room.locked():
                if self.room.fits(requester, nbytes):
                    try:
                        self.room.take(requester, [chunk])
                    except CacheFull:
                        if wait:
                            raise
                    else:
                        return
            if not wait:
                raise NoRoomNow(f"{requester.version.url}: no room in the cache now")
            self._await_room(requester, deadline)

    def claim(self, requester: CachedObject, first: int, last: int, deadline: float) -> set[int]:
        """Pin chunks first..last of an object, those present and those to fetch (the latter returned,
        their blocks taken): all at once, or nothing held while room is waited for (until `deadline`,
        then CacheFull). A reader that holds nothing while it waits never keeps another from the room
        it waits for, and chunks pinned before they come are never evicted before they are used.

        A disk that fills before the bound (or with no bound) is made room on as the bound is:
        chunks fetched ahead of readers must not keep a reader from its own. CacheFull at once when
        nothing of this cache can go, none of this process's fetches is under way and none of its
        chunks waits to be recorded (the disk is full of what is not the cache's, or of what is in use)."""
        disk_full: CacheFull | None = None
        while True:
            with self.room.locked():  # no eviction anywhere meanwhile: what is present stays so
                pinned, missing = requester.pin_present(first, last)
                need = sum(map(requester.chunk_bytes, missing))
                # Counted before the eviction looks: a chunk it passed over as in use, let go before
                # _soon_evictable looks, is counted, and the claim tries again rather than give up.
                freeings = self.room.freeings
                try:
                    # An eviction is a row deleted: on a disk full to its last block that write is refused
                    # too, the same refusal as the blocks' (waited on, not the read's failure at once).
                    freed = self.room.evict(need) if disk_full is not None else 0
                    fits = self.room.fits(requester, need)
                except CacheFull as exc:
                    freed, fits, disk_full = 0, True, exc
                if fits:
                    try:
                        self.room.take(requester, missing)
                    except CacheFull as exc:
                        requester.let_go(pinned, tell=False)  # its own: no room made for itself
                        stuck = not freed and not self._soon_evictable() and self.room.freeings == freeings
                        if pinned:
                            self.room_freed()
                        if disk_full is not None and stuck:
                            raise
                        disk_full = exc
                        if freed:
                            continue
                    except BaseException:
                        requester.let_go(pinned)
                        raise
                    else:
                        requester.pin_claimed(missing)
                        return set(missing)
                else:
                    requester.let_go(pinned)
            if disk_full is not None and time.monotonic() > deadline:
                raise disk_full
            self._await_room(requester, deadline)

    def _no_room(self, exc: CacheFull) -> bool:
        """A save the disk had no room for (False): said once while it lasts, every save meeting it again."""
        if not self._full_said:
            log.warning("could not record chunks in the cache: %s (recorded once there is room)", exc)
        self._full_said = True
        return False

    def _soon_evictable(self) -> bool:
        """Whether chunks of this process will soon be evictable: a fetch under way (its chunk's blocks
        taken), chunks its readers hold (let go once read: four readers through a disk with room for
        two chunks take turns), or chunks fetched and not yet recorded (evictable once saved, which
        waiting for room does), or being recorded by a save under way (out of what waits to be saved,
        not yet in the records: a reader right after a fetch met them so, and was told the disk was
        full). Not those the last save had no room to record: till room comes, saving them frees nothing."""
        with self._lock:
            objects = list(self._objects.values())
            if (self._pending and not self._full_said) or self._recording:
                return True
        return any(cached.busy() or cached.pinned_bytes() for cached in objects)

    def _await_room(self, requester: CachedObject, deadline: float) -> None:
        """Wait a moment for room (chunks let go, or this process's new chunks saved, which makes them
        evictable); CacheFull, saying what holds the cache, past `deadline`."""
        if time.monotonic() > deadline:
            raise CacheFull(self.what_holds(requester))
        with self._lock:
            unsaved = bool(self._pending)
        if unsaved and self.save():
            return
        with self._lock:
            self.room.wait(deadline - time.monotonic())

    @property
    def waiting_for_room(self) -> int:
        """Fetches waiting for chunks in use to be let go."""
        return self.room.waiting

    def room_freed(self) -> None:
        """Chunks were let go: a fetch waiting for room may find it now."""
        self.room.freed()

    def disk_usage(self) -> int:
        return self.room.disk_usage()

    def what_holds(self, requester: CachedObject) -> str:
        return self.room.what_holds(requester)

    def forget_chunk(self, oid: str, chunk: int) -> None:
        """Drop a chunk's row (its file's bytes are not those it was recorded with): fetched again."""
        self.records.forget_chunk(oid, chunk)

    def drop(self, cached: CachedObject, chunks: Iterable[int]) -> bool:
        """The chunks hold bytes proven not to be the object's (a manifest or a signature refused
        them): recorded first (their fetch locks go), then evicted, so that the next read here fetches
        them again, held to nothing they first summed to here (CachedObject.unhold). What the cache
        recorded of them stays: another process is held to it, never to bytes that came after a
        refusal and were not proven. Whether every one was evicted: one a reader holds now stays
        present to it, its row forgotten (no other process answers from it), until it is let go and
        evicted as any other."""
        self.save(wait=True)
        wanted = sorted(set(chunks))
        with self.room.locked():
            evicted = {
                chunk
                for chunk, _, _ in self.room.evict_from(
                    cached.id, [(chunk, cached.chunk_size, cached.chunk_bytes(chunk)) for chunk in wanted], 1 << 62
                )
            }
        for chunk in wanted:
            if chunk not in evicted:
                self.records.forget_chunk(cached.id, chunk)
        cached.unhold(wanted)
        return len(evicted) == len(wanted)

    def let_go(self, cached: CachedObject) -> bool:
        """One user of `cached` fewer: True when it was the last (its file is then closed by the caller)."""
        with self._lock:
            cached.users -= 1
            if cached.users > 0:
                return False
            if self._objects.get(cached.id) is cached:
                del self._objects[cached.id]
            return True

    # -- what `tensorfs cache` shows and does -----------------------------------------------
    def entries(self) -> list[CacheEntry]:
        return [
            CacheEntry(oid, url, etag, size, cached, used, self._in_use(oid))
            for oid, url, etag, size, used, cached in self.records.objects()
        ]

    def _in_use(self, oid: str) -> bool:
        return oid in self._objects or in_use_elsewhere(self.directory / OBJECTS_DIR / oid)

    def prune(self, max_size: int) -> int:
        """Evict least recently used chunks until the cache holds at most `max_size` bytes; bytes freed.

        Chunks in use now (by a mount, a command) stay. Files of objects left with no chunk, and in
        no process's use, are removed with their rows.
        """
        self.save(wait=True)
        held = self.records.count()
        with self.room.locked():
            freed = self.room.evict(held - max_size) if held > max_size else 0
        for oid in self.records.empty_objects():
            if oid not in self._objects:
                self._remove_unused(oid)
        return freed

    def _remove_unused(self, oid: str) -> None:
        """Remove an object's file and rows, unless a process holds it (then it stays)."""
        path = self.directory / OBJECTS_DIR / oid
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = -1
        except OSError:
            return
        try:
            if fd >= 0:
                if not can_remove(fd):
                    return  # in use
                path.unlink()  # under the lock: whoever opens it next makes a new file (see open_held)
            self.records.forget_object(oid)
        except OSError:
            return
        finally:
            if fd >= 0:
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self.save(wait=True)
        self.records.close()
        self.room.close()
