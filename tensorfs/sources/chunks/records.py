"""What the chunk cache records, in SQLite (objects.sqlite, shared by every process on the cache):
objects (URL, ETag, size, header, chunk size), the chunks present and who recorded them, every
chunk's checksums as it first came, and what models resolved to (for --offline).

A chunk counts as present only once its bytes are on disk and its row committed; each row carries a
token of the fetch that recorded it, so that a process can tell a chunk it checked from the same
chunk fetched again since by another (whose bytes it has not seen).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import RemoteError
from .full import disk_full, full

__all__ = ["DB_NAME", "ChunkSum", "Records", "Summing", "new_token"]

DB_NAME = "objects.sqlite"
SCHEMA = 5
"""The form of the database: a cache of an older form is emptied of its chunks (their checksums were
not these, or there were none; their rows had no token)."""
CHUNK_BYTES = "MIN(o.chunk_size, o.size - c.chunk * o.chunk_size)"  # a chunk's bytes (the last may be short)
WAL_PAGES = 16
"""Pages the write-ahead log takes before they are checkpointed into the database, and what it is cut
back to then (journal_size_limit). The log shares the disk with the chunks: at SQLite's default, 1000
pages (4 MiB, kept at that size once grown), it filled what two chunks left of a 20 MiB disk, and then
no eviction (a row deleted first) nor save could be written: no chunk could go, ever, and every read
was told the disk is full."""


@dataclass(frozen=True)
class ChunkSum:
    """What a chunk's bytes summed to when they first came: a CRC-32C always, a SHA-256 where a
    manifest is in force (or where one was, for that chunk, in any process)."""

    crc32c: int
    sha256: bytes | None = None

    def agrees(self, other: ChunkSum) -> bool:
        """Whether `other` sums the same bytes: the CRC-32Cs equal, and the SHA-256s where both have one."""
        if self.crc32c != other.crc32c:
            return False
        return self.sha256 is None or other.sha256 is None or self.sha256 == other.sha256


class Summing:
    """The checksums of bytes given a piece at a time (both functions let the GIL go for large pieces)."""

    def __init__(self, strong: bool) -> None:
        from crc32c import crc32c  # here, not at the top: `import crc32c` takes tens of ms (importlib.metadata)

        self._crc32c = crc32c
        self._crc = 0
        self._sha = hashlib.sha256() if strong else None

    def update(self, piece: bytes | memoryview) -> None:
        self._crc = self._crc32c(piece, self._crc)
        if self._sha is not None:
            self._sha.update(piece)

    def sums(self) -> ChunkSum:
        return ChunkSum(self._crc, self._sha.digest() if self._sha is not None else None)


def new_token() -> int:
    """A token for one fetch's record of a chunk: another fetch's is another."""
    return secrets.randbits(62)


Pending = dict[str, dict[int, tuple[int, ChunkSum, int]]]
"""Chunks written and not yet recorded: object id -> chunk -> (bytes, checksums, token)."""


class Records:
    """The cache's database, as this process uses it: one connection for writes (and its lock), one of
    its own for presence lookups (a reader's never waits behind a commit of this process)."""

    def __init__(self, directory: Path, check: Any) -> None:
        self.directory = directory
        self._check = check  # the directory's own check, before the database is first opened
        self.lock = threading.RLock()
        self._db: sqlite3.Connection | None = None
        self._pid = 0
        self._reader: sqlite3.Connection | None = None
        self._reader_lock = threading.Lock()

    def db(self) -> sqlite3.Connection:
        if self._db is not None and self._pid == os.getpid():
            return self._db
        self._check()
        try:
            db = sqlite3.connect(self.directory / DB_NAME, timeout=30.0, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute(f"PRAGMA wal_autocheckpoint={WAL_PAGES}")
            db.execute(f"PRAGMA journal_size_limit={WAL_PAGES * 4096}")
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
                    " used REAL NOT NULL, token INTEGER NOT NULL, PRIMARY KEY (object, chunk)) WITHOUT ROWID"
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
            if disk_full(exc):
                raise full(self.directory) from None
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise RemoteError(f"cannot use the cache {self.directory}: {reason}") from None
        self._db, self._pid = db, os.getpid()
        return db

    def _failure(self, exc: sqlite3.Error) -> RemoteError:
        return full(self.directory) if disk_full(exc) else RemoteError(f"the cache {self.directory}: {exc}")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        with self.lock:
            db = self.db()
            try:
                with db:
                    yield db
            except sqlite3.Error as exc:
                raise self._failure(exc) from None

    # -- objects -------------------------------------------------------------------------------
    def object_opened(
        self, oid: str, url: str, etag: str, size: int, mtime: float, chunk_size: int, header: bytes | None
    ) -> tuple[int, list[int], dict[int, ChunkSum]]:
        """An object opened: its row made (or its use noted); (its chunk size, the chunks recorded
        present, every chunk's checksums as it first came)."""
        with self.transaction() as db:
            row = db.execute("SELECT chunk_size FROM objects WHERE id=?", (oid,)).fetchone()
            if row is not None:
                chunk_size = int(row[0])  # the object's chunks were cut so: keep to them
                db.execute("UPDATE objects SET used=? WHERE id=?", (time.time(), oid))
            else:
                db.execute(
                    "INSERT OR IGNORE INTO objects VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    (oid, url, etag, size, mtime, chunk_size, header or b"", time.time()),
                )
            present = [c for (c,) in db.execute("SELECT chunk FROM chunks WHERE object=?", (oid,))]
            sums = db.execute("SELECT chunk, crc32c, sha256 FROM digests WHERE object=?", (oid,)).fetchall()
        return chunk_size, present, {chunk: ChunkSum(crc, sha) for chunk, crc, sha in sums}

    def chunk_size_of(self, oid: str) -> int | None:
        with self.transaction() as db:
            row = db.execute("SELECT chunk_size FROM objects WHERE id=?", (oid,)).fetchone()
        return int(row[0]) if row is not None else None

    def header_of(self, oid: str) -> tuple[bytes, float] | None:
        """The header cached of an object version, and its Last-Modified (for --offline)."""
        with self.transaction() as db:
            row = db.execute("SELECT header, mtime FROM objects WHERE id=?", (oid,)).fetchone()
        return (bytes(row[0]), float(row[1])) if row is not None else None

    def remember_model(self, source: str, description: dict[str, Any]) -> None:
        with contextlib.suppress(RemoteError), self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO models VALUES (?, ?, ?)", (source, json.dumps(description), time.time()))

    def recall_model(self, source: str) -> dict[str, Any] | None:
        with self.transaction() as db:
            row = db.execute("SELECT description FROM models WHERE source=?", (source,)).fetchone()
        found = json.loads(row[0]) if row is not None else None
        return found if isinstance(found, dict) else None

    # -- chunks ----------------------------------------------------------------------------------
    def recorded(self, oid: str, chunk: int) -> tuple[ChunkSum, int] | None:
        """The chunk's checksums and its record's token if it is recorded present (its bytes on disk,
        by some process), else None."""
        with self._reader_lock:
            try:
                if self._reader is None or self._pid != os.getpid():
                    self.db()
                    self._reader = sqlite3.connect(self.directory / DB_NAME, timeout=30.0, check_same_thread=False)
                row = self._reader.execute(
                    "SELECT d.crc32c, d.sha256, c.token FROM chunks c JOIN digests d"
                    " ON d.object = c.object AND d.chunk = c.chunk WHERE c.object=? AND c.chunk=?",
                    (oid, chunk),
                ).fetchone()
            except sqlite3.Error as exc:
                raise self._failure(exc) from None
        return (ChunkSum(row[0], row[1]), int(row[2])) if row is not None else None

    def sums_of(self, oid: str, chunk: int) -> ChunkSum | None:
        """The checksums the chunk had when it first came, if it ever came."""
        with self.transaction() as db:
            row = db.execute("SELECT crc32c, sha256 FROM digests WHERE object=? AND chunk=?", (oid, chunk)).fetchone()
        return ChunkSum(row[0], row[1]) if row is not None else None

    def strengthen(self, oid: str, chunk: int, sums: ChunkSum) -> None:
        """Keep the SHA-256 of a chunk that came before without one (its CRC-32C checked as the same)."""
        with contextlib.suppress(RemoteError), self.transaction() as db:
            db.execute(
                "UPDATE digests SET sha256=? WHERE object=? AND chunk=? AND sha256 IS NULL", (sums.sha256, oid, chunk)
            )

    def commit(self, pending: Pending, touched: dict[str, set[int]]) -> None:
        """Record chunks written (their bytes flushed already) and when chunks were last used."""
        now = time.time()
        with self.transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO chunks VALUES (?, ?, ?, ?)",
                [
                    (oid, chunk, now, token)
                    for oid, chunks in pending.items()
                    for chunk, (_, _, token) in chunks.items()
                ],
            )
            db.executemany(  # a SHA-256 where there was none before is kept; nothing else changes
                "INSERT INTO digests VALUES (?, ?, ?, ?) ON CONFLICT (object, chunk)"
                " DO UPDATE SET sha256 = COALESCE(digests.sha256, excluded.sha256)",
                [
                    (oid, chunk, s.crc32c, s.sha256)
                    for oid, chunks in pending.items()
                    for chunk, (_, s, _) in chunks.items()
                ],
            )
            db.executemany(
                "UPDATE chunks SET used=? WHERE object=? AND chunk=?",
                [(now, oid, chunk) for oid, chunks in touched.items() for chunk in chunks],
            )
            db.executemany("UPDATE objects SET used=? WHERE id=?", [(now, oid) for oid in {*pending, *touched}])

    def forget_chunk(self, oid: str, chunk: int) -> None:
        """Drop a chunk's row: it is not present any more (evicted, or its bytes are not its record's)."""
        with contextlib.suppress(RemoteError), self.transaction() as db:
            db.execute("DELETE FROM chunks WHERE object=? AND chunk=?", (oid, chunk))

    def replace_sums(self, oid: str, chunk: int, sums: ChunkSum) -> None:
        """What the chunk sums to from now on, for every process: its bytes fetched again after those
        that first came were refused, and proven since (CachedObject.proven)."""
        with contextlib.suppress(RemoteError), self.transaction() as db:
            db.execute("INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?)", (oid, chunk, sums.crc32c, sums.sha256))

    def forget_chunks(self, oid: str) -> None:
        """Drop the rows of every chunk of an object (its file is gone)."""
        with self.transaction() as db:
            db.execute("DELETE FROM chunks WHERE object=?", (oid,))

    def count(self) -> int:
        """Bytes of the chunks recorded present."""
        with self.transaction() as db:
            row = db.execute(
                f"SELECT COALESCE(SUM({CHUNK_BYTES}), 0) FROM chunks c JOIN objects o ON c.object = o.id"
            ).fetchone()
        return int(row[0])

    def least_used(self, skip: int, limit: int = 256) -> list[tuple[str, int, int, int]]:
        """Recorded chunks, least recently used first, past the first `skip`: (object, chunk, chunk
        size, its bytes)."""
        with self.transaction() as db:
            rows = db.execute(
                f"SELECT c.object, c.chunk, o.chunk_size, {CHUNK_BYTES} FROM chunks c"
                " JOIN objects o ON c.object = o.id ORDER BY c.used, c.object, c.chunk LIMIT ? OFFSET ?",
                (limit, skip),
            ).fetchall()
        return [(str(oid), int(chunk), int(size), int(nbytes)) for oid, chunk, size, nbytes in rows]

    def objects(self) -> list[tuple[str, str, str, int, float, int]]:
        """Every object: (id, url, ETag, size, last used, bytes of its chunks present)."""
        with self.transaction() as db:
            return [
                (str(oid), str(url), str(etag), int(size), float(used), int(cached))
                for oid, url, etag, size, used, cached in db.execute(
                    f"SELECT o.id, o.url, o.etag, o.size, o.used, COALESCE(SUM({CHUNK_BYTES}), 0)"
                    " FROM objects o LEFT JOIN chunks c ON c.object = o.id GROUP BY o.id ORDER BY o.url"
                )
            ]

    def empty_objects(self) -> list[str]:
        """The objects with no chunk present."""
        with self.transaction() as db:
            return [str(oid) for (oid,) in db.execute(
                "SELECT id FROM objects WHERE id NOT IN (SELECT DISTINCT object FROM chunks)"
            )]  # fmt: skip

    def forget_object(self, oid: str) -> None:
        with self.transaction() as db:
            db.execute("DELETE FROM objects WHERE id=?", (oid,))
            db.execute("DELETE FROM digests WHERE object=?", (oid,))

    def close(self) -> None:
        with self.lock:
            if self._db is not None and self._pid == os.getpid():
                with contextlib.suppress(sqlite3.Error):
                    self._db.close()
            self._db = None
            with self._reader_lock:
                if self._reader is not None and self._pid == os.getpid():
                    with contextlib.suppress(sqlite3.Error):
                        self._reader.close()
                self._reader = None
