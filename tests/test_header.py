"""Every safetensors rule, broken one at a time by a hand-made file, against tensorfs and the reference."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from helpers import REFERENCE_DTYPES, entry, header_table, reference_accepts, reference_table
from tensorfs import InvalidModelError
from tensorfs.formats.dtypes import DTYPES
from tensorfs.formats.safetensors import MAX_HEADER_BYTES, _careful_parse, _fast_parse
from tensorfs.sources.local import read_shard_header

U8_A = {"a": entry("U8", [1], 0, 1)}

# (id, header bytes or object, data, declared header length or None, words the message must hold)
REJECTED = [
    ("rule1-short-file", None, b"", None, "too short to hold the 8-byte header length"),
    ("rule2-header-too-long", b"{}", b"", MAX_HEADER_BYTES + 1, "over the limit of 100,000,000 bytes"),
    ("rule3-header-past-eof", b"{}", b"", 50, "runs past the end of the file"),
    ("rule3-header-length-huge", b"{}", b"", 2**64 - 1, "over the limit"),
    ("rule4-not-utf8", b'{"\xff":{}}', b"", None, "not valid UTF-8"),
    ("rule5-not-json", b"{not json}", b"", None, "not valid JSON"),
    ("rule5-empty-header", b"", b"", None, "not valid JSON"),
    ("rule5-array", b"[]", b"", None, "not a JSON object"),
    ("rule5-trailing-nul", b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}\x00', b"x", None, "not valid JSON"),
    ("rule5-bom", b"\xef\xbb\xbf{}", b"", None, "not valid JSON"),
    ("rule5-formfeed", b"\x0c{}", b"", None, "not valid JSON"),
    ("rule5-nan", b'{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}', b"x", None, "not valid JSON"),
    ("rule5-entry-not-object", {"a": "U8"}, b"", None, "must be a JSON object with dtype, shape and data_offsets"),
    ("rule5-entry-array", {"a": []}, b"", None, "must be a JSON object"),
    ("rule5-entry-empty-object", {"a": {}}, b"", None, "has no dtype or shape or data_offsets"),
    ("rule5-missing-shape", {"a": {"dtype": "U8", "data_offsets": [0, 1]}}, b"x", None, "has no shape"),
    ("rule5-unknown-dtype", {"a": entry("F128", [1], 0, 1)}, b"x", None, 'unknown dtype "F128"'),
    ("rule5-dtype-wrong-case", {"a": entry("u8", [1], 0, 1)}, b"x", None, 'unknown dtype "u8"'),
    (
        "rule5-dtype-not-string",
        {"a": {"dtype": 8, "shape": [1], "data_offsets": [0, 1]}},
        b"x",
        None,
        "unknown dtype 8",
    ),
    ("rule5-shape-float", b'{"a":{"dtype":"U8","shape":[1.0],"data_offsets":[0,1]}}', b"x", None, "shape must be"),
    ("rule5-shape-negative", {"a": entry("U8", [-1], 0, 1)}, b"x", None, "shape must be"),
    ("rule5-shape-minus-zero", b'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}', b"", None, "shape must be"),
    ("rule5-shape-bool", {"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, b"x", None, "shape must be"),
    ("rule5-shape-null", {"a": {"dtype": "U8", "shape": None, "data_offsets": [0, 1]}}, b"x", None, "shape must be"),
    ("rule5-shape-object", b'{"a":{"dtype":"U8","shape":{},"data_offsets":[0,1]}}', b"x", None, "shape must be"),
    ("rule5-shape-past-u64", {"a": entry("U8", [2**64], 0, 1)}, b"x", None, "shape must be"),
    (
        "rule5-offsets-three",
        {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 2]}},
        b"x",
        None,
        "two non-negative",
    ),
    ("rule5-offsets-float", b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1.0]}}', b"x", None, "two non-negative"),
    ("rule5-metadata-not-map", {"__metadata__": ["x"]}, b"", None, "__metadata__ must be a JSON object of strings"),
    ("rule5-metadata-empty-array", b'{"__metadata__":[]}', b"", None, "__metadata__ must be a JSON object"),
    ("rule5-metadata-int-value", {"__metadata__": {"k": 1}}, b"", None, "__metadata__ value of 'k' is not a string"),
    (
        "rule5-metadata-repeated",
        b'{"__metadata__":{"k":"v"},"__metadata__":{"k":"v"}}',
        b"",
        None,
        "appears more than once",
    ),
    (
        "rule5-field-repeated",
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"dtype":"U8"}}',
        b"x",
        None,
        "repeats the field(s) dtype",
    ),
    (
        "rule5-extra-field-too-deep",
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + b"[" * 126 + b"]" * 126 + b"}}",
        b"x",
        None,
        "nests deeper than 127 levels",
    ),
    (
        "rule5-extra-object-too-deep",
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + b'{"k":' * 126 + b"1" + b"}" * 126 + b"}}",
        b"x",
        None,
        "nests deeper than 127 levels",
    ),
    (  # as deep as json parses: deeper than a recursive walk of it takes (a RecursionError, once)
        "rule5-extra-field-600-deep",
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + b"[" * 600 + b"]" * 600 + b"}}",
        b"x",
        None,
        "nests deeper than 127 levels",
    ),
    (
        "rule5-extra-object-600-deep",
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + b'[{"k":' * 300 + b"1" + b"}]" * 300 + b"}}",
        b"x",
        None,
        "nests deeper than 127 levels",
    ),
    (
        "rule5-extra-number-too-large",
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":[1e400]}}',
        b"x",
        None,
        "holds a number too large",
    ),
    (
        "rule5-extra-lone-surrogate",
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":{"\\ud800":1}}}',
        b"x",
        None,
        "not valid Unicode",
    ),
    (
        "rule5-name-lone-surrogate",
        b'{"a\\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        b"x",
        None,
        "not valid Unicode (it holds a lone surrogate)",
    ),
    (
        "rule5-name-lone-low-surrogate",
        b'{"\\udc00a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        b"x",
        None,
        "not valid Unicode",
    ),
    (
        "rule5-name-reversed-pair",
        b'{"\\ude00\\ud83d":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}',
        b"x",
        None,
        "not valid Unicode",
    ),
    (
        "rule5-metadata-value-lone-surrogate",
        b'{"__metadata__":{"k":"v\\udc00"}}',
        b"",
        None,
        "__metadata__ entry 'k' is not valid Unicode",
    ),
    ("rule5-metadata-key-lone-surrogate", b'{"__metadata__":{"k\\ud800":"v"}}', b"", None, "is not valid Unicode"),
    (
        "rule4-raw-surrogate-in-a-name",
        '{"a\ud800":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'.encode("utf-8", "surrogatepass"),
        b"x",
        None,
        "not valid UTF-8",
    ),
    ("rule5-ggml-dtype", {"a": entry("Q4_0", [32], 0, 18)}, bytes(18), None, 'unknown dtype "Q4_0"'),
    ("rule6-gap-at-start", {"a": entry("U8", [1], 1, 2)}, b"xy", None, "leave a gap after the start of the data"),
    (
        "rule6-gap-between",
        {"a": entry("U8", [1], 0, 1), "b": entry("U8", [1], 2, 3)},
        b"xyz",
        None,
        "leave a gap after the tensor before it ends at 1",
    ),
    (
        "rule6-overlap",
        {"a": entry("U8", [2], 0, 2), "b": entry("U8", [1], 1, 2)},
        b"xy",
        None,
        "overlap the tensor before it, which ends at 2",
    ),
    (
        "rule6-end-before-begin",
        {"a": entry("U8", [0], 1, 0), "b": entry("U8", [1], 0, 1)},
        b"x",
        None,
        "end before they begin",
    ),
    ("rule7-overflow", {"a": entry("U8", [2**32, 2**32], 0, 1)}, b"x", None, "too many elements (overflows 64 bits)"),
    ("rule7-overflow-before-zero", {"a": entry("U8", [2**32, 2**32, 0], 0, 0)}, b"", None, "too many elements"),
    ("rule7-bits-overflow", {"a": entry("F64", [2**61], 0, 0)}, b"", None, "overflows 64 bits in size"),
    ("rule8-f4-half-byte", {"a": entry("F4", [3], 0, 2)}, b"xy", None, "do not fill whole bytes"),
    ("rule8-f6-partial", {"a": entry("F6_E2M3", [3], 0, 3)}, b"xyz", None, "do not fill whole bytes"),
    (
        "rule9-size-mismatch",
        {"a": entry("F32", [2, 2], 0, 12)},
        bytes(12),
        None,
        "hold 12 bytes but F32 [2, 2] needs 16",
    ),
    ("rule10-trailing-data", U8_A, b"xy", None, "tensor data ends at byte 1 but the file has 2 bytes after the header"),
    (
        "rule10-missing-data",
        {"a": entry("U8", [4], 0, 4)},
        b"xy",
        None,
        "tensor data ends at byte 4 but the file has 2",
    ),
    ("rule10-empty-header-with-data", b"{}", b"x", None, "tensor data ends at byte 0 but the file has 1"),
]

# Valid by the reference (and by tensorfs): the edges of the rules.
ACCEPTED = [
    ("empty-object", b"{}", b""),
    ("leading-and-trailing-whitespace", b' \n\t{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}\r\n  ', b"x"),
    ("spaces-everywhere", b'{ "a" : { "dtype" : "U8" , "shape" : [ 1 ] , "data_offsets" : [ 0 , 1 ] } }', b"x"),
    ("metadata-null", b'{"__metadata__":null,"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
    ("metadata-empty", b'{"__metadata__":{}}', b""),
    ("metadata-map", {"__metadata__": {"format": "pt", "": ""}}, b""),
    ("extra-field-ignored", b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":[1,{"x":2}]}}', b"x"),
    (
        "extra-field-as-deep-as-allowed",
        b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"x":' + b"[" * 125 + b"]" * 125 + b"}}",
        b"x",
    ),
    ("fields-in-any-order", b'{"a":{"data_offsets":[0,1],"shape":[1],"dtype":"U8"}}', b"x"),
    ("zero-d", {"a": entry("F32", [], 0, 4)}, bytes(4)),
    ("empty-tensor", {"a": entry("F32", [0, 3], 0, 0)}, b""),
    # [0, 2**32, 2**32] too, but numpy and torch cannot make it: tensorfs refuses it (test_loader.py)
    ("zero-before-large-dimensions", {"a": entry("U8", [0, 2**31, 2**31], 0, 0)}, b""),
    ("empty-tensors-share-offsets", {"a": entry("U8", [0], 0, 0), "b": entry("U8", [1], 0, 1)}, b"x"),
    ("offsets-out-of-key-order", {"b": entry("U8", [1], 1, 2), "a": entry("U8", [1], 0, 1)}, b"xy"),
    ("f4-whole-bytes", {"a": entry("F4", [4], 0, 2)}, b"xy"),
    ("f6-whole-bytes", {"a": entry("F6_E3M2", [4], 0, 3)}, b"xyz"),
    ("escaped-name", b'{"a\\"b\\u00e9":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
    ("non-ascii-name-raw", '{"é":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'.encode(), b"x"),
    ("name-with-dash-zero", {"layer-0": entry("U8", [1], 0, 1)}, b"x"),
    ("colon-after-space-in-name", {"a :b": entry("U8", [1], 0, 1)}, b"x"),
    (
        "escaped-control-and-backslash-names",
        b'{"a\\nb":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
        b'"c\\\\d\\/e":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},'
        b'"\\u0041\\t":{"dtype":"U8","shape":[1],"data_offsets":[2,3]}}',
        b"xyz",
    ),
    ("surrogate-pair-name", b'{"\\ud83d\\ude00":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"x"),
    ("escaped-metadata", b'{"__metadata__":{"k\\"\\n":"v\\\\\\u00e9","":"\\ud83d\\ude00"}}', b""),
    (
        "dtypes-and-offsets-out-of-order",
        {
            "c": entry("F16", [2, 1], 9, 13),
            "a": entry("BF16", [], 0, 2),
            "e": entry("U8", [0, 7], 13, 13),
            "b": entry("F6_E2M3", [2, 2], 2, 5),
            "d": entry("I32", [1], 5, 9),
        },
        b"0123456789abc",
    ),
]


@pytest.mark.parametrize(("case", "header", "data", "length", "words"), REJECTED, ids=[c[0] for c in REJECTED])
def test_each_rule_is_enforced_like_the_reference(shard_file, case, header, data, length, words) -> None:  # type: ignore[no-untyped-def]
    if header is None:  # rule 1: fewer than 8 bytes in all
        path = shard_file(b"")
        path.write_bytes(b"1234567")
    else:
        path = shard_file(header, data, length=length)
    with pytest.raises(InvalidModelError) as caught:
        read_shard_header(path)
    message = str(caught.value)
    assert words in message
    assert all(line.startswith(f"{path}: ") for line in message.splitlines())
    assert "\n" not in str(caught.value.problems[0])
    assert not reference_accepts(path), "the reference reader accepts this file"


@pytest.mark.parametrize(("case", "header", "data"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_edges_the_reference_accepts_are_accepted(shard_file, case, header, data) -> None:  # type: ignore[no-untyped-def]
    path = shard_file(header, data)
    assert reference_accepts(path)
    header_obj = read_shard_header(path)
    assert header_obj.file_size == path.stat().st_size
    assert sum(end - begin for begin, end, *_ in header_obj.entries) == len(data)
    # Names (unescaped), dtypes, shapes, offsets, bytes and metadata: as the reference parses them.
    assert header_table(header_obj, path.read_bytes()) == reference_table(path)


def test_repeated_tensor_name_is_rejected_though_the_reference_keeps_one(shard_file) -> None:  # type: ignore[no-untyped-def]
    body = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    path = shard_file(body, b"x")
    assert reference_accepts(path)  # the reference silently keeps one of them
    with pytest.raises(InvalidModelError, match="tensor 'a': appears more than once in the header"):
        read_shard_header(path)


def test_every_problem_of_a_shard_is_reported(shard_file) -> None:  # type: ignore[no-untyped-def]
    header = {
        "good": entry("U8", [1], 0, 1),
        "bad_dtype": entry("X9", [1], 1, 2),
        "bad_size": entry("F32", [2], 2, 3),
        "bad_shape": entry("U8", [-1], 3, 4),
    }
    path = shard_file(header, b"abcd")
    with pytest.raises(InvalidModelError) as caught:
        read_shard_header(path)
    by_tensor = {p.tensor: p.reason for p in caught.value.problems}
    assert set(by_tensor) == {"bad_dtype", "bad_size", "bad_shape"}
    assert "unknown dtype" in by_tensor["bad_dtype"]
    assert "needs 8" in by_tensor["bad_size"]


def test_header_length_is_checked_before_the_header_is_read(tmp_path: Path) -> None:
    # A file claiming a 90 MB header but holding 10 bytes: refused from its size, nothing allocated.
    path = tmp_path / "liar.safetensors"
    path.write_bytes(struct.pack("<Q", 90_000_000) + b"{}")
    with pytest.raises(InvalidModelError, match="runs past the end of the file"):
        read_shard_header(path)


def test_unreadable_and_special_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelError, match="not a regular file"):
        read_shard_header(tmp_path)
    with pytest.raises(InvalidModelError, match="cannot open: No such file or directory"):
        read_shard_header(tmp_path / "missing.safetensors")


def test_names_with_control_characters_stay_on_one_line(shard_file) -> None:  # type: ignore[no-untyped-def]
    path = shard_file({"evil\nname\x1b[31m": entry("F32", [1], 0, 2)}, b"xy")
    with pytest.raises(InvalidModelError) as caught:
        read_shard_header(path)
    (line,) = str(caught.value).splitlines()
    assert "evil\\x0aname\\x1b[31m" in line


@pytest.mark.parametrize(
    ("header", "fast_takes_it"),
    [
        ({"b": entry("BF16", [2, 3], 0, 12), "a": entry("F4", [4], 12, 14), "__metadata__": {"k": "v"}}, True),
        ({"x": entry("U8", [0], 0, 0), "y": entry("U8", [3], 0, 3)}, False),  # a 0: the careful path's
        ({}, True),
        ({"é/名": entry("F32", [], 0, 4), "__metadata__": {"\ud83d\ude00": "ü"}}, True),
    ],
)
def test_fast_and_careful_paths_agree_on_valid_headers(header, fast_takes_it: bool) -> None:  # type: ignore[no-untyped-def]
    """The fast path takes the plain headers (the fuzz compares it on thousands), declines what it
    cannot prove, and agrees with the careful path where it answers."""
    raw = json.dumps(header, separators=(",", ":")).encode()
    problems: list[object] = []
    careful = _careful_parse(raw, "x", problems)  # type: ignore[arg-type]
    assert problems == []
    fast = _fast_parse(raw)
    assert (fast is not None) == fast_takes_it
    if fast is not None:
        assert sorted(fast[0], key=lambda e: e[2]) == sorted(careful[0], key=lambda e: e[2])
        assert fast[1] == careful[1]


def test_fast_path_declines_what_it_cannot_prove() -> None:
    dup = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    assert _fast_parse(dup) is None
    nested_dup = b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"dtype":"U8"}}'
    assert _fast_parse(nested_dup) is None
    spaced_dup = (
        b'{"a" :{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}'
    )
    assert _fast_parse(spaced_dup) is None
    assert _fast_parse(b'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}') is None


def test_dtype_table_is_complete() -> None:
    assert {name: dtype.bits for name, dtype in DTYPES.items()} == REFERENCE_DTYPES  # the reference's, as it says
    assert len(DTYPES) == 22
    bits = {
        "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
        "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
        "I32": 32, "U32": 32, "F32": 32, "C64": 64, "F64": 64, "I64": 64, "U64": 64,
    }  # fmt: skip
    assert {name: d.bits for name, d in DTYPES.items()} == bits
    for dtype in DTYPES.values():
        if dtype.bits % 8:
            assert dtype.numpy is None and dtype.numpy_name is None
        else:
            assert dtype.numpy is not None and dtype.numpy.itemsize * 8 == dtype.bits
            import numpy as np

            assert np.dtype(dtype.numpy_name) == dtype.numpy
