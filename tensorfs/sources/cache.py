"""The local cache of remote objects: one sparse file per object version, what is present in SQLite.

Layout of a cache directory (shared safely by several processes):

    objects.sqlite   objects (URL, ETag, size, header, chunk size), chunks present, models resolved
    objects/ID       one sparse file per object version (ID: sha256 of URL, ETag and size)

A chunk counts as present only once its bytes are written and flushed to disk (fdatasync) and its
row committed: a process killed mid-chunk, or a power cut, leaves a chunk that is fetched again,
never a hole taken for data. Rows are committed a second's worth at a time.

The cache is bounded (least recently used chunks go first, their bytes freed by punching holes
in the files). A hole reads as zeros through a mapping, so a chunk is never evicted while
anything may answer from it: each process holds a shared lock (open file description lock, byte 0) on every object
file it has mapped, and evicts only from files no other process holds; within a process, a chunk
is pinned (counted) from before a range of it is answered until the answer has gone, and a pinned
chunk is not evicted.
"""

from __future__ import annotations

import contextlib
import ctypes
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
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..errors import TensorfsError
from .pages import Pages
from .remote import ObjectChanged, ObjectVersion, RemoteError, read_range

log = logging.getLogger(__name__)

DB_NAME = "objects.sqlite"
OBJECTS_DIR = "objects"
_ROOM_WAIT = 10.0  # seconds a fetch waits for chunks in use to be let go before it fails (cache too small)
_SAVE_AT_LEAST_EVERY = 5.0  # seconds: a fetch saves if nobody else did (a daemon saves every second)
_CHUNK_BYTES = "MIN(o.chunk_size, o.size - c.chunk * o.chunk_size)"  # a chunk's bytes (the last may be short)
_FALLOC_FL_KEEP_SIZE = 1
_FALLOC_FL_PUNCH_HOLE = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)


class CacheFull(RemoteError):
    """No room in the cache for a chunk: everything in it is in use, or its disk is full."""


def default_cache_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(cache) / "tensorfs"


def object_id(url: str, etag: str, size: int) -> str:
    return hashlib.sha256(f"{url}\0{etag}\0{size}".encode("utf-8", "surrogateescape")).hexdigest()[:32]


def _punch(fd: int, offset: int, length: int) -> None:
    if _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


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


