"""safetensors: a file's first bytes -> its validated table (ShardHeader), by the reference reader's rules.

Pure: it reads what it is given and nothing else, and keeps no state. Every rule of the
safetensors reference reader (0.8) is applied, plus tensorfs's own: duplicate JSON keys are errors.
Tensor names are checked as paths elsewhere (utils/names.py), since that needs the whole model.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from itertools import chain
from math import prod
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import orjson

from ..errors import InvalidModelError, Problem, printable
from ..utils.gcpause import gc_paused
from ..utils.identity import ShardKey
from .dtypes import DTYPES, DType
from .table import BEGIN, END, SHAPE, Described, Entry, ShardHeader, shape_text

if TYPE_CHECKING:
    from .table import Reader

MAX_HEADER_BYTES = 100_000_000
"""The reference reader's limit on the JSON header's length (rule 2)."""

_U64_END = 1 << 64  # the reference computes in usize: anything at or past this overflows
_FIELDS = ("dtype", "shape", "data_offsets")
_FIELD_GETTER = itemgetter(*_FIELDS)
_EMPTY_OBJECT = re.compile(r"\{[ \t\n\r]*\}")
_SPACE_BEFORE_COLON = (b" :", b"\t:", b"\n:", b"\r:")
_MAX_DEPTH = 127  # containers nested in one another: the most the reference reader accepts
_UNKNOWN_DTYPE = DType("?", 0, None)  # stands in only in headers that are about to be rejected


NAME = "safetensors"
SUFFIXES: tuple[str, ...] = (".safetensors",)
"""The names its files are found by in a directory or a listing (content decides what a file is)."""


def sniff(first: bytes, name: str) -> bool:
    """safetensors has no magic bytes: it takes what no other format claims (see formats/)."""
    return True


def read_table(read: Reader, size: int, path: ShardKey, label: str) -> ShardHeader:
    """The validated table of the safetensors file at `path` (`size` bytes, shown as `label`), its
    bytes had from `read(offset, count)`: the 8-byte length, then the header. Tensor data is never
    read. InvalidModelError listing every problem found."""
    length = header_length(read(0, 8) if size >= 8 else b"", size, label)
    raw = read(8, length)
    if len(raw) != length:
        raise InvalidModelError([Problem(label, "the header's bytes did not all come")])
    return parse_header(raw, path, size, label)


def across_files(shards: list[tuple[str, ShardHeader]]) -> list[Problem]:
    """Nothing beyond what every format's files are held to (unique names, the index)."""
    return []


def file_metadata(header: ShardHeader, read: Reader) -> dict[str, str] | None:
    """What the file says of itself: its header's `__metadata__` (None when it has none)."""
    return header.metadata


def described_metadata(header: ShardHeader, read: Reader, into: Described) -> dict[str, Any] | None:
    """The header's `__metadata__`, as far as it fits `into`."""
    return into.of(header.metadata)


def fits(begins: list[int], ends: list[int], data_start: int, size: int, layout: object) -> bool:
    """Whether tensors at these offsets fill a file of `size` bytes whose data starts at `data_start`,
    as rules 6 and 10 have it (C-speed comparisons of the columns)."""
    return begins[:1] in ([], [0]) and begins[1:] == ends[:-1] and data_start + (ends or [0])[-1] == size


def table_bytes(first: bytes, size: int) -> int:
    """How many of a file's first bytes its table takes: 8 + the header's length, once `first` holds
    the 8 bytes that say it (as few as there are, for a length to be refused)."""
    if len(first) < 8:
        return len(first)
    length = int.from_bytes(first[:8], "little")
    if length > MAX_HEADER_BYTES or 8 + length > size:
        return min(len(first), 8)  # refused by its length alone: no more is read
    return 8 + length


def plausible(first: bytes, size: int) -> bool:
    """Whether a file of `size` bytes beginning `first` (its first 8 at least, if it has them) could
    be a safetensors file: its length fits the file and the limit (a file of another name told from
    a text file, formats/)."""
    if len(first) < 8:
        return False
    length = int.from_bytes(first[:8], "little")
    return length <= MAX_HEADER_BYTES and 8 + length <= size


def header_length(prefix: bytes, size: int, label: str) -> int:
    """The header's length from the shard's first 8 bytes, checked against the shard's size (rules 1-3)."""
    if size < 8:
        raise InvalidModelError([Problem(label, f"file is {size} bytes, too short to hold the 8-byte header length")])
    length = int.from_bytes(prefix[:8], "little")
    if length > MAX_HEADER_BYTES:
        raise InvalidModelError(
            [Problem(label, f"header length {length} is over the limit of {MAX_HEADER_BYTES:,} bytes")]
        )
    if 8 + length > size:
        raise InvalidModelError(
            [Problem(label, f"header length {length} runs past the end of the file ({size} bytes)")]
        )
    return length


