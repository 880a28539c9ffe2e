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
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import pyfuse3
import trio

from ..errors import IntegrityError, ShardChangedError, TensorfsError, printable
from ..fallback import Copy
from ..integrity import Integrity
from ..names import STATS_NAME
from ..sources.shard import ShardData, ShardKey
from ..sources.store import RemoteError
from ..views import Companion, Piece, SynthesizedFile
from .stats import Stats
from .tree import ROOT_INODE, Attributes, Kind, NoSuchEntry, Tree
from .verifier import Invalidate, Refused, Verifier
from .watch import ShardWatch

log = logging.getLogger(__name__)

# The tree never changes while mounted: let the kernel cache names, attributes and pages for long
# (when a shard does change, the daemon tells the kernel to drop what it holds of it).
CACHE_TIMEOUT = 24 * 3600.0
DEFAULT_PREFETCH = 32 << 20
SMALL_TENSOR = 1 << 20
"""Tensors up to this size are read without a worker thread when their pages are in memory already."""
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


"""The .tensorfs/ file of the daemon's counters: a snapshot made at each open."""


def stats_json(stats: Stats) -> bytes:
    return (json.dumps(stats.snapshot(), indent=1) + "\n").encode()


# Domain errors -> errno. Anything not listed (a bug) is logged with its traceback and answered EIO.
_ERRNO_OF: dict[type[TensorfsError], int] = {NoSuchEntry: errno.ENOENT, IntegrityError: errno.EIO, Refused: errno.EIO}

P = ParamSpec("P")
R = TypeVar("R")


