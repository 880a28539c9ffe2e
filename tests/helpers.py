"""Model builders for the tests (the reference writer, hand-made bytes), and readers that take part in faults."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import pickle
import platform
import random
import re
import secrets
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import zipfile
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import crc32c
import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, seed, settings

from tensorfs.errors import InvalidModelError
from tensorfs.formats import ShardHeader
from tensorfs.sources.index import INDEX_NAME
from tensorfs.testing.servers import free_ports

# safetensors dtype -> the name safetensors.serialize takes; the F6 types it cannot write.
REFERENCE_WRITER_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
    "C64": "complex64",
}

Tensor = tuple[str, Sequence[int], bytes]  # (dtype, logical shape, raw bytes)


def random_bytes(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def write_reference(path: Path, tensors: Mapping[str, Tensor], metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` with the reference writer (safetensors.serialize_file)."""
    keep = []
    specs = {}
    for name, (dtype, shape, data) in tensors.items():
        buffer = np.frombuffer(data, dtype=np.uint8).copy() if data else np.zeros(1, dtype=np.uint8)
        keep.append(buffer)
        storage_shape = list(shape)
        if dtype == "F4":  # the writer takes F4's storage shape and doubles the last dimension
            storage_shape[-1] //= 2
        specs[name] = safetensors.TensorSpec(
            dtype=REFERENCE_WRITER_DTYPES[dtype], shape=storage_shape, data_ptr=buffer.ctypes.data, data_len=len(data)
        )
    safetensors.serialize_file(specs, str(path), metadata=dict(metadata) if metadata is not None else None)


def raw_shard(header: bytes | Mapping[str, Any], data: bytes = b"", *, length: int | None = None) -> bytes:
    """A shard made by hand: an 8-byte length (given, or the header's), the header, the data."""
    if not isinstance(header, bytes):
        header = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(header) if length is None else length) + header + data


