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
A part of a part (a stage's export, selected again) says the same of the blocks it holds, numbered
as the whole model's.
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
    gguf.pairs() gives them; validated), holding the tensors of `blocks` (ascending, as the source
    numbers them) of it, and others of no block (embeddings, norms, the head) or not all of them.
    The source may be a part itself (a stage's export, selected again): it says which blocks it
    holds, and of which architecture."""
    said = dict(pairs)
    architecture = _string_value(said[ARCHITECTURE_KEY]) if ARCHITECTURE_KEY in said else None
    held: list[int] | None = None  # the source's blocks, when it is a part: else 0 to block_count - 1
    if architecture == PART_ARCHITECTURE and SOURCE_ARCHITECTURE_KEY in said:
        architecture = _string_value(said[SOURCE_ARCHITECTURE_KEY])
        held = _integers(said[BLOCKS_KEY]) if BLOCKS_KEY in said else None
    count_key = f"{architecture}.block_count"
    count = _integer(said[count_key]) if architecture is not None and count_key in said else None
    positions = None  # where each block's value is in a per-block array of the source
    if count is not None:
        numbers = held if held is not None and len(held) == count else list(range(count))
        if set(blocks) <= set(numbers):
            positions = [numbers.index(block) for block in blocks]
    per_block = {f"{architecture}.{key}" for key in PER_BLOCK}
    made: list[bytes] = []
    for key, raw in pairs:
        if key in (SOURCE_ARCHITECTURE_KEY, BLOCKS_KEY):
            continue  # said again below, of this part
        if key == ARCHITECTURE_KEY:
            made.append(_pair(key, STRING, encoded_string(PART_ARCHITECTURE)))
        elif key == count_key and count is not None:
            kind = _kind(raw)
            made.append(_pair(key, kind, struct.pack("<" + VALUE_FORMATS[kind], len(blocks))))
        elif key in per_block and count is not None and positions is not None:
            made.append(_per_block(raw, count, positions) or raw)
        else:
            made.append(raw)
    if ARCHITECTURE_KEY not in said:  # a part says so, whatever its source said
        made.append(_pair(ARCHITECTURE_KEY, STRING, encoded_string(PART_ARCHITECTURE)))
    if architecture is not None:
        made.append(_pair(SOURCE_ARCHITECTURE_KEY, STRING, encoded_string(architecture)))
    made.append(_pair(BLOCKS_KEY, ARRAY, struct.pack(f"<IQ{len(blocks)}I", UINT32, len(blocks), *blocks)))
    return made


def _per_block(raw: bytes, count: int, positions: list[int]) -> bytes | None:
    """The pair of an array of one number per block of the source (`count` of them), with those at
    `positions` (None: it is not such an array)."""
    start = _value_start(raw)
    if _kind(raw) != ARRAY:
        return None
    item, length = struct.unpack_from("<IQ", raw, start)
    if item not in VALUE_SIZES or length != count:
        return None
    values = struct.unpack_from(f"<{length}{VALUE_FORMATS[item]}", raw, start + 12)
    kept = [values[position] for position in positions]
    array = struct.pack(f"<IQ{len(kept)}{VALUE_FORMATS[item]}", item, len(kept), *kept)
    return raw[: start - 4] + _pair_body(ARRAY, array)


def _integers(raw: bytes) -> list[int] | None:
    """An array of integers' values (None: the pair is no such array)."""
    start = _value_start(raw)
    if _kind(raw) != ARRAY:
        return None
    item, length = struct.unpack_from("<IQ", raw, start)
    if item not in VALUE_SIZES or item in _FLOATS_AND_BOOL:
        return None
    return list(struct.unpack_from(f"<{length}{VALUE_FORMATS[item]}", raw, start + 12))


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
