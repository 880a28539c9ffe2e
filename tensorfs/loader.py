"""The in-process API: what a mount guarantees, without one.

open_model() validates every header and maps the shards, and with `verify` hands out no tensor before
its bytes match the manifest; safe_open() is a drop-in for `safetensors.safe_open` over anything
open_model opens (one file, a directory of shards, an index, s3://, http(s)://, hf://); load_file()
is `safetensors.torch.load_file` for all of those, and load() is `safetensors.torch.load` of a
file's bytes (tensorfs.torch and tensorfs.numpy hold them as safetensors.torch and .numpy do). All
take their original's arguments in the same places, meaning the same (tests/test_dropin.py holds
them to the installed safetensors); tensorfs's own options are keyword-only beside them. What
safetensors refuses, they refuse with a SafetensorError too (errors.py). Arrays and tensors are
made over the shards' bytes, never copied (formats/frameworks.py), unless backend="pread" asks for bytes of
their own; prefetching is the model's (prefetch.py).
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
from types import TracebackType
from typing import Any

from .errors import InvalidModelError, Problem, RefusedArgument, SliceError, printable
from .formats import safetensors
from .formats.dtypes import DTYPE_NAMED
from .formats.frameworks import FRAMEWORKS, check_device, framework_of, given_as_bytes, make_tensor
from .formats.table import shape_problems
from .gate import UNREADABLE
from .model import Model
from .opening.source import open_model

__all__ = ["SafeOpen", "TensorSlice", "load", "load_file", "open_model", "safe_open"]

BACKENDS = ("mmap", "pread")
"""safetensors' backends: tensors over a mapping of the file, or read into memory of their own (pread(2))."""


def check_backend(backend: str) -> None:
    """A backend safetensors takes, or the one-line error it makes of any other."""
    if backend not in BACKENDS:
        raise RefusedArgument(f"backend {printable(repr(backend))} is invalid: 'mmap' or 'pread', as safetensors takes")


def safe_open(
    filename: str | os.PathLike[str], framework: str, device: Any = "cpu", *, backend: str = "mmap", **options: Any
) -> SafeOpen:
    """`safetensors.safe_open(filename, framework, device="cpu", *, backend="mmap")`, over anything
    open_model opens, with its options keyword-only beside them (verify=, signature=, include=, exclude=,
    layers=, remote=, cache=, fallback=). `framework`: "np"/"numpy" or "pt"/"torch"; `backend`:
    "mmap" (tensors over the shards' bytes) or "pread" (each tensor read from its file into memory
    of its own)."""
    kind = framework_of(framework)
    check_device(kind, device)
    check_backend(backend)
    return SafeOpen(open_model(filename, **options), kind, device, backend)


class SafeOpen:
    """An open model as `safetensors.safe_open` shows one file: keys, metadata, tensors and slices.

    Tensors share their bytes with the shards (a private copy-on-write mapping: writable, and no write
    reaches a file), or with backend="pread" have bytes of their own; for several shards, metadata()
    is their common `__metadata__`.
    """

    def __init__(self, model: Model, framework: str, device: Any = "cpu", backend: str = "mmap") -> None:
        self.model = model
        """The model: for prefetch(), tensors() and the rest of its API."""
        self.framework = framework
        self.device = device
        self.backend = backend

    def keys(self) -> list[str]:
        """Every tensor name, sorted."""
        self.model._check_open()
        return self.model.names()

    def offset_keys(self) -> list[str]:
        """Every tensor name in the order of the bytes: by shard, then by offset in it."""
        self.model._check_open()
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
        if self.backend == "mmap":
            return self.model.tensor(name, self.framework, self.device)
        return self._read(name, self.device)

    def _read(self, name: str, device: Any) -> Any:
        """The tensor read from its file (or through the cache) into memory of its own: backend="pread"."""
        self.model._check_open()
        _, _, (begin, end, _, dtype, shape) = self.model.entry(name)
        buffer = bytearray(end - begin)
        self.model.gate.copy_into(name, 0, memoryview(buffer))
        return make_tensor(memoryview(buffer), dtype, shape, self.framework, device)

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

    def _refused(self, key: Any, why: str, said: str | None = None) -> SliceError:
        """The error a slice of this tensor `key` gets: what safetensors says of it (`said`, when it
        raises its SafetensorError), then the model, the tensor, the slice and why."""
        detail = str(Problem(str(self._opened.model.source), f"slice {_written(key)}: {why}", self._name))
        return SliceError(detail if said is None else f"{said} ({detail})")

    def __getitem__(self, key: Any) -> Any:
        opened = self._opened
        dtype = DTYPE_NAMED[self._info.dtype]
        if given_as_bytes(dtype, self._info.shape, opened.framework):  # a slice of its bytes is not of its values
            framework = "numpy" if opened.framework == "np" else "torch"
            why = f"{dtype.name} comes as its raw bytes in {framework} (no such dtype there): get_tensor() gives them"
            raise self._refused(key, why)
        if opened.backend == "mmap":
            whole = opened.model.tensor(self._name, opened.framework)  # a view: nothing read yet
        else:
            whole = opened._read(self._name, "cpu")
        if opened.framework == "np":
            try:
                index = numpy_index(key, whole.shape)
            except RefusedIndex as exc:
                raise self._refused(key, str(exc), exc.said) from None
            part = whole[(*index, ...)]  # an element too: a 0-d array of its bytes, as the reference gives
            return part.copy() if opened.backend == "pread" else part  # not the whole tensor's memory held
        part = whole[key]  # torch's indexing, as safetensors' torch slices
        device = opened.device
        if str(device) != "cpu":
            return part.to(device)
        return part.clone() if opened.backend == "pread" else part

    def __repr__(self) -> str:
        return f"<tensorfs.TensorSlice {self._name!r} {self.get_dtype()} {self.get_shape()}>"


