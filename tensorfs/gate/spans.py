"""Many tensors' bytes of one shard's file at once: a view's file read at the cost of its bytes, not of
its tensors (a weights file served as it is, a synthesized file's tensors that lie close together in
one shard's file, an export of either).

The tensors a range holds are admitted together as the gate admits each one (gate.py, read_into):
every change to their file reported so far applied once, for all of them; none while the file is held
(its status changed: changes.py); under a manifest, every one verified first, those not verified yet
hashed together (or proven together, by their file's signed bytes). Then their bytes are read from
the file in one read, and the file's generation looked at again: a change meanwhile, and they are
admitted and read again. The bytes no tensor holds are the ones kept as validated (untensored.py),
never those just read.

What cannot go that way goes tensor by tensor, through read_into, which refuses it and says why, or
switches it to its fallback: a tensor served from a fallback, one refused at its file's generation
already, one that was not verified by its batch, and every tensor of a file changed in place (no
manifest), of a shard whose reads failed a moment ago, or whose one read failed.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from ..catalogue.fallbacks import Copy
from ..catalogue.tables import Tables
from ..errors import IntegrityError, ShardChangedError, TensorfsError
from ..proof.integrity import Integrity
from ..sources.shard import ShardData
from ..utils.identity import ShardKey
from .changes import Changes
from .digests import Digests
from .files import FileState
from .plans import Place, Plan, StepKind
from .router import Router
from .untensored import KeptUntensored

__all__ = ["Run", "Served", "read_file"]

Run = tuple[int, int, str]
"""Bytes [start, end) of a shard's file (absolute offsets) that are a tensor's, and its name."""


@dataclass(frozen=True)
class Served:
    """Bytes [low, high) of `data` that went out: bytes [origin, origin + high - low) of the tensors of
    `shard` (their own file's offsets), had from their own file or, `copy`, from a fallback's."""

    shard: ShardKey
    origin: int
    data: ShardData
    low: int
    high: int
    copy: Copy | None = None


class GateParts(Protocol):
    """What of its gate a read of many tensors works with (gate.Gate)."""

    tables: Tables
    integrity: Integrity
    changes: Changes
    router: Router
    digests: Digests
    untensored: KeptUntensored

    @property
    def lock(self) -> threading.RLock: ...
    def read_into(self, name: str, begin: int, buffer: memoryview) -> Plan[Place]: ...
    def refusal(self, name: str, generation: int) -> TensorfsError | None: ...
    def passed_together(self, names: list[str], data: ShardData) -> None: ...
    def prove(self, names: list[str], progress: Callable[[int], None] | None = None) -> Plan[None]: ...


def read_file(
    gate: GateParts, shard: ShardKey, offset: int, buffer: memoryview, runs: Sequence[Run], *, untensored: bool
) -> Plan[list[Served]]:
    """Fill `buffer` with bytes [offset, offset + len(buffer)) of a shard's file: those of `runs` (the
    tensors' bytes the range holds, in file order, each within its tensor) as read_into() would give
    each; the rest, `untensored`, as read_untensored() would (all bytes no tensor holds), else zeros
    (bytes of the file the caller does not serve). What went out, and from where."""
    end = offset + len(buffer)
    previous = offset
    for start, stop, _ in runs:
        if not previous <= start < stop <= end:
            raise ValueError(f"runs of tensors' bytes out of order, or out of [{offset}, {end}): [{start}, {stop})")
        previous = stop
    gaps = _gaps(runs, offset, end)
    if untensored and gaps:
        kept = yield from gate.untensored.of(shard)
    served: list[Served] = []
    if runs:
        served = yield from _read_runs(gate, shard, offset, buffer, runs, untensored)
    for start, stop in gaps:  # never the bytes just read: those no tensor holds as kept, or none
        if untensored:
            kept.copy(start, buffer[start - offset : stop - offset])
        else:
            buffer[start - offset : stop - offset] = bytes(stop - start)
    return served


def _read_runs(
    gate: GateParts, shard: ShardKey, offset: int, buffer: memoryview, runs: Sequence[Run], untensored: bool
) -> Plan[list[Served]]:
    data = gate.tables.shard_data(shard)
    alone: set[str] = set()  # tensor by tensor, through read_into
    tried: set[str] = set()  # hashed (or proven) together once already
    while True:
        with gate.lock:
            gate.changes.notice(data)
            state = gate.changes.seen(data)
            assert state is not None
            held = state.held
        if held:
            yield from gate.changes.settled([state])
            continue
        with gate.lock:
            generation = state.generation
            if state.changed or gate.router.failing(shard, runs[0][0], runs[-1][1]) is not None:
                alone.update(name for _, _, name in runs)  # each refused, or to its fallback, and said so
            together, proving, hashing = _admitted(gate, runs, generation, alone, tried)
        if proving or hashing:
            tried.update(proving, hashing)
            yield from _verify(gate, data, state, generation, proving, hashing)
            continue
        groups = _groups(runs, together)
        if groups:
            try:
                yield "read", functools.partial(_read_groups, data, groups, offset, buffer)
            except (TensorfsError, OSError):
                alone.update(name for _, _, name in runs)  # each says which of its bytes cannot be had
                continue
            with gate.lock:
                gate.changes.notice(data)
                moved = bool(gate.router.copies) and not gate.router.copies.keys().isdisjoint(together)
                if state.generation != generation or moved:
                    continue  # written (or switched) while read: admitted and read again
        contiguous = _contiguous(runs, together)
        for low, high in contiguous:
            gate.changes.served_file(data, low, high)
        # What went out of the file: the tensors' bytes, and those between them where they are served too.
        served = [Served(shard, low, data, low, high) for low, high in (groups if untensored else contiguous)]
        for start, stop, name in runs:
            if name in together:
                continue
            begin = start - gate.tables.locate(name)[1]  # where in the tensor
            place = yield from gate.read_into(name, begin, buffer[start - offset : stop - offset])
            low = place.start + begin
            served.append(Served(shard, start, place.data, low, low + stop - start, place.copy))
        return served


def _admitted(
    gate: GateParts, runs: Sequence[Run], generation: int, alone: set[str], tried: set[str]
) -> tuple[set[str], list[str], list[str]]:
    """Of the runs' tensors (the gate's lock held): those whose bytes go out together now, and those to
    prove by their file's signed bytes, or to hash, first (the rest go tensor by tensor: `alone`)."""
    together = {name for _, _, name in runs}
    copies = gate.router.copies
    if copies:
        alone |= together & copies.keys()
    together -= alone
    expected = gate.integrity.expected
    unverified = together - gate.integrity.verified if expected is not None else set()
    if not unverified:
        return together, [], []
    together -= unverified
    proving: list[str] = []
    hashing: list[str] = []
    for _, _, name in runs:
        if name not in unverified:
            continue
        if name in tried or gate.refusal(name, generation) is not None:
            alone.add(name)  # refused, and said so, by read_into
        elif gate.integrity.unproven(name):
            proving.append(name)
        else:
            hashing.append(name)
    return together, proving, hashing


