"""GGUF behind the formats/ seam: tables the `gguf` package (the reference reader) agrees with, every
rule of llama.cpp's reader enforced in one line, and every command, the mount, its view and the loader."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import sqlite3
import struct
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import modelvet  # type: ignore[import-untyped]
import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFReader
from gguf_files import (
    ARRAY,
    F32,
    STRING,
    U8,
    U32,
    gguf_files,
    gguf_reading,
    info,
    pair,
    raw_gguf,
    row_bytes,
    string,
    write_gguf,
)
from hypothesis import given
from hypothesis import strategies as st

import tensorfs
import tensorfs.utils.identity
from conftest import Mounts, require
from helpers import (
    NAME_RULES,
    BoundedReference,
    cli,
    fuzz_split,
    fuzzing,
    random_bytes,
    refused_in_one_line,
    unexplained,
)
from servers import Nginx, SeaweedFS
from tensorfs.errors import InvalidModelError
from tensorfs.formats import Described, gguf
from tensorfs.formats.dtypes import GGML_TYPES
from tensorfs.formats.table import ShardHeader
from tensorfs.mount.contents import metadata_json

EVERY_TYPE = sorted(GGML_TYPES.values(), key=lambda dtype: dtype.name)
WRITTEN_RIGHT = [dtype for dtype in EVERY_TYPE if dtype.name != "Q8_1"]
"""The types the reference writer writes as ggml reads them: its Q8_1 blocks are 40 bytes, ggml's 36."""


def table_of(path: Path) -> ShardHeader:
    data = path.read_bytes()
    return gguf.read_table(lambda offset, count: data[offset : offset + count], len(data), path, str(path))


def reference(path: Path) -> dict[str, tuple[str, list[int], int, int, bytes]]:
    """Each tensor as GGUFReader reads it: type, dims as stored, data offset, bytes (of a file made well)."""
    return gguf_reading(path)[0]


def every_type(path: Path, seed: int = 0) -> dict[str, bytes]:
    """One tensor of each ggml type, two rows of two blocks, and a 1-d one of one block."""
    tensors: dict[str, tuple[str, list[int]]] = {}
    for dtype in WRITTEN_RIGHT:
        tensors[f"blk.0.{dtype.name.lower()}.weight"] = (dtype.name, [2, 2 * dtype.block_size])
        tensors[f"blk.1.{dtype.name.lower()}.bias"] = (dtype.name, [dtype.block_size])
    return write_gguf(path, tensors, {"general.name": "every type", "x.list": [1, 2, 3]}, seed)