def entry(dtype: str, shape: Sequence[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def _reference_dtypes() -> dict[str, int]:
    """The reference reader's dtypes and the bits of each, from the reference itself: safetensors
    exposes no table of them (safetensors.torch's holds torch's alone), so the names are those its
    refusal of an unknown one lists, and each one's width the size it takes for 8 elements."""
    try:
        safetensors.deserialize(raw_shard({"a": entry("NO SUCH DTYPE", [1], 0, 1)}, b"x"))
    except Exception as exc:
        listed = str(exc).partition("expected one of")[2]
    else:
        raise AssertionError("the reference took a dtype it has not")
    names = re.findall(r"`([^`]+)`", listed.partition(" at line")[0])
    assert names, f"no dtype names in the reference's refusal: {listed!r}"
    bits = {}
    for name in names:
        for size in range(1, 129):
            try:
                safetensors.deserialize(raw_shard({"a": entry(name, [8], 0, size)}, bytes(size)))
            except Exception:
                continue
            bits[name] = size  # 8 elements of `size` bytes: `size` bits each
            break
    assert set(bits) == set(names), f"no width found for {set(names) - set(bits)}"
    return bits


REFERENCE_DTYPES = _reference_dtypes()
"""Every dtype name the reference reader knows, and its bits."""


def reference_accepts(path: Path) -> bool:
    try:
        with safetensors.safe_open(str(path), framework="np") as f:
            f.keys()
    except Exception:
        return False
    return True


def reference_tensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Every tensor of a shard as the reference reads it: dtype, shape, raw bytes."""
    return {
        name: (t["dtype"], list(t["shape"]), bytes(t["data"])) for name, t in safetensors.deserialize(path.read_bytes())
    }


Row = tuple[str, list[int], tuple[int, int], bytes]
"""One tensor of a parsed table: dtype, shape, data_offsets (relative to the data), raw bytes."""
Table = tuple[dict[str, Row], dict[str, str] | None]
"""A shard as a reader parses it: every tensor by (unescaped) name, and the `__metadata__`."""


def reference_table(path: Path) -> Table:
    """The shard as the reference reader parses it. Its API gives no offsets, so they are rebuilt from
    what it does give: its tensors in offset order (which it checked are contiguous from 0) and the
    length of each one's data; empty tensors sharing an offset get the same one whatever their order."""
    data = {name: bytes(t["data"]) for name, t in safetensors.deserialize(path.read_bytes())}
    tensors: dict[str, Row] = {}
    with safetensors.safe_open(str(path), framework="np") as f:
        begin = 0
        for name in f.offset_keys():
            view = f.get_slice(name)
            end = begin + len(data[name])
            tensors[name] = (view.get_dtype(), list(view.get_shape()), (begin, end), data[name])
            begin = end
        metadata = f.metadata()
    assert set(tensors) == set(data)
    return tensors, metadata


def header_table(header: ShardHeader, content: bytes) -> Table:
    """The shard as tensorfs parsed it into `header`; each tensor's bytes taken from the file's
    `content` where tensorfs says they are."""
    tensors: dict[str, Row] = {}
    for begin, end, name, dtype, shape in header.entries:
        assert name not in tensors
        start = header.data_start
        tensors[name] = (dtype.name, list(shape), (begin, end), content[start + begin : start + end])
    return tensors, header.metadata


# -- differential fuzzing: the suite's cases fixed, make fuzz's many more and fresh -------------

FUZZ_RANDOM = os.environ.get("TENSORFS_FUZZ_RANDOM") is not None
"""`make fuzz`: fresh cases each run, from FUZZ_SEED (TENSORFS_FUZZ_SEED replays a run)."""
FUZZ_SEED = int(os.environ.get("TENSORFS_FUZZ_SEED") or secrets.randbits(64)) if FUZZ_RANDOM else None
FUZZ_TIMES = int(os.environ.get("TENSORFS_FUZZ_TIMES", "1"))
"""How many times its suite's count of cases each differential fuzz runs (`make fuzz`: FUZZ_TIMES)."""
FUZZ_REPLAY = f"TENSORFS_FUZZ_RANDOM=1 TENSORFS_FUZZ_SEED={FUZZ_SEED} TENSORFS_FUZZ_TIMES={FUZZ_TIMES}"
"""What replays this run's fuzz (the conftest says it at the start and the end of a random run)."""

_Test = TypeVar("_Test", bound=Callable[..., Any])


def fuzzing(examples: int) -> Callable[[_Test], _Test]:
    """Hypothesis's settings for a differential fuzz of `examples` cases (FUZZ_TIMES as many).

    In the suite the cases are derandomized: the same ones each run, so a failure is one of them.
    Under `make fuzz` (TENSORFS_FUZZ_RANDOM) they are drawn from FUZZ_SEED, fresh each run and
    said, so that a failure can be replayed. Only then a @seed: one would override derandomize.
    No example database: nothing is written into the working directory.
    """

    def apply(test: _Test) -> _Test:
        chosen: _Test = settings(
            max_examples=examples * FUZZ_TIMES,
            deadline=None,
            database=None,
            derandomize=not FUZZ_RANDOM,
            suppress_health_check=list(HealthCheck),
        )(test)
        return seed(FUZZ_SEED)(chosen) if FUZZ_SEED is not None else chosen

    return apply


NAME_RULES = {
    "an empty name": r"name is empty",
    "a NUL in a name": r"name contains a NUL character",
    "a lone surrogate": r"name is not valid Unicode \(it holds a lone surrogate\)",
    "an absolute path": r"name is an absolute path",
    "an empty, . or .. component": r"name has (an empty|a '\.'|a '\.\.') path component",
    "an empty component under --layout dotted": (
        r"(name|component '.*') (begins with '\.'|ends with '\.'|holds '\.\.'), "
        r"which --layout dotted makes an empty path component"
    ),
    "the reserved .tensorfs/": r"names beginning with '\.tensorfs/' are reserved for tensorfs",
    "a directory name over 255 bytes": r"directory name '.*\.\.\.' is over 255 bytes",
    "a file name over 255 bytes with its sidecar's suffix": (
        r"file name is \d+ bytes; with its '\.meta\.json' sidecar it would pass the 255-byte limit"
    ),
    "a tensor on a sidecar's path": r"has the same path as a sidecar of tensor '.*'",
    "a file needed as a directory": (
        r"is a file, but tensor '.*' needs '.*' as a directory|needs '.*' as a directory, but it is a sidecar of tensor '.*'"
    ),
    "two names on one path": r"maps to the same path '.*' as tensor '.*'",
}
"""What tensorfs refuses of names that any format's reader takes, each must stay a safe path in a mount
(names.py, docs/guarantees.md): a rule's name, and the pattern its refusal's reason is, whole."""


def cited_rule(reason: str, rules: Mapping[str, str]) -> str | None:
    """The rule of `rules` (name -> pattern) whose pattern the refusal's reason is, whole; None when
    it is none of them (a refusal no stricter rule explains)."""
    for rule, pattern in rules.items():
        if re.fullmatch(pattern, reason, re.DOTALL):
            return rule
    return None


def unexplained(problems: Sequence[Any], rules: Mapping[str, str]) -> list[str]:
    """The reasons of `problems` (an InvalidModelError's) that cite none of `rules`."""
    return [problem.reason for problem in problems if cited_rule(problem.reason, rules) is None]


def fuzz_split(split: Counter[str], ways: Sequence[str], note: str = "") -> str:
    """How the cases of a differential fuzz went, as one line (printed, and in assertions)."""
    cases = split.total()
    shares = ", ".join(f"{way} {split[way]} ({split[way] / max(cases, 1):.1%})" for way in ways)
    replay = f"; replay: {FUZZ_REPLAY}" if FUZZ_RANDOM else ""
    line = f"{cases} cases: {shares}{note}{replay}"
    print(line)
    return line


def every_dtype_tensors(seed: int = 0) -> dict[str, Tensor]:
    """One tensor of each dtype the reference writer knows, plus a 0-d and an empty one."""
    tensors: dict[str, Tensor] = {}
    for i, dtype in enumerate(REFERENCE_WRITER_DTYPES):
        bits = {"F4": 4}.get(dtype) or np.dtype(_numpy_for(dtype)).itemsize * 8
        shape = [3, 4]
        nbytes = 3 * 4 * bits // 8
        tensors[f"t.{dtype.lower()}"] = (dtype, shape, random_bytes(nbytes, seed + i))
    tensors["scalar"] = ("F32", [], random_bytes(4, seed + 100))
    tensors["empty"] = ("F16", [0, 5], b"")
    tensors["ünïcødé/名前.weight"] = ("I32", [2], random_bytes(8, seed + 101))
    return tensors


def _numpy_for(dtype: str) -> Any:
    from tensorfs.formats.dtypes import DTYPES

    found = DTYPES[dtype].numpy
    return found if found is not None else np.uint8


# -- the in-process loader against the reference's safe_open -----------------------------------


def as_bytes(tensor: Any) -> bytes:
    """A tensor's raw bytes, whatever it is (a numpy array or a torch tensor)."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tensor, torch.Tensor):
        if tensor.element_size() == 1:  # as bytes before any copy: a copy makes a bool's byte 0 or 1
            tensor = tensor.view(torch.uint8)
        flat = torch.empty(tensor.numel(), dtype=tensor.dtype).copy_(tensor.reshape(-1))  # stride 1, whatever it was
        return bytes(flat.view(torch.uint8).numpy().tobytes())
    return bytes(np.ascontiguousarray(tensor).tobytes())


def same_tensor(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    assert ours.dtype == theirs.dtype
    assert tuple(ours.shape) == tuple(theirs.shape)
    assert as_bytes(ours) == as_bytes(theirs)


SLICES: list[Callable[[int], Any]] = [
    lambda ndim: slice(None),
    lambda ndim: 0,
    lambda ndim: slice(1, None),
    lambda ndim: (Ellipsis, slice(None, 1)),
    lambda ndim: (slice(None), slice(None, None, 2)),
    lambda ndim: (slice(0, 1), Ellipsis),
    lambda ndim: (0,) * ndim,  # an element (of a 0-d tensor too): a 0-d array in numpy, not a scalar
]


def in_byte_order(names: list[str], opened: Any) -> list[str]:
    """`names` by shard and offset; empty tensors at one offset by name (the reference's order of
    those follows its hash map, not the file)."""
    shards = opened.model.shards
    return sorted(names, key=lambda n: (shards.index(opened.model.locate(n)[0]), opened.model.locate(n)[1:], n))


RAW_BYTES_DTYPES = {"np": {"F4", "F6_E2M3", "F6_E3M2"}, "pt": {"F6_E2M3", "F6_E3M2"}}
"""Dtypes whose tensors tensorfs gives as their raw bytes (uint8) in a framework that has no such dtype,
where the reference has no tensor at all ("beyond the reference", docs/python.md)."""
ML_DTYPES_IN_NUMPY = {"BF16", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2", "F8_E5M2FNUZ", "F8_E8M0"}
"""Dtypes numpy has not, which tensorfs gives as ml_dtypes arrays where the reference raises."""


def given_as_bytes(framework: str, dtype: str, shape: Sequence[int]) -> bool:
    """Whether tensorfs gives a tensor of `dtype` and `shape` as its raw bytes in `framework`:
    RAW_BYTES_DTYPES, and torch's F4 of an odd count (torch's F4 holds two values an element)."""
    return dtype in RAW_BYTES_DTYPES[framework] or (
        framework == "pt" and dtype == "F4" and (not shape or shape[-1] % 2 == 1)
    )


def beyond_the_reference(framework: str, dtype: str, shape: Sequence[int]) -> str | None:
    """Why the reference may refuse a tensor of `dtype` and `shape` (or a slice of it) that tensorfs
    gives, or None: then what the reference refuses of it, tensorfs refuses too. Each is named in
    docs/python.md."""
    if given_as_bytes(framework, dtype, shape) or (framework == "np" and dtype in ML_DTYPES_IN_NUMPY):
        return "a dtype the framework has not"
    if dtype == "F4":
        return "F4 sliced by its values"  # the reference slices by values, gives tensors of two values an element
    return None


def compare_safe_open(path: Path, framework: str, **options: Any) -> None:
    """Everything tensorfs.safe_open shows of the file `path` against the reference's safe_open: keys
    in both orders, metadata, each tensor's dtype, shape and bytes, and slices of it. Both ways:
    what the reference refuses (a tensor, a slice), tensorfs refuses too, but where tensorfs goes
    beyond it, by a rule named here: a dtype the framework has not (beyond_the_reference())."""
    import tensorfs

    raw = {name: bytes(t["data"]) for name, t in safetensors.deserialize(path.read_bytes())}
    with tensorfs.safe_open(path, framework, **options) as ours, safetensors.safe_open(str(path), framework) as theirs:
        assert ours.keys() == theirs.keys()
        assert ours.offset_keys() == in_byte_order(theirs.offset_keys(), ours)
        assert ours.metadata() == theirs.metadata()
        for name in theirs.offset_keys():
            reference = theirs.get_slice(name)
            mine = ours.get_slice(name)
            dtype, shape = reference.get_dtype(), reference.get_shape()
            assert mine.get_dtype() == dtype
            assert mine.get_shape() == shape
            beyond = beyond_the_reference(framework, dtype, shape)
            try:
                whole = theirs.get_tensor(name)
            except Exception as refused:
                assert beyond == "a dtype the framework has not", (name, dtype, refused)
                assert as_bytes(ours.get_tensor(name)) == raw[name]  # the bytes, as ml_dtypes or uint8 has them
            else:
                same_tensor(ours.get_tensor(name), whole)
            if given_as_bytes(framework, dtype, shape):
                for make in SLICES:  # raw bytes: a slice of them is not of the values (the reference refuses it too)
                    with pytest.raises(tensorfs.SliceError):
                        mine[make(len(shape))]
                continue
            if beyond is not None:
                continue  # F4 in torch: the two disagree by design on what an element is; ml_dtypes' arrays
            for make in SLICES:
                key = make(len(shape))
                try:
                    expected = reference[key]
                except Exception:
                    with pytest.raises(IndexError):  # refused as the reference refuses it (tests/test_dropin.py)
                        mine[key]
                    continue
                same_tensor(mine[key], expected)


def write_index(directory: Path, weight_map: Mapping[str, str], total_size: int = 0) -> None:
    document = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    (directory / INDEX_NAME).write_text(json.dumps(document))


MIB = 1 << 20


def files_of(directory: Path) -> dict[str, bytes]:
    """Every file under `directory`, by its path there: its bytes (a view, an export, a folder)."""
    return {
        path.relative_to(directory).as_posix(): path.read_bytes() for path in directory.rglob("*") if path.is_file()
    }


def random_shard(path: Path, sizes: Mapping[str, int], seed: int = 0) -> dict[str, bytes]:
    """A shard at `path` (its directory made) of U8 tensors of random bytes, written by the reference
    writer: each tensor's size by name, its bytes from its own seed (`seed` + its place: every chunk
    of every tensor differs from every other); their bytes by name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {name: random_bytes(size, seed + i) for i, (name, size) in enumerate(sizes.items())}
    write_reference(path, {name: ("U8", [len(blob)], blob) for name, blob in data.items()})
    return data


