"""The in-process API: what a mount guarantees, without one.

open_model() validates every header and maps the shards, and with `verify` hands out no tensor before
its bytes match the manifest; safe_open() is a drop-in for `safetensors.safe_open` over anything
open_model opens (one file, a directory of shards, an index, s3://, http(s)://, hf://); load_file()
is `safetensors.torch.load_file` for all of those. Arrays and tensors are made over the shards'
bytes, never copied (frameworks.py); prefetching is the model's (prefetch.py).
"""

from __future__ import annotations

import contextlib
import os
from types import TracebackType
from typing import Any

from .dtypes import DTYPE_NAMED
from .frameworks import check_device, framework_of
from .gate import UNREADABLE
from .model import Model
from .opener import open_model

__all__ = ["SafeOpen", "TensorSlice", "load_file", "open_model", "safe_open"]


def safe_open(path: str | os.PathLike[str], framework: str = "np", device: Any = "cpu", **options: Any) -> SafeOpen:
    """`safetensors.safe_open`, over anything open_model opens, with its options (verify=, include=,
    exclude=, layers=, remote=, cache=, fallback=). `framework`: "np"/"numpy" or "pt"/"torch"."""
    kind = framework_of(framework)
    check_device(kind, device)
    return SafeOpen(open_model(path, **options), kind, device)


class SafeOpen:
    """An open model as `safetensors.safe_open` shows one file: keys, metadata, tensors and slices.

    Tensors share their bytes with the shards (a private copy-on-write mapping: writable, and no write
    reaches a file); for several shards, metadata() is their common `__metadata__`.
    """

    def __init__(self, model: Model, framework: str, device: Any = "cpu") -> None:
        self.model = model
        """The model: for prefetch(), tensors() and the rest of its API."""
        self.framework = framework
        self.device = device

    def keys(self) -> list[str]:
        """Every tensor name, sorted."""
        return self.model.names()

    def offset_keys(self) -> list[str]:
        """Every tensor name in the order of the bytes: by shard, then by offset in it."""
        return [entry[2] for shard in self.model.shards for entry in self.model.shard_header(shard).entries]

    def metadata(self) -> dict[str, str] | None:
        """The `__metadata__` of the file (None when it has none); of several shards, what they share."""
        self.model._check_open()
        shards = self.model.shards
        if len(shards) == 1:
            found = self.model.shard_header(shards[0]).metadata
            return dict(found) if found is not None else None
        from .views import shared_metadata

        return shared_metadata(self.model)

    def get_tensor(self, name: str) -> Any:
        """The tensor (see Model.tensor); TensorNotFound, also a KeyError, for a name not in the model."""
        return self.model.tensor(name, self.framework, self.device)

    def get_slice(self, name: str) -> TensorSlice:
        """The tensor to slice: only the bytes a slice takes are read (verified whole first, when verifying)."""
        self.model._check_open()
        self.model.gate.check(name)
        return TensorSlice(self, name)

    def get_tensors(self) -> dict[str, Any]:
        """Every tensor, in the order of the bytes."""
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> SafeOpen:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<tensorfs.SafeOpen {self.model.source!s} ({self.framework})>"


class TensorSlice:
    """A tensor to slice (`safetensors`' PySafeSlice): get_shape(), get_dtype(), and [...]."""

    def __init__(self, opened: SafeOpen, name: str) -> None:
        self._opened = opened
        self._name = name
        self._info = opened.model.info(name)

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        """The dtype's name ("F32", "BF16", ...; a GGUF's "Q4_K" ...)."""
        return DTYPE_NAMED[self._info.dtype].name

    def __getitem__(self, key: Any) -> Any:
        whole = self._opened.model.tensor(self._name, self._opened.framework)  # a view: nothing read yet
        part = whole[key]
        if self._opened.framework == "np":
            import numpy as np

            if isinstance(part, np.generic):  # an element: a 0-d array of its bytes, as the reference gives
                part = whole[(*key, ...) if isinstance(key, tuple) else (key, ...)]
        device = self._opened.device
        return part if str(device) == "cpu" else part.to(device)

    def __repr__(self) -> str:
        return f"<tensorfs.TensorSlice {self._name!r} {self.get_dtype()} {self.get_shape()}>"


def load_file(
    path: str | os.PathLike[str], framework: str = "pt", device: Any = "cpu", **options: Any
) -> dict[str, Any]:
    """Every tensor of the model (or of the selection) by name, in the order of the bytes: what
    `safetensors.torch.load_file` gives for one file, for anything open_model opens. Verified first
    when `verify` is given (hashed on several threads); a remote model's chunks fetched at once.
    The tensors share their bytes with the shards' files (copy-on-write), as safetensors' do."""
    kind = framework_of(framework)
    check_device(kind, device)
    with open_model(path, **options) as model:
        opened = SafeOpen(model, kind, device)
        names = opened.offset_keys()
        # With fallbacks, a tensor that fails here is taken from one by tensor() below.
        with contextlib.suppress(*UNREADABLE) if model.fallbacks is not None else contextlib.nullcontext():
            model.gate.verify_many(names)
            if any(model.shard_data(shard).needs_ensure for shard in model.shards):
                model.prefetch(names).wait()
        return {name: model.tensor(name, kind, device) for name in names}
