"""The floor of the stack: the least a pyfuse3 daemon does to serve a shard's tensors as files.

One file per tensor of one safetensors shard, in one flat directory, each read answered with a
memoryview slice of one mmap of the shard. Nothing else: no validation beyond parsing the header,
no page population off the trio thread, no read-ahead of its own, no counters, no hashing. The
benchmark runs it as a peer of tensorfs (`python -m tensorfs.bench.floor SHARD MOUNTPOINT`,
unmounted with `fusermount3 -u`): what tensorfs adds on top of pyfuse3 should cost nothing.

What it shares with a tensorfs mount, so that the two differ only in the daemon: pyfuse3's default
options plus `ro`, files opened with keep_cache (never direct_io), entries and attributes cached a
day, st_blksize 1 MiB. The benchmark sets the same connection knobs on it as tensorfs sets on
itself (the bdi's read_ahead_kb and fusectl's max_background).
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import stat
import struct
import sys
from pathlib import Path

import pyfuse3
import trio

CACHE_TIMEOUT = 24 * 3600.0


class FloorOperations(pyfuse3.Operations):
    def __init__(self, shard: Path) -> None:
        super().__init__()
        with open(shard, "rb") as f:
            self.mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        self.view = memoryview(self.mapping)
        (header_size,) = struct.unpack("<Q", self.mapping[:8])
        header = json.loads(self.mapping[8 : 8 + header_size])
        data_start = 8 + header_size
        mtime_ns = os.stat(shard).st_mtime_ns
        self.inodes: dict[bytes, int] = {}
        self.spans: dict[int, tuple[int, int]] = {}
        self.entries: dict[int, pyfuse3.EntryAttributes] = {
            pyfuse3.ROOT_INODE: self._entry(pyfuse3.ROOT_INODE, stat.S_IFDIR | 0o555, 0, mtime_ns)
        }
        for inode, (name, info) in enumerate(sorted(header.items()), start=pyfuse3.ROOT_INODE + 1):
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            self.inodes[name.encode()] = inode
            self.spans[inode] = (data_start + begin, data_start + end)
            self.entries[inode] = self._entry(inode, stat.S_IFREG | 0o444, end - begin, mtime_ns)

    @staticmethod
    def _entry(inode: int, mode: int, size: int, mtime_ns: int) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = inode
        entry.entry_timeout = entry.attr_timeout = CACHE_TIMEOUT
        entry.st_mode = mode
        entry.st_nlink = 2 if stat.S_ISDIR(mode) else 1
        entry.st_uid, entry.st_gid = os.getuid(), os.getgid()
        entry.st_size = size
        entry.st_blksize = 1 << 20
        entry.st_blocks = -(-size // 512)
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = mtime_ns
        return entry

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        inode = self.inodes.get(name) if parent_inode == pyfuse3.ROOT_INODE else None
        if inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self.entries[inode]

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.entries[inode]

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return inode

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        names = list(self.inodes.items())
        for position in range(start_id, len(names)):
            name, inode = names[position]
            if not pyfuse3.readdir_reply(token, name, self.entries[inode], position + 1):
                return

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if inode not in self.spans:
            raise pyfuse3.FUSEError(errno.EISDIR)
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)

    async def read(self, fh: int, off: int, size: int) -> memoryview:  # type: ignore[override]
        begin, end = self.spans[fh]
        low = min(begin + off, end)
        return self.view[low : min(low + size, end)]


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tensorfs.bench.floor SHARD MOUNTPOINT", file=sys.stderr)
        return 2
    shard, mountpoint = Path(argv[0]), argv[1]
    operations = FloorOperations(shard)
    options = set(pyfuse3.default_options) | {"ro", "fsname=tensorfs-floor", "subtype=tensorfs-floor"}
    pyfuse3.init(operations, mountpoint, options)
    try:
        trio.run(pyfuse3.main)  # returns when the mount goes away (fusermount3 -u)
    finally:
        pyfuse3.close(unmount=False)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
