"""Changes to the files a gate's bytes come from, as the gate applies them: each one counted (a
file's generation: a hash made before it is no answer after it), and what it means for the tensors.

- With a manifest or a signature, the tensors of a changed shard are verified again before another
  byte of them goes out.
- Without one, a shard's file whose status changed may hold its bytes as they were (a chmod, a
  touch, the same bytes written again) or not, and nothing the kernel tells says which. Where the
  bytes served are fingerprinted (a mount: fingerprints.py), the shard is held until those bytes are
  read again: all as they were, it is served on (its tensors' files keep their pages, mapped readers
  live); one other, it is refused from then on, as a shard changed in place is where nothing was
  fingerprinted (the library).
"""

from __future__ import annotations

import functools
import threading
from concurrent.futures import Future
from typing import Protocol

from ..catalogue.tables import Tables
from ..errors import ShardChangedError, printable
from ..proof.integrity import Integrity
from ..sources.shard import ShardData
from ..sources.watch import Change
from ..utils.identity import ShardKey
from .digests import Digests
from .files import FileState, WatchedFiles
from .fingerprints import Fingerprints, prepare
from .plans import Place, Plan, Refused
from .reporter import Reporter
from .router import Router


class GateParts(Protocol):
    """What of its gate the account of changes works with (gate.Gate)."""

    tables: Tables
    reporter: Reporter
    integrity: Integrity
    digests: Digests
    router: Router

    @property
    def lock(self) -> threading.RLock: ...
    def forget_refusals(self, names: list[str]) -> None: ...


__all__ = ["Changes"]


