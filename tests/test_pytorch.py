"""PyTorch checkpoints behind the formats/ seam: tables torch.load(weights_only=True) (the reference
reader, torch==2.13.0) agrees with, byte for byte; pickles that would run something refused, with
nothing of them run; every zip rule in one line; every command, the mount, its safetensors view,
the loader, remote stores, and transformers reading a real model's checkpoint through the view."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import pickletools
import re
import shutil
import struct
import subprocess
import sys
import warnings
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from hypothesis import given
from hypothesis import strategies as st

import tensorfs
from conftest import Mounts
from helpers import (
    NAME_RULES,
    BoundedReference,
    cited_rule,
    cli,
    fuzz_split,
    fuzzing,
    patience,
    records_edited,
    refused_in_one_line,
    unexplained,
)
from servers import Nginx, SeaweedFS
from tensorfs.errors import InvalidModelError
from tensorfs.formats import pickled, pytorch

SAFETENSORS_NAME = {dtype: name for name, dtype in safetensors.torch._TYPES.items()}
"""torch dtype -> safetensors dtype name, from the reference library's own table."""
TORCH_DTYPES = [*SAFETENSORS_NAME, torch.float8_e8m0fnu]
"""Every dtype torch saves that safetensors has (and tensorfs: F8_E8M0 too)."""
SAFETENSORS_NAME[torch.float8_e8m0fnu] = "F8_E8M0"


def as_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def reference(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    """Each tensor as torch.load(weights_only=True) has it: dtype, shape, bytes; named as docs/formats.md
    says tensorfs names them (a state dict's keys; a dict or a list within adds its key or index and
    a '.'; what is not a tensor left out; a dict reached twice named once). What torch loads that is
    no dict is no state dict: refused."""
    loaded = torch.load(path, weights_only=True, map_location="cpu")
    if not isinstance(loaded, dict):
        raise TypeError(f"torch.load gives a {type(loaded).__name__}, not a state dict")
    found: dict[str, tuple[str, list[int], bytes]] = {}
    seen: set[int] = set()

    def walk(prefix: str, container: Any) -> None:
        if id(container) in seen:
            return
        seen.add(id(container))
        items = container.items() if isinstance(container, dict) else enumerate(container)
        for key, value in items:
            if not (isinstance(key, str) or (type(key) is int and abs(key) < 1 << 63)):
                continue
            if isinstance(value, torch.Tensor):
                found[f"{prefix}{key}"] = (SAFETENSORS_NAME[value.dtype], list(value.shape), as_bytes(value))
            elif isinstance(value, dict | list | tuple):
                walk(f"{prefix}{key}.", value)

    walk("", loaded)
    return found


def ours(source: Path | str, **options: Any) -> dict[str, tuple[str, list[int], bytes]]:
    with tensorfs.open_model(source, **options) as model:
        return {name: (model.info(name).dtype, list(model.info(name).shape), bytes(model.raw(name))) for name in model}


_OURS_BOUNDED = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[2]), int(sys.argv[2])))
import tensorfs
from tensorfs.errors import InvalidModelError
try:
    with tensorfs.open_model(sys.argv[1], cache=False) as model:
        found = {n: [model.info(n).dtype, list(model.info(n).shape), bytes(model.raw(n)).hex()] for n in model}
    print(json.dumps({"tensors": found}))
except InvalidModelError as exc:
    print(json.dumps({"refused": str(exc)}))
