"""A view's file read at the cost of its bytes, not of its tensors: the tensors a read meets, of one
shard's file, admitted together and read in one read (gate/spans.py), with every guarantee of a
tensor read alone kept: a tensor that fails its manifest, a shard changed in place or written while
it is read, a tensor served from its fallback."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import struct
from pathlib import Path
from typing import Any

import pytest
from gguf_files import write_gguf

import tensorfs
from conftest import Mounts, wait_until
from helpers import daemon_stats, fingerprints_pending, random_bytes
from tensorfs.errors import IntegrityError, TensorfsError
from tensorfs.gate import Answer, Outcome, Plan, next_step
from tensorfs.proof.manifest import format_manifest
from tensorfs.testing.sample_models import write_shard
from tensorfs.views import Piece, SynthesizedFile, WeightsFile, shared_metadata

PAGE = 4096


def tiny_tensors(path: Path, count: int, size: int = 1, seed: int = 0) -> dict[str, bytes]:
    """A safetensors file of `count` U8 [size] tensors named as an adapter's (in the file in numeric
    order: a merged view, by name, lays them out otherwise). Their bytes, by name."""
    data = random_bytes(count * size, seed)
    tensors = {f"base_model.model.layers.{i}.lora_A.weight": data[i * size : (i + 1) * size] for i in range(count)}
    write_shard(path, {name: ("U8", [size], blob) for name, blob in tensors.items()})
    return tensors


def header_of(path: Path) -> tuple[int, dict[str, Any]]:
    with open(path, "rb") as file:
        length = struct.unpack("<Q", file.read(8))[0]
        return 8 + length, json.loads(file.read(length))


def driven(plan: Plan[Any]) -> tuple[Any, int]:
    """What a plan answers, driven here as run() does, and how many blocking steps it asked for."""
    steps, outcome = 0, Outcome()
    while True:
        step = next_step(plan, outcome)
        if isinstance(step, Answer):
            return step.value, steps
        steps += 1
        outcome = Outcome.of(step[1])


def steps_made(mountpoint: Path) -> int:
    return sum(daemon_stats(mountpoint)["steps"].values())


# -- through a mount ---------------------------------------------------------------------------------


def test_a_view_file_of_100k_tensors_is_read_in_a_few_steps(mounts: Mounts, tmp_path: Path) -> None:
    """An adapter of 100,000 one-byte tensors beside a model: its view file is read byte for byte, its
    tensors' bytes by a few steps of its gate's plans (one read of the file per request), not one per
    tensor (at 24bd43a: 100,000, a minute and more)."""
    directory = tmp_path / "m"
    directory.mkdir()
    write_shard(directory / "model.safetensors", {f"w{i}": ("F32", [64], random_bytes(256, i)) for i in range(4)})
    (directory / "config.json").write_text('{"model_type": "llama"}')
    tiny_tensors(directory / "adapter_model.safetensors", 100_000)
    mountpoint = mounts.mount(directory)
    before = steps_made(mountpoint)
    view = mountpoint / ".tensorfs" / "model" / "adapter_model.safetensors"
    assert view.read_bytes() == (directory / "adapter_model.safetensors").read_bytes()
    stats = daemon_stats(mountpoint)
    assert stats["reads"]["view"] >= 1 and stats["errors"] == []
    assert sum(stats["steps"].values()) - before <= 20, stats["steps"]


def test_a_merged_view_of_100k_tensors_is_read_in_a_few_steps(mounts: Mounts, tmp_path: Path) -> None:
    """A model of 100,000 one-byte tensors, under its manifest, merged: its tensors lie in the merged
    file by name, in its own file otherwise; each read's tensors are verified together and read in
    one read of their file. Every one verified, the file as the reference writer lays it out."""
    directory = tmp_path / "m"
    directory.mkdir()
    tensors = tiny_tensors(directory / "model.safetensors", 100_000, seed=1)
    manifest = {name: hashlib.sha256(blob).hexdigest() for name, blob in tensors.items()}
    (directory / "tensors.sha256").write_text(format_manifest(manifest))
    mountpoint = mounts.mount(directory, "--view", "merged")
    before = steps_made(mountpoint)
    served = (mountpoint / ".tensorfs" / "model" / "model.safetensors").read_bytes()
    data_start, header = header_of(mountpoint / ".tensorfs" / "model" / "model.safetensors")
    assert list(header) == sorted(tensors)
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        assert served[data_start + begin : data_start + end] == tensors[name], name
    stats = daemon_stats(mountpoint)
    assert stats["integrity"]["verified"] == len(tensors) and stats["integrity"]["verify_failures"] == 0
    assert sum(stats["steps"].values()) - before <= 20, stats["steps"]


def expected_view(directory: Path, view: Path, tensors: dict[str, bytes], merged: bool) -> bytes:
    """What the view's file holds: the model's own file, or the merged file its header lays out."""
    if not merged:
        return (directory / "model.safetensors").read_bytes()
    data_start, header = header_of(view)
    content = bytearray(view.stat().st_size)
    with open(view, "rb") as file:
        content[:data_start] = file.read(data_start)  # the header: no tensor's bytes
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        content[data_start + begin : data_start + end] = tensors[name]
    return bytes(content)


@pytest.mark.parametrize("merged", [False, True], ids=["folder", "merged"])
def test_a_read_across_many_tensors_refuses_the_one_that_fails_its_manifest(
    mounts: Mounts, tmp_path: Path, merged: bool
) -> None:
    """One tensor among thousands whose bytes do not match the manifest: a read of the view that meets
    it is refused (EIO) however many others it meets, and said once; reads of pages away from it
    are served."""
    directory = tmp_path / "m"
    directory.mkdir()
    tensors = tiny_tensors(directory / "model.safetensors", 3000, size=16, seed=2)
    names = list(tensors)
    bad = names[1500]
    manifest = {name: hashlib.sha256(blob).hexdigest() for name, blob in tensors.items()}
    manifest[bad] = "0" * 64
    (directory / "tensors.sha256").write_text(format_manifest(manifest))
    mountpoint = mounts.mount(directory, *(["--view", "merged"] if merged else []))
    view = mountpoint / ".tensorfs" / "model" / "model.safetensors"
    data_start, header = header_of(view)
    expected = expected_view(directory, view, tensors, merged)
    at = data_start + header[bad]["data_offsets"][0]
    with open(view, "rb", buffering=0) as file:
        with pytest.raises(OSError) as caught:  # from the bad one's page on: thousands of tensors
            os.pread(file.fileno(), len(expected), at // PAGE * PAGE)
        assert caught.value.errno == errno.EIO
        for page in (at // PAGE - 3, at // PAGE + 3):
            assert os.pread(file.fileno(), PAGE, page * PAGE) == expected[page * PAGE : (page + 1) * PAGE]
    stats = daemon_stats(mountpoint)
    assert stats["integrity"]["verify_failures"] == 1
    wait_until(lambda: f"tensor '{bad}'" in mounts.log(), what="the refusal in the log")


def test_a_read_across_many_tensors_refuses_a_shard_changed_in_place(mounts: Mounts, tmp_path: Path) -> None:
    """No manifest: a shard written in place after its bytes were served (fingerprinted) is refused, in
    a read of its view file that meets thousands of its tensors as in one of them; its header, no
    tensor's bytes, is served on as it was validated."""
    directory = tmp_path / "m"
    directory.mkdir()
    tiny_tensors(directory / "model.safetensors", 3000, size=16, seed=3)
    source = (directory / "model.safetensors").read_bytes()
    mountpoint = mounts.mount(directory)
    view = mountpoint / ".tensorfs" / "model" / "model.safetensors"
    assert view.read_bytes() == source
    wait_until(lambda: fingerprints_pending(mountpoint) == 0, what="what was served to be fingerprinted")
    data_start, _ = header_of(directory / "model.safetensors")
    where = data_start + 20_000
    with open(directory / "model.safetensors", "r+b") as file:  # as `dd conv=notrunc`: the inode and size kept
        file.seek(where)
        file.write(bytes([source[where] ^ 0xFF]))

    def refused() -> bool:
        try:
            with open(view, "rb", buffering=0) as file:
                os.pread(file.fileno(), len(source) - data_start, data_start)
        except OSError as exc:
            return exc.errno == errno.EIO
        return False

    wait_until(refused, what="the view's tensors to be refused")
    with open(view, "rb", buffering=0) as file:
        assert os.pread(file.fileno(), PAGE, 0) == source[:PAGE]
    assert "was changed in place" in mounts.log()


