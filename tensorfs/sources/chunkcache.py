"""The local cache of remote objects: one sparse file per object version, what is present in SQLite.

Layout of a cache directory (this user's alone; shared safely by several processes):

    objects.sqlite   objects (URL, ETag, size, header, chunk size), chunks present, every chunk's
                     checksums as it first came, models resolved
    objects/ID       one sparse file per object version (ID: sha256 of URL, ETag and size)

No byte is taken from the cache that is not the object's:

- A chunk is written only inside its own range: a server that sends more than was asked is an
  error, and a failed fetch frees only its own chunk.
- Each chunk's checksums are computed as it arrives and kept with the object for as long as the
  object is cached, also after the chunk is evicted: the same version must always give the same
  bytes, so a chunk fetched again that sums otherwise is refused (a store that serves other bytes
  under one ETag), and so is a chunk whose file bytes no longer sum to them (the file changed on
  disk: a miss, fetched again, never data). A process checks every chunk it did not fetch itself
  before it first uses it. The checksum is a CRC-32C (what changes by accident shows, at a small
  cost: the processor's own instruction, three times zlib's CRC-32), and a SHA-256 too where a
  manifest is in force: a store that means to send other bytes under one ETag cannot forge that
  one, and the bytes that passed the manifest are the only ones ever served again.
- A chunk counts as present only once its bytes are written and flushed to disk (fdatasync) and its
  row committed: a process killed mid-chunk leaves a chunk that is fetched again, never a hole
  taken for data.

The cache is bounded by the blocks its files hold on disk (least recently used chunks go first,
their bytes freed by punching holes). A chunk's blocks are allocated before it is fetched, under a
lock that every process takes to make room, so several processes on one cache keep to one bound.
A hole reads as zeros through a mapping, so a chunk is never evicted while anything may answer from
it. Each chunk has two lock bytes in its file (open file description locks): a process holds the
first shared while it answers from the chunk (and evicts only chunks whose first byte it can hold
exclusively), and the second exclusively while it fetches the chunk, until the chunk is recorded
(another process that wants it waits, then finds it). Byte 0 is held shared by every process that
has the file open, and exclusively only to remove the file. A process that wants a chunk it
thought present checks the database again whenever it takes the chunk's first lock byte anew.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import RemoteError
from ..safefiles import UnsafeLocation, check_private_file, make_private_file, private_directory
from ..syscalls import punch_hole
from ..units import human_size
from .cachefile import (
    IN_USE,
    ROOM_WAIT,
    SAVE_AT_LEAST_EVERY,
    CachedObject,
    CacheFull,
    ChunkSum,
    NoRoomNow,
    holders,
    lock_byte,
    presence_byte,
)
from .fetching import COUNTERS
from .store import ObjectVersion

log = logging.getLogger(__name__)

DB_NAME = "objects.sqlite"
OBJECTS_DIR = "objects"
ROOM_LOCK = "room.lock"
SCHEMA = 4
"""The form of the database: a cache of an older form is emptied of its chunks (their checksums were
not these, or there were none)."""
_CHUNK_BYTES = "MIN(o.chunk_size, o.size - c.chunk * o.chunk_size)"  # a chunk's bytes (the last may be short)
_BLOCK = 4096  # the unit a file system allocates in


def default_cache_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "tensorfs"


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
        self._lock = threading.RLock()  # the connection, the counters, eviction
        self._db: sqlite3.Connection | None = None
        self._pid = 0
        self._checked_directory = False
        self._objects: dict[str, CachedObject] = {}  # open in this process, by id
        self._pending: dict[str, dict[int, tuple[int, ChunkSum]]] = {}  # chunks written, not yet recorded
        self._saving = threading.Lock()
        self._room = threading.Condition(self._lock)  # told when pinned chunks are let go, or rows saved
        self._waiting_for_room = 0
        self._touched: dict[str, set[int]] = {}  # chunks served, their use not yet committed
        self._saved_at = time.monotonic()
        self._room_fd = -1  # the lock file every process takes to make room (a bounded cache)
        self._room_pid = 0
        self._room_mutex = threading.Lock()  # and its threads one at a time (a lock file's lock is the process's)
        self._reader: sqlite3.Connection | None = None  # presence lookups: never behind a commit
        self._reader_lock = threading.Lock()

    # -- the database ----------------------------------------------------------------------
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

    def db(self) -> sqlite3.Connection:
        if self._db is not None and self._pid == os.getpid():
            return self._db
        self.check_directory()
        try:
            db = sqlite3.connect(self.directory / DB_NAME, timeout=30.0, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            with db:
                db.execute("BEGIN IMMEDIATE")
                if db.execute("PRAGMA user_version").fetchone()[0] < SCHEMA:
                    db.execute("DROP TABLE IF EXISTS chunks")  # their checksums were not these: fetched again
                    db.execute("DROP TABLE IF EXISTS digests")
                db.execute(
                    "CREATE TABLE IF NOT EXISTS objects (id TEXT PRIMARY KEY, url TEXT NOT NULL, etag TEXT NOT NULL,"
                    " size INTEGER NOT NULL, mtime REAL NOT NULL, chunk_size INTEGER NOT NULL,"
                    " header BLOB NOT NULL, used REAL NOT NULL)"
                )
                db.execute(
                    "CREATE TABLE IF NOT EXISTS chunks (object TEXT NOT NULL, chunk INTEGER NOT NULL,"
                    " used REAL NOT NULL, PRIMARY KEY (object, chunk)) WITHOUT ROWID"
                )
                db.execute("CREATE INDEX IF NOT EXISTS chunks_by_use ON chunks (used)")
                db.execute(
                    "CREATE TABLE IF NOT EXISTS digests (object TEXT NOT NULL, chunk INTEGER NOT NULL,"
                    " crc32c INTEGER NOT NULL, sha256 BLOB, PRIMARY KEY (object, chunk)) WITHOUT ROWID"
                )
                db.execute(
                    "CREATE TABLE IF NOT EXISTS models (source TEXT PRIMARY KEY, description TEXT NOT NULL,"
                    " used REAL NOT NULL)"
                )
                db.execute(f"PRAGMA user_version={SCHEMA}")
        except (sqlite3.Error, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise RemoteError(f"cannot use the cache {self.directory}: {reason}") from None
        self._db, self._pid = db, os.getpid()
        return db

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            db = self.db()
            try:
                with db:
                    yield db
            except sqlite3.Error as exc:
                raise RemoteError(f"the cache {self.directory}: {exc}") from None

    # -- objects ---------------------------------------------------------------------------
    def open_object(self, version: ObjectVersion, header: bytes | None, chunk_size: int) -> CachedObject:
        """The cache file of `version`, made if new, mapped, and held (shared lock) until closed.

        `header` (the object's first 8 + N bytes, for --offline) is recorded with a new object.
        RemoteError when the file cannot be made (nothing is left behind then).
        """
        oid = object_id(version.url, version.etag, version.size)
        with self._lock:
            found = self._objects.get(oid)
            if found is not None:
                found.users += 1
                return found
            with self._transaction() as db:
                row = db.execute("SELECT chunk_size FROM objects WHERE id=?", (oid,)).fetchone()
                if row is not None:
                    chunk_size = int(row[0])  # the object's chunks were cut so: keep to them
            path = self.directory / OBJECTS_DIR / oid
            cached = CachedObject(self, oid, version, path, chunk_size)  # RemoteError: nothing made
            try:
                with self._transaction() as db:
                    if row is not None:
                        db.execute("UPDATE objects SET used=? WHERE id=?", (time.time(), oid))
                    else:
                        db.execute(
                            "INSERT OR IGNORE INTO objects VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                            (oid, version.url, version.etag, version.size, version.mtime, chunk_size, header or b"",
                             time.time()),
                        )  # fmt: skip
                    present = [c for (c,) in db.execute("SELECT chunk FROM chunks WHERE object=?", (oid,))]
                    sums = db.execute("SELECT chunk, crc32c, sha256 FROM digests WHERE object=?", (oid,)).fetchall()
            except BaseException:
                cached.close()
                raise
            cached.known({chunk: ChunkSum(crc, sha) for chunk, crc, sha in sums})
            cached.clear_orphans(set(present))
            self._objects[oid] = cached
            return cached

    def header_of(self, url: str, etag: str, size: int) -> tuple[bytes, float] | None:
        """The header cached of an object version, and its Last-Modified (for --offline)."""
        with self._transaction() as db:
            row = db.execute("SELECT header, mtime FROM objects WHERE id=?", (object_id(url, etag, size),)).fetchone()
        return (bytes(row[0]), float(row[1])) if row is not None else None

    # -- models (what a source resolved to, for --offline) ----------------------------------
    def remember_model(self, source: str, description: dict[str, Any]) -> None:
        with contextlib.suppress(RemoteError), self._transaction() as db:
            db.execute("INSERT OR REPLACE INTO models VALUES (?, ?, ?)", (source, json.dumps(description), time.time()))

    def recall_model(self, source: str) -> dict[str, Any] | None:
        with self._transaction() as db:
            row = db.execute("SELECT description FROM models WHERE source=?", (source,)).fetchone()
        found = json.loads(row[0]) if row is not None else None
        return found if isinstance(found, dict) else None

    # -- presence ---------------------------------------------------------------------------
    def recorded(self, oid: str, chunk: int) -> ChunkSum | None:
        """The chunk's checksums if it is recorded present (its bytes on disk, by some process), else None.

        On a connection of its own: a reader's lookup never waits for a commit of this process.
        """
        with self._reader_lock:
            try:
                if self._reader is None or self._pid != os.getpid():
                    self.db()
                    self._reader = sqlite3.connect(self.directory / DB_NAME, timeout=30.0, check_same_thread=False)
                row = self._reader.execute(
                    "SELECT d.crc32c, d.sha256 FROM chunks c JOIN digests d"
                    " ON d.object = c.object AND d.chunk = c.chunk WHERE c.object=? AND c.chunk=?",
                    (oid, chunk),
                ).fetchone()
            except sqlite3.Error as exc:
                raise RemoteError(f"the cache {self.directory}: {exc}") from None
        return ChunkSum(row[0], row[1]) if row is not None else None

    def sums_of(self, oid: str, chunk: int) -> ChunkSum | None:
        """The checksums the chunk had when it first came, if it ever came."""
        with self._transaction() as db:
            row = db.execute("SELECT crc32c, sha256 FROM digests WHERE object=? AND chunk=?", (oid, chunk)).fetchone()
        return ChunkSum(row[0], row[1]) if row is not None else None

    def strengthen(self, oid: str, chunk: int, sums: ChunkSum) -> None:
        """Keep the SHA-256 of a chunk that came before without one (its CRC-32C checked as the same)."""
        with contextlib.suppress(RemoteError), self._transaction() as db:
            db.execute(
                "UPDATE digests SET sha256=? WHERE object=? AND chunk=? AND sha256 IS NULL", (sums.sha256, oid, chunk)
            )

    def record(self, cached: CachedObject, chunk: int, nbytes: int, digest: ChunkSum) -> None:
        """A chunk written: it is recorded (for other processes, and after a crash) at the next save()."""
        with self._lock:
            self._pending.setdefault(cached.id, {})[chunk] = (nbytes, digest)
            due = time.monotonic() - self._saved_at > SAVE_AT_LEAST_EVERY
        if due:  # nobody saved for a while (no daemon calls save() here): this thread does
            self.save()

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
        another thread saves just now (and this one did not), unless `wait`: then after it.
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
                files = [os.dup(cached.fd) for cached in written.values() if cached is not None and cached.fd >= 0]
            try:
                if pending or touched:
                    self._commit(pending, touched, files)
            finally:
                for oid, chunks in pending.items():  # recorded (or given up): others may fetch them now
                    cached = written[oid]
                    if cached is not None:
                        cached.recorded(chunks)
                with self._lock:
                    self._room.notify_all()
        finally:
            self._saving.release()
        return True

    def _commit(
        self, pending: dict[str, dict[int, tuple[int, ChunkSum]]], touched: dict[str, set[int]], files: list[int]
    ) -> None:
        try:
            for fd in files:
                os.fdatasync(fd)  # the bytes on disk before the rows that say they are
        except OSError as exc:
            log.warning("could not flush the cache files: %s (their new chunks will be fetched again)", exc.strerror)
            pending = {}
        finally:
            for fd in files:
                os.close(fd)
        now = time.time()
        try:
            with self._transaction() as db:
                db.executemany(
                    "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?)",
                    [(oid, chunk, now) for oid, chunks in pending.items() for chunk in chunks],
                )
                db.executemany(  # a SHA-256 where there was none before is kept; nothing else changes
                    "INSERT INTO digests VALUES (?, ?, ?, ?) ON CONFLICT (object, chunk)"
                    " DO UPDATE SET sha256 = COALESCE(digests.sha256, excluded.sha256)",
                    [
                        (oid, chunk, s.crc32c, s.sha256)
                        for oid, chunks in pending.items()
                        for chunk, (_, s) in chunks.items()
                    ],
                )
                db.executemany(
                    "UPDATE chunks SET used=? WHERE object=? AND chunk=?",
                    [(now, oid, chunk) for oid, chunks in touched.items() for chunk in chunks],
                )
                db.executemany("UPDATE objects SET used=? WHERE id=?", [(now, oid) for oid in {*pending, *touched}])
        except RemoteError as exc:
            log.warning("could not record chunks in the cache: %s (they will be fetched again)", exc)

    # -- room -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _room_lock(self) -> Iterator[None]:
        """Held (by one thread of one process at a time) while room is made and a chunk's blocks taken."""
        self.db()
        with self._room_mutex:
            if self._room_fd < 0 or self._room_pid != os.getpid():
                path = self.directory / ROOM_LOCK
                try:
                    check_private_file(path, what="the cache's lock file")
                    self._room_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
                except (OSError, UnsafeLocation) as exc:
                    why = getattr(exc, "strerror", None) or exc
                    raise RemoteError(f"cannot use the cache {self.directory}: {why}") from None
                self._room_pid = os.getpid()
            fd = self._room_fd
            lock_byte(fd, fcntl.F_WRLCK, 0, wait=True)
            try:
                yield
            finally:
                lock_byte(fd, fcntl.F_UNLCK, 0)

    def _fits(self, requester: CachedObject, nbytes: int) -> bool:
        """Whether `nbytes` more fit under the bound, once least recently used chunks that nobody
        uses are evicted to make room (call with the room lock held)."""
        if self.limit is None:
            return True
        need = -(-nbytes // _BLOCK) * _BLOCK  # whole blocks
        held = self.disk_usage()
        if held + need > self.limit:
            slack = min(self.limit // 16, 8 * requester.chunk_size)
            self._evict(held + need - self.limit + slack)
            held = self.disk_usage()
        return held + need <= self.limit

    def reserve(self, requester: CachedObject, chunk: int, nbytes: int, *, wait: bool = True) -> None:
        """Take the blocks of a chunk about to be fetched (freeing least recently used chunks first
        to keep under the bound). The blocks are taken at once (fallocate), so that every process
        counts them.

        With no room, `wait` waits for chunks in use to be let go (a while: then CacheFull, as when
        the disk is full); without `wait`, NoRoomNow at once (a fetch ahead of readers).
        """
        deadline = time.monotonic() + ROOM_WAIT
        while True:
            with self._room_lock():
                if self._fits(requester, nbytes):
                    requester.allocate(chunk * requester.chunk_size, nbytes)
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
            with self._room_lock():  # no eviction anywhere meanwhile: what is present stays so
                pinned, missing = requester.pin_present(first, last)
                need = sum(map(requester.chunk_bytes, missing))
                freed = self._evict(need) if disk_full is not None else 0
                if self._fits(requester, need):
                    try:
                        for chunk in missing:
                            requester.allocate(chunk * requester.chunk_size, requester.chunk_bytes(chunk))
                    except CacheFull as exc:
                        requester.let_go(pinned)
                        if disk_full is not None and not freed and not self._soon_evictable():
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

    def _soon_evictable(self) -> bool:
        """Whether chunks of this process will soon be evictable: a fetch under way (its chunk's blocks
        taken), or chunks fetched and not yet recorded (evictable once saved, which waiting for room
        does)."""
        with self._lock:
            objects = list(self._objects.values())
            if self._pending:
                return True
        return any(cached.busy() for cached in objects)

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
            self._wait_for_room(deadline - time.monotonic())

    def _wait_for_room(self, left: float) -> None:
        """Wait (the lock held) until chunks are let go or saved, or a moment passes."""
        self._waiting_for_room += 1
        try:
            self._room.wait(max(0.0, min(left, 0.1)))
        finally:
            self._waiting_for_room -= 1

    @property
    def waiting_for_room(self) -> int:
        """Fetches waiting for chunks in use to be let go."""
        return self._waiting_for_room

    def room_freed(self) -> None:
        """Chunks were let go: a fetch waiting for room may find it now."""
        if self._waiting_for_room:
            with self._lock:
                self._room.notify_all()

    def disk_usage(self) -> int:
        """Bytes the object files hold on disk (their blocks): every process's chunks, recorded or not."""
        total = 0
        with contextlib.suppress(FileNotFoundError), os.scandir(self.directory / OBJECTS_DIR) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    total += entry.stat(follow_symlinks=False).st_blocks * 512
        return total

    def forget_chunk(self, oid: str, chunk: int) -> None:
        """Drop a chunk's row (its file's bytes are not those it was recorded with): fetched again."""
        with contextlib.suppress(RemoteError), self._transaction() as db:
            db.execute("DELETE FROM chunks WHERE object=? AND chunk=?", (oid, chunk))

    def let_go(self, cached: CachedObject) -> bool:
        """One user of `cached` fewer: True when it was the last (its file is then closed by the caller)."""
        with self._lock:
            cached.users -= 1
            if cached.users > 0:
                return False
            if self._objects.get(cached.id) is cached:
                del self._objects[cached.id]
            return True

    def what_holds(self, requester: CachedObject) -> str:
        """Why no room could be made: what holds the cache, in words."""
        assert self.limit is not None
        mine = sum(cached.pinned_bytes() for cached in self._objects.values())
        others = sorted(
            {pid for oid in self._in_use_by_others() for pid in holders(self.directory / OBJECTS_DIR / oid)}
        )
        by = f"readers in this process hold {human_size(mine)}" if mine else "no reader of this process holds any"
        if others:
            by += f"; processes {', '.join(map(str, others))} use it too (their chunks in use stay)"
        return (
            f"{requester.version.url}: no room in the cache {self.directory} ({human_size(self.limit)}, "
            f"{human_size(self.disk_usage())} on disk) for another chunk of {human_size(requester.chunk_size)}: "
            f"{by}; raise --cache-size, or read less at once"
        )

    def _in_use_by_others(self) -> list[str]:
        found = []
        with contextlib.suppress(FileNotFoundError), os.scandir(self.directory / OBJECTS_DIR) as entries:
            for entry in entries:
                if self._in_use(entry.name, others_only=True):
                    found.append(entry.name)
        return found

    def _count(self) -> int:
        """Bytes of the chunks recorded present."""
        with self._transaction() as db:
            row = db.execute(
                f"SELECT COALESCE(SUM({_CHUNK_BYTES}), 0) FROM chunks c JOIN objects o ON c.object = o.id"
            ).fetchone()
        return int(row[0])

    def _evict(self, wanted: int) -> int:
        """Punch out least recently used chunks, `wanted` bytes' worth if there are; the bytes freed."""
        freed, kept = 0, 0  # kept: rows passed over (in use), which the next query skips by its offset
        while freed < wanted:
            with self._transaction() as db:
                rows = db.execute(
                    f"SELECT c.object, c.chunk, o.chunk_size, {_CHUNK_BYTES} FROM chunks c"
                    " JOIN objects o ON c.object = o.id ORDER BY c.used, c.object, c.chunk LIMIT 256 OFFSET ?",
                    (kept,),
                ).fetchall()
            if not rows:
                break
            by_object: dict[str, list[tuple[int, int, int]]] = {}
            for oid, chunk, chunk_size, nbytes in rows:
                by_object.setdefault(oid, []).append((chunk, chunk_size, nbytes))
            for oid, chunks in by_object.items():
                evicted = self._evict_from(oid, chunks, wanted - freed)
                freed += sum(nbytes for _, _, nbytes in evicted)
                COUNTERS.add(evicted_chunks=len(evicted), evicted_bytes=sum(nbytes for _, _, nbytes in evicted))
                kept += len(chunks) - len(evicted)
                if freed >= wanted:
                    break
        return freed

    def _evict_from(self, oid: str, chunks: list[tuple[int, int, int]], wanted: int) -> list[tuple[int, int, int]]:
        """Evict the object's chunks (chunk, chunk size, its bytes; least recently used first) that
        nobody uses now, up to `wanted` bytes: those evicted."""
        ours = self._objects.get(oid)
        if ours is not None:
            fd, close = ours.fd, False
        else:
            try:
                fd, close = os.open(self.directory / OBJECTS_DIR / oid, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC), True
            except FileNotFoundError:  # the file is gone: so are its chunks
                with self._transaction() as db:
                    db.execute("DELETE FROM chunks WHERE object=?", (oid,))
                return chunks
            except OSError as exc:
                log.warning("could not evict from the cache file %s: %s", oid, exc.strerror)
                return []
        evicted: list[tuple[int, int, int]] = []
        try:
            for chunk, chunk_size, nbytes in chunks:
                if ours is not None and not ours.take(chunk):
                    continue  # pinned, or being fetched, here
                gone = False
                try:
                    if not lock_byte(fd, fcntl.F_WRLCK, presence_byte(chunk)):
                        continue  # another process answers from it now
                    try:
                        # Its record first, before the lock goes: whoever takes the lock next sees it gone (and a
                        # chunk not punched after all is only blocks left over, never a hole that is recorded).
                        with self._transaction() as db:
                            db.execute("DELETE FROM chunks WHERE object=? AND chunk=?", (oid, chunk))
                        gone = True
                        punch_hole(fd, chunk * chunk_size, chunk_size)
                    finally:
                        lock_byte(fd, fcntl.F_UNLCK, presence_byte(chunk))
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

    # -- what `tensorfs cache` shows and does -----------------------------------------------
    def entries(self) -> list[CacheEntry]:
        with self._transaction() as db:
            rows = db.execute(
                f"SELECT o.id, o.url, o.etag, o.size, o.used, COALESCE(SUM({_CHUNK_BYTES}), 0)"
                " FROM objects o LEFT JOIN chunks c ON c.object = o.id GROUP BY o.id ORDER BY o.url"
            ).fetchall()
        return [
            CacheEntry(oid, url, etag, size, int(cached), used, self._in_use(oid))
            for oid, url, etag, size, used, cached in rows
        ]

    def _in_use(self, oid: str, *, others_only: bool = False) -> bool:
        if oid in self._objects and not others_only:
            return True
        try:
            fd = os.open(self.directory / OBJECTS_DIR / oid, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            if not lock_byte(fd, fcntl.F_WRLCK, IN_USE):
                return True
            lock_byte(fd, fcntl.F_UNLCK, IN_USE)
            return False
        finally:
            os.close(fd)

    def prune(self, max_size: int) -> int:
        """Evict least recently used chunks until the cache holds at most `max_size` bytes; bytes freed.

        Chunks in use now (by a mount, a command) stay. Files of objects left with no chunk, and in
        no process's use, are removed with their rows.
        """
        self.save(wait=True)
        held = self._count()
        with self._room_lock():
            freed = self._evict(held - max_size) if held > max_size else 0
        with self._transaction() as db:
            empty = [oid for (oid,) in db.execute(
                "SELECT id FROM objects WHERE id NOT IN (SELECT DISTINCT object FROM chunks)"
            )]  # fmt: skip
        for oid in empty:
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
                if not lock_byte(fd, fcntl.F_WRLCK, IN_USE):
                    return  # in use
                path.unlink()  # under the lock: whoever opens it next makes a new file (see CachedObject)
            with self._transaction() as db:
                db.execute("DELETE FROM objects WHERE id=?", (oid,))
                db.execute("DELETE FROM digests WHERE object=?", (oid,))
        except OSError:
            return
        finally:
            if fd >= 0:
                os.close(fd)

    def close(self) -> None:
        self.save(wait=True)
        with self._lock:
            if self._db is not None and self._pid == os.getpid():
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
            self._db = None
            with self._reader_lock:
                if self._reader is not None and self._pid == os.getpid():
                    with contextlib.suppress(sqlite3.Error):
                        self._reader.close()
                self._reader = None
        with self._room_mutex:
            if self._room_fd >= 0 and self._room_pid == os.getpid():
                with contextlib.suppress(OSError):
                    os.close(self._room_fd)
            self._room_fd = -1