def sharded_model(directory: Path, shards: Mapping[str, Mapping[str, int]]) -> dict[str, bytes]:
    """Shards of random U8 tensors (file name -> its tensors' sizes, see random_shard; the i-th shard's
    seeds from 10 * i) in `directory`, with an index; every tensor's bytes by name."""
    data: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for i, (file, sizes) in enumerate(shards.items()):
        data.update(random_shard(directory / file, sizes, seed=10 * i))
        weight_map.update(dict.fromkeys(sizes, file))
    write_index(directory, weight_map)
    return data


def mib_sharded_model(directory: Path, shards: int) -> Path:
    """`shards` shards of four 1-4 MiB U8 tensors (t{shard}.{k}), with an index."""
    directory.mkdir()
    sharded_model(
        directory, {f"s{s}.safetensors": {f"t{s}.{k}": (k + 1) * MIB for k in range(4)} for s in range(shards)}
    )
    return directory


def zeros_sha256(size: int) -> str:
    """The SHA-256 of `size` zero bytes (a tensor in a hole of a sparse file)."""
    digest, block = hashlib.sha256(), bytes(16 * MIB)
    for offset in range(0, size, len(block)):
        digest.update(block[: min(len(block), size - offset)])
    return digest.hexdigest()


def model_bytes(source: Path) -> dict[str, bytes]:
    """Every tensor's bytes in a shard or a directory of shards, as the reference reader reads them
    (what tests compare a mount's files with)."""
    shards = sorted(source.glob("*.safetensors")) if source.is_dir() else [source]
    found: dict[str, bytes] = {}
    for shard in shards:
        for name, (_, _, data) in reference_tensors(shard).items():
            assert name not in found, f"{name} is in two shards"
            found[name] = data
    return found


