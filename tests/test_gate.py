"""The gate (tensorfs/gate): every byte handed out goes through one sequence, in-process and through a
mount alike. Each promise is attacked both ways: bytes a store changed under one ETag and another
process put back in the shared cache, a fallback's copy rewritten in place by another user, a
fallback that lacks the tensor, the loader's bytes fetched again under a manifest, and S3's folder
markers beside a model's files."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import tensorfs
from conftest import Mounts, drop_caches, wait_until
from helpers import (
    MIB,
    damage_in_place,
    errno_of_reading,
    fingerprints_pending,
    patience,
    random_bytes,
    same_crc32c,
    upload,
    write_index,
    write_reference,
)
from servers import HostileServer, Lie, SeaweedFS
from tensorfs.errors import IntegrityError, TensorfsError
from tensorfs.gate import run
from tensorfs.opening.source import Source
from tensorfs.opening.view_files import ViewRule
from tensorfs.proof.manifest import format_manifest
from tensorfs.selection import Selection
from tensorfs.sources.store import RemoteOptions
from tensorfs.views.remote_files import find_remote_companions


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tensorfs.cli", *args], capture_output=True, text=True, timeout=patience(120)
    )


def four_tensors(path: Path, size: int = 8 * MIB) -> dict[str, bytes]:
    """One shard of four tensors of `size` random bytes (every chunk differs from every other)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {f"t{i}": random_bytes(size, 300 + i) for i in range(4)}
    write_reference(path, {name: ("U8", [size], blob) for name, blob in data.items()})
    return data


def manifest_of(data: dict[str, bytes], path: Path) -> Path:
    path.write_text(format_manifest({name: hashlib.sha256(blob).hexdigest() for name, blob in data.items()}))
    return path


# -- a chunk another process fetched again ---------------------------------------------------------

# Another process on the same cache, without a manifest, reads tensors (their chunks fetched if they
# are not in the cache): t0's bytes, or its one-line error. With "weak", it keeps no SHA-256 of what it
# fetches, as a process of an older tensorfs would: only the CRC-32C, which the store forged.
OTHER_PROCESS = """
import sys
import tensorfs
from tensorfs.sources.chunks import records, objects
if sys.argv[3] == "weak":
    strong_as = records.Summing.__init__
    objects.Summing.__init__ = lambda self, strong: strong_as(self, False)
try:
    options = tensorfs.RemoteOptions(cache_dir=sys.argv[2], cache_size=24 << 20)
    for name in sys.argv[4:]:  # each by a model of its own, which holds it while open
        with tensorfs.open_model(sys.argv[1], remote=options, cache=False) as model:
            data = bytes(model.raw(name))
    sys.stdout.buffer.write(data)
except tensorfs.TensorfsError as exc:
    print(f"refused: {exc}", file=sys.stderr)
    sys.exit(1)
"""


def other_process_reads(url: str, cache: Path, weak: bool, *names: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, "-c", OTHER_PROCESS, url, str(cache), "weak" if weak else "strong", *names],
        capture_output=True,
        timeout=patience(120),
    )


def forge_t0(hostile: HostileServer) -> None:
    """The store serves other bytes in t0's first chunk under the same ETag, its CRC-32C forged."""
    served = (hostile.root / "m.safetensors").read_bytes()
    chunk = served[: 8 * MIB]
    changed = chunk[:MIB] + bytes(b ^ 0xFF for b in chunk[MIB : 2 * MIB]) + chunk[2 * MIB :]
    hostile.lies.append(Lie("body", "m.safetensors", same_crc32c(chunk, changed) + served[8 * MIB :]))


def evict_forge_and_fetch_again(hostile: HostileServer, url: str, cache: Path, expected: bytes, weak: bool) -> None:
    """Another process evicts t0's chunks (24 MiB of other tensors through the 24 MiB cache), the store
    changes t0 under the same ETag, and the other process reads t0 again: held to the SHA-256 kept of
    its chunk, it refuses it (nothing recorded); keeping none ("weak"), it records the forged chunk."""
    evicting = other_process_reads(url, cache, weak, "t1", "t2", "t3")
    assert evicting.returncode == 0, evicting.stderr
    forge_t0(hostile)
    again = other_process_reads(url, cache, weak, "t0")
    if weak:
        assert again.returncode == 0 and again.stdout != expected
    else:
        assert again.returncode == 1 and b"are not those the same version" in again.stderr