def load_file(
    filename: str | os.PathLike[str],
    device: Any = "cpu",
    *,
    backend: str = "mmap",
    framework: str = "pt",
    **options: Any,
) -> dict[str, Any]:
    """`safetensors.torch.load_file(filename, device="cpu", *, backend="mmap")`, for anything
    open_model opens: every tensor of the model (or of the selection) by name, in the order of the
    bytes. Keyword-only beside them, tensorfs's own: `framework` ("np" for numpy arrays, as
    `safetensors.numpy.load_file` gives) and open_model's options. Verified first when `verify` is
    given (hashed on several threads); a remote model's chunks fetched at once. The tensors share
    their bytes with the shards' files (copy-on-write), as safetensors' do (backend="pread": their own)."""
    kind = framework_of(framework)
    if isinstance(device, str) and device in FRAMEWORKS:  # load_file(path, "np"): the device's place
        raise RefusedArgument(
            f"device {device} is invalid: load_file's second argument is the device, as safetensors.torch.load_file's; "
            f"for {'numpy arrays' if FRAMEWORKS[device] == 'np' else 'torch tensors'} pass framework={device!r}"
        )
    check_device(kind, device)
    check_backend(backend)
    with open_model(filename, **options) as model:
        opened = SafeOpen(model, kind, device, backend)
        names = opened.offset_keys()
        # With fallbacks, a tensor that fails here is taken from one by get_tensor() below.
        with contextlib.suppress(*UNREADABLE) if model.fallbacks is not None else contextlib.nullcontext():
            model.gate.verify_many(names)
            if any(model.shard_data(shard).needs_ensure for shard in model.shards):
                model.prefetch(names).wait()
        return {name: opened.get_tensor(name) for name in names}


def load(data: bytes | bytearray | memoryview, *, framework: str = "pt") -> dict[str, Any]:
    """`safetensors.torch.load(data)` (framework="np": `safetensors.numpy.load`): every tensor of
    `data`, a safetensors file's bytes, by name in the order of the bytes, over one copy of them of
    its own (writable; `data` is not held). Held to every rule a file is (InvalidModelError, which
    is a SafetensorError too, naming "the bytes given", the tensor and why)."""
    kind = framework_of(framework)
    given = memoryview(data).cast("B")
    label = "the bytes given"
    header = safetensors.read_table(lambda at, count: bytes(given[at : at + count]), given.nbytes, label, label)
    problems = shape_problems(header, label)
    if problems:
        raise InvalidModelError(problems)
    own = memoryview(bytearray(given[header.data_start :]))
    return {name: make_tensor(own[begin:end], dtype, shape, kind) for begin, end, name, dtype, shape in header.entries}


class RefusedIndex(ValueError):
    """A key safetensors' numpy slices do not take: why, and `said`, what safetensors says of it (None
    where it raises no SafetensorError: a TypeError, an OverflowError, a crash)."""

    def __init__(self, why: str, said: str | None = None) -> None:
        super().__init__(why)
        self.said = said


_I64 = 1 << 63
"""safetensors reads an index as a 64-bit int: one past it is no index."""


