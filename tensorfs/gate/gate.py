"""The Gate: one per opened model, the only code that turns "tensor, byte range" into bytes that may
be handed out (see the package's docstring for the order in which it decides)."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import NoReturn, TypeVar

from ..catalogue.fallbacks import Copy, Fallbacks
from ..catalogue.tables import Tables
from ..errors import IntegrityError, ModelClosedError, RemoteError, ShardChangedError, TensorfsError, printable
from ..proof.integrity import Hasher, Integrity, sha256_of
from ..sources.shard import ShardData
from ..utils.identity import ShardKey
from .changes import Changes
from .digests import Digests
from .plans import UNREADABLE, Grant, Place, Plan, Present, Refused, StepKind, run
from .reporter import Reporter
from .router import Router
from .spans import Run, Served, read_file
from .untensored import KeptUntensored

T = TypeVar("T")

__all__ = ["Gate"]

log = logging.getLogger("tensorfs.gate")


class Gate:
    """One opened model's policy for its bytes (see the module's docstring). Thread-safe."""

    def __init__(self, tables: Tables, fallbacks: Fallbacks | None = None) -> None:
        self.tables = tables
        self.integrity = Integrity(Hasher(tables))
        """The manifest in force (none until set_integrity()), what is verified, and the hasher."""
        self.fallbacks = fallbacks
        """Other copies of the model, tried in order when a tensor's own shard cannot give its bytes."""
        self.reporter = Reporter()
        self._lock = threading.RLock()
        self._bad: dict[str, tuple[int, TensorfsError]] = {}
        """Tensors found not to match (or not to be readable), by their shard's generation then: refused
        without hashing them again until their shard changes (a reader's retries cost nothing)."""
        self.changes = Changes(self)
        """Changes to the files, as applied (changes.py): refused, verified again, or checked first."""
        self.router = Router(tables, fallbacks, self.changes.files, self._lock, self.place, lambda: self.reporter)
        """Which fallback copy each tensor is served from, the next one that agrees, the retry rule."""
        self.digests = Digests(self._lock, lambda: self.integrity, self.changes.generations, self._settled)
        """Tensors' SHA-256s as they are now, each hashed once however many ask."""
        self.untensored = KeptUntensored(tables, self.changes, self._lock)
        """The bytes of shard files that no tensor holds, kept as validated (read_untensored)."""
        self.closed = False

    @property
    def lock(self) -> threading.RLock:
        """The lock every state change of the gate is made under (its parts' too: changes.py)."""
        return self._lock

    def forget_refusals(self, names: list[str]) -> None:
        """What was found of these tensors is no answer now (their shard changed; the lock held)."""
        for name in names:
            self._bad.pop(name, None)

    # -- the manifest --------------------------------------------------------------------------
    def set_integrity(self, integrity: Integrity) -> None:
        """Prove bytes with `integrity` from now on: its hasher (and hash cache), and its manifest if it
        has one. Then no byte of a tensor goes out before it matches the manifest, and remote bytes
        that come again must be the bytes that passed (their chunks held to SHA-256s)."""
        with self._lock:
            self.integrity = integrity
            self.router.verified.clear()
            self._bad.clear()
        if integrity.expected is not None:
            for shard in self.tables.opened_shards():
                shard.data.hold_to_manifest()

    @property
    def expected(self) -> Mapping[str, str] | None:
        """The manifest's values by tensor (None: no manifest in force)."""
        return self.integrity.expected

    # -- where the bytes are -------------------------------------------------------------------
    def place(self, name: str) -> Place:
        """Where the tensor's bytes are had now (its own shard, or the fallback copy it was switched to)."""
        shard = self.tables.shard_of(name)  # TensorNotFound for a name not in the model
        copy = self.router.copies.get(name)
        begin, end = shard.by_name[name][:2]
        start = shard.header.data_start
        if copy is not None:
            return Place(name, shard.header.path, copy.data, copy.start, copy.end, copy)
        return Place(name, shard.header.path, shard.data, start + begin, start + end)

    # -- the plans -----------------------------------------------------------------------------
    def read(self, name: str, begin: int, end: int, present: Present | None = None) -> Plan[Grant]:
        """The bytes [begin, end) of a tensor (offsets in the tensor, clipped to it) that may go out,
        made present by `present` (default: fetched and pinned where the source needs it, for as long
        as the model is open)."""
        present = present or self._present

        def serve(place: Place) -> Plan[Grant | None]:
            low = min(place.start + begin, place.end)
            high = min(place.start + max(begin, end), place.end)
            yield from self._admitted(place, low, high)
            if self._moved(place):
                return None
            try:
                copied = yield from present(place, low, high)
            except TensorfsError as exc:  # the source's words, said of the tensor
                raise self._unreadable(place, low, high, exc) from None
            self.changes.served(place, low, high)
            return Grant(place, low, high, copied)

        return (yield from self._served(name, serve))

    def admit(self, name: str) -> Plan[Place]:
        """Whether the tensor's bytes may go out at all (its place checked, and verified): its place."""

        def serve(place: Place) -> Plan[Place | None]:
            yield from self._admitted(place, place.start, place.end)
            return None if self._moved(place) else place

        return (yield from self._served(name, serve))

    def read_into(self, name: str, begin: int, buffer: memoryview) -> Plan[Place]:
        """Fill `buffer` with the tensor's bytes from `begin` (in the tensor), read from the file (or
        through the cache), never the mapping: for answers assembled from several tensors. Its place."""

        def serve(place: Place) -> Plan[Place | None]:
            low = place.start + begin
            high = low + len(buffer)
            if high > place.end:
                raise ValueError(f"bytes [{begin}, {begin + len(buffer)}) are not all in tensor {name!r}")
            yield from self._admitted(place, low, high)
            if self._moved(place):
                return None
            generation = self.changes.generation(place)
            try:
                yield "read", functools.partial(place.data.readinto, low, buffer)
            except TensorfsError as exc:
                raise self._unreadable(place, low, high, exc) from None
            # Written while it was read: not its bytes. Checked again (refused, or verified again).
            if self.changes.generation(place) != generation:
                return None
            self.changes.served(place, low, high)
            return place

        return (yield from self._served(name, serve))

    def read_file(
        self, shard: ShardKey, offset: int, buffer: memoryview, runs: Sequence[Run], *, untensored: bool = True
    ) -> Plan[list[Served]]:
        """Fill `buffer` with bytes of a shard's file from `offset`, many tensors' at once (spans.py):
        those of `runs` as read_into() would give each, the rest as read_untensored() would (else zeros).
        What went out, and from where."""
        return read_file(self, shard, offset, buffer, runs, untensored=untensored)

    def read_untensored(self, shard: ShardKey, offset: int, buffer: memoryview) -> Plan[None]:
        """Fill `buffer` with bytes of a shard's file from `offset` that no tensor holds (its header,
        the padding between tensors, a checkpoint's zip records; all within one such run): a view
        serving the file as it is. They are the bytes of the file that was validated when the model
        was opened (its table was read from them then; under a signature they were proven then: the
        file's digest, or the ranges that hold them), kept from their first read (keep_untensored)
        while the file is unchanged; Refused when it changed in place before that."""
        kept = yield from self.untensored.of(shard)
        kept.copy(offset, buffer)

    def copy_untensored(self, shard: ShardKey, offset: int, buffer: memoryview) -> None:
        """read_untensored(), blocking."""
        run(self.read_untensored(shard, offset, buffer))

    def keep_untensored(self, shard: ShardKey) -> None:
        """Read and keep the bytes of a shard's file that no tensor holds (blocking), now, while it is
        the file validated (untensored.py); Refused when the file changed in place since it was opened."""
        self.untensored.keep(shard)

    def refusal(self, name: str, generation: int) -> TensorfsError | None:
        """Why the tensor is refused at its shard's `generation`, found before (its bytes do not match,
        or cannot be had): refused again without hashing them (None: nothing found)."""
        known = self._bad.get(name)
        return known[1] if known is not None and known[0] == generation else None

    def _served(self, name: str, serve: Callable[[Place], Plan[T | None]]) -> Plan[T]:
        """`serve(place)` of where the tensor's bytes are had, until it answers: again from where they
        are had now when it says None (switched meanwhile by another reader, or written while read),
        and from the tensor's next fallback after what a fallback stands in for (UNREADABLE)."""
        place = self.place(name)
        while True:
            try:
                answer = yield from serve(place)
            except UNREADABLE as exc:
                if self.integrity.unproven(name):
                    raise  # its value rests on its own file's signed bytes: no copy can be held to it
                place = yield from self.router.switched(place, exc, self._expected_of)
                continue
            if answer is not None:
                return answer
            place = self.place(name)

    # -- the library's ways in (blocking) -----------------------------------------------------
    def held(self, name: str) -> Grant:
        """The tensor's bytes, made present and held (a remote shard's chunks kept in the cache while
        the model is open): the library's arrays and tensors are made over them."""
        return run(self.read(name, 0, 1 << 62))

    def check(self, name: str) -> None:
        """Whether the tensor's bytes may go out (verified first, where a manifest is in force)."""
        run(self.admit(name))

    def copy_into(self, name: str, begin: int, buffer: memoryview) -> None:
        """read_into(), blocking."""
        run(self.read_into(name, begin, buffer))

    def verify_many(self, names: Iterable[str], progress: Callable[[int], None] | None = None) -> None:
        """Verify these tensors, hashing several at once (those in their own shards, not yet verified):
        IntegrityError for the first, by name, that does not match (every matching one is verified).
        A tensor served from a fallback is verified as any, when it is asked for."""
        with self._lock:
            expected = self.integrity.expected
            if expected is None:
                return
            todo = [n for n in names if n not in self.router.copies and n not in self.integrity.verified]
            unproven = [name for name in todo if self.integrity.unproven(name)]
        if unproven:  # their files' signed bytes checked (each byte hashed once), not the tensors hashed
            run(self.prove(unproven, progress))
            with self._lock:
                todo = [name for name in todo if name not in self.integrity.verified]
        with self._lock:
            generations = {name: self.changes.state_of(name).generation for name in todo}
        if not todo:
            return
        actual = self.integrity.hash_all(todo, progress)
        with self._lock:
            self.changes.notice()
            bad = []
            for name, digest in actual.items():
                if self.changes.state_of(name).generation != generations[name]:
                    continue  # changed while hashed: verified when asked for
                if digest == expected[name]:
                    self._pass(name)
                else:
                    bad.append(name)
            errors = {
                name: self._mismatch(name, self.tables.locate(name)[0], actual[name], expected[name]) for name in bad
            }
        for name, error in errors.items():
            run(self._refuse_bytes(self.place(name), error, generations[name]))
        if bad:
            raise errors[min(bad)]

    def bring_in(self, names: list[str]) -> None:
        """Bring in the pages of these neighbouring tensors of one shard (their chunks fetched, for a
        remote one), mapped in the private mapping the library's tensors are made on. Those served
        from a fallback, or whose shard cannot give them, each through read() (switching them)."""
        if not names:
            return
        places = [self.place(name) for name in names]
        data = places[0].data
        if all(p.copy is None and p.data is data for p in places) and self.router.failing(places[0].shard) is None:
            low, high = places[0].start, places[-1].end
            with contextlib.suppress(*UNREADABLE):
                if data.ensure_private(low, high, within=(low, high)):
                    return
            if self.fallbacks is None:
                raise ShardChangedError(f"{data.label}: bytes [{low}, {high}) cannot be read")
        for name in names:
            run(self.read(name, 0, 1 << 62, present=self._present_private))

    # -- hashes of the bytes (the mount's .sha256 sidecars and SHA256SUMS) ----------------------
    def digest(self, name: str) -> Plan[str]:
        """The SHA-256 of the tensor's bytes in its own shard, as they are now (found, or hashed once
        however many ask). Refused when its shard changed in place without a manifest."""
        return self.digests.of(name)

    def digest_all(self, names: list[str]) -> Plan[dict[str, str]]:
        """Every tensor's SHA-256 (those not known hashed together, on the hasher's threads); Refused
        when a shard changed in place without a manifest, before or while they were hashed."""
        return self.digests.of_all(names)

    def manifest_values(self, names: list[str]) -> Plan[dict[str, str]]:
        """The manifest's values of these tensors (one must be in force): those a signature's ranges
        hold, and not known yet, established first (their ranges read and checked: IntegrityError if
        they are not the signed bytes). What a .sha256 sidecar or SHA256SUMS says under a manifest."""
        expected = self.integrity.expected
        assert expected is not None
        unproven = [name for name in names if self.integrity.unproven(name)]
        if unproven:
            yield "verify", functools.partial(self.integrity.establish, unproven, values=True)
        return {name: expected[name] for name in names}

    # -- changes to the files --------------------------------------------------------------------
    def watch_fd(self) -> int:
        """The descriptor that becomes readable when a watched file changes (-1: none to wait on)."""
        return self.changes.files.fileno()

    def notice_changes(self) -> None:
        """Apply every change to the files reported so far (a mount does it between requests too)."""
        with self._lock:
            self.changes.notice()

    def changed_shards(self) -> list[ShardKey]:
        """The model's shards changed in place with no manifest: refused until opened again."""
        with self._lock:
            return self.changes.changed_shards()

    def fingerprint_served(self) -> None:
        """From now on, fingerprint the bytes served from the shards' files (a mount): a shard whose
        status changes, with no manifest, is then checked against them, and refused only if they differ."""
        self.changes.fingerprint_from_now()

    def held_shards(self) -> bool:
        """Whether a shard is held now: its status changed with no manifest, its bytes served to be
        checked (check_held(); a read of its tensors waits for that)."""
        with self._lock:
            return bool(self.changes.held())

    def check_held(self) -> None:
        """Check every held shard's bytes served so far against their fingerprints (blocking): served
        on, or refused from now on."""
        with self._lock:
            held = self.changes.held()
        for state in held:
            self.changes.check(state)

    def fingerprints_pending(self) -> int:
        """Bytes served whose fingerprints are still to take (quick)."""
        with self._lock:
            return self.changes.pending()

    def fingerprint_pending(self) -> int:
        """Take the fingerprints of the bytes served since the last call (blocking; a mount's background
        work, at low priority); the bytes served whose fingerprints are still to take."""
        self.changes.fingerprint_served()
        with self._lock:
            return self.changes.pending()

    def _settled(self, names: list[str]) -> Plan[None]:
        """The held shards of these tensors checked first (changes.py)."""
        with self._lock:
            self.changes.notice()
            states = list({id(state): state for name in names if (state := self.changes.state_of(name)).held}.values())
        yield from self.changes.settled(states)

    # -- the fallbacks ---------------------------------------------------------------------------
    def copy(self, name: str) -> Copy | None:
        """The fallback's copy a tensor is served from, if it is."""
        return self.router.copies.get(name)

    def failed(self, shard: ShardKey) -> None:
        """A read of the shard's bytes failed (see Router.failed)."""
        self.router.failed(shard)

    def check_open(self) -> None:
        """ModelClosedError once the model is closed."""
        if self.closed:
            raise ModelClosedError(self.tables.source)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.changes.close()
        self.router.close()

    # -- inside the plans --------------------------------------------------------------------------
    def _admitted(self, place: Place, low: int, high: int) -> Plan[None]:
        """Raise what keeps the place from giving bytes [low, high) now; verify it first if need be."""
        while True:
            with self._lock:
                self.changes.notice(place.data)
                state = self.changes.seen(place.data)
                held = state is not None and state.held and place.copy is None
            if held:
                assert state is not None
                yield from self.changes.settled([state])
                continue
            with self._lock:
                if place.copy is None:
                    failing = self.router.failing(place.shard, low, high)
                    if failing is not None and not self.integrity.unproven(place.name):
                        raise failing  # to its fallback at once
                    assert state is not None
                    self.changes.refuse_if_changed(place.name, state)
                    proven = self.integrity.verified
                elif state is not None and state.changed:
                    raise ShardChangedError(
                        f"{place.data.label} (fallback {place.copy.source}): changed in place since it was "
                        f"opened, and no manifest can tell its bytes: tensor '{printable(place.name)}' is not "
                        "served from it"
                    )
                else:
                    proven = self.router.verified
                expected = self.integrity.expected
                if expected is None or place.name in proven:
                    return
                generation = state.generation if state is not None else 0
                known = self._bad.get(place.name) if place.copy is None else None
                if known is not None and known[0] == generation:
                    raise known[1]
                unproven = place.copy is None and self.integrity.unproven(place.name)
            if unproven:  # its file's signed bytes checked: proven (or not) without hashing it again
                yield from self.prove([place.name])
                with self._lock:
                    if place.name in self.integrity.verified or self._moved(place):
                        return  # (read from its own file just now: a failure since is not waited out)
                continue
            actual = yield from self._hash_of(place, generation)
            with self._lock:
                self.changes.notice(place.data)
                if state is not None and state.generation != generation:
                    continue  # changed while it was hashed: hashed again
                if self._moved(place):
                    return  # switched meanwhile: the caller starts again from its new place
                if actual == expected[place.name]:
                    if place.copy is None:
                        self._pass(place.name)
                    else:
                        self.router.verified.add(place.name)
                    return
                if place.copy is not None:
                    error = IntegrityError(
                        f"{place.data.label} (fallback {place.copy.source}): tensor '{printable(place.name)}': "
                        f"its bytes hash to {actual}, not to {expected[place.name]} as {self.integrity.label} says",
                        place.name,
                        expected[place.name],
                        actual,
                    )
                else:
                    error = self._mismatch(place.name, place.shard, actual, expected[place.name])
            yield from self._refuse_bytes(place, error, generation)
            raise error

    def prove(self, names: list[str], progress: Callable[[int], None] | None = None) -> Plan[None]:
        """Check the signed bytes these tensors rest on (Integrity.establish): each tensor they prove
        is verified, unless its file changed meanwhile (then it is checked again when asked for).
        A check that fails refuses the tensor, as a tensor's own mismatch is (_hash_of)."""
        with self._lock:
            self.changes.notice()
            seen = {id(self.changes.state_of(name)): self.changes.state_of(name) for name in names}
            before = {key: state.generation for key, state in seen.items()}
            generations = {self.tables.locate(name)[0]: self.changes.state_of(name).generation for name in names}
        kind: StepKind = "read" if any(self.place(name).data.needs_ensure for name in names) else "verify"
        establish = functools.partial(self.integrity.establish, names, progress, generations=generations)
        try:
            proven: set[str] = yield kind, establish
        except ShardChangedError as exc:
            if len(names) > 1:
                raise
            place = self.place(names[0])
            yield from self._unproven(place, exc, before[id(self.changes.state_of(place.name))])
        except IntegrityError as exc:  # the bytes they rest on are not the signed ones
            place = self.place(exc.tensor if exc.tensor in names else names[0])
            yield from self._unproven(place, exc, before[id(self.changes.state_of(place.name))])
        with self._lock:
            self.changes.notice()
            for name in proven:
                state = self.changes.state_of(name)
                if before.get(id(state)) == state.generation and name not in self.integrity.verified:
                    self._pass(name)

    def _unproven(self, place: Place, exc: ShardChangedError | IntegrityError, generation: int) -> Plan[NoReturn]:
        """A check of the bytes the place rests on failed. Its bytes gone (ShardChangedError): refused
        until its shard changes again. Not the signed ones (IntegrityError): said once a change of its
        shard, and its bytes refused (_refuse_bytes); raised as it came."""
        if isinstance(exc, ShardChangedError):
            with self._lock:
                refused = Refused(str(exc))
                if self._bad.get(place.name, (-1,))[0] != generation:
                    self._bad[place.name] = (generation, refused)
                    self.reporter.unverifiable(place.name, place.shard, str(exc))
            raise refused from None
        with self._lock:
            known = self._bad.get(place.name, (-1,))[0] == generation
            if not known:
                how = str(exc) if exc.span is not None else None  # a range's digest, not the tensor's
                self.reporter.mismatch(place.name, place.shard, exc.actual or "", exc.expected or "", how)
        if not known:
            yield from self._refuse_bytes(place, exc, generation)
        raise exc

    def _refuse_bytes(self, place: Place, error: IntegrityError, generation: int) -> Plan[None]:
        """Bytes of the place proven wrong (`error`): its source forgets the copy it keeps of them (a
        remote object's chunks, and those of the signed range they failed), so that the next read has
        them again; else (a file's own bytes) the tensor is refused without hashing it again until its
        shard changes."""
        start, end = (place.start, place.end) if error.span is None else (
            min(place.start, error.span[0]), max(place.end, error.span[1])
        )  # fmt: skip
        forgot = yield "read", functools.partial(place.data.refused, start, end)
        with self._lock:
            if forgot:
                self.digests.forget([place.name])  # what they hashed to is no answer for what comes next
            elif place.copy is None:
                self._bad[place.name] = (generation, error)

    def _hash_of(self, place: Place, generation: int) -> Plan[str]:
        """The SHA-256 of the place's bytes (a tensor in its own shard: the hash cache first, and one
        hashing however many readers wait for it)."""
        # Hashing a remote tensor waits on its chunks more than it computes: on the readers' threads, so
        # that readers waiting on one stalled chunk all wait its one timeout together, not a few at a time.
        kind: StepKind = "read" if place.data.needs_ensure else "verify"
        if place.copy is None:
            try:
                digest: str = yield kind, functools.partial(self.digests.shared, place.name, generation)
                return digest
            except (ShardChangedError, IntegrityError) as exc:  # (Integrity.pending: bytes its value rests on)
                yield from self._unproven(place, exc, generation)
        copied: str = yield kind, functools.partial(sha256_of, place.data, place.start, place.end)
        return copied

    def _present(self, place: Place, low: int, high: int) -> Plan[bytes | None]:
        """The library's presence: a range of a source that needs it fetched and pinned (held until closed)."""
        if place.data.needs_ensure:
            within = (place.start, place.end)  # read ahead past the tensor for a reader going on into the next
            yield "present", functools.partial(place.data.ensure_pinned, low, high, within=within)
        return None

    def _present_private(self, place: Place, low: int, high: int) -> Plan[bytes | None]:
        """Bring the range into the private mapping too (the library's tensors are made on it)."""
        ensure = functools.partial(place.data.ensure_private, low, high, within=(place.start, place.end))
        if not (yield "present", ensure):
            raise ShardChangedError(f"{place.data.label}: bytes [{low}, {high}) cannot be read")
        return None

    def _moved(self, place: Place) -> bool:
        """Whether the tensor is served from elsewhere now than `place` (another reader switched it)."""
        return self.router.moved(place)

    def _expected_of(self, name: str) -> str | None:
        """The manifest's value for the tensor (None: no manifest in force)."""
        expected = self.integrity.expected
        return None if expected is None else expected.get(name)

    def _pass(self, name: str) -> None:
        self.integrity.verified.add(name)
        self.reporter.verified(name)
        place = self.place(name)
        if place.copy is None:  # bytes had again after a refusal, proven now: the source's own
            place.data.proven(place.start, place.end, self.tables.shard_header(place.shard).data_start)

    def passed_together(self, names: list[str], data: ShardData) -> None:
        """These tensors, read from their own shard's file (`data`), matched the manifest (the lock held)."""
        for name in names:
            _, data_start, entry = self.tables.entry(name)
            self.integrity.verified.add(name)
            self.reporter.verified(name)
            data.proven(data_start + entry[0], data_start + entry[1], data_start)

    def _mismatch(self, name: str, shard: ShardKey, actual: str, expected: str) -> IntegrityError:
        if name not in self._bad:
            self.reporter.mismatch(name, shard, actual, expected)
        return IntegrityError(
            f"{printable(str(shard))}: tensor '{printable(name)}': its bytes hash to {actual}, not to "
            f"{expected} as {printable(self.integrity.label)} says",
            name,
            expected,
            actual,
        )

    def _unreadable(self, place: Place, low: int, high: int, exc: TensorfsError) -> TensorfsError:
        """A source's error, said of the tensor: which bytes of it cannot be read, and why."""
        if isinstance(exc, IntegrityError | Refused):
            return exc
        where = place.shard if place.copy is None else f"{place.data.label} (fallback {place.copy.source})"
        shrank = not place.data.needs_ensure and isinstance(exc, ShardChangedError)
        why = "the shard shrank after it was validated" if shrank else str(exc)
        # A store's failure stays one (a timeout is no change: a caller that reopens on a changed
        # shard would ask a stalled store forever).
        kind: type[TensorfsError] = type(exc) if isinstance(exc, RemoteError) else ShardChangedError
        error = kind(
            f"{printable(str(where))}: tensor '{printable(place.name)}': bytes [{low - place.start}, "
            f"{high - place.start}) of the tensor cannot be read: {why}"
        )
        error.fields = {"tensor": place.name, "shard": str(place.shard)}  # type: ignore[attr-defined]
        return error
