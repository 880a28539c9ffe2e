"""pyfuse3 Operations for a Tree: FUSE requests in, bytes out. The only place errors become errnos.

Every handler runs on pyfuse3's one trio thread. Whether a tensor's bytes may go out, and where
from, is the model's gate's to say (gate.py): a read is one of its plans, driven here with its
blocking steps on worker threads (hashing, fetching, opening a fallback) while other requests are
answered. What this module adds is how a mount answers: a memoryview slice of the shard's mmap,
never a copy (the kernel copies straight from the mapping, and a shard truncated under the mount
costs the reader an EIO instead of killing the daemon with SIGBUS), pages brought in off this
thread and ahead of a sequential reader, ranges held until their reply has gone. The daemon itself
touches no mapped byte: hashing reads the files (see Hasher).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar, assert_never, get_args

import pyfuse3
import trio

from ..errors import RemoteError, printable
from ..gate import Answer, Gate, Outcome, Place, Plan, StepKind, next_step
from ..proof.integrity import HASH_WORKERS
from ..sources import waits
from ..sources.fetching import lower_this_thread
from ..sources.shard import ShardData
from ..utils.names import CONTROL_DIR, STATS_NAME
from ..views import Companion, SynthesizedFile, WeightsFile
from .checks import Invalidate, MountReporter, Sums
from .failedreads import FailedReads
from .handlers import handler, not_implemented, read_only
from .readahead import DEFAULT_PREFETCH, OpenTensor, ReadAhead
from .stats import Stats
from .statsfile import StatsFile
from .tree import ROOT_INODE, Attributes, Kind, NoSuchEntry, Tree

if TYPE_CHECKING:
    from ..catalogue.fallbacks import Copy
    from ..model import Model
    from ..utils.identity import ShardKey

log = logging.getLogger(__name__)

T = TypeVar("T")

# The tree never changes while mounted: let the kernel cache names, attributes and pages for long
# (when a shard does change, the daemon tells the kernel to drop what it holds of it).
CACHE_TIMEOUT = 24 * 3600.0
FOLLOWED_TIMEOUT = 1.0
"""How long the kernel keeps a local companion's attributes: its owner and mode are followed by
looking them up again (no watch on it, as there is on a shard), within a second of a chmod."""
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT


NAME_MAX = 255
"""The longest name a directory of the tree holds, in bytes (what statfs says)."""


class TensorOperations(pyfuse3.Operations):
    """Serves one Tree, read-only, its bytes through its model's gate."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(
        self,
        tree: Tree,
        *,
        prefetch: int = DEFAULT_PREFETCH,
        invalidate: Invalidate | None = None,
        trace: bool = False,
        keep_source_pages: bool = False,
        counters: Mapping[str, Callable[[], dict[str, int | float]]] | None = None,
        others: Sequence[Model] = (),
    ) -> None:
        """`prefetch`: bytes brought into memory ahead of a sequential reader; `invalidate`: how the
        kernel is told to drop what it caches (see MountReporter); `trace`: log every request
        (--debug); `counters`: more counters for stats.json and the metrics, by the name of what
        counts; `keep_source_pages`: leave the sources' pages in memory once the kernel holds what
        was read of them in the mounted files' pages (two copies of each byte read); `others`: the
        models whose files the view serves besides the tree's (the other weights files of its folder)."""
        super().__init__()
        self.tree = tree
        self.gate = tree.model.gate
        self.gates = [self.gate, *(other.gate for other in others)]
        """Every gate whose bytes the mount serves: the tree's model's first."""
        self.stats = Stats(tree.model.nbytes)
        self.stats.signature = self.gate.integrity.signature()  # what the mount is held to, if signed
        self.stats.sources.update(counters or {})
        self.reporter = MountReporter(tree, self.stats, invalidate)
        for gate in self.gates:
            gate.reporter = self.reporter
            gate.fingerprint_served()  # a chmod of a shard then ends no reader (gate/changes.py)
        self.sums = Sums(tree, self.gate, self._drive)
        self.reporter.on_change = self.sums.forget
        self.read_ahead = ReadAhead(self.stats, prefetch, lambda: self._nursery)
        self.trace = trace
        self.hand_over = not keep_source_pages
        self._spans: dict[int, OpenTensor] = {}  # open tensor files by inode
        self._other_spans: dict[tuple[int, str], OpenTensor] = {}  # the others' tensors the view serves, by gate
        # Threads for each kind of blocking step of the gate's plans: readers waiting on their bytes
        # (and the window ahead of them), hashing, switching to fallbacks; and windows ahead of readers.
        self._limiters = {kind: trio.CapacityLimiter(_threads_for(kind)) for kind in get_args(StepKind)}
        self._nursery: trio.Nursery | None = None
        self._checking: set[Gate] = set()  # gates whose held shards are being checked
        # Work that may wait while readers are served: the CRCs of what they were served, first of all.
        self._background = ThreadPoolExecutor(1, "background", initializer=lower_this_thread, initargs=(19,))
        self._background.submit(int)  # its thread made now: the daemon's threads are then those it keeps
        self.stats.sources["fingerprints"] = lambda: {
            "pending_bytes": sum(g.fingerprints_pending() for g in self.gates)
        }
        self._replied: list[_Held] = []  # ranges replied from: held (remote), then let go of
        self.files = self.tree.inode_count
        self.stats_file = StatsFile(self.stats)
        """stats.json: a snapshot each open, its size true (statsfile.py)."""
        self._stats_inode = _inode_of(tree, CONTROL_DIR, STATS_NAME)
        self._next_fh = 1 << 48  # handles of those opens, above every inode
        self.failed_reads = FailedReads()
        """Reads that failed waiting on a store, answering the readers the kernel held behind them."""

    @property
    def nursery(self) -> trio.Nursery | None:
        """Where background work runs; set while the daemon serves (None: no background work)."""
        return self._nursery

    @nursery.setter
    def nursery(self, nursery: trio.Nursery | None) -> None:
        self._nursery = nursery
        self.reporter.serving(nursery)

    async def watch_changes(self) -> None:
        """Apply changes to the files as they happen, between requests too (run in the nursery)."""
        self.notice_changes()  # what happened since validation is told at once, not at the first read
        # The gates' watches share one descriptor (sources/watch.py): waited on once, it tells of all.
        descriptors = {gate.watch_fd() for gate in self.gates} - {-1}
        async with trio.open_nursery() as nursery:
            for fd in descriptors:
                nursery.start_soon(self._watch, fd)

    async def _watch(self, fd: int) -> None:
        while True:
            await trio.lowlevel.wait_readable(fd)
            self.notice_changes()

    def notice_changes(self) -> None:
        """Apply every change to the files reported so far, of every gate; a shard held by one (its
        status changed: gate/changes.py) is checked at once, off this thread, not at its next read:
        what a reader's pages hold of it must be dropped soon if its bytes did change."""
        for gate in self.gates:
            gate.notice_changes()
            if self.nursery is not None and gate not in self._checking and gate.held_shards():
                self._checking.add(gate)
                self.nursery.start_soon(self._check_held, gate)

    async def _check_held(self, gate: Gate) -> None:
        try:
            while gate.held_shards():
                await trio.to_thread.run_sync(gate.check_held, limiter=self._limiters["verify"])
        except Exception as exc:  # a failure to read is the next reader's to meet
            log.warning("could not check a changed shard: %s", printable(str(exc)))
        finally:
            self._checking.discard(gate)

    def flush_sources(self) -> None:
        """Fingerprint the bytes served since (gate/fingerprints.py), record what was fetched for remote
        shards, and let go of the sources' pages served (blocking): on a thread of the lowest priority,
        the bytes' pages let go only once they are fingerprinted."""
        self._background.submit(self._flush).result()

    def _flush(self) -> None:
        for gate in self.gates:
            gate.fingerprint_pending()
            gate.tables.flush()

    def close(self) -> None:
        """Stop the background thread (its work done)."""
        self._background.shutdown(wait=True)

    async def _drive(self, plan: Plan[T], held: list[_Held] | None = None) -> T:
        """Run one of the gate's plans as gate.run() does (next_step, Outcome.of): its quick steps
        here, its blocking ones on worker threads (each kind on its own bounded threads), letting go
        of `held` before any of them: no request waits while it holds what another may be waiting for."""
        with contextlib.closing(plan), waits.request():  # its steps' waits: one timeout from here (waits.py)
            outcome = Outcome()
            while True:
                step = next_step(plan, outcome)
                if isinstance(step, Answer):
                    return step.value
                if held:
                    self._let_go(held)
                kind, call = step
                self.stats.steps[kind] = self.stats.steps.get(kind, 0) + 1
                outcome = await trio.to_thread.run_sync(Outcome.of, call, limiter=self._limiters[kind])

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
        if attributes.inode == self._stats_inode:  # its size as it is now, asked again each time
            self.stats_file.snapshot()
            entry.st_size = self.stats_file.size
            entry.entry_timeout = entry.attr_timeout = 0
        elif attributes.kind is Kind.VIEW and self.tree.followed(attributes.inode) is not None:
            entry.entry_timeout = entry.attr_timeout = FOLLOWED_TIMEOUT  # (nothing watches it: asked again)
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
        elif len(name) > NAME_MAX:  # as statfs says: callers test for ENAMETOOLONG, not ENOENT
            raise pyfuse3.FUSEError(errno.ENAMETOOLONG)
        else:
            inode = self.tree.lookup(parent_inode, _decode(name))
        await self._up_to_date(inode)
        return self._entry(self.tree.attributes(inode))

    @handler
    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        await self._up_to_date(inode)
        return self._entry(self.tree.attributes(inode))

    async def _up_to_date(self, inode: int, *, listing: bool = False) -> None:
        """Before an answer about `inode` (or its listing): every change to the files reported so far
        applied (a `chmod` or `touch` of a shard that finished before the request came shows in it:
        else a lookup answered before the change was seen could leave the kernel an inode it makes
        after the change's invalidation went by), and what the answer needs made (synthesized files'
        layouts, control files' bytes) on a worker thread: at 100k tensors, or a GGUF's long arrays,
        that takes longer than this thread may stall (docs/performance.md)."""
        self.notice_changes()
        for file in self.tree.unbuilt(inode, listing=listing):
            await trio.to_thread.run_sync(file.build)
        companion = None if listing else self.tree.followed(inode)
        if companion is not None:  # its owner and mode as they are now, as a shard's are
            await trio.to_thread.run_sync(self.tree.follow, companion)

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
        await self._up_to_date(fh, listing=True)
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
            if inode == self._stats_inode:  # its own attributes: never cached
                offset += 1
                if not reply(token, name.encode(), self._entry(tree.attributes(inode)), offset):
                    break
                continue
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
        self.failed_reads.opened(inode)  # a new reader: what failed is asked for again
        if flags & _WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        if node.kind is Kind.CONTROL and node.control == STATS_NAME:
            # A fresh snapshot for each open, every change reported so far in it; read with direct_io:
            # never queued behind readers' read-ahead (the kernel's background requests, which a store
            # that stalls holds for a timeout), and no cached page keeps an old snapshot (statsfile.py).
            self.notice_changes()
            fh, self._next_fh = self._next_fh, self._next_fh + 1
            self.stats_file.opened(fh)
            self.stats.open_files += 1
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        if node.kind is Kind.TENSOR:
            assert node.tensor is not None
            self._span_of(node.tensor, inode)
            await self._drive(self.gate.admit(node.tensor))  # refused (EIO) at open, if it is to be
            self.stats.opened_tensors.add(node.tensor)
        self.stats.open_files += 1
        # keep_cache: pages the kernel holds stay valid across opens; when a shard changes, the
        # daemon itself tells the kernel to drop them. Never direct_io: it would break shared mmap
        # (np.memmap) of the mounted files.
        return pyfuse3.FileInfo(fh=inode, keep_cache=True, direct_io=False)

    @handler
    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:  # type: ignore[override]
        start = time.perf_counter()
        self.failed_reads.check(fh, off, size)  # (the kernel's next reader of a page that just failed)
        try:
            kind, reply = await self._read(fh, off, size)
        except RemoteError as exc:
            if not self._may_heal(fh):
                self.failed_reads.failed(fh, off, size, exc)
            raise
        self.stats.read(kind, len(reply), time.perf_counter() - start)
        return reply

    def _may_heal(self, fh: int) -> bool:
        """Whether the next read of a file may be answered from elsewhere (its model has fallbacks):
        its failure then answers no other read."""
        span = self._spans.get(fh)
        if span is not None:
            return span.gate.fallbacks is not None
        try:
            found = self.tree.view_file(fh)
        except NoSuchEntry:
            return False
        return isinstance(found, SynthesizedFile | WeightsFile) and found.gate.fallbacks is not None

    async def _read(self, fh: int, off: int, size: int) -> tuple[str, bytes | memoryview]:
        """What a read answers, and what kind of file it read (for the counters)."""
        span = self._spans.get(fh)
        if span is not None:
            return "tensor", await self._read_tensor(span, off, size)
        snapshot = self.stats_file.read(fh, off, size)
        if snapshot is not None:
            return "control", snapshot
        node = self.tree.node(fh)
        kind = "control"
        if node.kind is Kind.SHA256:
            assert node.tensor is not None
            content = self.tree.sha256_file(fh, await self.sums.sidecar_digest(node.tensor))
            kind = "sidecar"
        elif node.kind is Kind.VIEW:
            found = self.tree.view_file(fh)
            if isinstance(found, SynthesizedFile | WeightsFile):
                return "view", await self._read_made_of_tensors(found, off, size)
            if isinstance(found, Companion):  # read from its file (or through the cache), off this thread
                assert self.tree.view is not None
                read = functools.partial(self.tree.view.companions.read, found.path, off, size)
                return "view", await trio.to_thread.run_sync(read, limiter=self._limiters["read"])
            content, kind = found, "view"
        elif node.kind is Kind.SUMS:
            content = await self.sums.sha256sums()
        else:
            content = self.tree.small_file(fh)
            kind = "sidecar" if node.kind is Kind.META else "control"
        return kind, content[off : off + size]

    def _span_of(self, name: str, inode: int | None = None) -> OpenTensor:
        """The open-file state of a tensor's bytes (made on first use, shared by its file and the view)."""
        inode = self.tree.tensor_inode(name) if inode is None else inode
        span = self._spans.get(inode)
        if span is None:
            shard, offset, _ = self.tree.model.locate(name)
            span = self._spans[inode] = OpenTensor(name, shard, offset, self.gate)
        return span

    def _view_span(self, file: SynthesizedFile | WeightsFile, name: str) -> OpenTensor:
        """The open-file state of a tensor a file of the view serves: the tree's own when the file is
        of the tree's model, else one of its own model's (made on first use)."""
        if file.gate is self.gate:
            return self._span_of(name)
        key = (id(file.gate), name)
        span = self._other_spans.get(key)
        if span is None:
            shard, offset, _ = file.model.locate(name)
            span = self._other_spans[key] = OpenTensor(name, shard, offset, file.gate)
        return span

    async def _read_made_of_tensors(
        self, file: SynthesizedFile | WeightsFile, off: int, size: int
    ) -> bytes | memoryview:
        """Bytes of a file of the view made of tensors (synthesized, or a weights file served as it
        is): within one tensor, read as that tensor's file is (a slice of the mapping, no copy);
        across tensors, the header or the bytes no tensor holds, assembled by one plan of the file's
        gate (reads of the shard files, never of the mappings: the tensors of one file read together,
        gate/spans.py)."""
        end = min(off + size, file.size)
        only = file.within(off, end)
        if only is not None:
            span = self._view_span(file, only.tensor)
            return await self._read_tensor(span, only.shard_offset - span.origin, only.end - only.start)
        buffer = bytearray(max(0, end - off))
        for served in await self._drive(file.read(off, memoryview(buffer))):
            self._count(served.shard, served.origin, served.origin + served.high - served.low, served.copy)
            if self.hand_over:  # a copy: the kernel will hold it, the source's pages may go
                served.data.served(served.low, served.high)
        return memoryview(buffer)

    async def _read_tensor(self, span: OpenTensor, off: int, size: int) -> memoryview:
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
            present = functools.partial(self.read_ahead.present, span)
            grant = await self._drive(span.gate.read(span.name, off, off + size, present), previous)
        finally:
            self._let_go(previous)
        place, low, high = grant.place, grant.low, grant.high
        self._touch(span, place, low, high)
        if grant.copied is not None:  # bytes of a remote chunk still coming, copied as they came
            if self.hand_over:
                place.data.served(low, high)
            return memoryview(grant.copied)
        if place.data.needs_ensure or self.hand_over:
            self._replied.append((place.data, low, high))  # nothing awaited from here to the reply
        return place.data.view[low:high]

    def _touch(self, span: OpenTensor, place: Place, low: int, high: int) -> None:
        """Count [low, high) of the place served (by the tensor's place in its own shard)."""
        self._count(span.shard, span.in_shard(place, low), span.in_shard(place, high), place.copy)

    def _count(self, shard: ShardKey, start: int, end: int, copy: Copy | None) -> None:
        """Count bytes [start, end) of a shard's own file served, had from `copy` if a fallback's."""
        self.stats.touch(shard, start, end)
        if copy is not None:
            self.stats.from_fallback(copy.source, end - start)

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

    async def release(self, fh: int) -> None:
        self.stats_file.released(fh)
        self.stats.open_files -= 1

    # Nothing to write back on a close; and no extended attributes (the kernel then answers
    # EOPNOTSUPP itself: `ls -l` asks two of them per file, ACL and capabilities).
    flush = not_implemented("flush")
    getxattr = not_implemented("getxattr")
    listxattr = not_implemented("listxattr")

    @handler
    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        stats = pyfuse3.StatvfsData()
        stats.f_bsize = stats.f_frsize = 4096
        stats.f_blocks = -(-self.tree.model.nbytes // 4096)
        stats.f_bfree = stats.f_bavail = 0
        stats.f_files = self.files
        stats.f_ffree = stats.f_favail = 0
        stats.f_namemax = NAME_MAX
        return stats

    # -- everything that would change the tree: refused -------------------------------------
    setattr = read_only("setattr")
    mknod = read_only("mknod")
    mkdir = read_only("mkdir")
    unlink = read_only("unlink")
    rmdir = read_only("rmdir")
    symlink = read_only("symlink")
    rename = read_only("rename")
    link = read_only("link")
    create = read_only("create")
    write = read_only("write")
    setxattr = read_only("setxattr")
    removexattr = read_only("removexattr")


def _threads_for(kind: StepKind) -> int:
    """How many of the mount's worker threads make steps of this kind at once."""
    match kind:
        case "present" | "read" | "ahead":  # readers waiting on their bytes, and windows ahead of them
            return 8
        case "verify":
            return HASH_WORKERS
        case "switch":  # opening and hashing fallbacks
            return 2
        case _:
            assert_never(kind)


_Held = tuple[ShardData, int, int]
"""A range a reply was made from (pinned, for a remote shard): the shard, [start, end)."""


def _inode_of(tree: Tree, *path: str) -> int:
    """The inode of a path of the tree (-1: none)."""
    inode = ROOT_INODE
    try:
        for name in path:
            inode = tree.lookup(inode, name)
    except NoSuchEntry:
        return -1
    return inode


def _decode(name: bytes) -> str:
    """A name asked for, as the tree holds names: bytes that are not UTF-8 as surrogate escapes (only a
    companion file's name may hold them)."""
    return name.decode("utf-8", "surrogateescape")


__all__ = ["ROOT_INODE", "TensorOperations", "handler"]
