"""Model builders for the tests: the reference writer (safetensors) and hand-made bytes."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import safetensors

from tensorfs.header import ShardHeader
from tensorfs.model import INDEX_NAME

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
    from tensorfs.dtypes import DTYPES

    found = DTYPES[dtype].numpy
    return found if found is not None else np.uint8


def write_index(directory: Path, weight_map: Mapping[str, str], total_size: int = 0) -> None:
    document = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    (directory / INDEX_NAME).write_text(json.dumps(document))


MIB = 1 << 20


def mib_sharded_model(directory: Path, shards: int) -> Path:
    """`shards` shards of four 1-4 MiB U8 tensors (t{shard}.{k}), with an index."""
    directory.mkdir()
    weight_map = {}
    for s in range(shards):
        shard = directory / f"s{s}.safetensors"
        tensors = {f"t{s}.{k}": ("U8", [(k + 1) * MIB], random_bytes((k + 1) * MIB, 10 * s + k)) for k in range(4)}
        write_reference(shard, tensors)
        weight_map.update(dict.fromkeys(tensors, shard.name))
    write_index(directory, weight_map)
    return directory


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


def errno_of_reading(path: Path) -> int | None:
    """The errno reading `path` fails with; None when it reads."""
    try:
        path.read_bytes()
    except OSError as exc:
        return exc.errno
    return None
