"""A file's bytes against what a signature says of them (signing.py's SignedFile): hashed whole, or
range by range, the SHA-256 of its tensors taken on the way (check_file); and the files of a model
signed by ranges, whose ranges are checked as their tensors are first read (SignedRanges).

A file signed by ranges (model_signing's sharded hashing) need not be read whole before a tensor of
it is served: the ranges that hold a tensor's bytes are hashed whole when the tensor is first
checked, through the gate's read path (a remote file's chunks through the cache), and compared with
the signature; the tensor's SHA-256, and that of every other tensor lying wholly inside them, taken
in the same pass, become the manifest's values the gate holds them to. The bytes no tensor holds
(the header the table was read from, a GGUF's padding, a checkpoint's zip records) are checked
when the model is opened. What was found is kept in the hash cache by the file's identity: each
range that held its signed bytes, and the tensors' digests, so a later open checks nothing again.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .errors import IntegrityError, ShardChangedError, printable
from .formats import BEGIN, END, NAME
from .identity import ShardKey
from .integrity import HASH_WORKERS, Hasher
from .signing import SignatureError, SignedFile

_CHUNK = 1 << 20
EMPTY = hashlib.sha256().hexdigest()

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
    """A file signed by ranges as the checks look it up: where each range starts, and the model's
    tensors in it by where they begin (absolute offsets)."""

    ranges: list[tuple[int, int, str]]
    """The signed ranges: (start, end, SHA-256), tiling the file."""
    starts: list[int]
    tensors: list[tuple[int, int, str]]
    begins: list[int]


class SignedRanges:
    """The model's files signed by ranges whose tensors' values are established as they are first
    checked (integrity.Pending; see the module's docstring). Picklable: a mount's daemon is handed it."""

    def __init__(self, files: dict[ShardKey, SignedFile], label: str) -> None:
        self.files = files
        """Each such file (a shard of the model), and what the signature says of its ranges."""
        self.label = label
        """Where the signature was read from, as messages say it."""
        self._layouts: dict[ShardKey, _Layout] = {}  # made when first needed, in each process

    def __getstate__(self) -> dict[str, Any]:
        return {"files": self.files, "label": self.label}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.files, self.label, self._layouts = state["files"], state["label"], {}

    def open(self, hasher: Hasher) -> dict[str, str]:
        """What is known when the model is opened: the values of the tensors whose ranges the hash
        cache knows held their signed bytes (for this identity of their file), empty tensors', and
        those the ranges holding bytes no tensor holds give, checked now. SignatureError naming the
        file (and the range) when the file cannot be the signed one or those bytes are not its."""
        model, cache = hasher.model, hasher.cache
        known: dict[str, str] = {}
        for shard, signed_file in self.files.items():
            header = model.shard_header(shard)
            check_size(signed_file, header.file_size, str(shard), self.label)
            layout = self._layout(hasher, shard)
            known.update({name: EMPTY for begin, end, name in layout.tensors if begin == end})
            held: set[int] = set()  # the ranges the cache knows held their signed bytes
            identity = model.identity(shard)
            if identity is not None and cache.enabled:
                start = header.data_start
                spans = [range_span(b, e) for b, e, _ in layout.ranges]
                spans += [(b - start, e - start) for b, e, _ in layout.tensors]
                found = cache.get_many(identity, spans)
                held = {i for i, (b, e, want) in enumerate(layout.ranges) if found.get(range_span(b, e)) == want}
                for begin, end, name in layout.tensors:
                    digest = found.get((begin - start, end - start))
                    if digest is not None and begin < end and self._covering(layout, begin, end) <= held:
                        known[name] = digest
            untensored = set().union(*(self._covering(layout, a, b) for a, b in _gaps(layout, header.file_size)))
            for first, last in _runs(untensored - held):
                known.update(self._check(hasher, shard, first, last))
        return known

    def establish(
        self, names: list[str], hasher: Hasher, progress: Callable[[int], None] | None = None
    ) -> dict[str, str]:
        """Check the ranges that hold these tensors' bytes, whole (integrity.Pending.establish)."""
        model = hasher.model
        jobs: list[tuple[ShardKey, int, int]] = []
        known: dict[str, str] = {}
        for shard, entries in model.by_shard(names).items():
            layout, start = self._layout(hasher, shard), model.shard_header(shard).data_start
            needed: set[int] = set()
            for entry in entries:
                if entry[BEGIN] == entry[END]:
                    known[entry[NAME]] = EMPTY
                needed |= self._covering(layout, start + entry[BEGIN], start + entry[END])
            jobs += [(shard, first, last) for first, last in _runs(needed)]

        def one(job: tuple[ShardKey, int, int]) -> dict[str, str]:
            try:
                return self._check(hasher, *job, progress)
            except SignedBytesMismatch as exc:
                name = next((n for n in names if self._holds(hasher, n, job[0], exc.span)), names[0])
                said = f"{printable(str(job[0]))}: tensor '{printable(name)}': {exc.reason}"
                raise IntegrityError(said, name, exc.expected, exc.actual, exc.span) from None
            except SignatureError as exc:  # its bytes gone while read: as the gate says of a tensor's
                raise ShardChangedError(str(exc)) from None

        if len(jobs) == 1:
            known.update(one(jobs[0]))
        elif jobs:
            with ThreadPoolExecutor(max_workers=HASH_WORKERS) as pool:
                for found in pool.map(one, jobs):
                    known.update(found)
        return known

    def _check(
        self, hasher: Hasher, shard: ShardKey, first: int, last: int, advance: Callable[[int], None] | None = None
    ) -> dict[str, str]:
        """Hash ranges first..last of the file against the signature, read as the gate reads it; the
        digests of the tensors lying wholly inside them, kept with the ranges in the hash cache."""
        model = hasher.model
        header = model.shard_header(shard)
        layout = self._layout(hasher, shard)
        ranges = layout.ranges[first : last + 1]
        low, high = ranges[0][0], ranges[-1][1]
        inside = []
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
        identity = model.identity(shard)
        if identity is not None and hasher.cache.enabled:
            start = header.data_start
            rows = {range_span(b, e): want for b, e, want in ranges}
            rows.update({(b - start, e - start): digests[name] for b, e, name in inside})
            hasher.cache.put_many(identity, rows)
        return digests

    def _layout(self, hasher: Hasher, shard: ShardKey) -> _Layout:
        layout = self._layouts.get(shard)
        if layout is None:
            header = hasher.model.shard_header(shard)
            start = header.data_start
            tensors = sorted((start + e[BEGIN], start + e[END], e[NAME]) for e in header.entries)
            ranges = [(begin, end, want) for begin, end, want in self.files[shard].ranges if end is not None]
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
