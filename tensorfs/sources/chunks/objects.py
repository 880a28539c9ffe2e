"""One object version in the chunk cache, as one process uses it: its chunks known present or not,
fetched into their own range of its file (by the `fetch` the object was opened with) and checked
against the strongest checksums any process kept of them, pinned while answered from. The file's
bytes and blocks: files.py; how the cache as a whole keeps its bound: chunks.py; the locks: locks.py."""

from __future__ import annotations

import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ...errors import RemoteError, printable
from .. import waits
from ..fetching import COUNTERS, failed_future, wait
from .arrivals import Arrivals
from .files import ObjectFile
from .full import CacheFull, NoRoomNow
from .locks import hold_chunk, let_go_chunk, let_go_fetch, take_fetch
from .records import ChunkSum, Records, Summing, new_token
from .refetched import Chunks, Refetched

if TYPE_CHECKING:
    from ..store import ObjectVersion

__all__ = ["CacheFull", "CachedObject", "Fetch", "NoRoomNow"]

log = logging.getLogger("tensorfs.sources.chunkcache")  # one logger for the cache's messages

SAVE_AT_LEAST_EVERY = 1.0  # seconds: a fetch saves if nobody else did (a daemon saves every second)
_FETCH_WAIT = 0.01  # seconds between looks at a chunk another process is fetching
SPLIT_AT_LEAST = 1 << 20
"""A read that starts a chunk's fetch this far into the chunk or more has its own part asked for first."""

Fetch = Callable[[int, int, Callable[[int, bytes], object]], None]
"""Bytes [start, end) of exactly this version of an object, handed to write(offset, piece) as they
come (ObjectChanged if the store has another version now, RemoteError if it cannot give them)."""


class BadChunk(RemoteError):
    """A chunk whose bytes are not those the object version gave before (the store's, or the file's)."""


class Cache(Protocol):
    """What an object's file asks of the cache it is in (chunks.ChunkCache): its records, room for its
    chunks, and the saving of what it fetched."""

    directory: Path
    limit: int | None
    records: Records
    refetched: dict[str, Refetched]

    def claim(self, requester: CachedObject, first: int, last: int, deadline: float) -> set[int]: ...
    def reserve(self, requester: CachedObject, chunk: int, nbytes: int, *, wait: bool = True) -> None: ...
    def room_freed(self) -> None: ...
    def what_holds(self, requester: CachedObject) -> str: ...
    def record(self, cached: CachedObject, chunk: int, nbytes: int, digest: ChunkSum, token: int) -> None: ...
    def pending(self, oid: str, chunk: int) -> bool: ...
    def touch(self, cached: CachedObject, chunks: range) -> None: ...
    def save(self, *, wait: bool = False) -> bool: ...
    def let_go(self, cached: CachedObject) -> bool: ...
    def drop(self, cached: CachedObject, chunks: Iterable[int]) -> bool: ...