def hub_api(root: Path, repo: str, files: Path, revision: str = "main") -> None:
    """The Hub's API for a repository whose files (at `revision`) are `files`, as nginx serves it
    (servers.HUB_API): the listing of its files and folders (one level down too), and its own page."""
    api = root / "api" / "models" / repo
    tree = api / "tree" / revision

    def listing(directory: Path, prefix: str) -> list[dict[str, object]]:
        return [
            {
                "type": "directory" if p.is_dir() else "file",
                "path": prefix + p.name,
                "size": 0 if p.is_dir() else p.stat().st_size,
            }
            for p in sorted(directory.iterdir())
        ]

    tree.mkdir(parents=True)
    tree.with_name(f"{revision}.json").write_text(json.dumps(listing(files, "")))
    for sub in (p for p in files.iterdir() if p.is_dir()):
        (tree / f"{sub.name}.json").write_text(json.dumps(listing(sub, f"{sub.name}/")))
    api.with_name(f"{api.name}.json").write_text(json.dumps({"id": repo}))


def upload(store: Any, prefix: str, directory: Path) -> None:
    """Put every file of `directory` into an object store under `prefix/`."""
    import obstore

    for path in sorted(directory.iterdir()):
        if path.is_file():
            obstore.put(store, f"{prefix}/{path.name}" if prefix else path.name, path.read_bytes())


def sharded_every_dtype(directory: Path) -> dict[str, bytes]:
    """Two shards and an index: every dtype, 0-d, empty, unicode names, and 3 MiB tensors across chunks;
    returns every tensor's bytes as the reference reader reads them."""
    directory.mkdir(parents=True)
    write_reference(directory / "model-00001-of-00002.safetensors", every_dtype_tensors(seed=3), {"format": "pt"})
    big = {f"layers/{i}/w": ("U8", [3 * MIB + i], random_bytes(3 * MIB + i, 40 + i)) for i in range(4)}
    write_reference(directory / "model-00002-of-00002.safetensors", big)
    expected: dict[str, bytes] = {}
    weight_map = {}
    for shard in sorted(directory.glob("*.safetensors")):
        for name, (_, _, data) in reference_tensors(shard).items():
            expected[name] = data
            weight_map[name] = shard.name
    write_index(directory, weight_map)
    return expected


def refused_in_one_line(path: Path, expected: str, opening: Callable[[Path], object]) -> None:
    """`opening(path)` raises an InvalidModelError of one line that names the file and says
    `expected`; `tensorfs validate` says the same in one line on stderr, exits 1, no traceback."""
    with pytest.raises(InvalidModelError) as raised:
        opening(path)
    message = str(raised.value)
    assert expected in message and message.count("\n") == 0 and message.startswith(str(path)), message
    done = cli("validate", "--no-cache", str(path))
    assert done.returncode == 1 and expected in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert "Traceback" not in done.stderr


def random_range_reads(
    mountpoint: Path, expected: Mapping[str, bytes], *, readers: int, reads: int, longest: int
) -> list[str]:
    """`readers` threads at once, each `reads` reads of random ranges (up to `longest` bytes) of
    random tensors of a mount, each tensor's file held open (seeded: the same reads each run); what
    went wrong, a line each: a read that failed, or bytes other than `expected`'s."""
    names = sorted(expected)
    failures: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        handles = {name: open(mountpoint / name, "rb") for name in names}  # noqa: SIM115
        try:
            for _ in range(reads):
                name = rng.choice(names)
                offset = rng.randrange(len(expected[name]))
                length = rng.randrange(1, longest)
                try:
                    got = os.pread(handles[name].fileno(), length, offset)
                except OSError as exc:
                    failures.append(f"{name} [{offset}, +{length}): {exc}")
                    continue
                if got != expected[name][offset : offset + length]:
                    failures.append(f"{name} [{offset}, +{length}): wrong bytes")
        finally:
            for handle in handles.values():
                handle.close()

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return failures


def errno_of_reading(path: Path) -> int | None:
    """The errno reading `path` fails with; None when it reads."""
    try:
        path.read_bytes()
    except OSError as exc:
        return exc.errno
    return None


# -- processes that take part in a fault: handshakes over pipes, never sleeps ------------------

PATIENCE = float(os.environ.get("TENSORFS_TEST_PATIENCE", "1"))
"""How many times longer than on a quiet machine this machine may take (TENSORFS_TEST_PATIENCE)."""


CONSUMER_LOOP = r"""
import contextlib, gc, io, json, os, sys, traceback

def held_on_fuse():
    # Whether this process holds a file of a FUSE mount open or mapped (a mount it would keep busy).
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split()[4] for line in f if line.split(" - ")[1].startswith("fuse")]
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd") if fd.isdigit()
            and os.path.exists(f"/proc/self/fd/{fd}")]
    with open("/proc/self/maps") as f:
        held += [line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6]
    return any(path == mount or path.startswith(mount + "/") for path in held for mount in mounts)

answers, commands = os.fdopen(int(sys.argv[1]), "w"), sys.stdin
for line in commands:
    script, argv, cwd = json.loads(line)
    out, err, code, here, scope = io.StringIO(), io.StringIO(), 0, os.getcwd(), {"__name__": "__main__"}
    try:
        os.chdir(cwd)
        sys.argv, sys.stdin = ["-c", *argv], io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            exec(compile(script, "<string>", "exec"), scope)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        err.write("" if exc.code is None or isinstance(exc.code, int) else str(exc.code))
    except BaseException:
        err.write(traceback.format_exc())
        code = 1
    finally:
        os.chdir(here)
    scope.clear()
    gc.collect()
    leave = held_on_fuse()  # as a process that ends would: it lets go of every mount before it answers
    answers.write(json.dumps([code, out.getvalue(), err.getvalue(), leave]) + "\n")
    answers.flush()
    if leave:
        break
"""


