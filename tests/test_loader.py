"""The in-process loader: tensorfs.safe_open and load_file against the reference (safetensors), torch
tensors over the shards' bytes, verification in-process, prefetching, and nothing left behind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import json
import os
import struct
import sys
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch
import trio
from gguf_files import info, raw_gguf
from hypothesis import given
from hypothesis import strategies as st

import tensorfs
from conftest import wait_until
from helpers import (
    MIB,
    REFERENCE_WRITER_DTYPES,
    as_bytes,
    compare_safe_open,
    entry,
    every_dtype_tensors,
    fuzzing,
    in_byte_order,
    patience,
    random_bytes,
    raw_shard,
    refused_in_one_line,
    same_tensor,
    sharded_every_dtype,
    upload,
    write_reference,
)
from servers import Nginx, SeaweedFS
from tensorfs.formats import shape_text, table
from tensorfs.formats.dtypes import DTYPE_NAMED
from tensorfs.proof.manifest import DEFAULT_MANIFEST, format_manifest

names = st.text(st.sampled_from("abcxyz019._/é名"), min_size=1, max_size=12).filter(
    lambda n: not n.startswith(("/", ".")) and "//" not in n and not n.endswith("/") and "/." not in n
)
dtypes = st.sampled_from(sorted(REFERENCE_WRITER_DTYPES))
shapes = st.lists(st.integers(0, 4), max_size=3)


@st.composite
def models(draw: st.DrawFn) -> tuple[dict[str, tuple[str, list[int], bytes]], dict[str, str] | None]:
    from tensorfs.formats.dtypes import DTYPES

    chosen = draw(st.dictionaries(names, st.tuples(dtypes, shapes), min_size=1, max_size=6))
    tensors = {}
    for i, (name, (dtype, shape)) in enumerate(sorted(chosen.items())):
        if dtype == "F4":  # two values a byte: the writer wants an even last dimension
            shape = [*shape[:-1], 2 * shape[-1]] if shape else [2]
        count = int(np.prod(shape)) if shape else 1
        tensors[name] = (dtype, shape, random_bytes(count * DTYPES[dtype].bits // 8, i))  # a BOOL's bytes too
    metadata = draw(st.none() | st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2))
    return tensors, metadata


@fuzzing(60)
@given(models())
def test_safe_open_is_the_reference_on_generated_files(tmp_path: Path, model: Any) -> None:
    tensors, metadata = model
    path = tmp_path / "m.safetensors"
    write_reference(path, tensors, metadata)
    names_ok = True
    try:
        tensorfs.open_model(path, cache=False).close()
    except tensorfs.InvalidModelError:
        names_ok = False  # a name tensorfs refuses (it must stay a path in a mount): covered elsewhere
    if names_ok:
        for framework in ("pt", "np"):
            compare_safe_open(path, framework, cache=False)


def test_safe_open_is_the_reference_for_every_dtype_and_on_shards(tmp_path: Path) -> None:
    one = tmp_path / "one.safetensors"
    write_reference(one, every_dtype_tensors(seed=7), {"format": "pt", "ünï": "cødé"})
    for framework in ("pt", "torch", "np", "numpy"):
        compare_safe_open(one, {"torch": "pt", "numpy": "np"}.get(framework, framework))
    directory = tmp_path / "sharded"
    expected = sharded_every_dtype(directory)
    shards = sorted(directory.glob("*.safetensors"))
    with tensorfs.safe_open(directory, "pt") as ours:
        in_file_order = in_byte_order(
            [name for shard in shards for name in safetensors.safe_open(str(shard), "pt").offset_keys()], ours
        )
        assert ours.keys() == sorted(expected)
        assert ours.offset_keys() == in_file_order
        assert ours.metadata() is None  # the shards' __metadata__ differ: none is common
        for shard in shards:
            with safetensors.safe_open(str(shard), "pt") as theirs:
                for name in theirs.offset_keys():
                    same_tensor(ours.get_tensor(name), theirs.get_tensor(name))
    loaded = tensorfs.load_file(directory / "model.safetensors.index.json")
    assert list(loaded) == in_file_order
    assert {name: as_bytes(tensor) for name, tensor in loaded.items()} == expected


def test_beyond_the_reference(tmp_path: Path) -> None:
    """numpy gets ml_dtypes where the reference raises (fp8), and F4 as its raw bytes."""
    import ml_dtypes

    path = tmp_path / "m.safetensors"
    tensors = every_dtype_tensors(seed=3)
    write_reference(path, tensors)
    with tensorfs.safe_open(path, "np") as ours:
        for name, dtype in (("t.f8_e4m3", ml_dtypes.float8_e4m3fn), ("t.f8_e8m0", ml_dtypes.float8_e8m0fnu)):
            with pytest.raises(AttributeError):  # numpy has no such dtype of its own
                safetensors.safe_open(str(path), "np").get_tensor(name)
            array = ours.get_tensor(name)
            assert array.dtype == dtype and array.shape == (3, 4) and as_bytes(array) == tensors[name][2]
        f4 = ours.get_tensor("t.f4")
        assert f4.dtype == np.uint8 and as_bytes(f4) == tensors["t.f4"][2]


@pytest.mark.parametrize("framework", ["np", "pt"])
def test_a_tensor_given_as_raw_bytes_is_not_sliced(tmp_path: Path, framework: str) -> None:
    """An F6 tensor (8 values in 6 bytes) comes as its raw bytes where the framework has no such dtype:
    a slice of its values is not a slice of those bytes. The reference refuses it; so must tensorfs
    (it gives bytes 1 to 5 for values 1 to 7)."""
    path = tmp_path / "m.safetensors"
    path.write_bytes(raw_shard({"a": entry("F6_E2M3", [8], 0, 6)}, random_bytes(6, 1)))
    with safetensors.safe_open(str(path), framework) as theirs, pytest.raises(Exception):  # noqa: B017
        theirs.get_slice("a")[1:]
    with tensorfs.safe_open(path, framework) as ours, pytest.raises(tensorfs.SliceError, match="raw bytes"):
        ours.get_slice("a")[1:]


def test_an_element_in_numpy_is_a_0d_array_of_its_bytes_as_the_references(tmp_path: Path) -> None:
    """get_slice(name)[i, j] with numpy: the reference gives a 0-d array of the element's bytes. A numpy
    scalar would be another type, and would make a bool's byte 0 or 1."""
    path = tmp_path / "m.safetensors"
    tensors = {
        "b": ("BOOL", [3], b"\x00\x01\xd8"),
        "f": ("F32", [2, 2], random_bytes(16, 1)),
        "s": ("I16", [], b"4\x12"),
    }
    write_reference(path, tensors)
    keys = [("b", 2), ("b", (2,)), ("f", (1, 0)), ("f", (Ellipsis, 1, 1)), ("s", ()), ("s", Ellipsis)]
    with tensorfs.safe_open(path, "np") as ours, safetensors.safe_open(str(path), "np") as theirs:
        for name, key in keys:
            got, expected = ours.get_slice(name)[key], theirs.get_slice(name)[key]
            assert type(got) is type(expected) is np.ndarray, (name, key, got)
            assert got.shape == expected.shape == () and got.dtype == expected.dtype
            assert got.tobytes() == expected.tobytes()
        assert ours.get_slice("b")[2].tobytes() == b"\xd8"


