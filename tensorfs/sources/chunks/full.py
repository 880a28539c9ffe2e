"""The cache's refusals for want of room, raised by its files (objects.py) and its database (records.py) alike."""

from __future__ import annotations

import errno
import sqlite3
from pathlib import Path

from ...errors import RemoteError


class CacheFull(RemoteError):
    """No room in the cache for a chunk: everything in it is in use, or its disk is full."""


class NoRoomNow(RemoteError):
    """No room in the cache at this moment, for a fetch that does not wait for some (one ahead of readers)."""


def disk_full(exc: BaseException) -> bool:
    """Whether a write failed for want of room on the cache's disk: the file's own (ENOSPC, EDQUOT),
    or SQLite's (SQLITE_FULL: "database or disk is full"), one refusal whichever wrote first."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL


def full(directory: Path, url: str | None = None) -> CacheFull:
    return CacheFull(f"{url + ': ' if url else ''}the cache disk is full ({directory})")
