"""Sizes as people read them."""

from __future__ import annotations


def human_size(nbytes: int) -> str:
    """1536 -> '1.5 KiB'; bytes below 1 KiB are shown exactly."""
    if nbytes < 1024:
        return f"{nbytes} B"
    size = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        size /= 1024
        if size < 1024 or unit == "PiB":
            break
    return f"{size:.1f} {unit}"


def plural(count: int, noun: str) -> str:
    """3, 'tensor' -> '3 tensors'; 1, 'shard' -> '1 shard'."""
    return f"{count} {noun}{'s' * (count != 1)}"
