"""pyfuse3 Operations for a Tree: FUSE requests in, bytes out. The only place errors become errnos.

Every handler runs on pyfuse3's one trio thread. Tensor reads answer with a memoryview slice of
the shard's mmap, never a copy: the kernel copies straight from the mapping, and a shard truncated
under the mount costs the reader an EIO instead of killing the daemon with SIGBUS.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio

from ..errors import TensorfsError
from ..integrity import HASH_WORKERS, Integrity, TensorCorrupt
from .pages import ShardPages
from .tree import ROOT_INODE, Attributes, Kind, NoSuchEntry, Tree

log = logging.getLogger(__name__)

# The files never change while mounted: let the kernel cache names, attributes and pages for long.
CACHE_TIMEOUT = 24 * 3600.0
DEFAULT_PREFETCH = 32 << 20
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT

# Domain errors -> errno. Anything not listed (a bug) is logged with its traceback and answered EIO.
_ERRNO_OF: dict[type[TensorfsError], int] = {NoSuchEntry: errno.ENOENT, TensorCorrupt: errno.EIO}

TRACE_REQUESTS = False
"""Log every request at DEBUG (mount --debug); off, it costs one test of this flag per request."""

P = ParamSpec("P")
R = TypeVar("R")


def handler(method: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn what a handler raises into the errno FUSE answers; never let it end the daemon."""

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if TRACE_REQUESTS:
            log.debug("%s%s", method.__name__, args[1:])
        try:
            return await method(*args, **kwargs)
        except pyfuse3.FUSEError:
            raise
        except TensorfsError as exc:
            code = _ERRNO_OF.get(type(exc))
            if code is None:
                log.error("%s%s: %s", method.__name__, args[1:], exc)
                raise pyfuse3.FUSEError(errno.EIO) from None
            raise pyfuse3.FUSEError(code) from None
        except Exception:
            log.exception("bug in %s%s; answered EIO", method.__name__, args[1:])
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


async def _read_only(*_: Any, **__: Any) -> Any:
    raise pyfuse3.FUSEError(errno.EROFS)


