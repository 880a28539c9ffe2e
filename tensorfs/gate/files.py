"""The files a gate's bytes come from, watched: its model's shards and the fallback copies it serves
from, and what the gate has seen of each since it was opened (how many changes, refused or not)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..catalogue.tables import Tables
from ..sources.shard import ShardData
from ..sources.watch import Change, ShardWatch
from ..utils.identity import ShardKey
from .fingerprints import Fingerprints

__all__ = ["FileState", "WatchedFiles"]


@dataclass(eq=False)
class FileState:
    """What the gate has seen of one shard's file (or one fallback copy's) since it was opened."""

    shard: ShardKey
    """The model's shard it is, or that of the first tensor served from it (a fallback's)."""
    copy: bool = False
    generation: int = 0
    """Bumped at every change of its bytes: a hash made before a change is no answer after it."""
    changed: bool = False
    """Changed in place with no manifest to check it against: refused until opened again."""
    held: bool = False
    """Its status changed, with no manifest: held until the bytes served from it are read again and
    found as their fingerprints say (served on) or not (changed)."""
    fingerprints: Fingerprints | None = None
    """The CRC-32C of the bytes served from it, where they are taken (a mount's shards)."""
    refused: set[str] = field(default_factory=set)
    """Tensors whose refusal was reported already."""


class WatchedFiles:
    """The sources of a model's bytes, each with what was seen of it; their files watched for changes
    (a remote object has none: its version is pinned)."""

    def __init__(self, tables: Tables) -> None:
        self._seen: dict[ShardData, FileState] = {}
        self._watch = ShardWatch()
        self._refetches: dict[ShardData, int] = {}
        """Of each source that keeps copies (a remote object's chunks), how many times they were refused
        and had again when last looked at (ShardData.refetches): each time, a change of its bytes."""
        for shard in tables.opened_shards():
            self._add(shard.data, FileState(shard.header.path))

    def add_copy(self, data: ShardData, shard: ShardKey) -> None:
        """Watch a fallback's shard too, from now on (once)."""
        if data not in self._seen:
            self._add(data, FileState(shard, copy=True))

    def _add(self, data: ShardData, seen: FileState) -> None:
        self._seen[data] = seen
        files = data.watched()
        if files is not None:
            self._watch.add(data, *files)
        if data.needs_ensure:
            self._refetches[data] = data.refetches()

    def seen(self, data: ShardData) -> FileState | None:
        return self._seen.get(data)

    def watched_files(self) -> list[tuple[ShardData, FileState]]:
        """Every source watched for changes (a file), with what was seen of it."""
        return [(data, state) for data, state in self._seen.items() if data.watched() is not None]

    def changes(
        self, data: ShardData | None = None, *, at_once: bool = False
    ) -> list[tuple[ShardData, FileState, Change]]:
        """Every change reported so far, and those `data`'s file's size and times show (`at_once`: looked
        at now, even within a millisecond of the last look); never blocking."""
        found = self._watch.changes()
        if data is not None and data in self._seen:
            found += [(data, change) for change in self._watch.check(data, at_once=at_once)]
        for source in self._refetches if data is None else [data] if data in self._refetches else []:
            now = source.refetches()
            if now != self._refetches[source]:
                self._refetches[source] = now
                found.append((source, Change.CONTENT))
        return [(key, self._seen[key], change) for key, change in found if isinstance(key, ShardData)]

    def changed_shards(self) -> list[ShardKey]:
        """The model's shards changed in place with no manifest: refused until opened again."""
        return [seen.shard for seen in self._seen.values() if seen.changed and not seen.copy]

    def fileno(self) -> int:
        """The descriptor that becomes readable when a watched file changes (-1: none to wait on)."""
        return self._watch.fileno()

    def close(self) -> None:
        self._watch.close()
