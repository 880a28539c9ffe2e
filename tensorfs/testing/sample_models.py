"""Sample models, written here for the demo, the benchmarks and the tests (nothing downloaded)."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from ..formats.dtypes import DTYPES
from ..sources.index import INDEX_NAME, index_document

Tensor = tuple[str, Sequence[int], bytes]
"""(safetensors dtype name, shape, raw little-endian bytes)."""


def shard_bytes(tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> bytes:
    """A safetensors file holding `tensors` in the given order, header padded to 8 bytes."""
    header: dict[str, object] = {}
    if metadata is not None:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype}")
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(data for _, _, data in tensors.values())


def write_shard(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write one shard (see shard_bytes)."""
    path.write_bytes(shard_bytes(tensors, metadata))


def write_sharded(
    directory: Path, shards: Iterable[Mapping[str, Tensor]], *, index: bool = True, prefix: str = "model"
) -> list[Path]:
    """Write `prefix-0000i-of-0000n.safetensors` shards, and the index when `index` is true."""
    shards = list(shards)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    weight_map: dict[str, str] = {}
    total = 0
    for i, tensors in enumerate(shards, 1):
        path = directory / f"{prefix}-{i:05d}-of-{len(shards):05d}.safetensors"
        write_shard(path, tensors)
        paths.append(path)
        for name, (_, _, data) in tensors.items():
            weight_map[name] = path.name
            total += len(data)
    if index:
        (directory / INDEX_NAME).write_bytes(index_document(weight_map, total))
    return paths


def many_tiny_tensors(directory: Path, tensors: int, shards: int) -> list[Path]:
    """A model of `tensors` F32 [4, 4] tensors named like a transformer's, over `shards` shards.

    The data is streamed, so a header of any size can be written without building it twice.
    """
    directory.mkdir(parents=True, exist_ok=True)
    per_shard = -(-tensors // shards)
    weight_map: dict[str, str] = {}
    paths = []
    for s in range(shards):
        names = [
            f"model.layers.{i // 8}.mlp.experts.{i % 8}.weight"
            for i in range(s * per_shard, min(tensors, (s + 1) * per_shard))
        ]
        header = {
            name: {"dtype": "F32", "shape": [4, 4], "data_offsets": [j * 64, j * 64 + 64]}
            for j, name in enumerate(names)
        }
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        path = directory / f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            f.truncate(8 + len(text) + 64 * len(names))  # zeros, without writing them from Python
        os.utime(path)
        weight_map.update(dict.fromkeys(names, path.name))
        paths.append(path)
    (directory / INDEX_NAME).write_bytes(index_document(weight_map, 64 * tensors))
    return paths