def _verify(
    gate: GateParts, data: ShardData, state: FileState, generation: int, proving: list[str], hashing: list[str]
) -> Plan[None]:
    """Verify these tensors of one file together: those a signature holds proven by their file's signed
    bytes, the others hashed (several at once) and held to the manifest. Those that do not pass are
    left to read_into, which says why (a mismatch's hash kept: not hashed again)."""
    if proving:
        with contextlib.suppress(IntegrityError, ShardChangedError):  # refused by read_into, and said so (once)
            yield from gate.prove(proving)
    if not hashing:
        return
    kind: StepKind = "read" if data.needs_ensure else "verify"
    try:
        actual: dict[str, str] = yield kind, functools.partial(gate.digests.shared_all, hashing, generation)
    except (TensorfsError, OSError):
        return  # each one's bytes read by read_into, which says which cannot be
    with gate.lock:
        gate.changes.notice(data)
        if state.generation != generation:
            return  # changed while hashed: hashed again
        expected = gate.integrity.expected
        verified = gate.integrity.verified
        copies = gate.router.copies
        if expected is not None:
            matched = [name for name, digest in actual.items() if expected.get(name) == digest]
            gate.passed_together([name for name in matched if name not in verified and name not in copies], data)


def _groups(runs: Sequence[Run], together: set[str]) -> list[tuple[int, int]]:
    """The ranges of the file to read: from the first byte to the last of each stretch of runs whose
    tensors go out together (a run of a tensor that goes alone ends one)."""
    return _stretches(runs, together, across_gaps=True)


def _contiguous(runs: Sequence[Run], together: set[str]) -> list[tuple[int, int]]:
    """The tensors' bytes that went out together, as contiguous ranges (what is fingerprinted)."""
    return _stretches(runs, together, across_gaps=False)


def _stretches(runs: Sequence[Run], together: set[str], *, across_gaps: bool) -> list[tuple[int, int]]:
    """The runs of tensors in `together` merged into ranges: consecutive ones, and with `across_gaps`
    those with bytes of no tensor between them too (a run of a tensor not in `together` ends one)."""
    found: list[tuple[int, int]] = []
    joined = False  # whether the next run of `together` may join the last range
    for start, stop, name in runs:
        if name not in together:
            joined = joined and not across_gaps
        elif joined and (across_gaps or found[-1][1] == start):
            found[-1] = (found[-1][0], stop)
        else:
            found.append((start, stop))
            joined = True
    return found


def _gaps(runs: Sequence[Run], offset: int, end: int) -> list[tuple[int, int]]:
    """The ranges of [offset, end) that no run holds."""
    gaps: list[tuple[int, int]] = []
    at = offset
    for start, stop, _ in runs:
        if start > at:
            gaps.append((at, start))
        at = stop
    if at < end:
        gaps.append((at, end))
    return gaps


def _read_groups(data: ShardData, groups: list[tuple[int, int]], offset: int, buffer: memoryview) -> None:
    """Read each range of the file into its place in `buffer` (which holds the file's bytes from `offset`)."""
    for low, high in groups:
        data.readinto(low, buffer[low - offset : high - offset])
