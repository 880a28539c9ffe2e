"""What a mount knows of its shards' bytes, and what it does with that: changes to the shard files
(watched) and the hashes of tensors (the .sha256 sidecars, SHA256SUMS, verification against a
manifest). The request handlers (fs.py) ask it before they answer:

- check(shard, tensor): Refused (EIO) when the shard was changed in place and no manifest can
  tell its bytes right;
- verify(tensor): with a manifest, no byte of a tensor is served before its hash matches
  (IntegrityError, or Refused, when it does not);
- sidecar_digest(tensor) and sha256sums(): what those files say.

Every change the watch reports is applied before any of these answers (see notice_changes);
the kernel is told to drop what it caches of a changed shard's files (`invalidate`).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pyfuse3
import trio

from ..errors import IntegrityError, ShardChangedError, TensorfsError, printable
from ..formats import NAME
from ..integrity import HASH_WORKERS, Integrity
from ..sources.shard import ShardKey
from ..units import plural
from .stats import Stats
from .tree import Tree
from .watch import Change, ShardWatch

log = logging.getLogger("tensorfs.mount.fs")  # the log lines of the request handlers they answer for


class Refused(TensorfsError):
    """A request refused with EIO, the reason already logged."""


Invalidate = Callable[[Sequence[int], bool], None]
"""Tells the kernel to drop what it caches of these inodes (all, or attributes only); blocking."""


class Verifier:
    """Changes to one mount's shards, and its tensors' hashes (see the module's docstring)."""

    def __init__(
        self,
        tree: Tree,
        integrity: Integrity,
        stats: Stats,
        watch: ShardWatch | None = None,
        invalidate: Invalidate | None = None,
    ) -> None:
        self.tree = tree
        self.integrity = integrity
        self.stats = stats
        self.watch = watch
        """Changes to the shard files; None: nobody watches (the files are trusted not to change)."""
        self.invalidate = invalidate
        self.nursery: trio.Nursery | None = None
        """Where invalidations are queued while the daemon serves (None: done at once)."""
        self._shards = {shard: _ShardState() for shard in tree.model.shards}
        self._failed: set[str] = set()
        self._hashers = trio.CapacityLimiter(HASH_WORKERS)  # hashing threads at once, over all requests
        self._invalidations: dict[ShardKey, bool] = {}  # shard -> attributes only? (still to be done)
        self._invalidating: set[ShardKey] = set()
        self._digests: dict[str, tuple[int, str]] = {}  # tensor -> (its shard's generation, sha256)
        self._hashing: dict[str, trio.Event] = {}
        self._sums: bytes | None = None
        self._summing: trio.Event | None = None  # SHA256SUMS being made: later readers wait for it
        self._sums_refused = False  # and said so in the log

    def needs_verifying(self, name: str) -> bool:
        """Whether a tensor must be verified (again) before another of its bytes is served."""
        return self.integrity.expected is not None and name not in self.integrity.verified

    # -- changes to the shards ----------------------------------------------------------------
    async def watch_changes(self) -> None:
        """Apply changes to the shards as they happen, between requests too (run in the nursery)."""
        self.notice_changes()  # what happened since validation is told at once, not at the first read
        if self.watch is None or self.watch.fileno() < 0:
            return
        while True:
            await trio.lowlevel.wait_readable(self.watch.fileno())
            self.notice_changes()

    def notice_changes(self, shard: ShardKey | None = None) -> None:
        """Apply every change the watch has reported, and those `shard`'s size and times show."""
        if self.watch is None:
            return
        changes = self.watch.changes()
        if shard is not None:
            changes += [(shard, change) for change in self.watch.check(shard)]
        for path, change in changes:
            self._apply(path, change)

    def _apply(self, shard: ShardKey, change: Change) -> None:
        state = self._shards[shard]
        if change is Change.ATTRIBUTES:
            if self.tree.refresh_shard(shard):  # owner, permissions or mtime: the kernel must ask again
                self._invalidate(shard, attr_only=True)
            return
        if change is Change.MOVED:
            log.info("shard %s was moved or renamed: the mount goes on serving the file it validated", _shown(shard))
            return
        if change is Change.DELETED:
            log.info("shard %s was deleted: the mount goes on serving the file it validated", _shown(shard))
            return
        state.generation += 1
        if state.changed:
            return  # refused already, and nothing of it cached since
        names = [entry[NAME] for entry in self.tree.model.shard_header(shard).entries]
        for name in names:
            self._digests.pop(name, None)
        if self.integrity.expected is None:
            log.error(
                "shard %s was changed in place under the mount: it is no longer the file that was "
                "validated, and its %s answer EIO until it is mounted again",
                _shown(shard),
                plural(len(names), "tensor"),
                extra={"fields": {"shard": str(shard), "errno": "EIO"}},
            )
            state.changed = True
            self.stats.changed.add(shard)
            self._sums = None
        else:
            # Told once per burst of writes: again only once something of it was verified since.
            if shard not in self.stats.changed or not self.integrity.verified.isdisjoint(names):
                log.warning(
                    "shard %s changed under the mount: its %s verified again before any more of their bytes are served",
                    _shown(shard),
                    plural(len(names), "tensor") + (" are" if len(names) != 1 else " is"),
                    extra={"fields": {"shard": str(shard)}},
                )
            self.stats.changed.add(shard)
            self.integrity.verified.difference_update(names)
            self._failed.difference_update(names)
        self.tree.refresh_shard(shard)
        self._invalidate(shard, attr_only=False)

    def _invalidate(self, shard: ShardKey, *, attr_only: bool) -> None:
        """Have the kernel drop what it cached of the shard's files (or their attributes only).

        In a worker thread: dropping a page waits for a read of it in flight, which this thread
        may be the one to answer. A burst of changes costs at most one more round than one change.
        """
        if self.invalidate is None:
            return
        queued = self._invalidations.get(shard)
        self._invalidations[shard] = attr_only if queued is None else queued and attr_only
        if self.nursery is None:  # not serving (tests): at once
            self.invalidate([*self.tree.inodes_of(shard), self.tree.sums_inode], self._invalidations.pop(shard))
        elif shard not in self._invalidating:
            self._invalidating.add(shard)
            self.nursery.start_soon(self._invalidate_queued, shard)

    async def _invalidate_queued(self, shard: ShardKey) -> None:
        assert self.invalidate is not None
        try:
            while shard in self._invalidations:
                attr_only = self._invalidations.pop(shard)
                inodes = [*self.tree.inodes_of(shard), self.tree.sums_inode]
                await trio.to_thread.run_sync(self.invalidate, inodes, attr_only)
        finally:
            self._invalidating.discard(shard)

    def check(self, shard: ShardKey, name: str) -> None:
        """Refuse a tensor of a shard changed in place (no manifest): it is not what was validated."""
        self.notice_changes(shard)
        state = self._shards[shard]
        if state.changed:
            if name not in state.refused:
                state.refused.add(name)
                log.error(
                    "tensor '%s': refused (EIO): its shard %s was changed under the mount; mount it again",
                    printable(name),
                    _shown(shard),
                    extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
                )
            raise Refused()

    # -- hashes -----------------------------------------------------------------------------
    async def digest(self, name: str) -> str:
        """The tensor's actual SHA-256, found or hashed once in a worker thread; callers share it.

        A hash begun before its shard changed is not an answer: it is made again.
        """
        shard = self.tree.model.locate(name)[0]
        state = self._shards[shard]
        while True:
            self.check(shard, name)  # changed in place while it was hashed: no answer at all
            generation = state.generation
            found = self._digests.get(name)
            if found is not None and found[0] == generation:
                return found[1]
            running = self._hashing.get(name)
            if running is not None:
                await running.wait()
                if name not in self._digests:  # the hashing that was waited for failed
                    raise pyfuse3.FUSEError(errno.EIO)
                continue
            done = self._hashing[name] = trio.Event()
            try:
                digest = await trio.to_thread.run_sync(self.integrity.digest, name, limiter=self._hashers)
                self._digests[name] = (generation, digest)
            finally:
                del self._hashing[name]
                done.set()
            self.notice_changes(shard)  # a write while it was hashed is known now, if it finished
            if state.generation == generation:
                return digest

    async def sidecar_digest(self, name: str) -> str:
        """What a .sha256 sidecar says: the manifest's value when there is one, else the bytes' hash."""
        if self.integrity.expected is not None:
            return self.integrity.expected[name]
        self.check(self.tree.model.locate(name)[0], name)
        return await self.digest(name)

    async def sha256sums(self) -> bytes:
        """SHA256SUMS: the manifest's values, or every tensor's hash (hashing what is not known)."""
        self.notice_changes()
        if self.integrity.expected is not None:
            if self._sums is None:
                self._sums = self.tree.sha256sums(self.integrity.expected)
            return self._sums
        changed = [shard for shard, state in self._shards.items() if state.changed]
        if changed:
            if not self._sums_refused:
                self._sums_refused = True
                log.error(
                    "SHA256SUMS: refused (EIO): shard %s was changed under the mount; mount it again",
                    _shown(changed[0]),
                )
            raise Refused()
        if self._sums is None:
            if self._summing is not None:  # being made for another reader: share it
                await self._summing.wait()
                return await self.sha256sums()
            self._summing = trio.Event()
            try:
                self._sums = await self._make_sums()
            finally:
                self._summing.set()
                self._summing = None
        return self._sums

    async def _make_sums(self) -> bytes:
        generations = {shard: state.generation for shard, state in self._shards.items()}
        todo = [name for name in self.tree.names if name not in self._digests]
        if todo:  # many tensors: the hasher reads and hashes them in runs, in its own threads
            found = await trio.to_thread.run_sync(self.integrity.hasher.hash_all, todo)
            for name, digest in found.items():
                self._digests[name] = (generations[self.tree.model.locate(name)[0]], digest)
        for shard in self._shards:  # a write while they were hashed is known now, if it finished
            self.notice_changes(shard)
        if any(state.changed for state in self._shards.values()):
            raise Refused()  # changed while it was hashed: logged as it was seen
        return self.tree.sha256sums({name: self._digests[name][1] for name in self.tree.names})

    async def verify(self, name: str) -> None:
        """With a manifest, serve no byte of a tensor before its hash matches: EIO when it does not."""
        expected = self.integrity.expected
        if expected is None or name in self.integrity.verified:
            return
        if name not in self._failed:
            try:
                actual = await self.digest(name)
            except ShardChangedError as exc:  # its bytes are gone: refused until the shard changes again
                if name not in self._failed:
                    self._failed.add(name)
                    shard = self.tree.model.locate(name)[0]
                    log.error(
                        "tensor '%s' cannot be verified (refused, EIO): %s",
                        printable(name),
                        exc,
                        extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
                    )
                raise Refused() from None
            if actual == expected[name]:
                self.integrity.verified.add(name)
                self.stats.verified += 1
                return
            if name not in self._failed:
                self._failed.add(name)
                self.stats.verify_failures += 1
                shard = self.tree.model.locate(name)[0]
                log.error(
                    "tensor '%s' in shard %s does not match the manifest (sha256 %s, expected %s): refused (EIO)",
                    printable(name),
                    _shown(shard),
                    actual,
                    expected[name],
                    extra={"fields": {"tensor": name, "shard": str(shard), "errno": "EIO"}},
                )
        raise IntegrityError(f"tensor {name!r} does not match the manifest")


@dataclass(eq=False)
class _ShardState:
    """What the daemon has seen of one shard since it was mounted."""

    generation: int = 0
    """Bumped at every change of the shard's bytes: a hash made before a change is no answer after it."""
    changed: bool = False
    """Changed in place with no manifest to check it against: its tensors are refused until remounted."""
    refused: set[str] = field(default_factory=set)
    """Tensors whose refusal is logged already."""


def _shown(path: ShardKey) -> str:
    """A path in a log line: one line, whatever it holds."""
    return printable(str(path))
