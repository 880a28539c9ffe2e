"""What `safetensors.numpy` reads with, over anything tensorfs opens: where code has
`from safetensors.numpy import load_file, load`, `from tensorfs.numpy import ...` takes the same
arguments and gives the same arrays (tests/test_dropin.py holds them to safetensors')."""

from __future__ import annotations

import os
from typing import Any

from . import loader
from .loader import safe_open

__all__ = ["load", "load_file", "safe_open"]


def load(data: bytes) -> dict[str, Any]:
    """`safetensors.numpy.load(data)`: the numpy arrays of a safetensors file's bytes (see loader.load)."""
    return loader.load(data, framework="np")


def load_file(filename: str | os.PathLike[str], *, backend: str = "mmap", **options: Any) -> dict[str, Any]:
    """`safetensors.numpy.load_file(filename, *, backend="mmap")`, for anything open_model opens (its
    options keyword-only beside them): every array by name, in the order of the bytes."""
    return loader.load_file(filename, backend=backend, framework="np", **options)
