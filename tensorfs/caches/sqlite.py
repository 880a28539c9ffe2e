"""The SQLite database of a cache (hashes, validated headers): opened on first use by each process,
shared by its threads under one lock. Any trouble with it (corrupt, unwritable, locked for too long)
turns the cache off with one warning: a cache can make tensorfs faster, never make it fail."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from ..fs.guarded import UnsafeLocation, make_private_file, private_directory

log = logging.getLogger(__name__)

T = TypeVar("T")


class SqliteCache:
    FILE_NAME = ""
    """The database's file in the cache directory."""
    TABLE = ""
    """The CREATE TABLE IF NOT EXISTS statement of its one table."""
    OBSOLETE: tuple[str, ...] = ()
    """Tables of its earlier forms, dropped when it is opened (their rows are never read)."""
    NAME = ""
    """How warnings call it ("hash cache"), and what goes on without it."""
    WITHOUT = "going on without it"

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._connection: sqlite3.Connection | None = None
        self._pid = 0
        self._disabled = directory is None

    @property
    def enabled(self) -> bool:
        return not self._disabled

    def _connect(self) -> sqlite3.Connection | None:
        """The connection (made on first use), or None when the cache is off; call with the lock held."""
        if self._disabled:
            return None
        if self._connection is not None and self._pid == os.getpid():
            return self._connection
        # A connection must never cross a fork: a child opens its own.
        assert self.directory is not None
        try:
            # This user's alone: whoever could write here could make the cache vouch for other bytes.
            private_directory(self.directory, what=f"the {self.NAME}'s directory")
            make_private_file(self.directory / self.FILE_NAME, what=f"the {self.NAME}")
            connection = sqlite3.connect(self.directory / self.FILE_NAME, timeout=5.0, check_same_thread=False)
            connection.execute("PRAGMA journal_mode=WAL")
            # A cache may lose its last rows in a power cut, never its consistency: no fsync per commit.
            connection.execute("PRAGMA synchronous=NORMAL")
            for table in self.OBSOLETE:
                connection.execute(f"DROP TABLE IF EXISTS {table}")
            connection.execute(self.TABLE)
            connection.commit()
        except (sqlite3.Error, OSError, UnsafeLocation) as exc:
            self._give_up(exc)
            return None
        self._connection, self._pid = connection, os.getpid()
        return connection

    def _with_connection(self, work: Callable[[sqlite3.Connection], T], default: T) -> T:
        """`work` done on the connection under the lock; `default` when the cache is off, or when
        SQLite fails (which turns it off)."""
        with self._lock:
            connection = self._connect()
            if connection is None:
                return default
            try:
                return work(connection)
            except sqlite3.Error as exc:
                self._give_up(exc)
                return default

    def _give_up(self, exc: Exception) -> None:
        if not self._disabled:
            log.warning("%s %s unusable, %s: %s", self.NAME, self.directory, self.WITHOUT, exc)
        self._disabled = True
        self._connection = None

    def close(self) -> None:
        with self._lock:
            if self._connection is not None and self._pid == os.getpid():
                with contextlib.suppress(sqlite3.Error):
                    self._connection.close()
            self._connection = None
