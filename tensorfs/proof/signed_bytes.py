"""A file's bytes against what a signature says of them (signature.py's SignedFile): hashed whole, or
range by range, in one pass (check_file: the SHA-256 of tensors it is given taken on the same
read); and the model's files as the gate checks them (SignedRanges).

A file need not be read whole before a tensor of it is served, unless it is signed whole: the
ranges that hold a tensor's bytes are hashed whole when the tensor is first checked, through the
gate's read path (a remote file's chunks through the cache), and compared with the signature;
the tensor, and every other tensor lying wholly inside them, are proven by them. The bytes no tensor
holds (the header the table was read from, a GGUF's padding, a checkpoint's zip records; all of a
file signed whole) are checked when the model is opened. Each byte is hashed once, for its range:
a tensor's own digest (its value) is taken on the way only where something holds bytes to it later.
What was found is kept in the hash cache by the file's identity: each range that held its signed
bytes (and the values taken), so a later open checks nothing again.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..errors import IntegrityError, ShardChangedError, printable
from ..formats import BEGIN, END, NAME
from ..sources import waits
from ..utils.identity import ShardKey
from ..utils.progress import Progress
from .integrity import CACHE_MIN_BYTES, Checked, Hasher
from .signature import SignatureError, SignedFile

_CHUNK = 1 << 20
EMPTY = hashlib.sha256().hexdigest()
CHECKERS = max(1, min(32, os.cpu_count() or 1))
"""Checks of signed bytes made at once: on every core, as model_signing hashes a model's files (each
check reads a megabyte at a time: as many megabytes of memory)."""
_KEPT_CHECKS = 4096
"""Checks made kept for readers asking for the same ranges later (a mount's readers of one tensor
come a moment apart), the latest so many."""
_CheckKey = tuple[ShardKey, int, int, bool, int]
"""A check of a file's ranges first..last, taking the tensors' values or not, since a count of changes."""

Reader = Callable[[int, memoryview], None]
"""Fill a buffer with a file's bytes from an offset (ShardChangedError when they are gone)."""


def range_span(start: int, end: int) -> tuple[int, int]:
    """The hash cache's row for a signed range [start, end) of a file that held its signed bytes (its
    value: their SHA-256): below -1, so never a tensor's span (from 0) nor a whole file's (-1, -1)."""
    return (-2 - start, -2 - end)


class SignedBytesMismatch(SignatureError):
    """Bytes of a file that are not the signed ones: `reason` says which, and what they hash to."""

    def __init__(self, shown: str, reason: str, span: tuple[int, int], expected: str, actual: str) -> None:
        super().__init__(f"{printable(shown)}: {reason}")
        self.reason = reason
        self.span = span
        """The bytes [start, end) of the file whose digest is not the signed one."""
        self.expected = expected
        self.actual = actual


def check_size(signed_file: SignedFile, size: int, shown: str, label: str) -> None:
    """SignatureError naming the file when a file of `size` bytes cannot be the one signed."""
    why = signed_file.mismatch(size)
    if why is not None:
        raise SignatureError(f"{printable(shown)}: not the file signed: {why} (the signature {label})")