def private_mappings_of(path: Path) -> list[tuple[int, int, str]]:
    """(start, end, permissions) of this process's mappings of `path`."""
    found = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append((start, end, fields[1]))
    return found


def test_torch_tensors_are_the_files_bytes_and_writing_them_never_writes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    data = random_bytes(4 * MIB, 1)
    write_reference(path, {"big": ("F32", [MIB], data), "small": ("U8", [3], b"abc")})
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with tensorfs.safe_open(path, "pt") as opened:
        big = opened.get_tensor("big")
        address = big.data_ptr()
        mappings = [m for m in private_mappings_of(path) if m[0] <= address < m[1]]
        assert mappings and mappings[0][2].endswith("p")  # no copy: on a private mapping of the file itself
        big[0] = 12345.0  # writable, with no warning (warnings are errors here)
        small = opened.get_tensor("small")
        small[:] = 0
        again = opened.get_tensor("big")
        assert again[0].item() == 12345.0  # one private mapping per shard, as safetensors' torch storage
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    assert big[0].item() == 12345.0 and as_bytes(big[1:]) == data[4:]  # alive after the model closed
    with tensorfs.safe_open(path, "pt") as opened:
        assert as_bytes(opened.get_tensor("big")) == data  # a new open sees the file's bytes


def test_load_file_is_a_state_dict_transformers_loads(tmp_path: Path) -> None:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37)
    for name, shard_size in (("one", "1GB"), ("sharded", "40KB")):
        directory = tmp_path / name
        BertModel(config).eval().save_pretrained(directory, max_shard_size=shard_size)
        by_transformers = BertModel.from_pretrained(directory).eval()
        ours = BertModel(config).eval()
        source = directory if name == "sharded" else directory / "model.safetensors"
        if name == "sharded":
            assert len(list(directory.glob("*.safetensors"))) > 1
        missing, unexpected = ours.load_state_dict(tensorfs.load_file(source), strict=False)
        assert not unexpected and not [key for key in missing if "position_ids" not in key]
        ids = torch.randint(0, 99, (2, 7))
        with torch.no_grad():
            assert torch.equal(ours(ids).last_hidden_state, by_transformers(ids).last_hidden_state)


