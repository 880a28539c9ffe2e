"""A model: its shards (from an index or a glob), validated together, one read-only mapping per shard.

Where the shards' bytes come from (files, or objects through a cache) is sources/' business.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from . import formats
from .errors import (
    IntegrityError,
    InvalidModelError,
    ModelClosedError,
    Problem,
    ShardChangedError,
    TensorNotFound,
    printable,
)
from .fallback import RETRY_AFTER, UNREADABLE, Copy, Fallbacks, FallbackSpec
from .formats import NAME, Entry, ShardHeader, TensorInfo
from .frameworks import check_device, framework_of, make_tensor
from .gcpause import gc_paused
from .headercache import WORTH_CACHING, HeaderCache
from .names import Layout, collisions, name_problems
from .prefetch import DEFAULT_AHEAD, DEFAULT_AHEAD_BYTES, Prefetch, Window, aiterate, iterate
from .selection import Selection, layer_of
from .sources.chunkcache import default_cache_dir
from .sources.index import INDEX_NAME
from .sources.local import FoundShards, LocalDescription, LocalShard, find_shards
from .sources.remote import RemoteDescription, RemoteOpener, RemoteShard
from .sources.shard import Identity, ShardData, ShardKey, shard_name
from .sources.store import CREDENTIALS_HINT, RemoteError, RemoteOptions, is_remote, redact, unsupported_scheme

if TYPE_CHECKING:
    import numpy as np

    from .integrity import Integrity

__all__ = ["INDEX_NAME", "Model", "ModelSnapshot", "open_model", "reopen", "snapshot"]

log = logging.getLogger(__name__)
_begin = itemgetter(0)
_MAX_READERS = 8  # header reads are I/O (and GIL-bound parsing): a few threads hide disk latency
_BRINGERS = 4  # threads bringing tensors in ahead of use: one reads in order (prefetch.Lane), the others hash


@dataclass(frozen=True)
class _Shard:
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


class Model:
    """A validated model whose tensors are zero-copy, read-only views on one mmap per shard.

    Use as a context manager, or call close(); views handed out stay valid while referenced.
    """

    def __init__(
        self,
        source: ShardKey,
        shards: list[_Shard],
        owner: dict[str, _Shard],
        layout: Layout,
        selection: Selection | None = None,
        parent: Model | None = None,
    ) -> None:
        self.source = source
        """What was opened: a path, or a URL."""
        self.layout: Layout = layout
        self.selection = selection or Selection()
        """How this model's tensors were picked from its source's (or its parent's): all by default."""
        self._parent = parent  # a selection made by select(): the parent owns the mappings
        self._header_cache: Path | None = None  # where its headers are kept, when they are (open_model)
        self._shards = {s.header.path: s for s in shards}
        self._owner = owner
        self._closed = False
        self.metadata: dict[str, dict[str, str]] = {
            shard_name(s.header.path): dict(s.header.metadata or {}) for s in shards
        }
        """Each shard's `__metadata__` (empty when it has none), keyed by the shard's file name."""
        self.integrity: Integrity | None = parent.integrity if parent is not None else None
        """With a manifest (open_model's verify=): no view of a tensor is handed out before it matches."""
        self._pool: ThreadPoolExecutor | None = None  # the threads that bring tensors in (made when asked)
        self._pool_made = threading.Lock()
        self.fallbacks: Fallbacks | None = parent.fallbacks if parent is not None else None
        """Other copies of the model, tried in order when a tensor's own shard cannot give its bytes."""
        self._copies: dict[str, Copy] = parent._copies if parent is not None else {}
        self._switching: threading.Lock = parent._switching if parent is not None else threading.Lock()
        self._failed_at: dict[ShardKey, float] = parent._failed_at if parent is not None else {}
        self.stand_ins: list[str] = []
        """What its fallbacks stand in for since it was opened (shards missing or invalid), one line each."""

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
        """Bytes of tensor data over all tensors."""
        return sum(end - begin for s in self._shards.values() for begin, end, _, _, _ in s.header.entries)

    def select(self, selection: Selection) -> Model:
        """This model restricted to the tensors `selection` picks (of those it holds).

        The result reads through this model's mappings: it is usable while this model is open.
        InvalidModelError when nothing is selected.
        """
        self._check_open()
        shards, owner = _restricted(list(self._shards.values()), selection, str(self.source))
        return Model(self.source, shards, owner, self.layout, selection, parent=self)

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
        shard = self._shard_of(name)
        return shard.header.path, shard.header.data_start, shard.by_name[name]

    def _shard_of(self, name: str) -> _Shard:
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
        shard = self._shard_of(name)
        return shard.header.info(shard.by_name[name])

    # -- the data ------------------------------------------------------------------------
    def shard_data(self, shard: ShardKey) -> ShardData:
        """The opened shard: its mapping, and the safe ways to its bytes (see sources.ShardData)."""
        self._check_open()
        return self._shards[shard].data

    def shard_view(self, shard: ShardKey) -> memoryview:
        """A read-only view of the whole shard, on its mapping."""
        return self.shard_data(shard).view

    def readinto(self, shard: ShardKey, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the shard's bytes from `offset`, without touching the mapping."""
        self.shard_data(shard).readinto(offset, buffer)

    def flush(self) -> None:
        """Record in their caches what was fetched for remote shards (a second's worth is kept back)."""
        for shard in self._shards.values():
            shard.data.flush()

    def identity(self, shard: ShardKey) -> Identity | None:
        """The identity of the bytes validated, if the shard still holds them (for caches of their hashes)."""
        return self._shards[shard].data.identity()

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes: a read-only view on the shard's mapping, no copy.

        For a remote model the tensor's chunks are fetched first (TensorfsError if they cannot be),
        and kept in the cache while the model is open. Verified first when the model is. When its
        shard cannot give them and the model has fallbacks, a fallback's copy (see fallback.py).
        """
        data, start, end = self._bytes(name)
        return data.view[start:end]

    def _bytes(self, name: str) -> tuple[ShardData, int, int]:
        """Where the tensor's bytes are had: its shard's, verified and present (fetched, and held until
        the model is closed: never evicted under a view), or a fallback's copy when its shard fails."""
        self._check_open()
        shard = self._shard_of(name)
        copy = self._copies.get(name)
        if copy is None:
            begin, end, _, _, _ = shard.by_name[name]
            start = shard.header.data_start
            failing = self.failing(shard.header.path, start + begin, start + end)
            if failing is not None:
                copy = self.switch(name, failing)
            else:
                try:
                    self._verify(name)
                    if shard.data.needs_ensure:
                        shard.data.ensure_pinned(start + begin, start + end)
                    return shard.data, start + begin, start + end
                except UNREADABLE as exc:
                    if not isinstance(exc, IntegrityError):
                        self.failed(shard.header.path)
                    copy = self.switch(name, exc)
        while True:
            try:
                if copy.data.needs_ensure:
                    copy.data.ensure_pinned(copy.start, copy.end)
                return copy.data, copy.start, copy.end
            except UNREADABLE as exc:
                copy = self.switch(name, exc, after=copy)

    def failed(self, shard: ShardKey) -> None:
        """A read of the shard's bytes failed: with fallbacks, its other tensors go to theirs for a while
        (a store down would otherwise cost each of them its own timeout)."""
        if self.fallbacks is not None:
            self._failed_at[shard] = time.monotonic()

    def failing(self, shard: ShardKey, start: int = 0, end: int = 0) -> ShardChangedError | None:
        """Why the shard's tensors go to their fallbacks without asking it, while a read of it failed
        less than RETRY_AFTER seconds ago (None: ask it). Not bytes [start, end) of it that it holds
        without asking where it comes from (a remote shard's cached chunks): they wait for nothing."""
        since = self._failed_at.get(shard)
        if since is None or self.fallbacks is None:
            return None
        ago = time.monotonic() - since
        if ago >= RETRY_AFTER:
            del self._failed_at[shard]
            return None
        if end > start and self._shards[shard].data.held(start, end):
            return None
        return ShardChangedError(f"{self._shards[shard].label}: a read of it failed {ago:.0f} s ago")

    def copy(self, name: str) -> Copy | None:
        """The fallback's copy a tensor is served from, if it is (see switch)."""
        return self._copies.get(name)

    def switch(self, name: str, why: BaseException, after: Copy | None = None, expected: str | None = None) -> Copy:
        """Serve tensor `name` from its next fallback from now on (blocking: a fallback may have to be
        opened, its copy fetched and hashed): the first after `after` whose copy agrees with this
        model's table, and with the manifest where there is one (`expected`, else the model's own
        integrity's); `why` raised again if none does."""
        if self.fallbacks is None:
            raise why
        with self._switching:
            current = self._copies.get(name)
            if current is not None and current is not after:
                return current  # another thread switched it meanwhile
            info = self.info(name)
            if expected is None and self.integrity is not None and self.integrity.expected is not None:
                expected = self.integrity.expected.get(name)
            copy = self.fallbacks.copy_of(name, (info.dtype, list(info.shape)), expected, after.index if after else -1)
            if copy is None:
                log.error("tensor '%s': %s; no fallback can give it", printable(name), printable(str(why)))
                raise why
            self._copies[name] = copy
            shown = printable(str(why))
            log.warning("tensor '%s': served from fallback %s from now on (%s)", printable(name), copy.source, shown)
            return copy

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array on the shard's mmap, no copy.

        BF16 and FP8 come as ml_dtypes dtypes; the packed F4/F6 types as their raw uint8 bytes.
        """
        import numpy as np  # here: only the array views need numpy

        self._check_open()
        shard = self._shard_of(name)
        _, _, _, dtype, shape = shard.by_name[name]
        if dtype.numpy is None:
            return np.frombuffer(self.raw(name), dtype=np.uint8)
        return np.frombuffer(self.raw(name), dtype=dtype.numpy).reshape(shape)

    def tensor(self, name: str, framework: str = "np", device: Any = "cpu") -> Any:
        """The tensor as a numpy array (`framework` "np") or a torch tensor ("pt"), no copy: on a private
        copy-on-write mapping of its shard, so it is writable and no write ever reaches the file (the
        model's tensors share that mapping: a write shows in every view of those bytes). `device`
        other than "cpu" copies a torch tensor there.

        Verified first when the model is; a remote tensor's chunks are fetched, and kept in the cache
        while the model is open (and after, while the tensor is alive).
        """
        kind = framework_of(framework)
        check_device(kind, device)
        data, start, end = self._bytes(name)
        _, _, _, dtype, shape = self._shard_of(name).by_name[name]
        return make_tensor(data.private_view()[start:end], dtype, shape, kind, device)

    # -- ahead of use ----------------------------------------------------------------------
    def prefetch(self, names: Iterable[str] | None = None) -> Prefetch:
        """Bring the tensors `names` (all by default) in on worker threads, in that order: their pages
        read (a local model) or their chunks fetched (a remote one), and verified when the model is.
        Returns at once: the handle says done(), wait(timeout), cancel(), bytes_done of bytes_total."""
        self._check_open()
        return Prefetch(self, self._known(names), self._workers())

    def tensors(
        self,
        names: Iterable[str] | None = None,
        *,
        framework: str = "np",
        device: Any = "cpu",
        ahead: int = DEFAULT_AHEAD,
        ahead_bytes: int = DEFAULT_AHEAD_BYTES,
    ) -> Iterator[tuple[str, Any]]:
        """(name, tensor) for each of `names` (sorted names by default) in order, as tensor() gives them,
        while the next ones are brought in and verified in the background: at most `ahead` tensors
        and `ahead_bytes` bytes ahead of the one handed out. Leaving the loop stops the work ahead."""
        return iterate(self._window(names, framework, device, ahead, ahead_bytes))

    def atensors(
        self,
        names: Iterable[str] | None = None,
        *,
        framework: str = "np",
        device: Any = "cpu",
        ahead: int = DEFAULT_AHEAD,
        ahead_bytes: int = DEFAULT_AHEAD_BYTES,
    ) -> AsyncIterator[tuple[str, Any]]:
        """tensors(), as an async iterator (asyncio or trio): waiting for a tensor never blocks the loop."""
        return aiterate(self._window(names, framework, device, ahead, ahead_bytes))

    def _window(self, names: Iterable[str] | None, framework: str, device: Any, ahead: int, ahead_bytes: int) -> Window:
        kind = framework_of(framework)
        check_device(kind, device)
        self._check_open()
        return Window(
            self, self._known(names), self._workers(), lambda name: self.tensor(name, kind, device), ahead, ahead_bytes
        )

    def _known(self, names: Iterable[str] | None) -> Sequence[str]:
        """`names` as a list (every tensor, sorted, for None); TensorNotFound for one not in the model."""
        if names is None:
            return self.sorted_names
        chosen = list(names)
        for name in chosen:
            self._shard_of(name)
        return chosen

    def _read_in(self, names: list[str]) -> None:
        """Map the pages of these neighbouring tensors (fetching a remote shard's chunks) (blocking: a
        worker thread)."""
        self._check_open()
        shard = self._shard_of(names[0])
        start = shard.header.data_start
        first, last = shard.by_name[names[0]], shard.by_name[names[-1]]
        if not shard.data.ensure_private(start + first[0], start + last[1]):
            raise ShardChangedError(f"{shard.label}: bytes [{start + first[0]}, {start + last[1]}) cannot be read")

    def _verify(self, name: str) -> None:
        if self.integrity is not None:
            self.integrity.check(name)

    def _workers(self) -> ThreadPoolExecutor:
        root = self._root
        with root._pool_made:
            if root._pool is None:
                root._pool = ThreadPoolExecutor(_BRINGERS, thread_name_prefix="tensorfs-ahead")
            return root._pool

    @property
    def _root(self) -> Model:
        model = self
        while model._parent is not None:
            model = model._parent
        return model

    def write_safetensors(self, path: str | os.PathLike[str], progress: Callable[[int], None] | None = None) -> None:
        """Write the model's tensors (this selection's) as one safetensors file at `path` (a GGUF
        model's: one GGUF file, its metadata and alignment the source's).

        Laid out as the reference writer lays them out, with the shards' `__metadata__` when they
        all agree on it; streamed from the shard files, written whole or not at all. `progress`,
        if given, is called with each count of bytes written.
        """
        from .views.export import write_safetensors  # views build on the model

        self._check_open()
        if self.integrity is not None:
            self.integrity.check_many(self.sorted_names)
        write_safetensors(self, Path(path), progress)

    # -- lifetime ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed or (self._parent is not None and self._parent.closed):
            raise ModelClosedError(f"model {self.source} is closed: its tensors can no longer be read")

    @property
    def closed(self) -> bool:
        return self._closed or (self._parent is not None and self._parent.closed)

    def close(self) -> None:
        """Release the mmaps; a mapping that still backs a live view is released with the view."""
        if self._closed:
            return
        self._closed = True
        if self._parent is not None:
            return  # the mappings are the parent's
        if self._pool is not None:  # what is on its way stops first: nothing touches a closed mapping
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self.integrity is not None:
            self.integrity.hasher.save()
            self.integrity.hasher.cache.close()
        for shard in self._shards.values():
            # A view handed out may still be alive: then the mapping goes when it does.
            if not shard.lent:
                with contextlib.suppress(BufferError):
                    shard.data.close()
        if self.fallbacks is not None:
            self.fallbacks.close()

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


def snapshot(model: Model) -> ModelSnapshot:
    """What reopen() needs to map `model` again in another process, without validating it again.

    Headers kept in the header cache are sent as references (the file's identity): 100k entries
    take longer to pickle and unpickle than to be read back from the cache. Otherwise equal shapes
    become one shared object, which pickle then sends once: a model's tensors have few distinct
    shapes, and 100k copies of them would be a tenth of the daemon's memory.
    """
    by_reference = model._header_cache is not None and model._parent is None and model.selection.everything
    shapes: dict[tuple[int, ...], Any] = {}
    shards = []
    for shard in model._shards.values():
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
    return ModelSnapshot(
        model.source, model.layout, shards, model.selection, model._header_cache if by_reference else None, fallback
    )


def reopen(saved: ModelSnapshot) -> Model:
    """Map the shards of a model validated elsewhere; InvalidModelError if any of them changed since."""
    opened: list[_Shard] = []
    cache = HeaderCache(saved.header_cache)
    try:
        for shard in saved.shards:
            if shard.header is None:
                assert isinstance(shard.data, LocalDescription)
                opened.append(_Shard(*LocalShard.reopen_with_header(shard.data, cache)))
            else:
                data = _reopen_data(shard.data)
                opened.append(_Shard(dataclasses.replace(shard.header, path=data.key), data))
    except BaseException:
        for done in opened:
            done.data.close()
        raise
    finally:
        cache.close()
    source = saved.source if isinstance(saved.source, str) else Path(os.path.abspath(saved.source))
    model = Model(source, opened, _owners(opened), saved.layout, saved.selection)
    if saved.fallback is not None:
        model.fallbacks = Fallbacks(saved.fallback, open_model)
    return model


def _reopen_data(description: object) -> ShardData:
    if isinstance(description, LocalDescription):
        return LocalShard.reopen(description)
    if isinstance(description, RemoteDescription):
        return RemoteShard.reopen(description)
    raise TypeError(f"no source reopens {description!r}")


def open_model(
    path: str | os.PathLike[str],
    *,
    layout: Layout = "slash",
    remote: RemoteOptions | None = None,
    include: Iterable[str] | str = (),
    exclude: Iterable[str] | str = (),
    layers: tuple[int, int] | str | int | None = None,
    cache: bool | str | os.PathLike[str] = True,
    fallback: Sequence[str | os.PathLike[str]] = (),
) -> Model:
    """Validate every header of the model at `path` and map its shards.

    `path` is a .safetensors file, a directory of shards (with or without
    model.safetensors.index.json), or an index file; or such a model in a store: s3://BUCKET/PREFIX,
    http(s)://.../NAME.safetensors or .../model.safetensors.index.json, hf://ORG/NAME[@REVISION],
    read through a local cache (`remote` says how). Raises InvalidModelError naming every
    problem found; no tensor data is read.

    `include`/`exclude` (fnmatch globs on names, or one glob) and `layers` ((A, B), "A-B" or N: the N in
    `*.layers.N.*`) select a subset: every header is still validated, but only the selected
    tensors are in the model, and shards without any are not kept mapped (see Selection).

    `cache`: where validated headers are remembered, so that files unchanged since (same device,
    inode, size, mtime and ctime) are not parsed and checked again: True for the default directory
    ($XDG_CACHE_HOME/tensorfs), a directory, or False for none (validate from scratch).

    `fallback`: other copies of the model (paths or URLs, as `path`), in order: a tensor whose own
    shard cannot give its bytes is read from the first that holds the same tensor, and a shard
    missing or invalid is taken from the first that has a file of its name (with a warning). Each
    is opened when first needed, and validated as this model is (see fallback.py).
    """
    selection = Selection(include, exclude, layers)  # type: ignore[arg-type]  # it takes one glob too
    problems: list[Problem] = []
    failed: dict[str, list[Problem]] = {}  # shards that could not be opened, by file name
    headers = _header_cache(cache)
    found: FoundShards | None = None  # a local model's files
    fallbacks = None
    if fallback:
        spec = FallbackSpec.of(fallback, layout=layout, remote=remote or RemoteOptions(), selection=selection,
                               cache=cache)  # fmt: skip
        fallbacks = Fallbacks(spec, open_model)
    with gc_paused(), contextlib.closing(headers):
        # Every problem is collected, of every shard and across shards, before any is reported.
        why = unsupported_scheme(path)
        if why is not None:
            raise InvalidModelError([Problem(str(path), why)])
        if is_remote(path):
            assert isinstance(path, str)
            if "@" in urlsplit(path).netloc:  # never shown, never sent
                raise InvalidModelError([Problem(redact(path), CREDENTIALS_HINT)])
            try:
                opener = RemoteOpener(path, remote or RemoteOptions(), problems)
            except RemoteError as exc:
                raise InvalidModelError([Problem(path, str(exc).removeprefix(f"{path}: "))]) from None
            source: ShardKey = path
            opener.cache.db()  # the objects' cache must be usable (RemoteError if not), before the headers'
            opener.headers = headers if headers.enabled else None
            located = opener.located
            opened = _open_shards(opener.shards, opener.open, problems, failed)
            weight_map, index_label, done = located.weight_map, located.index_label, opener.remember
        else:
            source = Path(path)
            found = find_shards(source, problems, headers)
            weight_map, index_label = found.weight_map, found.index_label
            open_local = functools.partial(LocalShard.open, cache=headers, directory=found.directory)
            try:
                opened = _open_shards([(path, str(path)) for path in found.paths], open_local, problems, failed)
            finally:
                found.close()
            failed.update({name: [problem] for name, problem in found.missing.items()})
            done = None
        stand_ins: list[str] = []
        if fallbacks is not None and failed:
            opened += _lent_by(fallbacks, failed, problems, stand_ins)
        try:
            checks = None
            if (
                headers.enabled
                and found is not None
                and sum(shard.header.data_start for shard in opened) >= WORTH_CACHING
            ):
                checks = _checks_key(source, found, opened, layout)
            owner = _owners(opened) if checks is not None and headers.get("model", checks) == len(opened) else None
            if owner is None:
                if weight_map is None and index_label is not None:  # the index was known, the model not
                    again = find_shards(Path(source), [])  # (its own problems are known: none)
                    again.close()
                    weight_map = again.weight_map
                owner = _check_model(opened, weight_map, index_label, layout, problems)
                if checks is not None and not problems:
                    headers.put("model", checks, len(opened))
            if problems:
                raise InvalidModelError(problems)
            if done is not None:
                done()
            if selection.everything:
                model = Model(source, opened, owner, layout)
                if headers.enabled and found is not None and not failed:
                    model._header_cache = headers.directory
            else:
                kept, owner = _restricted(opened, selection, str(path))
                paths = {shard.header.path for shard in kept}
                for shard in opened:
                    if shard.header.path not in paths and not shard.lent:
                        shard.data.close()  # nothing selected in it: neither mapped nor read any further
                model = Model(source, kept, owner, layout, selection)
            model.fallbacks = fallbacks
            model.stand_ins = stand_ins
            return model
        except BaseException:
            for shard in opened:
                if not shard.lent:
                    shard.data.close()
            if fallbacks is not None:
                fallbacks.close()
            raise


def _header_cache(cache: bool | str | os.PathLike[str]) -> HeaderCache:
    if cache is True:
        return HeaderCache(default_cache_dir().absolute())
    return HeaderCache(Path(cache).absolute() if cache else None)


def _checks_key(source: ShardKey, found: FoundShards, opened: list[_Shard], layout: Layout) -> str | None:
    """What names a local model's checks across shards: its files' identities, the layout; None
    when some file has no identity known (then the model is checked whole)."""
    if found.index_label is not None and found.index_key is None:
        return None
    files: list[str] = []
    for shard in opened:
        description = shard.data.describe()
        if not isinstance(description, LocalDescription):
            return None
        if not description.identity.settled():
            return None
        files += [os.path.abspath(description.path), description.identity.key()]
    text = "\0".join([os.path.abspath(str(source)), layout, found.index_key or "", *files])
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _owners(shards: list[_Shard]) -> dict[str, _Shard]:
    owner: dict[str, _Shard] = {}
    for shard in shards:
        owner.update(dict.fromkeys([entry[NAME] for entry in shard.header.entries], shard))
    return owner


def _restricted(shards: list[_Shard], selection: Selection, label: str) -> tuple[list[_Shard], dict[str, _Shard]]:
    """The shards' headers cut down to the selected tensors (shards left with none dropped), and their owners."""
    kept: list[_Shard] = []
    owner: dict[str, _Shard] = {}
    for shard in shards:
        chosen = set(selection.select(entry[NAME] for entry in shard.header.entries))
        if not chosen:
            continue
        entries = [entry for entry in shard.header.entries if entry[NAME] in chosen]
        restricted = _Shard(dataclasses.replace(shard.header, entries=entries), shard.data, shard.lent)
        kept.append(restricted)
        owner.update(dict.fromkeys(chosen, restricted))
    if not owner:
        raise InvalidModelError([Problem(label, f"no tensor matches the selection ({selection.describe()})")])
    if selection.layers is not None and all(layer_of(name) is None for name in owner):
        # Only tensors outside the layers would be kept: a range that misses, or a model named otherwise.
        numbers = {n for shard in shards for entry in shard.header.entries if (n := layer_of(entry[NAME])) is not None}
        held = f"its layers are {min(numbers)}-{max(numbers)}" if numbers else "it has no numbered layers"
        why = f"--layers {selection.layers[0]}-{selection.layers[1]} selects no layer ({held})"
        raise InvalidModelError([Problem(label, why)])
    return kept, owner


def _open_shards(
    shards: list[tuple[Any, str]], open_one: Any, problems: list[Problem], failed: dict[str, list[Problem]]
) -> list[_Shard]:
    """Read, validate and map every shard, in parallel; problems of all shards are collected (and
    those of each shard that failed in `failed`, by its file name).

    `open_one(where, label)` returns (header, ShardData) or raises InvalidModelError.
    """

    def attempt(shard: tuple[Any, str]) -> _Shard | InvalidModelError:
        try:
            header, data = open_one(*shard)
        except InvalidModelError as exc:
            return exc
        return _Shard(header, data)

    if len(shards) <= 1:
        results = [attempt(shard) for shard in shards]
    else:
        with ThreadPoolExecutor(max_workers=min(_MAX_READERS, len(shards))) as pool:
            results = list(pool.map(attempt, shards))
    opened: list[_Shard] = []
    for (_, label), result in zip(shards, results, strict=True):
        if isinstance(result, InvalidModelError):
            problems.extend(result.problems)
            failed[shard_name(label)] = list(result.problems)
        else:
            opened.append(result)
    return opened


def _lent_by(
    fallbacks: Fallbacks, failed: dict[str, list[Problem]], problems: list[Problem], said: list[str]
) -> list[_Shard]:
    """The fallbacks' shards that stand in for those that failed (each of the same file name), their
    problems taken back and said as warnings (also in `said`); a shard no fallback has keeps its problems."""
    lent: list[_Shard] = []
    for name, its_problems in failed.items():
        found = fallbacks.shard_named(name)
        if found is None:
            continue
        index, header, data = found
        lent.append(_Shard(header, data, lent=True))
        for problem in its_problems:
            problems.remove(problem)
        said.append(f"{printable(str(its_problems[0]))}; its tensors are served from fallback {fallbacks.shown(index)}")
        log.warning("%s", said[-1])
    return lent


def _index_agrees(shards: list[_Shard], weight_map: dict[str, str], tensors: int) -> bool:
    """Whether the index maps exactly the shards' tensors, each to its shard (C-speed for 100k)."""
    if len(weight_map) != tensors:
        return False
    for shard in shards:
        names = [entry[NAME] for entry in shard.header.entries]
        if list(map(weight_map.get, names)) != [shard_name(shard.header.path)] * len(names):
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
    owner = _owners(shards)
    # One model, one format (its views are files of that format), and what that format asks of its
    # files together (several GGUF models in one directory): said instead of their names' clashes.
    mixed = [
        Problem(shard.label, f"is a {shard.header.format} file, where {shards[0].label} is {shards[0].header.format}"
                ": a model's shards are all of one format")
        for shard in shards
        if shard.header.format != shards[0].header.format
    ]  # fmt: skip
    if shards and not mixed:
        in_order = sorted(shards, key=lambda shard: str(shard.header.path))
        mixed = formats.across_files(shards[0].header.format, [(s.label, s.header) for s in in_order])
    if mixed:
        problems += mixed
        return owner
    if len(owner) != sum(len(shard.header.entries) for shard in shards):
        first: dict[str, _Shard] = {}
        for shard in shards:
            for entry in shard.header.entries:
                holder = first.setdefault(entry[NAME], shard)
                if holder is not shard:
                    problems.append(
                        Problem(shard.label, f"is also in shard {shard_name(holder.header.path)}", entry[NAME])
                    )
    bad_names = name_problems(owner, layout)
    for name, reason in bad_names:
        problems.append(Problem(owner[name].label, reason, name))
    if weight_map is not None and index_label is not None and not _index_agrees(shards, weight_map, len(owner)):
        read = {shard_name(shard.header.path) for shard in shards}  # a shard missing or invalid: reported
        for name, mapped in weight_map.items():
            actual = owner.get(name)
            if mapped in read and (actual is None or shard_name(actual.header.path) != mapped):
                problems.append(Problem(index_label, f"the index maps it to {mapped}, which does not hold it", name))
        for name, holder in owner.items():
            if name not in weight_map:
                problems.append(Problem(holder.label, "is not listed in the index's weight_map", name))
    # Clashes among the names that are each valid, reported with everything else in one pass.
    valid = owner if not bad_names else {name: shard for name, shard in owner.items() if name not in dict(bad_names)}
    for name, reason in collisions(valid, layout):
        problems.append(Problem(owner[name].label, reason, name))
    return owner
