"""pyfuse3 Operations for a Tree: FUSE requests in, bytes out. The only place errors become errnos.

Every handler runs on pyfuse3's one trio thread. Tensor reads answer with a memoryview slice of
the shard's mmap, never a copy: the kernel copies straight from the mapping, and a shard truncated
under the mount costs the reader an EIO instead of killing the daemon with SIGBUS. The daemon
itself touches no mapped byte: hashing reads the files (see Hasher).

Shards are watched (watch.py). Before a tensor's bytes are served, every change seen so far is
applied: without a manifest a shard changed in place is no longer the validated file, and its
tensors answer EIO until remounted; with one, its tensors are verified again before another of
their bytes is served. Either way the kernel is told to drop what it cached of them.
"""

from __future__ import annotations

import errno
import functools
import inspect
import json
import logging
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio

from ..errors import ShardChangedError, TensorfsError, printable
from ..integrity import HASH_WORKERS, Integrity, TensorCorrupt
from ..sources.shard import ShardData, ShardKey, hold
from ..views import Companion, Piece, SynthesizedFile
from .stats import Stats
from .tree import ROOT_INODE, Attributes, Kind, NoSuchEntry, Tree
from .watch import Change, ShardWatch

log = logging.getLogger(__name__)

# The tree never changes while mounted: let the kernel cache names, attributes and pages for long
# (when a shard does change, the daemon tells the kernel to drop what it holds of it).
CACHE_TIMEOUT = 24 * 3600.0
DEFAULT_PREFETCH = 32 << 20
SMALL_TENSOR = 1 << 20
"""Tensors up to this size are read without a worker thread when their pages are in memory already."""
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


STATS_NAME = "stats.json"
"""The .tensorfs/ file of the daemon's counters: a snapshot made at each open."""


def stats_json(stats: Stats) -> bytes:
    return (json.dumps(stats.snapshot(), indent=1) + "\n").encode()


class _Refused(TensorfsError):
    """A request refused with EIO, the reason already logged."""


# Domain errors -> errno. Anything not listed (a bug) is logged with its traceback and answered EIO.
_ERRNO_OF: dict[type[TensorfsError], int] = {NoSuchEntry: errno.ENOENT, TensorCorrupt: errno.EIO, _Refused: errno.EIO}

TRACE_REQUESTS = False
"""Log every request at DEBUG (mount --debug); off, it costs one test of this flag per request."""

P = ParamSpec("P")
R = TypeVar("R")


