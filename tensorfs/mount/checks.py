"""What a mount makes of its gate's checks: the log lines and counters of what the gate reports (a
shard changed, a tensor refused or verified), the kernel told to drop what it caches of a changed
shard, and the hashes the mount shows (the .sha256 sidecars, SHA256SUMS). Whether bytes may go out
is the gate's alone (gate.py); nothing here decides it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import trio

from ..errors import printable
from ..gate import Gate, Plan, Refused, Reporter
from ..sources.watch import Change
from ..utils.identity import ShardKey
from ..utils.units import plural
from .stats import Stats
from .tree import Tree

log = logging.getLogger("tensorfs.mount.operations")  # the log lines of the request handlers they answer for


class Invalidate(Protocol):
    """Tells the kernel to drop what it caches of these inodes: pages and attributes, or the attributes
    alone; blocking."""

    def __call__(self, inodes: Sequence[int], attr_only: bool = False) -> None: ...


Drive = Callable[[Plan[Any]], Awaitable[Any]]
"""How the mount drives one of the gate's plans (its blocking steps on worker threads)."""


class MountReporter(Reporter):
    """The gate's reports as a mount's log lines and counters; a changed shard's files dropped from
    the kernel's caches (queued in the nursery while the daemon serves, at once before)."""

    def __init__(self, tree: Tree, stats: Stats, invalidate: Invalidate | None = None) -> None:
        self.tree = tree
        self.stats = stats
        self.invalidate = invalidate
        self.nursery: trio.Nursery | None = None
        """Where invalidations are queued while the daemon serves (None: done at once); set on its thread."""
        self.on_change: Callable[[], None] = _nothing
        """Called when a shard's bytes change (what was made of them is made again)."""
        self._trio_token: trio.lowlevel.TrioToken | None = None
        self._invalidations: dict[ShardKey, bool] = {}  # shards whose files are still to be dropped: attributes only?
        self._invalidating: set[ShardKey] = set()

    def verified(self, name: str) -> None:
        self.stats.verified += 1

    def mismatch(self, name: str, shard: ShardKey, actual: str, expected: str, said: str | None = None) -> None:
        self.stats.verify_failures += 1
        if said is not None:  # a signature's range, not the tensor's digest: said as the range's
            log.error(
                "%s: refused (EIO)",
                printable(said),
                extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
            )
            return
        log.error(
            "tensor '%s' in shard %s does not match the manifest (sha256 %s, expected %s): refused (EIO)",
            printable(name),
            _shown(shard),
            actual,
            expected,
            extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
        )

    def unverifiable(self, name: str, shard: ShardKey, why: str) -> None:
        log.error(
            "tensor '%s' cannot be verified (refused, EIO): %s",
            printable(name),
            printable(why),
            extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
        )

    def changed(self, shard: ShardKey, names: list[str], *, manifest: bool, had_verified: bool) -> None:
        if not manifest:
            if shard in self.stats.changed:  # refused already: said once
                self._refresh(shard)
                return
            log.error(
                "shard %s was changed in place under the mount: it is no longer the file that was "
                "validated, and its %s answer EIO until it is mounted again",
                _shown(shard),
                plural(len(names), "tensor"),
                extra={"fields": {"shard": str(shard), "errno": "EIO"}},
            )
        elif shard not in self.stats.changed or had_verified:  # once per burst of writes
            log.warning(
                "shard %s changed under the mount: its %s verified again before any more of their bytes are served",
                _shown(shard),
                plural(len(names), "tensor") + (" are" if len(names) != 1 else " is"),
                extra={"fields": {"shard": str(shard)}},
            )
        self.stats.changed.add(shard)
        self.on_change()
        self._refresh(shard)

    def _refresh(self, shard: ShardKey, *, attr_only: bool = False) -> None:
        """What the kernel holds of the shard's files dropped: their pages, and the attributes shown
        (`attr_only`: the attributes alone)."""
        self.tree.refresh_shard(shard)
        self._invalidate(shard, attr_only=attr_only)

    def held(self, shard: ShardKey, *, again: bool = False) -> None:
        if again:
            self._refresh(shard, attr_only=True)
            return
        self.stats.rechecked_shards += 1
        log.info(
            "shard %s changed under the mount (its status: a chmod, a touch, or a write): the bytes served "
            "from it are read again and compared with what they were before another goes out",
            _shown(shard),
            extra={"fields": {"shard": str(shard)}},
        )
        self._refresh(shard, attr_only=True)  # its pages stay: they are the bytes served, if they still are

    def unchanged(self, shard: ShardKey) -> None:
        self.stats.unchanged_shards += 1
        log.info("shard %s: the bytes served from it are as they were: served on", _shown(shard))

    def moved(self, shard: ShardKey, change: Change) -> None:
        what = "moved or renamed" if change is Change.MOVED else "deleted"
        log.info("shard %s was %s: the mount goes on serving the file it validated", _shown(shard), what)

    def refused(self, name: str, shard: ShardKey) -> None:
        log.error(
            "tensor '%s': refused (EIO): its shard %s was changed under the mount; mount it again",
            printable(name),
            _shown(shard),
            extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
        )

    def fell_back(self, name: str, source: str) -> None:
        self.stats.fallback_tensors[name] = source

    def _invalidate(self, shard: ShardKey, *, attr_only: bool = False) -> None:
        """Have the kernel drop what it cached of the shard's files: pages and attributes (a change of
        its bytes), or the attributes alone (`attr_only`: a change to be checked).

        In a worker thread: dropping a page waits for a read of it in flight, which the daemon's
        thread may be the one to answer. A burst of changes costs at most one more round than one.
        """
        if self.invalidate is None:
            return
        if self.nursery is None:  # not serving (tests): at once
            self.invalidate([*self.tree.inodes_of(shard), self.tree.sums_inode], attr_only=attr_only)
            self.stats.invalidations += not attr_only
            return
        try:
            trio.lowlevel.current_task()
        except RuntimeError:  # told on a worker thread (a shard checked there): queued on the daemon's
            self._token.run_sync_soon(functools.partial(self._invalidate, shard, attr_only=attr_only))
            return
        self._invalidations[shard] = self._invalidations.get(shard, True) and attr_only
        if shard not in self._invalidating:
            self._invalidating.add(shard)
            self.nursery.start_soon(self._invalidate_queued, shard)

    @property
    def _token(self) -> trio.lowlevel.TrioToken:
        assert self._trio_token is not None
        return self._trio_token

    def serving(self, nursery: trio.Nursery | None) -> None:
        """Serving from now on, background work in `nursery` (called on the daemon's thread); None: not."""
        self.nursery = nursery
        self._trio_token = trio.lowlevel.current_trio_token() if nursery is not None else None

    async def _invalidate_queued(self, shard: ShardKey) -> None:
        assert self.invalidate is not None
        try:
            while shard in self._invalidations:
                attr_only = self._invalidations.pop(shard)
                inodes = [*self.tree.inodes_of(shard), self.tree.sums_inode]
                await trio.to_thread.run_sync(functools.partial(self.invalidate, inodes, attr_only=attr_only))
                self.stats.invalidations += not attr_only  # (a test waits on it, then finds the pages gone)
        finally:
            self._invalidating.discard(shard)