# -- in process ----------------------------------------------------------------------------------------


@pytest.fixture
def tiny_model(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    directory = tmp_path / "model"
    directory.mkdir()
    return directory, tiny_tensors(directory / "model.safetensors", 2000, size=8, seed=4)


def merged_bytes(model: tensorfs.Model, file: SynthesizedFile) -> bytes:
    """The synthesized file as its pieces say, each tensor's bytes from its mapping (test_views.py's way)."""
    parts = []
    for piece in file.pieces(0, file.size):
        if isinstance(piece, Piece):
            data = model.shard_data(piece.shard).view
            parts.append(bytes(data[piece.shard_offset : piece.shard_offset + piece.end - piece.start]))
        else:
            parts.append(piece)
    return b"".join(parts)


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_view_files_read_at_any_range_are_their_bytes(tmp_path: Path, kind: str) -> None:
    """A weights file as it is, and the merged file, read through their plans at ranges of every kind
    (within the header, across it and tensors, across thousands of tensors, a GGUF's padding): the
    file's bytes; a range of many tensors in two steps at most (a read of the file, or a verification
    and a read)."""
    if kind == "gguf":
        path = tmp_path / "model.gguf"
        write_gguf(path, {f"blk.{i}.w": ("F32", [4]) for i in range(1500)}, alignment=32)
    else:
        path = tmp_path / "model.safetensors"
        tiny_tensors(path, 1500, size=12, seed=5)
    source = path.read_bytes()
    rng = random.Random(6)
    with tensorfs.open_model(path, cache=False) as model:
        weights = WeightsFile(model, model.gate, model.shards[0])
        merged = SynthesizedFile(model, model.gate, model.sorted_names, shared_metadata(model))
        for file, expected in ((weights, source), (merged, merged_bytes(model, merged))):
            assert file.size == len(expected)
            ranges = [(0, file.size), (0, 7), (file.size - 5, file.size)]
            ranges += [(start, min(file.size, start + rng.choice([1, 13, 4096, 1 << 16]))) for _ in range(200)
                       for start in [rng.randrange(file.size)]]  # fmt: skip
            for start, end in ranges:
                buffer = bytearray(end - start)
                driven(file.read(start, memoryview(buffer)))
                assert bytes(buffer) == expected[start:end], (type(file).__name__, start, end)
            last = file.size - 1
            _, steps = driven(file.read(last - 20_000, memoryview(bytearray(20_000))))
            assert steps <= 1


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_bytes_written_while_many_tensors_are_read_are_never_handed_out(
    tiny_model: tuple[Path, dict[str, bytes]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manifest: bool
) -> None:
    """The shard is written in place while a range of many of its tensors is read (the write made
    inside the read): what was read is dropped and the tensors admitted again: hashed again and
    refused (the one changed) under a manifest, refused without one. Never the new bytes."""
    directory, tensors = tiny_model
    verify = None
    if manifest:
        verify = tmp_path / "m.sha256"
        verify.write_text(format_manifest({n: hashlib.sha256(b).hexdigest() for n, b in tensors.items()}))
    shard = directory / "model.safetensors"
    data_start, header = header_of(shard)
    victim = data_start + header[list(tensors)[700]]["data_offsets"][0]
    with tensorfs.open_model(directory, cache=False, verify=verify) as model:
        weights = WeightsFile(model, model.gate, model.shards[0])
        buffer = bytearray(weights.size - data_start)
        driven(weights.read(data_start, memoryview(buffer)))  # verified first (with a manifest): the read alone is left
        data = model.shard_data(model.shards[0])
        read = data.readinto
        written: list[bool] = []

        def written_then_read(offset: int, buffer: memoryview) -> None:
            if not written:
                written.append(True)
                with open(shard, "r+b") as file:
                    file.seek(victim)
                    file.write(b"\xff" * 8 if tensors[list(tensors)[700]] != b"\xff" * 8 else b"\0" * 8)
            read(offset, buffer)

        monkeypatch.setattr(data, "readinto", written_then_read)
        with pytest.raises(IntegrityError if manifest else TensorfsError):
            driven(weights.read(data_start, memoryview(buffer)))
        assert written == [True]


def test_a_tensor_among_many_that_fails_its_manifest_is_served_from_its_fallback(
    tiny_model: tuple[Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """A range of many tensors, one of which does not match the manifest in its own file: that one is
    served from the fallback whose copy does (tensor by tensor), the others from their own file."""
    directory, tensors = tiny_model
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    verify = tmp_path / "m.sha256"
    verify.write_text(format_manifest({n: hashlib.sha256(b).hexdigest() for n, b in tensors.items()}))
    shard = directory / "model.safetensors"
    data_start, header = header_of(shard)
    bad = list(tensors)[1200]
    at = data_start + header[bad]["data_offsets"][0]
    content = bytearray(shard.read_bytes())
    content[at : at + 8] = bytes(b ^ 0xFF for b in content[at : at + 8])
    shard.write_bytes(bytes(content))
    expected = (copy / "model.safetensors").read_bytes()
    with tensorfs.open_model(directory, cache=False, verify=verify, fallback=[copy]) as model:
        weights = WeightsFile(model, model.gate, model.shards[0])
        buffer = bytearray(weights.size)
        served, _ = driven(weights.read(0, memoryview(buffer)))
        assert bytes(buffer) == expected
        assert model.gate.copy(bad) is not None and model.gate.copy(next(iter(tensors))) is None
        assert [s.copy is not None for s in served].count(True) == 1
