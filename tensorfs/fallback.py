"""Other copies of a model (`--fallback`, open_model's `fallback=`): where a tensor's bytes are had
when its own shard cannot give them (a read error, a store down past its timeout, a shard changed
or truncated, bytes that fail the manifest, a shard missing or invalid when the model is opened).

A fallback is a model of its own, opened when first needed (a fallback down is a warning, tried
again later, never a failure of the model) and validated as strictly as any model. It gives a
tensor only when its table agrees with the primary's for that tensor (dtype and shape, so size),
and, where a manifest is in force, only bytes that hash to the manifest's value: hashed here,
before anything is served from it. A fallback that holds other bytes is passed over: the answer is
then the primary's error, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import IntegrityError, ShardChangedError, TensorfsError, printable
from .sources.shard import ShardData, shard_name
from .sources.store import RemoteError, RemoteOptions, is_remote, redact

if TYPE_CHECKING:
    from .formats import ShardHeader
    from .model import Model
    from .names import Layout
    from .selection import Selection

log = logging.getLogger(__name__)

UNREADABLE = (ShardChangedError, RemoteError, IntegrityError, OSError)
"""What a fallback stands in for: bytes gone or changed, a store that cannot give them, bytes that
fail the manifest, a read error of the disk."""
RETRY_AFTER = 30.0
"""Seconds before a fallback that could not be opened is tried again."""
_HASH_PIECE = 8 << 20


@dataclass(frozen=True)
class FallbackSpec:
    """The fallbacks of a model, in order, and how to open them (picklable: a daemon opens its own)."""

    locations: tuple[str | Path, ...]
    layout: Layout = "slash"
    remote: RemoteOptions = field(default_factory=RemoteOptions)
    selection: Selection | None = None
    cache: bool | str | os.PathLike[str] = True

    @classmethod
    def of(cls, locations: Sequence[str | os.PathLike[str]], **how: object) -> FallbackSpec:
        # Paths absolute: a daemon leaves the directory it was started in.
        named = tuple(
            place if isinstance(place, str) and is_remote(place) else Path(os.path.abspath(place))
            for place in locations
        )
        return cls(named, **how)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Copy:
    """A tensor's bytes in a fallback: [start, end) of one of its shards."""

    source: str
    """The fallback, as messages show it."""
    index: int
    """Its place among the fallbacks (the next one tried is after it)."""
    data: ShardData
    start: int
    end: int


class Fallbacks:
    """The fallbacks of one model: opened lazily, asked for copies of tensors (blocking: worker threads)."""

    def __init__(self, spec: FallbackSpec, opener: Callable[..., Model]) -> None:
        self.spec = spec
        self._open = opener  # open_model, given by the model, which builds on this module
        self._models: list[Model | None] = [None] * len(spec.locations)
        self._failed_at: list[float | None] = [None] * len(spec.locations)
        self._locks = [threading.Lock() for _ in spec.locations]
        self._said: set[tuple[int, str]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self.spec.locations)

    def shown(self, index: int) -> str:
        return printable(redact(str(self.spec.locations[index])))

    def model(self, index: int) -> Model | None:
        """The fallback opened (now, if it was not yet); None while it cannot be (said once a try)."""
        with self._locks[index]:
            if self._closed:
                return None
            found = self._models[index]
            if found is not None:
                return found
            failed = self._failed_at[index]
            if failed is not None and time.monotonic() - failed < RETRY_AFTER:
                return None
            spec = self.spec
            selection = spec.selection
            try:
                found = self._open(
                    spec.locations[index],
                    layout=spec.layout,
                    remote=spec.remote,
                    include=selection.include if selection else (),
                    exclude=selection.exclude if selection else (),
                    layers=selection.layers if selection else None,
                    cache=spec.cache,
                )
            except TensorfsError as exc:
                self._failed_at[index] = time.monotonic()
                log.warning(
                    "fallback %s cannot be opened now (tried again in %.0f s): %s",
                    self.shown(index),
                    RETRY_AFTER,
                    printable(str(exc)),
                )
                return None
            self._failed_at[index] = None
            self._models[index] = found
            log.info("fallback %s opened: %d tensors", self.shown(index), len(found))
            return found

    def shard_named(self, name: str) -> tuple[int, ShardHeader, ShardData] | None:
        """The first fallback's shard whose file is called `name` (for a shard of the primary that is
        missing or invalid): its validated header and its data, still the fallback's to close."""
        for index in range(len(self)):
            model = self.model(index)
            if model is None:
                continue
            for shard in model.shards:
                if shard_name(shard) == name:
                    return index, model.shard_header(shard), model.shard_data(shard)
        return None

    def copy_of(self, name: str, header: tuple[str, list[int]], expected: str | None, after: int = -1) -> Copy | None:
        """A fallback's copy of tensor `name` whose dtype and shape are `header`'s (and, with
        `expected`, whose bytes hash to it), from the first fallback after `after` that has one."""
        for index in range(after + 1, len(self)):
            model = self.model(index)
            if model is None or name not in model:
                if model is not None:
                    self._say_once(index, name, "does not hold it")
                continue
            info = model.info(name)
            if (info.dtype, list(info.shape)) != (header[0], list(header[1])):
                found = f"{info.dtype} {list(info.shape)}"
                self._say_once(index, name, f"holds it as {found}, not {header[0]} {list(header[1])}: not served")
                continue
            shard, offset, nbytes = model.locate(name)
            data = model.shard_data(shard)
            copy = Copy(self.shown(index), index, data, offset, offset + nbytes)
            if expected is not None:
                try:
                    actual = _sha256(copy)
                except UNREADABLE as exc:
                    self._say_once(index, name, f"cannot be read: {printable(str(exc))}")
                    continue
                if actual != expected:
                    self._say_once(index, name, f"does not match the manifest (sha256 {actual}): not served")
                    continue
            return copy
        return None

    def _say_once(self, index: int, name: str, what: str) -> None:
        if (index, name) not in self._said:
            self._said.add((index, name))
            log.warning("fallback %s: tensor '%s' %s", self.shown(index), printable(name), what)

    def close(self) -> None:
        for index, lock in enumerate(self._locks):
            with lock:
                self._closed = True
                model, self._models[index] = self._models[index], None
            if model is not None:
                with contextlib.suppress(BufferError):
                    model.close()


def _sha256(copy: Copy) -> str:
    """The SHA-256 of a copy's bytes, read from its file (a remote one's chunks fetched first)."""
    digest = hashlib.sha256()
    buffer = bytearray(min(_HASH_PIECE, copy.end - copy.start))
    for start in range(copy.start, copy.end, _HASH_PIECE):
        piece = memoryview(buffer)[: min(_HASH_PIECE, copy.end - start)]
        copy.data.readinto(start, piece)
        digest.update(piece)
    return digest.hexdigest()