class CachedObject:
    """One object version's cache file in this process: mapped, held, its chunks known present or not."""

    def __init__(
        self, cache: Cache, oid: str, version: ObjectVersion, path: Path, chunk_size: int, fetch: Fetch
    ) -> None:
        self.cache = cache
        self._fetch_range = fetch
        self.id = oid
        self.version = version
        self.chunk_size = chunk_size
        self.users = 1
        self.chunks = -(-version.size // chunk_size)
        self._present = bytearray(self.chunks)
        """Chunks this process may answer from: fetched here, or recorded and checked against their checksums."""
        self._digests: dict[int, ChunkSum] = {}
        self._tokens: dict[int, int] = {}
        """The record (its token) of each chunk as this process fetched or checked it: a chunk recorded
        anew since (evicted, and fetched again by another process) is checked again before it is used."""
        self.strong = False
        """Whether chunks are also summed with SHA-256 here (where a manifest is in force)."""
        self.refusals = 0
        """How many times bytes kept here were refused and are had again: for every model reading this
        object in this process, a change of its bytes (each proves them again, or refuses them)."""
        self._lock = threading.Lock()
        self._inflight: dict[int, Future[None]] = {}
        self._pins: dict[int, int] = {}  # chunk -> how many answers hold it (not to be evicted)
        self._fetching: set[int] = set()  # chunks whose fetch lock this process holds until they are recorded
        self._progress = threading.Condition(self._lock)
        self._arrivals = Arrivals(self._progress)
        """Chunks being fetched whose bytes may be answered as they come (copy_arriving)."""
        self.file = ObjectFile(path, version.url, version.size, cache.directory)

    def known(self, sums: dict[int, ChunkSum]) -> None:
        """The checksums the object's chunks came with (its recorded chunks are checked against them
        when first wanted here, and so become present here)."""
        self._digests = dict(sums)

    def clear_orphans(self, recorded: set[int]) -> None:
        """Free the blocks of chunks allocated but never recorded (their fetch did not end: its process
        was killed), each under its fetch lock: nobody is fetching it now, and its record is final."""
        offset, size = 0, self.version.size
        while offset < size:
            try:
                start = os.lseek(self.file.fd, offset, os.SEEK_DATA)
                end = os.lseek(self.file.fd, start, os.SEEK_HOLE)
            except OSError:  # ENXIO: no data after offset (or no SEEK_DATA here)
                return
            for chunk in range(start // self.chunk_size, -(-end // self.chunk_size)):
                if chunk in recorded or not take_fetch(self.file.fd, chunk):
                    continue
                try:
                    if self.cache.records.recorded(self.id, chunk) is None:
                        begin, stop = self._range(chunk)
                        self.file.free(begin, stop - begin)
                finally:
                    let_go_fetch(self.file.fd, chunk)
            offset = max(end, start + 1)

    # -- presence -------------------------------------------------------------------------
    def present(self, chunk: int) -> bool:
        """Whether the chunk can be had without a GET (here, or recorded by another process)."""
        return bool(self._present[chunk]) or self.cache.records.recorded(self.id, chunk) is not None

    def here(self, chunk: int) -> bool:
        """Whether the chunk is present in this process (fetched or checked here)."""
        return bool(self._present[chunk])

    def pinned_bytes(self) -> int:
        with self._lock:
            return sum(min(self.chunk_size, self.version.size - chunk * self.chunk_size) for chunk in self._pins)

    def pin(self, first: int, last: int) -> bool:
        """Hold chunks first..last against eviction (here and by other processes); False (nothing
        held) if one is not present, or was evicted by another process meanwhile."""
        chunks = range(first, last + 1)
        with self._lock:
            if not all(self._present[chunk] for chunk in chunks):
                return False
            taken: list[int] = []
            for chunk in chunks:
                if not self._pins.get(chunk) and not self._hold(chunk):
                    for done in taken:
                        self._let_go(done)
                    return False
                self._pins[chunk] = self._pins.get(chunk, 0) + 1
                taken.append(chunk)
        self.cache.touch(self, chunks)
        return True

    def pin_present(self, first: int, last: int) -> tuple[list[int], list[int]]:
        """Pin the chunks of first..last that are present here, or being fetched here; (those pinned,
        those missing: to fetch). Called with the cache's room lock held: nothing is evicted meanwhile."""
        pinned: list[int] = []
        missing: list[int] = []
        with self._lock:
            for chunk in range(first, last + 1):
                here = self._present[chunk] or chunk in self._inflight  # (a fetch or a check: evictions need
                # the room lock, which the caller holds)
                if here and (self._pins.get(chunk) or self._hold(chunk, checked=bool(self._present[chunk]))):
                    self._pins[chunk] = self._pins.get(chunk, 0) + 1
                    pinned.append(chunk)
                else:
                    missing.append(chunk)
        return pinned, missing

    def pin_claimed(self, chunks: Iterable[int]) -> None:
        """Pin chunks about to be fetched: from now on nobody evicts them (nor could: they are not recorded)."""
        with self._lock:
            for chunk in chunks:
                if not self._pins.get(chunk):
                    hold_chunk(self.file.fd, chunk)
                self._pins[chunk] = self._pins.get(chunk, 0) + 1

    def let_go(self, chunks: Iterable[int], *, tell: bool = True) -> None:
        """Unpin each of `chunks` once; `tell`: fetches waiting for room look again (the caller tells them later)."""
        with self._lock:
            for chunk in chunks:
                self._let_go(chunk)
        if tell:
            self.cache.room_freed()

    def ensure_pinned(self, first: int, last: int, start: ThreadPoolExecutor, *, offline: bool = False) -> None:
        """Make chunks first..last present and pin them (blocking: a worker thread): room for all that
        are missing is claimed at once, each is pinned before it is fetched (see ChunkCache.claim).

        CacheFull when there is no room in time (--remote-timeout: readers of a cache too small for
        them all take turns); a fetch's own error as it is (wait()). A fetch joined here (begun by a
        reader ahead, or read-ahead) that found no room is not this read's failure: the claim
        settles room, and the chunk is claimed again.
        """
        deadline = waits.deadline(self.room_wait)  # one timeout from the request's start
        tries = 0
        while tries < 8:
            claimed = self.cache.claim(self, first, last, deadline)
            started = [
                self.fetching(chunk, start, offline=offline, reserved=chunk in claimed)
                for chunk in range(first, last + 1)
            ]
            failure: Exception | None = None
            for future in started:
                if future is not None:
                    try:
                        waits.wait_for(future, self.room_wait, lambda: f"{self.version.url}: a fetch")
                    except Exception as exc:
                        failure = failure or exc
            if all(self._present[chunk] for chunk in range(first, last + 1)):
                return
            self.let_go(range(first, last + 1))
            if failure is not None and not isinstance(failure, NoRoomNow | CacheFull):
                wait([failed_future(failure)])  # raised as wait() raises a fetch's failure
            if failure is None:
                tries += 1  # (present, then evicted by another process: a few times at most)
            elif time.monotonic() > deadline:
                break
        raise CacheFull(self.cache.what_holds(self))

    def _hold(self, chunk: int, *, checked: bool = True) -> bool:
        """Take the chunk's presence lock (the first pin of it here): False if another process evicts
        it just now, or evicted it since this process last looked, or recorded it anew since (fetched
        again by another process: its bytes are checked before they are used here). Then it is not
        present here."""
        if not hold_chunk(self.file.fd, chunk):
            self._present[chunk] = 0
            return False
        if not checked or chunk in self._fetching or self.cache.pending(self.id, chunk):
            return True  # being fetched, or written here and not yet recorded: nobody else can evict it
        try:
            found = self.cache.records.recorded(self.id, chunk)
        except RemoteError:
            found = None
        still = found is not None and found[1] == self._tokens.get(chunk)
        if not still:
            let_go_chunk(self.file.fd, chunk)
            self._present[chunk] = 0
        return still

    def _let_go(self, chunk: int) -> None:
        left = self._pins.get(chunk, 0) - 1
        if left > 0:
            self._pins[chunk] = left
            return
        self._pins.pop(chunk, None)
        let_go_chunk(self.file.fd, chunk)

    def unpin(self, first: int, last: int) -> None:
        with self._lock:
            for chunk in range(first, last + 1):
                self._let_go(chunk)
        self.cache.room_freed()

    def take(self, chunk: int) -> bool:
        """Mark a chunk not present, for its eviction: unless it is pinned or being fetched here. Until
        taken() is told how it went, a fetch of it here waits (an eviction is quick)."""
        with self._lock:
            if self._pins.get(chunk) or chunk in self._inflight or chunk in self._fetching:
                return False
            self._present[chunk] = 0
            self._inflight[chunk] = Future()
            return True

    def taken(self, chunk: int, gone: bool) -> None:
        """The eviction of a chunk taken is over: it is gone, or (another process answers from it) still there."""
        with self._lock:
            if not gone:
                self._present[chunk] = 1
            waited = self._inflight.pop(chunk, None)
            self._progress.notify_all()  # a copy waiting on the chunk (copy_arriving) looks again
        if waited is not None:
            waited.set_result(None)

    # -- fetching -------------------------------------------------------------------------
    @property
    def room_wait(self) -> float:
        """How long a fetch waits for room in the cache: as long as for the store (--remote-timeout)."""
        return self.version.ref.spec.timeout

    def busy(self) -> bool:
        """Whether a fetch (or a check) of any of its chunks is under way in this process."""
        with self._lock:
            return bool(self._inflight)

    def coming(self, chunk: int) -> bool:
        """Whether a fetch (or a check) of the chunk is under way in this process."""
        with self._lock:
            return chunk in self._inflight

    def fetching(
        self,
        chunk: int,
        start: ThreadPoolExecutor,
        *,
        offline: bool = False,
        reserved: bool = False,
        room: bool = True,
        reading: int | None = None,
    ) -> Future[None] | None:
        """The fetch of `chunk` (begun now in `start`'s threads, or already under way): a GET, or a
        check of a chunk recorded by another process or before; None if present here.

        `offline`: no GET; a chunk not cached fails its future (RemoteError). `reserved`: its room is
        taken already (see claim); `room`: wait for room if there is none (else NoRoomNow at once).
        `reading`: where the read that begins the fetch starts (see _get).
        """
        with self._lock:
            if self._present[chunk]:
                COUNTERS.add(cache_hits=1)
                return None
            running = self._inflight.get(chunk)
            if running is not None:
                return running
            if waits.expired(self.room_wait):  # a request past its deadline begins no fetch
                return failed_future(RemoteError(f"{self.version.url}: no answer within --remote-timeout"))
            future = start.submit(self._fetch, chunk, offline, reserved, room, reading)
            self._inflight[chunk] = future
            return future

    def _fetch(self, chunk: int, offline: bool, reserved: bool, room: bool, reading: int | None) -> None:
        try:
            self._take_fetch_lock(chunk)
            try:
                if self._present[chunk] or self._check(chunk):
                    self._fetched(chunk, None)
                    return
                if offline:
                    begin, end = self._range(chunk)
                    if reserved:  # its blocks were taken for a fetch that will not be
                        self.file.free(begin, end - begin)
                    raise RemoteError(f"{self.version.url}: bytes [{begin}, {end}) are not cached (--offline)")
                self._get(chunk, reserved=reserved, room=room, reading=reading)
            except BaseException:
                with self._lock:
                    self._fetching.discard(chunk)
                    let_go_fetch(self.file.fd, chunk)
                raise
        finally:
            with self._lock:
                self._inflight.pop(chunk, None)
                self._progress.notify_all()
            self.cache.room_freed()

    def _take_fetch_lock(self, chunk: int) -> None:
        """Be the one process that fetches `chunk` (another that is at it is waited for: it records
        the chunk when done, or dies and lets go)."""
        deadline = time.monotonic() + max(60.0, 4 * SAVE_AT_LEAST_EVERY)
        while not take_fetch(self.file.fd, chunk):
            if time.monotonic() > deadline:
                raise RemoteError(
                    f"{self.version.url}: chunk {chunk} is being fetched by another process that never ends"
                )
            time.sleep(_FETCH_WAIT)
        with self._lock:
            self._fetching.add(chunk)

    def _check(self, chunk: int) -> bool:
        """Whether a chunk recorded (by any process, any time) is present here: its bytes on disk
        still sum to what they did when they first came (a SHA-256 where any process kept one, else
        the CRC-32C). A chunk that does not is a miss, never data: its record is dropped and it is
        fetched again."""
        if not hold_chunk(self.file.fd, chunk):
            return False  # being evicted just now
        try:
            found = self.cache.records.recorded(self.id, chunk)
            if found is None:
                return False
            digest, token = found
            again = self._refetched()
            if again is not None and again.holds(chunk):  # its first bytes were refused here
                held = again.sums(chunk)
                if held is None:
                    return False
                digest = held
            begin, end = self._range(chunk)
            actual = self.file.summed(begin, end, Summing(self.strong or digest.sha256 is not None))
        finally:
            with self._lock:
                if not self._pins.get(chunk):
                    let_go_chunk(self.file.fd, chunk)
        sums = actual.sums()
        if digest.agrees(sums):
            if sums.sha256 is not None and digest.sha256 is None:  # summed for a manifest now: kept
                self.cache.records.strengthen(self.id, chunk, sums)
            self._digests[chunk] = ChunkSum(digest.crc32c, digest.sha256 or sums.sha256)
            self._tokens[chunk] = token
            COUNTERS.add(chunks_checked=1)
            return True
        COUNTERS.add(bad_chunks=1)
        log.warning(
            "%s: chunk %d in the cache file %s does not hold the bytes it was recorded with (changed on disk): "
            "fetched again",
            printable(self.version.url),
            chunk,
            self.file.path,
        )
        self._digests[chunk] = digest  # what the object's bytes are: the fetch again must give them
        self.cache.records.forget_chunk(self.id, chunk)
        return False

    def _get(self, chunk: int, *, reserved: bool, room: bool, reading: int | None = None) -> None:
        """GET the chunk into its range of the file (nothing outside it), and check what came. A chunk
        this object version never gave before has nothing to be checked against: its bytes may be
        answered as they are written (copy_arriving); and when the read that began its fetch starts
        well into it (`reading`), from there to its end first, then its first part (two GETs, one
        after the other), and it is summed from the file once whole: that read's bytes come first,
        not after those before them (docs/performance.md)."""
        begin, end = self._range(chunk)
        if not reserved:
            self.cache.reserve(self, chunk, end - begin, wait=room)
        expected = self._first_sums(chunk)
        # Summed as strongly as anyone ever summed it: a SHA-256 kept by any process is the bar.
        summing = Summing(self.strong or (expected is not None and expected.sha256 is not None))
        split = begin
        if expected is None and reading is not None and reading - begin >= SPLIT_AT_LEAST:
            split = min(end, reading - reading % mmap.PAGESIZE)
        parts = [(split, end), (begin, split)] if split > begin else [(begin, end)]
        COUNTERS.add(split_chunks=len(parts) - 1)
        if expected is None:
            with self._lock:
                self._arrivals.begin(chunk)

        def write(offset: int, piece: bytes) -> None:
            if len(parts) == 1:
                summing.update(piece)
            offset = self.file.write(offset, piece)
            if expected is None:
                with self._lock:
                    self._arrivals.wrote(chunk, offset)

        try:
            for start, stop in parts:
                with self._lock:
                    self._arrivals.part(chunk, start)
                COUNTERS.add(gets=1)
                self._fetch_range(start, stop, write)
            digest = (summing if len(parts) == 1 else self.file.summed(begin, end, summing)).sums()
            if expected is not None and not expected.agrees(digest):
                COUNTERS.add(changed_chunks=1)
                raise BadChunk(
                    f"{self.version.url}: bytes [{begin}, {end}) are not those the same version (ETag "
                    f"{printable(self.version.etag) or 'none'}) gave before: the store serves other bytes under it"
                )
        except BaseException as exc:
            COUNTERS.add(fetch_failures=1)
            with self._lock:  # no copy of its bytes from here on (copies are made under this lock)
                self._arrivals.end(chunk)
            self.file.free(begin, end - begin)  # nothing half-written stays, nor its blocks
            if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
                raise self.file.unwritable(exc) from None
            raise
        COUNTERS.add(fetched_bytes=end - begin)
        self._fetched(chunk, digest)

    def _fetched(self, chunk: int, digest: ChunkSum | None) -> None:
        """The chunk is present here; a new one (its digest given) is recorded at the next save."""
        with self._lock:
            self._present[chunk] = 1
            if digest is not None:
                self._digests[chunk] = digest
                again = self._refetched()
                if again is not None:
                    again.came(chunk, digest)
            self._arrivals.end(chunk)
            self._progress.notify_all()
        if digest is not None:
            token = new_token()
            with self._lock:
                self._tokens[chunk] = token
            self.cache.record(self, chunk, self.chunk_bytes(chunk), digest, token)
        else:
            self.recorded([chunk])

    def copy_arriving(self, start: int, end: int, until: float) -> bytes | None:
        """A copy of [start, end) as soon as its bytes are in the file, while a chunk of it is still
        coming (fetched for this read, or already by the read-ahead or another reader): each of its
        chunks present here, or being fetched with its part of the range written already. None when
        every chunk is here (answer from the mapping; a chunk whose bytes are held to the checksums
        of an earlier fetch, checked only once all have come, is waited for whole), when a fetch
        ended without them, when a chunk here was evicted meanwhile, or at `until`. It is woken by the piece
        written that completes its bytes (or a fetch's end). Copies are made under the object's
        lock, which a failed fetch takes before it frees the chunk's blocks (no copy ever reads a
        hole), with the chunks present pinned for the copy (no other process evicts them under it)."""
        chunks = range(start // self.chunk_size, (end - 1) // self.chunk_size + 1)
        pinned: list[int] = []
        try:
            with self._progress:
                while not self._written(chunks, start, end):
                    if any(
                        not self._arrivals.coming(c) and c not in self._inflight and not self._present[c]
                        for c in chunks
                    ):
                        return None  # a fetch ended without them (a failure is the caller's to tell)
                    left = until - time.monotonic()
                    if left <= 0:
                        return None
                    wanted = [
                        (c, max(start, c * self.chunk_size), min(end, (c + 1) * self.chunk_size))
                        for c in chunks
                        if not self._present[c]
                    ]
                    self._arrivals.wait(wanted, left)
                if all(self._present[chunk] for chunk in chunks):
                    return None
                for chunk in chunks:
                    if self._present[chunk]:
                        if not self._pins.get(chunk) and not self._hold(chunk):
                            return None  # evicted by another process just now
                        self._pins[chunk] = self._pins.get(chunk, 0) + 1
                        pinned.append(chunk)
                return self.file.copy(start, end)
        finally:
            if pinned:
                self.let_go(pinned)

    def _written(self, chunks: range, start: int, end: int) -> bool:
        """Whether each of `chunks` is present here or has its part of [start, end) written by the
        fetch under way (one with nothing to check against). Called with the object's lock held."""
        for chunk in chunks:
            if self._present[chunk]:
                continue
            low, high = max(start, chunk * self.chunk_size), min(end, (chunk + 1) * self.chunk_size)
            if not self._arrivals.written(chunk, low, high):
                return False
        return True

    def _refetched(self) -> Refetched | None:
        """Its chunks refused in this process and had again (refetched.py): only readers held to a
        manifest or a signature take them (`strong`); others are held to what the chunks first summed to."""
        return self.cache.refetched.get(self.id) if self.strong else None

    def _first_sums(self, chunk: int) -> ChunkSum | None:
        """What the chunk summed to when it first came (None: it never came), or, where its bytes were
        refused in this process, when it came again since (None: not yet: held to nothing)."""
        again = self._refetched()
        if again is not None and again.holds(chunk):
            return again.sums(chunk)
        return self._digests.get(chunk) or self.cache.records.sums_of(self.id, chunk)

    def unhold(self, chunks: Iterable[int]) -> None:
        """Bytes of these chunks were proven not the object's (ChunkCache.drop): in this process their
        next fetch is checked against nothing they first summed to, then held to what it brought, for
        readers held to a manifest or a signature; every model reading the object here sees a change
        of its bytes (refusals), and proves them again or refuses them. The cache's record of them
        stays for every other process, until every byte of one is proven (proven())."""
        chunks = list(chunks)
        with self._lock:
            for chunk in chunks:
                self._digests.pop(chunk, None)
                self._tokens.pop(chunk, None)
            self.cache.refetched.setdefault(self.id, Refetched()).unhold(chunks)
            self.refusals += 1

    def proven(self, start: int, end: int, header: int = 0) -> None:
        """Bytes [start, end) as they are here now are proven the object's (a manifest's or a signature's
        digest matched): see Refetched.proven."""
        again = self._refetched()
        if again:

            def holds_header() -> bool:  # its first bytes those it was opened with
                held = self.cache.records.header_of(self.id)
                return held is not None and self.file.holds(0, held[0][:header], header)

            chunks = Chunks(self.chunk_size, self.version.size, self.here)
            for chunk, sums in again.proven(chunks, start, end, header, holds_header):
                self.cache.records.replace_sums(self.id, chunk, sums)
                again.done(chunk)

    def recorded(self, chunks: Iterable[int]) -> None:
        """These chunks are recorded (or given up): their fetch locks go, so other processes may take them."""
        with self._lock:
            for chunk in chunks:
                if chunk in self._fetching:
                    self._fetching.discard(chunk)
                    let_go_fetch(self.file.fd, chunk)

    def chunk_bytes(self, chunk: int) -> int:
        return min(self.chunk_size, self.version.size - chunk * self.chunk_size)

    def _range(self, chunk: int) -> tuple[int, int]:
        begin = chunk * self.chunk_size
        return begin, min(self.version.size, begin + self.chunk_size)

    def close(self) -> None:
        self.cache.save(wait=True)  # what was fetched is recorded while the file is open to flush
        if self.cache.let_go(self):
            self.file.close()
