"""GGUF (versions 2 and 3, little-endian): a file's first bytes -> its validated table (ShardHeader).

The rules are those llama.cpp's own reader (ggml/src/gguf.cpp) enforces, the authority where the
`gguf` package checks less: the magic, version 2 or 3, counts and string lengths the file can hold,
known value types, arrays of scalars or strings (not of arrays), no key twice, `general.alignment` a
u32 power of two, strings and arrays of at most 2^30 bytes or elements, keys not empty, tensor names
under 64 bytes and unique, at most 4 dimensions whose product fits in 63 bits (none of them 0 but the
first: llama.cpp divides by the others), a known ggml type (removed ones refused) whose block size
divides the first dimension, and each tensor's offset exactly where the previous one's data ends,
padded to the alignment (so aligned, in order, never overlapping); the data section, its last tensor
padded too, inside the file. tensorfs adds: keys
and names are UTF-8 without NUL (names become file names), and every string is UTF-8 (as GGUF's
specification says, and as modelvet checks). Bytes after the data are allowed, as
llama.cpp allows them. The type table is ggml's (dtypes.GGML_TYPES).

Pure and bounded: it reads what it is given through `read(offset, count)` in growing pieces (at
most MAX_TABLE_BYTES, and never more than the file holds), every count is checked against the bytes
left before anything is made of it, and arrays of numbers are stepped over, not decoded. The
key/value pairs are not kept: `layout` says where they are, and metadata() decodes them on demand.
"""

from __future__ import annotations

import re
import struct
from typing import TYPE_CHECKING, Any

from ..errors import InvalidModelError, Problem, ShardChangedError, printable
from ..utils.identity import ShardKey
from .dtypes import GGML_ID, GGML_TYPES, DType
from .table import SUMMARY_CHARACTERS, SUMMARY_ITEMS, Described, Entry, ShardHeader, array_summary, string_summary

if TYPE_CHECKING:
    from .table import Reader

NAME = "gguf"
SUFFIXES: tuple[str, ...] = (".gguf",)
"""The names its files are found by in a directory or a listing (content decides what a file is)."""
MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_TABLE_BYTES = 256 << 20
"""The most a GGUF's key/value pairs and tensor infos may take: a 262k-token vocabulary with its
merges takes about 10 MB."""
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME_BYTES = 63  # GGML_MAX_NAME is 64, its NUL included
MAX_STRING_BYTES = MAX_ARRAY_ITEMS = 1 << 30  # GGUF_MAX_STRING_LENGTH, GGUF_MAX_ARRAY_ELEMENTS
_SIZE_MAX = (1 << 64) - 1
_FIRST_READ = 64 << 10
_INT64_MAX = (1 << 63) - 1

# Value types: their ids, and the bytes of the fixed-size ones.
STRING, ARRAY = 8, 9
VALUE_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
VALUE_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
VALUE_TYPE_NAMES = {
    0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32", 7: "BOOL",
    8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64",
}  # fmt: skip
UINT32 = 4
_U64 = struct.Struct("<Q")
_INTEGERS = {kind: struct.Struct("<" + VALUE_FORMATS[kind]) for kind in (0, 1, 2, 3, 4, 5, 10, 11)}
SPLIT_KEYS = {"split.no": "split_no", "split.count": "split_count", "split.tensors.count": "split_tensors"}
"""The keys of a multi-file GGUF (llama.cpp's gguf-split), and their names in a table's layout."""
SPLIT_NAME = re.compile(r"(?P<prefix>.+)-(?P<number>\d{5})-of-(?P<count>\d{5})\.gguf")
"""How gguf-split names the files of a multi-file GGUF: NAME-00001-of-00003.gguf."""
ALIGNMENT_KEY = "general.alignment"


def sniff(first: bytes, name: str) -> bool:
    """A GGUF begins with its magic, whatever its name; a byte-swapped one too (refused with a hint)."""
    return first[:4] == MAGIC


