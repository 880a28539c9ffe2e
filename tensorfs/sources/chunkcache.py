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
  before it first uses it. The checksum is a CRC-32 (what changes by accident shows, at a small
  cost), and a SHA-256 too where a manifest is in force: a store that means to send other bytes
  under one ETag cannot forge that one, and the bytes that passed the manifest are the only ones
  ever served again.
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
import errno
import fcntl
import hashlib
import json
import logging
import mmap
import os
import sqlite3
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import TensorfsError, printable
from ..safefiles import UnsafeLocation, check_private_file, make_private_file, private_directory
from ..syscalls import fallocate, punch_hole
from ..units import human_size
from .pages import Pages
from .store import ObjectChanged, ObjectVersion, RemoteError, read_range

log = logging.getLogger(__name__)

DB_NAME = "objects.sqlite"
OBJECTS_DIR = "objects"
ROOM_LOCK = "room.lock"
SCHEMA = 3
"""The form of the database: a cache of an older form is emptied of its chunks (their checksums were
not these, or there were none)."""
_ROOM_WAIT = 10.0  # seconds a fetch waits for chunks in use to be let go before it fails (cache too small)
_SAVE_AT_LEAST_EVERY = 1.0  # seconds: a fetch saves if nobody else did (a daemon saves every second)
_FETCH_WAIT = 0.01  # seconds between looks at a chunk another process is fetching
_CHUNK_BYTES = "MIN(o.chunk_size, o.size - c.chunk * o.chunk_size)"  # a chunk's bytes (the last may be short)
_CHECK_PIECE = 1 << 20  # a chunk is read back in pieces this large to be checked
_BLOCK = 4096  # the unit a file system allocates in


class CacheFull(RemoteError):
    """No room in the cache for a chunk: everything in it is in use, or its disk is full."""


class NoRoomNow(RemoteError):
    """No room in the cache at this moment, for a fetch that does not wait for some (one ahead of readers)."""


class BadChunk(RemoteError):
    """A chunk whose bytes are not those the object version gave before (the store's, or the file's)."""


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


# -- locks ------------------------------------------------------------------------------------

_IN_USE = 0  # byte 0: held shared by every process with the file open


def _presence_byte(chunk: int) -> int:
    return 1 + 2 * chunk


def _fetch_byte(chunk: int) -> int:
    return 2 + 2 * chunk


