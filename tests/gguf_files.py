"""GGUF files for the tests: written by the `gguf` package (the reference writer) where they are well
formed, and put together by hand here, byte by byte, where they must not be."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from hypothesis import strategies as st

from helpers import random_bytes
from tensorfs.formats.dtypes import GGML_ID

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


# -- generated files for the differential fuzz: well formed, or nearly so -----------------------

_SCALARS = {U8: "B", I8: "b", U16: "H", I16: "h", U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q", I64: "q", F64: "d"}
_TEXT = st.text(st.sampled_from("abz.09_-é名"), max_size=8)


@st.composite
def _value(draw: st.DrawFn, kind: int) -> bytes:
    """A value of one of GGUF's 13 types, encoded (any bits for a number; now and then a string not UTF-8)."""
    if kind == BOOL:
        return bytes([draw(st.sampled_from([0, 1, 1, 2]))])
    if kind in _SCALARS:
        return draw(st.binary(min_size=struct.calcsize(_SCALARS[kind]), max_size=struct.calcsize(_SCALARS[kind])))
    if kind == STRING:
        return string(draw(st.one_of(_TEXT.map(str.encode), _TEXT.map(str.encode), st.binary(max_size=4))))
    item = draw(st.sampled_from([*_SCALARS, STRING]))
    items = [draw(_value(item)) for _ in range(draw(st.integers(0, 3)))]
    return struct.pack("<IQ", item, len(items)) + b"".join(items)


@st.composite
def gguf_files(draw: st.DrawFn, types: list[Any]) -> bytes:
    """A GGUF put together by hand: a few key/value pairs of every value type, a few tensors of
    `types` (ggml's, tensorfs's DTypes) with 0 to 4 dimensions, laid out at the alignment (the
    default, or a general.alignment pair), random bytes; then, now and then, bytes of its table
    changed and the file cut short."""
    alignment = draw(st.sampled_from([None, None, None, 1, 8, 64, 48]))  # 48: not a power of two
    pairs = []
    if alignment is not None:
        pairs.append(pair("general.alignment", U32, struct.pack("<I", alignment)))
    keys = draw(st.lists(_TEXT.filter(bool), max_size=4, unique=True))
    for key in keys:
        kind = draw(st.sampled_from([*_SCALARS, STRING, ARRAY]))
        pairs.append(pair(key, kind, draw(_value(kind))))
    draw(st.randoms()).shuffle(pairs)
    infos, data = [], b""
    long_names = st.text("n", min_size=62, max_size=65)  # llama.cpp takes 63 bytes, not 64
    names = draw(st.lists(st.one_of(_TEXT.filter(bool), _TEXT.filter(bool), long_names), max_size=4, unique=True))
    step = alignment or 32
    for number, name in enumerate(names):
        dtype = draw(st.sampled_from(types))
        later = st.sampled_from([1, 2, 3, 1, 2, 3, 0])  # a 0 there is refused (llama.cpp divides by it)
        dims = [dtype.block_size * draw(st.sampled_from([1, 2, 1, 2, 0])), *draw(st.lists(later, max_size=3))]
        dims = dims[: draw(st.integers(0 if dtype.block_size == 1 else 1, len(dims)))]  # none: one element
        elements = int(np.prod(dims, dtype=np.int64)) if dims else 1
        nbytes = elements // dtype.block_size * (dtype.type_size or dtype.bits // 8)
        data += bytes(-len(data) % step)
        infos.append(info(name, dims, GGML_ID[dtype.name], len(data)))
        data += random_bytes(nbytes, number)
    content = bytearray(raw_gguf(pairs, infos, data + bytes(-len(data) % step), alignment=step))
    table_end = len(content) - len(data) - (-len(data) % step)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))):
        content[draw(st.integers(0, table_end - 1))] = draw(st.integers(0, 255))
    end = draw(st.sampled_from(["whole"] * 10 + ["cut", "more"]))
    if end == "cut":
        del content[draw(st.integers(0, len(content))) :]
    elif end == "more":  # bytes after the data: llama.cpp takes them
        content += draw(st.binary(min_size=1, max_size=40))
    return bytes(content)


# -- the reference reader ------------------------------------------------------------------


def gguf_reading(path: str | Path) -> tuple[dict[str, tuple[str, list[int], int, int, bytes]], str]:
    """What GGUFReader reads of a file: each tensor's type, dims as stored, data offset, size and
    bytes; the repr of every pair's contents(). It believes the counts a file gives (a damaged one
    may say 2^60 array elements past its end, and it appends an empty one to a list for each: 24 GB
    went before it was stopped): on files that may be damaged, read it through helpers.BoundedReference."""
    reader = GGUFReader(str(path))
    tensors = {
        t.name: (t.tensor_type.name, [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes), t.data.tobytes())
        for t in reader.tensors
    }
    return tensors, repr({key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")})