# -- verification -----------------------------------------------------------------------------


def verified_model(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A model of three tensors and its manifest beside it."""
    directory = tmp_path / "model"
    directory.mkdir()
    tensors = {
        "a": ("U8", [2 * MIB], random_bytes(2 * MIB, 1)),
        "b": ("F32", [1000], random_bytes(4000, 2)),
        "c": ("I64", [3], random_bytes(24, 3)),
    }
    write_reference(directory / "model.safetensors", tensors)
    digests = {name: hashlib.sha256(data).hexdigest() for name, (_, _, data) in tensors.items()}
    (directory / DEFAULT_MANIFEST).write_text(format_manifest(digests))
    return directory, {name: data for name, (_, _, data) in tensors.items()}


def test_verified_tensors_load_and_a_forged_line_fails_that_tensor_alone(tmp_path: Path) -> None:
    directory, expected = verified_model(tmp_path)
    assert {k: as_bytes(v) for k, v in tensorfs.load_file(directory, verify=True).items()} == expected
    with tensorfs.safe_open(directory, "np", verify=True) as opened:
        assert as_bytes(opened.get_slice("a")[:10]) == expected["a"][:10]
    manifest = directory / DEFAULT_MANIFEST
    forged = manifest.read_text().replace(hashlib.sha256(expected["b"]).hexdigest(), "0" * 64)
    manifest.write_text(forged)
    assert_refused_alone(directory, "b", expected, verify=True)


def test_a_byte_flipped_on_disk_fails_that_tensor_alone(tmp_path: Path) -> None:
    directory, expected = verified_model(tmp_path)
    shard = directory / "model.safetensors"
    with tensorfs.open_model(shard, cache=False) as model:
        _, offset, nbytes = model.locate("c")
    content = bytearray(shard.read_bytes())
    content[offset + nbytes - 1] ^= 1  # the last byte of c
    shard.write_bytes(bytes(content))
    assert_refused_alone(directory, "c", expected, verify=directory / DEFAULT_MANIFEST)


def assert_refused_alone(directory: Path, bad: str, expected: dict[str, bytes], **options: Any) -> None:
    with tensorfs.safe_open(directory, "pt", **options) as opened:
        for _ in range(2):  # refused again, not once
            with pytest.raises(tensorfs.IntegrityError) as refused:
                opened.get_tensor(bad)
        assert refused.value.tensor == bad and refused.value.actual != refused.value.expected
        assert f"tensor '{bad}'" in str(refused.value) and len(str(refused.value).splitlines()) == 1
        with pytest.raises(tensorfs.IntegrityError):
            opened.get_slice(bad)
        with pytest.raises(tensorfs.IntegrityError):
            opened.model.array(bad)
        with pytest.raises(tensorfs.IntegrityError):
            opened.model.raw(bad)
        for name in expected:
            if name != bad:
                assert as_bytes(opened.get_tensor(name)) == expected[name]
        with pytest.raises(tensorfs.IntegrityError):
            opened.model.prefetch().wait()
        seen = []
        with pytest.raises(tensorfs.IntegrityError):
            for name, _ in opened.model.tensors(framework="pt"):
                seen.append(name)
        assert seen == [name for name in sorted(expected) if name < bad]
    with pytest.raises(tensorfs.IntegrityError, match=f"tensor '{bad}'"):
        tensorfs.load_file(directory, **options)


def test_verify_needs_a_manifest_and_reads_one_from_a_url(nginx: Nginx, tmp_path: Path) -> None:
    directory, expected = verified_model(tmp_path)
    manifest = (directory / DEFAULT_MANIFEST).read_bytes()
    (directory / DEFAULT_MANIFEST).unlink()
    with pytest.raises(tensorfs.TensorfsError, match="needs a manifest"):
        tensorfs.open_model(directory, verify=True)
    (nginx.root / "manifests").mkdir()
    (nginx.root / "manifests" / "m.sha256").write_bytes(manifest)
    loaded = tensorfs.load_file(directory, framework="np", verify=f"{nginx.url}/manifests/m.sha256")
    assert {k: as_bytes(v) for k, v in loaded.items()} == expected


# -- remote -----------------------------------------------------------------------------------


def test_remote_models_load_as_local_ones(
    nginx: Nginx, seaweedfs: SeaweedFS, bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    directory = tmp_path / "model"
    expected = sharded_every_dtype(directory)
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in expected.items()}
    (directory / DEFAULT_MANIFEST).write_text(format_manifest(digests))
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    upload(seaweedfs.store(bucket), "loader", directory)
    served = nginx.root / "loader"
    served.mkdir()
    for path in directory.iterdir():
        (served / path.name).write_bytes(path.read_bytes())
    sources = {
        f"s3://{bucket}/loader": tensorfs.RemoteOptions(
            cache_dir=tmp_path / "s3-cache", endpoint_url=seaweedfs.endpoint
        ),
        f"{nginx.url}/loader/model.safetensors.index.json": tensorfs.RemoteOptions(cache_dir=tmp_path / "http-cache"),
    }
    for source, remote in sources.items():
        loaded = tensorfs.load_file(source, remote=remote, verify=True)
        assert {name: as_bytes(tensor) for name, tensor in loaded.items()} == expected
        with tensorfs.safe_open(source, "pt", remote=remote) as opened:
            for name in opened.offset_keys():
                assert as_bytes(opened.get_tensor(name)) == expected[name]
            assert as_bytes(opened.get_slice("layers/1/w")[5:9]) == expected["layers/1/w"][5:9]
        del loaded, opened
        gc.collect()


# -- prefetching ------------------------------------------------------------------------------


@pytest.fixture
def many(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    path = tmp_path / "many.safetensors"
    tensors = {f"t{i:02d}": ("U8", [64 * 1024 + i], random_bytes(64 * 1024 + i, i)) for i in range(40)}
    write_reference(path, tensors)
    return path, {name: data for name, (_, _, data) in tensors.items()}


def test_prefetch_brings_everything_in_and_says_so(many: tuple[Path, dict[str, bytes]]) -> None:
    path, _ = many
    with tensorfs.open_model(path) as model:
        handle = model.prefetch()
        assert handle.wait(timeout=patience(60)) and handle.done()
        assert handle.bytes_done == handle.bytes_total == model.nbytes
        with pytest.raises(tensorfs.TensorNotFound):
            model.prefetch(["t01", "nope"])


def test_tensors_come_in_order_and_leaving_stops_what_is_ahead(
    many: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = many
    with tensorfs.open_model(path) as model:
        assert [(n, as_bytes(t)) for n, t in model.tensors(ahead=3)] == sorted(expected.items())
        names = list(reversed(model.names()))
        assert [n for n, _ in model.tensors(names, framework="pt", ahead=0)] == names
    release = threading.Event()
    brought: list[str] = []
    with tensorfs.open_model(path) as model:
        read_in = model.gate.bring_in

        def held(names: list[str]) -> None:
            brought.extend(names)
            if names[0] != "t00":
                release.wait(patience(30))
            read_in(names)

        monkeypatch.setattr(model.gate, "bring_in", held)
        for name, _ in model.tensors(ahead=8):  # t01 is being read (held), t02-t08 wait their turn
            assert name == "t00"
            wait_until(lambda: len(brought) >= 2, what="the tensor after t00 is being read")
            break
        release.set()
    assert brought == ["t00", "t01"]  # read one after the other, in order; the queued ones never began


def test_prefetch_reads_in_order_and_hashes_beside_the_reads(
    many: tuple[Path, dict[str, bytes]], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = many
    (path.parent / DEFAULT_MANIFEST).write_text(
        format_manifest({n: hashlib.sha256(b).hexdigest() for n, b in expected.items()})
    )
    events: list[tuple[str, str]] = []
    hashing = threading.Event()
    with tensorfs.open_model(path, verify=True, cache=False) as model:
        read_in, verify = model.gate.bring_in, model.gate.check
        names = list(reversed(model.names()))  # one tensor a run: neighbours join only forwards

        def reading(run: list[str]) -> None:
            events.append(("read", run[0]))
            if run[0] == names[2]:  # the lane goes on only once the first is being hashed elsewhere
                assert hashing.wait(patience(30))
            read_in(run)

        def verifying(name: str) -> None:
            if name == names[0]:
                hashing.set()
            verify(name)
            events.append(("verified", name))

        monkeypatch.setattr(model.gate, "bring_in", reading)
        monkeypatch.setattr(model.gate, "check", verifying)
        handle = model.prefetch(names)
        assert handle.wait(patience(60))
    assert [name for what, name in events if what == "read"] == names
    assert sorted(name for what, name in events if what == "verified") == sorted(names)


def test_atensors_under_asyncio_and_trio(many: tuple[Path, dict[str, bytes]]) -> None:
    path, expected = many

    async def collect(model: tensorfs.Model) -> list[tuple[str, bytes]]:
        return [(name, as_bytes(tensor)) async for name, tensor in model.atensors(framework="pt", ahead=2)]

    with tensorfs.open_model(path) as model:
        assert asyncio.run(collect(model)) == sorted(expected.items())
        assert trio.run(collect, model) == sorted(expected.items())


def _safetensors_of(path: Path, header: dict[str, Any], data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _checkpoint_of_shape(path: Path, shape: tuple[int, ...]) -> Path:
    """A checkpoint of one F32 tensor of `shape` over an empty storage (no element, whatever its shape)."""

    def long1(value: int) -> bytes:
        raw = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
        return b"\x8a" + bytes([len(raw)]) + raw

    storage = b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x00tQ"
    sizes = b"(" + b"".join(map(long1, shape)) + b"t"
    strides = b"(" + b"".join(map(long1, [1] * len(shape))) + b"t"
    rebuild = b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage + b"K\x00" + sizes + strides + b"\x89}tR"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}X\x01\x00\x00\x00t" + rebuild + b"s.")
        archive.writestr("archive/version", b"3\n")
        archive.writestr(zipfile.ZipInfo("archive/data/0"), b"")
    return path


BIG = (1 << 63) - 1
ABSURD_SHAPES: dict[str, tuple[Callable[[Path], Path], tuple[int, ...], str]] = {
    "safetensors": (
        lambda d: _safetensors_of(d / "a.safetensors", {"t": {"dtype": "U8", "shape": [0, 2**32, 2**32], "data_offsets": [0, 0]}}),
        (0, 2**32, 2**32), "U8",
    ),
    "safetensors of 65 dimensions": (
        lambda d: _safetensors_of(d / "d.safetensors", {"t": {"dtype": "U8", "shape": [1] * 65, "data_offsets": [0, 1]}}, b"x"),
        (1,) * 65, "U8",
    ),
    "gguf": (
        lambda d: write_bytes(d / "a.gguf", raw_gguf([], [info("t", [0, 2**62, 2**62], 0, 0)])),
        (2**62, 2**62, 0), "F32",
    ),
    "pytorch": (lambda d: _checkpoint_of_shape(d / "a.bin", (0, BIG, BIG)), (0, BIG, BIG), "F32"),
}  # fmt: skip
"""Files each format's own rules accept (the reference readers read them: safetensors 0.8,
llama.cpp's checks, torch.load) of a tensor numpy or torch cannot make an array of: its shape and dtype."""


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", list(ABSURD_SHAPES))
def test_shapes_numpy_or_torch_cannot_make_are_refused_in_every_format(case: str, tmp_path: Path) -> None:
    """Such a tensor has no element, or one byte: validated by its format's rules alone, load_file met
    numpy's or torch's own error. Every format's table passes one rule (formats/table.py), which
    refuses it, naming the file and the tensor, in one line."""
    make, shape, dtype = ABSURD_SHAPES[case]
    path = make(tmp_path)
    numpy_dtype = DTYPE_NAMED[dtype].numpy
    with pytest.raises(ValueError):  # the control: numpy cannot (nor torch, but beyond 64 dimensions)
        np.frombuffer(b"", dtype=numpy_dtype).reshape(shape) if 0 in shape else np.empty(shape, numpy_dtype)
    if 0 in shape:
        with pytest.raises(RuntimeError, match="overflow"):
            torch.empty(shape, dtype=torch.float32)
    expected = f"tensor 't': {len(shape)} dimensions" if len(shape) > 64 else f"tensor 't': shape {shape_text(shape)}"
    refused_in_one_line(path, expected, lambda path: tensorfs.load_file(path, cache=False))
    if case == "safetensors":  # just within: both make it
        within = _safetensors_of(
            tmp_path / "w.safetensors", {"t": {"dtype": "U8", "shape": [0, 2**31, 2**31], "data_offsets": [0, 0]}}
        )
        assert (
            tensorfs.load_file(within, framework="np")["t"].shape
            == tensorfs.load_file(within)["t"].shape
            == (0, 2**31, 2**31)
        )


def test_no_dtype_packs_more_elements_a_byte_than_the_shape_rule_counts() -> None:
    """The shape rule looks only at empty tensors, tensors of many dimensions and files past
    MAX_BYTES / DENSEST bytes (table.shape_problems): any other tensor spans at most DENSEST times its
    bytes, if no dtype holds more elements a byte than that."""
    for dtype in DTYPE_NAMED.values():
        per_byte = dtype.block_size / dtype.type_size if dtype.block_size > 1 else 8 / dtype.bits
        assert per_byte <= table.DENSEST, dtype.name


# -- errors and lifetime ----------------------------------------------------------------------


def test_bad_requests_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.safetensors"
    write_reference(path, {"w": ("F32", [2], random_bytes(8, 0))})
    with pytest.raises(tensorfs.TensorfsError, match="framework tf is invalid: tensorfs serves"):
        tensorfs.safe_open(path, "tf")
    with pytest.raises(tensorfs.TensorfsError, match="numpy arrays live on the CPU"):
        tensorfs.safe_open(path, "np", device="cuda:0")
    with tensorfs.safe_open(path, "pt") as opened:
        with pytest.raises(KeyError) as missing:
            opened.get_tensor("x")
        assert isinstance(missing.value, tensorfs.TensorNotFound)
        assert str(missing.value) == f"{path}: tensor 'x': not in the model"
    with pytest.raises(tensorfs.ModelClosedError):
        opened.get_tensor("w")
    with pytest.raises(tensorfs.ModelClosedError):
        opened.model.tensors()
    monkeypatch.setitem(sys.modules, "torch", None)  # as if torch were not installed
    with tensorfs.safe_open(path, "pt") as opened, pytest.raises(tensorfs.TensorfsError, match="tensorfs\\[torch\\]"):
        opened.get_tensor("w")


def open_descriptors() -> set[tuple[int, str]]:
    """This process's descriptors but its sockets, each with what it is open on: idle pooled
    connections of earlier tests (their clients' keep-alive) close when their servers time them out,
    in the middle of any later test."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor, closed since
            target = os.readlink(f"/proc/self/fd/{fd}")
            if not target.startswith("socket:"):
                found.add((int(fd), target))
    return found


def made_since(before: set[Any], now: set[Any]) -> set[Any]:
    """What is in `now` and was not in `before`. Never a count: what an earlier test left may end in
    the middle of a later one (trio keeps idle worker threads for 10 s), and a count then hides a
    thread or descriptor of this test's that did not end."""
    return now - before


def test_nothing_is_left_behind(many: tuple[Path, dict[str, bytes]]) -> None:
    path, _ = many
    gc.collect()
    fds, threads, maps = open_descriptors(), set(threading.enumerate()), len(private_mappings_of(path))
    for _ in range(20):
        with tensorfs.safe_open(path, "pt") as opened:
            tensors = [opened.get_tensor(name) for name in opened.keys()[:5]]
            list(opened.model.tensors(ahead=4))
            opened.model.prefetch().wait()
            assert made_since(threads, set(threading.enumerate()))  # (the threads ahead ran)
        assert made_since(threads, set(threading.enumerate())) == set()  # the threads ahead end with the model
        assert made_since(fds, open_descriptors()) == set()
        assert len(private_mappings_of(path)) == maps + 1  # kept by the tensors alive...
        del tensors
        gc.collect()
        assert len(private_mappings_of(path)) == maps  # ...and gone with them
    loaded = tensorfs.load_file(path)
    assert made_since(fds, open_descriptors()) == set() and made_since(threads, set(threading.enumerate())) == set()
    del loaded
    gc.collect()
    assert len(private_mappings_of(path)) == maps


def test_ml_dtypes_is_imported_only_for_its_dtypes(tmp_path: Path) -> None:
    """A model of numpy's own dtypes is read without importing ml_dtypes (its import is most of a
    cold first tensor's time); a BF16 tensor imports it."""
    import subprocess

    path = tmp_path / "m.safetensors"
    write_reference(path, {"w": ("F32", [2], random_bytes(8, 0)), "b": ("BF16", [2], random_bytes(4, 1))})
    code = (
        "import sys, tensorfs\n"
        "with tensorfs.safe_open(sys.argv[1], 'np') as f:\n"
        "    f.get_tensor('w')\n"
        "    print('ml_dtypes' in sys.modules)\n"
        "    print(f.get_tensor('b').dtype)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "bfloat16"]


def test_torch_is_imported_only_for_torch_tensors(tmp_path: Path) -> None:
    import subprocess

    path = tmp_path / "m.safetensors"
    write_reference(path, {"w": ("F32", [2], random_bytes(8, 0))})
    code = (
        "import sys, tensorfs\n"
        "with tensorfs.safe_open(sys.argv[1], 'np') as f: f.get_tensor('w')\n"
        "print('torch' in sys.modules)\n"
        "with tensorfs.safe_open(sys.argv[1], 'pt', device='meta') as f: print(f.get_tensor('w').device)\n"
    )
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "meta"]  # another device than the CPU: a copy there
