"""The SHA-256 of tensors' bytes in their own shards as they are now (the mount's .sha256 sidecars and
SHA256SUMS, and what the gate verifies against a manifest): found, or hashed once however many ask,
each kept by its shard's generation (a hash made before a change is no answer after it)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from ..errors import printable
from ..proof.integrity import Integrity
from ..sources import waits
from .plans import Plan, Refused

__all__ = ["Digests"]

Generations = Callable[[list[str]], dict[str, int]]
"""The tensors' shards' generations, every change reported applied first (the gate's lock held);
Refused for a tensor whose shard changed in place without a manifest."""


class Digests:
    """Tensors' SHA-256s, by their shard's generation; one hashing of a tensor however many wait."""

    def __init__(
        self,
        lock: threading.RLock,
        integrity: Callable[[], Integrity],
        generations: Generations,
        settled: Callable[[list[str]], Plan[None]],
    ) -> None:
        self._lock = lock
        self._integrity = integrity
        self._generations = generations
        self._settled = settled  # the shards of these tensors whose status changed, checked first
        self._known: dict[str, tuple[int, str]] = {}  # tensor -> (its shard's generation, sha256)
        self._hashing: dict[tuple[str, int], Future[dict[str, str]]] = {}  # hashes under way, shared by whoever waits

    def of(self, name: str) -> Plan[str]:
        """The SHA-256 of the tensor's bytes as they are now (found, or hashed once however many ask)."""
        while True:
            yield from self._settled([name])
            with self._lock:
                generation = self._generations([name])[name]
                found = self._known.get(name)
                if found is not None and found[0] == generation:
                    return found[1]
            digest: str = yield "verify", functools.partial(self.shared, name, generation)
            with self._lock:
                if self._generations([name])[name] == generation:
                    self._known[name] = (generation, digest)
                    return digest
                if self._integrity().expected is None:  # changed while hashed: no answer now
                    raise Refused(f"tensor '{printable(name)}': its shard changed while it was hashed")
                # (under a manifest: hashed again, and verified before any byte of it goes out)

    def of_all(self, names: list[str]) -> Plan[dict[str, str]]:
        """Every tensor's SHA-256 (those not known hashed together, on the hasher's threads); Refused
        when a shard changed in place without a manifest, before or while they were hashed."""
        yield from self._settled(names)
        with self._lock:
            generations = self._generations(names)
            todo = [name for name in names if self._known.get(name, (-1, ""))[0] != generations[name]]
        if todo:
            integrity = self._integrity()
            hashing = functools.partial(integrity.hasher.hash_all, todo, proving=integrity.expected is not None)
            found: dict[str, str] = yield "verify", hashing
            with self._lock:
                for name, digest in found.items():
                    self._known[name] = (generations[name], digest)
        with self._lock:
            if self._generations(names) != generations:
                raise Refused()  # written while hashed, under a manifest: the sums are the manifest's anyway
            return {name: self._known[name][1] for name in names}

    def shared(self, name: str, generation: int) -> str:
        """The tensor's SHA-256 (blocking): known already, hashed here, or by the thread already hashing
        it (alone, or with others: shared_all); kept (by its shard's generation) for whoever asks next."""
        key = (name, generation)
        while True:
            with self._lock:
                found = self._known.get(name)
                if found is not None and found[0] == generation:
                    return found[1]
                running = self._hashing.get(key)
                mine = running is None
                if running is None:
                    running = self._hashing[key] = Future()
            if mine:
                return self._hash(running, [name], generation, lambda: {name: self._integrity().digest(name)})[name]
            try:
                return self._wait(running, name)[name]
            except _Unfinished:  # hashed with others, some of which could not be: hashed alone
                continue

    def shared_all(self, names: list[str], generation: int) -> dict[str, str]:
        """shared() of many tensors of one shard (blocking): those not known, and that no other thread
        is hashing, hashed here together (several at once: Integrity.hash_all), raising what that
        raises; those another thread is hashing waited for, and left out if it could not."""
        found: dict[str, str] = {}
        mine: list[str] = []
        batch: Future[dict[str, str]] = Future()
        others: dict[int, tuple[Future[dict[str, str]], list[str]]] = {}
        with self._lock:
            for name in names:
                known = self._known.get(name)
                if known is not None and known[0] == generation:
                    found[name] = known[1]
                    continue
                running = self._hashing.get((name, generation))
                if running is None:
                    mine.append(name)
                    self._hashing[name, generation] = batch
                else:
                    others.setdefault(id(running), (running, []))[1].append(name)
        if mine:
            found.update(self._hash(batch, mine, generation, lambda: self._integrity().hash_all(mine)))
        for running, waited in others.values():
            try:
                digests = self._wait(running, waited[0])
            except Exception:  # theirs to say: each is asked for alone then
                continue
            found.update((name, digests[name]) for name in waited)
        return found

    def _hash(
        self, running: Future[dict[str, str]], names: list[str], generation: int, hashing: Callable[[], dict[str, str]]
    ) -> dict[str, str]:
        """Hash `names` (hashing()) for whoever waits on `running`, and keep what they hash to."""
        try:
            digests = hashing()
            with self._lock:
                for name in names:
                    self._known[name] = (generation, digests[name])
            running.set_result(digests)
            return digests
        except BaseException as exc:
            running.set_exception(exc if len(names) == 1 else _Unfinished())
            raise
        finally:
            with self._lock:
                for name in names:
                    del self._hashing[name, generation]

    def _wait(self, running: Future[dict[str, str]], name: str) -> dict[str, str]:
        """What another thread hashed, waited for as long as a request may wait on its bytes."""
        model = self._integrity().hasher.model
        limit = model.shard_data(model.locate(name)[0]).wait_limit
        return waits.wait_for(running, limit, lambda: f"tensor '{printable(name)}': its hash, under way")

    def forget(self, names: Iterable[str]) -> None:
        """Their shard changed: what was known of them is no answer now (the lock held)."""
        for name in names:
            self._known.pop(name, None)


class _Unfinished(Exception):
    """Tensors hashed together could not all be: each waiting for one of them hashes it alone."""
