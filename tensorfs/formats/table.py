"""What a format makes of a file: the table of its tensors (a ShardHeader), the same for every format.

Each tensor: its name, dtype, shape, and where its bytes are (offsets from where the file's data
begins); and the file's metadata. A model is assembled, mounted, viewed and listed from tables
alone: nothing past formats/ knows which format a file is.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ..errors import Problem
from ..utils.identity import ShardKey, shard_name
from .dtypes import DTYPE_NAMED, DType

if TYPE_CHECKING:
    import numpy as np

Reader = Callable[[int, int], bytes]
"""Bytes of a file: read(offset, count), wherever the file is (a descriptor, a store's ranges)."""


def shape_text(shape: Sequence[int]) -> str:
    """A shape as messages and listings show it: [4096, 11008]."""
    return "[" + ", ".join(map(str, shape)) + "]"


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives and what it is."""

    name: str
    dtype: str
    """The safetensors dtype name, e.g. "BF16"."""
    shape: tuple[int, ...]
    nbytes: int
    shard: ShardKey
    """The shard's file (a Path), or its object's URL (a str)."""
    offset: int
    """Absolute byte offset of the tensor's data in the shard file."""
    data_offsets: tuple[int, int]
    """The offsets as the header gives them, relative to where the file's tensor data begins."""
    format: str = "safetensors"
    """The shard's format (formats/): "safetensors" or "gguf"."""

    @property
    def numpy_dtype(self) -> np.dtype | None:
        """The numpy dtype (ml_dtypes for bf16/fp8); None for packed F4/F6 and block-quantized types."""
        return DTYPE_NAMED[self.dtype].numpy

    def as_json(self) -> dict[str, Any]:
        """The fields as JSON values: what `.meta.json` and `ls --json` say of a tensor. A GGUF tensor
        also has its dimensions as stored (innermost first) and its type's block and type sizes."""
        dtype = DTYPE_NAMED[self.dtype]
        fields = {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "shard": shard_name(self.shard),
            "offset": self.offset,
            "data_offsets": list(self.data_offsets),
            "numpy_dtype": dtype.numpy_name,
        }
        if self.format == "gguf":
            fields["gguf_dims"] = list(self.shape[::-1])
            fields["block_size"] = dtype.block_size
            fields["type_size"] = dtype.type_size or dtype.bits // 8
        return fields


Entry = tuple[int, int, str, DType, list[int]]
"""One tensor of a header as (begin, end, name, dtype, shape): a plain tuple, since models hold 100k
and a NamedTuple costs their parse and walks more (docs/performance.md); read it as entry[NAME]."""
BEGIN: Final = 0
END: Final = 1
NAME: Final = 2
DTYPE: Final = 3
SHAPE: Final = 4


@dataclass(frozen=True)
class ShardHeader:
    """A shard whose header passed every rule."""

    path: ShardKey
    """The shard's file, or its object's URL."""
    file_size: int
    data_start: int
    """Where tensor data begins (safetensors: 8 + the header's length; GGUF: past the tensor infos, aligned)."""
    entries: list[Entry]
    """Every tensor, in file order (by offset)."""
    metadata: dict[str, str] | None
    """The header's `__metadata__`, when it has one."""
    format: str = "safetensors"
    """Which format's table it is (formats/): "safetensors" or "gguf"."""
    layout: dict[str, int] | None = None
    """What else the format's views need of the file, as JSON numbers (a GGUF's version, alignment,
    and where its key/value pairs are)."""

    def info(self, entry: Entry) -> TensorInfo:
        """The public description of one of this header's entries."""
        begin, end, name, dtype, shape = entry
        return TensorInfo(
            name, dtype.name, tuple(shape), end - begin, self.path, self.data_start + begin, (begin, end), self.format
        )


MAX_DIMS = 64
"""The most dimensions a tensor may have: numpy's limit (NPY_MAXDIMS), and torch.load's."""
MAX_BYTES = (1 << 63) - 1
"""The most bytes numpy and torch let an array's dimensions span (its dimensions of 0 aside)."""
DENSEST = 8
"""The most elements of any dtype a byte holds (F4: 2; ggml's densest, IQ1_S: 5.12)."""


def shape_problem(dtype: DType, shape: Sequence[int]) -> str | None:
    """Why numpy or torch could not make an array of this shape and dtype over a tensor's bytes
    (None when they can): more than MAX_DIMS dimensions, or dimensions that, those of 0 aside, span
    more than MAX_BYTES (numpy counts them so, torch's strides too: [0, 2^63-1, 2^63-1] has no
    element, and neither can make it)."""
    if len(shape) > MAX_DIMS:
        return f"{len(shape)} dimensions: numpy and torch make arrays of at most {MAX_DIMS}"
    width = dtype.bits // 8 or 1  # the raw bytes of packed types: one each
    if math.prod(dim for dim in shape if dim) * width > MAX_BYTES:
        return (
            f"shape {shape_text(shape)}: its dimensions other than 0 span more than 2^63-1 bytes of "
            f"{dtype.name}, which numpy and torch cannot make an array of"
        )
    return None


def shape_problems(header: ShardHeader, label: str) -> list[Problem]:
    """shape_problem of each of a table's tensors: the rule every format's table passes (formats/).
    A tensor with bytes, of at most MAX_DIMS dimensions, in a file of under MAX_BYTES / DENSEST
    bytes keeps it (it spans at most DENSEST times its bytes): only the others are looked at."""
    whole = header.file_size <= MAX_BYTES // DENSEST
    looked_at = [  # indexing, not unpacking, the tuples: 100k tensors in a few milliseconds
        entry
        for entry in header.entries
        if not (whole and entry[BEGIN] != entry[END] and len(entry[SHAPE]) <= MAX_DIMS)
    ]
    return [
        Problem(label, why, entry[NAME])
        for entry in looked_at
        if (why := shape_problem(entry[DTYPE], entry[SHAPE])) is not None
    ]


METADATA_JSON_BYTES = 16 << 20
"""The most .tensorfs/metadata.json takes of what a model's files say of themselves (a 262k-token
vocabulary with its merges, scores and types takes 13.7 MB of it)."""
SUMMARY_ITEMS = 16
"""The elements a summarized array shows."""
SUMMARY_CHARACTERS = 256
"""The characters a summarized string shows (and each string a summarized array shows)."""


class Described:
    """What a model's files say of themselves, as .tensorfs/metadata.json has it: each file's pairs
    in order while their JSON fits in what is left of `limit` bytes. A string or an array that does
    not fit is summarized instead (string_summary, array_summary: JSON objects, which no value of a
    file's metadata is); once a pair does not fit even so, it and the file's pairs after it are left
    out, counted in `left_out`. What it costs to make is in proportion to `limit`, not to the files."""

    def __init__(self, limit: int = METADATA_JSON_BYTES) -> None:
        self.left = limit
        self.left_out = 0
        """The pairs of the current file left out (its caller reads it, and sets it to 0, file by file)."""

    def add(self, pairs: dict[str, Any], key: str, value: Any) -> bool:
        """Put `key: value` in `pairs` when its JSON fits in what is left (and charge it); whether it did."""
        size = _json_size(key) + 2 + _json_size(value) + 2  # ': ' and ', '
        if size > self.left:
            return False
        self.left -= size
        pairs[key] = value
        return True

    def of(self, metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """`metadata`, decoded already (a safetensors `__metadata__`), as far as it fits."""
        if metadata is None:
            return None
        kept: dict[str, Any] = {}
        for number, (key, value) in enumerate(metadata.items()):
            if self.add(kept, key, value):
                continue
            if isinstance(value, str) and self.add(kept, key, string_summary(value, len(value.encode("utf-8")))):
                continue
            self.left_out += len(metadata) - number
            break
        return kept


def string_summary(first: str, length: int) -> dict[str, Any]:
    """What stands for a string left out: its type, its length in bytes and its first characters."""
    return {"type": "STRING", "bytes": length, "first": first[:SUMMARY_CHARACTERS]}


def array_summary(element_type: str, length: int, first: list[Any]) -> dict[str, Any]:
    """What stands for an array left out: its element type, its length and its first elements."""
    shown = [item[:SUMMARY_CHARACTERS] if isinstance(item, str) else item for item in first[:SUMMARY_ITEMS]]
    return {"type": "ARRAY", "element_type": element_type, "length": length, "first": shown}


def _json_size(value: Any) -> int:
    return len(json.dumps(value, ensure_ascii=False).encode("utf-8"))