def check_file(
    read: Reader,
    size: int,
    signed_file: SignedFile,
    shown: str,
    label: str,
    tensors: Iterable[tuple[int, int, str]] = (),
    advance: Callable[[int], None] | None = None,
    ranges: Iterable[tuple[int, int | None, str]] | None = None,
    refused: Callable[[int, int], object] | None = None,
) -> dict[str, str]:
    """Hash a file of `size` bytes in one pass: each signed range (or the whole) compared with the
    signature's digest, and the SHA-256 of each of `tensors` ((begin, end, name), absolute) taken on
    the way. `ranges`: only these consecutive ones of the signed ranges (which tile the file: the
    caller checked), `tensors` lying wholly inside them. SignedBytesMismatch (a SignatureError)
    naming the file and the range when its bytes are not the signed ones, `refused(start, end)`
    told of them first (ShardData.refused: a cache forgets them)."""
    if ranges is None:
        check_size(signed_file, size, shown, label)
        ranges = signed_file.ranges
    pending = sorted(tensors)
    active: list[tuple[int, int, str, hashlib._Hash]] = []
    digests: dict[str, str] = {}
    buffer = memoryview(bytearray(_CHUNK))
    nxt = 0
    for begin, end, want in ranges:
        end = size if end is None else end
        digest = hashlib.sha256()
        for offset in range(begin, end, _CHUNK):
            piece = buffer[: min(_CHUNK, end - offset)]
            try:
                read(offset, piece)
            except ShardChangedError as exc:
                raise SignatureError(f"{printable(shown)}: changed while it was checked: {exc}") from None
            digest.update(piece)
            stop = offset + len(piece)
            while nxt < len(pending) and pending[nxt][0] < stop:
                active.append((*pending[nxt], hashlib.sha256()))
                nxt += 1
            still = []
            for t_begin, t_end, name, t_digest in active:
                t_digest.update(piece[max(t_begin, offset) - offset : min(t_end, stop) - offset])
                if t_end <= stop:
                    digests[name] = t_digest.hexdigest()
                else:
                    still.append((t_begin, t_end, name, t_digest))
            active = still
            if advance is not None:
                advance(len(piece))
        if digest.hexdigest() != want:
            if refused is not None:
                refused(begin, end)
            span = "" if signed_file.whole else f" [{begin}, {end})"
            reason = f"bytes{span} hash to {digest.hexdigest()}, not to {want} as the signature {label} says"
            raise SignedBytesMismatch(shown, reason, (begin, end), want, digest.hexdigest())
    for _, _, name, t_digest in active:
        digests[name] = t_digest.hexdigest()
    for _, _, name in pending[nxt:]:  # empty tensors at the very end of what was read
        digests[name] = EMPTY
    return digests


@dataclass
class _Layout:
    """A signed file as the checks look it up: where each range starts, and the model's tensors in it
    by where they begin (absolute offsets)."""

    ranges: list[tuple[int, int, str]]
    """The signed ranges: (start, end, SHA-256), tiling the file (one, the whole, for a file signed whole)."""
    starts: list[int]
    tensors: list[tuple[int, int, str]]
    begins: list[int]