def test_the_type_table_is_the_reference_packages_but_q8_1() -> None:
    ours = {
        number: (dtype.name, dtype.block_size, dtype.type_size or dtype.bits // 8)
        for number, dtype in GGML_TYPES.items()
    }
    theirs = {int(t): (t.name, *sizes) for t, sizes in GGML_QUANT_SIZES.items()}
    assert ours == {**theirs, 9: ("Q8_1", 32, 36)}  # ggml's block_q8_1: two halves and 32 bytes
    assert theirs[9] == ("Q8_1", 32, 40)


def test_a_q8_1_tensor_is_read_as_ggml_reads_it(tmp_path: Path) -> None:
    path = tmp_path / "q8_1.gguf"
    path.write_bytes(raw_gguf([], [info("q", [64], 9, 0)], bytes(96)))  # two 36-byte blocks, padded to 96
    assert [(e[3].name, e[1] - e[0]) for e in table_of(path).entries] == [("Q8_1", 72)]


def test_tables_are_the_reference_readers(tmp_path: Path) -> None:
    path = tmp_path / "every.gguf"
    written = every_type(path)
    table = table_of(path)
    expected = reference(path)
    assert table.format == "gguf" and table.data_start % 32 == 0
    found = {}
    for begin, end, name, dtype, shape in table.entries:
        content = path.read_bytes()[table.data_start + begin : table.data_start + end]
        found[name] = (dtype.name, shape[::-1], table.data_start + begin, end - begin, content)
    assert found == expected
    assert {name: row[4] for name, row in found.items()} == written


@fuzzing(60)
@given(
    shapes=st.lists(
        st.tuples(
            st.sampled_from(WRITTEN_RIGHT), st.lists(st.integers(1, 3), min_size=0, max_size=3), st.integers(1, 3)
        ),
        min_size=0,
        max_size=6,
    ),
    alignment=st.sampled_from([None, 1, 8, 64]),
    seed=st.integers(0, 1000),
)
def test_generated_files_are_the_reference_readers(
    tmp_path_factory: pytest.TempPathFactory, shapes: list[tuple[Any, list[int], int]], alignment: int | None, seed: int
) -> None:
    path = tmp_path_factory.mktemp("gen") / "m.gguf"
    tensors = {
        f"t{i}": (dtype.name, [*rows, blocks * dtype.block_size]) for i, (dtype, rows, blocks) in enumerate(shapes)
    }
    write_gguf(path, tensors, seed=seed, alignment=alignment)
    table = table_of(path)
    expected = reference(path)
    assert {e[2]: (e[3].name, e[4][::-1], table.data_start + e[0], e[1] - e[0]) for e in table.entries} == {
        name: row[:4] for name, row in expected.items()
    }


def test_metadata_is_every_pair_decoded(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    pairs = {
        "a.text": "héllo",
        "a.count": 7,
        "a.ratio": 0.5,
        "a.flag": True,
        "a.ints": [1, 2, 3],
        "a.words": ["x", "yz"],
    }
    write_gguf(path, {"w": ("F32", [4])}, pairs)
    table = table_of(path)
    data = path.read_bytes()
    decoded = gguf.metadata(lambda offset, count: data[offset : offset + count], table.layout or {})
    assert decoded == {"general.architecture": "llama", **pairs}
    reader = GGUFReader(str(path))
    assert set(decoded) == {key for key in reader.fields if not key.startswith("GGUF.")}


def malformed() -> dict[str, tuple[bytes, str]]:
    """Files breaking one rule each, and what the one-line error must say."""
    w = [info("w", [8], 0, 0)]  # one F32 tensor of 8 elements: 32 bytes
    data = bytes(32)
    q4 = [info("q", [33], 2, 0)]  # Q4_0 of 33 elements: not whole blocks
    cases = {
        "version 0": (raw_gguf([], w, data, version=0), "GGUF version 0 is not one tensorfs reads"),
        "version 1": (raw_gguf([], w, data, version=1), "GGUF version 1 is not supported"),
        "version 4": (raw_gguf([], w, data, version=4), "GGUF version 4 is not one tensorfs reads"),
        "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian GGUF"),
        "truncated": (raw_gguf([], w, data)[:30], "truncated"),
        "truncated info": (
            raw_gguf([], w, data)[:50],
            "its offset runs past the end of the file (50 bytes): truncated",
        ),
        "too many tensors": (raw_gguf([], w, data, counts=(1 << 40, 0)), "tensors cannot fit"),
        "too many pairs": (raw_gguf([], w, data, counts=(1, 1 << 40)), "key/value pairs cannot fit"),
        "long string": (raw_gguf([pair("k", STRING, struct.pack("<Q", 1000))], w, data), "more than the file holds"),
        "long array": (
            raw_gguf([pair("k", ARRAY, struct.pack("<IQ", U32, 1000))], w, data),
            "more than the file holds",
        ),
        "nested array": (raw_gguf([pair("k", ARRAY, struct.pack("<IQ", ARRAY, 1))], w, data), "an array of arrays"),
        "unknown value type": (raw_gguf([pair("k", 13, b"")], w, data), "unknown type 13"),
        "empty key": (raw_gguf([pair("", U8, b"\0")], w, data), "key 0 is empty"),
        "NUL in a name": (raw_gguf([], [info(b"w\0x", [8], 0, 0)], data), "holds a NUL byte"),
        "string over 2^30": (
            raw_gguf([pair("k", STRING, struct.pack("<Q", (1 << 30) + 1))], w, data),
            "over GGUF's limit of 1,073,741,824",
        ),
        "array over 2^30": (
            raw_gguf([pair("k", ARRAY, struct.pack("<IQ", U8, (1 << 30) + 1))], w, data),
            "over GGUF's limit of 1,073,741,824",
        ),
        "negative dimension": (raw_gguf([], [info("w", [(1 << 64) - 8], 0, 0)], data), "is negative"),
        "removed type": (raw_gguf([], [info("w", [32], 31, 0)], data), "unknown ggml type 31"),
        "value not UTF-8": (raw_gguf([pair("k", STRING, string(b"ok\xff"))], w, data), "not valid UTF-8"),
        "long string in an array not UTF-8": (
            raw_gguf(
                [pair("k", ARRAY, struct.pack("<IQ", STRING, 3) + string("a") + string(b"\xe2" * 200) + string("b"))],
                w,
                data,
            ),
            "a string is not valid UTF-8",
        ),
        "a sequence cut at a string's end": (
            raw_gguf(
                [pair("k", ARRAY, struct.pack("<IQ", STRING, 2) + string(b"a\xe2\x82") + string(b"\xac"))], w, data
            ),
            "a string is not valid UTF-8",
        ),
        "key twice": (raw_gguf([pair("k", U8, b"\0"), pair("k", U8, b"\0")], w, data), "key 'k' appears twice"),
        "alignment not u32": (
            raw_gguf([pair("general.alignment", U8, b"\x20")], w, data),
            "general.alignment is UINT8, not UINT32",
        ),
        "alignment 0": (
            raw_gguf([pair("general.alignment", U32, struct.pack("<I", 0))], w, data),
            "not a power of two",
        ),
        "alignment 48": (
            raw_gguf([pair("general.alignment", U32, struct.pack("<I", 48))], w, data, alignment=48),
            "not a power of two",
        ),
        "key not UTF-8": (raw_gguf([pair(b"\xff", U8, b"\0")], w, data), "not valid UTF-8"),
        "long name": (raw_gguf([], [info("n" * 64, [8], 0, 0)], data), "over 63 bytes"),
        "name twice": (raw_gguf([], [info("w", [8], 0, 0), info("w", [8], 0, 32)], data * 2), "appears twice"),
        "five dimensions": (raw_gguf([], [info("w", [1, 1, 1, 1, 8], 0, 0)], data), "5 dimensions"),
        "overflow": (raw_gguf([], [info("w", [1 << 32, 1 << 32], 0, 0)], data), "more than 9223372036854775807"),
        "0 after the first dimension": (raw_gguf([], [info("w", [8, 1, 0], 0, 0)], b""), "one after the first is 0"),
        "unknown type": (raw_gguf([], [info("w", [8], 4, 0)], data), "unknown ggml type 4"),
        "partial block": (raw_gguf([], q4, bytes(64)), "not a multiple of Q4_0's block size 32"),
        "misaligned": (
            raw_gguf([], [info("w", [8], 0, 0), info("v", [8], 0, 40)], data * 3),
            "not a multiple of the alignment",
        ),
        "overlap": (
            raw_gguf([], [info("w", [8], 0, 0), info("v", [8], 0, 0)], data * 2),
            "not 32, where the tensor before",
        ),
        "past the end": (raw_gguf([], w, data[:16]), "past the end of the file"),
        "last not padded": (raw_gguf([], [info("w", [7], 0, 0)], bytes(28)), "past the end of the file"),
    }
    return cases


@pytest.mark.parametrize("case", sorted(malformed()))
def test_each_rule_is_one_line_naming_the_file(case: str, tmp_path: Path) -> None:
    content, expected = malformed()[case]
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    refused_in_one_line(path, expected, table_of)


def test_what_llama_cpp_takes_is_taken(tmp_path: Path) -> None:
    """The hand-made files above break one rule each: the same made right is valid, and so are the
    edges llama.cpp takes (no dimension, a dimension of 0, a 63-byte name, bytes after the data)."""
    path = tmp_path / "good.gguf"
    infos = [info("w", [7], 0, 0), info("s", [], 0, 32), info("z", [0, 4], 2, 64), info("n" * 63, [2], 0, 64)]
    words = [("€" * 100).encode(), b"x" * 300, "é".encode(), bytes(range(1, 128))]  # lengths over 127 too
    vocabulary = struct.pack("<IQ", STRING, len(words)) + b"".join(map(string, words))
    pairs = [pair("k", F32, struct.pack("<f", 1.0)), pair("words", ARRAY, vocabulary)]
    path.write_bytes(raw_gguf(pairs, infos, bytes(96) + b"trailing"))
    table = table_of(path)
    assert [(e[2], e[3].name, e[4], e[1] - e[0]) for e in table.entries] == [
        ("w", "F32", [7], 28),
        ("s", "F32", [], 4),
        ("z", "Q4_0", [4, 0], 0),
        ("n" * 63, "F32", [2], 8),
    ]
    data = path.read_bytes()
    assert gguf.metadata(_reader(data), table.layout or {})["words"] == [word.decode() for word in words]


MODELVET_POLICY = {"MVET_V_KV_BOOL_BYTE", "MVET_V_TRAILING_BYTES"}
"""What modelvet refuses beyond llama.cpp's reader (its header calls them policy): a bool byte other
than 0 or 1, bytes after the data; and it refuses a 0 in the first dimension, which llama.cpp takes."""
MODELVET_KINDS = {
    "MVET_V_MAGIC": r"not a GGUF file \(no GGUF magic\)",
    "MVET_V_VERSION_UNSUPPORTED": r"GGUF version \d+ is not one tensorfs reads \(2 and 3\)",
    "MVET_V_VERSION_LEGACY": r"GGUF version 1 is not supported: .+",
    "MVET_V_VERSION_ENDIAN": r"a big-endian GGUF: .+",
    "MVET_V_TRUNCATED": (
        r".+ (runs past the end of the file \(\d+ bytes\): truncated|runs past the table's first [\d,]+ bytes: truncated"
        r"|more than the file holds)|[\d,]+ (tensors|key/value pairs) cannot fit in the [\d,]+ bytes left: truncated or corrupt"
    ),
    "MVET_V_KEY_EMPTY": r"key \d+ is empty",
    "MVET_V_KEY_DUPLICATE": r"key '.*' appears twice",
    "MVET_V_STR_UTF8": r".+ is not valid UTF-8|.+: a string is not valid UTF-8 \(byte [\d,]+\)",
    "MVET_V_KV_TYPE_RANGE": r".+: unknown type \d+",
    "MVET_V_KV_ARRAY_TYPE_RANGE": r".+: an array of unknown type \d+",
    "MVET_V_KV_ARRAY_NESTED": r".+: an array of arrays, which GGUF readers do not take",
    "MVET_V_KV_ARRAY_ELEMS_CAP": (
        r".+: an array of [\d,]+ (elements|strings), (more than the file holds|over GGUF's limit of [\d,]+)"
    ),
    "MVET_V_STR_LEN_CAP": r".+: a string of [\d,]+ bytes, (more than the file holds|over GGUF's limit of [\d,]+)",
    "MVET_V_ALIGN_TYPE": r"general\.alignment is .+, not UINT32",
    "MVET_V_ALIGN_VALUE": r"general\.alignment \d+ is not a power of two",
    "MVET_V_NAME_DUPLICATE": r"the name appears twice",
    "MVET_V_TENSOR_DIMS_CAP": r"\d+ dimensions: GGUF tensors have at most \d+",
    "MVET_V_TENSOR_DTYPE_RANGE": r"unknown ggml type \d+",
    "MVET_V_TENSOR_NE_RANGE": (
        r"dimensions \[[\d, ]*\]: one after the first is 0, which llama\.cpp's reader divides by"
        r"|a dimension of \[.*\] is negative \(as int64\)"
    ),
    "MVET_V_TENSOR_NE_OVERFLOW": r"dimensions \[.*\] hold more than \d+ elements",
    "MVET_V_TENSOR_BLOCK_DIVISIBILITY": r"its first dimension \d+ is not a multiple of .+'s block size \d+",
    "MVET_V_TENSOR_SIZE_OVERFLOW": r"dimensions \[.*\] hold more bytes than a 64-bit size",
    "MVET_V_TENSOR_OFFSET_MISMATCH": (
        r"its offset \d+ is not (\d+, where the tensor before it ends \(padded to \d+\)|a multiple of the alignment \d+)"
    ),
    "MVET_V_TENSOR_DATA_EXTENT": r"its tensor data runs to byte \d+ \(padded to \d+\), past the end of the file \(\d+ bytes\)",
}
"""What tensorfs says of a GGUF that GGUFReader reads and modelvet refuses for the same fault, by
modelvet's violation: its reason, whole (a refusal for another fault than modelvet's explains nothing)."""
GGUF_STRICTER = {
    "a name over GGML_MAX_NAME": r"its name is over 63 bytes \(GGML_MAX_NAME\)",
    "a key or a name holding a NUL": r"(key \d+|a key|the name of tensor \d+) holds a NUL byte",
    **NAME_RULES,
}
"""What tensorfs refuses where modelvet (the second reference) may not: names of 64 bytes or more
(llama.cpp's GGML_MAX_NAME counts the NUL; modelvet takes 256), keys and names with a NUL (they
become JSON and file names; llama.cpp's C strings end at it: docs/formats.md), names that are no
safe path."""


def readings(path: Path) -> tuple[dict[str, tuple[str, list[int], int, int, bytes]], str]:
    """What tensorfs reads of a GGUF, as gguf_reading has the reference read it: each tensor's
    type, dims as stored, data offset, size and bytes; every pair decoded (its repr)."""
    with tensorfs.open_model(path, cache=False) as model:
        (shard,) = model.shards
        tensors = {}
        for name in model:
            found = model.info(name)
            tensors[name] = (found.dtype, list(found.shape[::-1]), found.offset, found.nbytes, bytes(model.raw(name)))
        return tensors, repr(model.file_metadata(shard))


@pytest.fixture(scope="module")
def bounded_reader() -> Iterator[BoundedReference]:
    reader = BoundedReference("gguf_files:gguf_reading")
    try:
        yield reader
    finally:
        reader.close()


@pytest.mark.fuzz
def test_tensorfs_agrees_with_the_reference_reader(tmp_path: Path, bounded_reader: BoundedReference) -> None:
    """Generated GGUFs, well formed or nearly (gguf_files: pairs of every type, tensors of every type,
    alignments, bytes of the table changed, files cut or longer), read by tensorfs and by GGUFReader.
    What the reference refuses tensorfs refuses, in one line; what tensorfs alone refuses, modelvet
    refuses too for the same fault (MODELVET_KINDS), or it breaks one of GGUF_STRICTER; what both read is the same table (types, dims,
    offsets, sizes, bytes) and the same pairs, and modelvet takes it but for its policies."""
    split: Counter[str] = Counter()
    path = tmp_path / "case.gguf"

    @fuzzing(300)
    @given(gguf_files(WRITTEN_RIGHT))
    def case(content: bytes) -> None:
        path.write_bytes(content)
        theirs = bounded_reader.read(path)
        report = modelvet.verify_path(str(path))
        try:
            ours = readings(path)
        except InvalidModelError as exc:
            assert str(exc).count("\n") == 0, str(exc)  # one problem: the rest would follow from it
            if theirs[0] == "refused":
                split["both reject"] += 1
                return
            # Refused by a stricter rule, or for a fault of a kind modelvet checks, when modelvet refuses it
            # for one (MODELVET_KINDS) or for one of its policies: each says its first fault only, and a
            # file of two faults may be told by one of one, by the other of the other.
            zero_first = report.violation_name == "MVET_V_TENSOR_NE_RANGE" and any(
                row[1][:1] == [0] for row in theirs[1][0].values()
            )  # a 0 in the first dimension, which llama.cpp (and GGUFReader) take: a policy of modelvet's
            kinds = (
                list(MODELVET_KINDS.values())
                if not report.accepted
                and (report.violation_name in MODELVET_KINDS or report.violation_name in MODELVET_POLICY or zero_first)
                else []
            )
            unexplained_ones = [
                reason
                for reason in unexplained(exc.problems, GGUF_STRICTER)
                if not any(re.fullmatch(kind, reason) for kind in kinds)
            ]
            assert not unexplained_ones, f"refused by no rule of GGUF_STRICTER, nor as modelvet refuses it: {exc}"
            split["tensorfs stricter"] += 1
            return
        if theirs[0] == "refused":
            # GGUFReader fails on a tensor of no dimensions of most types (quant_shape_to_byte_shape
            # indexes its last dimension); llama.cpp reads it as one element.
            no_dimension = theirs[1].startswith("IndexError") and any(not row[1] for row in ours[0].values())
            assert no_dimension, f"tensorfs reads what the reference refuses ({theirs[1]})"
            split["reference fails on no dimension"] += 1
            return
        assert ours == theirs[1]
        if not report.accepted:  # nothing modelvet refuses is taken, but for its policies
            zero_first = report.violation_name == "MVET_V_TENSOR_NE_RANGE" and any(
                row[1][:1] == [0] for row in ours[0].values()
            )
            assert report.violation_name in MODELVET_POLICY or zero_first, report.violation_name
        split["both accept"] += 1

    case()
    shares = fuzz_split(split, ["both accept", "both reject", "tensorfs stricter", "reference fails on no dimension"])
    assert split["both accept"] * 4 >= split.total() and split["both reject"], shares


def test_the_mount_serves_each_tensor_and_a_gguf_view(mounts: Mounts, tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    written = every_type(path)
    mountpoint = mounts.mount(path)
    expected = reference(path)
    for name, (type_name, dims, offset, nbytes, content) in expected.items():
        assert (mountpoint / name).read_bytes() == content == written[name]
        meta = json.loads((mountpoint / f"{name}.meta.json").read_bytes())
        dtype = GGML_TYPES[next(t for t, d in GGML_TYPES.items() if d.name == type_name)]
        assert meta == {
            "name": name,
            "dtype": type_name,
            "shape": dims[::-1],
            "nbytes": nbytes,
            "shard": "model.gguf",
            "offset": offset,
            "data_offsets": [offset - table_of(path).data_start, offset - table_of(path).data_start + nbytes],
            "numpy_dtype": dtype.numpy_name,
            "gguf_dims": dims,
            "block_size": dtype.block_size,
            "type_size": dtype.type_size or dtype.bits // 8,
        }
        assert (mountpoint / f"{name}.meta.json").stat().st_size == len((mountpoint / f"{name}.meta.json").read_bytes())
        digest = (mountpoint / f"{name}.sha256").read_text().split()[0]
        assert digest == hashlib.sha256(content).hexdigest()
    plain = "blk.0.f32.weight"
    assert np.array_equal(tensorfs.memmap(mountpoint / plain), np.frombuffer(written[plain], "<f4").reshape(2, 2))
    view = mountpoint / ".tensorfs" / "model" / "model.gguf"
    assert view.read_bytes() == path.read_bytes()  # the same tensors, in the same order: the same file
    assert {name: row[4] for name, row in reference(view).items()} == written
    checked = subprocess.run(
        ["sha256sum", "-c", ".tensorfs/SHA256SUMS"], cwd=mountpoint, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    metadata = json.loads((mountpoint / ".tensorfs" / "metadata.json").read_bytes())
    assert metadata == {
        "format": "gguf",
        "shards": {"model.gguf": {"general.architecture": "llama", "general.name": "every type", "x.list": [1, 2, 3]}},
    }


def _long_arrays(path: Path, numbers: int, count: int, long: int) -> Path:
    """A GGUF whose pairs are a name, `numbers` numbers, `count` words, a string of `long` bytes, and two short ones."""
    words = [f"w{i}".encode() for i in range(count)]
    numbered = bytes(range(256)) * (numbers // 256) + bytes(numbers % 256)
    pairs = [
        pair("general.name", STRING, string("big")),
        pair("nums", ARRAY, struct.pack("<IQ", U8, numbers) + numbered),
        pair("words", ARRAY, struct.pack("<IQ", STRING, count) + b"".join(map(string, words))),
        pair("long", STRING, string("é" * (long // 2))),
        pair("after", U32, struct.pack("<I", 7)),
        pair("fits", ARRAY, struct.pack("<IQ", U8, 3) + b"\x01\x02\x03"),
    ]
    path.write_bytes(raw_gguf(pairs, [info("w", [8], 0, 0)], bytes(32)))
    return path


def test_metadata_json_is_bounded_and_says_what_is_left_out(tmp_path: Path) -> None:
    """.tensorfs/metadata.json holds a file's pairs while they fit its bound: a string or an array
    that does not is a summary (an object: no value of a GGUF is one), and once not even that
    fits, the pairs from there on are left out and counted. Within the bound, it is every pair whole."""
    path = _long_arrays(tmp_path / "m.gguf", 1000, 1000, 5000)
    with tensorfs.open_model(path, cache=False) as model:
        data = path.read_bytes()
        whole = gguf.metadata(_reader(data), model.shard_header(model.shards[0]).layout or {})
        assert json.loads(metadata_json(model)) == {"format": "gguf", "shards": {"m.gguf": whole}}
        bounded = metadata_json(model, Described(2000))
        assert len(bounded) <= 2000 + 100  # the bound, and the document's own keys
        assert json.loads(bounded) == {
            "format": "gguf",
            "shards": {
                "m.gguf": {
                    "general.name": "big",
                    "nums": {"type": "ARRAY", "element_type": "UINT8", "length": 1000, "first": list(range(16))},
                    "words": {"type": "ARRAY", "element_type": "STRING", "length": 1000,
                              "first": [f"w{i}" for i in range(16)]},
                    "long": {"type": "STRING", "bytes": 5000, "first": "é" * 256},
                    "after": 7,
                    "fits": [1, 2, 3],
                }
            },
        }  # fmt: skip
        cut = json.loads(metadata_json(model, Described(600)))  # "long"'s summary no longer fits
        assert list(cut["shards"]["m.gguf"]) == ["general.name", "nums", "words"]
        assert cut["left_out"] == {"m.gguf": 3}
    summarized = Described(400).of({"a": "x" * 5000, "b": "y"})  # a safetensors __metadata__
    assert summarized == {"a": {"type": "STRING", "bytes": 5000, "first": "x" * 256}, "b": "y"}


def test_a_long_array_is_summarized_in_the_mounts_metadata_json(mounts: Mounts, tmp_path: Path) -> None:
    """A GGUF whose pairs hold 24 million numbers, 2 million words and a string of 20 MiB (within the
    table's bound): its metadata.json was 159 MB of JSON made on the daemon's request thread (the
    daemon answered nothing else meanwhile), and kept; it is a summary of each, the short pairs whole."""
    count = 24 << 20
    path = _long_arrays(tmp_path / "big.gguf", count, 2_000_000, 20 << 20)
    mountpoint = mounts.mount(path)
    described = mountpoint / ".tensorfs" / "metadata.json"
    assert described.stat().st_size < 4096
    pairs = json.loads(described.read_bytes())["shards"]["big.gguf"]
    assert pairs["nums"] == {"type": "ARRAY", "element_type": "UINT8", "length": count, "first": list(range(16))}
    assert pairs["words"]["length"] == 2_000_000 and pairs["long"]["bytes"] == 20 << 20
    assert (pairs["general.name"], pairs["after"], pairs["fits"]) == ("big", 7, [1, 2, 3])
    assert (mountpoint / "w").read_bytes() == bytes(32)


def test_a_selection_is_a_gguf_of_the_selected_tensors(mounts: Mounts, tmp_path: Path) -> None:
    """Which says it is a part of a model (see test_loaders for what loaders make of it): the blocks
    it holds, counted in block_count, each per-block array cut to them, every other pair as it was."""
    part_of_block_1 = {  # what a part holding block 1 alone says of itself (and of the model it is of)
        "general.architecture": "part-of-a-model",
        "llama.block_count": 1,
        "llama.attention.head_count_kv": [4],
        "llama.rope.dimension_sections": [1, 2],
        "general.name": "two blocks",
        "general.alignment": 64,
        "tensorfs.part.architecture": "llama",
        "tensorfs.part.blocks": [1],
    }
    path = tmp_path / "model.gguf"
    written = write_gguf(
        path,
        {"token_embd.weight": ("F32", [4, 8]), "blk.0.w": ("Q4_K", [1, 256]), "blk.1.w": ("Q8_0", [2, 32])},
        {
            "split.count": 1,
            "llama.block_count": 2,
            "llama.attention.head_count_kv": [8, 4],
            "llama.rope.dimension_sections": [1, 2],
            "general.name": "two blocks",
        },
        alignment=64,
    )
    mountpoint = mounts.mount(path, "--exclude", "blk.0.*")
    view = mountpoint / ".tensorfs" / "model" / "selected.gguf"
    reader = GGUFReader(str(view))
    assert {t.name: t.data.tobytes() for t in reader.tensors} == {
        name: data for name, data in written.items() if name != "blk.0.w"
    }
    assert "split.count" not in reader.fields and reader.alignment == 64
    said = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert said == part_of_block_1
    whole = GGUFReader(str(mounts.mount(path) / ".tensorfs" / "model" / "model.gguf"))
    assert whole.fields["general.architecture"].contents() == "llama"
    # A part of a part (a stage exported, then selected again) says so of the whole model's blocks.
    exported = mounts.run("export", "--exclude", "token_embd.weight", str(path), str(tmp_path / "stage"))
    assert exported.returncode == 0, exported.stderr
    again = mounts.mount(tmp_path / "stage" / "selected.gguf", "--layers", "1") / ".tensorfs" / "model"
    reader = GGUFReader(str(again / "selected.gguf"))
    said = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    assert said == part_of_block_1
    assert [t.name for t in reader.tensors] == ["blk.1.w"]


def test_the_loader_and_the_commands(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    written = write_gguf(path, {"a": ("F32", [2, 4]), "b": ("Q6_K", [256]), "c": ("BF16", [3, 2])})
    with tensorfs.safe_open(path, "np") as opened:
        assert opened.keys() == ["a", "b", "c"]
        assert np.array_equal(opened.get_tensor("a"), np.frombuffer(written["a"], "<f4").reshape(2, 4))
        assert opened.get_tensor("b").tobytes() == written["b"] and opened.get_slice("b").get_dtype() == "Q6_K"
    pt = tensorfs.load_file(path)
    assert pt["c"].shape == (3, 2) and pt["b"].numel() == len(written["b"])
    listed = cli("ls", "--json", str(path))
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(row["name"], row["dtype"], row["gguf_dims"]) for row in rows] == [
        ("a", "F32", [4, 2]),
        ("b", "Q6_K", [256]),
        ("c", "BF16", [2, 3]),
    ]
    manifest = cli("manifest", str(path))
    assert manifest.returncode == 0, manifest.stderr
    assert {line.split()[1]: line.split()[0] for line in manifest.stdout.splitlines()} == {
        name: hashlib.sha256(data).hexdigest() for name, data in written.items()
    }


def test_a_model_is_of_one_format(tmp_path: Path) -> None:
    from helpers import write_reference

    directory = tmp_path / "model"
    directory.mkdir()
    write_gguf(directory / "a.gguf", {"a": ("F32", [4])})
    write_reference(directory / "b.safetensors", {"b": ("F32", [1], random_bytes(4, 0))})
    with pytest.raises(  # by their names: a loader takes one or the other, never both
        InvalidModelError, match=r"holds safetensors and GGUF files \(b\.safetensors, a\.gguf\): name the one to open"
    ):
        tensorfs.open_model(directory)
    (directory / "a.gguf").rename(directory / "a.safetensors")  # by their content: a GGUF, whatever its name
    with pytest.raises(
        InvalidModelError, match=r"is a safetensors file, where .* is gguf: a model's shards are all of one format"
    ):
        tensorfs.open_model(directory)


def test_remote_models_with_long_tables(
    nginx: Nginx, seaweedfs: SeaweedFS, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vocabulary longer than a store's first read: the table is asked for again, twice as long each
    time; tensors and the GGUF view come through the chunk cache as from a local file."""
    from tensorfs.sources.client import FIRST_READ
    from tensorfs.sources.store import RemoteOptions

    path = tmp_path / "vocab.gguf"
    words = [f"token-{i}" for i in range(FIRST_READ // 4)]
    written = write_gguf(path, {"w": ("F32", [4]), "q": ("Q4_K", [2, 256])}, {"tokenizer.ggml.tokens": words})
    served = nginx.root / tmp_path.name
    served.mkdir()
    (served / "vocab.gguf").write_bytes(path.read_bytes())
    import obstore

    obstore.put(seaweedfs.store(bucket), "m/vocab.gguf", path.read_bytes())
    sources = {
        f"{nginx.url}/{tmp_path.name}/vocab.gguf": RemoteOptions(cache_dir=tmp_path / "c1"),
        f"s3://{bucket}/m/vocab.gguf": RemoteOptions(cache_dir=tmp_path / "c2", endpoint_url=seaweedfs.endpoint),
    }
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    try:
        for url, remote in sources.items():
            with tensorfs.open_model(url, remote=remote) as model:
                assert {name: bytes(model.raw(name)) for name in model} == written
                assert model.format == "gguf" and model.info("q").as_json()["gguf_dims"] == [256, 2]
        gets = [r for r in nginx.requests() if r[1].endswith(f"{tmp_path.name}/vocab.gguf") and r[0] == "GET"]
        assert 3 <= len(gets) <= 8  # 64 KiB, 128 KiB, 256 KiB, the rest; then the tensors' chunks
    finally:
        shutil.rmtree(served, ignore_errors=True)


def test_header_cache_rows_keep_the_format(tmp_path: Path) -> None:
    path = tmp_path / "vocab.gguf"
    write_gguf(
        path, {"w": ("F32", [4]), "q": ("Q4_0", [32])}, {"tokenizer.ggml.tokens": [f"t{i}" for i in range(9000)]}
    )
    from tensorfs.caches.headers import HeaderCache

    cache = HeaderCache(tmp_path / "cache")
    header = table_of(path)
    cache.put_shard("key", header)
    again = cache.shard(path, "key")
    assert again == header and again is not None and again.format == "gguf" and again.layout == header.layout
    # A row whose layout cannot be a GGUF's (a tensor off the alignment), its checksum made again: not taken.
    misaligned = dataclasses.replace(header, entries=[(1, 1 + e[1] - e[0], *e[2:]) for e in header.entries[:1]])
    cache.put_shard("forged", misaligned)
    assert cache.shard(path, "forged") is None
    cache.close()


def test_an_empty_string_and_a_zero_length_pair_are_values(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(raw_gguf([pair("empty", STRING, string("")), pair("none", ARRAY, struct.pack("<IQ", U8, 0))], []))
    table = table_of(path)
    data = path.read_bytes()
    assert table.entries == [] and gguf.metadata(lambda o, c: data[o : o + c], table.layout or {}) == {
        "empty": "",
        "none": [],
    }
    assert row_bytes("Q4_K", 256) == 144


def test_export_writes_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    written = write_gguf(
        path, {"token_embd.weight": ("F32", [2, 8]), "blk.0.w": ("Q5_K", [256]), "blk.1.w": ("I8", [3])}
    )

    def export(*args: str) -> subprocess.CompletedProcess[str]:
        return cli("export", *args)

    done = export(str(path), str(tmp_path / "copy.gguf"))
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "copy.gguf").read_bytes() == path.read_bytes()
    done = export("--layers", "1", str(path), str(tmp_path / "stage"))
    assert done.returncode == 0, done.stderr
    assert {t.name: t.data.tobytes() for t in GGUFReader(str(tmp_path / "stage" / "selected.gguf")).tensors} == {
        "token_embd.weight": written["token_embd.weight"],
        "blk.1.w": written["blk.1.w"],
    }
    refused = export(str(path), str(tmp_path / "out.safetensors"))
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert "a gguf model is written as a .gguf file" in refused.stderr
    assert not (tmp_path / "out.safetensors").exists()


# -- real files nobody here wrote ---------------------------------------------------------------

REAL_FILES = Path(sys.prefix) / "test-files"  # fetched by `make test` (scripts/fetch_test_files.py)


def real_vocabularies() -> list[Path]:
    found = sorted(REAL_FILES.glob("ggml-vocab-*.gguf"))
    if not found:
        require("llama.cpp's GGUF vocabularies", f"none in {REAL_FILES}: run make test (it fetches them)")
    return found


def test_real_files_are_the_reference_readers() -> None:
    for path in real_vocabularies():
        if path.stat().st_size > 10 << 20:
            continue  # the reference reader takes seconds on the largest; the next test has it
        table = table_of(path)
        reader = GGUFReader(str(path))
        assert [e[2] for e in table.entries] == [t.name for t in reader.tensors]
        decoded = gguf.metadata(_reader(path.read_bytes()), table.layout or {})
        expected = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
        assert decoded.keys() == expected.keys(), path.name
        for key, value in decoded.items():
            assert value == expected[key] or _same_floats(value, expected[key]), (path.name, key)


def _reader(data: bytes) -> Callable[[int, int], bytes]:
    return lambda offset, count: data[offset : offset + count]


def _same_floats(ours: Any, theirs: Any) -> bool:
    """float32 values: the reference reader gives numpy's float32 as Python floats, as they are."""
    return bool(np.array_equal(np.asarray(ours, dtype=np.float32), np.asarray(theirs, dtype=np.float32)))


def test_real_files_mount_with_their_metadata(mounts: Mounts) -> None:
    largest = max(real_vocabularies(), key=lambda path: path.stat().st_size)
    assert modelvet.verify_path(str(largest)).accepted
    mountpoint = mounts.mount(largest)
    metadata = json.loads((mountpoint / ".tensorfs" / "metadata.json").read_bytes())
    tokens = metadata["shards"][largest.name]["tokenizer.ggml.tokens"]
    assert metadata["format"] == "gguf" and len(tokens) > 200_000 and all(isinstance(t, str) for t in tokens)
    assert (mountpoint / ".tensorfs" / "model" / largest.name).read_bytes() == largest.read_bytes()


def test_tensorfs_refuses_what_modelvet_refuses(tmp_path: Path) -> None:
    """modelvet (a C verify-before-load validator): every malformed file above that it refuses,
    tensorfs refuses too (tensorfs refuses all of them)."""
    import modelvet

    refused_by_modelvet = []
    for case, (content, _) in sorted(malformed().items()):
        path = tmp_path / f"{case.replace(' ', '-')}.gguf"
        path.write_bytes(content)
        if not modelvet.verify_path(str(path)).accepted:
            refused_by_modelvet.append(case)
        with pytest.raises(InvalidModelError):
            table_of(path)
    assert len(refused_by_modelvet) >= len(malformed()) // 2  # the peer is a real check, not a no-op


def test_a_multi_file_gguf_is_one_model(mounts: Mounts, tmp_path: Path) -> None:
    directory = tmp_path / "split"
    directory.mkdir()
    tensors = {f"blk.{i}.w": ("Q8_0" if i % 2 else "F32", [2, 32]) for i in range(5)}
    written = write_gguf(directory / "m.gguf", tensors, {"general.name": "split"}, split_max_tensors=2)
    parts = sorted(path.name for path in directory.iterdir())
    assert parts == ["m-00001-of-00003.gguf", "m-00002-of-00003.gguf", "m-00003-of-00003.gguf"]
    for source in (directory, directory / parts[0], directory / parts[2]):  # the directory, or any part
        with tensorfs.open_model(source) as model:
            assert {name: bytes(model.raw(name)) for name in model} == written
    folder = mounts.mount(directory / parts[0]) / ".tensorfs" / "model"  # the parts as they are
    assert sorted(os.listdir(folder)) == parts
    assert all((folder / part).read_bytes() == (directory / part).read_bytes() for part in parts)
    mountpoint = mounts.mount(directory / parts[0], "--view", "merged")  # one GGUF of them all
    view = mountpoint / ".tensorfs" / "model" / "model.gguf"
    reader = GGUFReader(str(view))
    assert {t.name: t.data.tobytes() for t in reader.tensors} == written
    assert not any(key.startswith("split.") for key in reader.fields)
    assert reader.fields["general.name"].contents() == "split"


def test_parts_missing_or_not_of_one_model_are_refused(tmp_path: Path) -> None:
    directory = tmp_path / "split"
    directory.mkdir()
    write_gguf(directory / "m.gguf", {f"blk.{i}.w": ("F32", [4]) for i in range(4)}, split_max_tensors=2)
    (directory / "m-00002-of-00002.gguf").unlink()
    with pytest.raises(InvalidModelError, match=r"of which m-00002-of-00002\.gguf cannot be found"):
        tensorfs.open_model(directory / "m-00001-of-00002.gguf")
    several = tmp_path / "several"
    several.mkdir()
    write_gguf(several / "model-Q4.gguf", {"w": ("Q4_0", [32])})
    write_gguf(several / "model-Q8.gguf", {"w": ("Q8_0", [32])})
    with pytest.raises(InvalidModelError) as raised:
        tensorfs.open_model(several)
    message = str(raised.value)
    assert message.endswith(
        ": holds several GGUF files (model-Q4.gguf, model-Q8.gguf): name the one to open (its file, or its index)"
    )
    assert "\n" not in message
    lying = tmp_path / "lying"
    lying.mkdir()
    write_gguf(lying / "m.gguf", {f"t{i}": ("F32", [4]) for i in range(4)}, split_max_tensors=2)
    first, second = sorted(lying.iterdir())
    second.rename(tmp_path / "kept")
    first.rename(second)  # part 1 under part 2's name
    (tmp_path / "kept").rename(first)
    with pytest.raises(InvalidModelError, match=r"split\.no is 1, where this is part 0"):
        tensorfs.open_model(lying)


def test_small_gguf_tables_skip_the_header_cache_and_long_ones_use_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small, long = tmp_path / "small.gguf", tmp_path / "long.gguf"
    write_gguf(small, {"w": ("F32", [4])})
    write_gguf(long, {"w": ("F32", [4])}, {"tokenizer.ggml.tokens": [f"t{i}" for i in range(9000)]})
    cache = tmp_path / "cache"
    tensorfs.open_model(small, cache=cache).close()
    assert not cache.exists()  # cheaper validated again than looked up
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)  # files just written are kept too
    tensorfs.open_model(long, cache=cache).close()
    with sqlite3.connect(cache / "headers.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM rows WHERE kind LIKE 'shard/%'").fetchone() == (1,)