class Consumers:
    """Scripts of the heavy consumers (transformers, diffusers, sentence-transformers), each run as
    `python -c SCRIPT ARGS` with `env` runs it (its argv, environment and working directory, its
    output, its exit code) in a Python of their own that stays, one for each environment: their
    imports, most of each run's time, are made once a test process (stop() ends them: the session's
    fixture in conftest.py)."""

    def __init__(self) -> None:
        self._running: dict[tuple[tuple[str, str], ...], tuple[subprocess.Popen[str], Any, Any]] = {}

    def run(self, script: str, *args: str | Path, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
        key = tuple(
            sorted((name, value) for name, value in env.items() if name != "PYTEST_CURRENT_TEST")
        )  # (pytest's own)
        running = self._running.get(key)
        if running is None or running[0].poll() is not None:
            running = self._start(env)
            self._running[key] = running
        process, answers, said = running
        argv = [str(arg) for arg in args]
        assert process.stdin is not None
        process.stdin.write(json.dumps([script, argv, os.getcwd()]) + "\n")
        process.stdin.flush()
        ready, _, _ = select.select([answers], [], [], patience(300))
        line = answers.readline() if ready else ""
        if not line:  # no answer in time, or the interpreter died: said so, and started again next time
            self._stop(key)
            said.seek(0)
            raise AssertionError(f"the consumers' Python did not answer: {said.read()[-3000:]}")
        code, out, err, leaves = json.loads(line)
        if leaves:  # it held a mount's files still: it ends (the test's unmount must find the mount free)
            process.wait(timeout=patience(60))
            self._stop(key)
        return subprocess.CompletedProcess([sys.executable, "-c", "<script>", *argv], code, out, err)

    def _start(self, env: Mapping[str, str]) -> tuple[subprocess.Popen[str], Any, Any]:
        read, write = os.pipe()
        said = tempfile.TemporaryFile("w+")  # noqa: SIM115 (the interpreter's own words: open while it runs)
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", CONSUMER_LOOP, str(write)],
                stdin=subprocess.PIPE, stdout=said, stderr=said, text=True, env=dict(env),
                pass_fds=(write,),
            )  # fmt: skip
        finally:
            os.close(write)
        return process, os.fdopen(read), said

    def _stop(self, key: tuple[tuple[str, str], ...]) -> None:
        process, answers, said = self._running.pop(key)
        if process.poll() is None:
            process.kill()
        process.wait()
        for pipe in (process.stdin, answers, said):
            if pipe is not None:
                pipe.close()

    def stop(self) -> None:
        for key in list(self._running):
            self._stop(key)


CONSUMERS = Consumers()


def patience(seconds: float) -> float:
    """The deadline of a wait for what comes within `seconds` on a quiet machine: longer on a loaded
    one, by the processes waiting for each core (the load average of the last minute) and PATIENCE.
    A deadline only ends a wait for an event that should come (a handshake, a line, an exit): a slow
    machine gets more time, never a weaker assertion."""
    per_core = os.getloadavg()[0] / (os.cpu_count() or 1)
    return seconds * max(1.0, per_core) * PATIENCE


TENSORFS = (sys.executable, "-m", "tensorfs.cli")
"""The tensorfs command, as the tests run it: this Python, the code under test (PYTHONPATH)."""