class Sums:
    """The hashes a mount shows: each .sha256 sidecar, and SHA256SUMS (the manifest's values when one
    is in force, else the bytes' own, hashed once and shared by whoever asks meanwhile)."""

    def __init__(self, tree: Tree, gate: Gate, drive: Drive) -> None:
        self.tree = tree
        self.gate = gate
        self._drive = drive
        self._sums: bytes | None = None
        self._summing: trio.Event | None = None  # SHA256SUMS being made: later readers wait for it
        self._refused = False  # and said so in the log

    def forget(self) -> None:
        """A shard changed: SHA256SUMS is made again when next read."""
        self._sums = None

    async def sidecar_digest(self, name: str) -> str:
        """What a .sha256 sidecar says: the manifest's value when there is one, else the bytes' hash."""
        if self.gate.expected is not None:
            values: dict[str, str] = await self._drive(self.gate.manifest_values([name]))
            return values[name]
        digest: str = await self._drive(self.gate.digest(name))
        return digest

    async def sha256sums(self) -> bytes:
        """SHA256SUMS: the manifest's values, or every tensor's hash (hashing what is not known)."""
        self.gate.notice_changes()
        if self.gate.expected is not None:
            if self._sums is None:
                self._sums = self.tree.sha256sums(await self._drive(self.gate.manifest_values(self.tree.names)))
            return self._sums
        changed = self.gate.changed_shards()
        if changed:
            self._refuse(changed[0])
        if self._sums is None:
            if self._summing is not None:  # being made for another reader: share it
                await self._summing.wait()
                return await self.sha256sums()
            self._summing = trio.Event()
            try:
                digests = await self._drive(self.gate.digest_all(self.tree.names))
                self._sums = self.tree.sha256sums(digests)
            except Refused:
                self._refuse(next(iter(self.gate.changed_shards()), "?"))
            finally:
                self._summing.set()
                self._summing = None
        assert self._sums is not None
        return self._sums

    def _refuse(self, shard: ShardKey) -> None:
        if not self._refused:
            self._refused = True
            log.error("SHA256SUMS: refused (EIO): shard %s was changed under the mount; mount it again", _shown(shard))
        raise Refused()


def _nothing() -> None:
    pass


def _shown(path: ShardKey) -> str:
    """A path in a log line: one line, whatever it holds."""
    return printable(str(path))