def parse_header(raw: bytes, path: ShardKey, file_size: int, label: str | None = None) -> ShardHeader:
    """Validate `raw`, the header bytes of the shard at `path` whose size is `file_size`.

    A fast path proves the common valid header valid; anything it cannot prove valid is parsed
    again by the careful path, which applies every rule and says everything that is wrong.
    """
    label = str(path) if label is None else label
    data_start = 8 + len(raw)
    data_size = file_size - data_start
    fast = _fast_parse(raw)
    if fast is not None:
        entries, metadata = fast
        end = _contiguous_end(entries)
        if end is None:  # writers usually list tensors in offset order; sort only when they did not
            entries.sort()
            end = _contiguous_end(entries)
        if end == data_size:
            return ShardHeader(path, file_size, data_start, entries, metadata)
    problems: list[Problem] = []
    entries, metadata = _careful_parse(raw, label, problems)
    # Rule 6: in offset order, each tensor starts where the previous ended, the first at 0.
    entries.sort()  # by offsets: (begin, end, name) are unique, so the dtype is never compared
    end = _contiguous_end(entries)
    if end is None:
        _explain_offsets(entries, label, problems)
    elif end != data_size:  # rule 10: the data ends exactly where the file does
        problems.append(
            Problem(label, f"tensor data ends at byte {end} but the file has {data_size} bytes after the header")
        )
    if problems:
        raise InvalidModelError(problems)
    return ShardHeader(path, file_size, data_start, entries, metadata)


def _fast_parse(raw: bytes) -> tuple[list[Entry], dict[str, str] | None] | None:
    """The entries of a well-formed header, or None when it is not plainly well-formed.

    orjson parses several times faster than json but keeps one of two repeated keys silently.
    So repeats are ruled out by counting: with no escaped quote and no space before a colon in
    the text, every key is followed by exactly one `":`, and nothing else is; if the count equals
    the keys parsed at every level, no key was repeated.
    """
    if not _plainly_countable(raw):
        return None
    try:
        top = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(top) is not dict:
        return None
    keys = len(top)
    metadata = top.pop("__metadata__", None)
    if metadata is not None:
        if type(metadata) is not dict or any(type(v) is not str for v in metadata.values()):
            return None
        keys += len(metadata)
    entries: list[Entry] = []
    append = entries.append
    fields = _FIELD_GETTER
    dtypes = DTYPES
    u64_end = _U64_END
    try:
        for name, entry in top.items():
            if type(entry) is not dict or len(entry) != 3:
                return None
            dtype_name, shape, offsets = fields(entry)
            dtype = dtypes[dtype_name]
            begin, end = offsets
            if type(begin) is not int or type(end) is not int or type(shape) is not list:
                return None
            bits = prod(shape) * dtype.bits
            if bits >= u64_end or bits & 7 or bits >> 3 != end - begin:
                return None
            append((begin, end, name, dtype, shape))
    except (KeyError, TypeError, ValueError):
        return None  # a field missing or of the wrong kind
    # The dimensions, checked over all entries at once (offsets need no range check here: the
    # caller proves them contiguous from 0 to the end of the file).
    dims = list(chain.from_iterable([entry[SHAPE] for entry in entries]))
    if not set(map(type, dims)) <= {int} or min(dims, default=1) <= 0:
        return None  # a 0 needs the reference's overflow order: the careful path has it
    if raw.count(b'":') != keys + 3 * len(entries):
        return None
    return entries, metadata


def _plainly_countable(raw: bytes) -> bool:
    """Whether every `":` in `raw` ends a key: no escaped quote, no space before a colon, no "-0".

    Single bytes are searched first: that is a memchr, many times faster than a two-byte search.
    """
    if b"\\" in raw and b'\\"' in raw:
        return False
    if b"-" in raw and b"-0" in raw:
        return False  # the reference rejects "-0" as a float; orjson reads the integer 0
    end = len(raw.rstrip(b" \t\n\r"))  # writers pad the header with trailing spaces
    for space in _SPACE_BEFORE_COLON:
        if raw.find(space[:1], 0, end) != -1 and space in raw:
            return False
    return True


def _contiguous_end(entries: list[Entry]) -> int | None:
    """Where the data of `entries` (sorted by offsets) ends, or None when they leave a gap or overlap."""
    end = 0
    for entry in entries:
        if entry[BEGIN] != end:
            return None
        end = entry[END]
    return end