def _lock(fd: int, kind: int, start: int, *, wait: bool = False) -> bool:
    """Lock one byte of a cache file (F_RDLCK, F_WRLCK, or F_UNLCK); whether it was had.

    Open file description locks (F_OFD_SETLK): a POSIX lock would be dropped when this process
    closes any other descriptor of the file, and another process would then evict chunks from
    under our mapping (holes read as zeros).
    """
    flock = struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0)  # type, whence, start, length, pid (0)
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, flock)
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


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
                    " crc32 INTEGER NOT NULL, sha256 BLOB, PRIMARY KEY (object, chunk)) WITHOUT ROWID"
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
                    sums = db.execute("SELECT chunk, crc32, sha256 FROM digests WHERE object=?", (oid,)).fetchall()
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
                    "SELECT d.crc32, d.sha256 FROM chunks c JOIN digests d ON d.object = c.object AND d.chunk = c.chunk"
                    " WHERE c.object=? AND c.chunk=?",
                    (oid, chunk),
                ).fetchone()
            except sqlite3.Error as exc:
                raise RemoteError(f"the cache {self.directory}: {exc}") from None
        return ChunkSum(row[0], row[1]) if row is not None else None

    def sums_of(self, oid: str, chunk: int) -> ChunkSum | None:
        """The checksums the chunk had when it first came, if it ever came."""
        with self._transaction() as db:
            row = db.execute("SELECT crc32, sha256 FROM digests WHERE object=? AND chunk=?", (oid, chunk)).fetchone()
        return ChunkSum(row[0], row[1]) if row is not None else None

    def strengthen(self, oid: str, chunk: int, sums: ChunkSum) -> None:
        """Keep the SHA-256 of a chunk that came before without one (its CRC-32 checked as the same)."""
        with contextlib.suppress(RemoteError), self._transaction() as db:
            db.execute(
                "UPDATE digests SET sha256=? WHERE object=? AND chunk=? AND sha256 IS NULL", (sums.sha256, oid, chunk)
            )

    def record(self, cached: CachedObject, chunk: int, nbytes: int, digest: ChunkSum) -> None:
        """A chunk written: it is recorded (for other processes, and after a crash) at the next save()."""
        with self._lock:
            self._pending.setdefault(cached.id, {})[chunk] = (nbytes, digest)
            due = time.monotonic() - self._saved_at > _SAVE_AT_LEAST_EVERY
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
                        (oid, chunk, s.crc32, s.sha256)
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
            _lock(fd, fcntl.F_WRLCK, 0, wait=True)
            try:
                yield
            finally:
                _lock(fd, fcntl.F_UNLCK, 0)

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
        deadline = time.monotonic() + _ROOM_WAIT
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
        it waits for, and chunks pinned before they come are never evicted before they are used."""
        while True:
            with self._room_lock():  # no eviction anywhere meanwhile: what is present stays so
                pinned, missing = requester.pin_present(first, last)
                if self._fits(requester, sum(map(requester.chunk_bytes, missing))):
                    try:
                        for chunk in missing:
                            requester.allocate(chunk * requester.chunk_size, requester.chunk_bytes(chunk))
                    except BaseException:
                        requester.let_go(pinned)
                        raise
                    requester.pin_claimed(missing)
                    return set(missing)
                requester.let_go(pinned)
            self._await_room(requester, deadline)

    def _await_room(self, requester: CachedObject, deadline: float) -> None:
        """Wait a moment for room (chunks let go, or this process's new chunks saved, which makes them
        evictable); CacheFull, saying what holds the cache, past `deadline`."""
        if time.monotonic() > deadline:
            raise CacheFull(self._what_holds(requester))
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

    def _what_holds(self, requester: CachedObject) -> str:
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
                    if not _lock(fd, fcntl.F_WRLCK, _presence_byte(chunk)):
                        continue  # another process answers from it now
                    try:
                        # Its record first, before the lock goes: whoever takes the lock next sees it gone (and a
                        # chunk not punched after all is only blocks left over, never a hole that is recorded).
                        with self._transaction() as db:
                            db.execute("DELETE FROM chunks WHERE object=? AND chunk=?", (oid, chunk))
                        gone = True
                        punch_hole(fd, chunk * chunk_size, chunk_size)
                    finally:
                        _lock(fd, fcntl.F_UNLCK, _presence_byte(chunk))
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
            if not _lock(fd, fcntl.F_WRLCK, _IN_USE):
                return True
            _lock(fd, fcntl.F_UNLCK, _IN_USE)
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
                if not _lock(fd, fcntl.F_WRLCK, _IN_USE):
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


class CachedObject:
    """One object version's cache file in this process: mapped, held, its chunks known present or not."""

    def __init__(self, cache: ChunkCache, oid: str, version: ObjectVersion, path: Path, chunk_size: int) -> None:
        self.cache = cache
        self.id = oid
        self.version = version
        self.path = path
        self.chunk_size = chunk_size
        self.users = 1
        self.chunks = -(-version.size // chunk_size)
        self._present = bytearray(self.chunks)
        """Chunks this process may answer from: fetched here, or recorded and checked against their checksums."""
        self._digests: dict[int, ChunkSum] = {}
        self.strong = False
        """Whether chunks are also summed with SHA-256 here (where a manifest is in force)."""
        self._lock = threading.Lock()
        self._inflight: dict[int, Future[None]] = {}
        self._pins: dict[int, int] = {}  # chunk -> how many answers hold it (not to be evicted)
        self._fetching: set[int] = set()  # chunks whose fetch lock this process holds until they are recorded
        self.fd = _open_held(path, version.size)
        try:
            self._mapping = mmap.mmap(self.fd, version.size, access=mmap.ACCESS_READ) if version.size else None
        except OSError as exc:
            os.close(self.fd)
            raise RemoteError(f"{version.url}: cannot map its cache file {path}: {exc.strerror}") from None
        self.view = memoryview(self._mapping) if self._mapping is not None else memoryview(b"")
        self.pages = Pages(self.view)

    def known(self, sums: dict[int, ChunkSum]) -> None:
        """The checksums the object's chunks came with (its recorded chunks are checked against them
        when first wanted here, and so become present here)."""
        self._digests = dict(sums)

    def clear_orphans(self, recorded: set[int]) -> None:
        """Free the blocks of chunks allocated but never recorded (their fetch did not end: its process
        was killed), each under its fetch lock: nobody is fetching it now, and its record is final."""
        offset, size = 0, self.version.size
        while offset < size:
            try:
                start = os.lseek(self.fd, offset, os.SEEK_DATA)
                end = os.lseek(self.fd, start, os.SEEK_HOLE)
            except OSError:  # ENXIO: no data after offset (or no SEEK_DATA here)
                return
            for chunk in range(start // self.chunk_size, -(-end // self.chunk_size)):
                if chunk in recorded or not _lock(self.fd, fcntl.F_WRLCK, _fetch_byte(chunk)):
                    continue
                try:
                    if self.cache.recorded(self.id, chunk) is None:
                        begin, stop = self._range(chunk)
                        with contextlib.suppress(OSError):
                            punch_hole(self.fd, begin, stop - begin)
                finally:
                    _lock(self.fd, fcntl.F_UNLCK, _fetch_byte(chunk))
            offset = max(end, start + 1)

    # -- presence -------------------------------------------------------------------------
    def present(self, chunk: int) -> bool:
        """Whether the chunk can be had without a GET (here, or recorded by another process)."""
        return bool(self._present[chunk]) or self.cache.recorded(self.id, chunk) is not None

    def present_count(self) -> int:
        """Chunks present (as this process knows)."""
        with self._lock:
            return sum(self._present)

    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(min(self.chunk_size, self.version.size - chunk * self.chunk_size) for chunk in self._pins)

    def pin(self, first: int, last: int) -> bool:
        """Hold chunks first..last against eviction (here and by other processes); False (nothing
        held) if one is not present, or was evicted by another process meanwhile."""
        chunks = range(first, last + 1)
        with self._lock:
            if not all(self._present[chunk] for chunk in chunks):
                return False
            taken: list[int] = []
            for chunk in chunks:
                if not self._pins.get(chunk) and not self._hold(chunk):
                    for done in taken:
                        self._let_go(done)
                    return False
                self._pins[chunk] = self._pins.get(chunk, 0) + 1
                taken.append(chunk)
        self.cache.touch(self, chunks)
        return True

    def pin_present(self, first: int, last: int) -> tuple[list[int], list[int]]:
        """Pin the chunks of first..last that are present here, or being fetched here; (those pinned,
        those missing: to fetch). Called with the cache's room lock held: nothing is evicted meanwhile."""
        pinned: list[int] = []
        missing: list[int] = []
        with self._lock:
            for chunk in range(first, last + 1):
                here = self._present[chunk] or chunk in self._inflight  # (a fetch or a check: evictions need
                # the room lock, which the caller holds)
                if here and (self._pins.get(chunk) or self._hold(chunk, checked=bool(self._present[chunk]))):
                    self._pins[chunk] = self._pins.get(chunk, 0) + 1
                    pinned.append(chunk)
                else:
                    missing.append(chunk)
        return pinned, missing

    def pin_claimed(self, chunks: Iterable[int]) -> None:
        """Pin chunks about to be fetched: from now on nobody evicts them (nor could: they are not recorded)."""
        with self._lock:
            for chunk in chunks:
                if not self._pins.get(chunk):
                    _lock(self.fd, fcntl.F_RDLCK, _presence_byte(chunk))
                self._pins[chunk] = self._pins.get(chunk, 0) + 1

    def let_go(self, chunks: Iterable[int]) -> None:
        """Unpin each of `chunks` once."""
        with self._lock:
            for chunk in chunks:
                self._let_go(chunk)
        self.cache.room_freed()

    def ensure_pinned(self, first: int, last: int, start: ThreadPoolExecutor, *, offline: bool = False) -> None:
        """Make chunks first..last present and pin them (blocking: a worker thread): room for all that
        are missing is claimed at once, each is pinned before it is fetched (see ChunkCache.claim).

        CacheFull when there is no room in time; a fetch's own error as it is (wait()).
        """
        deadline = time.monotonic() + _ROOM_WAIT
        for _ in range(8):
            claimed = self.cache.claim(self, first, last, deadline)
            started = [
                self.fetching(chunk, start, offline=offline, reserved=chunk in claimed)
                for chunk in range(first, last + 1)
            ]
            failure: Exception | None = None
            for future in started:
                if future is not None:
                    try:
                        future.result()
                    except Exception as exc:
                        failure = failure or exc
            if all(self._present[chunk] for chunk in range(first, last + 1)):
                return
            self.let_go(range(first, last + 1))
            if failure is not None and not isinstance(failure, NoRoomNow):
                wait([_failed(failure)])  # raised as wait() raises a fetch's failure
        raise CacheFull(self.cache._what_holds(self))

    def _hold(self, chunk: int, *, checked: bool = True) -> bool:
        """Take the chunk's presence lock (the first pin of it here): False if another process evicts
        it just now, or evicted it since this process last looked (then it is not present here)."""
        if not _lock(self.fd, fcntl.F_RDLCK, _presence_byte(chunk)):
            self._present[chunk] = 0
            return False
        if not checked or chunk in self._fetching or self.cache.pending(self.id, chunk):
            return True  # being fetched, or written here and not yet recorded: nobody else can evict it
        try:
            still = self.cache.recorded(self.id, chunk) is not None
        except RemoteError:
            still = False
        if not still:
            _lock(self.fd, fcntl.F_UNLCK, _presence_byte(chunk))
            self._present[chunk] = 0
        return still

    def _let_go(self, chunk: int) -> None:
        left = self._pins.get(chunk, 0) - 1
        if left > 0:
            self._pins[chunk] = left
            return
        self._pins.pop(chunk, None)
        with contextlib.suppress(OSError):
            _lock(self.fd, fcntl.F_UNLCK, _presence_byte(chunk))

    def unpin(self, first: int, last: int) -> None:
        with self._lock:
            for chunk in range(first, last + 1):
                self._let_go(chunk)
        self.cache.room_freed()

    def take(self, chunk: int) -> bool:
        """Mark a chunk not present, for its eviction: unless it is pinned or being fetched here. Until
        taken() is told how it went, a fetch of it here waits (an eviction is quick)."""
        with self._lock:
            if self._pins.get(chunk) or chunk in self._inflight or chunk in self._fetching:
                return False
            self._present[chunk] = 0
            self._inflight[chunk] = Future()
            return True

    def taken(self, chunk: int, gone: bool) -> None:
        """The eviction of a chunk taken is over: it is gone, or (another process answers from it) still there."""
        with self._lock:
            if not gone:
                self._present[chunk] = 1
            waited = self._inflight.pop(chunk, None)
        if waited is not None:
            waited.set_result(None)

    # -- fetching -------------------------------------------------------------------------
    def fetching(
        self,
        chunk: int,
        start: ThreadPoolExecutor,
        *,
        offline: bool = False,
        reserved: bool = False,
        room: bool = True,
    ) -> Future[None] | None:
        """The fetch of `chunk` (begun now in `start`'s threads, or already under way): a GET, or a
        check of a chunk recorded by another process or before; None if present here.

        `offline`: no GET; a chunk not cached fails its future (RemoteError). `reserved`: its room is
        taken already (see claim); `room`: wait for room if there is none (else NoRoomNow at once).
        """
        with self._lock:
            if self._present[chunk]:
                COUNTERS.add(cache_hits=1)
                return None
            running = self._inflight.get(chunk)
            if running is not None:
                return running
            future = start.submit(self._fetch, chunk, offline, reserved, room)
            self._inflight[chunk] = future
            return future

    def _fetch(self, chunk: int, offline: bool, reserved: bool, room: bool) -> None:
        try:
            self._take_fetch_lock(chunk)
            try:
                if self._present[chunk] or self._check(chunk):
                    self._fetched(chunk, None)
                    return
                if offline:
                    begin, end = self._range(chunk)
                    if reserved:  # its blocks were taken for a fetch that will not be
                        with contextlib.suppress(OSError):
                            punch_hole(self.fd, begin, end - begin)
                    raise RemoteError(f"{self.version.url}: bytes [{begin}, {end}) are not cached (--offline)")
                self._get(chunk, reserved=reserved, room=room)
            except BaseException:
                with self._lock:
                    self._fetching.discard(chunk)
                    with contextlib.suppress(OSError):
                        _lock(self.fd, fcntl.F_UNLCK, _fetch_byte(chunk))
                raise
        finally:
            with self._lock:
                self._inflight.pop(chunk, None)
            self.cache.room_freed()

    def _take_fetch_lock(self, chunk: int) -> None:
        """Be the one process that fetches `chunk` (another that is at it is waited for: it records
        the chunk when done, or dies and lets go)."""
        deadline = time.monotonic() + max(60.0, 4 * _SAVE_AT_LEAST_EVERY)
        while not _lock(self.fd, fcntl.F_WRLCK, _fetch_byte(chunk)):
            if time.monotonic() > deadline:
                raise RemoteError(
                    f"{self.version.url}: chunk {chunk} is being fetched by another process that never ends"
                )
            time.sleep(_FETCH_WAIT)
        with self._lock:
            self._fetching.add(chunk)

    def _check(self, chunk: int) -> bool:
        """Whether a chunk recorded (by any process, any time) is present here: its bytes on disk
        still sum to what they did when they came. A chunk that does not is a miss, never data:
        its record is dropped and it is fetched again."""
        if not _lock(self.fd, fcntl.F_RDLCK, _presence_byte(chunk)):
            return False  # being evicted just now
        try:
            digest = self.cache.recorded(self.id, chunk)
            if digest is None:
                return False
            begin, end = self._range(chunk)
            actual = _Summing(self.strong)
            buffer = bytearray(min(_CHECK_PIECE, end - begin))
            for start in range(begin, end, _CHECK_PIECE):
                piece = memoryview(buffer)[: min(_CHECK_PIECE, end - start)]
                self.readinto(start, piece)
                actual.update(piece)
        finally:
            with self._lock:
                if not self._pins.get(chunk):
                    _lock(self.fd, fcntl.F_UNLCK, _presence_byte(chunk))
        found = actual.sums()
        if digest.agrees(found):
            if found.sha256 is not None and digest.sha256 is None:  # summed for a manifest now: kept
                self.cache.strengthen(self.id, chunk, found)
            self._digests[chunk] = ChunkSum(digest.crc32, digest.sha256 or found.sha256)
            COUNTERS.add(chunks_checked=1)
            return True
        COUNTERS.add(bad_chunks=1)
        log.warning(
            "%s: chunk %d in the cache file %s does not hold the bytes it was recorded with (changed on disk): "
            "fetched again",
            printable(self.version.url),
            chunk,
            self.path,
        )
        self._digests[chunk] = digest  # what the object's bytes are: the fetch again must give them
        with contextlib.suppress(RemoteError), self.cache._transaction() as db:
            db.execute("DELETE FROM chunks WHERE object=? AND chunk=?", (self.id, chunk))
        return False

    def _get(self, chunk: int, *, reserved: bool, room: bool) -> None:
        """GET the chunk into its range of the file (nothing outside it), and check what came."""
        begin, end = self._range(chunk)
        if not reserved:
            self.cache.reserve(self, chunk, end - begin, wait=room)
        summing = _Summing(self.strong)

        def write(offset: int, piece: bytes) -> None:
            summing.update(piece)
            view = memoryview(piece)
            while view:
                written = os.pwrite(self.fd, view, offset)
                view, offset = view[written:], offset + written

        try:
            COUNTERS.add(gets=1)
            read_range(self.version, begin, end, write)
            expected = self._digests.get(chunk) or self.cache.sums_of(self.id, chunk)
            digest = summing.sums()
            if expected is not None and not expected.agrees(digest):
                COUNTERS.add(changed_chunks=1)
                raise BadChunk(
                    f"{self.version.url}: bytes [{begin}, {end}) are not those the same version (ETag "
                    f"{printable(self.version.etag) or 'none'}) gave before: the store serves other bytes under it"
                )
        except BaseException as exc:
            COUNTERS.add(fetch_failures=1)
            with contextlib.suppress(OSError):
                punch_hole(self.fd, begin, end - begin)  # nothing half-written stays, nor its blocks
            if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise CacheFull(f"{self.version.url}: the cache disk is full ({self.cache.directory})") from None
                raise RemoteError(f"{self.version.url}: cannot write the cache: {exc.strerror}") from None
            raise
        COUNTERS.add(fetched_bytes=end - begin)
        self._fetched(chunk, digest)

    def _fetched(self, chunk: int, digest: ChunkSum | None) -> None:
        """The chunk is present here; a new one (its digest given) is recorded at the next save."""
        with self._lock:
            self._present[chunk] = 1
            if digest is not None:
                self._digests[chunk] = digest
        if digest is not None:
            self.cache.record(self, chunk, self.chunk_bytes(chunk), digest)
        else:
            self.recorded([chunk])

    def recorded(self, chunks: Iterable[int]) -> None:
        """These chunks are recorded (or given up): their fetch locks go, so other processes may take them."""
        with self._lock:
            for chunk in chunks:
                if chunk in self._fetching:
                    self._fetching.discard(chunk)
                    with contextlib.suppress(OSError):
                        _lock(self.fd, fcntl.F_UNLCK, _fetch_byte(chunk))

    def allocate(self, offset: int, nbytes: int) -> None:
        """Take the blocks of [offset, offset + nbytes) now (CacheFull when the disk has none)."""
        try:
            fallocate(self.fd, 0, offset, nbytes)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise CacheFull(f"{self.version.url}: the cache disk is full ({self.cache.directory})") from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                raise RemoteError(f"{self.version.url}: cannot write the cache: {exc.strerror}") from None

    def chunk_bytes(self, chunk: int) -> int:
        return min(self.chunk_size, self.version.size - chunk * self.chunk_size)

    def _range(self, chunk: int) -> tuple[int, int]:
        begin = chunk * self.chunk_size
        return begin, min(self.version.size, begin + self.chunk_size)

    def readinto(self, offset: int, buffer: memoryview) -> None:
        done, size = 0, len(buffer)
        while done < size:
            count = os.preadv(self.fd, [buffer[done:]], offset + done)
            if count == 0:
                raise ObjectChanged(f"{self.version.url}: its cache file is shorter than the object")
            done += count

    def close(self) -> None:
        self.cache.save(wait=True)  # what was fetched is recorded while the file is open to flush
        with self.cache._lock:
            self.users -= 1
            if self.users > 0:
                return
            if self.cache._objects.get(self.id) is self:
                del self.cache._objects[self.id]
        with contextlib.suppress(BufferError):
            self.view.release()
            if self._mapping is not None:
                self._mapping.close()
        with contextlib.suppress(OSError):
            os.close(self.fd)  # and with it every lock of this process on the file
        self.fd = -1


@dataclass(frozen=True)
class ChunkSum:
    """What a chunk's bytes summed to when they first came: a CRC-32 always, a SHA-256 where a
    manifest is in force (see the module's docstring)."""

    crc32: int
    sha256: bytes | None = None

    def agrees(self, other: ChunkSum) -> bool:
        """Whether `other` sums the same bytes: the CRC-32s equal, and the SHA-256s where both have one."""
        if self.crc32 != other.crc32:
            return False
        return self.sha256 is None or other.sha256 is None or self.sha256 == other.sha256


class _Summing:
    """The checksums of bytes given a piece at a time (both functions let the GIL go for large pieces)."""

    def __init__(self, strong: bool) -> None:
        self._crc = 0
        self._sha = hashlib.sha256() if strong else None

    def update(self, piece: bytes | memoryview) -> None:
        self._crc = zlib.crc32(piece, self._crc)
        if self._sha is not None:
            self._sha.update(piece)

    def sums(self) -> ChunkSum:
        return ChunkSum(self._crc, self._sha.digest() if self._sha is not None else None)


def _open_held(path: Path, size: int) -> int:
    """Open (or make, sized `size`: sparse) a cache file and hold it (a shared lock on byte 0, while
    mapped: nobody removes it).

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


def _yield_to_requests() -> None:
    """Run this fetch thread below the thread that answers requests (nice 10 more: per thread on Linux):
    with readers streaming cold data the CPUs are busy, and a `stat` must not wait behind fetches."""
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + _FETCH_NICE))


_FETCH_NICE = 10


class RemoteCounters:
    """What this process's remote shards did, for the daemon's counters (fetch threads count too)."""

    NAMES = (
        "gets", "fetched_bytes", "fetch_failures", "cache_hits", "evicted_chunks", "evicted_bytes",
        "chunks_checked", "bad_chunks", "changed_chunks",
    )  # fmt: skip

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(self.NAMES, 0)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, count in counts.items():
                self._values[name] += count

    def snapshot(self) -> dict[str, int | float]:
        with self._lock:
            return dict(self._values)


COUNTERS = RemoteCounters()


class Fetcher:
    """The threads that GET chunks, for every remote shard of a process (as many as --remote-concurrency)."""

    _pools: ClassVar[dict[int, ThreadPoolExecutor]] = {}
    _lock = threading.Lock()

    @classmethod
    def pool(cls, concurrency: int) -> ThreadPoolExecutor:
        with cls._lock:
            pool = cls._pools.get(concurrency)
            if pool is None:
                pool = cls._pools[concurrency] = ThreadPoolExecutor(
                    concurrency, thread_name_prefix="fetch", initializer=_yield_to_requests
                )
            return pool


def _failed(exc: Exception) -> Future[None]:
    future: Future[None] = Future()
    future.set_exception(exc)
    return future


def wait(futures: list[Future[None]]) -> None:
    """Wait for every fetch; the first failure is raised (as the TensorfsError it is)."""
    first: Exception | None = None
    for future in futures:
        try:
            future.result()
        except Exception as exc:  # each fetch's own error; the first is told (Ctrl-C is not a fetch's)
            if first is None:
                first = exc
    if first is not None:
        if isinstance(first, TensorfsError):
            raise first
        if isinstance(first, FileNotFoundError):  # its message names the object: "URL: not found (404)"
            raise ObjectChanged(f"{first}: gone since it was validated") from None
        raise RemoteError(f"fetch failed: {first!r}") from first
