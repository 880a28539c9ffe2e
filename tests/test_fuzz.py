"""Differential testing against the reference reader: tensorfs rejects what it rejects, accepts
what it accepts unless one of tensorfs's documented stricter rules applies, and parses what both
accept into the same table (names, dtypes, shapes, offsets, bytes, `__metadata__`).

The normal suite runs a fixed number of deterministic cases; `make fuzz` runs many more
(TENSORFS_FUZZ_TIMES as many) from a fresh seed, which it says (helpers.fuzzing).
"""

from __future__ import annotations

import json
import random
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tensorfs
from helpers import (
    NAME_RULES,
    REFERENCE_DTYPES,
    Row,
    Table,
    compare_safe_open,
    fuzz_split,
    fuzzing,
    peak_of_opening,
    reference_accepts,
    reference_table,
    unexplained,
)
from tensorfs import InvalidModelError, TensorfsError
from tensorfs.errors import Problem
from tensorfs.formats.safetensors import _careful_parse, _fast_parse

# What tensorfs refuses on purpose though the reference accepts it (docs/guarantees.md, "What is checked").
# Not "not valid Unicode": the reference refuses a lone surrogate itself (escaped, invalid JSON to it;
# raw, invalid UTF-8), so tensorfs refusing one is never stricter.
STRICTER = {
    "a name given twice": r"appears more than once in the header",
    "a metadata key given twice": r"__metadata__ repeats the key '.*'",
    "a field given twice": r"repeats the field\(s\) .+",
    **{rule: pattern for rule, pattern in NAME_RULES.items() if rule != "a lone surrogate"},  # the reference refuses it
}

# The reference's own dtype names (helpers.REFERENCE_DTYPES, from the reference), and names it does
# not have: another case, a GGML type (tensorfs knows those, for GGUF), torch's and numpy's spellings.
BOGUS_DTYPES = ["F128", "u8", "f32", "Bf16", "", "Q4_0", "Q8_K", "F8_E4M3FN", "float32", "I4", "F32 "]
ONE_IN_EIGHTY = st.sampled_from([False] * 79 + [True])