@pytest.mark.parametrize("other", ["strong", "weak"])
def test_a_mount_never_uses_a_chunk_another_process_fetched_again_unverified(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path, other: str
) -> None:
    """A mount under a manifest read t0; another process without one evicted its chunks, and read t0
    again once the store had changed it under the same ETag (CRC-32C forged). Whether that process
    keeps SHA-256s or not, the mount never serves the forged bytes: a chunk another process records
    anew is checked again before this one uses it."""
    expected = four_tensors(hostile.root / "m.safetensors")
    url = f"{hostile.url}/m.safetensors"
    manifest = manifest_of(expected, tmp_path / "tensors.sha256")
    cache = tmp_path / "cache"
    mountpoint = mounts.mount(url, "--manifest", str(manifest), "--cache-dir", str(cache), "--cache-size", "24M")
    assert (mountpoint / "t0").read_bytes() == expected["t0"]  # verified, served
    evict_forge_and_fetch_again(hostile, url, cache, expected["t0"], weak=other == "weak")
    drop_caches()  # the kernel's copy of t0 too: the mount is asked again
    assert errno_of_reading(mountpoint / "t0") == errno.EIO  # never the other bytes
    log = mounts.log()
    assert "ERROR" in log and "are not those the same version" in log


@pytest.mark.parametrize("verified", ["when-asked", "all-at-open"])
@pytest.mark.parametrize("other", ["strong", "weak"])
def test_the_loader_never_uses_a_chunk_another_process_fetched_again_unverified(
    hostile: HostileServer, tmp_path: Path, other: str, verified: str
) -> None:
    """The same attack on the in-process loader under a manifest, t0 verified when asked for or every
    tensor at open (verify="all": the manifest in force before they are hashed, so that the chunks
    fetched for it are held to their SHA-256s): the store's refusal, never the bytes."""
    expected = four_tensors(hostile.root / "m.safetensors")
    url = f"{hostile.url}/m.safetensors"
    manifest = manifest_of(expected, tmp_path / "tensors.sha256")
    cache = tmp_path / "cache"
    options = RemoteOptions(cache_dir=cache, cache_size=24 * MIB)
    source = Source.named(url, options, caches=False)
    with source.open(Selection(), manifest=manifest, verify="all" if verified == "all-at-open" else None) as model:
        if verified == "when-asked":
            model.gate.check("t0")  # verified: its chunks fetched, hashed, and let go (nothing handed out)
        evict_forge_and_fetch_again(hostile, url, cache, expected["t0"], weak=other == "weak")
        with pytest.raises(TensorfsError, match="are not those the same version"):
            model.raw("t0")


def test_the_loader_refuses_bytes_fetched_again_otherwise(hostile: HostileServer, tmp_path: Path) -> None:
    """Under verify=, a tensor verified, its chunks evicted, then served otherwise under the same ETag
    (CRC-32C forged) is refused when this process fetches it again: remote bytes fetched again must be
    those that passed, a rule the opener sets for the library as for a mount."""
    expected = four_tensors(hostile.root / "m.safetensors")
    url = f"{hostile.url}/m.safetensors"
    manifest = manifest_of(expected, tmp_path / "tensors.sha256")
    options = RemoteOptions(cache_dir=tmp_path / "cache", cache_size=24 * MIB)
    with tensorfs.open_model(url, remote=options, verify=manifest, cache=False) as model:
        for name in ("t0", "t1", "t2", "t3"):  # verified in turn, the last ones evicting t0's chunks
            model.gate.check(name)
        forge_t0(hostile)
        with pytest.raises(TensorfsError, match="are not those the same version"):
            model.raw("t0")


