"""What a format makes of a file: the table of its tensors (a ShardHeader), the same for every format.

Each tensor: its name, dtype, shape, and where its bytes are (offsets from where the file's data
begins); and the file's metadata. A model is assembled, mounted, viewed and listed from tables
alone: nothing past formats/ knows which format a file is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ..dtypes import DTYPE_NAMED, DType
from ..errors import Problem
from ..sources.shard import ShardKey, shard_name

if TYPE_CHECKING:
    import numpy as np


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
