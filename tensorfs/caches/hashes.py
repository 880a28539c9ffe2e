"""The hash cache: SHA-256 of tensors by the identity of their shard file and their byte range, so
that a model is hashed once, not at every mount or verify."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable, Mapping

from ..utils.identity import Identity
from .sqlite import SqliteCache

_FEW_SPANS = 64  # up to this many ranges, the cache is asked range by range


class HashCache(SqliteCache):
    """SHA-256 of tensors by (shard identity, offsets), in SQLite; safe for several processes at once."""

    FILE_NAME = "hashes.sqlite"
    TABLE = (
        "CREATE TABLE IF NOT EXISTS hashes (device INTEGER, inode INTEGER, size INTEGER, mtime_ns INTEGER,"
        " ctime_ns INTEGER, begin INTEGER, end INTEGER, sha256 TEXT NOT NULL,"
        " PRIMARY KEY (device, inode, size, mtime_ns, ctime_ns, begin, end)) WITHOUT ROWID"
    )
    NAME = "hash cache"

    def get_many(self, identity: Identity, spans: Iterable[tuple[int, int]]) -> dict[tuple[int, int], str]:
        """Cached hashes of the shard's byte ranges [begin, end) that have one."""
        wanted = set(spans)
        key = "device=? AND inode=? AND size=? AND mtime_ns=? AND ctime_ns=?"

        def found(connection: sqlite3.Connection) -> dict[tuple[int, int], str]:
            if len(wanted) <= _FEW_SPANS:  # a sidecar's one tensor: look it up by its key
                each = {}
                for begin, end in wanted:
                    row = connection.execute(
                        f"SELECT sha256 FROM hashes WHERE {key} AND begin=? AND end=?", (*identity, begin, end)
                    ).fetchone()
                    if row is not None:
                        each[begin, end] = row[0]
                return each
            # Many tensors of a shard (a manifest): one pass over the shard's rows beats a query each.
            rows = connection.execute(f"SELECT begin, end, sha256 FROM hashes WHERE {key}", tuple(identity)).fetchall()
            return {(begin, end): digest for begin, end, digest in rows if (begin, end) in wanted}

        return self._with_connection(found, {})

    def put_many(self, identity: Identity, hashes: Mapping[tuple[int, int], str]) -> None:
        if not hashes or not identity.settled():  # changed too lately to be told from a later change
            return

        def keep(connection: sqlite3.Connection) -> None:
            with connection:
                connection.executemany(
                    "INSERT OR REPLACE INTO hashes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                    [(*identity, begin, end, digest) for (begin, end), digest in hashes.items()],
                )

        self._with_connection(keep, None)