class _Fault(Exception):
    """What is wrong where the table cannot be read any further (its reason; the tensor, if any)."""

    def __init__(self, reason: str, tensor: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.tensor = tensor


class _Cursor:
    """The table's bytes, read as they are needed, in pieces twice as long each time."""

    def __init__(self, read: Reader, size: int) -> None:
        self._read = read
        self.size = size
        self._buffer = bytearray()
        self.position = 0

    def need(self, count: int, what: str) -> None:
        """Make `count` more bytes from the position available; _Fault when the file (or the bound) ends first."""
        end = self.position + count
        if end <= len(self._buffer):
            return
        if end > self.size:
            raise _Fault(f"{what} runs past the end of the file ({self.size} bytes): truncated")
        if end > MAX_TABLE_BYTES:
            raise _Fault(f"{what} runs past {MAX_TABLE_BYTES:,} bytes: the table is too large")
        want = min(self.size, MAX_TABLE_BYTES, max(end, 2 * len(self._buffer), _FIRST_READ))
        self._buffer += self._read(len(self._buffer), want - len(self._buffer))
        if end > len(self._buffer):  # a reader of a table's first bytes alone gives no more
            raise _Fault(f"{what} runs past the table's first {len(self._buffer):,} bytes: truncated")

    @property
    def buffer(self) -> bytearray:
        """The bytes read so far, from the file's start."""
        return self._buffer

    def take(self, count: int, what: str) -> memoryview:
        self.need(count, what)
        start = self.position
        self.position += count
        return memoryview(self._buffer)[start : self.position]

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")

    def u64(self, what: str) -> int:
        return int.from_bytes(self.take(8, what), "little")

    def string(self, what: str) -> str:
        """A string: UTF-8 without NUL (keys and names become JSON and file names)."""
        raw = self.take(_string_length(self, what), what)
        try:
            text = str(raw, "utf-8")
        except UnicodeDecodeError:
            raise _Fault(f"{what} is not valid UTF-8") from None
        if "\0" in text:
            raise _Fault(f"{what} holds a NUL byte")
        return text

    def left(self) -> int:
        return self.size - self.position


def read_table(read: Reader, size: int, path: ShardKey, label: str) -> ShardHeader:
    """The validated table of the GGUF at `path` (`size` bytes, shown as `label`), its bytes had from
    `read(offset, count)`. Tensor data is never read. InvalidModelError listing what is wrong."""
    cursor = _Cursor(read, size)
    try:
        version, n_tensors, n_kv = _preamble(cursor)
        kv_start = cursor.position
        alignment, splits = _skip_pairs(cursor, n_kv)
        kv_end = cursor.position
        infos = _tensor_infos(cursor, n_tensors)
    except _Fault as fault:
        raise InvalidModelError([Problem(label, fault.reason, fault.tensor)]) from None
    # No tensor, no data section: llama.cpp pads only before tensors (older writers pad anyway).
    data_start = _padded(cursor.position, alignment) if infos else cursor.position
    problems: list[Problem] = []
    entries = _entries(infos, alignment, data_start, size, label, problems)
    if problems:
        raise InvalidModelError(problems)
    layout = {"version": version, "alignment": alignment, "kv_start": kv_start, "kv_end": kv_end, "kv_count": n_kv}
    layout.update(splits)
    return ShardHeader(path, size, data_start, entries, None, "gguf", layout)


def fits(begins: list[int], ends: list[int], data_start: int, size: int, layout: Any) -> bool:
    """Whether tensors at these offsets (sorted) could be a GGUF's: aligned, in order, none past the next
    one's start, the last inside the file."""
    alignment = layout["alignment"]
    return (
        data_start % alignment == 0
        and all(begin % alignment == 0 for begin in begins)
        and all(end <= begin for end, begin in zip(ends, begins[1:], strict=False))
        and data_start + (ends or [0])[-1] <= size
    )


def table_bytes(first: bytes, size: int) -> int:
    """How many of a file's first bytes its table takes, as far as `first` tells: all of it when the
    table ends within `first`, else at least twice as many as `first` (a store is asked again)."""
    cursor = _Cursor(_only(first), min(size, len(first)))
    try:
        _, n_tensors, n_kv = _preamble(cursor)
        _skip_pairs(cursor, n_kv)
        _tensor_infos(cursor, n_tensors)
    except _Fault:
        if len(first) >= size or len(first) >= MAX_TABLE_BYTES:
            return len(first)  # refused from what there is
        return min(size, MAX_TABLE_BYTES, max(2 * len(first), _FIRST_READ))
    return cursor.position


def _only(first: bytes) -> Reader:
    def read(offset: int, count: int) -> bytes:
        return first[offset : offset + count]

    return read


def _preamble(cursor: _Cursor) -> tuple[int, int, int]:
    if cursor.size < 4 or bytes(cursor.take(4, "the magic")) != MAGIC:
        raise _Fault("not a GGUF file (no GGUF magic)")
    version = cursor.u32("the version")
    if version not in VERSIONS:
        if version and version & 0xFFFF == 0:  # as llama.cpp tells byte-swapped files
            raise _Fault("a big-endian GGUF: tensorfs reads little-endian GGUF only (convert it with gguf's tools)")
        if version == 1:
            raise _Fault("GGUF version 1 is not supported: convert it to version 3 (llama.cpp's convert scripts)")
        raise _Fault(f"GGUF version {version} is not one tensorfs reads (2 and 3)")
    n_tensors = cursor.u64("the tensor count")
    n_kv = cursor.u64("the key/value count")
    # Each tensor info takes at least 8 + 4 + 4 + 8 bytes (an empty name, no dimension), each pair
    # at least 8 + 4 + 1: a count that cannot fit is refused before anything is made of it.
    if n_tensors > cursor.left() // 24:
        raise _Fault(f"{n_tensors:,} tensors cannot fit in the {cursor.left():,} bytes left: truncated or corrupt")
    if n_kv > cursor.left() // 13:
        raise _Fault(f"{n_kv:,} key/value pairs cannot fit in the {cursor.left():,} bytes left: truncated or corrupt")
    return version, n_tensors, n_kv


def _skip_pairs(cursor: _Cursor, count: int) -> tuple[int, dict[str, int]]:
    """Step over `count` key/value pairs, checking each; the alignment they set (or the default),
    and what the split.* keys of a multi-file GGUF say (SPLIT_KEYS, integers)."""
    keys: set[str] = set()
    alignment = DEFAULT_ALIGNMENT
    splits: dict[str, int] = {}
    for number in range(count):
        key = cursor.string(f"key {number}")
        if not key:
            raise _Fault(f"key {number} is empty")
        if key in keys:
            raise _Fault(f"key '{printable(key)}' appears twice")
        keys.add(key)
        kind = cursor.u32(f"the type of key '{printable(key)}'")
        if key == ALIGNMENT_KEY:
            if kind != UINT32:
                raise _Fault(f"{ALIGNMENT_KEY} is {VALUE_TYPE_NAMES.get(kind, kind)}, not UINT32")
            alignment = cursor.u32(ALIGNMENT_KEY)
            if alignment == 0 or alignment & (alignment - 1):
                raise _Fault(f"{ALIGNMENT_KEY} {alignment} is not a power of two")
            continue
        if key in SPLIT_KEYS and kind in _INTEGERS:
            splits[SPLIT_KEYS[key]] = _INTEGERS[kind].unpack(cursor.take(_INTEGERS[kind].size, key))[0]
            continue
        _skip_value(cursor, kind, f"the value of key '{printable(key)}'")
    return alignment, splits


def _skip_value(cursor: _Cursor, kind: int, what: str) -> None:
    if kind in VALUE_SIZES:
        cursor.take(VALUE_SIZES[kind], what)
    elif kind == STRING:
        _skip_string(cursor, what)
    elif kind == ARRAY:
        item = cursor.u32(f"the element type of {what}")
        count = cursor.u64(f"the length of {what}")
        if count > MAX_ARRAY_ITEMS:
            raise _Fault(f"{what}: an array of {count:,} elements, over GGUF's limit of {MAX_ARRAY_ITEMS:,}")
        if item in VALUE_SIZES:
            if count > cursor.left() // VALUE_SIZES[item]:
                raise _Fault(f"{what}: an array of {count:,} elements, more than the file holds")
            cursor.take(count * VALUE_SIZES[item], what)
        elif item == STRING:
            if count > cursor.left() // 8:
                raise _Fault(f"{what}: an array of {count:,} strings, more than the file holds")
            _skip_strings(cursor, count, what)
        elif item == ARRAY:
            raise _Fault(f"{what}: an array of arrays, which GGUF readers do not take")
        else:
            raise _Fault(f"{what}: an array of unknown type {item}")
    else:
        raise _Fault(f"{what}: unknown type {kind}")


def _skip_strings(cursor: _Cursor, count: int, what: str) -> None:
    """Step over `count` strings (a vocabulary: 262k of them), each UTF-8: those wholly in the bytes
    read so far in a tight loop, the one across their end the careful way (which reads more)."""
    unpack = _U64.unpack_from
    start = cursor.position
    long: list[int] = []  # where the strings of over 127 bytes begin (their lengths' bytes may be too)
    done = 0
    while done < count:
        buffer, position = cursor.buffer, cursor.position
        end = len(buffer)
        # A for over a range, with as few steps as can be: a length read up to `short`, of a string of
        # at most 127 bytes (a token's usual), is within what was read and so is the string.
        short = end - 8 - 127
        for index in range(done, count):  # noqa: B007 - read after the loop: where it stopped
            if position > short:
                break
            (length,) = unpack(buffer, position)
            if length > 127:
                if position + 8 + length > end:
                    break
                long.append(position)
            position += 8 + length
        else:
            index = count
        done = index  # the strings stepped over so far
        while done < count and position + 8 <= end:  # the last few of what was read, each held to its end
            (length,) = unpack(buffer, position)
            following = position + 8 + length
            if following > end:  # past what was read (or past the file: the careful way says)
                break
            if length > 127:
                long.append(position)
            position = following
            done += 1
        cursor.position = position
        if done < count:
            _skip_string(cursor, what)
            if cursor.position - position > 135:
                long.append(position)
            done += 1
    # UTF-8 checked in a few decodes: a run of strings with their lengths between them is UTF-8
    # exactly when each string is, if no length has a byte over 127 (a sequence cut short, or begun,
    # at a string's edge meets a length's bytes and fails); runs are cut at the longer ones' lengths.
    view = memoryview(cursor.buffer)
    edges = [start, *(edge for begin in long for edge in (begin, begin + 8)), cursor.position]
    for begin, finish in zip(edges[::2], edges[1::2], strict=True):
        try:
            str(view[begin:finish], "utf-8")
        except UnicodeDecodeError as exc:
            raise _Fault(f"{what}: a string is not valid UTF-8 (byte {begin + exc.start:,})") from None


def _skip_string(cursor: _Cursor, what: str) -> None:
    try:
        str(cursor.take(_string_length(cursor, what), what), "utf-8")
    except UnicodeDecodeError:
        raise _Fault(f"{what} is not valid UTF-8") from None


def _string_length(cursor: _Cursor, what: str) -> int:
    length = cursor.u64(f"the length of {what}")
    if length > MAX_STRING_BYTES:
        raise _Fault(f"{what}: a string of {length:,} bytes, over GGUF's limit of {MAX_STRING_BYTES:,}")
    if length > cursor.left():
        raise _Fault(f"{what}: a string of {length:,} bytes, more than the file holds")
    return length


_Info = tuple[str, list[int], DType, int]  # name, dims as stored (innermost first), type, offset


def _tensor_infos(cursor: _Cursor, count: int) -> list[_Info]:
    infos: list[_Info] = []
    names: set[str] = set()
    for number in range(count):
        name = cursor.string(f"the name of tensor {number}")
        if len(name.encode("utf-8")) > MAX_NAME_BYTES:
            raise _Fault(f"its name is over {MAX_NAME_BYTES} bytes (GGML_MAX_NAME)", name)
        if name in names:
            raise _Fault("the name appears twice", name)
        names.add(name)
        n_dims = cursor.u32("its dimension count")
        if n_dims > MAX_DIMS:
            raise _Fault(f"{n_dims} dimensions: GGUF tensors have at most {MAX_DIMS}", name)
        dims = [cursor.u64("a dimension") for _ in range(n_dims)]
        type_id = cursor.u32("its type")
        offset = cursor.u64("its offset")
        dtype = GGML_TYPES.get(type_id)
        if dtype is None:
            raise _Fault(f"unknown ggml type {type_id}", name)
        if any(dim > _INT64_MAX for dim in dims):
            raise _Fault(f"a dimension of {dims} is negative (as int64)", name)
        ne = [*dims, 1, 1, 1, 1][:MAX_DIMS]
        if 0 in ne[1:]:  # llama.cpp's reader divides by them: a crash (SIGFPE), not a tensor
            raise _Fault(f"dimensions {dims}: one after the first is 0, which llama.cpp's reader divides by", name)
        if (  # llama.cpp's checks, as it makes them (integer division, <=)
            _INT64_MAX // ne[1] <= ne[0]
            or _INT64_MAX // ne[2] <= ne[0] * ne[1]
            or _INT64_MAX // ne[3] <= ne[0] * ne[1] * ne[2]
        ):
            raise _Fault(f"dimensions {dims} hold more than {_INT64_MAX} elements", name)
        if ne[0] % dtype.block_size:
            raise _Fault(
                f"its first dimension {ne[0]} is not a multiple of {dtype.name}'s block size {dtype.block_size}", name
            )
        if ne[0] * ne[1] * ne[2] * ne[3] // dtype.block_size > _SIZE_MAX // (dtype.type_size or dtype.bits // 8):
            raise _Fault(f"dimensions {dims} hold more bytes than a 64-bit size", name)
        infos.append((name, dims, dtype, offset))
    return infos


def _nbytes(dims: list[int], dtype: DType) -> int:
    elements = 1
    for dim in dims:
        elements *= dim
    if dtype.block_size > 1:
        return elements // dtype.block_size * dtype.type_size
    return elements * dtype.bits // 8


def _padded(offset: int, alignment: int) -> int:
    return offset + -offset % alignment


def _entries(
    infos: list[_Info], alignment: int, data_start: int, size: int, label: str, problems: list[Problem]
) -> list[Entry]:
    """Each tensor where the previous one's data ends, padded to the alignment, and the data in the
    file; the first tensor out of place is the problem (those after it follow from it)."""
    entries: list[Entry] = []
    expected = 0
    for name, dims, dtype, offset in infos:
        nbytes = _nbytes(dims, dtype)
        if offset != expected:
            if offset % alignment:
                why = f"its offset {offset} is not a multiple of the alignment {alignment}"
            else:
                why = f"its offset {offset} is not {expected}, where the tensor before it ends (padded to {alignment})"
            problems.append(Problem(label, why, name))
            return []
        entries.append((offset, offset + nbytes, name, dtype, dims[::-1]))
        expected = _padded(offset + nbytes, alignment)
    if data_start + expected > size:
        problems.append(
            Problem(
                label,
                f"its tensor data runs to byte {data_start + expected:,} (padded to {alignment}), "
                f"past the end of the file ({size:,} bytes)",
                infos[-1][0],
            )
        )
    return entries


def file_metadata(header: ShardHeader, read: Reader) -> dict[str, Any]:
    """What the file says of itself: its key/value pairs, decoded (see metadata())."""
    return metadata(read, header.layout or {})


def metadata(read: Reader, layout: dict[str, int]) -> dict[str, Any]:
    """The key/value pairs of a GGUF whose table is `layout` (ShardHeader.layout), decoded: arrays
    whole, numbers as numbers, strings as text. Validated already: read again only when asked."""
    start, end = layout["kv_start"], layout["kv_end"]
    raw = read(start, end - start)
    cursor = _Cursor(_only(raw), len(raw))
    pairs: dict[str, Any] = {}
    for _ in range(layout["kv_count"]):
        key = cursor.string("a key")
        kind = cursor.u32("a type")
        pairs[key] = _value(cursor, kind)
    return pairs


def _value(cursor: _Cursor, kind: int) -> Any:
    if kind in VALUE_SIZES:
        return struct.unpack("<" + VALUE_FORMATS[kind], cursor.take(VALUE_SIZES[kind], "a value"))[0]
    if kind == STRING:
        return _text(cursor)
    item = cursor.u32("an element type")
    count = cursor.u64("an array length")
    if item in VALUE_SIZES:
        return list(struct.unpack(f"<{count}{VALUE_FORMATS[item]}", cursor.take(count * VALUE_SIZES[item], "an array")))
    return [_text(cursor) for _ in range(count)]


def _text(cursor: _Cursor) -> str:
    return str(cursor.take(cursor.u64("a length"), "a string"), "utf-8")


def described_metadata(header: ShardHeader, read: Reader, into: Described) -> dict[str, Any]:
    """The key/value pairs, as far as they fit `into` (see described())."""
    return described(read, header.layout or {}, into)


def described(read: Reader, layout: dict[str, int], into: Described) -> dict[str, Any]:
    """The key/value pairs of a GGUF whose table is `layout`, as .tensorfs/metadata.json has them:
    decoded while they fit `into`; a string or array that does not fit summarized from its first
    elements, and one that cannot never decoded whole (a 100 MiB array is stepped over, not made a
    list of 100 million numbers); once a pair does not fit even so, the pairs from it on are left
    out (into.left_out). Validated already: read again, in growing pieces, only as far as the last
    pair looked at."""
    start, end = layout["kv_start"], layout["kv_end"]
    cursor = _Cursor(lambda offset, count: read(start + offset, count), end - start)
    pairs: dict[str, Any] = {}
    count = layout["kv_count"]
    try:
        for number in range(count):
            if int.from_bytes(cursor.take(8, "a key's length"), "little") + 2 > into.left:
                into.left_out += count - number  # not even the key fits: read no further
                break
            cursor.position -= 8
            key = cursor.string("a key")
            whole, summary = _described_value(cursor, cursor.u32("a type"), into.left)
            if whole is not None and into.add(pairs, key, whole):
                continue
            if summary is None or not into.add(pairs, key, summary):
                into.left_out += count - number
                break
    except _Fault as fault:  # the file changed since its table was validated
        raise ShardChangedError(f"its key/value pairs are no longer those validated: {fault.reason}") from None
    return pairs


def _described_value(cursor: _Cursor, kind: int, room: int) -> tuple[Any, dict[str, Any] | None]:
    """The value (None when it cannot fit in `room` bytes of JSON: then it is not decoded) and its
    summary (None for a number). A string's JSON takes at least its bytes; an array's at least 3
    bytes an element ("0, "), or its strings' bytes and 4 bytes each (quotes, ", ")."""
    if kind in VALUE_SIZES:
        return _value(cursor, kind), None
    if kind == STRING:
        length = cursor.u64("a string's length")
        raw = cursor.take(length, "a string")
        return str(raw, "utf-8") if length + 2 <= room else None, string_summary(_head(raw), length)
    item = cursor.u32("an element type")
    length = cursor.u64("an array's length")
    if item in VALUE_SIZES:
        size, shown = VALUE_SIZES[item], length if 3 * length <= room else min(length, SUMMARY_ITEMS)
        values = list(struct.unpack(f"<{shown}{VALUE_FORMATS[item]}", cursor.take(shown * size, "an array")))
        cursor.take((length - shown) * size, "an array")
        return values if shown == length else None, array_summary(VALUE_TYPE_NAMES[item], length, values)
    begin = cursor.position
    _skip_strings(cursor, length, "an array")
    after = cursor.position
    cursor.position = begin
    first = [_head(cursor.take(cursor.u64("a length"), "a string")) for _ in range(min(length, SUMMARY_ITEMS))]
    cursor.position = begin
    # Its JSON takes at least its strings' bytes and 4 each: what it takes here, less 4 each (of 8).
    whole = [_text(cursor) for _ in range(length)] if after - begin - 4 * length <= room else None
    cursor.position = after
    return whole, array_summary("STRING", length, first)


def _head(raw: memoryview) -> str:
    """The first SUMMARY_CHARACTERS characters of a string's bytes (a character cut at their end dropped)."""
    return str(raw[: 4 * SUMMARY_CHARACTERS], "utf-8", "ignore")[:SUMMARY_CHARACTERS]


def pairs(read: Reader, layout: dict[str, int]) -> list[tuple[str, bytes]]:
    """Each key/value pair of a GGUF whose table is `layout`, as its key and its bytes in the file
    (key, type, value): what a GGUF made of the file's tensors carries over as it is."""
    start, end = layout["kv_start"], layout["kv_end"]
    raw = read(start, end - start)
    cursor = _Cursor(_only(raw), len(raw))
    found: list[tuple[str, bytes]] = []
    for _ in range(layout["kv_count"]):
        begin = cursor.position
        key = cursor.string("a key")
        _skip_value(cursor, cursor.u32("a type"), "a value")
        found.append((key, raw[begin : cursor.position]))
    return found


def table(version: int, pairs: list[bytes], infos: list[tuple[str, list[int], DType, int]], alignment: int) -> bytes:
    """A GGUF's first bytes: magic, version, counts, the pairs (each as its bytes), the tensor infos
    (name, dimensions as stored, type, offset from the data's start), padded to `alignment` when
    there are tensors (as read_table has it)."""
    parts = [MAGIC, struct.pack("<IQQ", version, len(infos), len(pairs)), *pairs]
    for name, dims, dtype, offset in infos:
        parts += [encoded_string(name), struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, GGML_ID[dtype.name], offset)]
    head = b"".join(parts)
    return head + bytes(-len(head) % alignment) if infos else head  # no tensor, no data to align