class SignedRanges:
    """The model's files as their signature says them, checked range by range (a file signed whole:
    its one range) as their tensors are first read, or at open (see the module's docstring). Each
    byte checked is hashed once, for its range: the tensors it holds are proven by it, their own
    digests (their values) taken on the way only where something may need them (`values`: a
    fallback's copy to hold to them; a remote file signed whole, whose identity does not prove its
    bytes, for a later open to hold its tensors to) or where asked for (a .sha256). Picklable: a
    mount's daemon is handed it."""

    def __init__(self, files: dict[ShardKey, SignedFile], label: str, *, values: bool = False) -> None:
        self.files = files
        """Each file (a shard of the model), and what the signature says of its ranges."""
        self.label = label
        """Where the signature was read from, as messages say it."""
        self.values = values
        """Whether a check takes the values of the tensors it proves, whatever their shard."""
        self._layouts: dict[ShardKey, _Layout] = {}  # made when first needed, in each process
        self._lock = threading.Lock()
        self._checking: dict[_CheckKey, Future[dict[str, str]]] = {}  # made (the latest), under way
        self._done: deque[_CheckKey] = deque()

    def __getstate__(self) -> dict[str, Any]:
        return {"files": self.files, "label": self.label, "values": self.values}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.files, self.label, self.values, self._layouts = state["files"], state["label"], state["values"], {}
        self._lock, self._checking, self._done = threading.Lock(), {}, deque()

    def open(self, hasher: Hasher, *, everything: bool = False, progress: bool = False) -> Checked:
        """What is known when the model is opened: the tensors whose ranges the hash cache knows held
        their signed bytes (for this identity of their file, where it proves them; their values
        where it keeps them), empty tensors, and what the ranges holding bytes no tensor holds give,
        checked now (for a file signed whole: the file). `everything` (--verify all): every range
        checked now, whatever the cache knows. SignatureError naming the file (and the range) when
        the file cannot be the signed one or those bytes are not its."""
        model, cache = hasher.model, hasher.cache
        known = Checked(set(), {})
        jobs: list[tuple[ShardKey, int, int]] = []
        for shard, signed_file in self.files.items():
            header = model.shard_header(shard)
            check_size(signed_file, header.file_size, str(shard), self.label)
            layout = self._layout(hasher, shard)
            empty = {name for begin, end, name in layout.tensors if begin == end}
            known.proven |= empty
            known.values.update(dict.fromkeys(empty, EMPTY))
            held: set[int] = set()  # the ranges the cache knows held their signed bytes
            identity = model.identity(shard)
            if identity is not None and cache.enabled and not everything:
                start = header.data_start
                spans = [range_span(b, e) for b, e, _ in layout.ranges]
                spans += [(b - start, e - start) for b, e, _ in layout.tensors]
                found = cache.get_many(identity, spans)
                held = {i for i, (b, e, want) in enumerate(layout.ranges) if found.get(range_span(b, e)) == want}
                proves = model.shard_data(shard).identity_proves_bytes
                for begin, end, name in layout.tensors:
                    if begin == end or not self._covering(layout, begin, end) <= held:
                        continue
                    if proves:
                        known.proven.add(name)
                    digest = found.get((begin - start, end - start))
                    if digest is not None:
                        known.values[name] = digest
            if everything:
                needed = set(range(len(layout.ranges)))
            else:
                needed = set().union(*(self._covering(layout, a, b) for a, b in _gaps(layout, header.file_size)))
            jobs += self._jobs(hasher, shard, needed - held, values=False)
        total = sum(end - start for start, end in (self._span(hasher, job) for job in jobs))
        with Progress(total, "hashing the signed files, once", enabled=None if progress else False) as line:
            known.update(self._run(hasher, jobs, line.advance if progress else None))
        return known

    def establish(
        self,
        names: list[str],
        hasher: Hasher,
        progress: Callable[[int], None] | None = None,
        *,
        values: bool = False,
        generations: Mapping[ShardKey, int] | None = None,
    ) -> Checked:
        """Check the ranges that hold these tensors' bytes, whole (integrity.Pending.establish): each
        range once, several at a time. `values`: take these tensors' values (and those of the others
        those ranges hold whole) whatever the shard."""
        model = hasher.model
        jobs: list[tuple[ShardKey, int, int]] = []
        known = Checked(set(), {})
        for shard, entries in model.by_shard(names).items():
            layout, start = self._layout(hasher, shard), model.shard_header(shard).data_start
            needed: set[int] = set()
            for entry in entries:
                if entry[BEGIN] == entry[END]:
                    known.proven.add(entry[NAME])
                    known.values[entry[NAME]] = EMPTY
                needed |= self._covering(layout, start + entry[BEGIN], start + entry[END])
            jobs += self._jobs(hasher, shard, needed, values=values)
        known.update(self._run(hasher, jobs, progress, names, values=values, generations=generations))
        return known

    def _jobs(
        self, hasher: Hasher, shard: ShardKey, needed: set[int], *, values: bool
    ) -> list[tuple[ShardKey, int, int]]:
        """The checks of these ranges of a file: each run of consecutive ones where the tensors' values
        are taken (a tensor over two ranges is hashed in one pass), else each range alone (so that
        several hash at once)."""
        if values or self._takes_values(hasher, shard):
            return [(shard, first, last) for first, last in _runs(needed)]
        return [(shard, index, index) for index in sorted(needed)]

    def _takes_values(self, hasher: Hasher, shard: ShardKey) -> bool:
        """Whether a check of the file takes the values of the tensors it proves: with fallbacks, and for
        a remote file signed whole, whose later open (its object's identity proving nothing) then
        hashes each tensor it serves against its value rather than the whole file at open. A remote
        file signed by ranges is checked range by range again instead (as cheap: each byte once)."""
        return self.values or self._values_are_its_proof(hasher, shard)

    def _values_are_its_proof(self, hasher: Hasher, shard: ShardKey) -> bool:
        """Whether the values of a file's tensors are what a later open holds them to: a remote file
        signed whole. Every one is kept then, the smallest too: without its value a tensor can be
        proven only by the whole file, hashed again."""
        return self.files[shard].whole and not hasher.model.shard_data(shard).identity_proves_bytes

    def _run(
        self,
        hasher: Hasher,
        jobs: list[tuple[ShardKey, int, int]],
        progress: Callable[[int], None] | None,
        names: list[str] | None = None,
        *,
        values: bool = False,
        generations: Mapping[ShardKey, int] | None = None,
    ) -> Checked:
        """Run the checks, several at once (on every core: hashlib lets go of the GIL), largest first;
        the tensors they proved, and the values taken (`values`: of every tensor they hold whole). A
        mismatch found for a tensor of `names` is an IntegrityError naming it (else the
        SignatureError naming the file)."""
        known = Checked(set(), {})
        if not jobs:
            return known
        checked: dict[ShardKey, set[int]] = {}
        takes = {shard for shard, _, _ in jobs if self._takes_values(hasher, shard)}

        def one(job: tuple[ShardKey, int, int]) -> dict[str, str]:
            shard, first, last = job
            try:
                since = (generations or {}).get(shard, 0)
                return self._shared(hasher, shard, first, last, progress, values=values or shard in takes, since=since)
            except SignedBytesMismatch as exc:
                if names is None:
                    raise
                name = next((n for n in names if self._holds(hasher, n, shard, exc.span)), names[0])
                said = f"{printable(str(shard))}: tensor '{printable(name)}': {exc.reason}"
                raise IntegrityError(said, name, exc.expected, exc.actual, exc.span) from None
            except SignatureError as exc:  # its bytes gone while read: as the gate says of a tensor's
                if names is None:
                    raise
                raise ShardChangedError(str(exc)) from None

        ordered = sorted(jobs, key=lambda job: -self._span(hasher, job)[1] + self._span(hasher, job)[0])
        if len(ordered) == 1:
            found = [one(ordered[0])]
        else:
            # Each in the request's own context (its deadline: waits.py); the first failure cancels the
            # checks not begun (they would wait on the same bytes again, each a timeout more).
            pool = ThreadPoolExecutor(max_workers=min(CHECKERS, len(ordered)))
            try:
                found = list(
                    pool.map(lambda run: run(), [functools.partial(waits.in_copy(one), job) for job in ordered])
                )
            finally:
                pool.shutdown(wait=True, cancel_futures=True)
        for (shard, first, last), digests in zip(ordered, found, strict=True):
            checked.setdefault(shard, set()).update(range(first, last + 1))
            known.values.update(digests)
        for shard, indices in checked.items():
            known.proven |= self._proven(hasher, shard, indices)
        return known

    def _shared(
        self,
        hasher: Hasher,
        shard: ShardKey,
        first: int,
        last: int,
        advance: Callable[[int], None] | None,
        *,
        values: bool,
        since: int,
    ) -> dict[str, str]:
        """_check(), once however many ask: a check of the same ranges made or under way since the same
        change of the file (`since`: the gate's count of its changes) is taken, or waited for (a
        mount's readers of one tensor, and the kernel's reads ahead of them, come together; the
        gate makes a tensor verified only if its file did not change meanwhile). A check that failed
        is made again when asked for."""
        key = (shard, first, last, values, since)
        with self._lock:
            running = self._checking.get(key)
            mine = running is None
            if running is None:
                running = self._checking[key] = Future()
        if not mine:  # waited for as long as the request may wait on its bytes (waits.py)
            limit = hasher.model.shard_data(shard).wait_limit
            shared: dict[str, str] = waits.wait_for(
                running, limit, lambda: f"{printable(str(shard))}: a check of its signed bytes"
            )
            return shared
        try:
            digests = self._check(hasher, shard, first, last, advance, values=values)
        except BaseException as exc:
            running.set_exception(exc)
            with self._lock:
                del self._checking[key]
            raise
        running.set_result(digests)
        with self._lock:  # kept for whoever asks later since the same change, the latest so many
            self._done.append(key)
            while len(self._done) > _KEPT_CHECKS:
                self._checking.pop(self._done.popleft(), None)
        return digests

    def _check(
        self,
        hasher: Hasher,
        shard: ShardKey,
        first: int,
        last: int,
        advance: Callable[[int], None] | None = None,
        *,
        values: bool,
    ) -> dict[str, str]:
        """Hash ranges first..last of the file against the signature, read as the gate reads it (each
        byte once); with `values`, the digests of the tensors lying wholly inside them taken on the
        way. What held its signed bytes is kept in the hash cache (the ranges, and values taken)."""
        model = hasher.model
        header = model.shard_header(shard)
        layout = self._layout(hasher, shard)
        ranges = layout.ranges[first : last + 1]
        low, high = ranges[0][0], ranges[-1][1]
        inside = []
        if values:
            for begin, end, name in layout.tensors[bisect.bisect_left(layout.begins, low) :]:
                if begin > high:
                    break
                if end <= high:
                    inside.append((begin, end, name))

        def read(offset: int, buffer: memoryview) -> None:
            model.readinto(shard, offset, buffer)

        signed_file = self.files[shard]
        refused = model.shard_data(shard).refused
        digests = check_file(
            read, header.file_size, signed_file, str(shard), self.label, inside, advance, ranges, refused
        )
        hasher.count(high - low)
        identity = model.identity(shard)
        if identity is not None and hasher.cache.enabled:
            start = header.data_start
            rows = {range_span(b, e): want for b, e, want in ranges}
            every = self._values_are_its_proof(hasher, shard)
            rows.update(
                {(b - start, e - start): digests[name] for b, e, name in inside if every or e - b >= CACHE_MIN_BYTES}
            )
            hasher.cache.put_many(identity, rows)
        return digests

    def _proven(self, hasher: Hasher, shard: ShardKey, checked: set[int]) -> set[str]:
        """The tensors of the file whose every byte lies in ranges `checked` (and that hold bytes)."""
        layout = self._layout(hasher, shard)
        low, high = layout.ranges[min(checked)][0], layout.ranges[max(checked)][1]
        proven = set()
        for begin, end, name in layout.tensors[bisect.bisect_left(layout.begins, low) :]:
            if begin >= high:
                break
            if begin < end and self._covering(layout, begin, end) <= checked:
                proven.add(name)
        return proven

    def _span(self, hasher: Hasher, job: tuple[ShardKey, int, int]) -> tuple[int, int]:
        """The bytes [start, end) of the file a check of ranges first..last reads."""
        shard, first, last = job
        ranges = self._layout(hasher, shard).ranges
        return ranges[first][0], ranges[last][1]

    def _layout(self, hasher: Hasher, shard: ShardKey) -> _Layout:
        layout = self._layouts.get(shard)
        if layout is None:
            header = hasher.model.shard_header(shard)
            start = header.data_start
            tensors = sorted((start + e[BEGIN], start + e[END], e[NAME]) for e in header.entries)
            size = header.file_size  # (a file signed whole: one range, to its end)
            ranges = [(begin, size if end is None else end, want) for begin, end, want in self.files[shard].ranges]
            starts = [begin for begin, _, _ in ranges]
            layout = self._layouts[shard] = _Layout(ranges, starts, tensors, [begin for begin, _, _ in tensors])
        return layout

    @staticmethod
    def _covering(layout: _Layout, begin: int, end: int) -> set[int]:
        """The indices of the ranges that hold bytes [begin, end) of the file (none for no bytes)."""
        if begin >= end:
            return set()
        first = bisect.bisect_right(layout.starts, begin) - 1
        last = bisect.bisect_right(layout.starts, end - 1) - 1
        return set(range(first, last + 1))

    def _holds(self, hasher: Hasher, name: str, shard: ShardKey, span: tuple[int, int]) -> bool:
        """Whether tensor `name` has bytes in [span) of `shard`."""
        where, begin, nbytes = hasher.model.locate(name)
        return where == shard and begin < span[1] and span[0] < begin + nbytes


def _gaps(layout: _Layout, size: int) -> list[tuple[int, int]]:
    """The bytes [a, b) of a file of `size` that no tensor holds."""
    gaps, reached = [], 0
    for begin, end, _ in layout.tensors:
        if begin > reached:
            gaps.append((reached, begin))
        reached = max(reached, end)
    if reached < size:
        gaps.append((reached, size))
    return gaps


def _runs(indices: set[int]) -> list[tuple[int, int]]:
    """Consecutive indices as (first, last) runs."""
    runs: list[tuple[int, int]] = []
    for index in sorted(indices):
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs
