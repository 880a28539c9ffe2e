"""What a file's bytes mean: one module per format, each turning a file's first bytes into the
validated table of its tensors (table.py) or every problem found. The rest of tensorfs sees the
table alone: names across shards, the index, selections, the mount, the views and the commands
never ask which format a file is.

A format is found by a file's content (its magic bytes), its name a hint only. safetensors has no
magic (8 bytes of length, then JSON): it takes what no other format claims.

Adding a format: a module here with NAME (as ShardHeader.format says it), SUFFIXES (the names its
files are found by), `sniff(first: bytes, name: str) -> bool`, `fits(...)` (whether tensors at
given offsets could be such a file's: a check of a cached table), `file_metadata` and
`described_metadata` (what a file says of itself, whole, and within a bound),
`read_table(read, size, path, label) -> ShardHeader` and `table_bytes(first, size) -> int` (how
many of a file's first bytes its table takes, told from its first 64 KiB: a store is asked for
just those), put in FORMATS ahead of safetensors. Its
table's dtypes come from dtypes.py (a new one goes there, with its numpy dtype if it has one);
`read(offset, count)` gives those bytes of the file, wherever it is (a local file, or an object in
a store: a remote table should cost the store one GET, two when its header is long); fewer when
it reads the first bytes a store gave (as many as table_bytes said), past their end.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..errors import InvalidModelError, Problem
from ..utils.identity import ShardKey
from . import gguf, pytorch, safetensors
from .table import (
    BEGIN,
    DTYPE,
    END,
    NAME,
    SHAPE,
    Described,
    Entry,
    Reader,
    ShardHeader,
    TensorInfo,
    shape_problems,
    shape_text,
)

__all__ = [
    "BEGIN",
    "DTYPE",
    "END",
    "FORMATS",
    "NAME",
    "SHAPE",
    "SNIFF_BYTES",
    "WEIGHT_FILES",
    "WEIGHT_SUFFIXES",
    "Described",
    "Entry",
    "Reader",
    "ShardHeader",
    "TensorInfo",
    "across_files",
    "described_metadata",
    "detect",
    "file_metadata",
    "fits_file",
    "is_weights_name",
    "read_table",
    "shape_text",
    "table_bytes",
]  # fmt: skip

"""(offset, count) -> those bytes of a file (InvalidModelError, or OSError, if they cannot be had;
fewer past the end of the first bytes a store gave, see the module's docstring)."""


class Format(Protocol):
    """What a format's module offers (see the module's docstring)."""

    NAME: str
    SUFFIXES: tuple[str, ...]

    def sniff(self, first: bytes, name: str) -> bool: ...

    def read_table(self, read: Reader, size: int, path: ShardKey, label: str) -> ShardHeader: ...

    def table_bytes(self, first: bytes, size: int) -> int: ...

    def fits(self, begins: list[int], ends: list[int], data_start: int, size: int, layout: Any) -> bool: ...

    def file_metadata(self, header: ShardHeader, read: Reader) -> dict[str, Any] | None: ...

    def described_metadata(self, header: ShardHeader, read: Reader, into: Described) -> dict[str, Any] | None: ...

    def across_files(self, shards: list[tuple[str, ShardHeader]]) -> list[Problem]: ...


FORMATS: list[Format] = [gguf, pytorch, safetensors]
"""In the order they are tried; the last takes what no other claims."""
SNIFF_BYTES = 8
"""The bytes a format is told by."""
WEIGHT_SUFFIXES = tuple(suffix for format_ in FORMATS for suffix in format_.SUFFIXES)
"""The names of files that hold a model's tensors, in a directory or a store's listing."""
_NAMED = sorted(WEIGHT_SUFFIXES, key=lambda suffix: suffix != ".safetensors")
WEIGHT_FILES = ", ".join(_NAMED[:-1]) + " or " + _NAMED[-1]
"""How messages name them (".safetensors, .gguf, .bin, .pt or .pth")."""


def is_weights_name(name: str) -> bool:
    """Whether a file of this name is looked at as a shard of the model (its content decides how)."""
    return name.endswith(WEIGHT_SUFFIXES)


FORMAT_NAMED = {format_.NAME: format_ for format_ in FORMATS}


def fits_file(name: str, begins: list[int], ends: list[int], data_start: int, size: int, layout: Any) -> bool:
    """Whether tensors at these offsets could be a `name` file's of `size` bytes (a cheap check of a
    table kept elsewhere, the header cache's: it was validated when it was made)."""
    return FORMAT_NAMED[name].fits(begins, ends, data_start, size, layout)


def across_files(name: str, shards: list[tuple[str, ShardHeader]]) -> list[Problem]:
    """What a format says is wrong across a model's files (label and table of each, in name order),
    beyond what every format is held to (unique names, the index)."""
    return FORMAT_NAMED[name].across_files(shards)


def file_metadata(header: ShardHeader, read: Reader) -> dict[str, Any] | None:
    """What a file says of itself: a safetensors `__metadata__`, a GGUF's key/value pairs (decoded,
    read again through `read`: a table keeps no more than its views need)."""
    return FORMAT_NAMED[header.format].file_metadata(header, read)


def described_metadata(header: ShardHeader, read: Reader, into: Described) -> dict[str, Any] | None:
    """file_metadata as .tensorfs/metadata.json has it: as much as fits `into` (table.Described),
    made at a cost in proportion to what fits, whatever the file holds."""
    return FORMAT_NAMED[header.format].described_metadata(header, read, into)


def detect(first: bytes, name: str) -> Format:
    """The format of a file whose first bytes are `first` (up to SNIFF_BYTES) and whose name is `name`."""
    for format_ in FORMATS[:-1]:
        if format_.sniff(first, name):
            return format_
    return FORMATS[-1]


def read_table(read: Reader, size: int, path: ShardKey, label: str) -> ShardHeader:
    """The validated table of the file at `path` (`size` bytes, shown as `label`), whatever its format;
    InvalidModelError listing every problem found. Tensor data is never read. Every format's table
    passes here: each tensor's shape must be one numpy and torch can make an array of (table.py)."""
    first = read(0, min(size, SNIFF_BYTES))
    format_ = detect(first, str(path))
    if format_ is FORMATS[-1] and not is_weights_name(str(path)) and not safetensors.plausible(first, size):
        raise InvalidModelError(
            [Problem(label, f"not a weights file ({_begins(first)}; tensorfs reads {WEIGHT_FILES})")]
        )
    header = format_.read_table(read, size, path, label)
    problems = shape_problems(header, label)
    if problems:
        raise InvalidModelError(problems)
    return header


def _begins(first: bytes) -> str:
    """How a file that is no format's begins, in a few words ("it is empty", "it begins '{"model'")."""
    if not first:
        return "it is empty"
    shown = first.decode("ascii", "replace")
    if shown.isprintable():
        return f"it begins {shown!r}"
    return f"its first bytes, {first.hex(' ')}, are no format's"


def table_bytes(first: bytes, size: int) -> int:
    """How many of a file's first bytes its table takes (told from `first`, the first bytes of it
    a store gave: at least SNIFF_BYTES of them when the file has as many)."""
    return detect(first[:SNIFF_BYTES], "").table_bytes(first, size)