def cli(*args: str, timeout: float = 120, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`tensorfs ARGS` in a process of its own: its exit code, stdout and stderr (text). One that has
    not ended by its deadline (`timeout` on a quiet machine: see patience()) fails the test.
    `kwargs` go to subprocess.run (env=, preexec_fn=, ...)."""
    return subprocess.run(
        [*TENSORFS, *args], capture_output=True, text=True, timeout=patience(timeout), check=False, **kwargs
    )


def read_line(fd: int, timeout: float, pending: bytearray) -> str:
    """The next line written to the pipe `fd` (bytes beyond it stay in `pending`); AssertionError at
    the deadline (`timeout` on a quiet machine: see patience())."""
    timeout = patience(timeout)
    deadline = time.monotonic() + timeout
    while b"\n" not in pending:
        left = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(left, 0))
        if not ready:
            raise AssertionError(f"no line within {timeout:g} s (so far: {bytes(pending)!r})")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError(f"the pipe closed before a whole line (so far: {bytes(pending)!r})")
        pending += chunk
    line, _, rest = bytes(pending).partition(b"\n")
    pending[:] = rest
    return line.decode()


# System calls by machine: the numbers /proc/PID/syscall shows for a process blocked in them.
_SYSCALLS = {"x86_64": {"pread64": 17, "flock": 73}, "aarch64": {"pread64": 67, "flock": 32}}


def blocked_in(pid: int, call: str) -> bool:
    """Whether the process sleeps inside the system call `call` (pread64, flock): it is in it, not about to be."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        number = Path(f"/proc/{pid}/syscall").read_text().split()[0]
    except (OSError, IndexError):
        return False
    if state not in ("S", "D") or number == "running":
        return False
    expected = _SYSCALLS.get(platform.machine(), {}).get(call)
    return expected is None or number == str(expected)


def blocked_in_pread(pid: int) -> bool:
    """Whether the process sleeps inside pread(2): a read of it is in flight, not about to be."""
    return blocked_in(pid, "pread64")


HANDSHAKE_READER = """
import hashlib, os, sys
path, mode = sys.argv[1], sys.argv[2]
try:
    fd = os.open(path, os.O_RDONLY)
    os.pread(fd, 4096, 0)
except OSError as exc:
    print("error", exc.errno, flush=True)
    sys.exit(1)
print("served", flush=True)
sys.stdin.readline()
size = os.fstat(fd).st_size
while True:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # what the kernel cached is asked of the daemon again
    print("reading", flush=True)
    digest, offset = hashlib.sha256(), 0
    try:
        while offset < size:
            chunk = os.pread(fd, min(1 << 20, size - offset), offset)
            if not chunk:
                break
            digest.update(chunk)
            offset += len(chunk)
    except OSError as exc:
        print("error", exc.errno, flush=True)
        sys.exit(1)
    if mode != "forever":
        print("ok", digest.hexdigest(), flush=True)
        sys.exit(0)
"""


def reap(process: subprocess.Popen[Any]) -> None:
    """Kill a child if it still runs, wait for it, and close its pipes."""
    if process.poll() is None:
        process.kill()
    process.wait()
    for pipe in (process.stdin, process.stdout, process.stderr):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()


class _TalkingChild:
    """A process of a script that says lines on its stdout and waits for "go" on its stdin."""

    process: subprocess.Popen[bytes]
    _pending: bytearray

    def said(self, timeout: float = 30) -> str:
        assert self.process.stdout is not None
        return read_line(self.process.stdout.fileno(), timeout, self._pending)

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(b"go\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        """Kill it if it still runs, and reap it."""
        reap(self.process)


class HandshakeReader(_TalkingChild):
    """A reader in its own process that says what it has done: "served" once it holds the file open
    and has read from it, then (told to go) "reading" just before it reads the whole file again from
    the daemon (once, or with forever=True again and again until killed), then "ok <sha256>" or
    "error <errno>"."""

    def __init__(self, path: Path, *, forever: bool = False) -> None:
        self.path = path
        self.process = subprocess.Popen(
            [sys.executable, "-c", HANDSHAKE_READER, str(path), "forever" if forever else "once"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._pending = bytearray()

    @property
    def pid(self) -> int:
        return self.process.pid


ONE_READ = """
import hashlib, mmap, os, sys
path, offset, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
buffer = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT wants
try:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
except OSError as exc:
    print("error", exc.errno, flush=True)
    sys.exit(1)
print("open", flush=True)
sys.stdin.readline()
try:
    count = os.preadv(fd, [buffer], offset)
except OSError as exc:
    print("error", exc.errno, flush=True)
    sys.exit(1)
print("ok", hashlib.sha256(buffer[:count]).hexdigest(), flush=True)
"""


class OneRead(_TalkingChild):
    """A reader in its own process that makes one read of a mounted file, and one request of the daemon
    (O_DIRECT: no readahead, no read again after a failure): it says "open" once it holds the file
    open, then (told to go) reads `size` bytes at `offset` and says "ok <sha256>" or "error <errno>"."""

    def __init__(self, path: Path, offset: int, size: int = 64 << 10) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", ONE_READ, str(path), str(offset), str(size)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._pending = bytearray()


def certificate_for_loopback(directory: Path) -> tuple[Path, Path, Path]:
    """A certificate authority, and a certificate it signed for 127.0.0.1 with its key (PEM files,
    made by openssl in `directory`): (the authority, the certificate, the key). A client trusts the
    certificate with SSL_CERT_FILE set to the authority."""
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, request, extensions = (directory / name for name in ("cert.pem", "key.pem", "cert.csr", "ext.cnf"))
    extensions.write_text("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\n")
    for command in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=tensorfs test CA"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", request, "-subj", "/CN=127.0.0.1"],
        ["x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "2", "-extfile", extensions],
    ):  # fmt: skip
        subprocess.run(["openssl", *map(str, command)], capture_output=True, check=True)
    return ca, cert, key


HELD_COMMAND = """
import importlib, sys
import tensorfs.cli
module_name, _, path = sys.argv[1].partition(":")
owner_path, _, name = path.rpartition(".")
owner = importlib.import_module(module_name)
for part in filter(None, owner_path.split(".")):
    owner = getattr(owner, part)
real = getattr(owner, name)
when = eval("lambda *args, **kwargs: " + sys.argv[2])
def held(*args, **kwargs):
    if not held.said and when(*args, **kwargs):
        held.said = True
        print("held", flush=True)
        sys.stdin.readline()
    return real(*args, **kwargs)
held.said = False
setattr(owner, name, held)
sys.exit(tensorfs.cli.main(sys.argv[3:]))
"""
WRITING = "args[0].label == 'writing'"
"""A HeldCommand's `when` for a Progress's advance: held in an export's write, not in its validation."""


class HeldCommand(_TalkingChild):
    """`tensorfs ARGS...` in its own process, held the first time it calls `point` (module:Class.name,
    or module:name) with arguments for which the expression `when` (of `args` and `kwargs`) holds: it
    says "held" there and goes on once told to go; `ended()` waits for its end."""

    def __init__(self, point: str, *args: str, when: str = "True") -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HELD_COMMAND, point, when, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self._pending = bytearray()

    def ended(self, timeout: float = 120) -> tuple[int, str]:
        """(its exit status, what it wrote to standard error) once it has ended."""
        _, stderr = self.process.communicate(timeout=timeout)
        return self.process.returncode, stderr.decode()


def daemon_stats(mountpoint: Path) -> dict[str, Any]:
    """What a mount's daemon counts: its .tensorfs/stats.json."""
    stats: dict[str, Any] = json.loads((mountpoint / ".tensorfs" / "stats.json").read_bytes())
    return stats


def fingerprints_pending(mountpoint: Path) -> int:
    """Bytes a mount served whose fingerprints its daemon has still to take (they are taken every
    second, off the serving path): a shard whose status changes before they are is refused."""
    pending: int = daemon_stats(mountpoint)["sources"]["fingerprints"]["pending_bytes"]
    return pending


def invalidated(mountpoint: Path, times: int = 1) -> None:
    """Wait until the mount's daemon has had the kernel drop what it caches of changed shards' files
    `times` times (its counter, not the effect: a test then asserts the effect at once, and fails at
    once when it is not there)."""
    from conftest import wait_until

    wait_until(
        lambda: daemon_stats(mountpoint)["invalidations"] >= times, what="the kernel told to drop the shard's pages"
    )


def remote_stats(mountpoint: Path) -> dict[str, int]:
    """What a mount's daemon counts of its remote sources (stats.json's sources.remote)."""
    remote: dict[str, int] = daemon_stats(mountpoint)["sources"]["remote"]
    return remote


def free_port() -> int:
    """A port free on 127.0.0.1 now."""
    return free_ports(1)[0]


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus endpoint's samples on 127.0.0.1:`port`, by name and labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=patience(30)).read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def reads_in_handlers(mountpoint: Path) -> int:
    """Reads a daemon has begun to answer and not answered yet (its counters: begun, less answered or
    failed): requests inside its running handlers, not waiting in the kernel's queue."""
    stats = daemon_stats(mountpoint)
    failed = sum(e["count"] for e in stats["errors"] if e["op"] == "read")
    begun: int = stats["requests"].get("read", 0)
    return begun - sum(stats["reads"].values()) - failed


def daemon_process(mountpoint: Path) -> dict[str, int]:
    """What a daemon says of its own process (stats.json): descriptors, threads, memory."""
    process: dict[str, int] = daemon_stats(mountpoint)["process"]
    return process


# glibc's malloc gives threads arenas of their own, each a heap reserved 64 MiB at a time (HEAP_MAX_SIZE
# on 64-bit) at a 64 MiB boundary: the part in use readable, the rest PROT_NONE. It keeps them all.
MALLOC_HEAP = 64 << 20


def daemon_resources(pid: int) -> tuple[int, int]:
    """(open file descriptors, memory mappings but threads' stacks and malloc's arenas) of a process.

    Worker threads come and go with the load (trio keeps idle ones a while), each with a stack and its
    guard page, which glibc keeps mapped after the thread ends (its stack cache, up to 40 MiB); a new
    thread may be given an arena of malloc's, kept for good. Neither is a leak; the rest is counted:
    what was mapped by hand or by malloc for a big buffer, and every file mapping.
    """
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    spans = []
    for line in lines:
        fields = line.split(maxsplit=5)
        start, end = (int(address, 16) for address in fields[0].split("-"))
        spans.append((start, end, fields[1], len(fields) == 6))
    counted = 0
    for i, (start, end, mode, named) in enumerate(spans):
        after = spans[i + 1] if i + 1 < len(spans) else None
        before = spans[i - 1] if i > 0 else None
        joined_after = after is not None and after[0] == end and not after[3]
        joined_before = before is not None and before[1] == start and not before[3]
        if named:
            counted += 1
        elif mode == "---p" and joined_after and after is not None and after[2] == "rw-p":
            continue  # a thread stack's guard
        elif mode == "rw-p" and joined_before and before is not None and before[2] == "---p" and start % MALLOC_HEAP:
            continue  # the stack above its guard
        elif mode == "rw-p" and start % MALLOC_HEAP == 0:
            continue  # an arena's heap, in use
        elif (
            mode == "---p"
            and joined_before
            and before is not None
            and before[0] % MALLOC_HEAP == 0
            and end % MALLOC_HEAP == 0
        ):
            continue  # the rest of its 64 MiB
        else:
            counted += 1
    return len(os.listdir(f"/proc/{pid}/fd")), counted


def descriptors_but_sockets(pid: int) -> int:
    """A process's open descriptors but its sockets (an HTTP pool's connections come and go as its
    server keeps them alive or closes them: no leak)."""
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed while listed
            count += not os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return count


def file_mappings(pid: int) -> list[str]:
    """The files a process has mapped, a line for each mapping."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sorted(line.split(maxsplit=5)[5] for line in lines if len(line.split(maxsplit=5)) == 6)


def threads_of(pid: int) -> list[str]:
    """What each thread of a process waits in (its wchan)."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            found.append(task.joinpath("wchan").read_text())
    return found


def thread_read_bytes(pid: int) -> dict[int, int]:
    """Bytes each thread of a process has read with read(2) and its kind (rchar), by thread id."""
    found = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, StopIteration):
            io = task.joinpath("io").read_text()
            found[int(task.name)] = int(next(line.split()[1] for line in io.splitlines() if line.startswith("rchar:")))
    return found


# Opening a model in a fresh process, and what it cost at its peak. Not ru_maxrss: it keeps the peak
# of whatever ran before (the imports; even the forking parent's, across exec), which hides anything
# below it. The kernel's peak (VmHWM) is reset to the resident size first, so the peak is the opening's.
PEAK_OF_OPENING = """
import sys
from pathlib import Path
import tensorfs
def status(key):
    return int(next(line.split()[1] for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith(key + ":")))
Path("/proc/self/clear_refs").write_text("5")
before = status("VmRSS")
with tensorfs.open_model(sys.argv[1]) as model:
    print(len(model), sum(model.info(name).nbytes for name in model), status("VmHWM") - before)
"""


def peak_of_opening(path: Path) -> tuple[int, int, int]:
    """(tensors, their bytes, KiB by which the resident size peaked above where it was) of opening `path`."""
    result = subprocess.run(
        [sys.executable, "-c", PEAK_OF_OPENING, str(path)], capture_output=True, text=True, check=True
    )
    tensors, nbytes, peak_kib = map(int, result.stdout.split())
    return tensors, nbytes, peak_kib


# -- what a bounded chunk cache holds on disk, at its largest -----------------------------------

_CACHE_BLOCKS_COUNTED = """
import os, sys, types
from tensorfs.sources.chunks.files import ObjectFile
from tensorfs.sources.chunks.room import Room
allocate = ObjectFile.allocate
def counted(self, offset, nbytes):
    cache = types.SimpleNamespace(directory=self.directory)  # what Room.disk_usage counts by
    before = Room.disk_usage(cache)
    allocate(self, offset, nbytes)
    line = f"{before} {nbytes} {Room.disk_usage(cache)}\\n".encode()
    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
ObjectFile.allocate = counted
import tensorfs.cli
sys.exit(tensorfs.cli.main(["mount", *sys.argv[2:]]))
"""


class CacheBlocks:
    """What a chunk cache's files hold on disk at every moment it can be at its largest: each time a
    process takes a chunk's blocks (ObjectFile.allocate, always under the lock every process takes
    to make room, so that nothing else grows the cache meanwhile), the cache's own count of its
    blocks (Room.disk_usage) before and after, said by the daemons of mounts made with
    `mount_command`. Never a sample: a sampler can only miss a peak."""

    def __init__(self, directory: Path) -> None:
        self.said = directory / "blocks-taken"

    @property
    def mount_command(self) -> tuple[str, ...]:
        """`tensorfs mount` (for Mounts.mount's `command`) whose daemon says so."""
        return (sys.executable, "-c", _CACHE_BLOCKS_COUNTED, str(self.said))

    def peak(self) -> int:
        """The most the cache's files held on disk (bytes), once blocks were taken. A taking takes the
        chunk's blocks then (give or take the file system's own blocks of the file's extents; none when
        they are taken already), so that nothing takes them later, unseen: where fallocate does nothing
        the writes would, and no taking would ever grow the count."""
        taken = [tuple(map(int, line.split())) for line in self.said.read_text().splitlines()]
        assert any(after >= before + nbytes - 2 * 4096 for before, nbytes, after in taken), taken
        return max(after for _, _, after in taken)


# -- a reference reader bounded in memory and time ----------------------------------------------

_BOUNDED = """
import importlib, pickle, resource, signal, struct, sys, warnings
sys.path.insert(0, sys.argv[3])
module, _, function = sys.argv[4].partition(":")
read = getattr(importlib.import_module(module), function)
status = open("/proc/self/status").read()
size = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmSize:"))) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + int(sys.argv[1]), size + int(sys.argv[1])))
def late(*_):
    raise TimeoutError("did not finish in time")
signal.signal(signal.SIGALRM, late)
for line in sys.stdin.buffer:
    signal.alarm(int(sys.argv[2]))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            answer = ("read", read(line[:-1].decode()))
    except Exception as exc:
        why = str(exc) if len(str(exc)) < 500 else str(exc)[:200] + " ... " + str(exc)[-250:]
        answer = ("refused", f"{type(exc).__name__}: {why}")
    finally:
        signal.alarm(0)
    data = pickle.dumps(answer)
    sys.stdout.buffer.write(struct.pack("<Q", len(data)) + data)
    sys.stdout.buffer.flush()
"""


class BoundedReference:
    """A reference reader in a process of its own, with `memory` bytes more than it started with
    (its imports done) and `seconds` a file: what it cannot read within them it has not read. A
    reader that believes the counts a damaged file gives would otherwise take the machine's memory.

    `reader` names a function of a module of the tests ("module:function") that reads a file: read()
    returns its value (picklable) as ("read", value); a reader that raises, or dies, refused:
    ("refused", why).
    """

    def __init__(self, reader: str, memory: int = 512 << 20, seconds: int = 20) -> None:
        seconds = round(patience(seconds))  # a loaded machine's reader is not refusing: it is slow
        self._arguments = [str(memory), str(seconds), str(Path(__file__).parent), reader]
        self._seconds = seconds
        self._process: subprocess.Popen[bytes] | None = None

    def _started(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            threads = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}  # no memory reserved for more
            self._process = subprocess.Popen(
                [sys.executable, "-c", _BOUNDED, *self._arguments],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env={**os.environ, **threads},
            )
        return self._process

    def read(self, path: Path) -> tuple[str, Any]:
        process = self._started()
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(str(path).encode() + b"\n")
        process.stdin.flush()
        deadline = time.monotonic() + self._seconds + patience(60)  # its imports, the first time
        try:
            length = _read_exactly(process.stdout.fileno(), 8, deadline)
        except TimeoutError:  # stuck where its alarm cannot stop it (in C): it has not read the file either
            self.close()
            return ("refused", f"the reader did not finish within {self._seconds} s")
        if length is None:  # it died: that is no reading either (the next file has a new one)
            process.wait()
            return ("refused", f"the reader died ({process.returncode})")
        data = _read_exactly(process.stdout.fileno(), struct.unpack("<Q", length)[0], deadline)
        assert data is not None, "the bounded reader died mid-answer"
        answer: tuple[str, Any] = pickle.loads(data)
        return answer

    def close(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                if pipe is not None:
                    pipe.close()


def _read_exactly(fd: int, count: int, deadline: float) -> bytes | None:
    """`count` bytes from the pipe `fd`; None if it closes first; TimeoutError at the deadline."""
    found = bytearray()
    while len(found) < count:
        ready, _, _ = select.select([fd], [], [], max(deadline - time.monotonic(), 0))
        if not ready:
            raise TimeoutError("the bounded reader answered nothing in time")
        chunk = os.read(fd, count - len(found))
        if not chunk:
            return None
        found += chunk
    return bytes(found)


# -- CRC-32C forging: what a store that means to deceive a CRC can do ----------------------------

_CRC_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1  # Castagnoli's polynomial, reflected
    _CRC_TABLE.append(_c)
_CRC_TOP = {entry >> 24: index for index, entry in enumerate(_CRC_TABLE)}


def same_crc32c(original: bytes, changed: bytes) -> bytes:
    """`changed` (as long as `original`) with its last 4 bytes set so that its CRC-32C (the chunk
    cache's checksum) is `original`'s.

    A CRC is linear: the state the last four bytes must lead to is found by running the table
    backwards from the wanted CRC, and those bytes follow from the state before them.
    """
    assert len(changed) == len(original) >= 4
    before = crc32c.crc32c(changed[:-4]) ^ 0xFFFFFFFF
    state = crc32c.crc32c(original) ^ 0xFFFFFFFF
    for _ in range(4):
        index = _CRC_TOP[state >> 24]
        state = (((state ^ _CRC_TABLE[index]) << 8) & 0xFFFFFFFF) | index
    forged = changed[:-4] + (state ^ before).to_bytes(4, "little")
    assert crc32c.crc32c(forged) == crc32c.crc32c(original) and forged != original
    return forged


def records_edited(checkpoint: bytes, part: str, edits: list[tuple[int, int]]) -> bytes:
    """`checkpoint` (torch.save's) with bytes of its records whose names hold `part` ("/data.pkl", "/data/")
    changed (each edit's position taken modulo those records' bytes, laid end to end), and their CRC-32s
    made again where torch writes them (the data descriptor and the central directory): records that
    read as written."""
    data = bytearray(checkpoint)
    archive = zipfile.ZipFile(io.BytesIO(checkpoint))
    records = [info for info in archive.infolist() if part in info.filename and info.compress_size]
    spans = []
    for record in records:
        name_length, extra_length = struct.unpack_from("<HH", data, record.header_offset + 26)
        start = record.header_offset + 30 + name_length + extra_length
        spans.append((record, start))
    total = sum(record.compress_size for record in records)
    for position, value in edits:
        at = position % total
        for record, start in spans:
            if at < record.compress_size:
                data[start + at] = value
                break
            at -= record.compress_size
    for record, start in spans:
        crc = struct.pack("<I", zlib.crc32(data[start : start + record.compress_size]))
        descriptor = start + record.compress_size
        if record.flag_bits & 8:
            assert data[descriptor : descriptor + 4] == b"PK\x07\x08"
            data[descriptor + 4 : descriptor + 8] = crc
        else:
            data[record.header_offset + 14 : record.header_offset + 18] = crc
        entry = archive.start_dir
        while data[entry : entry + 4] == b"PK\x01\x02":  # the central directory's entries
            name_length, extra_length, comment_length = struct.unpack_from("<HHH", data, entry + 28)
            if data[entry + 46 : entry + 46 + name_length] == record.filename.encode():
                data[entry + 16 : entry + 20] = crc
            entry += 46 + name_length + extra_length + comment_length
    return bytes(data)


def damage_in_place(directory: Path, name: str, *, hidden: bool = False) -> None:
    """Flip a byte in the middle of tensor `name` of the model in `directory`, in place (its shard
    keeps its size and header). `hidden`: through a shared mapping, its mtime then set back, as its
    owner could hide a write (no inotify event; only the ctime moves)."""
    import tensorfs

    with tensorfs.open_model(directory, cache=False) as model:
        shard, offset, nbytes = model.locate(name)
    if hidden:
        write_through_a_mapping(Path(shard), offset + nbytes // 2)
        return
    with open(shard, "r+b") as f:
        f.seek(offset + nbytes // 2)
        byte = f.read(1)
        f.seek(offset + nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


def write_through_a_mapping(path: Path, offset: int) -> None:
    """Flip the byte at `offset` through a shared mapping, then set the mtime (and atime) back as
    they were: of the file's status, only its ctime moved."""
    import mmap

    before = path.stat()
    fd = os.open(path, os.O_RDWR)
    try:
        with mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mapping:
            mapping[offset] ^= 0xFF
    finally:
        os.close(fd)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert after.st_ctime_ns != before.st_ctime_ns


@contextlib.contextmanager
def small_disk(directory: Path, size: str) -> Iterator[Path]:
    """`directory` (made) a tmpfs of `size` ("3m") for the block, unmounted after (lazily: a daemon
    may still hold a file of it). Root only."""
    directory.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(directory)], check=True)
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)
