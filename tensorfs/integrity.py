"""SHA-256 of tensors' raw bytes."""

from __future__ import annotations

import hashlib

_CHUNK = 8 << 20  # hashlib releases the GIL while it hashes a chunk this large


def sha256_hex(data: memoryview) -> str:
    """The SHA-256 of `data`, hashed in chunks so other threads run meanwhile."""
    digest = hashlib.sha256()
    for start in range(0, len(data), _CHUNK):
        digest.update(data[start : start + _CHUNK])
    return digest.hexdigest()
