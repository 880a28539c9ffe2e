"""What `safetensors.torch` reads with, over anything tensorfs opens: where code has
`from safetensors.torch import load_file, load, safe_open`, `from tensorfs.torch import ...` takes
the same arguments and gives the same tensors (tests/test_dropin.py holds them to safetensors')."""

from __future__ import annotations

from typing import Any

from . import loader
from .loader import load_file, safe_open

__all__ = ["load", "load_file", "safe_open"]


def load(data: bytes) -> dict[str, Any]:
    """`safetensors.torch.load(data)`: the torch tensors of a safetensors file's bytes (see loader.load)."""
    return loader.load(data, framework="pt")
