"""The local cache of remote objects (chunks.py says what it promises).

chunks.py    ChunkCache: one cache directory as this process uses it: what waits for room, saving
room.py      its room: the lock every process takes to make it, its bound, what is evicted for it
objects.py   CachedObject: one object version's file: presence, pins, fetches and their checks
arrivals.py  the bytes of chunks still coming that may be answered as they land
refetched.py chunks refused in this process and had again: what they are held to, when they are proven
records.py   what is recorded in SQLite, and the checksums chunks are kept with
locks.py     the lock protocol every process keeps in the cache's files
"""

from .chunks import OBJECTS_DIR, CacheEntry, ChunkCache, default_cache_dir, object_id
from .full import CacheFull, NoRoomNow
from .objects import CachedObject, Fetch

__all__ = [
    "OBJECTS_DIR",
    "CacheEntry",
    "CacheFull",
    "CachedObject",
    "ChunkCache",
    "Fetch",
    "NoRoomNow",
    "default_cache_dir",
    "object_id",
]
