"""Proving bytes: SHA-256 of tensors (kept in the hash cache, caches/hashes.py) and verification."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..caches.hashes import HashCache
from ..errors import IntegrityError, ShardChangedError, printable
from ..formats import BEGIN, END, NAME, Entry
from ..sources.shard import ShardData
from ..utils.identity import Identity, ShardKey

if TYPE_CHECKING:
    from ..catalogue.tables import Tables

log = logging.getLogger(__name__)

_CHUNK = 1 << 20  # read a tensor in pieces this large: they stay in the CPU's cache between read and hash
HASH_WORKERS = max(1, min(4, os.cpu_count() or 1))
_SAVE_EVERY = 5.0  # seconds between commits of new hashes while a model is hashed
SIGNATURE_LABEL = "the signature "
"""How messages name a signature whose digests are in force (then comes where it was read from)."""
CACHE_MIN_BYTES = 256 << 10
"""Smaller tensors are hashed again rather than cached: storing a row costs a good part of hashing them."""


# -- hashing a model ------------------------------------------------------------------------

_Run = list[tuple[str, int, int]]
"""Tensors of one shard read together, as (name, absolute begin, absolute end), in file order."""


class Hasher:
    """Hashes a model's tensors, through the cache, several tensors at once.

    Bytes are read from the shard files with preadv, never hashed off the mappings: a shard that
    shrinks under a mapping kills whoever touches the lost pages (SIGBUS), while a read of them
    just comes up short (ShardChangedError, naming the tensor).
    """

    def __init__(self, model: Tables, cache: HashCache | None = None) -> None:
        self.model = model
        self.cache = cache or HashCache(None)
        self._buffers = threading.local()
        self._lock = threading.Lock()
        self._unsaved: dict[Identity, dict[tuple[int, int], str]] = {}
        self._saved_at = time.monotonic()
        self.tensors_hashed = 0
        self.bytes_hashed = 0
        self.cache_hits = 0

    def cached(self, names: Iterable[str], *, proving: bool = True) -> dict[str, str]:
        """The hashes the cache already holds for `names` (for shards unchanged since the model opened;
        `proving`: only those of shards whose identity proves their bytes, see hash_all)."""
        return self._cached(self.model.by_shard(names), proving)

    def _cached(self, groups: Mapping[ShardKey, list[Entry]], proving: bool) -> dict[str, str]:
        found: dict[str, str] = {}
        if not self.cache.enabled:
            return found
        for shard, entries in groups.items():
            identity = self.model.identity(shard)
            if identity is None or (proving and not self.model.shard_data(shard).identity_proves_bytes):
                continue
            spans = {
                (entry[BEGIN], entry[END]): entry[NAME]
                for entry in entries
                if entry[END] - entry[BEGIN] >= CACHE_MIN_BYTES
            }
            if not spans:  # none is ever cached: not even the database need be opened (or made)
                continue
            for span, digest in self.cache.get_many(identity, spans).items():
                found[spans[span]] = digest
        with self._lock:
            self.cache_hits += len(found)
        return found

    def hash_one(self, name: str, progress: Callable[[int], None] | None = None) -> str:
        """Hash one tensor (no cache lookup) and remember it in the cache."""
        shard, offset, nbytes = self.model.locate(name)
        digest = self._hash_run(shard, [(name, offset, offset + nbytes)], progress)[name]
        self.save()
        return digest

    def hash_all(
        self,
        names: Iterable[str] | None = None,
        progress: Callable[[int], None] | None = None,
        *,
        proving: bool = True,
    ) -> dict[str, str]:
        """SHA-256 of every tensor in `names` (all by default): cached ones looked up, the rest hashed.

        `proving` (to check bytes against a manifest): a remote shard's tensors are hashed from the
        bytes this process will serve, whatever the cache says of their object version. What another
        process hashed once was what the store gave it then; the chunks held now may have come again
        since, from a store that answers other bytes under the same ETag and CRC-32C, with nothing
        kept to hold them to (their SHA-256s pruned with the chunks). Not proving (a manifest made, a
        mount's .sha256 without one), the cache says what the version's bytes hashed to."""
        names = self.model.sorted_names if names is None else list(names)
        groups = self.model.by_shard(None if names is self.model.sorted_names else names)
        digests = self._cached(groups, proving)
        if progress is not None and digests:
            progress(
                sum(end - begin for entries in groups.values() for begin, end, name, _, _ in entries if name in digests)
            )
        runs = self._plan(groups, digests)
        try:
            with ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
                for found in pool.map(lambda job: self._hash_run(job[0], job[1], progress), runs):
                    digests.update(found)
        finally:
            self.save()
        return {name: digests[name] for name in names}

    def _plan(self, groups: Mapping[ShardKey, list[Entry]], done: Mapping[str, str]) -> list[tuple[ShardKey, _Run]]:
        """Group what is not `done` into runs: a big tensor alone, small neighbours together (one read,
        one commit). Largest runs first, so that the workers finish together.
        """
        runs: list[tuple[ShardKey, _Run]] = []
        for shard, entries in groups.items():
            data_start = self.model.shard_header(shard).data_start
            run: _Run = []
            for begin, end, name, _, _ in entries:
                if name in done:
                    continue
                if run and data_start + end - run[0][1] > _CHUNK:
                    runs.append((shard, run))
                    run = []
                run.append((name, data_start + begin, data_start + end))
            if run:
                runs.append((shard, run))
        runs.sort(key=lambda job: job[1][0][1] - job[1][-1][2])
        return runs

    def _hash_run(self, shard: ShardKey, run: _Run, progress: Callable[[int], None] | None) -> dict[str, str]:
        """Hash a run's tensors from the file, and store the hashes in the cache in one transaction."""
        buffer = self._buffer()
        found: dict[str, str] = {}
        first, last = run[0][1], run[-1][2]
        try:
            if last - first <= _CHUNK:  # small neighbours: one read, each hashed from the buffer
                self.model.readinto(shard, first, buffer[: last - first])
                for name, begin, end in run:
                    found[name] = hashlib.sha256(buffer[begin - first : end - first]).hexdigest()
                if progress is not None:
                    progress(sum(end - begin for _, begin, end in run))
            else:  # one big tensor, read and hashed a piece at a time
                (name, begin, end), digest = run[0], hashlib.sha256()
                for start in range(begin, end, _CHUNK):
                    piece = buffer[: min(_CHUNK, end - start)]
                    self.model.readinto(shard, start, piece)
                    digest.update(piece)
                    if progress is not None:
                        progress(len(piece))
                found[name] = digest.hexdigest()
        except ShardChangedError as exc:
            if exc.lost_from is None and not isinstance(shard, Path):  # a remote shard: its own words
                raise
            lost = exc.lost_from if exc.lost_from is not None else first
            name, begin, end = next(span for span in run if span[2] > lost)
            raise ShardChangedError(
                f"{shard}: tensor '{printable(name)}': bytes [{max(lost, begin) - begin}, {end - begin}) of the "
                "tensor are gone: the shard shrank after it was validated",
                lost_from=lost,
            ) from None
        # Stored only if the file is still the one mapped: bytes of a changed file are not its bytes.
        with self._lock:
            self.tensors_hashed += len(run)
            self.bytes_hashed += sum(end - begin for _, begin, end in run)
        identity = self.model.identity(shard) if self.cache.enabled else None
        if identity is not None:
            data_start = self.model.shard_header(shard).data_start
            worth = {
                (begin - data_start, end - data_start): found[name]
                for name, begin, end in run
                if end - begin >= CACHE_MIN_BYTES
            }
            with self._lock:
                self._unsaved.setdefault(identity, {}).update(worth)
            if time.monotonic() - self._saved_at > _SAVE_EVERY:
                self.save()
        return found

    def count(self, nbytes: int) -> None:
        """Bytes hashed elsewhere than here (a signed range's check), for the counts."""
        with self._lock:
            self.bytes_hashed += nbytes

    def save(self) -> None:
        """Write the hashes not yet in the cache, in one transaction per shard.

        A commit per tensor cost more than hashing small tensors did; one every few seconds costs
        nothing, and a manifest stopped midway still leaves most of its work cached.
        """
        with self._lock:
            unsaved, self._unsaved = self._unsaved, {}
            self._saved_at = time.monotonic()
        for identity, hashes in unsaved.items():
            self.cache.put_many(identity, hashes)

    def _buffer(self) -> memoryview:
        """This thread's read buffer, made once."""
        buffer: memoryview | None = getattr(self._buffers, "buffer", None)
        if buffer is None:
            buffer = self._buffers.buffer = memoryview(bytearray(_CHUNK))
        return buffer


@dataclass
class Checked:
    """What a check of bytes against a signature found: the tensors whose bytes it proved the signed
    ones (as they were read: the caller knows whether their file changed since), and the SHA-256 of
    those whose values were taken on the way (a tensor's value: what a fallback's copy, a .sha256 or
    a later open holds it to)."""

    proven: set[str]
    values: dict[str, str]

    def update(self, other: Checked) -> None:
        self.proven |= other.proven
        self.values.update(other.values)


class Pending(Protocol):
    """Tensors proven, and their values known, only once bytes of their file are checked: a model's
    files held to a signature (signed_bytes.SignedRanges). Picklable: a mount's daemon is handed it."""

    def establish(
        self,
        names: list[str],
        hasher: Hasher,
        progress: Callable[[int], None] | None = None,
        *,
        values: bool = False,
        generations: Mapping[ShardKey, int] | None = None,
    ) -> Checked:
        """Check the bytes these tensors rest on (read through `hasher`'s model): the tensors proven
        (these, and the others those bytes hold whole), and their values where taken (`values`:
        these tensors' at least; `generations`: how many changes of each file the caller has seen, a
        check under way since then being waited for rather than made again). IntegrityError naming
        the file, a tensor and the bytes that are not the signed ones."""
        ...


@dataclass
class Integrity:
    """What a mount (or an open model) knows of its tensors' hashes: the hasher, the manifest's
    values, what is verified."""

    hasher: Hasher
    expected: dict[str, str] | None = None
    """The manifest: tensor -> hex SHA-256. With one, no tensor is served before it is verified:
    its bytes hash to this value, or (a tensor `pending` holds) the signed bytes of its file were
    checked, its value taken then or only when something needs it."""
    verified: set[str] = field(default_factory=set)
    label: str = "the manifest"
    """How messages name the manifest (where it was read from)."""
    signer: str = ""
    """Who signed it, when it is a signature's digests (signed_model.py: its label is SIGNATURE_LABEL + where)."""
    pending: Pending | None = None
    """Where the values the manifest lacks come from, as their tensors are first checked (None: it
    lacks none)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def signature(self) -> dict[str, str] | None:
        """The signature in force and who signed it, as status, stats.json and the metrics say them."""
        if not self.signer:
            return None
        return {"signature": self.label.removeprefix(SIGNATURE_LABEL), "signer": self.signer}

    def digest(self, name: str) -> str:
        """The tensor's actual SHA-256: from the cache, else hashed (blocking: call from a worker thread).
        Under a manifest, proving (see Hasher.hash_all); a value `pending` has not taken yet, taken."""
        if self.unproven(name):
            self.establish([name], values=True)
            assert self.expected is not None
            return self.expected[name]
        proving = self.expected is not None
        return self.hasher.cached([name], proving=proving).get(name) or self.hasher.hash_one(name)

    def hash_all(self, names: Iterable[str], progress: Callable[[int], None] | None = None) -> dict[str, str]:
        """The tensors' actual SHA-256s (see Hasher.hash_all; proving under a manifest), the values the
        manifest lacks taken on the way (IntegrityError if the bytes they rest on are not the
        signed ones)."""
        names = list(names)
        unproven = [name for name in names if self.unproven(name)]
        if unproven:
            self.establish(unproven, progress, values=True)
        assert self.expected is not None or not unproven
        found = {name: self.expected[name] for name in unproven} if self.expected is not None else {}
        rest = [name for name in names if name not in found]
        if rest:
            found.update(self.hasher.hash_all(rest, progress, proving=self.expected is not None))
        return {name: found[name] for name in names}

    def unproven(self, name: str) -> bool:
        """Whether the manifest lacks the tensor's value: `pending` proves its bytes from its own file
        (no fallback's copy can be held to it before its value is taken)."""
        return self.pending is not None and self.expected is not None and name not in self.expected

    def establish(
        self,
        names: list[str],
        progress: Callable[[int], None] | None = None,
        *,
        values: bool = False,
        generations: Mapping[ShardKey, int] | None = None,
    ) -> set[str]:
        """Check the bytes these unproven tensors rest on: the tensors proven (these, and the others
        those bytes hold), their values where taken (`values`: these tensors' at least) put in the
        manifest. The caller makes them verified, knowing their files unchanged meanwhile."""
        if not names:
            return set()
        assert self.pending is not None and self.expected is not None
        found = self.pending.establish(names, self.hasher, progress, values=values, generations=generations)
        with self._lock:
            self.expected.update(found.values)
        return found.proven

    def check_many(self, names: Iterable[str], progress: Callable[[int], None] | None = None) -> None:
        """Verify these tensors (those not yet verified) before anything is served: what `pending`
        proves by its files' signed bytes, the rest hashed on HASH_WORKERS threads; IntegrityError
        for the first in name order that does not match (every matching one is verified still)."""
        if self.expected is None:
            return
        todo = [name for name in names if name not in self.verified]
        unproven = [name for name in todo if self.unproven(name)]
        if unproven:
            self.verified |= self.establish(unproven, progress)
        rest = [name for name in todo if name not in self.verified]
        if rest:
            self._compare(self.hash_all(rest, progress))

    def _compare(self, actual: Mapping[str, str]) -> None:
        assert self.expected is not None
        bad = []
        for name, digest in actual.items():
            if digest == self.expected[name]:
                self.verified.add(name)
            else:
                bad.append(name)
        if bad:
            name = min(bad)
            shard = self.hasher.model.locate(name)[0]
            expected = self.expected[name]
            raise IntegrityError(
                f"{printable(str(shard))}: tensor '{printable(name)}': its bytes hash to {actual[name]}, not to "
                f"{expected} as {printable(self.label)} says",
                name,
                expected,
                actual[name],
            )


def sha256_of(data: ShardData, start: int, end: int) -> str:
    """The SHA-256 of bytes [start, end) of a source, read from its file (a remote one's chunks fetched first)."""
    digest = hashlib.sha256()
    buffer = bytearray(min(_CHUNK, max(1, end - start)))
    for offset in range(start, end, _CHUNK):
        piece = memoryview(buffer)[: min(_CHUNK, end - offset)]
        data.readinto(offset, piece)
        digest.update(piece)
    return digest.hexdigest()
