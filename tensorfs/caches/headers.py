"""Validated headers remembered across runs, in SQLite: a shard unchanged since it was last
validated is neither parsed nor checked again, and neither is a model whose every file is unchanged.

A row is keyed by what identifies the bytes it was made from (a file's device, inode, size, mtime
and ctime; an object's URL, ETag and size) and holds the compact form a daemon is handed: offsets,
names, dtypes, shapes, metadata. Each row carries the SHA-256 of its kind, key and value. A row that
does not check out, or a database that cannot be read or written, is one warning and a validation
from scratch: the cache can make tensorfs faster, never make it trust anything else. Small local
headers are not kept at all (WORTH_CACHING).
"""

from __future__ import annotations

import hashlib
import logging
import sqlite3
import time
from typing import Any

import orjson

from ..formats import BEGIN, END, NAME, Entry, ShardHeader, fits_file
from ..formats.dtypes import DTYPE_NAMED
from ..utils.identity import ShardKey
from .sqlite import SqliteCache

log = logging.getLogger(__name__)

WORTH_CACHING = 32 << 10
"""A local file (shard header or index) shorter than this is read and validated afresh every time,
and a model whose shards' headers all are is checked afresh: that costs less than opening the
cache's database (docs/performance.md). Remote objects are cached whatever their size (their
bytes come over a network anyway)."""

SCHEMA = 3
"""The form of the rows: rows of another form are never read (their kind says which), only dropped in time."""

_KEEP_UNUSED = 30 * 24 * 3600.0  # a row nobody read for this long is dropped (at the next write)
_TOUCH_EVERY = 24 * 3600.0  # a row's last use is written at most this often: reads stay reads


class HeaderCache(SqliteCache):
    """Shard headers and model checks by the identity of what they were made from; safe for
    several processes at once (SQLite's WAL), and for threads (one lock)."""

    FILE_NAME = "headers.sqlite"
    TABLE = (
        "CREATE TABLE IF NOT EXISTS rows (kind TEXT, key TEXT, value BLOB NOT NULL, sha256 BLOB NOT NULL,"
        " used REAL NOT NULL, PRIMARY KEY (kind, key)) WITHOUT ROWID"
    )
    NAME = "header cache"
    WITHOUT = "validating without it"

    def shard(self, path: ShardKey, identity: str) -> ShardHeader | None:
        """The header validated earlier from the bytes `identity` names (a file's Identity.key(); an
        object's URL, ETag and size), for the shard at `path`."""
        found = self.get("shard", identity)
        if found is None:
            return None
        try:
            # Column by column, so that 100k entries are rebuilt by C loops (zip, map), not Python's.
            (file_size, data_start, metadata, begins, ends, names, dtype_names, dtypes, shapes, shape_of, format_name,
             layout) = found  # fmt: skip
            kinds = [DTYPE_NAMED[name] for name in dtype_names]
            entries: list[Entry] = list(
                zip(begins, ends, names, map(kinds.__getitem__, dtypes), map(shapes.__getitem__, shape_of), strict=True)
            )
            # Cheap checks that the layout fits the file (C-speed comparisons of the columns): a row
            # is checksummed against damage, and this catches a layout that could not be the file's.
            if not fits_file(format_name, begins, ends, data_start, file_size, layout):
                raise ValueError(f"its tensors cannot be where a {format_name} file has them")
        except (TypeError, ValueError, KeyError, IndexError) as exc:  # checksummed, yet not this form: a bug
            log.warning("header cache %s: a row of %s is unreadable (%s): validated afresh", self.directory, path, exc)
            return None
        return ShardHeader(path, file_size, data_start, entries, metadata, format_name, layout)

    def put_shard(self, identity: str, header: ShardHeader) -> None:
        kinds: dict[str, int] = {}
        shapes: dict[tuple[int, ...], int] = {}
        dtypes = [kinds.setdefault(dtype.name, len(kinds)) for _, _, _, dtype, _ in header.entries]
        shape_of = [shapes.setdefault(tuple(shape), len(shapes)) for _, _, _, _, shape in header.entries]
        value = (
            header.file_size,
            header.data_start,
            header.metadata,
            [entry[BEGIN] for entry in header.entries],
            [entry[END] for entry in header.entries],
            [entry[NAME] for entry in header.entries],
            list(kinds),
            dtypes,
            [list(shape) for shape in shapes],
            shape_of,
            header.format,
            header.layout,
        )
        self.put("shard", identity, value)

    def get(self, kind: str, key: str) -> Any:
        """The value kept under (kind, key), as JSON gave it; None when there is none (or it is bad)."""
        kind = f"{kind}/{SCHEMA}"

        def kept(connection: sqlite3.Connection) -> bytes | None:
            query = "SELECT value, sha256, used FROM rows WHERE kind=? AND key=?"
            row = connection.execute(query, (kind, key)).fetchone()
            if row is None:
                return None
            value, digest, used = row
            if not isinstance(value, bytes) or _digest(kind, key, value) != digest:
                log.warning(
                    "header cache %s: a %s row does not match its checksum: dropped, validated afresh",
                    self.directory,
                    kind,
                )
                with connection:
                    connection.execute("DELETE FROM rows WHERE kind=? AND key=?", (kind, key))
                return None
            now = time.time()
            if not isinstance(used, int | float) or now - used > _TOUCH_EVERY:
                with connection:
                    connection.execute("UPDATE rows SET used=? WHERE kind=? AND key=?", (now, kind, key))
            return value

        value = self._with_connection(kept, None)
        if value is None:
            return None
        try:
            found = orjson.loads(value)
        except orjson.JSONDecodeError:  # the checksum held: written so by a bug, not damaged since
            log.warning("header cache %s: a %s row is not JSON; validating afresh", self.directory, kind)
            return None
        return found

    def put(self, kind: str, key: str, value: Any) -> None:
        """Keep `value` (JSON) under (kind, key); a value JSON cannot hold is just not kept."""
        kind = f"{kind}/{SCHEMA}"
        try:
            data = orjson.dumps(value)
        except orjson.JSONEncodeError as exc:  # not a value JSON holds: it is just not kept
            log.debug("header cache: %s not kept: %s", kind, exc)
            return

        def keep(connection: sqlite3.Connection) -> None:
            now = time.time()
            with connection:
                connection.execute(
                    "INSERT OR REPLACE INTO rows VALUES (?, ?, ?, ?, ?)",
                    (kind, key, data, _digest(kind, key, data), now),
                )
                connection.execute("DELETE FROM rows WHERE used < ?", (now - _KEEP_UNUSED,))

        self._with_connection(keep, None)


def _digest(kind: str, key: str, value: bytes) -> bytes:
    return hashlib.sha256(f"{kind}\0{key}\0".encode("utf-8", "surrogatepass") + value).digest()
