"""Remote shards: objects read through the local cache, and how a remote model's shards are opened.

A remote shard's bytes are its cache file's: mapped read-only like a local shard, and made
present chunk by chunk (GETs on the fetch threads, then madvise) before anything reads them.
A reader that keeps on where the last one stopped is sequential, however many tensor files it
opens on the way: the chunks ahead of it are fetched before it asks (the window doubles each
time, up to as many chunks as there are fetch threads), into the next shard when it reaches the
end of one; any other reader fetches only what it reads.
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import formats
from ..errors import InvalidModelError, Problem, RemoteError, ShardChangedError
from ..formats import ShardHeader
from ..utils.identity import Identity, settled
from . import waits
from .chunks import CachedObject, CacheFull, ChunkCache, NoRoomNow, default_cache_dir
from .client import head, read_first_bytes, read_range
from .fetching import COUNTERS, Fetcher, failed_future, wait
from .finding import Located, locate
from .index import missing_shard
from .pages import Handover
from .shard import ShardData, Within
from .store import ObjectRef, ObjectVersion, RemoteOptions, StoreSpec, model_key, store_spec

if TYPE_CHECKING:
    from ..caches.headers import HeaderCache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteDescription:
    """A remote shard as validated: the object version, and how this process read it (the options)."""

    version: ObjectVersion
    options: RemoteOptions


_caches: dict[tuple[str, int | None], ChunkCache] = {}
_caches_lock = threading.Lock()


def shared_cache(options: RemoteOptions) -> ChunkCache:
    """The cache that `options` name, one per process (its chunks and locks are the process's)."""
    directory = (options.cache_dir or default_cache_dir()).absolute()
    with _caches_lock:
        key = (str(directory), options.cache_size)
        cache = _caches.get(key)
        if cache is None:
            cache = _caches[key] = ChunkCache(directory, options.cache_size)
        return cache


def remember_document(url: str, options: RemoteOptions, data: bytes) -> None:
    """A small document a model is held to (its signature, a manifest), read from `url`: kept in the
    cache, for a later --offline, which asks no store anything."""
    encoded = base64.b64encode(data).decode("ascii")
    shared_cache(options).remember_model(f"{_DOCUMENT}{url}", {"document": encoded})


def remembered_document(url: str, options: RemoteOptions) -> bytes | None:
    """The document last read from `url` (remember_document), if the cache has it."""
    found = shared_cache(options).recall_model(f"{_DOCUMENT}{url}")
    encoded = found.get("document") if found is not None else None
    return base64.b64decode(encoded) if isinstance(encoded, str) else None


_DOCUMENT = "document "
"""What the cache's models table names documents by (its models are named by their URLs alone)."""


class RemoteShard(ShardData):
    """An object version, read through its cache file."""

    key: str
    needs_ensure = True

    def __init__(self, cached: CachedObject, options: RemoteOptions) -> None:
        self.cached = cached
        self.key = self.label = cached.version.url
        self.view = cached.file.view
        self.options = options
        self.wait_limit = options.timeout
        self._pool = Fetcher.pool(options.concurrency)
        self._lock = threading.Lock()
        self._frontier = -(1 << 62)  # where the run of ranges asked for so far ends
        self._run_start = self._frontier  # and where it began
        self._window = 0  # chunks fetched ahead of a sequential reader
        self._across = False  # the run went on from one tensor into the next: read ahead past its end
        self._then: tuple[RemoteShard, int] | None = None  # the shard read after this one, and where its data starts
        self._handover = Handover(cached.version.size)
        # Never so far ahead that the window evicts what the reader is on (two chunks: a read may span two).
        room = None if cached.cache.limit is None else cached.cache.limit // cached.chunk_size - 2
        self._most_ahead = options.concurrency if room is None else min(options.concurrency, room)
        version = cached.version
        mtime = int(version.mtime * 1e9)
        # The mounting user's alone, as the credentials that read it are: -o allow_other must not show
        # a private bucket to every user (-o umask= opens it up, on purpose).
        self._status = os.stat_result(
            (0o100400, 0, 0, 1, os.getuid(), os.getgid(), version.size, int(version.mtime), int(version.mtime), 0),
            {"st_atime_ns": mtime, "st_mtime_ns": mtime, "st_ctime_ns": mtime},
        )

    @classmethod
    def of(cls, version: ObjectVersion, options: RemoteOptions, header: bytes | None = None) -> RemoteShard:
        """An object version read through the cache `options` name (`header`: its first bytes, kept
        with a new object for --offline)."""
        fetch = functools.partial(read_range, version)  # the cache's way to its bytes: exactly this version
        return cls(shared_cache(options).open_object(version, header, options.chunk_size, fetch), options)

    @classmethod
    def reopen(cls, saved: RemoteDescription) -> RemoteShard:
        return cls.of(saved.version, saved.options)

    def ensure(self, start: int, end: int, *, ahead: bool = False, within: Within = None) -> bool:
        """Fetch the chunks of [start, end) that are missing (each once, however many wait), then map
        them: a window ahead of readers, which takes room only if there is some (NoRoomNow if not)."""
        if end <= start:
            return True
        first, last = self._chunks(start, end)
        waiting = [future for chunk in range(first, last + 1) if (future := self._fetch(chunk, room=False)) is not None]
        self._read_ahead(start, end, ahead, within)
        wait(waiting, self.options.timeout)
        return self.cached.file.pages.populate(start, end)

    def ensure_pinned(self, start: int, end: int, *, ahead: bool = False, within: Within = None) -> None:
        """Make [start, end) present and pin it: room for every chunk missing is claimed at once, and
        each is pinned before it is fetched (see ChunkCache.claim): readers sharing a small cache wait
        their turn instead of evicting what another is about to use."""
        if end <= start:
            return
        first, last = self._chunks(start, end)
        self.cached.ensure_pinned(first, last, self._pool, offline=self.options.offline)
        try:
            self._read_ahead(start, end, ahead, within)
            if not self.cached.file.pages.populate(start, end):
                raise ShardChangedError(f"{self.label}: bytes [{start}, {end}) cannot be read")
        except BaseException:
            self.cached.let_go(range(first, last + 1))
            raise

    def window_end(self, end: int, prefetch: int) -> int:
        """The end of the chunk the read ends in: what is beyond is the source's read-ahead's to
        fetch, and a reader that waited for a window of chunks before its next read left a distant
        link idle meanwhile (docs/performance.md)."""
        size = self.cached.chunk_size
        return max(end, -(-end // size) * size)

    def pinned_or_copied(self, start: int, end: int, *, within: Within = None) -> bytes | None:
        """A read in a chunk still coming is answered with a copy of its bytes as soon as they have
        been written, not when the whole chunk has come (see CachedObject.copy_arriving and _get for
        which chunks): a cold tensor's first bytes cost a round trip, not a chunk's transfer, nor
        that of the bytes before them in their chunk, which come after them; and a reader that
        caught up with the read-ahead (or another reader) reads each piece as it lands instead of
        stalling for a chunk's transfer (counted: `arriving_reads`). A read that begins a chunk's
        fetch does not read further ahead (its first bytes do not share the link with the window);
        one that joins a fetch under way follows its run as a reader's own request does
        (_read_ahead), so the window stays ahead of it; one across two chunks is copied so only
        where it begins no fetch itself. A fetch that fails before the read's bytes came fails the
        read, as any reader waiting on it fails (for want of room: the claim settles it)."""
        first, last = self._chunks(start, end) if end > start else (0, -1)
        chunks = range(first, last + 1)
        coming = False
        joined = [chunk for chunk in chunks if self.cached.coming(chunk)]
        # A read across chunks begins no fetch here: those it would begin are claimed and pinned
        # first (ensure_pinned), so that readers sharing a small cache wait their turn.
        across = first != last and (not joined or not all(c in joined or self.cached.present(c) for c in chunks))
        if end > start and not self.options.offline and not across:
            futures = [
                future
                for chunk in chunks
                if (future := self.cached.fetching(chunk, self._pool, reading=start if chunk == first else None))
                is not None
            ]
            if futures:
                copied = self.cached.copy_arriving(start, end, waits.deadline(self.options.timeout))
                if copied is not None:
                    if joined:
                        COUNTERS.add(arriving_reads=1)
                    self._read_ahead(start, end, not joined, within)
                    return copied
                # Not copied: the chunks have come (or are held to checksums), or a fetch failed: a
                # failure of the store's is the read's; one for want of room is the claim's to settle.
                failed = [
                    exc
                    for future in futures
                    if isinstance(exc := future.exception(), Exception) and not isinstance(exc, NoRoomNow | CacheFull)
                ]
                if failed:
                    wait([failed_future(failed[0])])  # raised as a waiter on the fetch has it raised
                coming = True
        self.ensure_pinned(start, end, ahead=coming, within=within)
        return None

    def held(self, start: int, end: int) -> bool:
        return self.missing(self.chunks_of([(start, end)])) == 0

    def pin(self, start: int, end: int) -> bool:
        return end <= start or self.cached.pin(*self._chunks(start, end))

    def unpin(self, start: int, end: int) -> None:
        if end > start:
            self.cached.unpin(*self._chunks(start, end))

    def chunks_of(self, ranges: Iterable[tuple[int, int]]) -> list[int]:
        """The chunks that hold bytes of `ranges` ([start, end) pairs), in order."""
        found: set[int] = set()
        for start, end in ranges:
            if end > start:
                first, last = self._chunks(start, end)
                found.update(range(first, last + 1))
        return sorted(found)

    def chunk_bytes(self, chunk: int) -> int:
        size = self.cached.chunk_size
        return min(size, self.cached.version.size - chunk * size)

    def _chunks(self, start: int, end: int) -> tuple[int, int]:
        size = self.cached.chunk_size
        return start // size, (end - 1) // size

    def _fetch(self, chunk: int, *, room: bool = True) -> Any:
        return self.cached.fetching(chunk, self._pool, offline=self.options.offline, room=room)

    def _read_ahead(self, start: int, end: int, ahead: bool, within: Within = None) -> None:
        """Follow the reader: fetch ahead of one that goes on where the reads so far stopped, and only
        as far as it is going.

        Every range asked for extends the run it continues (or starts a new one); a reader's own
        request that continues the run doubles the window of chunks fetched ahead of it (up to as
        many as there are fetch threads), any other resets it. A window asked for `ahead` extends
        the run without fetching further. The window stays within the tensor being read (`within`:
        its chunks, no other), unless the reader went on into it from where the tensor before ended
        (a model loaded front to back): a reader of one tensor fetches that tensor's chunks alone.
        """
        size = self.cached.chunk_size
        with self._lock:
            # Behind the frontier is the run still: a reader catching up with its own window.
            continues = self._run_start - size <= start <= self._frontier + size
            if within is not None and start == within[0] and self._frontier == start:
                self._across = True  # a tensor's first bytes, where the one before ended: a reader going on
            elif not continues:
                self._across = False
            if not continues:
                self._run_start = start
            self._frontier = max(self._frontier, end) if continues else end
            if ahead:
                return
            self._window = min(max(1, 2 * self._window), self._most_ahead) if continues else 0
            first, window = (self._frontier - 1) // size + 1, self._window
            last = self.cached.chunks if within is None or self._across else (within[1] - 1) // size + 1
            then = self._then if self._across else None  # past the end of this shard: into the next
        if self.options.offline:
            return
        for chunk in range(first, min(last, first + window)):
            # Not waited for (a failure is met again if it is read), nor for room: ahead of readers.
            self.cached.fetching(chunk, self._pool, room=False)
        if then is not None and first + window > last:
            then[0]._lead_in(then[1], first + window - last, window)

    def goes_on_into(self, then: ShardData, data_start: int) -> None:
        if isinstance(then, RemoteShard):
            self._then = then, data_start

    def _lead_in(self, start: int, chunks: int, window: int) -> None:
        """A reader going on through the shard before has its window past that shard's end: the
        first `chunks` of this one's data (from `start`) are fetched, and, unless a reader here
        has asked for more already, a run begun where the data starts, at that `window`: the
        reader's first read here continues it (going on from where the run ends, as from one
        tensor into the next) instead of starting one with no chunk ahead of it
        (docs/performance.md). Another reader's run here is its own: never taken over."""
        size = self.cached.chunk_size
        with self._lock:
            if self._frontier <= start:
                self._run_start, self._frontier, self._window = start, start, window
            first = start // size
        for chunk in range(first, min(self.cached.chunks, first + chunks)):
            self.cached.fetching(chunk, self._pool, room=False)

    def prefetch(self, progress: Callable[[int], None] | None = None, chunks: Iterable[int] | None = None) -> None:
        """Fetch every chunk not cached yet (or those of `chunks`), as many at once as there are fetch threads."""
        if self.options.offline:
            return
        wanted = range(self.cached.chunks) if chunks is None else chunks
        pending = [(chunk, self.cached.fetching(chunk, self._pool)) for chunk in wanted]
        for chunk, future in pending:
            if future is not None:
                wait([future])
            if progress is not None:
                progress(self.chunk_bytes(chunk))

    def missing(self, chunks: Iterable[int]) -> int:
        """How many of `chunks` the cache does not hold (here, or recorded by another process)."""
        return sum(not self.cached.present(chunk) for chunk in chunks)

    def readinto(self, offset: int, buffer: memoryview) -> None:
        """The bytes from the cache file (fetched first if need be), never through the mapping."""
        end = offset + len(buffer)
        self.ensure_pinned(offset, end)
        try:
            self.cached.file.readinto(offset, buffer)
        finally:
            self.unpin(offset, end)

    identity_proves_bytes = False

    def identity(self) -> Identity | None:
        # An object version never changes: URL, ETag and size stand for it (as numbers, for the hash cache).
        version = self.cached.version
        return Identity(-1, int(self.cached.id[:15], 16), version.size, int(version.mtime * 1e9), 0)

    def status(self) -> os.stat_result:
        return self._status

    def hold_to_manifest(self) -> None:
        self.cached.strong = True

    def refused(self, start: int, end: int) -> bool:
        if end <= start:
            return False
        size = self.cached.chunk_size
        return self.cached.cache.drop(self.cached, range(start // size, -(-end // size)))

    def refetches(self) -> int:
        return self.cached.refusals

    def proven(self, start: int, end: int, header: int = 0) -> None:
        self.cached.proven(start, end, header)

    def served(self, start: int, end: int) -> None:
        self._handover.served(start, end)

    def flush(self) -> None:
        """Record what was fetched; then let go of the pages served whole before: written back by then
        (a dirty page cannot be dropped)."""
        served = self._handover.taken()
        self.cached.cache.save(wait=bool(served))
        for first, last in served:
            if self.cached.file.fd < 0:
                return  # closed: its address may be another mapping's now
            self.cached.file.pages.let_go(self.cached.file.fd, first, last)

    def describe(self) -> RemoteDescription:
        return RemoteDescription(self.cached.version, self.options)

    def mapped_file(self) -> tuple[int, int]:
        return self.cached.file.fd, self.cached.version.size

    def close(self) -> None:
        self.close_private(self.cached.close)


def open_connections(shards: Iterable[ShardData]) -> list[Future[None]]:
    """Open connections to each store the remote ones of `shards` are in, now: as many HEADs of one
    of its objects at once as there are fetch threads (their answers unused), on those threads, so
    that the client keeps a connection for each GET they may make at once. A reader's first cold
    reads then cost their requests' round trips alone, not a new connection's handshake too
    (docs/performance.md). The HEADs under way, for a mount to wait for a while before it says it is
    ready; none when no shard is remote (or --offline: no request is made)."""
    first: dict[StoreSpec, tuple[ObjectRef, int]] = {}
    for data in shards:
        if isinstance(data, RemoteShard) and not data.options.offline:
            first.setdefault(data.cached.version.ref.spec, (data.cached.version.ref, data.options.concurrency))
    return [Fetcher.pool(threads).submit(_connect, ref) for ref, threads in first.values() for _ in range(threads)]


def _connect(ref: ObjectRef) -> None:
    try:
        head(ref)
    except (RemoteError, OSError) as exc:  # the reads that need the store will say it
        log.debug("opening a connection to %s: %s", ref.url, exc)


class RemoteOpener:
    """What `open_model` needs of a remote model: where its shards are, and how to open one.

    Online, the shards are found in the store and each header read with at most two GETs; with
    --offline, what the cache remembers of the model is used, and no request is made.
    """

    def __init__(self, source: str, options: RemoteOptions, problems: list[Problem], *, several: bool = False) -> None:
        self.source = source
        self.options = options
        self.cache = shared_cache(options)
        self._lock = threading.Lock()
        self._opened: dict[str, tuple[ObjectVersion, bytes]] = {}
        self._remembered: dict[str, ObjectVersion] | None = None
        self.headers: HeaderCache | None = None
        """Headers validated before, by object version (set by open_model)."""
        self._several = several
        if options.offline:
            self.located = self._recall(problems)
        else:
            self.located = locate(source, options, problems, several=several)

    @property
    def shards(self) -> list[tuple[ObjectRef, str]]:
        return [(ref, ref.url) for ref in self.located.shards]

    def open(self, ref: ObjectRef, label: str) -> tuple[ShardHeader, RemoteShard]:
        """Read, validate and open one shard (from the cache, --offline); InvalidModelError if it fails."""
        if self._remembered is not None:
            version = self._remembered[ref.url]
            found = self.cache.header_of(version.url, version.etag, version.size)
            if found is None:
                raise InvalidModelError([Problem(label, "--offline: its header is not in the cache")])
            raw = found[0]
        else:
            version, raw = self._read(ref, label)
        # An object is known by its URL, ETag and size; without an ETag, or modified too lately (a weak
        # ETag made of mtime and size may not change within a second), its header is not cached.
        remembered = version.etag and settled(int(version.mtime * 1e9))
        identity = f"{version.url}\0{version.etag}\0{version.size}" if remembered else None
        header = self.headers.shard(version.url, identity) if self.headers is not None and identity else None
        if header is None:
            header = _validated(version, raw, label, self._remembered is not None)
            if self.headers is not None and identity:
                self.headers.put_shard(identity, header)
        with self._lock:
            self._opened[ref.url] = (version, raw)
        return header, RemoteShard.of(version, self.options, raw)

    def _read(self, ref: ObjectRef, label: str) -> tuple[ObjectVersion, bytes]:
        located = self.located
        try:
            return read_first_bytes(ref, formats.table_bytes)
        except FileNotFoundError:
            if located.weight_map is not None and located.index_label is not None:
                raise InvalidModelError([missing_shard(located.index_label, located.weight_map, ref.name)]) from None
            raise InvalidModelError([Problem(label, "not found (404)")]) from None
        except RemoteError as exc:
            raise InvalidModelError([Problem(label, str(exc).removeprefix(f"{label}: "))]) from None

    def remember(self) -> None:
        """Once the model is valid: what it resolved to, for a later --offline."""
        if self._remembered is not None:
            return
        shards = [
            {"key": v.ref.key, "etag": v.etag, "size": v.size, "mtime": v.mtime} for v, _ in self._opened.values()
        ]
        located = self.located
        description: dict[str, object] = {
            "shards": shards, "weight_map": located.weight_map, "index": located.index_label
        }  # fmt: skip
        if located.parts:  # a directory of several models: each one's files
            description["parts"] = [list(part) for part in located.parts]
        self.cache.remember_model(model_key(self.source, self.options), description)

    def _recall(self, problems: list[Problem]) -> Located:
        spec, _ = store_spec(self.source, self.options)
        try:
            remembered = self.cache.recall_model(model_key(self.source, self.options))
        except RemoteError as exc:
            problems.append(Problem(self.source, str(exc)))
            return Located([])
        if remembered is None:
            problems.append(Problem(self.source, f"--offline: the cache {self.cache.directory} never had this model"))
            return Located([])
        self._remembered = {
            spec.url(s["key"]): ObjectVersion(ObjectRef(spec, s["key"]), s["etag"], s["size"], s["mtime"])
            for s in remembered["shards"]
        }
        refs = [v.ref for v in self._remembered.values()]
        parts = remembered.get("parts") if self._several else None
        found = tuple(tuple(map(str, part)) for part in parts) if isinstance(parts, list) else ()
        return Located(refs, remembered["weight_map"], remembered["index"], found)


def _validated(version: ObjectVersion, raw: bytes, label: str, offline: bool = False) -> ShardHeader:
    """The table of the object, from its first bytes (all a safetensors or GGUF table needs; a read
    that begins in them gets no more, as formats/ says), and exactly this version's bytes past them
    that its format asks for (a checkpoint's directory is at its end): a ranged GET each."""

    def read(offset: int, count: int) -> bytes:
        if offset < len(raw) or offset >= version.size:
            return raw[offset : offset + count]
        if offline:
            raise InvalidModelError([Problem(label, "--offline: its table is not in the cache")])
        piece = bytearray()
        try:
            read_range(version, offset, min(offset + count, version.size), lambda _, data: piece.extend(data))
        except RemoteError as exc:
            raise InvalidModelError([Problem(label, str(exc).removeprefix(f"{label}: "))]) from None
        return bytes(piece)

    return formats.read_table(read, version.size, version.url, label)
