"""Helpers for programs that read a mounted model's files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .formats.dtypes import DTYPE_NAMED
from .utils.names import SIDECAR_SUFFIXES

if TYPE_CHECKING:
    import numpy as np


def memmap(path: str | os.PathLike[str]) -> np.ndarray[Any, Any]:
    """The tensor file at `path` as a read-only np.memmap of its dtype and shape (from its .meta.json).

    Packed F4/F6 tensors come as their raw uint8 bytes; an empty tensor as an empty array (a file
    of 0 bytes cannot be mapped).
    """
    import numpy as np

    path = Path(path)
    meta = json.loads(path.with_name(path.name + SIDECAR_SUFFIXES[0]).read_bytes())
    dtype = DTYPE_NAMED[meta["dtype"]].numpy
    if dtype is None:
        dtype, shape = np.dtype(np.uint8), (meta["nbytes"],)
    else:
        shape = tuple(meta["shape"])
    if meta["nbytes"] == 0:
        empty = np.empty(shape, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, shape=shape, mode="r")
