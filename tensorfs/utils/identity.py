"""What names a shard (a file's path, or an object's URL) and what identifies the bytes it held when
it was validated: the leaf that formats/, sources/ and the caches all build on."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import NamedTuple

ShardKey = Path | str
"""What names a shard in a model: a file's path, or an object's URL."""


def shard_name(key: ShardKey) -> str:
    """The shard's file name (what .meta.json and index.json call it)."""
    return key.name if isinstance(key, Path) else key.rstrip("/").rsplit("/", 1)[-1]


class Identity(NamedTuple):
    """What changes whenever a shard's bytes may have: a cached hash is valid for one identity only.

    For a file: device, inode, size, mtime and ctime (no one can set a ctime back, so a file
    rewritten in place and given its old mtime again still gets a new one). For an object, the
    same five numbers stand for its URL, ETag and size (see sources/remote.py).
    """

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> Identity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def key(self) -> str:
        """As one string (a key of the header cache)."""
        return ":".join(map(str, self))

    def settled(self) -> bool:
        """Whether what was read of these bytes may be remembered by this identity (see settled())."""
        return settled(max(self.mtime_ns, self.ctime_ns))


def settled(changed_ns: int) -> bool:
    """Whether something last changed at `changed_ns` (since the epoch) has been left alone for
    SETTLED_NS: a write within the tick of the last one may leave every number of an identity as it was."""
    return time.time_ns() - changed_ns >= SETTLED_NS


SETTLED_NS = 2_000_000_000
"""How long a file (or object) must have been left alone before a cache keys anything by its identity.
Timestamps can be as coarse as a second (ext3, 128-byte ext4 inodes, many NFS and SMB mounts; FAT's
mtime two), or a jiffy for ctime before Linux 6.13: a file rewritten within the same tick as it was
read keeps its identity ("racily clean", as git calls it), so nothing read within that window is kept."""
