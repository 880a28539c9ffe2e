"""The key/value pairs of a GGUF made of some of a model's tensors (the view of a selection, a
pipeline stage's layers): what they say agrees with the tensors it holds, and no loader takes it
for the whole model.

A GGUF loader builds the model its pairs describe and fills it with the tensors it finds: llama.cpp
refuses a tensor missing, transformers (gguf_file=) makes the missing ones up at random with a
warning. So a part says it is one: its general.architecture is none a loader knows (PART_ARCHITECTURE:
both refuse it, naming it), the source's architecture is kept in tensorfs.part.architecture, the
blocks it holds (blk.N, as the source numbers them) in tensorfs.part.blocks, and {arch}.block_count
counts them; an array of one value per block ({arch}.attention.head_count_kv of some models: the
keys PER_BLOCK) keeps the values of the blocks held. Every other pair is the source's as it is.
"""

from __future__ import annotations

import struct

from .gguf import ARRAY, STRING, UINT32, VALUE_FORMATS, VALUE_SIZES, encoded_string

__all__ = ["ARCHITECTURE_KEY", "BLOCKS_KEY", "PART_ARCHITECTURE", "SOURCE_ARCHITECTURE_KEY", "part_pairs"]

ARCHITECTURE_KEY = "general.architecture"
PART_ARCHITECTURE = "part-of-a-model"
"""A part's general.architecture: a name no loader knows, which says why (transformers looks for
the names of architectures within it: it holds none)."""
SOURCE_ARCHITECTURE_KEY = "tensorfs.part.architecture"
BLOCKS_KEY = "tensorfs.part.blocks"
PER_BLOCK = (
    "feed_forward_length", "attention.head_count", "attention.head_count_kv", "attention.sliding_window_pattern",
)  # fmt: skip
"""The keys (after `{arch}.`) that llama.cpp reads as one value, or an array of one value per block."""
_FLOATS_AND_BOOL = (6, 7, 12)


def part_pairs(pairs: list[tuple[str, bytes]], blocks: list[int]) -> list[bytes]:
    """The pairs of a part of the GGUF whose pairs are `pairs` (key, and the pair's bytes, as
    gguf.pairs() gives them; validated), holding the tensors of `blocks` (ascending) of it, and
    others of no block (embeddings, norms, the head) or not all of them."""
    architecture = next((_string_value(raw) for key, raw in pairs if key == ARCHITECTURE_KEY), None)
    count_key = f"{architecture}.block_count"
    source_blocks = next((_integer(raw) for key, raw in pairs if key == count_key), None)
    per_block = {f"{architecture}.{key}" for key in PER_BLOCK}
    made: list[bytes] = []
    for key, raw in pairs:
        if key == ARCHITECTURE_KEY:
            made.append(_pair(key, STRING, encoded_string(PART_ARCHITECTURE)))
        elif key == count_key and source_blocks is not None:
            kind = _kind(raw)
            made.append(_pair(key, kind, struct.pack("<" + VALUE_FORMATS[kind], len(blocks))))
        elif key in per_block and source_blocks is not None:
            made.append(_per_block(raw, source_blocks, blocks) or raw)
        else:
            made.append(raw)
    if architecture is not None:
        made.append(_pair(SOURCE_ARCHITECTURE_KEY, STRING, encoded_string(architecture)))
    made.append(_pair(BLOCKS_KEY, ARRAY, struct.pack(f"<IQ{len(blocks)}I", UINT32, len(blocks), *blocks)))
    return made


def _per_block(raw: bytes, source_blocks: int, blocks: list[int]) -> bytes | None:
    """The pair of an array of one number per block of the source, with those of `blocks` (None: it is not one)."""
    start = _value_start(raw)
    if _kind(raw) != ARRAY:
        return None
    item, count = struct.unpack_from("<IQ", raw, start)
    if item not in VALUE_SIZES or count != source_blocks or any(block >= count for block in blocks):
        return None
    values = struct.unpack_from(f"<{count}{VALUE_FORMATS[item]}", raw, start + 12)
    kept = [values[block] for block in blocks]
    array = struct.pack(f"<IQ{len(kept)}{VALUE_FORMATS[item]}", item, len(kept), *kept)
    return raw[: start - 4] + _pair_body(ARRAY, array)


def _value_start(raw: bytes) -> int:
    """Where a pair's value begins (after its key and its type)."""
    return 8 + int.from_bytes(raw[:8], "little") + 4


def _kind(raw: bytes) -> int:
    return int.from_bytes(raw[_value_start(raw) - 4 : _value_start(raw)], "little")


def _string_value(raw: bytes) -> str | None:
    if _kind(raw) != STRING:
        return None
    start = _value_start(raw)
    length = int.from_bytes(raw[start : start + 8], "little")
    return raw[start + 8 : start + 8 + length].decode("utf-8")


def _integer(raw: bytes) -> int | None:
    kind = _kind(raw)
    if kind not in VALUE_FORMATS or kind in _FLOATS_AND_BOOL:  # floats and booleans count no blocks
        return None
    value: int = struct.unpack_from("<" + VALUE_FORMATS[kind], raw, _value_start(raw))[0]
    return value


def _pair(key: str, kind: int, value: bytes) -> bytes:
    return encoded_string(key) + _pair_body(kind, value)


def _pair_body(kind: int, value: bytes) -> bytes:
    return struct.pack("<I", kind) + value