def numpy_index(key: Any, shape: tuple[int, ...]) -> tuple[int | slice, ...]:
    """`key` as safetensors' numpy slices take it, for a tensor of `shape`: ints (a bool is 0 or 1)
    within the dimension (negative from its end), slices of a step of 1 or more whose start is in
    the dimension and whose stop is from the start to its end (no negative bound), and one `...`;
    `[]` is `[0:0]`. RefusedIndex saying why for anything else (None, a list, an array, a float, a
    bound out of the dimension), with safetensors' words where it raises its SafetensorError: the
    key is taken in its order (its ellipses, each item in turn, their count, then each one's bounds
    from the last)."""
    if isinstance(key, list):
        if key:
            raise RefusedIndex(
                "a list of indices is not a slice safetensors takes", "Non empty lists are not implemented"
            )
        key = slice(0, 0)
    items = key if isinstance(key, tuple) else (key,)
    given = sum(item is not Ellipsis for item in items)  # by identity: an array's == is not a bool
    if len(items) - given > 1:
        raise RefusedIndex("only one ellipsis (...) is allowed", "Only one ellipsis (...) is allowed in slice index")
    index: list[int | slice] = []
    for item in items:
        if item is Ellipsis:
            spread = max(0, len(shape) - given)  # the dimensions the other items leave, each whole
            index += [slice(None)] * spread
            continue
        dim = len(index)
        size = shape[dim] if dim < len(shape) else 0
        if isinstance(item, slice):
            index.append(_slice_of(item, dim, size))
            continue
        value = _integer(item)
        if value is None:
            raise RefusedIndex(
                f"{item!r} is not an index: an int, a slice or ... is",
                f"Unsupported slice index at position {dim}: expected slice, int, or ellipsis",
            )
        if value < -size:
            raise RefusedIndex(
                f"index {value} is out of bounds for dimension #{dim} of size {size}",
                f"Invalid index {value} for dimension {dim} of size {size}",
            )
        index.append(value + size if value < 0 else value)
    written = f"[{', '.join(map(_written_item, index))}] with shape [{', '.join(map(str, shape))}]"
    if given > len(shape):
        raise RefusedIndex(
            f"{given} indices for {len(shape)} dimensions",
            f"Error during slicing {written}: more slicing indexes than dimensions in tensor",
        )
    # Last dimension first, as safetensors checks them (the dimensions after the key's: whole).
    for dim, (item, size) in reversed(list(enumerate(zip(index, shape, strict=False)))):
        beyond: int | None = item if isinstance(item, int) and item >= size else None
        if isinstance(item, slice):  # safetensors names the start past the end, else the last index taken
            start = item.start or 0
            beyond = start if start >= size else item.stop - 1 if item.stop is not None and item.stop > size else None
        if beyond is not None:
            out = f"index {beyond} out of bounds for tensor dimension #{dim} of size {size}"
            why = f"index {item} is out of bounds for dimension #{dim} of size {size}"
            raise RefusedIndex(
                why if isinstance(item, int) else _not_within(item, dim, size), f"Error during slicing {written}: {out}"
            )
    taken: list[int | slice] = []
    for dim, (item, size) in enumerate(zip(index, shape, strict=False)):
        if isinstance(item, slice):
            start, stop = item.start or 0, size if item.stop is None else item.stop
            if start > stop:  # (safetensors takes it, then fails to make it: no error of its own)
                raise RefusedIndex(_not_within(item, dim, size))
            item = slice(start, stop, item.step or 1)
        taken.append(item)
    return tuple(taken)


def _slice_of(item: slice, dim: int, size: int) -> slice:
    """A slice of the key as safetensors reads it: its bounds and step ints or None, the step 1 or
    more, no bound negative or past 64 bits (RefusedIndex: safetensors' step error, or its
    OverflowError)."""
    start, stop, step = (_bound(part) for part in (item.start, item.stop, item.step))
    taken = slice(start, stop, step)
    if any(bound is not None and not 0 <= bound < _I64 for bound in (start, stop)):  # its bounds first
        raise RefusedIndex(_not_within(taken, dim, size))
    if step is not None and step < 1:
        raise RefusedIndex(
            f"a slice's step must be 1 or more, not {step}", f"Slice step must be a positive integer, got {step}"
        )
    return taken


def _not_within(item: slice, dim: int, size: int) -> str:
    """Why a slice's bounds are refused, and what safetensors' numpy slices take of the dimension."""
    start, stop = 0 if item.start is None else item.start, size if item.stop is None else item.stop
    return (
        f"{start}:{stop} is not within dimension #{dim} of size {size} (safetensors' numpy slices take a start "
        f"from 0 to {size - 1} and a stop from the start to {size})"
    )


def _written_item(item: int | slice) -> str:
    """One item of a key as safetensors' messages write it: an int from 0, a slice's bounds as given
    and its step unless 1."""
    if isinstance(item, int):
        return str(item)
    written = ":".join("" if bound is None else str(bound) for bound in (item.start, item.stop))
    return written + ("" if item.step in (None, 1) else f":{item.step}")


def _integer(item: Any) -> int | None:
    """An index as safetensors reads one (an int, a bool, anything with __index__ but numpy's bool,
    within 64 bits), else None."""
    numpy = sys.modules.get("numpy")  # a numpy bool exists only once numpy is imported: not imported for it
    if numpy is not None and isinstance(item, numpy.bool_):
        return None
    try:
        value = operator.index(item)
    except TypeError:
        return None
    return value if -_I64 <= value < _I64 else None


def _bound(value: Any) -> int | None:
    """A slice's bound or step: an int, or None; RefusedIndex for anything else (safetensors: a TypeError)."""
    if value is None:
        return None
    try:
        return operator.index(value)
    except TypeError:
        raise RefusedIndex(f"{value!r} is not an index: an int, a slice or ... is") from None


def _written(key: Any) -> str:
    """A slice's key as it was written: [3:1], [..., 0], [::2], [0, 1] (a list)."""
    if isinstance(key, list):
        return repr(key)
    items = key if isinstance(key, tuple) else (key,)

    def one(item: Any) -> str:
        if isinstance(item, slice):
            bounds = ["" if b is None else repr(b) for b in (item.start, item.stop)]
            return ":".join(bounds) + ("" if item.step is None else f":{item.step!r}")
        return "..." if item is Ellipsis else repr(item)

    return "[" + ", ".join(one(item) for item in items) + "]"