# Names both readers take, and names that break a rule of one of them (or of tensorfs's tree).
GOOD_NAMES = st.one_of(
    st.sampled_from(["w", "model.layers.0.weight", "a/b", "a", "a/b/c", "x", "é/名", 'q"uote', "back\\slash"]),
    st.text(alphabet=st.characters(exclude_characters="/\0", exclude_categories=["Cs"]), min_size=1, max_size=12),
)
# Lone surrogates (and pairs of them, which are one character): JSON escapes them, or a raw one is not UTF-8.
SURROGATES = st.text(st.one_of(st.characters(categories=["Cs"]), st.sampled_from("ab.")), min_size=1, max_size=4)
ODD_NAMES = st.one_of(
    st.sampled_from(["x.sha256", "x.meta.json", ".tensorfs/x", "..", "", "a//b", "/abs", "\ud83d\ude00"]),
    st.text(min_size=0, max_size=12),
    st.text(alphabet='ab./\\\0\n"', min_size=1, max_size=6),
    st.one_of(SURROGATES, st.text(min_size=0, max_size=12)),
)
SHAPES = st.lists(st.integers(min_value=0, max_value=5), min_size=0, max_size=3)
# The weights below keep at least a third of the cases acceptable to both readers, so that most reach
# the comparison of parsed tables; the rest still cover every way to break a header.
REPEAT_A_KEY = st.sampled_from([False] * 5 + [True])
AFTER_THE_JSON = st.sampled_from([b"", b"  ", b" \r\n", b"", b"  ", b"\x00"])  # a NUL: invalid JSON
MUTATION_COUNT = st.sampled_from([0, 0, 0, 1, 2])
METADATA = st.one_of(
    st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    st.one_of(  # a value, or a key, with a surrogate
        st.dictionaries(st.text(max_size=4), SURROGATES, min_size=1, max_size=1),
        st.dictionaries(SURROGATES, st.text(max_size=4), min_size=1, max_size=1),
    ),
    st.none(),
    st.integers(),
    st.dictionaries(st.text(max_size=2), st.integers(), min_size=1, max_size=2),
)


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A header, valid or nearly so, and the data after it (random bytes, so that a tensor read
    from the wrong place shows)."""
    tensors: dict[str, Any] = {}
    offset = 0
    for _ in range(draw(st.integers(min_value=0, max_value=5))):
        # One odd name in ten, so that most headers stay acceptable to both.
        name = draw(ODD_NAMES if draw(st.integers(min_value=0, max_value=9)) == 9 else GOOD_NAMES)
        dtype = draw(st.sampled_from(BOGUS_DTYPES if draw(ONE_IN_EIGHTY) else sorted(REFERENCE_DTYPES)))
        bits = REFERENCE_DTYPES.get(dtype, 8)
        shape = draw(SHAPES)
        count = 1
        for dim in shape:
            count *= dim
        if count * bits % 8 and draw(st.sampled_from([True, True, False])):
            shape, count = [*shape, 4], count * 4  # F4 and F6 fill whole bytes in fours
        nbytes = count * bits // 8
        if name in tensors:
            continue  # (a name written twice is the repeated-key case below)
        tensors[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    items = list(tensors.items())
    rng = random.Random(draw(st.integers(min_value=0, max_value=2**16)))
    if draw(st.booleans()):  # writers need not list tensors in offset order
        rng.shuffle(items)
    document: dict[str, Any] = dict(items)
    if draw(st.booleans()):
        document["__metadata__"] = draw(METADATA)
    text = json.dumps(
        document, separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])), ensure_ascii=draw(st.booleans())
    )
    raw = text.encode("utf-8", "surrogatepass")
    if draw(REPEAT_A_KEY):  # written by hand since dicts cannot hold one
        raw = _repeat_first_key(raw)
    raw = draw(st.sampled_from([b"", b" ", b"\n\t"])) + raw + draw(AFTER_THE_JSON)
    return raw, rng.randbytes(offset)


def _repeat_first_key(raw: bytes) -> bytes:
    if not raw.startswith(b"{") or len(raw) < 3 or b"}" not in raw:
        return raw
    inner = raw[1:-1]
    return b"{" + inner + (b"," + inner if inner else b"") + b"}"


MUTATIONS = st.sampled_from(["flip", "truncate", "extend", "length", "replace", "insert", "delete"])


@st.composite
def shard_files(draw: st.DrawFn) -> bytes:
    header, data = draw(headers())
    content = bytearray(struct.pack("<Q", len(header)) + header + data)
    for _ in range(draw(MUTATION_COUNT)):
        mutation = draw(MUTATIONS)
        if not content:
            break
        at = draw(st.integers(min_value=0, max_value=len(content) - 1))
        if mutation == "flip":
            content[at] ^= 1 << draw(st.integers(min_value=0, max_value=7))
        elif mutation == "truncate":
            del content[at:]
        elif mutation == "extend":
            content += draw(st.binary(min_size=1, max_size=9))
        elif mutation == "length":
            delta = draw(st.integers(min_value=-9, max_value=9))
            length = (
                max(0, struct.unpack("<Q", bytes(content[:8]).ljust(8, b"\0"))[0] + delta) if len(content) >= 8 else 0
            )
            content[:8] = struct.pack("<Q", length)
        elif mutation == "replace":
            new = draw(
                st.sampled_from(
                    [
                        b"0",
                        b"9",
                        b"-",
                        b"1.5",
                        b'"',
                        b"{}",
                        b"[]",
                        b"null",
                        b"1e3",
                        b"F32",
                        b"u8",
                        b"18446744073709551616",
                        b"1e400",
                        b'"\\ud800"',
                    ]
                )
            )
            content[at : at + 1] = new
        elif mutation == "insert":
            content[at:at] = draw(st.sampled_from([b" ", b",", b'"x":1,', b"\\u0000", b"\xff", b"[[[[[[[["]))
        elif mutation == "delete":
            del content[at : at + draw(st.integers(min_value=1, max_value=4))]
    return bytes(content)


def model_table(model: tensorfs.Model) -> Table:
    """A one-shard model as tensorfs parsed it, each tensor's bytes read through the model."""
    (shard,) = model.shards
    tensors: dict[str, Row] = {}
    for name in model:
        info = model.info(name)
        tensors[name] = (info.dtype, list(info.shape), info.data_offsets, bytes(model.raw(name)))
    return tensors, model.shard_header(shard).metadata


WAYS = ("both accept", "both reject", "tensorfs stricter", "reference stricter")
"""How a case can go ("reference stricter" never shows: any such case has failed the test already)."""


def verdicts(path: Path, content: bytes, opening: Callable[[Path], Any]) -> tuple[str, Any]:
    """Write one shard's `content` to `path`, and have it opened by the reference and by tensorfs
    (`opening`, which raises InvalidModelError when tensorfs refuses): which way the case went, and
    what `opening` gave. What the reference refuses tensorfs refuses; what tensorfs alone refuses
    breaks one of its documented stricter rules."""
    path.write_bytes(content)
    reference = reference_accepts(path)
    try:
        opened = opening(path)
    except InvalidModelError as exc:
        if not reference:
            return "both reject", None
        unexplained_ones = unexplained(exc.problems, STRICTER)
        assert not unexplained_ones, f"rejected without a stricter rule: {unexplained_ones} for {content[:200]!r}"
        return "tensorfs stricter", None
    except TensorfsError as exc:  # pragma: no cover - would be a bug in the error types
        raise AssertionError(f"an error other than InvalidModelError: {exc!r}") from exc
    assert reference, f"tensorfs accepts what the reference rejects: {content[:200]!r}"
    return "both accept", opened