class Changes:
    """One gate's account of the changes to its files (its lock held where a method says so)."""

    def __init__(self, gate: GateParts) -> None:
        self._gate = gate
        self.files = WatchedFiles(gate.tables)
        self.fingerprinting = False
        """Whether the bytes served are fingerprinted (a mount: fingerprint_served()); then a shard
        changed with no manifest is checked before it is refused."""
        self._checks: dict[int, Future[None]] = {}  # checks of held shards under way, by id(FileState)

    # -- what was seen (the gate's lock held) ---------------------------------------------------
    def notice(self, data: ShardData | None = None, *, at_once: bool = False) -> None:
        """Apply the changes reported so far, and those `data`'s file's size and times show (`at_once`:
        looked at now, even within a millisecond of the last look)."""
        for key, seen, change in self.files.changes(data, at_once=at_once):
            self._apply(key, seen, change)

    def seen(self, data: ShardData) -> FileState | None:
        return self.files.seen(data)

    def state_of(self, name: str) -> FileState:
        seen = self.files.seen(self._gate.tables.shard_of(name).data)
        assert seen is not None
        return seen

    def generation(self, place: Place) -> int:
        """How many changes of the place's file were seen so far (every change reported applied first)."""
        with self._gate.lock:
            self.notice(place.data)
            state = self.files.seen(place.data)
            return state.generation if state is not None else 0

    def generations(self, names: list[str]) -> dict[str, int]:
        """The tensors' shards' generations, every change reported applied first; Refused for a
        tensor whose shard changed in place without a manifest."""
        self.notice()
        states = {name: self.state_of(name) for name in names}
        for name, state in states.items():
            self.refuse_if_changed(name, state)
        return {name: state.generation for name, state in states.items()}

    def refuse_if_changed(self, name: str, state: FileState) -> None:
        if state.changed:
            if name not in state.refused:
                state.refused.add(name)
                self._gate.reporter.refused(name, state.shard)
            raise Refused(f"{printable(str(state.shard))}: changed in place: tensor '{printable(name)}' is refused")

    def changed_shards(self) -> list[ShardKey]:
        return self.files.changed_shards()

    def _apply(self, data: ShardData, state: FileState, change: Change) -> None:
        gate = self._gate
        if state.copy:
            if change is Change.CONTENT:
                gate.router.copy_changed(data, state, manifest=gate.integrity.expected is not None)
            return
        shard = state.shard
        if change in (Change.MOVED, Change.DELETED):
            gate.reporter.moved(shard, change)
            return
        state.generation += 1  # (refused already, it is still said: a mount shows its new attributes)
        names = [entry[2] for entry in gate.tables.shard_header(shard).entries]
        gate.digests.forget(names)
        manifest = gate.integrity.expected is not None
        had_verified = not gate.integrity.verified.isdisjoint(names)
        if manifest:
            gate.integrity.verified.difference_update(names)
            gate.forget_refusals(names)
        elif state.fingerprints is not None and not state.changed:
            # Checked against what was served before another byte goes out (once for a burst of changes).
            gate.reporter.held(shard, again=state.held)
            state.held = True
            return
        else:
            state.changed = True
        gate.reporter.changed(shard, names, manifest=manifest, had_verified=had_verified)

    # -- fingerprints of the bytes served --------------------------------------------------------
    def fingerprint_from_now(self) -> None:
        """Fingerprint the bytes of the shards' files served, from now on (a mount)."""
        prepare()
        with self._gate.lock:
            self.fingerprinting = True
            for data, state in self.files.watched_files():
                if state.fingerprints is None and not state.copy:
                    state.fingerprints = Fingerprints(self._gate.tables.shard_header(state.shard).file_size)
                    data.readinto_exact(0, memoryview(b""))  # what it reads back with, made now (its descriptor)

    def served(self, place: Place, low: int, high: int) -> None:
        """Bytes [low, high) of the place go out: their fingerprints are to be taken (quick), where the
        bytes served are fingerprinted (a mount's shard files, with no manifest in force)."""
        if place.copy is None:
            self.served_file(place.data, low, high)

    def served_file(self, data: ShardData, low: int, high: int) -> None:
        """Bytes [low, high) of a shard's own file, its tensors' bytes, go out (as served())."""
        if not self.fingerprinting or self._gate.integrity.expected is not None:
            return
        state = self.files.seen(data)
        if state is not None and state.fingerprints is not None:
            state.fingerprints.served(low, high)

    def pending(self) -> int:
        """Bytes served whose fingerprints are not taken yet."""
        return sum(state.fingerprints.pending() for _, state in self.files.watched_files() if state.fingerprints)

    def fingerprint_served(self) -> None:
        """Take the fingerprints of the bytes served since (blocking: a mount's background work). Kept
        only where no change of the file was seen from their serving to their reading (the file's
        times looked at once more after it): else they stay untaken, and the shard, held, is refused."""
        gate = self._gate
        for data, state in self.files.watched_files():
            fingerprints = state.fingerprints
            if fingerprints is None or not fingerprints.pending():
                continue
            with gate.lock:
                self.notice(data)
                generation, unsettled = state.generation, state.held or state.changed
            if unsettled:
                continue
            try:
                found = fingerprints.take(data.readinto_exact)
            except ShardChangedError:
                continue  # cut: its change is told, and the shard held, at the next look
            with gate.lock:
                self.notice(data, at_once=True)
                if state.generation == generation and not state.held and not state.changed:
                    fingerprints.keep(found)

    def held(self) -> list[FileState]:
        """The shards held now (their status changed; to be checked: check())."""
        return [state for _, state in self.files.watched_files() if state.held]

    def settled(self, states: list[FileState]) -> Plan[None]:
        """Wait for the held shards among `states` to be checked (on worker threads)."""
        for state in states:
            while state.held:
                yield "verify", functools.partial(self.check, state)

    def check(self, state: FileState) -> None:
        """Read a held shard's bytes served so far again (blocking), once however many wait: all as
        their fingerprints say, it is served on; else refused from now on. A change meanwhile leaves
        it held, for the next to check."""
        gate = self._gate
        with gate.lock:
            if not state.held:
                return
            generation = state.generation
            running = self._checks.get(id(state))
            mine = running is None
            if running is None:
                running = self._checks[id(state)] = Future()
        if not mine:
            running.result()
            return
        try:
            data = gate.tables.shard_data(state.shard)
            assert state.fingerprints is not None
            try:
                if data.status().st_size != state.fingerprints.size:  # cut, or grown: not the file served
                    differs: int | None = min(data.status().st_size, state.fingerprints.size)
                else:
                    differs = state.fingerprints.differs(data.readinto_exact)
            except (ShardChangedError, OSError) as exc:
                differs = getattr(exc, "lost_from", None) or 0
            with gate.lock:
                self.notice(data)
                if state.held and state.generation == generation:
                    state.held = False
                    names = [entry[2] for entry in gate.tables.shard_header(state.shard).entries]
                    if differs is None:
                        gate.reporter.unchanged(state.shard)
                    else:
                        state.changed = True
                        gate.reporter.changed(state.shard, names, manifest=False, had_verified=False)
            running.set_result(None)
        except BaseException as exc:
            running.set_exception(exc)
            raise
        finally:
            with gate.lock:
                del self._checks[id(state)]

    def close(self) -> None:
        self.files.close()