"""
BOUNDED_MEMORY = 2 << 30
"""The address space a hostile pickle's reading may take (the process's own included)."""


def ours_bounded(path: Path) -> dict[str, tuple[str, list[int], bytes]] | str:
    """ours(path, cache=False) in a process of its own, within a deadline and BOUNDED_MEMORY: the
    tensors read, or the refusal's one line. A pickle's rule deleted fails the test that makes its
    fault happen (TimeoutExpired, a MemoryError's traceback) instead of hanging the suite."""
    command = [sys.executable, "-c", _OURS_BOUNDED, str(path), str(BOUNDED_MEMORY)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=patience(60), check=False)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    answer = json.loads(done.stdout)
    if "refused" in answer:
        return str(answer["refused"])
    return {name: (dtype, shape, bytes.fromhex(data)) for name, (dtype, shape, data) in answer["tensors"].items()}


def every_dtype(seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict of every dtype, a scalar, empty tensors, tied weights, a slice at a storage offset, a Parameter."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for dtype in TORCH_DTYPES:
        name = str(dtype).removeprefix("torch.")
        raw = torch.randint(0, 256, (2 * 3 * torch.empty((), dtype=dtype).element_size(),), generator=generator)
        tensors[f"w.{name}"] = raw.to(torch.uint8).view(dtype).reshape(2, 3)
    base = torch.arange(24, dtype=torch.float32)
    tensors.update({
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "empty.scalar_shape": torch.zeros(3, 0, dtype=torch.int8),
        "embed.weight": base.reshape(4, 6),
        "lm_head.weight": base.reshape(4, 6),  # tied: the same storage
        "slice": base[6:12],  # a storage offset
        "row": base.reshape(4, 6)[2],
        "param": torch.nn.Parameter(torch.ones(3, 2)),
    })  # fmt: skip
    return tensors


def checkpoint(
    path: Path, pickled: bytes, storages: dict[str, bytes], *, archive: str = "archive",
    byteorder: bytes | None = b"little", method: int = zipfile.ZIP_STORED, extra: dict[str, bytes] | None = None,
) -> Path:  # fmt: skip
    """A checkpoint written by hand (zipfile, which torch.load reads): data.pkl, byteorder, data/KEY."""
    with zipfile.ZipFile(path, "w") as archive_file:
        archive_file.writestr(f"{archive}/data.pkl", pickled)
        archive_file.writestr(f"{archive}/version", b"3\n")
        if byteorder is not None:
            archive_file.writestr(f"{archive}/byteorder", byteorder)
        for key, data in storages.items():
            archive_file.writestr(zipfile.ZipInfo(f"{archive}/data/{key}"), data, compress_type=method)
        for name, data in (extra or {}).items():
            archive_file.writestr(f"{archive}/{name}", data)
    return path


def saved(path: Path, obj: Any, **options: Any) -> Path:
    torch.save(obj, path, **options)
    return path


def test_tables_are_torch_loads(tmp_path: Path) -> None:
    path = saved(tmp_path / "every.bin", every_dtype())
    expected = reference(path)
    found = ours(path)
    assert found == expected
    table = tensorfs.open_model(path)
    try:
        tied = {name: table.info(name).offset for name in ("embed.weight", "lm_head.weight")}
        assert len(set(tied.values())) == 1  # one storage, two files over the same bytes
        assert table.info("slice").offset == tied["embed.weight"] + 6 * 4
        assert table.format == "pytorch" and table.view_format == "safetensors"
    finally:
        table.close()


def test_nested_checkpoints_name_tensors_by_their_keys(tmp_path: Path) -> None:
    """A training checkpoint: the model's state dict under "model", an optimizer's state keyed by
    ints, an epoch number; tensors named by their keys joined with '.', the rest left out."""
    model = {"layer.weight": torch.ones(2, 2), "layer.bias": torch.zeros(2)}
    optimizer = {"state": {0: {"exp_avg": torch.full((2, 2), 3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    path = saved(tmp_path / "train.pt", {"model": model, "optimizer": optimizer, "epoch": 3})
    found = ours(path)
    assert sorted(found) == ["model.layer.bias", "model.layer.weight", "optimizer.state.0.exp_avg"]
    assert found["optimizer.state.0.exp_avg"][2] == as_bytes(torch.full((2, 2), 3.0))


# -- never run ---------------------------------------------------------------------------------


class RunsCommand:
    """What a hostile checkpoint holds: unpickled, it runs a command."""

    def __init__(self, function: Callable[..., Any], *args: Any) -> None:
        self.function, self.args = function, args

    def __reduce__(self) -> tuple[Any, ...]:
        return self.function, self.args


class Custom:
    def __init__(self) -> None:
        self.weight = torch.ones(2)


def hostile(marker: Path, tmp_path: Path) -> dict[str, tuple[Path, str, bool]]:
    """Checkpoints that would run something or make what is not a state dict: what each refusal
    names, and whether torch.load(weights_only=True) refuses it too."""
    touch = f"touch {marker}"
    cases: dict[str, tuple[Path, str, bool]] = {}

    def case(name: str, obj: Any, expected: str, **options: Any) -> None:
        cases[name] = (saved(tmp_path / f"{name}.bin", obj, **options), expected, True)

    case("os.system", {"w": torch.ones(1), "x": RunsCommand(os.system, touch)}, "'posix.system'")
    case("exec", RunsCommand(exec, f"open({str(marker)!r}, 'w')"), "'builtins.exec'")
    case("eval", {"w": RunsCommand(eval, f"open({str(marker)!r}, 'w')")}, "'builtins.eval'")
    case("popen", RunsCommand(subprocess.Popen, ["touch", str(marker)]), "'subprocess.Popen'", pickle_protocol=4)
    case("a module", torch.nn.Linear(2, 2), "'torch.nn.modules.linear.Linear'")
    case("a custom class", {"c": Custom()}, "'test_pytorch.Custom'")
    # Opcodes that make objects: INST calls the global it names; NEWOBJ a class's __new__; EXT1 a
    # global by its copyreg code.
    inst = b"(S'" + touch.encode() + b"'\nios\nsystem\n."
    cases["INST"] = (checkpoint(tmp_path / "inst.bin", inst, {}), "'os.system'", True)
    newobj = b"\x80\x02ccollections\nOrderedDict\n)\x81."
    cases["NEWOBJ"] = (checkpoint(tmp_path / "newobj.bin", newobj, {}), "opcode NEWOBJ", False)
    ext = b"\x80\x02\x82\x01."
    cases["EXT1"] = (checkpoint(tmp_path / "ext.bin", ext, {}), "opcode EXT1", False)
    rebuild = b"\x80\x02}X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n(cos\nsystem\n"
    cases["a global for a storage"] = (
        checkpoint(tmp_path / "ns.bin", rebuild + b"K\x00))\x89tRs.", {}),
        "'os.system'",
        True,
    )
    return cases


def test_hostile_pickles_are_refused_and_nothing_runs(mounts: Mounts, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    cases = hostile(marker, tmp_path)
    for name, (path, expected, torch_refuses) in cases.items():
        if torch_refuses:  # the reference refuses these too
            with pytest.raises(pickle.UnpicklingError), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # protocol 4 is not torch's: it says so
                torch.load(path, weights_only=True)
        done = mounts.run("validate", "--no-cache", str(path))
        assert done.returncode == 1 and done.stderr.count("\n") == 1, (name, done.stderr)
        assert done.stderr.startswith(f"error: {path}: data.pkl ") and expected in done.stderr, (name, done.stderr)
        assert "Traceback" not in done.stderr
        assert not marker.exists(), name
    path = cases["os.system"][0]
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    refused = mounts.attempt(path, mountpoint=mountpoint)
    assert refused.returncode == 1 and "'posix.system'" in refused.stderr and not os.path.ismount(mountpoint)
    assert not marker.exists()
    pickle.loads(pickle.dumps(RunsCommand(os.system, f"touch {marker}")))
    assert marker.exists()  # the control: what these files hold does run when unpickled


def test_pickles_cost_time_and_memory_in_proportion_to_their_length(tmp_path: Path) -> None:
    """Python's unpickler would take hours (int keys that all hash alike, a list copied again and
    again) or allocate gigabytes (a memo index of 2^31) on these few bytes; here each is done in
    one pass or refused."""
    prime = (1 << 61) - 1  # every multiple of it hashes to 0
    keys = b"".join(b"\x8a\x0a" + (k * prime).to_bytes(10, "little") + b"K\x00" for k in range(1, 200_001))
    colliding = b"\x80\x02}(" + keys
    path = checkpoint(tmp_path / "collide.bin", colliding + b"u.", {})
    assert ours_bounded(path) == {}  # a dict of 200,000 numbers: no tensors
    memo = b"\x80\x02}r\xff\xff\xff\x7f."  # LONG_BINPUT 2^31 - 1
    assert ours_bounded(checkpoint(tmp_path / "memo.bin", memo, {})) == {}
    pairs = b"](" + b"X\x01\x00\x00\x00aK\x00\x86" * 100_000 + b"e"
    again = b"\x80\x02" + pairs + b"q\x00" + b"0ccollections\nOrderedDict\nh\x00\x85R" * 20_000 + b"."
    path = checkpoint(tmp_path / "copies.bin", again, {})
    assert (
        ours_bounded(path)
        == f"{path}: data.pkl costs more than 16 items a byte of it to read: not what torch.save writes"
    )


def _shared_tree(depth: int) -> bytes:
    """Tuples t(k+1) = (t(k), t(k)) made through the memo (2^depth leaves in 9 bytes a level), kept in a
    list under "x"; then the pickle `_shared_tree(depth) + VALUE + b"s."` puts VALUE in the dict."""
    levels = b"h\x01h\x01\x86q\x01a" * depth  # BINGET 1 twice, TUPLE2, BINPUT 1, APPEND
    return b"\x80\x02}q\x00X\x01\x00\x00\x00x])q\x01a" + levels + b"s"


def _wrapped_rebuilds(count: int) -> bytes:
    """_rebuild_from_type_v2(_rebuild_from_type_v2, Tensor, (... torch.Size, Tensor, ((1, 2),), {}) ...):
    each call the next one's function, `count` deep."""
    outer = b"(h\x00ctorch\nTensor\nq\x01" + b"(h\x00h\x01" * (count - 1)
    inner = b"(ctorch\nSize\nh\x01K\x01K\x02\x86\x85}t" + b"}t" * (count - 1) + b"}t"
    call = b"ctorch._tensor\n_rebuild_from_type_v2\nq\x00" + outer + inner + b"R"
    return b"\x80\x02}X\x01\x00\x00\x00k" + call + b"s."


PICKLES_OF_SHARED_AND_DEEP_STRUCTURES: dict[str, tuple[bytes, str | None]] = {
    "a key of 2^100 leaves in 100 shared tuples": (_shared_tree(100) + b"h\x01K\x00s.", None),
    "a key of tuples 100,000 deep": (b"\x80\x02}q\x00)" + b"\x85" * 100_000 + b"K\x00s.", None),
    "640,000 nested dicts": (b"\x80\x02" + b"}X\x01\x00\x00\x00a" * 640_000 + b"}" + b"s" * 640_000 + b".", None),
    "a rebuild wrapped 100,000 times": (_wrapped_rebuilds(100_000), None),
    "a device of 2^100 leaves": (
        _shared_tree(100) + b"X\x01\x00\x00\x00dctorch\ndevice\nh\x01\x85Rs.",
        "torch.device of something other than a string",
    ),
    "a storage keyed by 2^100 leaves": (
        _shared_tree(100)
        + b"X\x01\x00\x00\x00s(X\x07\x00\x00\x00storagectorch\nFloatStorage\nh\x01X\x03\x00\x00\x00cpuK\x00tQs.",
        "storage a tuple: its key, location or size is not what torch writes",
    ),
}  # fmt: skip
"""Pickles of a few bytes a level whose structures a recursive walk or a text of them would take
forever over (each level doubles the leaves) or overflow the stack with; and what each is told."""


@pytest.mark.parametrize("case", list(PICKLES_OF_SHARED_AND_DEEP_STRUCTURES))
def test_shared_and_deep_structures_are_walked_once_in_a_loop(case: str, tmp_path: Path) -> None:
    """Each is read, or refused in one line, by `tensorfs validate` in a process of its own within a
    generous bound (a hang guard: a walk of the 2^100 leaves never ends, a recursive one overflows
    its stack into a traceback, the names of 640,000 nested dicts take 640,000^2 characters); and
    the work charged to the pickle's budget is a few items a byte of it."""
    data, refusal = PICKLES_OF_SHARED_AND_DEEP_STRUCTURES[case]
    path = checkpoint(tmp_path / "p.bin", data, {})
    done = subprocess.run(
        [sys.executable, "-m", "tensorfs.cli", "validate", "--no-cache", str(path)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    if refusal is None:
        assert (done.returncode, done.stderr) == (0, "") and "valid: 1 shard, 0 tensors" in done.stdout
        budget = pickled.Budget(len(data))
        assert pickled.tensors(pickled.load(data, budget), budget) == []
        assert budget.spent <= 3 * len(data), (budget.spent, len(data))
    else:
        assert done.returncode == 1 and done.stderr == f"error: {path}: data.pkl {refusal}\n"


def _nested_with_a_tensor_each(levels: int) -> bytes:
    """{"a": t, "b": {"a": t, "b": {... {"a": t}}}}, `levels` dicts, t one tensor named again through the memo."""
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump(_Rebuild("FloatStorage", "0", 4, 0, (2, 2), (2, 1)))
    tensor = out.getvalue()[2:-1] + b"r\x00\x00\x10\x00"  # LONG_BINPUT 2^20: past the pickler's own
    a, b, again = b"X\x01\x00\x00\x00a", b"X\x01\x00\x00\x00b", b"j\x00\x00\x10\x00"
    middle = (b"}(" + a + again + b) * (levels - 2)
    return b"\x80\x02}(" + a + tensor + b + middle + b"}(" + a + again + b"u" * levels + b"."


def test_names_are_charged_to_the_pickles_budget(tmp_path: Path) -> None:
    """A tensor in each of 3,000 nested dicts (a 50 KB pickle): names of 9 million characters
    ("b.b.b. ... .a"), made of what the pickle names again and again. Their making is charged to
    the budget, which refuses it (such names are no file names anyway); a hundred levels are read."""
    data = _nested_with_a_tensor_each(3_000)
    path = checkpoint(tmp_path / "names.bin", data, {"0": F32_BYTES})
    refused = "data.pkl costs more than 16 items a byte of it to read: not what torch.save writes"
    assert ours_bounded(path) == f"{path}: {refused}"
    done = cli("validate", "--no-cache", str(path), timeout=60)
    assert (done.returncode, done.stderr) == (1, f"error: {path}: {refused}\n")
    data = _nested_with_a_tensor_each(100)
    budget = pickled.Budget(len(data))
    found = pickled.tensors(pickled.load(data, budget), budget)
    assert [item.name for item in found] == ["b." * level + "a" for level in range(100)]
    path = checkpoint(tmp_path / "hundred.bin", data, {"0": F32_BYTES})
    assert ours(path) == reference(path)


# -- the archive's rules -------------------------------------------------------------------------


class _Rebuild:
    def __init__(self, *fields: Any) -> None:
        self.fields = fields

    def __reduce__(self) -> tuple[Any, ...]:
        storage_class, key, count, offset, shape, stride = self.fields
        storage = _Persistent(("storage", getattr(torch, storage_class), key, "cpu", count))
        return torch._utils._rebuild_tensor_v2, (storage, offset, shape, stride, False, {})


class _Persistent:
    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _Pickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _Persistent) else None


def state_pickle(storage_class: str, key: str, count: int, offset: int, shape: tuple[int, ...]) -> bytes:
    stride = tuple(int(np.prod(shape[i + 1 :])) for i in range(len(shape)))
    out = io.BytesIO()
    _Pickler(out, protocol=2).dump({"t": _Rebuild(storage_class, key, count, offset, shape, stride)})
    return out.getvalue()


def _central_entry(data: bytearray, name: bytes) -> int:
    """Where the central directory's entry of `name` begins."""
    position = 0
    while True:
        position = data.index(b"PK\x01\x02", position)
        length = struct.unpack_from("<H", data, position + 28)[0]
        if data[position + 46 : position + 46 + length] == name:
            return position
        position += 4


def _truncated(tmp_path: Path) -> Path:
    whole = saved(tmp_path / "whole.bin", {"t": torch.ones(64)}).read_bytes()
    (tmp_path / "truncated.bin").write_bytes(whole[: len(whole) // 2])
    return tmp_path / "truncated.bin"


def _another_zip(tmp_path: Path) -> Path:
    with zipfile.ZipFile(tmp_path / "other.bin", "w") as other:
        other.writestr("notes/readme.txt", "hello")
    return tmp_path / "other.bin"


def _scripted(tmp_path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit is deprecated, and still writes these
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(tmp_path / "script.pt"))
    return tmp_path / "script.pt"


def _crc_damaged(tmp_path: Path) -> Path:
    damaged = bytearray(saved(tmp_path / "crc.bin", {"layer": torch.ones(2)}).read_bytes())
    damaged[damaged.index(b"layer")] = ord("p")  # a name changed: the pickle reads, its CRC-32 does not match
    (tmp_path / "crc.bin").write_bytes(damaged)
    return tmp_path / "crc.bin"


def _overlapping(tmp_path: Path) -> Path:
    path = checkpoint(tmp_path / "overlap.bin", GOOD, {"0": F32_BYTES, "1": F32_BYTES})
    two = bytearray(path.read_bytes())
    struct.pack_into("<II", two, _central_entry(two, b"archive/data/0") + 20, 40, 40)  # into data/1's header
    path.write_bytes(two)
    return path


def _twice(tmp_path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns of the duplicate it writes
        return checkpoint(tmp_path / "twice.bin", GOOD, {"0": F32_BYTES}, extra={"data/0": F32_BYTES})


def _newline_in_a_name(tmp_path: Path) -> Path:
    path = checkpoint(tmp_path / "nl.bin", GOOD, {"0": F32_BYTES})
    named = bytearray(path.read_bytes())
    named[_central_entry(named, b"archive/data/0") + 46 + len("archive/da")] = ord("\n")  # in the directory alone
    path.write_bytes(named)
    return path


def _nul_in_a_name(tmp_path: Path) -> Path:
    path = checkpoint(tmp_path / "nul.bin", GOOD, {"0": F32_BYTES})
    named = bytearray(path.read_bytes())
    named[_central_entry(named, b"archive/byteorder") + 46 + len("archive/byte")] = 0
    path.write_bytes(named)
    return path


def _long_local_name(tmp_path: Path) -> Path:
    path = checkpoint(tmp_path / "long.bin", GOOD, {"0": F32_BYTES})
    content = bytearray(path.read_bytes())
    local = content.index(b"PK\x03\x04archive/data/0"[:4], content.index(b"archive/data/0") - 30)
    struct.pack_into("<H", content, local + 26, 0xFFFF)  # its name's length: past the end of the file
    path.write_bytes(content)
    return path


def _quantized(tmp_path: Path) -> Path:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, and still saved
        return saved(tmp_path / "q.bin", {"q": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)})


def _short_zip64_extra(tmp_path: Path) -> Path:
    """The last entry's sizes say "in the Zip64 extra field", whose header says 24 bytes and holds 8."""
    path = checkpoint(tmp_path / "extra.bin", GOOD, {"0": F32_BYTES})
    data = bytearray(path.read_bytes())
    end = data.rindex(b"PK\x05\x06")
    entry = _central_entry(data, b"archive/data/0")  # the last: its extra field ends where the end record begins
    struct.pack_into("<II", data, entry + 20, 0xFFFFFFFF, 0xFFFFFFFF)
    struct.pack_into("<H", data, entry + 30, 12)
    struct.pack_into("<I", data, end + 12, struct.unpack_from("<I", data, end + 12)[0] + 12)  # the directory's size
    data[end:end] = struct.pack("<HHQ", 1, 24, 16)
    path.write_bytes(data)
    return path


def _lying_locator(tmp_path: Path) -> Path:
    """torch.save's Zip64 locator, saying its end record is a byte before the classic one (past the file's end)."""
    data = bytearray(saved(tmp_path / "locator.bin", {"t": torch.ones(4)}).read_bytes())
    struct.pack_into("<Q", data, data.rindex(b"PK\x06\x07") + 8, data.rindex(b"PK\x05\x06") - 1)
    (tmp_path / "locator.bin").write_bytes(data)
    return tmp_path / "locator.bin"


def _header_past_the_end(tmp_path: Path) -> Path:
    data = bytearray(saved(tmp_path / "far.bin", {"t": torch.ones(4)}).read_bytes())
    entry = _central_entry(data, b"far/data/0")  # torch names its folder after the file
    struct.pack_into("<I", data, entry + 42, 0x7FFFFFFF)  # its local header's offset
    (tmp_path / "far.bin").write_bytes(data)
    return tmp_path / "far.bin"


GOOD = state_pickle("FloatStorage", "0", 4, 0, (2, 2))
F32_BYTES = bytes(16)
ZIP_CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "compressed": (lambda d: checkpoint(d / "z.bin", GOOD, {"0": F32_BYTES}, method=zipfile.ZIP_DEFLATED),
                   "is compressed (method 8)"),
    "legacy": (lambda d: saved(d / "legacy.bin", {"t": torch.ones(2)}, _use_new_zipfile_serialization=False),
               "legacy format (torch < 1.6"),
    "big-endian": (lambda d: checkpoint(d / "big.bin", GOOD, {"0": F32_BYTES}, byteorder=b"big"),
                   "big-endian checkpoint"),
    "truncated": (_truncated, "no zip end-of-central-directory record"),
    "another zip": (_another_zip, "no notes/data.pkl: not a PyTorch checkpoint"),
    "TorchScript": (_scripted, "a TorchScript archive"),
    "storage missing": (lambda d: checkpoint(d / "m.bin", GOOD, {}), "tensor 't': its storage 0 is not in"),
    "storage short": (lambda d: checkpoint(d / "s.bin", GOOD, {"0": F32_BYTES[:12]}), "holds 16 bytes, where"),
    "past its storage": (
        lambda d: checkpoint(d / "p.bin", state_pickle("FloatStorage", "0", 4, 2, (2, 2)), {"0": F32_BYTES}),
        "runs past the end of its storage",
    ),
    "not contiguous": (lambda d: saved(d / "t.bin", {"t": torch.ones(2, 3).t()}), "tensor 't': is not contiguous"),
    "complex128": (lambda d: saved(d / "c.bin", {"c": torch.zeros(2, dtype=torch.complex128)}),
                   "ComplexDoubleStorage (safetensors has no such dtype)"),
    "quantized": (_quantized, "a quantized tensor"),
    "data.pkl damaged": (_crc_damaged, "does not match its CRC-32"),
    "overlapping entries": (_overlapping, "overlaps"),
    "an entry twice": (_twice, "holds archive/data/0 twice"),
    "a newline in an entry's name": (_newline_in_a_name, "archive/da\\x0aa/0's local header is not where"),
    "a local header's name past the end": (_long_local_name, "archive/data/0's local header is not where"),
    # Names from an archive pass the one gate of names from outside (torch looks them up as they are):
    "a storage named out of its folder": (
        lambda d: checkpoint(d / "o.bin", state_pickle("FloatStorage", "../../x", 4, 0, (2, 2)), {"../../x": F32_BYTES}),
        "the zip holds an entry whose name has a '..' path component: archive/data/../../x",
    ),
    "a NUL in an entry's name": (_nul_in_a_name, "the zip holds an entry whose name contains a NUL character"),
    "not a state dict": (lambda d: checkpoint(d / "l.bin", pickle.dumps([1, 2], protocol=2), {}),
                         "holds a list, not a dict of tensors"),
    "a Zip64 extra field shorter than it says": (_short_zip64_extra, "says 24 bytes, past the end of its extra data"),
    "a Zip64 locator that lies": (_lying_locator, "Zip64 end record is not where its locator says"),
    "a local header past the end": (_header_past_the_end, "far/data/0's local header is not where the central"),
}  # fmt: skip
"""Checkpoints that break one rule each (made in a directory), and what the one line says."""


class _Rebuilt:
    """A tensor pickled as _rebuild_tensor_v2 with the arguments given after its storage's."""

    def __init__(self, *arguments: Any) -> None:
        self.arguments = arguments

    def __reduce__(self) -> tuple[Any, ...]:
        storage = _Persistent(("storage", torch.FloatStorage, "0", "cpu", 4))
        return torch._utils._rebuild_tensor_v2, (storage, *self.arguments)


def _rebuilt_with(*arguments: Any) -> Callable[[Path], Path]:
    def make(directory: Path) -> Path:
        out = io.BytesIO()
        _Pickler(out, protocol=2).dump({"t": _Rebuilt(*arguments)})
        return checkpoint(directory / "r.bin", out.getvalue(), {"0": F32_BYTES})

    return make


def _lazy_view(directory: Path) -> Path:
    lazy = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64).conj()  # saved as its bytes and a conj bit
    return saved(directory / "conj.bin", {"w": torch.ones(2), "c": lazy})


WHAT_TORCH_REFUSES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "protocol 4": (lambda d: saved(d / "p4.bin", {"t": torch.ones(2)}, pickle_protocol=4),
                   "uses the opcode FRAME, which torch.load(weights_only=True) does not read"),
    "requires_grad not a bool": (_rebuilt_with(0, (2, 2), (2, 1), 1, {}), "requires_grad is not a bool"),
    "too few arguments": (_rebuilt_with(0, (2, 2), (2, 1), False), "with 5 arguments"),
    "too many arguments": (_rebuilt_with(0, (2, 2), (2, 1), False, {}, None, None), "with 8 arguments"),
    "metadata not a dict": (_rebuilt_with(0, (2, 2), (2, 1), False, {}, 5), "metadata is not a dict"),
    "a list as a key": (lambda d: checkpoint(d / "k.bin", b"\x80\x02}(]K\x01u.", {}), "a dict's key is a list"),
    "a backslash in a global's name": (  # read as written, as torch reads it: no escape undone, no warning
        lambda d: checkpoint(d / "g.bin", b"\x80\x02c\\gos\nsystem\n.", {}),
        "names the global '\\\\gos.system'",
    ),
    "an unknown escape in a protocol 0 string": (  # Python's decoder warns of it: an error where warnings are
        lambda d: checkpoint(d / "s.bin", b"\x80\x02}q\x00S'a\\8b'\nK\x01s.", {}),
        "uses the opcode STRING, which torch.load(weights_only=True) does not read",
    ),
}  # fmt: skip
"""Pickles torch.load(weights_only=True) refuses though tensorfs read them once (the differential
fuzz found them), and what the one line says."""


@pytest.mark.parametrize("case", list(WHAT_TORCH_REFUSES))
def test_what_torch_refuses_of_a_pickle_is_refused(case: str, tmp_path: Path) -> None:
    make, expected = WHAT_TORCH_REFUSES[case]
    path = make(tmp_path)
    with pytest.raises(Exception) as theirs, warnings.catch_warnings():  # each fails its own way in torch
        warnings.simplefilter("ignore")  # protocol 4: torch says it is not its own
        torch.load(path, weights_only=True)
    assert not isinstance(theirs.value, InvalidModelError)
    refused_in_one_line(path, expected, lambda path: tensorfs.open_model(path, cache=False))


def test_a_lazy_conjugate_is_refused_not_served_as_its_bytes(tmp_path: Path) -> None:
    """A conjugate (or negative) view is saved as the bytes it views and a bit: torch.load applies the
    bit, and bytes served as they are would be other values than the tensor's."""
    path = _lazy_view(tmp_path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["c"].is_conj() and loaded["c"].resolve_conj().tolist() == [1 - 2j, 3 + 4j]
    refused_in_one_line(path, "tensor saved as a lazy conjugate", lambda path: tensorfs.open_model(path, cache=False))


@pytest.mark.parametrize("case", list(ZIP_CASES))
def test_each_rule_is_one_line_naming_the_file(case: str, tmp_path: Path) -> None:
    make, expected = ZIP_CASES[case]
    refused_in_one_line(make(tmp_path), expected, lambda path: tensorfs.open_model(path, cache=False))


def test_every_read_of_an_archive_is_inside_it(tmp_path: Path) -> None:
    """What an archive's records say is where to read, checked before it is read: a read past the
    end of a file would be told as a file that shrank (locally) or not sent (from a store)."""
    for case, (make, expected) in ZIP_CASES.items():
        data = make(tmp_path).read_bytes()

        def inside(offset: int, count: int, data: bytes = data, case: str = case) -> bytes:
            assert min(offset, count) >= 0 and offset + count <= len(data), (case, offset, count, len(data))
            return data[offset : offset + count]

        with pytest.raises(InvalidModelError, match=re.escape(expected)):
            pytorch.read_table(inside, len(data), "m.bin", "m.bin")


def test_what_the_reference_reads_of_hand_made_archives_is_read(tmp_path: Path) -> None:
    """The hand-made archives above differ from a good one in one thing: made right, both readers take it."""
    path = checkpoint(tmp_path / "good.bin", state_pickle("FloatStorage", "0", 4, 0, (2, 2)), {"0": bytes(range(16))})
    assert ours(path) == reference(path) == {"t": ("F32", [2, 2], bytes(range(16)))}
    no_byteorder = checkpoint(tmp_path / "old.bin", state_pickle("ByteStorage", "7", 3, 1, (2,)), {"7": b"abc"},
                              byteorder=None)  # fmt: skip
    assert ours(no_byteorder) == reference(no_byteorder) == {"t": ("U8", [2], b"bc")}


# -- the mount, its views, the commands ------------------------------------------------------------


def test_the_mount_serves_each_tensor_and_a_safetensors_view(mounts: Mounts, tmp_path: Path) -> None:
    path = saved(tmp_path / "every.bin", every_dtype())
    expected = reference(path)
    mountpoint = mounts.mount(path)
    for name, (dtype, shape, content) in expected.items():
        assert (mountpoint / name).read_bytes() == content, name
        meta = json.loads((mountpoint / f"{name}.meta.json").read_bytes())
        assert (meta["dtype"], meta["shape"], meta["nbytes"], meta["shard"]) == (
            dtype,
            shape,
            len(content),
            "every.bin",
        )
        assert path.read_bytes()[meta["offset"] : meta["offset"] + len(content)] == content
        assert meta["data_offsets"] == [meta["offset"], meta["offset"] + len(content)]
        assert (mountpoint / f"{name}.sha256").read_text().split()[0] == hashlib.sha256(content).hexdigest()
    assert np.array_equal(tensorfs.memmap(mountpoint / "embed.weight"), np.arange(24, dtype="<f4").reshape(4, 6))
    checked = subprocess.run(
        ["sha256sum", "-c", ".tensorfs/SHA256SUMS"], cwd=mountpoint, capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    view = mountpoint / ".tensorfs" / "model" / "model.safetensors"
    loaded = safetensors.torch.load_file(view)
    assert {name: (SAFETENSORS_NAME[t.dtype], list(t.shape), as_bytes(t)) for name, t in loaded.items()} == expected
    with safetensors.safe_open(str(view), "pt") as opened:
        assert opened.metadata() == {"format": "pt"}
    metadata = json.loads((mountpoint / ".tensorfs" / "metadata.json").read_bytes())
    assert metadata == {"format": "pytorch", "shards": {"every.bin": {"format": "pt"}}}


def llama_like(path: Path, layers: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    state = {"model.embed_tokens.weight": torch.randn(16, 8), "model.norm.weight": torch.ones(8)}
    for layer in range(layers):
        state[f"model.layers.{layer}.mlp.up_proj.weight"] = torch.randn(8, 8)
        state[f"model.layers.{layer}.input_layernorm.weight"] = torch.ones(8)
    torch.save(state, path)
    return state


def test_layers_and_the_export_of_a_checkpoint(mounts: Mounts, tmp_path: Path) -> None:
    path = tmp_path / "pytorch_model.bin"
    state = llama_like(path)
    mountpoint = mounts.mount(path, "--layers", "1-2")
    view = mountpoint / ".tensorfs" / "model" / "selected.safetensors"
    selected = safetensors.torch.load_file(view)
    assert sorted(selected) == sorted(n for n in state if ".layers." not in n or ".layers.1." in n or ".layers.2." in n)
    assert all(torch.equal(selected[name], state[name]) for name in selected)
    out = tmp_path / "out.safetensors"
    done = mounts.run("export", str(path), str(out))
    assert done.returncode == 0, done.stderr
    exported = safetensors.torch.load_file(out)
    assert exported.keys() == state.keys() and all(torch.equal(exported[n], state[n]) for n in state)
    refused = mounts.run("export", str(path), str(tmp_path / "out.gguf"))
    assert refused.returncode == 1 and "a pytorch model is written as a .safetensors file" in refused.stderr
    listed = mounts.run("ls", "--json", str(path))
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    assert {row["name"]: row["shape"] for row in rows} == {name: list(t.shape) for name, t in state.items()}
    manifest = mounts.run("manifest", str(path))
    assert {line.split()[1]: line.split()[0] for line in manifest.stdout.splitlines()} == {
        name: hashlib.sha256(as_bytes(t)).hexdigest() for name, t in state.items()
    }


def test_the_loader_reads_checkpoints(tmp_path: Path) -> None:
    path = saved(tmp_path / "every.bin", every_dtype())
    loaded = torch.load(path, weights_only=True)
    with tensorfs.safe_open(path, "pt") as opened:
        for name, tensor in loaded.items():
            got = opened.get_tensor(name)
            assert got.dtype == tensor.dtype and got.shape == tensor.shape and as_bytes(got) == as_bytes(tensor)
        assert opened.metadata() == {"format": "pt"}
    state = tensorfs.load_file(path)
    assert state.keys() == loaded.keys()
    state["embed.weight"][0, 0] = loaded["embed.weight"][0, 0] = 99.0  # written: a private copy of the pages
    assert state["lm_head.weight"][0, 0] == loaded["lm_head.weight"][0, 0] == 99.0  # tied, as torch.load has them
    assert torch.load(path, weights_only=True)["embed.weight"][0, 0] == 0.0  # the file unchanged


def test_which_files_of_a_directory_are_the_model(tmp_path: Path) -> None:
    both = tmp_path / "both"
    both.mkdir()
    safetensors.torch.save_file({"w": torch.ones(2)}, both / "model.safetensors")
    torch.save({"w": torch.zeros(2)}, both / "pytorch_model.bin")
    with tensorfs.open_model(both) as model:
        assert model.format == "safetensors"  # as transformers prefers it
    training = tmp_path / "training"
    training.mkdir()
    torch.save({"w": torch.ones(2)}, training / "pytorch_model.bin")
    torch.save({"lr": 0.1}, training / "training_args.bin")
    torch.save({"state": {0: {"exp_avg": torch.ones(2)}}}, training / "optimizer.pt")
    assert ours(training) == {"w": ("F32", [2], as_bytes(torch.ones(2)))}
    several = tmp_path / "several"
    several.mkdir()
    torch.save({"w": torch.ones(2)}, several / "a.pt")
    torch.save({"w": torch.ones(2)}, several / "b.pt")
    with pytest.raises(InvalidModelError, match=r"holds several PyTorch checkpoints \(a\.pt, b\.pt\): name the one"):
        tensorfs.open_model(several)
    sharded = tmp_path / "sharded"
    state = sharded_checkpoint(sharded)
    found = ours(sharded)
    assert found == {name: (SAFETENSORS_NAME[t.dtype], list(t.shape), as_bytes(t)) for name, t in state.items()}
    (sharded / pytorch.INDEX_NAME).unlink()  # the numbered parts, all there, are one model without it
    assert ours(sharded) == found
    (sharded / "pytorch_model-00002-of-00002.bin").unlink()
    with pytest.raises(InvalidModelError, match=r"of 2 files, of which pytorch_model-00002-of-00002\.bin cannot be"):
        tensorfs.open_model(sharded)


def test_a_views_companions_are_never_the_models_own_file(mounts: Mounts, tmp_path: Path) -> None:
    """A checkpoint named model.pt is the model's weights by being chosen, not by its name: its view
    holds model.safetensors, not a second copy of the checkpoint beside it (over the 64 MiB
    companion limit it would also be a warning), while other .pt/.bin files stay companions."""
    model = tmp_path / "model"
    model.mkdir()
    torch.save({"w": torch.ones(2)}, model / "model.pt")
    (model / "config.json").write_text("{}")
    torch.save({"lr": 0.1}, model / "training_args.bin")
    for source in (model, model / "model.pt"):
        dest = tmp_path / f"export-{source.name}"
        done = mounts.run("export", str(source), str(dest))
        assert done.returncode == 0 and "warning" not in done.stderr, done.stderr
        assert sorted(p.name for p in dest.iterdir()) == [
            "config.json", "model.safetensors", "tensorfs-view.json", "training_args.bin",
        ]  # fmt: skip
        assert (dest / "training_args.bin").read_bytes() == (model / "training_args.bin").read_bytes()


def sharded_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Two shards and their index, as transformers 4 wrote them (save_pretrained(safe_serialization=False))."""
    directory.mkdir()
    state = llama_like(directory / "whole.bin")
    (directory / "whole.bin").unlink()
    names = list(state)
    parts = {"pytorch_model-00001-of-00002.bin": names[:3], "pytorch_model-00002-of-00002.bin": names[3:]}
    for file_name, part in parts.items():
        torch.save({name: state[name] for name in part}, directory / file_name)
    weight_map = {name: file_name for file_name, part in parts.items() for name in part}
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": weight_map,
    }
    (directory / pytorch.INDEX_NAME).write_text(json.dumps(index))
    return state


def test_transformers_loads_a_real_models_checkpoint_through_the_view(mounts: Mounts, tmp_path: Path) -> None:
    """A real model's state dict saved by torch itself (tied embeddings: one storage, two tensors), and
    its config: transformers reads the mount's safetensors view, and computes what the original does."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)  # fmt: skip
    original = LlamaForCausalLM(config).eval()
    directory = tmp_path / "llama"
    directory.mkdir()
    config.save_pretrained(directory)
    torch.save(original.state_dict(), directory / "pytorch_model.bin")
    mountpoint = mounts.mount(directory)
    view = mountpoint / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == ["config.json", "model.safetensors", "tensorfs-view.json"]  # converted
    assert json.loads((view / "tensorfs-view.json").read_text())["synthesized"].startswith("a PyTorch checkpoint")
    folder = mounts.mount(directory, "--view", "folder") / ".tensorfs" / "model"  # the checkpoint as it is
    assert sorted(os.listdir(folder)) == ["config.json", "pytorch_model.bin"]
    assert (folder / "pytorch_model.bin").read_bytes() == (directory / "pytorch_model.bin").read_bytes()
    ids = torch.randint(0, 128, (2, 9))
    for served in (view, folder):
        loaded = LlamaForCausalLM.from_pretrained(served).eval()
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, original(ids).logits)


# -- remote ---------------------------------------------------------------------------------------------


def test_remote_checkpoints(
    nginx: Nginx, seaweedfs: SeaweedFS, bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint's directory is at its end and its storages' headers throughout: read with ranged
    GETs of exactly that version beyond the first; a sharded one by its index; a prefix's
    pytorch_model.bin beside a training run's other files."""
    import obstore

    from tensorfs.sources.store import RemoteOptions

    big = {f"layer.{i}": torch.full((256, 1024), float(i)) for i in range(3)}  # 1 MiB each
    big["small"] = torch.arange(5)
    local = saved(tmp_path / "big.bin", big)
    expected = reference(local)
    sharded = tmp_path / "sharded"
    state = sharded_checkpoint(sharded)
    served = nginx.root / tmp_path.name
    shutil.copytree(sharded, served / "sharded")
    shutil.copy(local, served / "big.bin")
    store = seaweedfs.store(bucket)
    obstore.put(store, "run/pytorch_model.bin", local.read_bytes())
    obstore.put(store, "run/training_args.bin", saved(tmp_path / "args.bin", {"lr": 0.1}).read_bytes())
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    try:
        http = f"{nginx.url}/{tmp_path.name}"
        assert ours(f"{http}/big.bin", remote=RemoteOptions(cache_dir=tmp_path / "c1")) == expected
        gets = [r for r in nginx.requests() if r[1].endswith(f"{tmp_path.name}/big.bin") and r[0] == "GET"]
        assert 3 <= len(gets) <= 12, gets  # the first bytes, the end, the storages' headers; the tensors' chunks
        index_url = f"{http}/sharded/{pytorch.INDEX_NAME}"
        assert ours(index_url, remote=RemoteOptions(cache_dir=tmp_path / "c2")) == {
            name: (SAFETENSORS_NAME[t.dtype], list(t.shape), as_bytes(t)) for name, t in state.items()
        }
        s3 = RemoteOptions(cache_dir=tmp_path / "c3", endpoint_url=seaweedfs.endpoint)
        assert ours(f"s3://{bucket}/run", remote=s3) == expected
    finally:
        shutil.rmtree(served, ignore_errors=True)


def test_header_cache_rows_of_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tensorfs.utils.identity

    path = saved(tmp_path / "big.bin", {f"t{i}": torch.full((64, 64), float(i)) for i in range(8)})
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)
    first = ours(path, cache=tmp_path / "cache")

    def parsed(*args: Any) -> Any:
        raise AssertionError("read again")

    monkeypatch.setattr(pytorch, "read_table", parsed)
    assert ours(path, cache=tmp_path / "cache") == first


# -- damaged files --------------------------------------------------------------------------------


PYTORCH_STRICTER = {
    "data.pkl's CRC-32": r".+/data\.pkl does not match its CRC-32: the archive is damaged",  # torch never checks it
    # The zip's own consistency, which torch's reader (miniz) reads past:
    "a local header away from where the directory says": r".+'s local header is not where the central directory says",
    "no end-of-central-directory record": r"no zip end-of-central-directory record: not a zip archive, or truncated",
    "the central directory away from where the end record says": (
        r"the zip's central directory is not where its end record says \(data before or after it\)"
    ),
    "a Zip64 end record away from its locator": r"a Zip64 archive whose Zip64 end record is not where its locator says",
    "end records that disagree": r"the zip's end record and its Zip64 end record disagree",
    "a split archive": r"a zip archive split over several disks|.+ is on another disk of a split archive",
    "an entry running into the central directory": r".+ runs into the zip's central directory: truncated or damaged",
    "entries that overlap": r".+ overlaps .+ in the archive",
    "an entry marked as a directory": r".+ is marked as a directory",
    # Small records torch reads leniently or not at all:
    "a small record torch does not read as we do": (
        r".+/(\.format_version|\.storage_alignment|\.data/serialization_id) holds .+, not (a number|printable text)"
    ),
    # Pickles other than torch.save writes, which torch's unpickler reads all the same:
    "a tensor not contiguous": (  # one tensorfs would have to gather (docs/formats.md)
        r"is not contiguous \(size \[.*\], stride \[.*\]\): tensorfs serves a tensor as the bytes it is stored in; "
        r"save tensor\.contiguous\(\) instead"
    ),
    "a persistent id not as torch writes it": r"data\.pkl storage .+: its key, location or size is not what torch writes",
    "a storage named twice": r"data\.pkl storage .+ is named twice, as different storages",
    "a storage of no storage class": r"data\.pkl a storage of .+, which is not a torch storage class",
    "a tensor past its storage's end": r"runs past the end of its storage .+ \(\d+ bytes\) from byte \d+",  # an empty one
    "a storage whose key torch cuts": r"its storage .+ is not in the archive",  # a key with a NUL: torch stops at it
    "the opcode NEWOBJ": r"data\.pkl uses the opcode NEWOBJ, which a state dict's pickle never does",
    "not one object on the stack at its end": r"data\.pkl the pickle ends with other than one object on its stack",
    "two tensors of one name": r"data\.pkl two tensors are named .+ \(a key with a '\.' and a dict within\)",
    **NAME_RULES,  # names that are no safe path
}
"""What tensorfs refuses of a damaged archive that torch's reader reads all the same: a rule's name, and
the pattern a refusal's reason must be, whole, to cite it."""


@pytest.fixture(scope="module")
def bounded_torch() -> Iterator[BoundedReference]:
    reader = BoundedReference("test_pytorch:reference", memory=1 << 30)  # torch.load believes a pickle's sizes
    try:
        yield reader
    finally:
        reader.close()


MUTATIONS = ["the data"] * 4 + ["a name"] * 2 + ["a number", "as saved"] + ["anywhere"] * 3 + ["the pickle"] * 3
"""How a case changes its checkpoint, as often as listed: what torch reads (the storages' bytes, a key's
characters, a number of the pickle, the checkpoint as saved, under another pickle protocol too) and
what it may not (bytes anywhere, cut short; bytes of the pickle). The archive's CRCs are made again
for what is changed of a record: else tensorfs refuses by a CRC alone."""


@pytest.mark.fuzz
def test_damaged_checkpoints_are_refused_or_agree_with_torch(tmp_path: Path, bounded_torch: BoundedReference) -> None:
    """Checkpoints (a small one; every dtype, tied weights, slices, a scalar, empty tensors; pickled with
    protocols 1, 3 and 4) changed as MUTATIONS says, read by tensorfs and by
    torch.load(weights_only=True) in a process of its own. What torch refuses tensorfs refuses, a
    line a problem (torch's checks of the small records and of the Zip64 end records included);
    what tensorfs alone refuses cites one of PYTORCH_STRICTER's rules; what both read is the same
    tensors (names, dtypes, shapes, bytes), a third of the cases at least."""
    split: Counter[str] = Counter()
    cited: Counter[str] = Counter()
    path = tmp_path / "damaged.bin"

    @fuzzing(300)
    @given(
        base=st.sampled_from(
            ["small", "every dtype"] * 3 + ["pickle protocol 1", "pickle protocol 3", "pickle protocol 4"]
        ),
        how=st.sampled_from(MUTATIONS),
        edits=st.lists(st.tuples(st.integers(0, 100_000), st.integers(0, 255)), min_size=1, max_size=4),
        cut=st.one_of(st.none(), st.integers(0, 100_000)),
        letters=st.lists(st.sampled_from(NAME_LETTERS), min_size=4, max_size=4),
    )
    def case(base: str, how: str, edits: list[tuple[int, int]], cut: int | None, letters: list[str]) -> None:
        path.write_bytes(mutated(BASES[base], how, edits, cut, letters))
        theirs = bounded_torch.read(path)
        try:
            found = ours(path, cache=False)
        except InvalidModelError as exc:
            # A problem a line naming the file (tied tensors over one bad storage: a line each).
            assert all(line.startswith(f"{path}: ") for line in str(exc).splitlines()), str(exc)
            assert len(str(exc).splitlines()) == len(exc.problems), str(exc)
            if theirs[0] == "refused":
                split["both reject"] += 1
                return
            unexplained_ones = unexplained(exc.problems, PYTORCH_STRICTER)
            assert not unexplained_ones, f"torch reads what tensorfs refuses by no stricter rule: {exc}"
            cited.update(cited_rule(problem.reason, PYTORCH_STRICTER) for problem in exc.problems)
            split["tensorfs stricter"] += 1
            return
        assert theirs[0] == "read", f"tensorfs reads what torch refuses ({theirs[1]})"
        assert found == theirs[1]
        split["both accept"] += 1

    case()
    shares = fuzz_split(
        split, ["both accept", "both reject", "tensorfs stricter"], f"; stricter rules cited: {dict(cited)}"
    )
    assert split["both accept"] * 3 >= split.total() and split["both reject"] and split["tensorfs stricter"], shares


NAME_LETTERS = ["a", "b", ".", "z", "9", "_", "/", "-", "\0"]
"""What a character of a key becomes (some make a name no safe path)."""


def mutated(base: bytes, how: str, edits: list[tuple[int, int]], cut: int | None, letters: list[str]) -> bytes:
    """`base` changed as `how` says (see MUTATIONS), by `edits` ((position, value), each taken modulo
    what it changes), `cut` (where the file ends, modulo its length: "anywhere" only) and `letters`
    (what the characters of a key become: "a name" only)."""
    if how == "as saved":
        return base
    if how == "the data":  # storages' bytes: other values, as torch reads them
        return records_edited(base, "/data/", edits)
    if how == "a name":  # a character of a key: another (which may make a name no safe path)
        keys = set(_fuzzed_state()) | set(every_dtype())  # the bases' tensors' names
        spans = [(at, at + len(text)) for op, text, at in pickle_strings(base) if op == "string" and text in keys]
        changes = []
        for (position, value), letter in zip(edits, letters, strict=False):
            start, end = spans[position % len(spans)]
            changes.append((start + value % (end - start), ord(letter)))
        return records_edited(base, "/data.pkl", changes)
    if how == "a number":  # a small number of the pickle: a shape, an offset, a stride, a storage's size
        numbers = [at for op, _, at in pickle_strings(base) if op == "BININT1"]
        return records_edited(base, "/data.pkl", [(numbers[p % len(numbers)], v) for p, v in edits])
    if how == "the pickle":
        return records_edited(base, "/data.pkl", edits)
    data = bytearray(base)  # "anywhere": any byte, the CRCs as they were; and cut short
    for position, value in edits:
        data[position % len(data)] = value
    return bytes(data[: cut % len(data)] if cut is not None else data)


def pickle_strings(checkpoint: bytes) -> list[tuple[str, Any, int]]:
    """(opcode, argument, where its argument's bytes begin in data.pkl) of the strings and one-byte
    numbers of a checkpoint's pickle."""
    archive = zipfile.ZipFile(io.BytesIO(checkpoint))
    pickle_name = next(name for name in archive.namelist() if name.endswith("/data.pkl"))
    found = []
    for opcode, argument, at in pickletools.genops(archive.read(pickle_name)):
        length = _LENGTH_BYTES.get(opcode.name)
        if length is not None:
            found.append(("string", argument, at + 1 + length))  # its opcode, then its length
        elif opcode.name == "BININT1":
            found.append((opcode.name, argument, at + 1))
    return found


_LENGTH_BYTES = {"SHORT_BINUNICODE": 1, "BINUNICODE": 4, "BINUNICODE8": 8, "SHORT_BINSTRING": 1, "BINSTRING": 4}
"""The string opcodes of a pickle, and the bytes of the length before their text."""


def saved_bytes(state: dict[str, torch.Tensor], protocol: int = 2) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer, pickle_protocol=protocol)
    return buffer.getvalue()


def _fuzzed_state() -> dict[str, torch.Tensor]:
    state = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}
    state["tied"] = state["a.weight"]
    return state


FUZZED = saved_bytes(_fuzzed_state())
EVERY_DTYPE = saved_bytes(every_dtype())
BASES = {
    "small": FUZZED,
    "every dtype": EVERY_DTYPE,
    "pickle protocol 1": saved_bytes(every_dtype(), protocol=1),  # opcodes torch does not read (INT, ...)
    "pickle protocol 3": saved_bytes(every_dtype(), protocol=3),
    "pickle protocol 4": saved_bytes(every_dtype(), protocol=4),  # FRAME, MEMOIZE, ...: torch does not read them
}
"""The checkpoints the fuzz changes."""