def verified_pruned_and_forged_then_read_unverified(
    hostile: HostileServer, tmp_path: Path
) -> tuple[str, Path, Path, dict[str, bytes]]:
    """Three processes, each done before the next begins: one verifies the model (its tensors' hashes
    kept in the hash cache, their chunks' SHA-256s in the chunk cache); the cache is pruned (chunks
    and their SHA-256s gone, the hash cache kept); the store serves other bytes in t0's first chunk
    under the same ETag, its CRC-32C forged; a process without a manifest reads t0 (the forged chunk
    recorded, with the only checksum it has). (url, manifest, cache, the tensors): for the third process."""
    expected = four_tensors(hostile.root / "m.safetensors")
    url = f"{hostile.url}/m.safetensors"
    manifest = manifest_of(expected, tmp_path / "tensors.sha256")
    cache = tmp_path / "cache"
    verified = cli("verify", "--manifest", str(manifest), "--cache-dir", str(cache), url)
    assert verified.returncode == 0, verified.stderr
    pruned = cli("cache", "prune", "--cache-dir", str(cache))  # everything not in use
    assert pruned.returncode == 0, pruned.stderr
    assert (cache / "hashes.sqlite").exists()  # what the first process proved of the object version
    forge_t0(hostile)
    read = other_process_reads(url, cache, False, "t0")
    assert read.returncode == 0 and read.stdout != expected["t0"], read.stderr  # no manifest: not refused
    return url, manifest, cache, expected


def test_the_loader_proves_remote_bytes_it_serves_not_those_another_process_hashed(
    hostile: HostileServer, tmp_path: Path
) -> None:
    """After another process verified a remote model, the cache was pruned, the store forged t0 under
    the same ETag and a process without a manifest put the forged chunk back in the cache, safe_open
    and load_file under the manifest refuse t0: the hash cache says what the object version's bytes
    hashed to when that process fetched them, not what the cache holds now (it answered for them)."""
    url, manifest, cache, expected = verified_pruned_and_forged_then_read_unverified(hostile, tmp_path)
    options = RemoteOptions(cache_dir=cache, cache_size=64 * MIB)
    with tensorfs.safe_open(url, "np", verify=manifest, remote=options, cache=cache) as opened:
        with pytest.raises(IntegrityError, match="t0"):
            opened.get_tensor("t0")
        assert opened.get_tensor("t1").tobytes() == expected["t1"]
    with pytest.raises(IntegrityError, match="t0"):
        tensorfs.load_file(url, framework="np", verify=manifest, remote=options, cache=cache)


def test_a_mount_proves_remote_bytes_it_serves_not_those_another_process_hashed(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path
) -> None:
    """The same three processes, then a mount under the manifest on that cache: t0 is EIO, never the
    forged bytes, and the log says which tensor did not match."""
    url, manifest, cache, expected = verified_pruned_and_forged_then_read_unverified(hostile, tmp_path)
    mountpoint = mounts.mount(url, "--manifest", str(manifest), "--cache-dir", str(cache), "--cache-size", "64M")
    assert errno_of_reading(mountpoint / "t0") == errno.EIO
    assert (mountpoint / "t1").read_bytes() == expected["t1"]
    assert "tensor 't0'" in mounts.log()


# -- fallbacks: watched like shards ----------------------------------------------------------------


def _sharded(directory: Path) -> dict[str, bytes]:
    directory.mkdir(parents=True)
    data: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for s in range(2):
        name = f"model-{s + 1:05d}-of-00002.safetensors"
        part = {f"s{s}.t{t}": random_bytes(MIB, 40 + 10 * s + t) for t in range(2)}
        write_reference(directory / name, {n: ("U8", [len(b)], b) for n, b in part.items()})
        data.update(part)
        weight_map.update(dict.fromkeys(part, name))
    write_index(directory, weight_map)
    return data


