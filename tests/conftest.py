"""Shared fixtures. Test files live in tmp_path; nothing is written to the working tree."""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import raw_shard


@pytest.fixture
def shard_file(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Write hand-made shard bytes to a file and return its path."""
    counter = iter(range(1_000_000))

    def make(header, data: bytes = b"", *, length: int | None = None, name: str | None = None) -> Path:  # type: ignore[no-untyped-def]
        path = tmp_path / (name or f"shard{next(counter)}.safetensors")
        path.write_bytes(raw_shard(header, data, length=length))
        return path

    return make