def opened_table(path: Path) -> Table:
    with tensorfs.open_model(path) as model:
        return model_table(model)


@pytest.mark.fuzz
def test_tensorfs_agrees_with_the_reference(tmp_path: Path, record_property: Any) -> None:
    """open_model's table of each fuzzed shard against the reference reader's."""
    split: Counter[str] = Counter()
    path = tmp_path / "case.safetensors"

    @fuzzing(5000)
    @given(shard_files())
    def case(content: bytes) -> None:
        way, table = verdicts(path, content, opened_table)
        if way == "both accept":
            assert table == reference_table(path), f"tensorfs parses differently from the reference: {content[:300]!r}"
            fast[fast_path_agrees(content)] += 1
        split[way] += 1

    fast: Counter[bool] = Counter()
    case()
    shares = fuzz_split(split, WAYS, f"; of those both accept, the fast path took {fast[True]}")
    record_property("fuzz_split", dict(split))
    # At least a third of the cases must reach the comparison of tables, not stop at a rejection.
    assert split["both accept"] * 3 >= split.total() and split["both reject"], shares
    assert fast[True] * 4 >= split["both accept"], shares  # the fast path is compared with the careful one


def fast_path_agrees(content: bytes) -> bool:
    """The header of a shard both readers accept, parsed by the careful path (every rule, no problem
    found) and by the fast one, which may decline: whether it took it (and then, agreeing)."""
    raw = content[8 : 8 + int.from_bytes(content[:8], "little")]
    problems: list[Problem] = []
    careful = _careful_parse(raw, "case", problems)
    assert problems == [], problems
    fast = _fast_parse(raw)
    if fast is None:
        return False
    assert sorted(fast[0]) == sorted(careful[0]) and fast[1] == careful[1], f"the paths differ on {raw!r}"
    return True


@pytest.mark.fuzz
def test_safe_open_agrees_with_the_reference(tmp_path: Path, record_property: Any) -> None:
    """tensorfs.safe_open against the reference's safe_open on the same fuzzed shards, in a framework
    drawn: refused alike, and what both open the same in every way compare_safe_open looks."""
    split: Counter[str] = Counter()
    path = tmp_path / "case.safetensors"

    @fuzzing(300)
    @given(shard_files(), st.sampled_from(["np", "pt"]))
    def case(content: bytes, framework: str) -> None:
        way, _ = verdicts(path, content, lambda path: tensorfs.safe_open(path, framework, cache=False).close())
        if way == "both accept":
            compare_safe_open(path, framework, cache=False)
        split[way] += 1

    case()
    shares = fuzz_split(split, WAYS)
    record_property("fuzz_split", dict(split))
    # A quarter at least reach the comparison (fewer cases than above: the share varies more).
    assert split["both accept"] * 4 >= split.total() and split["both reject"], shares


@pytest.mark.parametrize(
    "content",
    [
        b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # deeply nested
        b'{"a":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}',  # a huge integer
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + b"{" * 3000 + b"}" * 3000 + b"}}",
    ],
)
def test_hostile_headers_are_refused_cleanly(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "hostile.safetensors"
    path.write_bytes(struct.pack("<Q", len(content)) + content + b"x")
    assert not reference_accepts(path)
    with pytest.raises(InvalidModelError):
        tensorfs.open_model(path)


def tiny_tensors_shard(path: Path, count: int) -> int:
    """A shard of `count` one-byte tensors with short names (the largest header per tensor); its header's length."""
    entries = ",".join(f'"{i:x}":{{"dtype":"U8","shape":[1],"data_offsets":[{i},{i + 1}]}}' for i in range(count))
    header = ("{" + entries + "}").encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + count)
    return len(header)


def test_a_million_tiny_tensors_parse_in_linear_memory(tmp_path: Path) -> None:
    cost = {}  # peak bytes a tensor, at a quarter of a million and at a million
    for count in (250_000, 1_000_000):
        header_length = tiny_tensors_shard(tmp_path / f"{count}.safetensors", count)
        assert header_length < 100_000_000  # the largest header there may be
        tensors, nbytes, peak_kib = peak_of_opening(tmp_path / f"{count}.safetensors")
        assert (tensors, nbytes) == (count, count)
        cost[count] = peak_kib * 1024 / count
    assert cost[1_000_000] < 1536, cost  # at the worst moment (the parse), under 1.5 KiB a tensor
    # Linear: a tensor costs no more among a million than among a quarter of a million (whose cost
    # also carries the fixed part, so more-than-linear growth could only raise the ratio).
    assert cost[1_000_000] < 1.1 * cost[250_000], cost