@pytest.fixture
def damaged(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """A primary whose tensor s1.t0 is damaged, and a whole copy of it (the fallback)."""
    data = _sharded(tmp_path / "copy")
    shutil.copytree(tmp_path / "copy", tmp_path / "primary")
    damage_in_place(tmp_path / "primary", "s1.t0")
    return tmp_path / "primary", tmp_path / "copy", data


@pytest.mark.parametrize("hidden", [False, True], ids=["written", "hidden"])
@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_a_fallback_rewritten_in_place_is_verified_again_or_refused_in_process(
    damaged: tuple[Path, Path, dict[str, bytes]], tmp_path: Path, manifest: bool, hidden: bool
) -> None:
    """Hidden: written through a shared mapping, its mtime set back (only the ctime moves)."""
    primary, copy, data = damaged
    verify = manifest_of(data, tmp_path / "m.sha256") if manifest else None
    if not manifest:  # without a manifest, a shard changed in place is what sends s1.t0 to its fallback
        damage_in_place(primary, "s1.t1")
    with tensorfs.open_model(primary, cache=False, verify=verify, fallback=[copy]) as model:
        if not manifest:
            damage_in_place(primary, "s1.t0")  # after opening: the primary's shard changed in place
        assert model.raw("s1.t0").tobytes() == data["s1.t0"]
        assert model.gate.copy("s1.t0") is not None
        damage_in_place(copy, "s1.t0", hidden=hidden)  # another user rewrites the fallback's copy in place
        with pytest.raises(TensorfsError):
            model.raw("s1.t0")
        damage_in_place(copy, "s1.t0", hidden=hidden)  # written back: the bytes it was
        if manifest:  # verified again: served again
            assert model.raw("s1.t0").tobytes() == data["s1.t0"]
        else:  # nothing can tell its bytes: refused until opened again
            with pytest.raises(TensorfsError):
                model.raw("s1.t0")
        assert model.raw("s0.t0").tobytes() == data["s0.t0"]  # the rest is served on


@pytest.mark.parametrize("hidden", [False, True], ids=["written", "hidden"])
@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_a_fallback_rewritten_in_place_is_verified_again_or_refused_through_a_mount(
    mounts: Mounts, damaged: tuple[Path, Path, dict[str, bytes]], tmp_path: Path, manifest: bool, hidden: bool
) -> None:
    primary, copy, data = damaged
    options = ["--no-cache", "--fallback", str(copy)]
    if manifest:
        options += ["--manifest", str(manifest_of(data, tmp_path / "m.sha256"))]
    else:
        options += ["--verify", "off"]
    mountpoint = mounts.mount(primary, *options)
    if not manifest:  # the primary's bytes served (nothing tells them), then changed in place: its
        # tensors go to the fallback
        assert (mountpoint / "s1.t0").read_bytes() != data["s1.t0"]
        wait_until(lambda: fingerprints_pending(mountpoint) == 0, what="what was served to be fingerprinted")
        damage_in_place(primary, "s1.t0")
        drop_caches()
    assert (mountpoint / "s1.t0").read_bytes() == data["s1.t0"]
    damage_in_place(copy, "s1.t0", hidden=hidden)  # another user rewrites the fallback's copy in place
    drop_caches()  # the kernel's pages of it too: the daemon is asked again
    assert errno_of_reading(mountpoint / "s1.t0") == errno.EIO  # never her bytes
    damage_in_place(copy, "s1.t0", hidden=hidden)
    drop_caches()
    if manifest:
        assert (mountpoint / "s1.t0").read_bytes() == data["s1.t0"]  # verified again
    else:
        assert errno_of_reading(mountpoint / "s1.t0") == errno.EIO
    assert (mountpoint / "s0.t0").read_bytes() == data["s0.t0"]
    assert "fallback" in mounts.log() and "changed" in mounts.log()


def _two_fallbacks(tmp_path: Path) -> tuple[Path, Path, Path, dict[str, bytes]]:
    """A damaged primary; a first fallback that lacks the damaged tensor (another model with the rest);
    a second that holds it."""
    primary, whole, data = tmp_path / "primary", tmp_path / "whole", _sharded(tmp_path / "whole")
    shutil.copytree(whole, primary)
    damage_in_place(primary, "s1.t0")
    lacking = tmp_path / "lacking"
    lacking.mkdir()
    write_reference(lacking / "model.safetensors", {"s1.t1": ("U8", [MIB], data["s1.t1"])})
    return primary, lacking, whole, data


def test_a_fallback_without_the_tensor_is_passed_over_in_process(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    primary, lacking, whole, data = _two_fallbacks(tmp_path)
    verify = manifest_of(data, tmp_path / "m.sha256")
    with (
        caplog.at_level(logging.WARNING),
        tensorfs.open_model(primary, cache=False, verify=verify, fallback=[lacking, whole]) as model,
    ):
        assert model.raw("s1.t0").tobytes() == data["s1.t0"]
        copy = model.gate.copy("s1.t0")
        assert copy is not None and copy.index == 1  # the second: the first does not hold it
    assert f"fallback {lacking}: tensor 's1.t0' does not hold it" in caplog.text


def test_a_fallback_without_the_tensor_is_passed_over_through_a_mount(mounts: Mounts, tmp_path: Path) -> None:
    primary, lacking, whole, data = _two_fallbacks(tmp_path)
    verify = manifest_of(data, tmp_path / "m.sha256")
    mountpoint = mounts.mount(
        primary, "--no-cache", "--manifest", str(verify), "--fallback", str(lacking), "--fallback", str(whole)
    )
    assert (mountpoint / "s1.t0").read_bytes() == data["s1.t0"]
    stats = json.loads((mountpoint / ".tensorfs" / "stats.json").read_bytes())
    assert stats["fallback"]["tensors"] == {"s1.t0": str(whole)}
    assert f"fallback {lacking}: tensor 's1.t0' does not hold it" in mounts.log()


# -- S3 folder markers -------------------------------------------------------------------------------


def test_s3_folder_markers_are_directories_not_files(
    seaweedfs: SeaweedFS, bucket: str, mounts: Mounts, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zero-byte keys ending in '/' (the S3 console's and sync tools' folders: `m/`, `m/1_Pooling/`)
    and a key that other keys are beneath: none of them a file of the view; 1_Pooling/ a directory
    holding its config, in the mount's model directory and in the library's view."""
    import obstore

    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    model = tmp_path / "m"
    model.mkdir()
    blob = random_bytes(4096, 9)
    write_reference(model / "model.safetensors", {"w": ("U8", [len(blob)], blob)})
    (model / "config.json").write_text('{"model_type": "bert"}')
    pooling = json.dumps({"word_embedding_dimension": 4, "pooling_mode_mean_tokens": True}).encode()
    store = seaweedfs.store(bucket)
    upload(store, "m", model)
    obstore.put(store, "m/1_Pooling/config.json", pooling)
    for marker in ("m/", "m/1_Pooling/"):
        obstore.put(store, marker, b"")
    obstore.put(store, "m/2_Dense", b"")  # a folder made as an object, with a key beneath it
    obstore.put(store, "m/2_Dense/config.json", b"{}")
    url = f"s3://{bucket}/m"
    cache = tmp_path / "cache"
    mountpoint = mounts.mount(url, "--endpoint-url", seaweedfs.endpoint, "--cache-dir", str(cache))  # type: ignore[arg-type]
    view = mountpoint / ".tensorfs" / "model"
    assert sorted(os.listdir(view)) == ["1_Pooling", "2_Dense", "config.json", "model.safetensors"]
    assert (view / "1_Pooling").is_dir() and (view / "1_Pooling" / "config.json").read_bytes() == pooling
    assert (view / "2_Dense").is_dir() and (view / "2_Dense" / "config.json").read_bytes() == b"{}"
    remote = RemoteOptions(endpoint_url=seaweedfs.endpoint, cache_dir=cache)
    spec = find_remote_companions(url, remote, ViewRule(folder=False))
    assert sorted(c.path for c in spec.companions) == ["1_Pooling/config.json", "2_Dense/config.json", "config.json"]


# -- without a manifest: what the CRC-32C catches ----------------------------------------------------


def change_t0(hostile: HostileServer) -> None:
    """The store serves other bytes in t0's first chunk under the same ETag (changed in place: no forging)."""
    served = (hostile.root / "m.safetensors").read_bytes()
    changed = served[:MIB] + bytes(b ^ 0x5A for b in served[MIB : 2 * MIB]) + served[2 * MIB :]
    hostile.lies.append(Lie("body", "m.safetensors", changed))


def test_without_a_manifest_a_store_changing_an_object_in_place_is_caught_in_process(
    hostile: HostileServer, tmp_path: Path
) -> None:
    """No manifest: t0's chunk fetched again after its eviction, from a store that changed the object in
    place under the same ETag, does not sum to its CRC-32C as it first came: refused, never served."""
    expected = four_tensors(hostile.root / "m.safetensors")
    url = f"{hostile.url}/m.safetensors"
    options = RemoteOptions(cache_dir=tmp_path / "cache", cache_size=24 * MIB)
    for name in ("t0", "t1", "t2", "t3"):  # each read by a model of its own (which holds it while open)
        with tensorfs.open_model(url, remote=options, cache=False) as model:
            assert bytes(model.raw(name)) == expected[name]
    change_t0(hostile)
    with tensorfs.open_model(url, remote=options, cache=False) as model:
        with pytest.raises(TensorfsError, match="are not those the same version"):
            model.raw("t0")
        assert bytes(model.raw("t3")) == expected["t3"]


def test_without_a_manifest_a_store_changing_an_object_in_place_is_caught_through_a_mount(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path
) -> None:
    expected = four_tensors(hostile.root / "m.safetensors")
    url = f"{hostile.url}/m.safetensors"
    mountpoint = mounts.mount(url, "--cache-dir", str(tmp_path / "cache"), "--cache-size", "24M")
    for name in ("t0", "t1", "t2", "t3"):  # the last three evict t0's chunks
        assert (mountpoint / name).read_bytes() == expected[name]
    change_t0(hostile)
    drop_caches()  # the kernel's copy of t0 too: the daemon is asked again
    assert errno_of_reading(mountpoint / "t0") == errno.EIO
    assert "are not those the same version" in mounts.log()


# -- fallbacks that cannot stand in, through a mount --------------------------------------------------


def test_a_fallback_invalid_when_opened_is_passed_over_through_a_mount(
    mounts: Mounts, damaged: tuple[Path, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """A fallback whose own header is invalid is never opened (a warning, tried again later): the
    damaged tensor is EIO under its manifest, the others are served."""
    primary, copy, data = damaged
    (copy / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 16)  # a header length past its end
    verify = manifest_of(data, tmp_path / "m.sha256")
    mountpoint = mounts.mount(primary, "--no-cache", "--manifest", str(verify), "--fallback", str(copy))
    assert errno_of_reading(mountpoint / "s1.t0") == errno.EIO
    assert (mountpoint / "s0.t0").read_bytes() == data["s0.t0"]
    log = mounts.log()
    assert f"fallback {copy} cannot be opened now" in log and "no fallback can give it" in log


def test_a_fallback_holding_another_shape_is_passed_over_through_a_mount(
    mounts: Mounts, damaged: tuple[Path, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    primary, _, data = damaged
    other = tmp_path / "other"
    other.mkdir()
    blob = data["s1.t0"]
    write_reference(other / "m.safetensors", {"s1.t0": ("U8", [2, len(blob) // 2], blob)})  # its very bytes
    verify = manifest_of(data, tmp_path / "m.sha256")
    mountpoint = mounts.mount(primary, "--no-cache", "--manifest", str(verify), "--fallback", str(other))
    assert errno_of_reading(mountpoint / "s1.t0") == errno.EIO  # the same bytes, another tensor: never served
    assert f"fallback {other}: tensor 's1.t0' holds it as U8 [2, {len(blob) // 2}]" in mounts.log()


# -- the rules of the gate's reads of files --------------------------------------------------------


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_bytes_read_while_the_shard_was_written_are_never_handed_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, manifest: bool
) -> None:
    """read_into (a reply assembled from several tensors) reads the file; the shard is written in place
    during that read (the handshake: the write is made inside the read, before the bytes are read):
    what was read is dropped, and the tensor is checked again: hashed (a mismatch) under a manifest,
    refused without one. Never the new bytes in the buffer as the answer."""
    data = _sharded(tmp_path / "model")
    verify = manifest_of(data, tmp_path / "m.sha256") if manifest else None
    with tensorfs.open_model(tmp_path / "model", cache=False, verify=verify) as model:
        model.gate.check("s1.t0")  # verified first (with a manifest): the read alone is left
        shard_data = model.shard_data(model.locate("s1.t0")[0])
        read = shard_data.readinto
        written: list[bool] = []

        def written_then_read(offset: int, buffer: memoryview) -> None:
            if not written:
                written.append(True)
                damage_in_place(tmp_path / "model", "s1.t0")
            read(offset, buffer)

        monkeypatch.setattr(shard_data, "readinto", written_then_read)
        buffer = bytearray(MIB)
        with pytest.raises(IntegrityError if manifest else TensorfsError):
            model.gate.copy_into("s1.t0", 0, memoryview(buffer))
        assert written == [True]


def test_a_disk_error_reading_a_shard_sends_the_tensor_to_its_fallback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the shard's file fails with EIO (the disk's OSError, not tensorfs's own error): the
    tensor is served from its fallback, whose bytes agree."""
    data = _sharded(tmp_path / "copy")
    shutil.copytree(tmp_path / "copy", tmp_path / "primary")
    with tensorfs.open_model(tmp_path / "primary", cache=False, fallback=[tmp_path / "copy"]) as model:
        shard_data = model.shard_data(model.locate("s1.t0")[0])

        def disk_error(offset: int, buffer: memoryview) -> None:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(shard_data, "readinto", disk_error)
        buffer = bytearray(MIB)
        model.gate.copy_into("s1.t0", 0, memoryview(buffer))
        assert bytes(buffer) == data["s1.t0"]
        assert model.gate.copy("s1.t0") is not None


def test_sums_hashed_while_their_shard_was_written_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SHA256SUMS of every tensor (digest_all) under a manifest: the shard is written in place while
    they are hashed (inside the hashing step: the handshake), so the sums are of no one state of it:
    refused, never handed out; asked again, they are those of the bytes as they are now."""
    data = _sharded(tmp_path / "model")
    verify = manifest_of(data, tmp_path / "m.sha256")
    with tensorfs.open_model(tmp_path / "model", cache=False, verify=verify) as model:
        hasher = model.gate.integrity.hasher
        hash_all = hasher.hash_all
        written: list[bool] = []

        def written_while_hashed(*args: Any, **kwargs: Any) -> dict[str, str]:
            found = hash_all(*args, **kwargs)
            if not written:
                written.append(True)
                damage_in_place(tmp_path / "model", "s1.t0")
            return found

        monkeypatch.setattr(hasher, "hash_all", written_while_hashed)
        names = sorted(data)
        with pytest.raises(TensorfsError):
            run(model.gate.digest_all(names))
        sums = run(model.gate.digest_all(names))
        assert sums["s1.t0"] != hashlib.sha256(data["s1.t0"]).hexdigest()  # the bytes as they are now
        assert sums["s0.t0"] == hashlib.sha256(data["s0.t0"]).hexdigest()


# -- a store that lied once: what the manifest refused is not kept ------------------------------------------


def lie_about_t0(hostile: HostileServer) -> None:
    """Other bytes in t0's first chunk, under the object's ETag (a resumed GET given another object's
    bytes looks so): the first fetch of that chunk caches them."""
    served = (hostile.root / "m.safetensors").read_bytes()
    lied = served[:MIB] + bytes(b ^ 0xA5 for b in served[MIB : 2 * MIB]) + served[2 * MIB :]
    hostile.lies.append(Lie("body", "m.safetensors", lied))


def test_bytes_a_manifest_refused_are_fetched_again_in_process(hostile: HostileServer, tmp_path: Path) -> None:
    """A store lies once: the manifest refuses t0 (IntegrityError), and its chunks are not kept: once
    the store is honest again (same URL, same ETag), the same open model reads t0 exact, and so does a
    new one from the same cache (the cache kept the lie, and every later read was refused)."""
    expected = four_tensors(hostile.root / "m.safetensors")
    verify = manifest_of(expected, tmp_path / "m.sha256")
    url = f"{hostile.url}/m.safetensors"
    options = RemoteOptions(cache_dir=tmp_path / "cache")
    lie_about_t0(hostile)
    with tensorfs.open_model(url, remote=options, cache=False, verify=verify) as model:
        with pytest.raises(IntegrityError, match="tensor 't0': its bytes hash to"):
            model.raw("t0")
        hostile.lies.clear()
        assert bytes(model.raw("t0")) == expected["t0"]
    with tensorfs.open_model(url, remote=options, cache=False, verify=verify) as model:
        assert {name: bytes(model.raw(name)) for name in model} == expected


@pytest.mark.mount
def test_bytes_a_manifest_refused_are_fetched_again_through_a_mount(
    mounts: Mounts, hostile: HostileServer, tmp_path: Path
) -> None:
    expected = four_tensors(hostile.root / "m.safetensors")
    verify = manifest_of(expected, tmp_path / "m.sha256")
    url = f"{hostile.url}/m.safetensors"
    lie_about_t0(hostile)
    mountpoint = mounts.mount(url, "--cache-dir", str(tmp_path / "cache"), "--manifest", str(verify))  # type: ignore[arg-type]
    assert errno_of_reading(mountpoint / "t0") == errno.EIO
    hostile.lies.clear()
    assert (mountpoint / "t0").read_bytes() == expected["t0"]  # fetched again: no remount, no cache cleared
    assert "tensor 't0' in shard" in mounts.log()