class TensorOperations(pyfuse3.Operations):
    """Serves one Tree, read-only."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, tree: Tree, integrity: Integrity) -> None:
        super().__init__()
        self.tree = tree
        self.integrity = integrity
        self._failed: set[str] = set()
        self._hashers = trio.CapacityLimiter(HASH_WORKERS)  # hashing threads at once, over all requests
        self._uid = os.getuid()
        self._gid = os.getgid()
        self._spans: dict[int, _Span] = {}  # open tensor files by inode
        self._pages: dict[Path, ShardPages] = {}
        # Threads populating pages: for readers waiting on their bytes, and for windows ahead.
        self._demand = trio.CapacityLimiter(8)
        self._prefetchers = trio.CapacityLimiter(2)
        self.prefetch = DEFAULT_PREFETCH
        """Bytes brought into memory ahead of a sequential reader."""
        self.nursery: trio.Nursery | None = None
        """Where background prefetches run; set while the daemon serves (None: no background work)."""
        self._digests: dict[str, str] = {}
        self._hashing: dict[str, trio.Event] = {}
        self._sums: bytes | None = None
        self.files = self.tree.inode_count

    # -- names and attributes ---------------------------------------------------------------
    def _entry(self, attributes: Attributes) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = attributes.inode
        entry.generation = 0
        entry.entry_timeout = CACHE_TIMEOUT
        entry.attr_timeout = CACHE_TIMEOUT
        entry.st_mode = attributes.mode
        entry.st_nlink = attributes.nlink
        entry.st_uid = self._uid
        entry.st_gid = self._gid
        entry.st_rdev = 0
        entry.st_size = attributes.size
        entry.st_blksize = 1 << 20
        entry.st_blocks = -(-attributes.size // 512)
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = attributes.mtime_ns
        return entry

    @handler
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if name == b".":
            inode = parent_inode
        elif name == b"..":
            inode = self.tree.parent(parent_inode)
        else:
            inode = self.tree.lookup(parent_inode, _decode(name))
        return self._entry(self.tree.attributes(inode))

    @handler
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self._entry(self.tree.attributes(inode))

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        """Nothing to free: inodes are fixed numbers for the life of the mount, not objects."""

    # -- directories ------------------------------------------------------------------------
    @handler
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if self.tree.node(inode).kind is not Kind.DIRECTORY:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    @handler
    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        tree = self.tree
        # One EntryAttributes serves every entry: readdir_reply copies it out at once, and making
        # 300k of them would be most of the cost of listing a large model.
        entry = self._entry(tree.attributes(fh))
        reply = pyfuse3.readdir_reply
        # Offset i + 1 follows entry i (. and .. first): the kernel resumes where it last stopped.
        offset = start_id
        if offset == 0:
            if not reply(token, b".", entry, 1):
                return
            offset = 1
        if offset == 1:
            if not reply(token, b"..", self._entry(tree.attributes(tree.parent(fh))), 2):
                return
            offset = 2
        for name, inode, mode, size, nlink, mtime in tree.scan(fh, offset - 2):
            entry.st_ino = inode
            entry.st_mode = mode
            entry.st_size = size
            entry.st_blocks = -(-size // 512)
            entry.st_nlink = nlink
            entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = mtime
            offset += 1
            if not reply(token, name.encode(), entry, offset):
                break

    async def releasedir(self, fh: int) -> None:
        pass

    # -- files ------------------------------------------------------------------------------
    @handler
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        node = self.tree.node(inode)
        if node.kind is Kind.DIRECTORY:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if node.kind is Kind.TENSOR:
            assert node.tensor is not None
            await self.verify(node.tensor)
            if inode not in self._spans:
                shard, offset, nbytes = self.tree.model.locate(node.tensor)
                view = self.tree.model.shard_view(shard)
                pages = self._pages.get(shard)
                if pages is None:
                    pages = self._pages[shard] = ShardPages(view)
                self._spans[inode] = _Span(view, pages, offset, offset + nbytes)
        # keep_cache: the bytes never change, so pages the kernel holds stay valid across opens.
        # Never direct_io: it would break shared mmap (np.memmap) of the mounted files.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)

    @handler
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        span = self._spans.get(fh)
        if span is not None:
            return await self._read_tensor(fh, span, off, size)
        node = self.tree.node(fh)
        if node.kind is Kind.SHA256:
            assert node.tensor is not None
            content = self.tree.sha256_file(fh, await self.sidecar_digest(node.tensor))
        elif node.kind is Kind.SUMS:
            if self._sums is None:
                self._sums = self.tree.sha256sums(await self.sidecar_digests())
            content = self._sums
        else:
            content = self.tree.small_file(fh)
        return content[off : off + size]

    async def _read_tensor(self, fh: int, span: _Span, off: int, size: int) -> memoryview:
        """A slice of the shard's mapping, its pages brought in off this thread first if need be."""
        low = min(span.start + off, span.end)
        high = min(low + size, span.end)
        if not span.ready_from <= low < high <= span.ready_to:
            # Not known to be in memory: bring in this request, then a window ahead, off this thread.
            if not await trio.to_thread.run_sync(span.pages.populate, low, high, limiter=self._demand):
                # The bytes are gone from the file (truncated under the mount): the reader gets EIO
                # and the daemon goes on. What was validated is never replaced by anything else.
                log.error("bytes [%d, %d) of inode %d cannot be read: shard truncated under the mount?", low, high, fh)
                raise pyfuse3.FUSEError(errno.EIO)
            until = min(span.end, high + self.prefetch)
            if until > high and not await trio.to_thread.run_sync(
                span.pages.populate, high, until, limiter=self._demand
            ):
                until = high
            span.ready_from, span.ready_to = low, max(until, span.ready_to if span.ready_from <= low else 0)
        elif self.nursery is not None and self._window_running_out(span, high):
            span.prefetching = True  # a sequential reader: fetch the window ahead meanwhile
            self.nursery.start_soon(self._prefetch, span)
        return span.view[low:high]

    def _window_running_out(self, span: _Span, high: int) -> bool:
        return span.ready_to < span.end and span.ready_to - high < self.prefetch // 2 and not span.prefetching

    async def _prefetch(self, span: _Span) -> None:
        begin, until = span.ready_to, min(span.end, span.ready_to + self.prefetch)
        try:
            done = await trio.to_thread.run_sync(span.pages.populate, begin, until, limiter=self._prefetchers)
            if done and span.ready_from <= begin <= span.ready_to:  # still contiguous with what is ready
                span.ready_to = max(span.ready_to, until)
        finally:
            span.prefetching = False

    async def digest(self, name: str) -> str:
        """The tensor's actual SHA-256, found or hashed once in a worker thread; callers share it."""
        found = self._digests.get(name)
        if found is not None:
            return found
        running = self._hashing.get(name)
        if running is not None:
            await running.wait()
            if name not in self._digests:  # the hashing that was waited for failed
                raise pyfuse3.FUSEError(errno.EIO)
            return self._digests[name]
        done = self._hashing[name] = trio.Event()
        try:
            self._digests[name] = await trio.to_thread.run_sync(self.integrity.digest, name, limiter=self._hashers)
        finally:
            del self._hashing[name]
            done.set()
        return self._digests[name]

    async def sidecar_digest(self, name: str) -> str:
        """What a .sha256 sidecar says: the manifest's value when there is one, else the bytes' hash."""
        if self.integrity.expected is not None:
            return self.integrity.expected[name]
        return await self.digest(name)

    async def sidecar_digests(self) -> Mapping[str, str]:
        """What every sidecar says (for SHA256SUMS): hashing what is not known, a few tensors at a time."""
        if self.integrity.expected is not None:
            return self.integrity.expected
        todo = iter([name for name in self.tree.names if name not in self._digests])

        async def hash_some() -> None:
            for name in todo:  # shared by the workers: each takes the next tensor
                await self.digest(name)

        async with trio.open_nursery() as nursery:
            for _ in range(HASH_WORKERS):
                nursery.start_soon(hash_some)
        return self._digests

    async def verify(self, name: str) -> None:
        """With a manifest, serve no byte of a tensor before its hash matches: EIO when it does not."""
        expected = self.integrity.expected
        if expected is None or name in self.integrity.verified:
            return
        if name not in self._failed:
            actual = await self.digest(name)
            if actual == expected[name]:
                self.integrity.verified.add(name)
                return
            if name not in self._failed:
                self._failed.add(name)
                log.error(
                    "tensor %r in shard %s does not match the manifest (sha256 %s, expected %s): refused",
                    name,
                    self.tree.model.info(name).shard,
                    actual,
                    expected[name],
                )
        raise TensorCorrupt(f"tensor {name!r} does not match the manifest")

    async def release(self, fh: int) -> None:
        pass

    async def flush(self, fh: int) -> None:
        pass

    @handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        stats = pyfuse3.StatvfsData()
        stats.f_bsize = stats.f_frsize = 4096
        stats.f_blocks = -(-self.tree.model.nbytes // 4096)
        stats.f_bfree = stats.f_bavail = 0
        stats.f_files = self.files
        stats.f_ffree = stats.f_favail = 0
        stats.f_namemax = 255
        return stats

    # -- extended attributes: there are none ------------------------------------------------
    @handler
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        self.tree.node(inode)
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    @handler
    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> Sequence[bytes]:
        self.tree.node(inode)
        return []

    # -- everything that would change the tree: refused -------------------------------------
    setattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = _read_only
    create = write = setxattr = removexattr = _read_only


@dataclass(eq=False)
class _Span:
    """An open tensor file: where its bytes are, and which of them are known to be in memory."""

    view: memoryview
    pages: ShardPages
    start: int
    end: int
    ready_from: int = 0
    ready_to: int = 0
    prefetching: bool = False


def _decode(name: bytes) -> str:
    try:
        return name.decode("utf-8")
    except UnicodeDecodeError:
        raise NoSuchEntry("name is not UTF-8") from None


__all__ = ["ROOT_INODE", "TensorOperations", "handler"]
