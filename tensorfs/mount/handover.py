"""A validated model handed to another process (the mount's daemon) without validating it again: a
picklable snapshot of its tables and of what its gate holds it to, and the same files mapped again
from it, refusing any that changed since."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..caches.hashes import HashCache
from ..caches.headers import HeaderCache
from ..catalogue.fallbacks import Fallbacks, FallbackSpec
from ..catalogue.tables import Shard, owners
from ..formats import Entry, ShardHeader
from ..model import Model
from ..opening.source import open_model
from ..proof.integrity import Hasher, Integrity, Pending
from ..selection import Selection
from ..sources.local import LocalDescription, LocalShard
from ..sources.shard import ShardData
from ..utils.identity import ShardKey
from ..utils.names import Layout

__all__ = ["ModelSnapshot", "reopen", "snapshot"]


@dataclass(frozen=True)
class ShardSnapshot:
    header: ShardHeader | None
    """None: in the header cache under the file's identity (or read again from the very same file)."""
    data: object
    """What the shard's source needs to open the same bytes again (ShardData.describe())."""


@dataclass(frozen=True)
class ModelSnapshot:
    """A validated model without its mappings: picklable, and cheap to map again (see reopen)."""

    source: ShardKey
    layout: Layout
    shards: list[ShardSnapshot]
    selection: Selection
    header_cache: Path | None = None
    """Where the headers left out of `shards` are."""
    fallback: FallbackSpec | None = None
    """The model's fallbacks (opened again, when needed, where it is reopened)."""
    expected: dict[str, str] | None = None
    """The manifest in force, its label, and the tensors verified already."""
    label: str = ""
    verified: frozenset[str] = frozenset()
    hash_cache: Path | None = None
    """Where the hashes of its tensors are kept (None: not kept)."""
    signer: str = ""
    """Who signed the manifest in force, when it is a signature's digests."""
    pending: Pending | None = None
    """Where the values the manifest lacks come from (files signed by ranges)."""
    parts: dict[str, list[str]] = dataclasses.field(default_factory=dict)
    """A folder of several models: each one's folder and files (Model.parts)."""


def snapshot(model: Model) -> ModelSnapshot:
    """What reopen() needs to map `model` again in another process, without validating it again.

    Headers kept in the header cache are sent as references (the file's identity): 100k entries
    take longer to pickle and unpickle than to be read back from the cache. Otherwise equal shapes
    become one shared object, which pickle then sends once: a model's tensors have few distinct
    shapes, and 100k copies of them would be a tenth of the daemon's memory.
    """
    by_reference = model.header_cache is not None and model.selection.everything
    shapes: dict[tuple[int, ...], Any] = {}
    shards = []
    for shard in model.opened_shards():
        header = shard.header
        description = shard.data.describe()
        if by_reference and isinstance(description, LocalDescription):
            shards.append(ShardSnapshot(None, description))
            continue
        entries: list[Entry] = [
            (begin, end, name, dtype, shapes.setdefault(tuple(shape), shape))
            for begin, end, name, dtype, shape in header.entries
        ]
        shards.append(ShardSnapshot(dataclasses.replace(header, entries=entries), description))
    fallback = model.fallbacks.spec if model.fallbacks is not None else None
    integrity = model.gate.integrity
    cache = integrity.hasher.cache
    return ModelSnapshot(
        model.source,
        model.layout,
        shards,
        model.selection,
        model.header_cache if by_reference else None,
        fallback,
        integrity.expected,
        integrity.label,
        frozenset(integrity.verified),
        cache.directory if cache.enabled else None,
        integrity.signer,
        integrity.pending,
        model.parts,
    )


def reopen(saved: ModelSnapshot) -> Model:
    """Map the shards of a model validated elsewhere, held to what it was; InvalidModelError if any
    of its files changed since."""
    opened: list[Shard] = []
    cache = HeaderCache(saved.header_cache)
    try:
        for shard in saved.shards:
            if shard.header is None:
                assert isinstance(shard.data, LocalDescription)
                opened.append(Shard(*LocalShard.reopen_with_header(shard.data, cache)))
            else:
                data = _reopen_data(shard.data)
                opened.append(Shard(dataclasses.replace(shard.header, path=data.key), data))
    except BaseException:
        for done in opened:
            done.data.close()
        raise
    finally:
        cache.close()
    source = saved.source if isinstance(saved.source, str) else Path(os.path.abspath(saved.source))
    fallbacks = Fallbacks(saved.fallback, open_model) if saved.fallback is not None else None
    model = Model(source, opened, owners(opened), saved.layout, saved.selection, fallbacks=fallbacks)
    hasher = Hasher(model, HashCache(saved.hash_cache))
    expected = None if saved.expected is None else dict(saved.expected)  # its own: pending adds to it
    integrity = Integrity(hasher, expected, set(saved.verified), saved.label, saved.signer, saved.pending)
    model.gate.set_integrity(integrity)
    model.parts = saved.parts
    return model


def _reopen_data(description: object) -> ShardData:
    if isinstance(description, LocalDescription):
        return LocalShard.reopen(description)
    from ..sources.remote import RemoteDescription, RemoteShard  # the stores' machinery: a remote model's only

    if isinstance(description, RemoteDescription):
        return RemoteShard.reopen(description)
    raise TypeError(f"no source reopens {description!r}")
