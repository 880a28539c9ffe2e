"""open_model against the reference: every dtype, shards, indexes, and the zero-copy views."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import tensorfs
from helpers import (
    entry,
    every_dtype_tensors,
    random_bytes,
    raw_shard,
    reference_table,
    write_index,
    write_reference,
)
from tensorfs import InvalidModelError
from tensorfs.mount.handover import reopen, snapshot
from tensorfs.sources.index import INDEX_NAME


def assert_matches_reference(model: tensorfs.Model, shards: list[Path]) -> None:
    expected = {}
    for shard in shards:
        for name, (dtype, shape, offsets, data) in reference_table(shard)[0].items():
            expected[name] = (shard, dtype, shape, offsets, data)
    assert model.names() == sorted(expected)
    assert len(model) == len(expected)
    for name, (shard, dtype, shape, offsets, data) in expected.items():
        info = model.info(name)
        assert (info.name, info.dtype, list(info.shape), info.nbytes, info.shard, info.data_offsets) == (
            name,
            dtype,
            shape,
            len(data),
            shard,
            offsets,
        )
        assert bytes(model.raw(name)) == data
        with open(shard, "rb") as f:
            f.seek(info.offset)
            assert f.read(info.nbytes) == data
        assert info.offset - info.data_offsets[0] == model.shard_header(shard).data_start


def test_every_dtype_is_byte_exact(tmp_path: Path) -> None:
    path = tmp_path / "all.safetensors"
    write_reference(path, every_dtype_tensors(), metadata={"format": "pt"})
    with tensorfs.open_model(path) as model:
        assert_matches_reference(model, [path])
        assert model.metadata == {"all.safetensors": {"format": "pt"}}


def test_arrays_match_the_reference_numpy_reader(tmp_path: Path) -> None:
    arrays = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "f64": np.linspace(0, 1, 5),
        "i64": np.array([-1, 2**40], dtype=np.int64),
        "bool": np.array([True, False, True]),
        "u8": np.arange(7, dtype=np.uint8),
        "c64": np.array([1 + 2j, 3 - 4j], dtype=np.complex64),
        "bf16": np.array([1.5, -2.0, 3.25], dtype=ml_dtypes.bfloat16),
        "f8": np.array([0.5, 1.0], dtype=ml_dtypes.float8_e4m3fn),
        "scalar": np.array(3.5, dtype=np.float32),
        "empty": np.zeros((0, 3), dtype=np.float16),
    }
    path = tmp_path / "np.safetensors"
    safetensors.numpy.save_file(arrays, str(path))
    with tensorfs.open_model(path) as model:
        for name, expected in arrays.items():
            got = model.array(name)
            assert got.dtype == expected.dtype, name
            assert got.shape == expected.shape, name
            np.testing.assert_array_equal(got, expected)
            assert not got.flags.writeable
        assert model.info("bf16").numpy_dtype == np.dtype(ml_dtypes.bfloat16)


def test_packed_types_come_as_raw_bytes(tmp_path: Path) -> None:
    path = tmp_path / "packed.safetensors"
    path.write_bytes(raw_shard({"f4": entry("F4", [2, 4], 0, 4), "f6": entry("F6_E2M3", [4], 4, 7)}, b"abcdefg"))
    with tensorfs.open_model(path) as model:
        assert model.info("f4").numpy_dtype is None
        assert model.array("f4").dtype == np.uint8
        assert bytes(model.array("f4")) == b"abcd"
        assert bytes(model.array("f6")) == b"efg"


def test_views_are_zero_copy_and_read_only(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_reference(path, {"w": ("F32", [256], random_bytes(1024, 1))})
    with tensorfs.open_model(path) as model:
        view = model.raw("w")
        assert view.readonly
        with pytest.raises(TypeError):
            view[0] = 1
        array = model.array("w")
        with pytest.raises(ValueError):
            array[0] = 1
        assert np.shares_memory(array, np.frombuffer(model.raw("w"), dtype=np.float32))


def test_views_outlive_close(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    data = random_bytes(64, 2)
    write_reference(path, {"w": ("U8", [64], data)})
    model = tensorfs.open_model(path)
    array = model.array("w")
    model.close()  # the mapping stays while the array is alive
    assert array.tobytes() == data


def test_sharded_with_index(tmp_path: Path) -> None:
    shards = []
    weight_map = {}
    for i in range(3):
        shard = tmp_path / f"model-{i + 1:05d}-of-00003.safetensors"
        tensors = {f"layers.{i}.{k}": ("BF16", [4, 2], random_bytes(16, 10 * i + k)) for k in range(4)}
        write_reference(shard, tensors)
        shards.append(shard)
        weight_map.update(dict.fromkeys(tensors, shard.name))
    write_index(tmp_path, weight_map, total_size=999)  # total_size is informational only
    (tmp_path / "stray.safetensors").write_bytes(b"not even a shard")  # not in the index: ignored
    with tensorfs.open_model(tmp_path) as model:
        assert_matches_reference(model, shards)
        assert model.shards == shards
    with tensorfs.open_model(tmp_path / INDEX_NAME) as model:
        assert len(model) == 12


def test_sharded_without_index_takes_every_safetensors_file(tmp_path: Path) -> None:
    shards = [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    write_reference(shards[0], {"x": ("F16", [3], random_bytes(6, 1))})
    write_reference(shards[1], {"y": ("I8", [5], random_bytes(5, 2)), "ünï/cødé": ("U8", [1], b"z")})
    (tmp_path / "sub").mkdir()
    write_reference(tmp_path / "sub" / "c.safetensors", {"z": ("U8", [1], b"z")})  # not recursive
    with tensorfs.open_model(tmp_path) as model:
        assert_matches_reference(model, shards)


def test_many_tensors(tmp_path: Path) -> None:
    tensors = {f"blk.{i}.w": ("U8", [i % 7], random_bytes(i % 7, i)) for i in range(3000)}
    path = tmp_path / "many.safetensors"
    write_reference(path, tensors)
    with tensorfs.open_model(path) as model:
        assert_matches_reference(model, [path])


def test_every_problem_of_every_shard_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.safetensors").write_bytes(raw_shard({"x": entry("F32", [2], 0, 4)}, bytes(4)))
    (tmp_path / "b.safetensors").write_bytes(b"short")
    (tmp_path / "c.safetensors").write_bytes(raw_shard({"ok": entry("U8", [1], 0, 1)}, b"x"))
    with pytest.raises(InvalidModelError) as caught:
        tensorfs.open_model(tmp_path)
    lines = str(caught.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"{tmp_path / 'a.safetensors'}: tensor 'x': data_offsets [0, 4] hold 4 bytes")
    assert lines[1].startswith(f"{tmp_path / 'b.safetensors'}: file is 5 bytes")


def test_a_name_in_two_shards_is_refused(tmp_path: Path) -> None:
    write_reference(tmp_path / "a.safetensors", {"w": ("U8", [1], b"a")})
    write_reference(tmp_path / "b.safetensors", {"w": ("U8", [1], b"b")})
    with pytest.raises(InvalidModelError, match=r"b\.safetensors: tensor 'w': is also in shard a\.safetensors"):
        tensorfs.open_model(tmp_path)


def test_unsafe_names_and_clashes_are_refused(tmp_path: Path) -> None:
    write_reference(tmp_path / "a.safetensors", {"../escape": ("U8", [1], b"a"), "w": ("U8", [1], b"b")})
    with pytest.raises(InvalidModelError, match=r"tensor '\.\./escape': name has a '\.\.' path component"):
        tensorfs.open_model(tmp_path)
    write_reference(tmp_path / "a.safetensors", {"w": ("U8", [1], b"a"), "w.sha256": ("U8", [1], b"b")})
    with pytest.raises(InvalidModelError, match=r"tensor 'w\.sha256': has the same path as a sidecar of tensor 'w'"):
        tensorfs.open_model(tmp_path)
    write_reference(tmp_path / "a.safetensors", {"m.w": ("U8", [1], b"a"), "m.w.b": ("U8", [1], b"b")})
    with tensorfs.open_model(tmp_path) as model:  # fine with slash layout
        assert len(model) == 2
    with pytest.raises(InvalidModelError, match="needs 'm/w' as a directory"):
        tensorfs.open_model(tmp_path, layout="dotted")


def test_clashes_are_reported_with_every_other_problem(tmp_path: Path) -> None:
    write_reference(
        tmp_path / "a.safetensors",
        {"../escape": ("U8", [1], b"a"), "p": ("U8", [1], b"b"), "p/q": ("U8", [1], b"c"), "w": ("U8", [1], b"d")},
    )
    write_reference(tmp_path / "b.safetensors", {"w.sha256": ("U8", [1], b"e"), "": ("U8", [1], b"f")})
    (tmp_path / "c.safetensors").write_bytes(b"short")
    with pytest.raises(InvalidModelError) as caught:
        tensorfs.open_model(tmp_path)
    a, b, c = (str(tmp_path / f"{x}.safetensors") for x in "abc")
    assert sorted(str(p) for p in caught.value.problems) == sorted(
        [
            f"{a}: tensor '../escape': name has a '..' path component",
            f"{b}: tensor '': name is empty",
            f"{a}: tensor 'p': is a file, but tensor 'p/q' needs 'p' as a directory",
            f"{b}: tensor 'w.sha256': has the same path as a sidecar of tensor 'w'",
            f"{c}: file is 5 bytes, too short to hold the 8-byte header length",
        ]
    )


def test_a_shard_file_name_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    write_reference(tmp_path / "ok.safetensors", {"a": ("U8", [1], b"a")})
    write_reference(tmp_path / "bad.safetensors", {"b": ("U8", [1], b"b")})
    os.rename(tmp_path / "bad.safetensors", os.fsencode(tmp_path) + b"/x\xff.safetensors")
    with pytest.raises(InvalidModelError) as caught:
        tensorfs.open_model(tmp_path)
    assert [str(p) for p in caught.value.problems] == [
        f"{tmp_path}/x\\udcff.safetensors: file name is not valid UTF-8; rename the shard"
    ]


def test_a_closed_model_says_so(tmp_path: Path) -> None:
    write_reference(tmp_path / "m.safetensors", {"w": ("F32", [2], bytes(8))})
    model = tensorfs.open_model(tmp_path / "m.safetensors")
    kept = model.array("w")
    model.close()
    for read in (model.array, model.raw):
        with pytest.raises(tensorfs.ModelClosedError, match=r"^File is closed: model .*m\.safetensors was closed"):
            read("w")
    assert kept.tobytes() == bytes(8) and model.info("w").nbytes == 8  # what was handed out, and the header, stay


INDEX_CASES = [
    ("shard missing", {"a": "a.safetensors", "b": "gone.safetensors"}, "names shard 'gone.safetensors', which does not exist"),
    ("path in shard name", {"a": "a.safetensors", "b": "../b.safetensors"}, "is not a plain file name"),
    ("mapped to the wrong shard", {"a": "b.safetensors", "b": "b.safetensors"}, "tensor 'a': the index maps it to b.safetensors"),
    ("tensor not in map", {"a": "a.safetensors", "b": "b.safetensors"}, "tensor 'a2': is not listed in the index's weight_map"),
    ("mapped tensor missing", {"a": "a.safetensors", "b": "b.safetensors", "c": "a.safetensors"}, "tensor 'c': the index maps it to a.safetensors, which does not hold it"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "weight_map", "words"), INDEX_CASES, ids=[c[0] for c in INDEX_CASES])
def test_index_must_agree_with_the_shards(tmp_path: Path, case: str, weight_map: dict[str, str], words: str) -> None:
    write_reference(tmp_path / "a.safetensors", {"a": ("U8", [1], b"a"), "a2": ("U8", [1], b"c")})
    write_reference(tmp_path / "b.safetensors", {"b": ("U8", [1], b"b")})
    write_index(tmp_path, {**weight_map, **({"a2": "a.safetensors"} if case != "tensor not in map" else {})})
    with pytest.raises(InvalidModelError) as caught:
        tensorfs.open_model(tmp_path)
    assert words in str(caught.value)


@pytest.mark.parametrize(
    ("content", "words"),
    [(b"{nope", "index is not valid JSON"), (b'{"weight_map": []}', "index has no weight_map object"),
     (b'{"weight_map": {"a": 1}}', "weight_map value is not a shard file name")],
)  # fmt: skip
def test_broken_index(tmp_path: Path, content: bytes, words: str) -> None:
    write_reference(tmp_path / "a.safetensors", {"a": ("U8", [1], b"a")})
    (tmp_path / INDEX_NAME).write_bytes(content)
    with pytest.raises(InvalidModelError, match=words):
        tensorfs.open_model(tmp_path)


def test_missing_and_empty_sources(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelError, match=re.escape(f"No such file or directory: {tmp_path / 'nope'}")):
        tensorfs.open_model(tmp_path / "nope")
    with pytest.raises(
        InvalidModelError, match=r"no \.safetensors, \.gguf, \.bin, \.pt or \.pth files in this directory"
    ):
        tensorfs.open_model(tmp_path)


# Opening a model in a fresh process: what it read (rchar: every read(2), .pyc files of imports too)
# and how much of the shard's mapping is resident, from the kernel's own accounts.
READ_WHEN_OPENED = """
import sys
from pathlib import Path
import tensorfs
open_model = tensorfs.open_model  # imported (tensorfs's names are, on first use) before the reads are counted
def rchar():
    return int(next(line.split()[1] for line in Path("/proc/self/io").read_text().splitlines() if line.startswith("rchar:")))
