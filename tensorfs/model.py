"""A model: its shards (from an index or a glob), validated together, one read-only mmap per shard."""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import orjson

from .errors import InvalidModelError, ModelClosedError, Problem, ShardChangedError
from .gcpause import gc_paused
from .header import Entry, ShardHeader, TensorInfo, open_shard, read_header_fd
from .names import Layout, collisions, name_problems

if TYPE_CHECKING:
    import numpy as np

INDEX_NAME = "model.safetensors.index.json"
_begin = itemgetter(0)
_MAX_READERS = 8  # header reads are I/O (and GIL-bound parsing): a few threads hide disk latency


@dataclass(frozen=True)
class _Shard:
    header: ShardHeader
    label: str
    mapping: mmap.mmap
    view: memoryview
    stat: os.stat_result
    """The shard file's status when it was mapped."""
    fd: int
    """The descriptor the shard was validated through, kept open for reads that must not fault."""

    @cached_property
    def by_name(self) -> dict[str, Entry]:
        return {entry[2]: entry for entry in self.header.entries}

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.fd)
        self.view.release()
        self.mapping.close()


class Model:
    """A validated model whose tensors are zero-copy, read-only views on one mmap per shard.

    Use as a context manager, or call close(); views handed out stay valid while referenced.
    """

    def __init__(self, source: Path, shards: list[_Shard], owner: dict[str, _Shard], layout: Layout) -> None:
        self.source = source
        self.layout: Layout = layout
        self._shards = {s.header.path: s for s in shards}
        self._owner = owner
        self._closed = False
        self.metadata: dict[str, dict[str, str]] = {s.header.path.name: dict(s.header.metadata or {}) for s in shards}
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
    def shards(self) -> list[Path]:
        """The shard files, sorted by path."""
        return sorted(self._shards)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data over all shards."""
        return sum(s.header.file_size - s.header.data_start for s in self._shards.values())

    def shard_header(self, shard: Path) -> ShardHeader:
        """The validated header of one shard."""
        return self._shards[shard].header

    def entry(self, name: str) -> tuple[Path, int, Entry]:
        """(shard, where its data starts, the header's entry): the raw form, for code that does 100k."""
        shard = self._owner[name]
        return shard.header.path, shard.header.data_start, shard.by_name[name]

    def locate(self, name: str) -> tuple[Path, int, int]:
        """(shard, absolute offset, nbytes) of a tensor: cheaper than info() where that is all."""
        path, data_start, (begin, end, _, _, _) = self.entry(name)
        return path, data_start + begin, end - begin

    def by_shard(self, names: Iterable[str] | None = None) -> dict[Path, list[Entry]]:
        """The header entries of `names` (every tensor by default), grouped by shard, in file order."""
        if names is None:
            return {path: list(shard.header.entries) for path, shard in self._shards.items()}
        groups: dict[Path, list[Entry]] = {}
        for name in names:
            shard = self._owner[name]
            groups.setdefault(shard.header.path, []).append(shard.by_name[name])
        for entries in groups.values():
            entries.sort(key=_begin)
        return groups

    def info(self, name: str) -> TensorInfo:
        """Where tensor `name` lives and what it is; KeyError when there is no such tensor."""
        shard = self._owner[name]
        return shard.header.info(shard.by_name[name])

    # -- the data ------------------------------------------------------------------------
    def shard_stat(self, shard: Path) -> os.stat_result:
        """The shard file's status (identity, size, times) when the model mapped it."""
        return self._shards[shard].stat

    def shard_fd(self, shard: Path) -> int:
        """The shard file's open descriptor (the file validated and mapped), e.g. to watch it."""
        self._check_open()
        return self._shards[shard].fd

    def shard_view(self, shard: Path) -> memoryview:
        """A read-only view of the whole shard file, on its mmap."""
        self._check_open()
        return self._shards[shard].view

    def readinto(self, shard: Path, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the shard's bytes from `offset`, read from the file, not the mapping.

        A mapped page whose bytes were cut from the file kills the process that touches it
        (SIGBUS); a read just comes up short, which is ShardChangedError here.
        """
        self._check_open()
        fd = self._shards[shard].fd
        done, size = 0, len(buffer)
        while done < size:
            count = os.preadv(fd, [buffer[done:]], offset + done)
            if count == 0:
                raise ShardChangedError(
                    f"{shard}: bytes [{offset + done}, {offset + size}) are gone: "
                    "the file shrank after it was validated",
                    lost_from=offset + done,
                )
            done += count

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes: a read-only view on the shard's mmap, no copy."""
        self._check_open()
        shard = self._owner[name]
        begin, end, _, _, _ = shard.by_name[name]
        start = shard.header.data_start
        return shard.view[start + begin : start + end]

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array on the shard's mmap, no copy.

        BF16 and FP8 come as ml_dtypes dtypes; the packed F4/F6 types as their raw uint8 bytes.
        """
        import numpy as np  # here: only the array views need numpy

        self._check_open()
        shard = self._owner[name]
        _, _, _, dtype, shape = shard.by_name[name]
        if dtype.numpy is None:
            return np.frombuffer(self.raw(name), dtype=np.uint8)
        return np.frombuffer(self.raw(name), dtype=dtype.numpy).reshape(shape)

    # -- lifetime ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ModelClosedError(f"model {self.source} is closed: its tensors can no longer be read")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Release the mmaps; a mapping that still backs a live view is released with the view."""
        if self._closed:
            return
        self._closed = True
        for shard in self._shards.values():
            # A view handed out may still be alive: then the mapping goes when it does.
            with contextlib.suppress(BufferError):
                shard.release()

    def __enter__(self) -> Model:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Model {str(self.source)!r}: {len(self._shards)} shards, {len(self)} tensors>"


@dataclass(frozen=True)
class ShardSnapshot:
    header: ShardHeader
    label: str
    identity: tuple[int, int, int, int, int]
    """(device, inode, size, mtime_ns, ctime_ns) of the file that was validated."""


@dataclass(frozen=True)
class ModelSnapshot:
    """A validated model without its mappings: picklable, and cheap to map again (see reopen)."""

    source: Path
    layout: Layout
    shards: list[ShardSnapshot]


def _identity(status: os.stat_result) -> tuple[int, int, int, int, int]:
    return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


def snapshot(model: Model) -> ModelSnapshot:
    """What reopen() needs to map `model` again in another process, without validating it again.

    Equal shapes become one shared object, which pickle then sends once: a model's tensors have
    few distinct shapes, and 100k copies of them would be a tenth of the daemon's memory.
    """
    shapes: dict[tuple[int, ...], Any] = {}
    shards = []
    for shard in model._shards.values():
        header = shard.header
        entries: list[Entry] = [
            (begin, end, name, dtype, shapes.setdefault(tuple(shape), shape))
            for begin, end, name, dtype, shape in header.entries
        ]
        shards.append(ShardSnapshot(dataclasses.replace(header, entries=entries), shard.label, _identity(shard.stat)))
    return ModelSnapshot(model.source, model.layout, shards)


def reopen(saved: ModelSnapshot) -> Model:
    """Map the shards of a model validated elsewhere; InvalidModelError if any file changed since."""
    opened: list[_Shard] = []
    try:
        for shard in saved.shards:
            # Absolute from here on: a daemon leaves the directory it was started in.
            path = Path(os.path.abspath(shard.header.path))
            fd = open_shard(path, shard.label)
            try:
                status = os.fstat(fd)
                if _identity(status) != shard.identity:
                    raise InvalidModelError([Problem(shard.label, "changed while it was being validated; try again")])
                mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            except BaseException:
                os.close(fd)
                raise
            header = dataclasses.replace(shard.header, path=path)
            opened.append(_Shard(header, shard.label, mapping, memoryview(mapping), status, fd))
    except BaseException:
        for done in opened:
            done.release()
        raise
    owner = {entry[2]: shard for shard in opened for entry in shard.header.entries}
    return Model(Path(os.path.abspath(saved.source)), opened, owner, saved.layout)


def open_model(path: str | os.PathLike[str], *, layout: Layout = "slash") -> Model:
    """Validate every header of the model at `path` and map its shards.

    `path` is a .safetensors file, a directory of shards (with or without
    model.safetensors.index.json), or an index file. Raises InvalidModelError naming every
    problem found; no tensor data is read.
    """
    source = Path(path)
    problems: list[Problem] = []
    with gc_paused():
        # Every problem is collected, of every shard and across shards, before any is reported.
        shard_paths, weight_map, index_label = _find_shards(source, problems)
        opened = _open_shards(shard_paths, problems)
        try:
            owner = _check_model(opened, weight_map, index_label, layout, problems)
            if problems:
                raise InvalidModelError(problems)
            return Model(source, opened, owner, layout)
        except BaseException:
            for shard in opened:
                shard.release()
            raise


def _find_shards(source: Path, problems: list[Problem]) -> tuple[list[Path], dict[str, str] | None, str | None]:
    """The shard files of `source`, and the index's weight map when there is one."""
    if source.is_dir():
        index = source / INDEX_NAME
        if index.exists():
            return _shards_from_index(index, problems)
        shards = sorted(source.glob("*.safetensors"))
        if not shards:
            problems.append(Problem(str(source), "no .safetensors files in this directory"))
        return shards, None, None
    if source.name.endswith(".index.json") and source.is_file():
        return _shards_from_index(source, problems)
    if not source.exists() and not source.is_symlink():
        problems.append(Problem(str(source), "no such file or directory"))
        return [], None, None
    return [source], None, None


def _shards_from_index(index: Path, problems: list[Problem]) -> tuple[list[Path], dict[str, str] | None, str]:
    label = str(index)
    weight_map = _read_weight_map(index, label, problems)
    if weight_map is None:
        return [], None, label
    shards: dict[str, Path] = {}
    for shard in dict.fromkeys(weight_map.values()):  # each shard once, in the index's order
        if not shard or "/" in shard or "\\" in shard or shard in (".", "..") or "\0" in shard:
            reason = f"weight_map names '{shard}', which is not a plain file name"
        elif not (index.parent / shard).exists():
            reason = f"weight_map names shard '{shard}', which does not exist"
        else:
            shards[shard] = index.parent / shard
            continue
        first = next(name for name, value in weight_map.items() if value == shard)  # the tensor to name
        problems.append(Problem(label, reason, first))
    return sorted(shards.values()), weight_map, label


def _read_weight_map(index: Path, label: str, problems: list[Problem]) -> dict[str, str] | None:
    # A repeated key needs no check of its own: every mapping is compared with the shards' contents.
    try:
        document = orjson.loads(index.read_bytes())
    except OSError as exc:
        problems.append(Problem(label, f"cannot read: {exc.strerror}"))
        return None
    except orjson.JSONDecodeError as exc:
        problems.append(Problem(label, f"index is not valid JSON: {exc}"))
        return None
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict):
        problems.append(Problem(label, "index has no weight_map object"))
        return None
    if set(map(type, weight_map.values())) <= {str}:
        return weight_map
    for name, shard in weight_map.items():
        if not isinstance(shard, str):
            problems.append(Problem(label, "weight_map value is not a shard file name", name))
    return None


def _open_shards(paths: list[Path], problems: list[Problem]) -> list[_Shard]:
    """Read, validate and map every shard, in parallel; problems of all shards are collected."""

    def open_one(path: Path) -> _Shard | InvalidModelError:
        label = str(path)
        try:
            path.name.encode("utf-8")
        except UnicodeEncodeError:  # .meta.json and index.json name shards in JSON, which is Unicode
            return InvalidModelError([Problem(label, "file name is not valid UTF-8; rename the shard")])
        try:
            fd = open_shard(path, label)
        except InvalidModelError as exc:
            return exc
        try:
            header = read_header_fd(fd, path, label)
            # Map the descriptor the header was read from: the bytes served are the bytes validated.
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
            status = os.fstat(fd)
        except (InvalidModelError, OSError) as exc:
            os.close(fd)
            if isinstance(exc, InvalidModelError):
                return exc
            return InvalidModelError([Problem(label, f"cannot map: {exc.strerror}")])
        return _Shard(header, label, mapping, memoryview(mapping), status, fd)

    if len(paths) <= 1:
        results = [open_one(path) for path in paths]
    else:
        with ThreadPoolExecutor(max_workers=min(_MAX_READERS, len(paths))) as pool:
            results = list(pool.map(open_one, paths))
    opened: list[_Shard] = []
    for result in results:
        if isinstance(result, InvalidModelError):
            problems.extend(result.problems)
        else:
            opened.append(result)
    return opened


def _index_agrees(shards: list[_Shard], weight_map: dict[str, str], tensors: int) -> bool:
    """Whether the index maps exactly the shards' tensors, each to its shard (C-speed for 100k)."""
    if len(weight_map) != tensors:
        return False
    for shard in shards:
        names = [entry[2] for entry in shard.header.entries]
        if list(map(weight_map.get, names)) != [shard.header.path.name] * len(names):
            return False
    return True


def _check_model(
    shards: list[_Shard],
    weight_map: dict[str, str] | None,
    index_label: str | None,
    layout: Layout,
    problems: list[Problem],
) -> dict[str, _Shard]:
    """The rules that span shards: unique names, the index agrees, names are safe paths.

    Returns which shard holds each tensor.
    """
    owner: dict[str, _Shard] = {}
    for shard in shards:
        names = [entry[2] for entry in shard.header.entries]
        owner.update(dict.fromkeys(names, shard))
    if len(owner) != sum(len(shard.header.entries) for shard in shards):
        first: dict[str, _Shard] = {}
        for shard in shards:
            for entry in shard.header.entries:
                holder = first.setdefault(entry[2], shard)
                if holder is not shard:
                    problems.append(Problem(shard.label, f"is also in shard {holder.header.path.name}", entry[2]))
    bad_names = name_problems(owner, layout)
    for name, reason in bad_names:
        problems.append(Problem(owner[name].label, reason, name))
    if weight_map is not None and index_label is not None and not _index_agrees(shards, weight_map, len(owner)):
        read = {shard.header.path.name for shard in shards}  # a shard missing or invalid is reported already
        for name, shard_name in weight_map.items():
            actual = owner.get(name)
            if shard_name in read and (actual is None or actual.header.path.name != shard_name):
                problems.append(
                    Problem(index_label, f"the index maps it to {shard_name}, which does not hold it", name)
                )
        for name, holder in owner.items():
            if name not in weight_map:
                problems.append(Problem(holder.label, "is not listed in the index's weight_map", name))
    # Clashes among the names that are each valid, reported with everything else in one pass.
    valid = owner if not bad_names else {name: shard for name, shard in owner.items() if name not in dict(bad_names)}
    for name, reason in collisions(valid, layout):
        problems.append(Problem(owner[name].label, reason, name))
    return owner