def handler(method: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, Coroutine[Any, Any, R]]:
    """Turn what a handler raises into the errno FUSE answers; never let it end the daemon."""
    describe = _describer(method)

    op = method.__name__

    @functools.wraps(method)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if args[0].trace:  # type: ignore[attr-defined]  # (off, one test of a flag per request)
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

    def __init__(
        self,
        tree: Tree,
        integrity: Integrity,
        watch: ShardWatch | None = None,
        *,
        prefetch: int = DEFAULT_PREFETCH,
        invalidate: Invalidate | None = None,
        trace: bool = False,
        keep_source_pages: bool = False,
        counters: Mapping[str, Callable[[], dict[str, int | float]]] | None = None,
    ) -> None:
        """`prefetch`: bytes brought into memory ahead of a sequential reader; `invalidate`: how the
        kernel is told to drop what it caches (see Verifier); `trace`: log every request (--debug);
        `counters`: more counters for stats.json and the metrics, by the name of what counts;
        `keep_source_pages`: leave the sources' pages in memory once the kernel holds what was read
        of them in the mounted files' pages (two copies of each byte read)."""
        super().__init__()
        self.tree = tree
        self.stats = Stats(tree.model.nbytes)
        self.stats.sources.update(counters or {})
        self.verifier = Verifier(tree, integrity, self.stats, watch, invalidate)
        self.prefetch = prefetch
        self.trace = trace
        self.hand_over = not keep_source_pages
        self._spans: dict[int, _OpenTensor] = {}  # open tensor files by inode
        # Threads populating pages: for readers waiting on their bytes, and for windows ahead.
        self._demand = trio.CapacityLimiter(8)
        self._prefetchers = trio.CapacityLimiter(2)
        self._switchers = trio.CapacityLimiter(2)  # switches to fallbacks (one at a time, in the model)
        self._nursery: trio.Nursery | None = None
        self._replied: list[_Held] = []  # ranges replied from: held (remote), then let go of
        self.files = self.tree.inode_count
        self._snapshots: dict[int, bytes] = {}  # open stats.json files: each its own snapshot
        self._next_fh = 1 << 48  # handles of those opens, above every inode

    @property
    def nursery(self) -> trio.Nursery | None:
        """Where background work runs; set while the daemon serves (None: no background work)."""
        return self._nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery | None) -> None:
        self._nursery = self.verifier.nursery = nursery

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
        """Make what an answer about `inode` (or its listing) needs (synthesized files' layouts,
        control files' bytes) on a worker thread: at 100k tensors, or a GGUF's long arrays, that takes
        longer than this thread may stall (docs/performance.md)."""
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
            await self._checked(self._span_of(node.tensor, inode))
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
            content = self.tree.sha256_file(fh, await self.verifier.sidecar_digest(node.tensor))
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
            content = await self.verifier.sha256sums()
        else:
            content = self.tree.small_file(fh)
            kind = "sidecar" if node.kind is Kind.META else "control"
        return kind, content[off : off + size]

    def _span_of(self, name: str, inode: int | None = None) -> _OpenTensor:
        """The open-file state of a tensor's bytes (made on first use, shared by its file and the view)."""
        inode = self.tree.tensor_inode(name) if inode is None else inode
        span = self._spans.get(inode)
        if span is None:
            shard, offset, nbytes = self.tree.model.locate(name)
            data = self.tree.model.shard_data(shard)
            span = self._spans[inode] = _OpenTensor(name, shard, data, data.view, offset, offset + nbytes, offset)
        return span

    # -- fallbacks ----------------------------------------------------------------------------
    async def _checked(self, span: _OpenTensor) -> None:
        """What must hold before a tensor's bytes are served: its shard not changed in place (without
        a manifest), its bytes verified (with one); else its fallback's copy, checked so."""
        model = self.tree.model
        while span.copy is None:
            try:
                failing = model.failing(span.shard, span.start, span.end)
                if failing is not None:
                    raise failing  # to its fallback at once
                self.verifier.check(span.shard, span.name)
                await self.verifier.verify(span.name)
                return
            except (TensorfsError, pyfuse3.FUSEError) as exc:
                if isinstance(exc, RemoteError | ShardChangedError):  # its bytes could not be read to hash
                    model.failed(span.shard)
                if not await self._fall_back(span, exc):
                    raise

    async def _fall_back(self, span: _OpenTensor, why: BaseException) -> bool:
        """Serve the tensor from its next fallback from now on, if it has one that gives its bytes (see
        Model.switch: on a worker thread, a fallback may be opened, and its copy fetched and hashed)."""
        model = self.tree.model
        if model.fallbacks is None or not _unreadable_error(why):
            return False
        expected = self.verifier.integrity.expected
        switch = functools.partial(
            model.switch, span.name, why, span.copy, expected.get(span.name) if expected is not None else None
        )
        try:
            copy = await trio.to_thread.run_sync(switch, limiter=self._switchers)
        except BaseException as exc:
            if exc is why or isinstance(exc, TensorfsError | OSError):
                return False  # no fallback gives it: the reader gets the primary's error
            raise
        span.copy, span.data, span.view, span.start, span.end = copy, copy.data, copy.data.view, copy.start, copy.end
        span.ready_from = span.ready_to = 0
        self.stats.fallback_tensors[span.name] = copy.source
        return True

    async def _read_synthesized(self, file: SynthesizedFile, off: int, size: int) -> bytes | memoryview:
        """Bytes of a synthesized safetensors file: within one tensor, read as that tensor's file is
        (a slice of the mapping, no copy); across tensors or the header, assembled from reads of the
        shard files (never of the mappings)."""
        pieces = list(file.pieces(off, off + size))
        if len(pieces) == 1 and isinstance(pieces[0], Piece):
            only = pieces[0]
            span = self._span_of(only.tensor)
            return await self._read_tensor(span, only.shard_offset - span.origin, only.end - only.start)
        reply = bytearray()
        for piece in pieces:
            if isinstance(piece, bytes):
                reply += piece
            else:
                reply += await self._copied(self._span_of(piece.tensor), piece)
        return bytes(reply)

    async def _copied(self, span: _OpenTensor, piece: Piece) -> bytearray:
        """A piece of a tensor's bytes, read from its file (never the mapping), checked first; from its
        fallback when its own shard cannot give them."""
        first = piece.shard_offset - span.origin  # where in the tensor
        buffer = bytearray(piece.end - piece.start)
        while True:
            await self._checked(span)
            data, low = span.data, span.start + first
            try:
                await trio.to_thread.run_sync(data.readinto, low, memoryview(buffer))
                break
            except (TensorfsError, OSError) as exc:
                error = _unreadable(span, first, first + len(buffer), str(exc))
                if not await self._fall_back(span, error):
                    raise error from None
        self._touch(span, low, low + len(buffer))
        if self.hand_over:  # a copy: the kernel will hold it, the source's pages may go
            data.served(low, low + len(buffer))
        return buffer

    async def _read_tensor(self, span: _OpenTensor, off: int, size: int) -> memoryview:
        """A slice of the shard's mapping, its pages brought in off this thread first if need be (or,
        for a remote chunk still coming, a copy of the bytes asked for once they have come).

        The range is held (pinned) until the reply has gone: a remote shard's cached chunks are not
        evicted from under it (a hole would read as zeros). It is let go by the next read, or within
        a second (serve.py): code that runs once this task has yielded, which is after pyfuse3 has
        sent the reply (it replies before it awaits anything). A read answered at once lets go of
        the ranges held before only once it holds its own (a reader going through a chunk keeps it,
        and its lock, from one read to the next); one that has to wait lets go of them first, so
        that no read ever waits while it holds what another may be waiting for. Once let go, a range
        is the kernel's to keep (in the mounted file's pages): the source's pages of it may go.
        """
        previous, self._replied = self._replied, []
        try:
            while True:
                try:
                    return await self._answer_tensor(span, off, size, previous)
                except (TensorfsError, pyfuse3.FUSEError) as exc:
                    self._let_go(previous)
                    if not await self._fall_back(span, exc):
                        raise
        finally:
            self._let_go(previous)

    async def _answer_tensor(self, span: _OpenTensor, off: int, size: int, previous: list[_Held]) -> memoryview:
        if span.copy is None:
            failing = self.tree.model.failing(span.shard, span.start + off, min(span.start + off + size, span.end))
            if failing is not None:
                raise failing  # to its fallback at once
            self.verifier.check(span.shard, span.name)
            if self.verifier.needs_verifying(span.name):
                self._let_go(previous)
                await self.verifier.verify(span.name)  # the shard changed since this file was opened
        # Where the bytes are had, as of now: a switch to a fallback meanwhile (another reader's)
        # changes the span, never what this read answers from.
        data, start, end = span.data, span.start, span.end
        low = min(start + off, end)
        high = min(low + size, end)
        ready = span.ready_from <= low < high <= span.ready_to
        small = end - start <= SMALL_TENSOR
        if not ready and small:
            # A small tensor already in memory (mincore) is answered at once: for many small files
            # the hop to a worker thread and back would cost more than the whole rest of the read.
            ready = data.resident(low, high)
        if not (ready and data.pin(low, high)):
            # Not known to be in memory: bring in this request, then a window ahead, off this thread.
            self._let_go(previous)
            waited = time.perf_counter()
            try:
                copied = await trio.to_thread.run_sync(data.pinned_or_copied, low, high, limiter=self._demand)
            except TensorfsError as exc:  # gone from the file, or a remote shard's bytes not fetched
                # The reader gets EIO (or its fallback's copy) and the daemon goes on. What was
                # validated is never replaced by anything else.
                why = str(exc) if data.needs_ensure else "the shard shrank under the mount"
                if span.copy is None:
                    self.tree.model.failed(span.shard)
                raise _unreadable(span, low - start, high - start, why) from None
            self.stats.page_waits += 1
            self.stats.page_wait_seconds += time.perf_counter() - waited
            if copied is not None:
                # Bytes of a remote chunk still coming, copied as they came: answered now, nothing of
                # the mapping held. No window ahead is waited for first: that kept a cold tensor's
                # first bytes waiting for four more chunks sharing the link (docs/performance.md).
                self._touch(span, low, high)
                if self.hand_over:
                    data.served(low, high)
                return memoryview(copied)
            until = min(end, data.window_end(high, self.prefetch))
            if until > high and not await self._ensure_ahead(span, data, high, until, self._demand):
                until = high
            if span.data is data:
                span.ready_from, span.ready_to = low, max(until, span.ready_to if span.ready_from <= low else 0)
        elif self.nursery is not None and not small and self._window_running_out(span, high):
            span.prefetching = True  # a sequential reader: fetch the window ahead meanwhile
            self.nursery.start_soon(self._prefetch, span)
        if data.needs_ensure or self.hand_over:
            self._replied.append((data, low, high))  # nothing awaited from here to the reply
        self._touch(span, low, high)
        return data.view[low:high]

    def _touch(self, span: _OpenTensor, low: int, high: int) -> None:
        """Count [low, high) of the span's source served (by the tensor's place in its own shard)."""
        self.stats.touch(span.shard, span.in_shard(low), span.in_shard(high))
        if span.copy is not None:
            self.stats.from_fallback(span.copy.source, high - low)

    def release_replied(self) -> None:
        """Let go of the ranges held for replies: call only from another task than a read's (trio's thread)."""
        replied, self._replied = self._replied, []
        self._let_go(replied)

    def _let_go(self, held: list[_Held]) -> None:
        """Unpin the ranges held for replies that have gone, hand them over to the kernel's pages, and
        forget them (so that letting go twice is once)."""
        for data, low, high in held:
            if data.needs_ensure:
                data.unpin(low, high)
            if self.hand_over:
                data.served(low, high)
        held.clear()

    async def _ensure_ahead(
        self,
        span: _OpenTensor,
        data: ShardData,
        begin: int,
        until: int,
        limiter: trio.CapacityLimiter,
        *,
        ahead: bool = True,
    ) -> bool:
        """Bring in a window ahead of a reader; a failure there is no reader's failure (yet)."""
        self.stats.prefetched(span.shard, span.in_shard(begin), span.in_shard(until))
        try:
            return bool(
                await trio.to_thread.run_sync(
                    functools.partial(data.ensure, begin, until, ahead=ahead), limiter=limiter
                )
            )
        except (TensorfsError, OSError):
            return False

    def _window_running_out(self, span: _OpenTensor, high: int) -> bool:
        return span.ready_to < span.end and span.ready_to - high < self.prefetch // 2 and not span.prefetching

    async def _prefetch(self, span: _OpenTensor) -> None:
        data, begin, until = span.data, span.ready_to, min(span.end, span.ready_to + self.prefetch)
        try:
            # A reader that consumed its window: its source may read further ahead (ahead=False).
            done = await self._ensure_ahead(span, data, begin, until, self._prefetchers, ahead=False)
            if done and span.data is data and span.ready_from <= begin <= span.ready_to:  # still contiguous
                span.ready_to = max(span.ready_to, until)
        finally:
            span.prefetching = False

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
class _OpenTensor:
    """An open tensor file: where its bytes are (its shard's, or a fallback's copy), and which of them
    are known to be in memory."""

    name: str
    shard: ShardKey
    """Its own shard (the model's)."""
    data: ShardData
    view: memoryview
    start: int
    end: int
    """Where its bytes are had: [start, end) of `data` (its shard's, or its fallback copy's)."""
    origin: int
    """Where its bytes start in its own shard."""
    copy: Copy | None = None
    """The fallback's copy it is served from, once it is (for the mount's life)."""
    ready_from: int = 0
    ready_to: int = 0
    prefetching: bool = False

    def in_shard(self, offset: int) -> int:
        """An offset of `data` as the offset of the same byte of the tensor in its own shard."""
        return self.origin + offset - self.start


