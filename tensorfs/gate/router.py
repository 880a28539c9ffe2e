"""The fallback router: which copy each tensor is served from once its own shard could not give its
bytes, the next copy that agrees (its table, and the manifest), and the retry rule: a shard whose read
failed a moment ago sends its tensors to their fallbacks at once, for RETRY_AFTER seconds."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

from ..catalogue.fallbacks import RETRY_AFTER, Copy, Fallbacks
from ..catalogue.tables import Tables
from ..errors import RemoteError, ShardChangedError, printable
from ..proof.integrity import sha256_of
from ..sources.shard import ShardData
from ..utils.identity import ShardKey
from .files import FileState, WatchedFiles
from .plans import UNREADABLE, Place, Plan, Refused
from .reporter import Reporter

__all__ = ["Failing", "Router"]

log = logging.getLogger("tensorfs.gate")


class Failing(ShardChangedError):
    """A shard whose read failed a moment ago: its tensors go to their fallbacks without asking it."""


class Router:
    """Where each tensor is served from when its own shard cannot give its bytes. Its state changes
    under the gate's lock, in the thread that drives a plan."""

    def __init__(
        self,
        tables: Tables,
        fallbacks: Fallbacks | None,
        files: WatchedFiles,
        lock: threading.RLock,
        place_of: Callable[[str], Place],
        reporter: Callable[[], Reporter],
    ) -> None:
        self.tables = tables
        self.fallbacks = fallbacks
        """Other copies of the model, tried in order when a tensor's own shard cannot give its bytes."""
        self._files = files
        self._lock = lock
        self._place_of = place_of
        self._reporter = reporter
        self.copies: dict[str, Copy] = {}
        self.verified: set[str] = set()
        """Tensors whose copy matched the manifest since it last changed."""
        self._failed_at: dict[ShardKey, float] = {}

    def moved(self, place: Place) -> bool:
        """Whether the tensor is served from elsewhere now than `place` (another reader switched it)."""
        return self.copies.get(place.name) is not place.copy

    # -- the retry rule ------------------------------------------------------------------------
    def failed(self, shard: ShardKey) -> None:
        """A read of the shard's bytes failed: with fallbacks, its other tensors go to theirs for a while
        (a store down would otherwise cost each of them its own timeout)."""
        if self.fallbacks is not None:
            with self._lock:
                self._failed_at[shard] = time.monotonic()

    def failing(self, shard: ShardKey, start: int = 0, end: int = 0) -> Failing | None:
        """Why the shard's tensors go to their fallbacks without asking it, while a read of it failed
        less than RETRY_AFTER seconds ago (None: ask it). Not bytes [start, end) of it that it holds
        without asking where it comes from (a remote shard's cached chunks): they wait for nothing."""
        since = self._failed_at.get(shard)
        if since is None or self.fallbacks is None:
            return None
        ago = time.monotonic() - since
        if ago >= RETRY_AFTER:
            with self._lock:  # bring_in asks outside the gate's lock: another may have let it go already
                self._failed_at.pop(shard, None)
            return None
        data = self.tables.shard_data(shard)
        if end > start and data.held(start, end):
            return None
        return Failing(f"{data.label}: a read of it failed {ago:.0f} s ago")

    # -- switching -----------------------------------------------------------------------------
    def switched(self, place: Place, why: BaseException, expected: Callable[[str], str | None]) -> Plan[Place]:
        """Where the tensor is served from after `why`: its next fallback whose copy agrees (opened,
        and hashed against `expected(name)` where it says one, on a worker thread); `why` raised again
        if there is none."""
        if (
            isinstance(why, RemoteError | ShardChangedError)
            and place.copy is None
            and not isinstance(why, Refused | Failing)
        ):
            self.failed(place.shard)
        if self.fallbacks is None:
            raise why
        with self._lock:
            if self.moved(place):
                return self._place_of(place.name)  # another reader switched it meanwhile
            info = self.tables.info(place.name)
            value = expected(place.name)
        after = place.copy.index if place.copy is not None else -1
        found = functools.partial(self._next_copy, place.name, (info.dtype, list(info.shape)), value, after)
        copy: Copy | None = yield "switch", found
        with self._lock:
            if self.moved(place):
                return self._place_of(place.name)
            if copy is None:
                log.error("tensor '%s': %s; no fallback can give it", printable(place.name), printable(str(why)))
                raise why
            self.copies[place.name] = copy
            if value is not None:
                self.verified.add(place.name)
            self._files.add_copy(copy.data, place.shard)
            shown = printable(str(why))
            log.warning(
                "tensor '%s': served from fallback %s from now on (%s)", printable(place.name), copy.source, shown
            )
            self._reporter().fell_back(place.name, copy.source)
            return self._place_of(place.name)

    def _next_copy(self, name: str, table: tuple[str, list[int]], expected: str | None, after: int) -> Copy | None:
        """The first copy after fallback `after` that agrees with the tensor's table and, with `expected`,
        whose bytes hash to it, not changed since it was opened (blocking)."""
        assert self.fallbacks is not None
        for copy in self.fallbacks.copies_of(name, table, after):
            state = self._files.seen(copy.data)
            if state is not None and state.changed:
                self.fallbacks.say_once(copy.index, name, "changed in place since it was opened: not served")
                continue
            if expected is not None:
                try:
                    actual = sha256_of(copy.data, copy.start, copy.end)
                except UNREADABLE as exc:
                    self.fallbacks.say_once(copy.index, name, f"cannot be read: {printable(str(exc))}")
                    continue
                if actual != expected:
                    self.fallbacks.say_once(
                        copy.index, name, f"does not match the manifest (sha256 {actual}): not served"
                    )
                    continue
            return copy
        return None

    # -- a copy changed ------------------------------------------------------------------------
    def copy_changed(self, data: ShardData, state: FileState, *, manifest: bool) -> None:
        """A fallback's file the tensors are served from may have changed: refused from now on without
        a manifest, verified again with one (the lock held)."""
        state.generation += 1
        served = [name for name, copy in self.copies.items() if copy.data is data]
        if not manifest:
            if not state.changed:
                log.error(
                    "fallback %s was changed in place: it is no longer the file that was validated, and %s "
                    "served from it are not any more",
                    printable(data.label),
                    f"the {len(served)} tensors" if len(served) != 1 else "the tensor",
                )
            state.changed = True
        else:
            log.warning("fallback %s changed: what is served from it is verified again", printable(data.label))
            self.verified.difference_update(served)

    def close(self) -> None:
        if self.fallbacks is not None:
            self.fallbacks.close()
