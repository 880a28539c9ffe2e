"""Other copies of a model (`--fallback`, open_model's `fallback=`): where a tensor's bytes are had
when its own shard cannot give them (a read error, a store down past its timeout, a shard changed
or truncated, bytes that fail the manifest, a shard missing or invalid when the model is opened).

A fallback is a model of its own, opened when first needed (a fallback down is a warning, tried
again later, never a failure of the model) and validated as strictly as any model. It gives a
tensor only when its table agrees with the primary's for that tensor (dtype and shape, so size),
and, where a manifest is in force, only bytes that hash to the manifest's value (the gate hashes a
copy before anything is served from it, and again when its file changes). A fallback that holds
other bytes is passed over: the answer is then the primary's error, never wrong bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import TensorfsError, printable
from ..sources.shard import ShardData
from ..sources.store import RemoteOptions, is_remote, redact
from ..utils.identity import shard_name

if TYPE_CHECKING:
    from ..formats import ShardHeader
    from ..selection import Selection
    from ..utils.names import Layout
    from .tables import Tables

log = logging.getLogger(__name__)

RETRY_AFTER = 30.0
"""Seconds before a fallback that could not be opened is tried again (and a shard whose read failed
is asked again: see gate.py)."""


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

    def __init__(self, spec: FallbackSpec, opener: Callable[..., Tables]) -> None:
        self.spec = spec
        self._open = opener  # open_model, given by the model, which builds on this module
        self._models: list[Tables | None] = [None] * len(spec.locations)
        self._failed_at: list[float | None] = [None] * len(spec.locations)
        self._locks = [threading.Lock() for _ in spec.locations]
        self._said: set[tuple[int, str]] = set()
        self._closed = False

    def __len__(self) -> int:
        return len(self.spec.locations)

    def shown(self, index: int) -> str:
        return printable(redact(str(self.spec.locations[index])))

    def model(self, index: int) -> Tables | None:
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

    def copies_of(self, name: str, table: tuple[str, list[int]], after: int = -1) -> Iterator[Copy]:
        """The copies of tensor `name` whose dtype and shape are `table`'s, from the fallbacks after
        `after`, in order (each opened when first needed; those without it, or with another shape, said
        once and passed over). Whether a copy's bytes may be served is the gate's to say."""
        for index in range(after + 1, len(self)):
            model = self.model(index)
            if model is None:
                continue
            if name not in model:
                self.say_once(index, name, "does not hold it")
                continue
            info = model.info(name)
            if (info.dtype, list(info.shape)) != (table[0], list(table[1])):
                found = f"{info.dtype} {list(info.shape)}"
                self.say_once(index, name, f"holds it as {found}, not {table[0]} {list(table[1])}: not served")
                continue
            shard, offset, nbytes = model.locate(name)
            yield Copy(self.shown(index), index, model.shard_data(shard), offset, offset + nbytes)

    def say_once(self, index: int, name: str, what: str) -> None:
        """Warn of a fallback's copy of a tensor, once."""
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
