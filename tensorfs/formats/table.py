"""What a format makes of a file: the table of its tensors (a ShardHeader), the same for every format.

Each tensor: its name, dtype, shape, and where its bytes are (offsets from where the file's data
begins); and the file's metadata. A model is assembled, mounted, viewed and listed from tables
alone: nothing past formats/ knows which format a file is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from ..dtypes import DTYPE_NAMED, DType
from ..identity import ShardKey, shard_name

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
