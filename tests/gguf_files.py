"""GGUF files for the tests: written by the `gguf` package (the reference writer) where they are well
formed, and put together by hand here, byte by byte, where they must not be."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from helpers import random_bytes

# Value types of GGUF's key/value pairs.
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)


def row_bytes(type_name: str, elements: int) -> int:
    """Bytes of `elements` elements (a multiple of the block size) of a ggml type."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return elements // block * size


def write_gguf(
    path: Path,
    tensors: dict[str, tuple[str, list[int]]],
    pairs: dict[str, Any] | None = None,
    seed: int = 0,
    alignment: int | None = None,
    split_max_tensors: int = 0,
) -> dict[str, bytes]:
    """A GGUF written by the reference writer: each tensor of a ggml type and a numpy-order shape
    (the last dimension a multiple of the type's block size), random bytes; returns each tensor's
    bytes. With split_max_tensors, a multi-file GGUF (PATH-00001-of-0000N.gguf, ...)."""
    writer = GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value in (pairs or {}).items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    written: dict[str, bytes] = {}
    for number, (name, (type_name, shape)) in enumerate(tensors.items()):
        *rows, last = shape or [1]
        data = random_bytes(int(np.prod(rows, dtype=np.int64)) * row_bytes(type_name, last), seed + number)
        array = np.frombuffer(data, dtype=np.uint8).reshape(*rows, row_bytes(type_name, last))
        writer.add_tensor(name, array, raw_dtype=GGMLQuantizationType[type_name])
        written[name] = data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def string(text: str | bytes) -> bytes:
    raw = text.encode("utf-8") if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def pair(key: str | bytes, kind: int, value: bytes) -> bytes:
    """One key/value pair, its value already encoded."""
    return string(key) + struct.pack("<I", kind) + value


def info(name: str | bytes, dims: list[int], type_id: int, offset: int) -> bytes:
    """One tensor info: dims as stored (innermost first)."""
    return string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


def raw_gguf(
    pairs: list[bytes],
    infos: list[bytes],
    data: bytes = b"",
    *,
    version: int = 3,
    alignment: int = 32,
    counts: tuple[int, int] | None = None,
) -> bytes:
    """A GGUF put together by hand: the counts are those of `infos` and `pairs` unless given."""
    n_tensors, n_kv = counts if counts is not None else (len(infos), len(pairs))
    head = b"GGUF" + struct.pack("<IQQ", version, n_tensors, n_kv) + b"".join(pairs) + b"".join(infos)
    return head + bytes(-len(head) % alignment) + data
