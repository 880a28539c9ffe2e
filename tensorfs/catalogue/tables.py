"""A model's tables: its shards (each a validated header and the opened data), which shard holds each
tensor, and the lookups every layer above asks (names, where a tensor is, what it is), selections.

Nothing here hands out a tensor's bytes: that is the gate's (gate.py), which asks these tables
where they are. Reading a shard's raw bytes (`readinto`) is for the code that proves them (hashing).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from typing import Any

from .. import formats
from ..errors import InvalidModelError, Problem, TensorNotFound
from ..formats import NAME, Entry, ShardHeader, TensorInfo
from ..selection import Selection, layer_of
from ..sources.shard import ShardData
from ..utils.identity import Identity, ShardKey, shard_name
from ..utils.names import Layout

__all__ = ["Shard", "Tables", "file_gaps", "file_runs", "owners", "restricted"]

_begin = itemgetter(0)
_end = itemgetter(1)


@dataclass(frozen=True)
class Shard:
    """One shard of a model: its validated header, and its opened data."""

    header: ShardHeader
    data: ShardData
    lent: bool = False
    """A fallback's shard, standing in for one missing or invalid: the fallback's to close."""

    @property
    def label(self) -> str:
        return self.data.label

    @cached_property
    def by_name(self) -> dict[str, Entry]:
        return {entry[NAME]: entry for entry in self.header.entries}


class Tables:
    """Which shard holds each tensor of a model, and what each tensor is."""

    def __init__(
        self,
        source: ShardKey,
        shards: list[Shard],
        owner: dict[str, Shard],
        layout: Layout,
        selection: Selection | None = None,
    ) -> None:
        self.source = source
        """What was opened: a path, or a URL."""
        self.layout: Layout = layout
        self.selection = selection or Selection()
        """How this model's tensors were picked from its source's (or its parent's): all by default."""
        self.parts: dict[str, list[str]] = {}
        """A folder of several models opened as one tree's, or a pipeline's components (opening/
        repository.py): each model's folder in the tree, and its files (paths in the folder). Empty
        for one model."""
        self._shards = {s.header.path: s for s in shards}
        self._owner = owner
        self.metadata: dict[str, dict[str, str]] = {
            shard_name(s.header.path): dict(s.header.metadata or {}) for s in shards
        }
        """Each shard's `__metadata__` (empty when it has none), keyed by the shard's file name."""

    # -- the set of tensors --------------------------------------------------------------
    @cached_property
    def sorted_names(self) -> list[str]:
        """Every tensor name, sorted: the model's own list, not to be changed (names() copies it)."""
        return sorted(self._owner)

    def names(self) -> list[str]:
        """Every tensor name, sorted."""
        return list(self.sorted_names)

    def __len__(self) -> int:
        return len(self._owner)

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def __iter__(self) -> Iterator[str]:
        return iter(self.sorted_names)

    @property
    def shards(self) -> list[ShardKey]:
        """The shards (paths of files, or URLs of objects), sorted."""
        return sorted(self._shards, key=str)

    @property
    def format(self) -> str:
        """The format of the model's files ("safetensors", "gguf", "pytorch"): one for all its shards."""
        return next(iter(self._shards.values())).header.format if self._shards else "safetensors"

    @property
    def view_format(self) -> str:
        """The format of the model's views and exports: a GGUF's are GGUFs, every other model's
        safetensors (a PyTorch checkpoint is read through its safetensors view, no pickle run)."""
        return "gguf" if self.format == "gguf" else "safetensors"

    @cached_property
    def nbytes(self) -> int:
        """Bytes of tensor data over all tensors (the sum of their ends less that of their begins: C loops)."""
        return sum(sum(map(_end, s.header.entries)) - sum(map(_begin, s.header.entries)) for s in self._shards.values())

    def shard_header(self, shard: ShardKey) -> ShardHeader:
        """The validated header of one shard."""
        return self._shards[shard].header

    def file_metadata(self, shard: ShardKey) -> dict[str, Any] | None:
        """What the shard's file says of itself: a safetensors `__metadata__`, a GGUF's key/value
        pairs (decoded; read again from the file: blocking)."""
        return formats.file_metadata(self.shard_header(shard), self.shard_data(shard).read)

    def described_metadata(self, shard: ShardKey, into: formats.Described) -> dict[str, Any] | None:
        """file_metadata, as much of it as fits `into` (.tensorfs/metadata.json's bound)."""
        return formats.described_metadata(self.shard_header(shard), self.shard_data(shard).read, into)

    def entry(self, name: str) -> tuple[ShardKey, int, Entry]:
        """(shard, where its data starts, the header's entry): the raw form, for code that does 100k."""
        shard = self.shard_of(name)
        return shard.header.path, shard.header.data_start, shard.by_name[name]

    def shard_of(self, name: str) -> Shard:
        """The shard that holds tensor `name`; TensorNotFound (a KeyError) when there is no such tensor."""
        try:
            return self._owner[name]
        except KeyError:
            raise TensorNotFound(str(Problem(str(self.source), "not in the model", name))) from None

    def locate(self, name: str) -> tuple[ShardKey, int, int]:
        """(shard, absolute offset, nbytes) of a tensor: cheaper than info() where that is all."""
        path, data_start, (begin, end, _, _, _) = self.entry(name)
        return path, data_start + begin, end - begin

    def by_shard(self, names: Iterable[str] | None = None) -> dict[ShardKey, list[Entry]]:
        """The header entries of `names` (every tensor by default), grouped by shard, in file order."""
        if names is None:
            return {path: list(shard.header.entries) for path, shard in self._shards.items()}
        groups: dict[ShardKey, list[Entry]] = {}
        for name in names:
            shard = self._owner[name]
            groups.setdefault(shard.header.path, []).append(shard.by_name[name])
        for entries in groups.values():
            entries.sort(key=_begin)
        return groups

    def info(self, name: str) -> TensorInfo:
        """Where tensor `name` lives and what it is; TensorNotFound (a KeyError) when there is no such tensor."""
        shard = self.shard_of(name)
        return shard.header.info(shard.by_name[name])

    def known(self, names: Iterable[str] | None) -> list[str]:
        """`names` as a list (every tensor, sorted, for None); TensorNotFound for one not in the model."""
        if names is None:
            return self.sorted_names
        chosen = list(names)
        for name in chosen:
            self.shard_of(name)
        return chosen

    # -- the shards' data: for the gate, and for the code that proves bytes ------------------
    def shard_data(self, shard: ShardKey) -> ShardData:
        """The opened shard: its mapping, and the safe ways to its bytes (see sources.ShardData)."""
        return self._shards[shard].data

    def readinto(self, shard: ShardKey, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the shard's bytes from `offset`, as they are (unchecked: for hashing)."""
        self.shard_data(shard).readinto(offset, buffer)

    def identity(self, shard: ShardKey) -> Identity | None:
        """The identity of the bytes validated, if the shard still holds them (for caches of their hashes)."""
        return self._shards[shard].data.identity()

    def flush(self) -> None:
        """Record in their caches what was fetched for remote shards (a second's worth is kept back),
        and let go of the source's pages a mount has served (the page-cache handover)."""
        for shard in self._shards.values():
            shard.data.flush()

    def close(self) -> None:
        """Let go of the shards' data (a mapping that still backs a live view goes with the view); a
        fallback's shards standing in for missing ones are the fallback's to close."""
        for shard in self._shards.values():
            if not shard.lent:
                with contextlib.suppress(BufferError):
                    shard.data.close()

    def opened_shards(self) -> list[Shard]:
        """The shards, as opened (the tables' own list: not to be changed)."""
        return list(self._shards.values())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {str(self.source)!r}: {len(self._shards)} shards, {len(self)} tensors>"


def file_runs(header: ShardHeader) -> tuple[list[tuple[int, int, str]], list[tuple[int, int]]]:
    """A shard file cut into what its tensors hold and what no tensor holds (its header, the padding
    between tensors, a checkpoint's zip records), as absolute [start, end) runs in file order: each
    byte once (tensors that share bytes, a checkpoint's views of one storage, are had from the first
    that holds them; empty tensors hold none)."""
    start = header.data_start
    held: list[tuple[int, int, str]] = []
    gaps: list[tuple[int, int]] = []
    reached = 0
    for entry in sorted(header.entries, key=lambda e: (e[0], e[1])):
        begin, end = start + entry[0], start + entry[1]
        if end <= max(reached, begin):
            continue
        if begin > reached:
            gaps.append((reached, begin))
        held.append((max(begin, reached), end, entry[NAME]))
        reached = end
    if reached < header.file_size:
        gaps.append((reached, header.file_size))
    return held, gaps


def file_gaps(header: ShardHeader) -> list[tuple[int, int]]:
    """What file_runs(header) says no tensor holds, without a Python step per tensor when the tensors
    lie end to end in file order (a safetensors shard as it is written): then the gaps are the header
    before them and what follows the last. Other layouts are walked by file_runs."""
    entries = header.entries
    begins, ends = list(map(_begin, entries)), list(map(_end, entries))
    # End to end: each begins where the one before ends, and none ends before it begins (then the ends
    # never go down). The comparisons of whole lists are C loops.
    if not entries or begins[1:] != ends[:-1] or begins[0] > ends[0] or ends != sorted(ends):
        return file_runs(header)[1]
    first, last = header.data_start + begins[0], header.data_start + ends[-1]
    if first == last:  # every tensor empty: the whole file is one gap
        return [(0, header.file_size)] if header.file_size else []
    gaps = [(0, first)] if first else []
    return [*gaps, (last, header.file_size)] if last < header.file_size else gaps


def owners(shards: list[Shard]) -> dict[str, Shard]:
    """Which of `shards` holds each tensor."""
    owner: dict[str, Shard] = {}
    for shard in shards:
        owner.update(dict.fromkeys([entry[NAME] for entry in shard.header.entries], shard))
    return owner


def opened_for(shards: list[Shard], selection: Selection, label: str) -> tuple[list[Shard], dict[str, Shard]]:
    """restricted(), for shards just opened for the selection: those left with nothing selected are
    closed (neither mapped nor read any further), but for those lent (their lender closes them)."""
    kept, owner = restricted(shards, selection, label)
    paths = {shard.header.path for shard in kept}
    for shard in shards:
        if shard.header.path not in paths and not shard.lent:
            shard.data.close()
    return kept, owner


def restricted(shards: list[Shard], selection: Selection, label: str) -> tuple[list[Shard], dict[str, Shard]]:
    """The shards' headers cut down to the selected tensors (shards left with none dropped), and their owners."""
    kept: list[Shard] = []
    owner: dict[str, Shard] = {}
    for shard in shards:
        chosen = set(selection.select(entry[NAME] for entry in shard.header.entries))
        if not chosen:
            continue
        entries = [entry for entry in shard.header.entries if entry[NAME] in chosen]
        cut = Shard(dataclasses.replace(shard.header, entries=entries), shard.data, shard.lent)
        kept.append(cut)
        owner.update(dict.fromkeys(chosen, cut))
    if not owner:
        raise InvalidModelError([Problem(label, f"no tensor matches the selection ({selection.describe()})")])
    if selection.layers is not None and all(layer_of(name) is None for name in owner):
        # Only tensors outside the layers would be kept: a range that misses, or a model named otherwise.
        numbers = {n for shard in shards for entry in shard.header.entries if (n := layer_of(entry[NAME])) is not None}
        held = f"its layers are {min(numbers)}-{max(numbers)}" if numbers else "it has no numbered layers"
        why = f"--layers {selection.layers[0]}-{selection.layers[1]} selects no layer ({held})"
        raise InvalidModelError([Problem(label, why)])
    return kept, owner
