"""Helpers for programs that read a mounted model's files."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 and the fp8 names with numpy.dtype)
import numpy as np

from .names import SIDECAR_SUFFIXES


def memmap(path: str | os.PathLike[str]) -> np.ndarray[Any, Any]:
    """The tensor file at `path` as a read-only np.memmap of its dtype and shape (from its .meta.json).

    Packed F4/F6 tensors come as their raw uint8 bytes; an empty tensor as an empty array (a file
    of 0 bytes cannot be mapped).
    """
    path = Path(path)
    meta = json.loads(path.with_name(path.name + SIDECAR_SUFFIXES[0]).read_bytes())
    if meta["numpy_dtype"] is None:
        dtype, shape = np.dtype(np.uint8), (meta["nbytes"],)
    else:
        dtype, shape = np.dtype(meta["numpy_dtype"]), tuple(meta["shape"])
    if meta["nbytes"] == 0:
        empty = np.empty(shape, dtype=dtype)
        empty.flags.writeable = False
        return empty
    return np.memmap(path, dtype=dtype, shape=shape, mode="r")