def encoded_string(text: str) -> bytes:
    """A GGUF string: its length (u64), then its UTF-8."""
    encoded = text.encode("utf-8")
    return struct.pack("<Q", len(encoded)) + encoded


def split_files(name: str) -> list[str] | None:
    """The names of every file of the multi-file GGUF that `name` is one of (by gguf-split's naming);
    None when it is not named as one."""
    found = SPLIT_NAME.fullmatch(name)
    if found is None or int(found["count"]) < 1:
        return None
    count = int(found["count"])
    return [f"{found['prefix']}-{number:05d}-of-{count:05d}.gguf" for number in range(1, count + 1)]


def across_files(shards: list[tuple[str, ShardHeader]]) -> list[Problem]:
    """What is wrong across the files of one GGUF model (label and table of each, in name order):
    several files are one model only as the parts of a multi-file GGUF, numbered 0 to N-1 by
    split.no, each saying N in split.count, holding split.tensors.count tensors in all."""
    if len(shards) < 2 and all((header.layout or {}).get("split_count", 1) == 1 for _, header in shards):
        return []
    problems: list[Problem] = []
    total = sum(len(header.entries) for _, header in shards)
    for number, (label, header) in enumerate(shards):
        layout = header.layout or {}
        if "split_count" not in layout:
            why = "is not a part of a multi-file GGUF (no split.count): several GGUFs are several models"
            problems.append(Problem(label, f"{why}; name the one to open"))
            continue
        if layout["split_count"] != len(shards):
            problems.append(
                Problem(label, f"split.count says {layout['split_count']} files, and there are {len(shards)}")
            )
        if layout.get("split_no") != number:
            why = f"split.no is {layout.get('split_no')}, where this is part {number} (from 0) of the model"
            problems.append(Problem(label, why))
        if "split_tensors" in layout and layout["split_tensors"] != total:
            why = f"split.tensors.count says {layout['split_tensors']} tensors, and the files hold {total}"
            problems.append(Problem(label, why))
    return problems