_Held = tuple[ShardData, int, int]
"""A range a reply was made from (pinned, for a remote shard): the shard, [start, end)."""


def _unreadable(span: _OpenTensor, begin: int, end: int, why: str) -> ShardChangedError:
    """The error of a read of bytes [begin, end) of a tensor that cannot be read (its log line's fields too)."""
    where = span.shard if span.copy is None else f"{span.data.label} (fallback {span.copy.source})"
    error = ShardChangedError(
        f"{where}: tensor '{printable(span.name)}': bytes [{begin}, {end}) of the tensor cannot be read: {why}"
    )
    error.fields = {"tensor": span.name, "shard": str(span.shard)}  # type: ignore[attr-defined]
    return error


def _unreadable_error(error: BaseException) -> bool:
    """Whether a fallback may stand in for what raised `error`: the tensor's own bytes cannot be had
    (gone, changed, not fetched, refused by the manifest), not a request that is wrong."""
    if isinstance(error, pyfuse3.FUSEError):
        return error.errno == errno.EIO
    return isinstance(error, Refused | IntegrityError | ShardChangedError | RemoteError)


def _decode(name: bytes) -> str:
    """A name asked for, as the tree holds names: bytes that are not UTF-8 as surrogate escapes (only a
    companion file's name may hold them)."""
    return name.decode("utf-8", "surrogateescape")


__all__ = ["ROOT_INODE", "TensorOperations", "handler"]