def _careful_parse(raw: bytes, label: str, problems: list[Problem]) -> tuple[list[Entry], dict[str, str] | None]:
    """Apply every rule but 6 and 10 to the header, adding what is wrong to `problems`."""

    def fail(reason: str) -> InvalidModelError:
        return InvalidModelError([Problem(label, reason)])

    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(f"header is not valid UTF-8 (at byte {exc.start} of the header)") from None
    top_pairs = _decode_json(text, fail)
    if not _is_object(top_pairs):
        raise fail("header is not a JSON object")
    top: dict[str, Any] = dict(top_pairs)
    if len(top) != len(top_pairs):
        for name in _repeated_keys(top_pairs):
            problems.append(Problem(label, "appears more than once in the header", name))
    metadata: dict[str, str] | None = None
    if "__metadata__" in top:
        metadata = _check_metadata(top.pop("__metadata__"), label, problems)
    entries: list[Entry] = []
    for name, entry in top.items():
        checked = _check_entry(name, entry, label, problems)
        if checked is not None:
            entries.append(checked)
    return entries, metadata


def _explain_offsets(entries: list[Entry], label: str, problems: list[Problem]) -> None:
    """Say, for each tensor, how its offsets break rule 6 (entries sorted by offsets)."""
    end_so_far = 0
    for begin, end, name, _, _ in entries:
        where = f"data_offsets [{begin}, {end}]"
        if begin > end_so_far:
            after = "the start of the data" if end_so_far == 0 else f"the tensor before it ends at {end_so_far}"
            problems.append(Problem(label, f"{where} leave a gap after {after}", name))
        elif begin < end_so_far:
            problems.append(Problem(label, f"{where} overlap the tensor before it, which ends at {end_so_far}", name))
        end_so_far = end


class _Object(list):  # type: ignore[type-arg]
    """A JSON object's (key, value) pairs, used only where `{}` and `[]` must be told apart."""

    __slots__ = ()


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _parse_int(digits: str) -> int:
    # The reference reads "-0" as the float -0.0, which no integer field accepts; -1 fails just the same.
    return -1 if digits.startswith("-") else int(digits)


def _decode_json(text: str, fail: Any) -> Any:
    """Parse JSON keeping every object as a list of (key, value) pairs, so repeated keys are seen.

    Objects come back as plain lists, which is the fast path; only when the text holds an empty
    object, which would look like an empty array, are they wrapped in _Object instead.
    """
    hook = list if _EMPTY_OBJECT.search(text) is None else _Object
    parse_int = _parse_int if "-0" in text else None
    try:
        with gc_paused():
            return json.loads(text, object_pairs_hook=hook, parse_int=parse_int, parse_constant=_reject_constant)
    except RecursionError:
        raise fail("header is not valid JSON: nested too deeply") from None
    except ValueError as exc:
        raise fail(f"header is not valid JSON: {exc}") from None


def _is_object(value: Any) -> bool:
    # Pairs are tuples, and a JSON array never holds a tuple.
    return type(value) is _Object or (type(value) is list and len(value) > 0 and type(value[0]) is tuple)


def _repeated_keys(pairs: list[tuple[str, Any]]) -> list[str]:
    """The keys that appear more than once, in the order of their first repeat (linear: a header of
    a million repeated keys is told in a second, not a day)."""
    seen: set[str] = set()
    repeated: dict[str, None] = {}
    for key, _ in pairs:
        if key in seen:
            repeated[key] = None
        else:
            seen.add(key)
    return list(repeated)


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_metadata(value: Any, label: str, problems: list[Problem]) -> dict[str, str] | None:
    if value is None:
        return None
    if not _is_object(value):
        problems.append(Problem(label, "__metadata__ must be a JSON object of strings"))
        return None
    metadata = dict(value)
    if len(metadata) != len(value):
        for key in _repeated_keys(value):
            problems.append(Problem(label, f"__metadata__ repeats the key '{printable(key)}'"))
    for key, item in metadata.items():
        if type(item) is not str:
            problems.append(Problem(label, f"__metadata__ value of '{printable(key)}' is not a string"))
        elif not (_is_utf8(key) and _is_utf8(item)):
            problems.append(Problem(label, f"__metadata__ entry '{printable(key)}' is not valid Unicode"))
    return metadata


