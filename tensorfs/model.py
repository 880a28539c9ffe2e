"""A model as the library hands it out: its tables (catalogue/tables.py), and its tensors as zero-copy numpy arrays
and torch tensors, every byte of them through the model's gate (gate.py)."""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from .catalogue.fallbacks import Fallbacks
from .catalogue.tables import Shard, Tables, restricted
from .errors import ModelClosedError
from .formats.frameworks import check_device, framework_of, make_tensor
from .gate import Gate
from .prefetch import DEFAULT_AHEAD, DEFAULT_AHEAD_BYTES, Prefetch, Window, aiterate, iterate
from .selection import Selection
from .sources.shard import ShardData
from .utils.identity import ShardKey
from .utils.names import Layout
from .views.export import Written, write_safetensors

if TYPE_CHECKING:
    import numpy as np

    from .proof.signature import SignedModel

__all__ = ["Model"]

_BRINGERS = 4  # threads bringing tensors in ahead of use: one reads in order (prefetch.Lane), the others hash


class Model(Tables):
    """A validated model whose tensors are zero-copy, read-only views on one mmap per shard.

    Use as a context manager, or call close(); views handed out stay valid while referenced.
    """

    def __init__(
        self,
        source: ShardKey,
        shards: list[Shard],
        owner: dict[str, Shard],
        layout: Layout,
        selection: Selection | None = None,
        *,
        fallbacks: Fallbacks | None = None,
        parent: Model | None = None,
    ) -> None:
        super().__init__(source, shards, owner, layout, selection)
        self._parent = parent  # a selection made by select(): the parent owns the mappings and the gate
        self.gate: Gate = parent.gate if parent is not None else Gate(self, fallbacks)
        """The only way to this model's bytes: checks, verification, fallbacks (see gate.py)."""
        self.header_cache: Path | None = None
        """Where its headers are kept, when they all are (a daemon reads them back from there)."""
        self.stand_ins: list[str] = []
        """What its fallbacks stand in for since it was opened (shards missing or invalid), one line each."""
        self.signed: SignedModel | None = None
        """The signature it is held to (its digests are the gate's manifest), if any (opening/source.py)."""
        self.manifest_beside: Mapping[str, Mapping[str, str]] = {}
        """What the manifest it is held to says of the weights files beside it, by file, then tensor
        (proof/manifest.py Manifest.beside): what its view's other models are held to."""
        self._closed = False
        self._pool: ThreadPoolExecutor | None = None  # the threads that bring tensors in (made when asked)
        self._pool_made = threading.Lock()
        if parent is None:  # a reader going through the model front to back goes on from each shard into the next
            for before, after in itertools.pairwise(self.shards):
                self.shard_data(before).goes_on_into(self.shard_data(after), self.shard_header(after).data_start)

    def select(self, selection: Selection) -> Model:
        """This model restricted to the tensors `selection` picks (of those it holds).

        The result reads through this model's mappings and gate: it is usable while this model is open.
        InvalidModelError when nothing is selected.
        """
        self._check_open()
        shards, owner = restricted(self.opened_shards(), selection, str(self.source))
        selected = Model(self.source, shards, owner, self.layout, selection, parent=self)
        selected.parts = self.parts
        return selected

    @property
    def fallbacks(self) -> Fallbacks | None:
        """Other copies of the model, tried in order when a tensor's own shard cannot give its bytes."""
        return self.gate.fallbacks

    @property
    def verifying(self) -> bool:
        """Whether a manifest is in force: no tensor is handed out before its bytes match it."""
        return self.gate.expected is not None

    # -- the data ------------------------------------------------------------------------
    def shard_data(self, shard: ShardKey) -> ShardData:
        self._check_open()
        return super().shard_data(shard)

    def raw(self, name: str) -> memoryview:
        """The tensor's bytes: a read-only view on the shard's mapping, no copy.

        For a remote model the tensor's chunks are fetched first (TensorfsError if they cannot be),
        and kept in the cache while the model is open. Verified first when the model is. When its
        shard cannot give them and the model has fallbacks, a fallback's copy (see catalogue/fallbacks.py).
        """
        self._check_open()
        grant = self.gate.held(name)
        return grant.place.data.view[grant.low : grant.high]

    def array(self, name: str) -> np.ndarray:
        """The tensor as a read-only numpy array on the shard's mmap, no copy.

        BF16 and FP8 come as ml_dtypes dtypes; the packed F4/F6 types as their raw uint8 bytes.
        """
        import numpy as np  # here: only the array views need numpy

        _, _, _, dtype, shape = self.entry(name)[2]
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
        self._check_open()
        grant = self.gate.held(name)
        _, _, _, dtype, shape = self.entry(name)[2]
        return make_tensor(grant.place.data.private_view()[grant.low : grant.high], dtype, shape, kind, device)

    # -- ahead of use ----------------------------------------------------------------------
    def prefetch(self, names: Iterable[str] | None = None) -> Prefetch:
        """Bring the tensors `names` (all by default) in on worker threads, in that order: their pages
        read (a local model) or their chunks fetched (a remote one), and verified when the model is.
        Returns at once: the handle says done(), wait(timeout), cancel(), bytes_done of bytes_total."""
        self._check_open()
        return Prefetch(self.gate, self.known(names), self._workers())

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
            self.gate,
            self.known(names),
            self._workers(),
            lambda name: self.tensor(name, kind, device),
            ahead,
            ahead_bytes,
        )

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

    def write_safetensors(
        self,
        path: str | os.PathLike[str],
        progress: Callable[[int], None] | None = None,
        *,
        replace: bool = True,
        written: Written | None = None,
    ) -> int:
        """Write the model's tensors (this selection's) as one safetensors file at `path` (a GGUF
        model's: one GGUF file, its metadata and alignment the source's); returns its size in bytes.

        Laid out as the reference writer lays them out, with the shards' `__metadata__` when they
        all agree on it; streamed from the shard files through the gate, written whole or not at
        all. A regular file at `path` is replaced (`replace=False`: refused), never one of the
        model's shards; a symlink or anything else there is refused. `progress`, if given, is called
        with each count of bytes written. Blocks of zeros are left as holes; `written`, if given,
        counts the bytes written and those left as holes.
        """

        self._check_open()
        self.gate.verify_many(self.sorted_names)
        return write_safetensors(self, self.gate, Path(path), progress, replace=replace, written=written)

    # -- lifetime ------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise ModelClosedError(self.source)

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
        hasher = self.gate.integrity.hasher
        hasher.save()
        hasher.cache.close()
        super().close()
        self.gate.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Model {str(self.source)!r}: {len(self.shards)} shards, {len(self)} tensors>"