def handler(method: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn what a handler raises into the errno FUSE answers; never let it end the daemon."""
    describe = _describer(method)

    op = method.__name__

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if TRACE_REQUESTS:
            log.debug("%s", describe(args))
        stats: Stats = args[0].stats  # type: ignore[attr-defined]
        stats.request(op)
        try:
            return await method(*args, **kwargs)
        except pyfuse3.FUSEError as exc:
            stats.error(op, exc.errno)
            raise
        except TensorfsError as exc:
            code = _ERRNO_OF.get(type(exc))
            if code is None:
                code = errno.EIO
                fields = {"op": op, "errno": "EIO", **getattr(exc, "fields", {})}
                log.error("%s: %s (EIO)", describe(args), exc, extra={"fields": fields})
            stats.error(op, code)
            raise pyfuse3.FUSEError(code) from None
        except Exception:
            log.exception("bug in %s; answered EIO", describe(args), extra={"fields": {"op": op, "errno": "EIO"}})
            stats.error(op, errno.EIO)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return wrapper


def _describer(method: Callable[..., Any]) -> Callable[[tuple[Any, ...]], str]:
    """A function that shows a request as `read(fh=12 'w', off=0, size=131072)`: its fields, not reprs."""
    names = list(inspect.signature(method).parameters)[1:]  # after self

    def describe(args: tuple[Any, ...]) -> str:
        operations, fields = args[0], []
        for name, value in zip(names, args[1:], strict=False):
            if isinstance(value, pyfuse3.RequestContext):
                fields.append(f"uid={value.uid}, gid={value.gid}, pid={value.pid}")
            elif isinstance(value, bytes):
                fields.append(f"{name}={printable(value.decode('utf-8', 'backslashreplace'))!r}")
            elif name in ("inode", "fh", "parent_inode") and isinstance(operations, TensorOperations):
                fields.append(f"{name}={value}{operations.inode_label(value)}")
            elif not isinstance(value, pyfuse3.ReaddirToken):
                fields.append(f"{name}={value!r}")
        return f"{method.__name__}({', '.join(fields)})"

    return describe


def _not_implemented(op: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    """A request tensorfs has nothing to do for: ENOSYS, once, and the kernel stops sending it for
    good (fc->no_flush, no_getxattr, ...), one round trip less per file. Counted as a request, not
    as an error: it is no failure."""

    async def decline(self: TensorOperations, *_: Any, **__: Any) -> Any:
        self.stats.request(op)
        raise pyfuse3.FUSEError(errno.ENOSYS)

    decline.__name__ = op
    return decline


def _read_only(op: str) -> Callable[..., Coroutine[Any, Any, Any]]:
    """A request that would change the tree: refused with EROFS, and counted."""

    async def refuse(self: TensorOperations, *_: Any, **__: Any) -> Any:
        self.stats.request(op)
        self.stats.error(op, errno.EROFS)
        raise pyfuse3.FUSEError(errno.EROFS)

    refuse.__name__ = op
    return refuse


class TensorOperations(pyfuse3.Operations):
    """Serves one Tree, read-only."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, tree: Tree, integrity: Integrity, watch: ShardWatch | None = None) -> None:
        super().__init__()
        self.tree = tree
        self.integrity = integrity
        self.watch = watch
        """Changes to the shard files; None: nobody watches (the files are trusted not to change)."""
        self._failed: set[str] = set()
        self._hashers = trio.CapacityLimiter(HASH_WORKERS)  # hashing threads at once, over all requests
        self._spans: dict[int, _Span] = {}  # open tensor files by inode
        self._shards = {shard: _ShardState() for shard in tree.model.shards}
        # Threads populating pages: for readers waiting on their bytes, and for windows ahead.
        self._demand = trio.CapacityLimiter(8)
        self._prefetchers = trio.CapacityLimiter(2)
        self.prefetch = DEFAULT_PREFETCH
        """Bytes brought into memory ahead of a sequential reader."""
        self.nursery: trio.Nursery | None = None
        """Where background work runs; set while the daemon serves (None: no background work)."""
        self._replied: list[_Held] = []  # ranges held until their replies have gone
        self.invalidate: Callable[[Sequence[int], bool], None] | None = None
        """Tells the kernel to drop what it caches of these inodes (all, or attributes only); blocking."""
        self._invalidations: dict[ShardKey, bool] = {}  # shard -> attributes only? (still to be done)
        self._invalidating: set[ShardKey] = set()
        self._digests: dict[str, tuple[int, str]] = {}  # tensor -> (its shard's generation, sha256)
        self._hashing: dict[str, trio.Event] = {}
        self._sums: bytes | None = None
        self._summing: trio.Event | None = None  # SHA256SUMS being made: later readers wait for it
        self._sums_refused = False  # and said so in the log
        self.files = self.tree.inode_count
        self.stats = Stats(tree.model.nbytes)
        self._snapshots: dict[int, bytes] = {}  # open stats.json files: each its own snapshot
        self._next_fh = 1 << 48  # handles of those opens, above every inode

    # -- names and attributes ---------------------------------------------------------------
    def _entry(self, attributes: Attributes) -> pyfuse3.EntryAttributes:
        entry = pyfuse3.EntryAttributes()
        entry.st_ino = attributes.inode
        entry.generation = 0
        entry.entry_timeout = CACHE_TIMEOUT
        entry.attr_timeout = CACHE_TIMEOUT
        entry.st_mode = attributes.mode
        entry.st_nlink = attributes.nlink
        entry.st_uid = attributes.uid
        entry.st_gid = attributes.gid
        entry.st_rdev = 0
        entry.st_size = attributes.size
        entry.st_blksize = 1 << 20
        entry.st_blocks = -(-attributes.size // 512)
        entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = attributes.mtime_ns
        return entry

    def inode_label(self, inode: int) -> str:
        """What an inode is, for log lines: ` 'tensor'`, ` 'tensor.sha256'`, ` '.tensorfs/index.json'`."""
        try:
            node = self.tree.node(inode)
        except NoSuchEntry:
            return ""
        if node.tensor is not None:
            suffix = {Kind.META: ".meta.json", Kind.SHA256: ".sha256"}.get(node.kind, "")
            return f" {printable(node.tensor + suffix)!r}"
        if node.control is not None:
            return f" '.tensorfs/{node.control}'"
        return ""

    @handler
    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if name == b".":
            inode = parent_inode
        elif name == b"..":
            inode = self.tree.parent(parent_inode)
        else:
            inode = self.tree.lookup(parent_inode, _decode(name))
        await self._lay_out(inode)
        return self._entry(self.tree.attributes(inode))

    @handler
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        await self._lay_out(inode)
        return self._entry(self.tree.attributes(inode))

    async def _lay_out(self, inode: int, *, listing: bool = False) -> None:
        """Make the layouts of synthesized files that an answer about `inode` (or its listing) needs,
        on a worker thread: at 100k tensors one takes 0.3 s, which this thread must not spend."""
        for file in self.tree.unbuilt(inode, listing=listing):
            await trio.to_thread.run_sync(file.build)

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
        await self._lay_out(fh, listing=True)
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
        shared = None  # what the previous entry set of mode, owner and times: set again only if changed
        for name, inode, mode, size, nlink, mtime, uid, gid in tree.scan(fh, offset - 2):
            entry.st_ino = inode
            entry.st_size = size
            entry.st_blocks = -(-size // 512)
            if (mode, nlink, uid, gid, mtime) != shared:
                shared = mode, nlink, uid, gid, mtime
                entry.st_mode = mode
                entry.st_nlink = nlink
                entry.st_uid = uid
                entry.st_gid = gid
                entry.st_atime_ns = entry.st_mtime_ns = entry.st_ctime_ns = mtime
            offset += 1
            if not reply(
                token, name.encode("utf-8", "surrogateescape"), entry, offset
            ):  # a companion's may not be UTF-8
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
        if node.kind is Kind.CONTROL and node.control == STATS_NAME:
            # A fresh snapshot for each open, read with direct_io: no cached page or stale size
            # cuts it short (the data files keep the page cache).
            fh, self._next_fh = self._next_fh, self._next_fh + 1
            self._snapshots[fh] = stats_json(self.stats)
            self.stats.open_files += 1
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        if node.kind is Kind.TENSOR:
            assert node.tensor is not None
            shard = self.tree.model.locate(node.tensor)[0]
            self._check_shard(shard, node.tensor)
            await self.verify(node.tensor)
            self._span_of(node.tensor, inode)
            self.stats.opened_tensors.add(node.tensor)
        self.stats.open_files += 1
        # keep_cache: pages the kernel holds stay valid across opens; when a shard changes, the
        # daemon itself tells the kernel to drop them. Never direct_io: it would break shared mmap
        # (np.memmap) of the mounted files.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)

    @handler
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        start = time.perf_counter()
        kind, reply = await self._read(fh, off, size)
        self.stats.read(kind, len(reply), time.perf_counter() - start)
        return reply

    async def _read(self, fh: int, off: int, size: int) -> tuple[str, bytes | memoryview]:
        """What a read answers, and what kind of file it read (for the counters)."""
        span = self._spans.get(fh)
        if span is not None:
            return "tensor", await self._read_tensor(span, off, size)
        snapshot = self._snapshots.get(fh)
        if snapshot is not None:
            return "control", snapshot[off : off + size]
        node = self.tree.node(fh)
        kind = "control"
        if node.kind is Kind.SHA256:
            assert node.tensor is not None
            content = self.tree.sha256_file(fh, await self.sidecar_digest(node.tensor))
            kind = "sidecar"
        elif node.kind is Kind.VIEW:
            found = self.tree.view_file(fh)
            if isinstance(found, SynthesizedFile):
                return "view", await self._read_synthesized(found, off, size)
            if isinstance(found, Companion):  # read from its file (or through the cache), off this thread
                assert self.tree.view is not None
                read = self.tree.view.companions.read
                return "view", await trio.to_thread.run_sync(read, found.path, off, size, limiter=self._demand)
            content, kind = found, "view"
        elif node.kind is Kind.SUMS:
            content = await self.sha256sums()
        else:
            content = self.tree.small_file(fh)
            kind = "sidecar" if node.kind is Kind.META else "control"
        return kind, content[off : off + size]

    def _span_of(self, name: str, inode: int | None = None) -> _Span:
        """The open-file state of a tensor's bytes (made on first use, shared by its file and the view)."""
        inode = self.tree.tensor_inode(name) if inode is None else inode
        span = self._spans.get(inode)
        if span is None:
            shard, offset, nbytes = self.tree.model.locate(name)
            data = self.tree.model.shard_data(shard)
            span = self._spans[inode] = _Span(name, shard, data, data.view, offset, offset + nbytes)
        return span

    async def _read_synthesized(self, file: SynthesizedFile, off: int, size: int) -> bytes | memoryview:
        """Bytes of a synthesized safetensors file: within one tensor, read as that tensor's file is
        (a slice of the mapping, no copy); across tensors or the header, assembled from reads of the
        shard files (never of the mappings)."""
        pieces = list(file.pieces(off, off + size))
        if len(pieces) == 1 and isinstance(pieces[0], Piece):
            only = pieces[0]
            span = self._span_of(only.tensor)
            return await self._read_tensor(span, only.shard_offset - span.start, only.end - only.start)
        reply = bytearray()
        for piece in pieces:
            if isinstance(piece, bytes):
                reply += piece
                continue
            span = self._span_of(piece.tensor)
            self._check_shard(span.shard, span.name)
            await self.verify(span.name)
            buffer = bytearray(piece.end - piece.start)
            try:
                await trio.to_thread.run_sync(span.data.readinto, piece.shard_offset, memoryview(buffer))
            except TensorfsError as exc:
                first = piece.shard_offset - span.start
                raise _unreadable(span, first, first + len(buffer), str(exc)) from None
            self.stats.touch(span.shard, piece.shard_offset, piece.shard_offset + len(buffer))
            reply += buffer
        return bytes(reply)

    async def _read_tensor(self, span: _Span, off: int, size: int) -> memoryview:
        """A slice of the shard's mapping, its pages brought in off this thread first if need be.

        The range is held (pinned) until the reply has gone: a remote shard's cached chunks are not
        evicted from under it (a hole would read as zeros). It is let go by the next read, or within
        a second (serve.py): code that runs once this task has yielded, which is after pyfuse3 has
        sent the reply (it replies before it awaits anything). A read answered at once lets go of
        the ranges held before only once it holds its own (a reader going through a chunk keeps it,
        and its lock, from one read to the next); one that has to wait lets go of them first, so
        that no read ever waits while it holds what another may be waiting for.
        """
        previous, self._replied = self._replied, []
        try:
            return await self._answer_tensor(span, off, size, previous)
        finally:
            _let_go(previous)

    async def _answer_tensor(self, span: _Span, off: int, size: int, previous: list[_Held]) -> memoryview:
        self._check_shard(span.shard, span.name)
        if self.integrity.expected is not None and span.name not in self.integrity.verified:
            _let_go(previous)
            await self.verify(span.name)  # the shard changed since this file was opened
        low = min(span.start + off, span.end)
        high = min(low + size, span.end)
        ready = span.ready_from <= low < high <= span.ready_to
        small = span.end - span.start <= SMALL_TENSOR
        if not ready and small:
            # A small tensor already in memory (mincore) is answered at once: for many small files
            # the hop to a worker thread and back would cost more than the whole rest of the read.
            ready = span.data.resident(low, high)
        if not (ready and span.data.pin(low, high)):
            # Not known to be in memory: bring in this request, then a window ahead, off this thread.
            _let_go(previous)
            waited = time.perf_counter()
            try:
                await trio.to_thread.run_sync(hold, span.data, low, high, limiter=self._demand)
            except TensorfsError as exc:  # gone from the file, or a remote shard's bytes not fetched
                # The reader gets EIO and the daemon goes on. What was validated is never replaced
                # by anything else.
                why = "the shard shrank under the mount" if span.data.lazy_views else str(exc)
                raise _unreadable(span, low - span.start, high - span.start, why) from None
            self.stats.page_waits += 1
            self.stats.page_wait_seconds += time.perf_counter() - waited
            until = min(span.end, high + self.prefetch)
            if until > high and not await self._ensure_ahead(span, high, until, self._demand):
                until = high
            span.ready_from, span.ready_to = low, max(until, span.ready_to if span.ready_from <= low else 0)
        elif self.nursery is not None and not small and self._window_running_out(span, high):
            span.prefetching = True  # a sequential reader: fetch the window ahead meanwhile
            self.nursery.start_soon(self._prefetch, span)
        if not span.data.lazy_views:
            self._replied.append((span.data, low, high))  # nothing awaited from here to the reply
        self.stats.touch(span.shard, low, high)
        return span.view[low:high]

    def release_replied(self) -> None:
        """Let go of the ranges held for replies: call only from another task than a read's (trio's thread)."""
        replied, self._replied = self._replied, []
        _let_go(replied)

    async def _ensure_ahead(
        self, span: _Span, begin: int, until: int, limiter: trio.CapacityLimiter, *, ahead: bool = True
    ) -> bool:
        """Bring in a window ahead of a reader; a failure there is no reader's failure (yet)."""
        self.stats.prefetched(span.shard, begin, until)
        try:
            return bool(
                await trio.to_thread.run_sync(
                    functools.partial(span.data.ensure, begin, until, ahead=ahead), limiter=limiter
                )
            )
        except TensorfsError:
            return False

    def _window_running_out(self, span: _Span, high: int) -> bool:
        return span.ready_to < span.end and span.ready_to - high < self.prefetch // 2 and not span.prefetching

    async def _prefetch(self, span: _Span) -> None:
        begin, until = span.ready_to, min(span.end, span.ready_to + self.prefetch)
        try:
            # A reader that consumed its window: its source may read further ahead (ahead=False).
            done = await self._ensure_ahead(span, begin, until, self._prefetchers, ahead=False)
            if done and span.ready_from <= begin <= span.ready_to:  # still contiguous with what is ready
                span.ready_to = max(span.ready_to, until)
        finally:
            span.prefetching = False

    # -- changes to the shards --------------------------------------------------------------
    async def watch_changes(self) -> None:
        """Apply changes to the shards as they happen, between requests too (run in the nursery)."""
        self.notice_changes()  # what happened since validation is told at once, not at the first read
        if self.watch is None or self.watch.fileno() < 0:
            return
        while True:
            await trio.lowlevel.wait_readable(self.watch.fileno())
            self.notice_changes()

    def notice_changes(self, shard: ShardKey | None = None) -> None:
        """Apply every change the watch has reported, and those `shard`'s size and times show."""
        if self.watch is None:
            return
        changes = self.watch.changes()
        if shard is not None:
            changes += [(shard, change) for change in self.watch.check(shard)]
        for path, change in changes:
            self._apply(path, change)

    def _apply(self, shard: ShardKey, change: Change) -> None:
        state = self._shards[shard]
        if change is Change.ATTRIBUTES:
            if self.tree.refresh_shard(shard):  # owner, permissions or mtime: the kernel must ask again
                self._invalidate(shard, attr_only=True)
            return
        if change is Change.MOVED:
            log.info("shard %s was moved or renamed: the mount goes on serving the file it validated", _shown(shard))
            return
        if change is Change.DELETED:
            log.info("shard %s was deleted: the mount goes on serving the file it validated", _shown(shard))
            return
        state.generation += 1
        if state.changed:
            return  # refused already, and nothing of it cached since
        names = [entry[2] for entry in self.tree.model.shard_header(shard).entries]
        for name in names:
            self._digests.pop(name, None)
        if self.integrity.expected is None:
            log.error(
                "shard %s was changed in place under the mount: it is no longer the file that was "
                "validated, and its %s answer EIO until it is mounted again",
                _shown(shard),
                _tensors(len(names)),
                extra={"fields": {"shard": str(shard), "errno": "EIO"}},
            )
            state.changed = True
            self.stats.changed.add(shard)
            self._sums = None
        else:
            # Told once per burst of writes: again only once something of it was verified since.
            if shard not in self.stats.changed or not self.integrity.verified.isdisjoint(names):
                log.warning(
                    "shard %s changed under the mount: its %s verified again before any more of their bytes are served",
                    _shown(shard),
                    _tensors(len(names)) + (" are" if len(names) != 1 else " is"),
                    extra={"fields": {"shard": str(shard)}},
                )
            self.stats.changed.add(shard)
            self.integrity.verified.difference_update(names)
            self._failed.difference_update(names)
        self.tree.refresh_shard(shard)
        self._invalidate(shard, attr_only=False)

    def _invalidate(self, shard: ShardKey, *, attr_only: bool) -> None:
        """Have the kernel drop what it cached of the shard's files (or their attributes only).

        In a worker thread: dropping a page waits for a read of it in flight, which this thread
        may be the one to answer. A burst of changes costs at most one more round than one change.
        """
        if self.invalidate is None:
            return
        queued = self._invalidations.get(shard)
        self._invalidations[shard] = attr_only if queued is None else queued and attr_only
        if self.nursery is None:  # not serving (tests): at once
            self.invalidate([*self.tree.inodes_of(shard), self.tree.sums_inode], self._invalidations.pop(shard))
        elif shard not in self._invalidating:
            self._invalidating.add(shard)
            self.nursery.start_soon(self._invalidate_queued, shard)

    async def _invalidate_queued(self, shard: ShardKey) -> None:
        assert self.invalidate is not None
        try:
            while shard in self._invalidations:
                attr_only = self._invalidations.pop(shard)
                inodes = [*self.tree.inodes_of(shard), self.tree.sums_inode]
                await trio.to_thread.run_sync(self.invalidate, inodes, attr_only)
        finally:
            self._invalidating.discard(shard)

    def _check_shard(self, shard: ShardKey, name: str) -> None:
        """Refuse a tensor of a shard changed in place (no manifest): it is not what was validated."""
        self.notice_changes(shard)
        state = self._shards[shard]
        if state.changed:
            if name not in state.refused:
                state.refused.add(name)
                log.error(
                    "tensor '%s': refused (EIO): its shard %s was changed under the mount; mount it again",
                    printable(name),
                    _shown(shard),
                    extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
                )
            raise _Refused()

    # -- hashes -----------------------------------------------------------------------------
    async def digest(self, name: str) -> str:
        """The tensor's actual SHA-256, found or hashed once in a worker thread; callers share it.

        A hash begun before its shard changed is not an answer: it is made again.
        """
        shard = self.tree.model.locate(name)[0]
        state = self._shards[shard]
        while True:
            self._check_shard(shard, name)  # changed in place while it was hashed: no answer at all
            generation = state.generation
            found = self._digests.get(name)
            if found is not None and found[0] == generation:
                return found[1]
            running = self._hashing.get(name)
            if running is not None:
                await running.wait()
                if name not in self._digests:  # the hashing that was waited for failed
                    raise pyfuse3.FUSEError(errno.EIO)
                continue
            done = self._hashing[name] = trio.Event()
            try:
                digest = await trio.to_thread.run_sync(self.integrity.digest, name, limiter=self._hashers)
                self._digests[name] = (generation, digest)
            finally:
                del self._hashing[name]
                done.set()
            self.notice_changes(shard)  # a write while it was hashed is known now, if it finished
            if state.generation == generation:
                return digest

    async def sidecar_digest(self, name: str) -> str:
        """What a .sha256 sidecar says: the manifest's value when there is one, else the bytes' hash."""
        if self.integrity.expected is not None:
            return self.integrity.expected[name]
        self._check_shard(self.tree.model.locate(name)[0], name)
        return await self.digest(name)

    async def sha256sums(self) -> bytes:
        """SHA256SUMS: the manifest's values, or every tensor's hash (hashing what is not known)."""
        self.notice_changes()
        if self.integrity.expected is not None:
            if self._sums is None:
                self._sums = self.tree.sha256sums(self.integrity.expected)
            return self._sums
        changed = [shard for shard, state in self._shards.items() if state.changed]
        if changed:
            if not self._sums_refused:
                self._sums_refused = True
                log.error(
                    "SHA256SUMS: refused (EIO): shard %s was changed under the mount; mount it again",
                    _shown(changed[0]),
                )
            raise _Refused()
        if self._sums is None:
            if self._summing is not None:  # being made for another reader: share it
                await self._summing.wait()
                return await self.sha256sums()
            self._summing = trio.Event()
            try:
                self._sums = await self._make_sums()
            finally:
                self._summing.set()
                self._summing = None
        return self._sums

    async def _make_sums(self) -> bytes:
        generations = {shard: state.generation for shard, state in self._shards.items()}
        todo = [name for name in self.tree.names if name not in self._digests]
        if todo:  # many tensors: the hasher reads and hashes them in runs, in its own threads
            found = await trio.to_thread.run_sync(self.integrity.hasher.hash_all, todo)
            for name, digest in found.items():
                self._digests[name] = (generations[self.tree.model.locate(name)[0]], digest)
        for shard in self._shards:  # a write while they were hashed is known now, if it finished
            self.notice_changes(shard)
        if any(state.changed for state in self._shards.values()):
            raise _Refused()  # changed while it was hashed: logged as it was seen
        return self.tree.sha256sums({name: self._digests[name][1] for name in self.tree.names})

    async def verify(self, name: str) -> None:
        """With a manifest, serve no byte of a tensor before its hash matches: EIO when it does not."""
        expected = self.integrity.expected
        if expected is None or name in self.integrity.verified:
            return
        if name not in self._failed:
            try:
                actual = await self.digest(name)
            except ShardChangedError as exc:  # its bytes are gone: refused until the shard changes again
                if name not in self._failed:
                    self._failed.add(name)
                    shard = self.tree.model.locate(name)[0]
                    log.error(
                        "tensor '%s' cannot be verified (refused, EIO): %s",
                        printable(name),
                        exc,
                        extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
                    )
                raise _Refused() from None
            if actual == expected[name]:
                self.integrity.verified.add(name)
                self.stats.verified += 1
                return
            if name not in self._failed:
                self._failed.add(name)
                self.stats.verify_failures += 1
                shard = self.tree.model.locate(name)[0]
                log.error(
                    "tensor '%s' in shard %s does not match the manifest (sha256 %s, expected %s): refused (EIO)",
                    printable(name),
                    _shown(shard),
                    actual,
                    expected[name],
                    extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
                )
        raise TensorCorrupt(f"tensor {name!r} does not match the manifest")

    async def release(self, fh: int) -> None:
        self._snapshots.pop(fh, None)
        self.stats.open_files -= 1

    # Nothing to write back on a close; and no extended attributes (the kernel then answers
    # EOPNOTSUPP itself: `ls -l` asks two of them per file, ACL and capabilities).
    flush = _not_implemented("flush")
    getxattr = _not_implemented("getxattr")
    listxattr = _not_implemented("listxattr")

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

    # -- everything that would change the tree: refused -------------------------------------
    setattr = _read_only("setattr")
    mknod = _read_only("mknod")
    mkdir = _read_only("mkdir")
    unlink = _read_only("unlink")
    rmdir = _read_only("rmdir")
    symlink = _read_only("symlink")
    rename = _read_only("rename")
    link = _read_only("link")
    create = _read_only("create")
    write = _read_only("write")
    setxattr = _read_only("setxattr")
    removexattr = _read_only("removexattr")


@dataclass(eq=False)
class _ShardState:
    """What the daemon has seen of one shard since it was mounted."""

    generation: int = 0
    """Bumped at every change of the shard's bytes: a hash made before a change is no answer after it."""
    changed: bool = False
    """Changed in place with no manifest to check it against: its tensors are refused until remounted."""
    refused: set[str] = field(default_factory=set)
    """Tensors whose refusal is logged already."""


@dataclass(eq=False)
class _Span:
    """An open tensor file: where its bytes are, and which of them are known to be in memory."""

    name: str
    shard: ShardKey
    data: ShardData
    view: memoryview
    start: int
    end: int
    ready_from: int = 0
    ready_to: int = 0
    prefetching: bool = False


_Held = tuple[ShardData, int, int]
"""A range held (pinned) for a reply: the shard, [start, end)."""


def _let_go(held: list[_Held]) -> None:
    """Unpin the ranges held, and forget them (so that letting go twice is once)."""
    for data, low, high in held:
        data.unpin(low, high)
    held.clear()


def _unreadable(span: _Span, begin: int, end: int, why: str) -> ShardChangedError:
    """The error of a read of bytes [begin, end) of a tensor that cannot be read (its log line's fields too)."""
    error = ShardChangedError(
        f"{span.shard}: tensor '{printable(span.name)}': bytes [{begin}, {end}) of the tensor cannot be read: {why}"
    )
    error.fields = {"tensor": span.name, "shard": str(span.shard)}  # type: ignore[attr-defined]
    return error


def _shown(path: ShardKey) -> str:
    """A path in a log line: one line, whatever it holds."""
    return printable(str(path))


def _tensors(count: int) -> str:
    return f"{count} tensor{'s' * (count != 1)}"


def _decode(name: bytes) -> str:
    """A name asked for, as the tree holds names: bytes that are not UTF-8 as surrogate escapes (only a
    companion file's name may hold them)."""
    return name.decode("utf-8", "surrogateescape")


__all__ = ["ROOT_INODE", "TensorOperations", "handler"]