def _check_entry(name: str, entry: Any, label: str, problems: list[Problem]) -> Entry | None:
    """Check one tensor, saying what is wrong; return its entry when its offsets are well-formed."""
    if not _is_object(entry):
        problems.append(Problem(label, "must be a JSON object with dtype, shape and data_offsets", name))
        return None
    fields = dict(entry)
    ok = True
    if not _is_utf8(name):  # an escaped lone surrogate: JSON to Python, not to the reference (serde_json)
        problems.append(Problem(label, "name is not valid Unicode (it holds a lone surrogate)", name))
    if len(fields) != len(entry):
        problems.append(Problem(label, f"repeats the field(s) {', '.join(_repeated_keys(entry))}", name))
        ok = False
    for field, value in fields.items():
        # Fields other than the three are ignored, but the reference parses them: what serde_json
        # refuses there (nesting past its limit, lone surrogates, numbers past f64) it refuses.
        if field not in _FIELDS:
            reason = _unparsable_by_reference(field, value)
            if reason is not None:
                problems.append(Problem(label, f"field '{printable(field)}' {reason}", name))
                ok = False
    missing = [f for f in _FIELDS if f not in fields]
    if missing:
        problems.append(Problem(label, f"has no {' or '.join(missing)}", name))
        return None
    dtype_name = fields["dtype"]
    dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        shown = printable(json.dumps(dtype_name, ensure_ascii=False))
        problems.append(Problem(label, f"unknown dtype {shown} (dtype names are case-sensitive, e.g. F32, BF16)", name))
        ok = False
    shape = fields["shape"]
    if type(shape) is not list or not all(type(d) is int and 0 <= d < _U64_END for d in shape):
        problems.append(Problem(label, "shape must be a list of non-negative integers", name))
        ok = False
    offsets = fields["data_offsets"]
    offsets_ok = (
        type(offsets) is list and len(offsets) == 2 and all(type(o) is int and 0 <= o < _U64_END for o in offsets)
    )
    if not offsets_ok:
        problems.append(Problem(label, "data_offsets must be a list of two non-negative integers", name))
    if offsets_ok and offsets[1] < offsets[0]:
        problems.append(Problem(label, f"data_offsets [{offsets[0]}, {offsets[1]}] end before they begin", name))
        return None
    if ok and dtype is not None and offsets_ok:
        nbytes = _nbytes(shape, dtype, name, label, problems)
        if nbytes is not None and nbytes != offsets[1] - offsets[0]:
            problems.append(
                Problem(
                    label,
                    f"data_offsets [{offsets[0]}, {offsets[1]}] hold {offsets[1] - offsets[0]} bytes "
                    f"but {dtype.name} {shape_text(shape)} needs {nbytes}",
                    name,
                )
            )
    # Offsets that are well-formed take part in the rule-6 check even when the rest is wrong,
    # so that one bad tensor does not also make its neighbours look misplaced.
    if not offsets_ok:
        return None
    return offsets[0], offsets[1], name, dtype or _UNKNOWN_DTYPE, shape


def _unparsable_by_reference(field: str, value: Any) -> str | None:
    if 2 + _depth(value) > _MAX_DEPTH:
        return f"nests deeper than {_MAX_DEPTH} levels"
    for leaf in _leaves((field, value)):
        if type(leaf) is float and not math.isfinite(leaf):
            return "holds a number too large for a 64-bit float"
        if type(leaf) is str and not _is_utf8(leaf):
            return "holds a string that is not valid Unicode (a lone surrogate)"
    return None


def _leaves(value: Any) -> Iterator[Any]:
    """Every key and scalar inside a parsed JSON value (objects are lists of pairs here), in order.

    With a stack, not nested generators: each leaf costs the same however deep it is (a generator
    a level would pass each of a wide array's leaves up through all 127 of them).
    """
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, list | tuple):
            stack.extend(reversed(item))
        else:
            yield item


def _depth(value: Any) -> int:
    """How many containers deep a parsed JSON value goes (an object is a list of pairs here).

    With a stack, not recursion: json parses arrays nested several hundred deep, deeper than
    Python's stack takes a recursive walk of them."""
    deepest = 0
    pending = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if type(item) is tuple:  # a (key, value) pair inside an object: no level of its own
            item = item[1]
        if isinstance(item, list):
            deepest = max(deepest, depth + 1)
            pending += [(child, depth + 1) for child in item if isinstance(child, list | tuple)]
    return deepest


def _nbytes(shape: list[int], dtype: DType, name: str, label: str, problems: list[Problem]) -> int | None:
    """Rules 7 and 8: the byte size of `shape` x `dtype`, computed as the reference does."""
    count = 1
    for dim in shape:
        count *= dim
        if count >= _U64_END:  # the reference multiplies in order, so overflow before a 0 still counts
            problems.append(
                Problem(label, f"shape {shape_text(shape)} has too many elements (overflows 64 bits)", name)
            )
            return None
    bits = count * dtype.bits
    if bits >= _U64_END:
        problems.append(Problem(label, f"shape {shape_text(shape)} of {dtype.name} overflows 64 bits in size", name))
        return None
    if bits % 8:
        problems.append(
            Problem(label, f"{count} elements of {dtype.name} ({dtype.bits} bits each) do not fill whole bytes", name)
        )
        return None
    return bits // 8