before = rchar()
with open_model(sys.argv[1], cache=False) as model:
    read = rchar() - before
    maps = Path("/proc/self/smaps").read_text().split("\\n")
    mapped = [i for i, line in enumerate(maps) if line.endswith(sys.argv[1])]
    resident = sum(int(line.split()[1]) for i in mapped for line in maps[i + 1 : i + 8] if line.startswith("Rss:"))
    print(len(model), sum(model.info(name).nbytes for name in model), read, len(mapped), resident)
"""


def test_opening_reads_no_tensor_data(tmp_path: Path) -> None:
    # A 2 GiB tensor in a sparse file: opening maps it, and reads nothing of it nor brings a page of it in.
    path = tmp_path / "big.safetensors"
    size = 2 << 30
    path.write_bytes(raw_shard({"big": entry("U8", [size], 0, size)}))
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + size)
    result = subprocess.run(
        [sys.executable, "-c", READ_WHEN_OPENED, str(path)], capture_output=True, text=True, check=True
    )
    tensors, nbytes, read, mappings, resident_kib = map(int, result.stdout.split())
    assert (tensors, nbytes, mappings) == (1, size, 1)
    assert read < 1 << 20  # the header, and the modules the opening imports: no tensor bytes
    assert resident_kib <= 8  # of the mapping: none of the tensor's pages


def test_reopen_refuses_a_shard_changed_since_it_was_validated(tmp_path: Path) -> None:
    # What `mount` hands its daemon: the validated model, mapped again there only if no shard changed.
    write_reference(tmp_path / "a.safetensors", {"w": ("U8", [4], b"abcd")})
    write_reference(tmp_path / "b.safetensors", {"v": ("U8", [2], b"ef")})
    with tensorfs.open_model(tmp_path) as model:
        saved = snapshot(model)
    with reopen(saved) as again:
        assert bytes(again.raw("w")) == b"abcd" and bytes(again.raw("v")) == b"ef"
    with open(tmp_path / "b.safetensors", "ab") as f:  # written to after validation
        f.write(b"x")
    with pytest.raises(InvalidModelError, match=r"b\.safetensors: changed while it was being validated; try again"):
        reopen(saved)
    write_reference(tmp_path / "new.tmp", {"v": ("U8", [2], b"ef")})
    os.replace(tmp_path / "new.tmp", tmp_path / "b.safetensors")  # the same bytes, but another file
    with pytest.raises(InvalidModelError, match="changed while it was being validated"):
        reopen(saved)


def test_info_fields(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    path.write_bytes(raw_shard({"a": entry("U8", [2], 0, 2), "b": entry("BF16", [1, 2], 2, 6)}, b"abcdef"))
    with tensorfs.open_model(path) as model:
        info = model.info("b")
        assert info == tensorfs.TensorInfo(
            name="b",
            dtype="BF16",
            shape=(1, 2),
            nbytes=4,
            shard=path,
            offset=8
            + len(json.dumps({"a": entry("U8", [2], 0, 2), "b": entry("BF16", [1, 2], 2, 6)}, separators=(",", ":")))
            + 2,
            data_offsets=(2, 6),
        )
        assert info.numpy_dtype == np.dtype(ml_dtypes.bfloat16)
        assert "b" in model and "c" not in model
        assert list(model) == ["a", "b"]
        with pytest.raises(KeyError):
            model.info("c")


def test_the_files_of_two_models_side_by_side_are_refused_in_one_line(tmp_path: Path) -> None:
    """Two LoRAs (or checkpoints) of the same tensors in one folder: one line naming both files, not
    one a tensor (64 lines for two of Stable Diffusion's LoRAs)."""
    tensors = {f"lora.{k}": ("U8", [1], bytes([k])) for k in range(64)}
    write_reference(tmp_path / "a_lora.safetensors", tensors)
    write_reference(tmp_path / "b_lora.safetensors", tensors)
    with pytest.raises(InvalidModelError) as caught:
        tensorfs.open_model(tmp_path)
    assert str(caught.value) == (
        f"{tmp_path / 'b_lora.safetensors'}: 64 of its tensors ('lora.0' ...) are also in shard a_lora.safetensors: "
        "the files of two models? name the one to open"
    )