class Cache:
    """One cache directory, as this process uses it."""

    def __init__(self, directory: Path, limit: int | None = None) -> None:
        self.directory = directory
        self.limit = limit
        self._lock = threading.RLock()  # the connection, the counters, eviction
        self._db: sqlite3.Connection | None = None
        self._pid = 0
        self._objects: dict[str, CachedObject] = {}  # open in this process, by id
        self._pending: dict[str, dict[int, int]] = {}  # chunks written, not yet recorded (and their bytes)
        self._pending_bytes = 0
        self._saving = threading.Lock()
        self._room = threading.Condition(self._lock)  # told when pinned chunks are let go, or rows saved
        self._waiting_for_room = 0
        self._touched: dict[str, set[int]] = {}  # chunks served, their use not yet committed
        self._saved_at = time.monotonic()
        self._cached: int | None = None  # bytes the cache holds, as last counted (plus what this process adds)

    # -- the database ----------------------------------------------------------------------
    def db(self) -> sqlite3.Connection:
        if self._db is not None and self._pid == os.getpid():
            return self._db
        try:
            (self.directory / OBJECTS_DIR).mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.directory / DB_NAME, timeout=30.0, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(
                "CREATE TABLE IF NOT EXISTS objects (id TEXT PRIMARY KEY, url TEXT NOT NULL, etag TEXT NOT NULL,"
                " size INTEGER NOT NULL, mtime REAL NOT NULL, chunk_size INTEGER NOT NULL, header BLOB NOT NULL,"
                " used REAL NOT NULL);"
                "CREATE TABLE IF NOT EXISTS chunks (object TEXT NOT NULL, chunk INTEGER NOT NULL, used REAL NOT NULL,"
                " PRIMARY KEY (object, chunk)) WITHOUT ROWID;"
                "CREATE INDEX IF NOT EXISTS chunks_by_use ON chunks (used);"
                "CREATE TABLE IF NOT EXISTS models (source TEXT PRIMARY KEY, description TEXT NOT NULL,"
                " used REAL NOT NULL);"
            )
            db.commit()
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
                    db.execute("UPDATE objects SET used=? WHERE id=?", (time.time(), oid))
                else:
                    db.execute(
                        "INSERT INTO objects VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (oid, version.url, version.etag, version.size, version.mtime, chunk_size, header or b"",
                         time.time()),
                    )  # fmt: skip
                present = [c for (c,) in db.execute("SELECT chunk FROM chunks WHERE object=?", (oid,))]
            cached = CachedObject(self, oid, version, self.directory / OBJECTS_DIR / oid, chunk_size, present)
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
        return json.loads(row[0]) if row is not None else None

    # -- presence ---------------------------------------------------------------------------
    def is_recorded(self, oid: str, chunk: int) -> bool:
        """Whether another process has the chunk (in the database: its bytes are on disk)."""
        with self._transaction() as db:
            return db.execute("SELECT 1 FROM chunks WHERE object=? AND chunk=?", (oid, chunk)).fetchone() is not None

    def record(self, cached: CachedObject, chunk: int, nbytes: int) -> None:
        """A chunk written: it is recorded (for other processes, and after a crash) at the next save()."""
        with self._lock:
            self._pending.setdefault(cached.id, {})[chunk] = nbytes
            self._pending_bytes += nbytes
            if self._cached is not None:
                self._cached += nbytes
            due = time.monotonic() - self._saved_at > _SAVE_AT_LEAST_EVERY
        if due:  # nobody saved for a while (no daemon calls save() here): this thread does
            self.save()

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
                saving = sum(sum(chunks.values()) for chunks in pending.values())
                written = {oid: self._objects.get(oid) for oid in pending}
                # A chunk of a file closed meanwhile cannot be flushed: it is not recorded (fetched again).
                pending = {oid: chunks for oid, chunks in pending.items() if written[oid] is not None}
                files = [os.dup(cached.fd) for cached in written.values() if cached is not None and cached.fd >= 0]
            try:
                if pending or touched:
                    self._commit(pending, touched, files)
            finally:
                with self._lock:
                    self._pending_bytes -= saving  # counted until now: in the database from here on
                    self._room.notify_all()
        finally:
            self._saving.release()
        return True

    def _commit(self, pending: dict[str, dict[int, int]], touched: dict[str, set[int]], files: list[int]) -> None:
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
                db.executemany(
                    "UPDATE chunks SET used=? WHERE object=? AND chunk=?",
                    [(now, oid, chunk) for oid, chunks in touched.items() for chunk in chunks],
                )
                db.executemany("UPDATE objects SET used=? WHERE id=?", [(now, oid) for oid in {*pending, *touched}])
        except RemoteError as exc:
            log.warning("could not record chunks in the cache: %s (they will be fetched again)", exc)

    # -- room -------------------------------------------------------------------------------
    def make_room(self, nbytes: int, requester: CachedObject) -> None:
        """Free least recently used chunks until `nbytes` more fit under the limit; CacheFull if they cannot.

        Chunks written since the last save are saved first to be evictable; chunks in use (pinned
        while an answer goes out) are waited for, a while. A little more than needed is freed, so
        that the next fetches find room without a search.
        """
        if self.limit is None:
            return
        deadline = time.monotonic() + _ROOM_WAIT
        while True:
            with self._lock:
                if self._cached is None or self._cached + nbytes > self.limit:
                    self._cached = self._count() + self._pending_bytes  # other processes fill it too
                if self._cached + nbytes <= self.limit:
                    return
                slack = min(self.limit // 16, 8 * requester.chunk_size)
                self._cached -= self._evict(self._cached + nbytes - self.limit + slack)
                if self._cached + nbytes <= self.limit:
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CacheFull(
                        f"{requester.version.url}: no room in the cache {self.directory} for another chunk: "
                        f"its {self.limit >> 20} MiB hold chunks in use; raise --cache-size"
                    )
                if not self._pending:
                    self._wait_for_room(left)
                    continue
            if not self.save():  # saved, its chunks can go; else another thread saves: wait for it
                with self._lock:
                    self._wait_for_room(left)

    def _wait_for_room(self, left: float) -> None:
        """Wait (the lock held) until chunks are let go or saved, or a moment passes."""
        self._waiting_for_room += 1
        try:
            self._room.wait(min(left, 0.1))
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

    def _count(self) -> int:
        with self._transaction() as db:
            row = db.execute(
                f"SELECT COALESCE(SUM({_CHUNK_BYTES}), 0) FROM chunks c JOIN objects o ON c.object = o.id"
            ).fetchone()
        return int(row[0])

    def _evict(self, wanted: int) -> int:
        """Punch out least recently used chunks, `wanted` bytes' worth if there are; the bytes freed."""
        freed, kept = 0, 0  # kept: rows passed over (in use), which the next query skips by its offset
        refused: set[str] = set()  # objects another process holds
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
                evicted = [] if oid in refused else self._evict_from(oid, chunks, wanted - freed)
                if evicted is None:
                    refused.add(oid)
                    evicted = []
                freed += sum(nbytes for _, _, nbytes in evicted)
                COUNTERS.add(evicted_chunks=len(evicted), evicted_bytes=sum(nbytes for _, _, nbytes in evicted))
                kept += len(chunks) - len(evicted)
                if freed >= wanted:
                    break
        return freed

    def _evict_from(
        self, oid: str, chunks: list[tuple[int, int, int]], wanted: int
    ) -> list[tuple[int, int, int]] | None:
        """Evict the object's chunks (chunk, chunk size, its bytes; least recently used first) up to
        `wanted` bytes: those evicted.

        None when another process holds the object: its chunks are not ours to take away.
        """
        ours = self._objects.get(oid)
        if ours is not None:
            fd, close = ours.fd, False
        else:
            try:
                fd, close = os.open(self.directory / OBJECTS_DIR / oid, os.O_RDWR | os.O_CLOEXEC), True
            except FileNotFoundError:  # the file is gone: so are its chunks
                with self._transaction() as db:
                    db.execute("DELETE FROM chunks WHERE object=?", (oid,))
                return chunks
        evicted: list[tuple[int, int, int]] = []
        try:
            try:
                _lock(fd, fcntl.F_WRLCK)  # nobody else has it mapped
            except OSError:
                return None
            try:
                for chunk, chunk_size, nbytes in chunks:
                    if ours is not None and not ours.take(chunk):
                        continue  # pinned, or being fetched
                    _punch(fd, chunk * chunk_size, chunk_size)
                    evicted.append((chunk, chunk_size, nbytes))
                    if sum(n for _, _, n in evicted) >= wanted:
                        break
            finally:
                if ours is not None:
                    _lock(fd, fcntl.F_RDLCK)  # back to what holding it takes
        except OSError as exc:
            log.warning("could not evict from the cache file %s: %s", oid, exc.strerror)
        finally:
            if close:
                os.close(fd)
            if evicted:
                with self._transaction() as db:
                    db.executemany("DELETE FROM chunks WHERE object=? AND chunk=?", [(oid, c) for c, _, _ in evicted])
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

    def _in_use(self, oid: str) -> bool:
        if oid in self._objects:
            return True
        try:
            fd = os.open(self.directory / OBJECTS_DIR / oid, os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            _lock(fd, fcntl.F_WRLCK)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    def prune(self, max_size: int) -> int:
        """Evict least recently used chunks until the cache holds at most `max_size` bytes; bytes freed.

        Files of objects left with no chunk, and in no process's use, are removed with their rows.
        """
        self.save(wait=True)
        with self._lock:
            held = self._count()
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
        """Remove an object's file and row, unless a process holds it (then it stays)."""
        path = self.directory / OBJECTS_DIR / oid
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = -1
        try:
            if fd >= 0:
                _lock(fd, fcntl.F_WRLCK)
                path.unlink()  # under the lock: whoever opens it next makes a new file (see CachedObject)
            with self._transaction() as db:
                db.execute("DELETE FROM objects WHERE id=?", (oid,))
        except OSError:
            return  # in use
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


class CachedObject:
    """One object version's cache file in this process: mapped, held, its chunks known present or not."""

    def __init__(
        self, cache: Cache, oid: str, version: ObjectVersion, path: Path, chunk_size: int, present: list[int]
    ) -> None:
        self.cache = cache
        self.id = oid
        self.version = version
        self.path = path
        self.chunk_size = chunk_size
        self.users = 1
        self.chunks = -(-version.size // chunk_size)
        self._present = bytearray(self.chunks)
        for chunk in present:
            if 0 <= chunk < self.chunks:
                self._present[chunk] = 1
        self._lock = threading.Lock()
        self._inflight: dict[int, Future[None]] = {}
        self._pins: dict[int, int] = {}  # chunk -> how many answers hold it (not to be evicted)
        self.fd = _open_held(path)
        try:
            if os.fstat(self.fd).st_size != version.size:
                os.ftruncate(self.fd, version.size)  # sparse: nothing is allocated yet
            self._mapping = mmap.mmap(self.fd, version.size, access=mmap.ACCESS_READ) if version.size else None
        except BaseException:
            os.close(self.fd)
            raise
        self.view = memoryview(self._mapping) if self._mapping is not None else memoryview(b"")
        self.pages = Pages(self.view)

    def present(self, chunk: int) -> bool:
        if self._present[chunk]:
            return True
        if self.cache.is_recorded(self.id, chunk):  # fetched by another process meanwhile
            self._present[chunk] = 1
            return True
        return False

    def present_count(self) -> int:
        """Chunks present (as this process knows)."""
        with self._lock:
            return sum(self._present)

    def pin(self, first: int, last: int) -> bool:
        """Hold chunks first..last (all present) against eviction; False (nothing held) if one is not present."""
        chunks = range(first, last + 1)
        with self._lock:
            if not all(self._present[chunk] for chunk in chunks):
                return False
            for chunk in chunks:
                self._pins[chunk] = self._pins.get(chunk, 0) + 1
        self.cache.touch(self, chunks)
        return True

    def unpin(self, first: int, last: int) -> None:
        with self._lock:
            for chunk in range(first, last + 1):
                left = self._pins.get(chunk, 0) - 1
                if left > 0:
                    self._pins[chunk] = left
                else:
                    self._pins.pop(chunk, None)
        self.cache.room_freed()

    def take(self, chunk: int) -> bool:
        """Mark a chunk not present, for its eviction: unless it is pinned or being fetched."""
        with self._lock:
            if self._pins.get(chunk) or chunk in self._inflight:
                return False
            self._present[chunk] = 0
            return True

    def fetching(self, chunk: int, start: ThreadPoolExecutor) -> Future[None] | None:
        """The fetch of `chunk` (begun now in `start`'s threads, or already under way); None if present."""
        with self._lock:
            if self._present[chunk]:
                COUNTERS.add(cache_hits=1)
                return None
            running = self._inflight.get(chunk)
            if running is not None:
                return running
            future = start.submit(self._fetch, chunk)
            self._inflight[chunk] = future
            return future

    def _fetch(self, chunk: int) -> None:
        try:
            if self.present(chunk):
                return
            begin = chunk * self.chunk_size
            end = min(self.version.size, begin + self.chunk_size)
            self.cache.make_room(end - begin, self)
            try:
                COUNTERS.add(gets=1)
                read_range(self.version, begin, end, self._write)
            except BaseException as exc:
                COUNTERS.add(fetch_failures=1)
                with contextlib.suppress(OSError):
                    _punch(self.fd, begin, end - begin)  # nothing half-written stays allocated
                if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise CacheFull(
                            f"{self.version.url}: the cache disk is full ({self.cache.directory})"
                        ) from None
                    raise RemoteError(f"{self.version.url}: cannot write the cache: {exc.strerror}") from None
                raise
            with self._lock:
                self._present[chunk] = 1
            COUNTERS.add(fetched_bytes=end - begin)
            self.cache.record(self, chunk, end - begin)
        finally:
            with self._lock:
                self._inflight.pop(chunk, None)
            self.cache.room_freed()

    def _write(self, offset: int, piece: bytes) -> None:
        view = memoryview(piece)
        while view:
            written = os.pwrite(self.fd, view, offset)
            view, offset = view[written:], offset + written

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
            os.close(self.fd)  # and with it the shared lock
        self.fd = -1


def _lock(fd: int, kind: int, *, wait: bool = False) -> None:
    """Lock byte 0 of a cache file (F_RDLCK: held; F_WRLCK: nobody else holds it), OSError if taken.

    An open file description lock (F_OFD_SETLK): a POSIX lock (lockf) would be dropped when this
    process closes any other descriptor of the file, and another process would then evict chunks
    from under our mapping (holes read as zeros).
    """
    flock = struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 1, 0)  # type, whence, start, length, pid (0)
    fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK, flock)


def _open_held(path: Path) -> int:
    """Open (or make) a cache file and hold it (a shared lock, while mapped: no other process evicts
    from it). A file removed by `cache prune` while we waited for the lock is left for a new one."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            _lock(fd, fcntl.F_RDLCK, wait=True)
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def _yield_to_requests() -> None:
    """Run this fetch thread below the thread that answers requests (nice 10 more: per thread on Linux).

    With readers streaming cold data the CPUs are busy; this keeps a `stat` from waiting behind
    the copies of fetches (stat p99 14.6-17.4 -> 10.6-14.5 ms; the first read no slower).
    """
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + _FETCH_NICE))


_FETCH_NICE = 10


class RemoteCounters:
    """What this process's remote shards did, for the daemon's counters (fetch threads count too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(
            ("gets", "fetched_bytes", "fetch_failures", "cache_hits", "evicted_chunks", "evicted_bytes"), 0
        )

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
