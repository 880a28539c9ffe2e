"""Fallback sources (--fallback, fallback=): other copies of a model that stand in for a tensor whose
own shard cannot give its bytes, and for a shard missing or invalid; never a byte that is not the
tensor's (a copy whose table or hash disagrees is passed over: EIO, or the primary's error)."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import Mounts, wait_until
from helpers import (
    MIB,
    cli,
    daemon_stats,
    damage_in_place,
    errno_of_reading,
    free_port,
    random_bytes,
    scrape,
    sharded_model,
    upload,
    write_reference,
)
from servers import Nginx, SeaweedFS
from tensorfs import RemoteOptions, load_file, open_model
from tensorfs.catalogue import fallbacks as fallback
from tensorfs.errors import IntegrityError, InvalidModelError


def _model(directory: Path, shards: int = 3, tensors: int = 3, size: int = MIB) -> dict[str, bytes]:
    """Shards of random tensors with an index; their bytes by name."""
    files = {
        f"model-{s + 1:05d}-of-{shards:05d}.safetensors": {f"s{s}.t{t}": size for t in range(tensors)}
        for s in range(shards)
    }
    return sharded_model(directory, files)


def _manifest(directory: Path, data: dict[str, bytes]) -> None:
    import hashlib

    text = "".join(f"{hashlib.sha256(blob).hexdigest()}  {name}\n" for name, blob in sorted(data.items()))
    (directory / "tensors.sha256").write_text(text)


@pytest.fixture
def copies(tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """A model with a manifest (the primary) and a copy of it (the fallback)."""
    data = _model(tmp_path / "primary")
    _manifest(tmp_path / "primary", data)
    shutil.copytree(tmp_path / "primary", tmp_path / "copy")
    return tmp_path / "primary", tmp_path / "copy", data


# -- in-process ---------------------------------------------------------------------------------
def test_the_loader_takes_a_damaged_tensor_from_its_fallback(copies: tuple[Path, Path, dict[str, bytes]]) -> None:
    primary, copy, data = copies
    damage_in_place(primary, "s1.t1")
    with pytest.raises(IntegrityError, match=r"s1\.t1"):
        load_file(primary, framework="np", verify=True, cache=False)
    loaded = load_file(primary, framework="np", verify=True, cache=False, fallback=[copy])
    assert {name: array.tobytes() for name, array in loaded.items()} == data
    with open_model(primary, verify=True, cache=False, fallback=[copy]) as model:
        assert model.raw("s1.t1").tobytes() == data["s1.t1"]
        assert model.gate.copy("s1.t1") is not None and model.gate.copy("s0.t0") is None


def test_an_export_takes_a_damaged_tensor_from_its_fallback(
    copies: tuple[Path, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """`export` takes --fallback as a mount does (it took none): a tensor whose bytes fail the
    manifest is written from the copy, so the export is the model's folder as it was; without the
    fallback the export fails, naming the tensor, and writes nothing."""
    primary, copy, _ = copies
    original = {path.name: path.read_bytes() for path in primary.iterdir()}
    damage_in_place(primary, "s1.t1")
    failed = cli("export", "-q", str(primary), str(tmp_path / "without"))
    assert failed.returncode == 1 and "s1.t1" in failed.stderr, failed.stderr
    assert not (tmp_path / "without").exists()
    done = cli("export", "-q", "--fallback", str(copy), str(primary), str(tmp_path / "with"))
    assert done.returncode == 0, done.stderr
    assert {path.name: path.read_bytes() for path in (tmp_path / "with").iterdir()} == original


def test_a_fallback_with_other_bytes_is_never_served(copies: tuple[Path, Path, dict[str, bytes]]) -> None:
    primary, copy, _ = copies
    damage_in_place(primary, "s1.t1")
    damage_in_place(copy, "s1.t1")  # the same tensor damaged in both: neither copy matches the manifest
    with open_model(primary, verify=True, cache=False, fallback=[copy]) as model:
        with pytest.raises(IntegrityError, match=r"s1\.t1"):
            model.raw("s1.t1")
        assert model.gate.copy("s1.t1") is None


def test_a_fallback_whose_table_disagrees_is_passed_over(tmp_path: Path) -> None:
    """Same names, other shapes: not the same tensors, whatever their bytes."""
    data = _model(tmp_path / "primary", shards=1, tensors=2)
    _manifest(tmp_path / "primary", data)
    other = tmp_path / "other"
    other.mkdir()
    write_reference(other / "m.safetensors", {name: ("U8", [2, len(blob) // 2], blob) for name, blob in data.items()})
    damage_in_place(tmp_path / "primary", "s0.t1")
    fallback = [other, tmp_path / "none"]
    with (
        open_model(tmp_path / "primary", verify=True, cache=False, fallback=fallback) as model,
        pytest.raises(IntegrityError),
    ):
        model.raw("s0.t1")


@pytest.mark.parametrize("how", ["missing", "invalid"])
def test_a_shard_missing_or_invalid_is_taken_from_the_fallback(
    copies: tuple[Path, Path, dict[str, bytes]], how: str, caplog: pytest.LogCaptureFixture
) -> None:
    primary, copy, data = copies
    shard = primary / "model-00002-of-00003.safetensors"
    if how == "missing":
        shard.unlink()
    else:
        shard.write_bytes(b"\xff" * 16)  # a header length past the end of the file
    with pytest.raises(InvalidModelError, match="model-00002-of-00003"):
        open_model(primary, cache=False)
    with caplog.at_level(logging.WARNING), open_model(primary, cache=False, fallback=[copy]) as model:
        assert {name: model.raw(name).tobytes() for name in model} == data
    assert "served from fallback" in caplog.text and "model-00002-of-00003" in caplog.text


def test_a_fallback_down_is_a_warning_then_tried_again(
    copies: tuple[Path, Path, dict[str, bytes]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    primary, copy, data = copies
    damage_in_place(primary, "s0.t2")
    later = tmp_path / "later"
    with caplog.at_level(logging.WARNING), open_model(primary, verify=True, cache=False, fallback=[later]) as model:
        with pytest.raises(IntegrityError):
            model.raw("s0.t2")
        assert "fallback" in caplog.text and "cannot be opened now" in caplog.text
        shutil.copytree(copy, later)  # it comes up ...
        assert model.gate.copy("s0.t2") is None
        with pytest.raises(IntegrityError):
            model.raw("s0.t2")  # ... not tried again before its wait is over
        monkeypatch.setattr(fallback, "RETRY_AFTER", 0.0)
        assert model.raw("s0.t2").tobytes() == data["s0.t2"]  # ... and then it is


# -- through a mount ------------------------------------------------------------------------------
def test_a_mount_serves_a_damaged_tensor_from_its_fallback(
    mounts: Mounts, copies: tuple[Path, Path, dict[str, bytes]]
) -> None:
    primary, copy, data = copies
    damage_in_place(primary, "s1.t1")
    port = free_port()
    mountpoint = mounts.mount(primary, "--fallback", str(copy), "--metrics", str(port))
    for name, blob in data.items():  # each byte asked of the daemon once: one read() each
        assert (mountpoint / name).read_bytes() == blob
    stats = daemon_stats(mountpoint)  # counted before anything reads again (a drop of the page cache meanwhile would)
    assert stats["fallback"]["tensors"] == {"s1.t1": str(copy)}
    assert stats["fallback"]["bytes"] == {str(copy): MIB}
    metrics = scrape(port)
    where = (("mountpoint", str(mountpoint)), ("source", str(copy)))
    assert metrics[("tensorfs_fallback_bytes_total", where)] == MIB
    assert metrics[("tensorfs_fallback_tensors", (("mountpoint", str(mountpoint)),))] == 1
    sums = subprocess.run(["sha256sum", "-c", "--quiet", ".tensorfs/SHA256SUMS"], cwd=mountpoint, capture_output=True)
    assert sums.returncode == 0, sums.stdout + sums.stderr
    status = mounts.run("status", str(mountpoint))
    assert "degraded" in status.stdout and "served from a fallback" in status.stdout
    shown = mounts.run("stats", str(mountpoint)).stdout
    assert f"fallback   {copy}: 1 tensors (s1.t1)" in shown
    log = mounts.log()
    assert log.count("tensor 's1.t1': served from fallback") == 1  # one line when it switches


def test_a_shard_truncated_under_the_mount_is_served_from_the_fallback(
    mounts: Mounts, copies: tuple[Path, Path, dict[str, bytes]]
) -> None:
    """No manifest: a shard changed in place is not the file validated; its tensors come from the
    fallback (the same table), the other shards' from their own."""
    primary, copy, data = copies
    (primary / "tensors.sha256").unlink()
    (copy / "tensors.sha256").unlink()
    mountpoint = mounts.mount(primary, "--fallback", str(copy))
    assert (mountpoint / "s2.t0").read_bytes() == data["s2.t0"]
    shard = primary / "model-00003-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size // 2)
    wait_until(lambda: (mountpoint / "s2.t2").read_bytes() == data["s2.t2"], what="s2.t2 from the fallback")
    for name, blob in data.items():
        assert (mountpoint / name).read_bytes() == blob
    view = (mountpoint / ".tensorfs" / "model").iterdir()
    assert any(path.name.endswith(".safetensors") for path in view)
    stats = daemon_stats(mountpoint)
    assert sorted(stats["fallback"]["tensors"]) == ["s2.t0", "s2.t1", "s2.t2"]


def test_without_a_fallback_that_agrees_the_reader_gets_eio(
    mounts: Mounts, copies: tuple[Path, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    primary, copy, data = copies
    damage_in_place(primary, "s1.t1")
    damage_in_place(copy, "s1.t1")
    mountpoint = mounts.mount(primary, "--fallback", str(tmp_path / "nothing-here"), "--fallback", str(copy))
    assert errno_of_reading(mountpoint / "s1.t1") == errno.EIO
    assert (mountpoint / "s1.t0").read_bytes() == data["s1.t0"]
    log = mounts.log()
    assert "cannot be opened now" in log and "does not match the manifest" in log


def test_a_mount_goes_ahead_without_a_shard_the_fallback_has(
    mounts: Mounts, nginx: Nginx, copies: tuple[Path, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    primary, copy, data = copies
    served = nginx.root / "fallback-missing"
    shutil.copytree(copy, served)
    (primary / "model-00001-of-00003.safetensors").unlink()
    refused = mounts.attempt(primary, mountpoint=mounts.watch(tmp_path / "refused"))
    assert refused.returncode != 0
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = mounts.attempt(
        primary,
        "--fallback",
        f"{nginx.url}/fallback-missing/model.safetensors.index.json",
        "--cache-dir",
        str(tmp_path / "cache"),
        mountpoint=mountpoint,
    )
    assert result.returncode == 0, result.stderr
    assert "model-00001-of-00003.safetensors" in result.stderr and "served from fallback" in result.stderr
    for name, blob in data.items():
        assert (mountpoint / name).read_bytes() == blob


def test_a_store_down_past_its_timeout_is_read_from_the_fallback(
    mounts: Mounts, own_nginx: Nginx, copies: tuple[Path, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """The primary a remote model; its server stops: every tensor not cached comes from the fallback
    (a local copy), the shard's other tensors without each waiting for the timeout again."""
    _, copy, data = copies
    shutil.copytree(copy, own_nginx.root / "m")
    url = f"{own_nginx.url}/m/model.safetensors.index.json"
    common = ["--remote-timeout", "2", "--cache-dir", str(tmp_path / "cache"), "--chunk-mb", "1"]
    mountpoint = mounts.mount(url, *common, "--fallback", str(copy))  # type: ignore[arg-type]
    assert (mountpoint / "s0.t0").read_bytes() == data["s0.t0"]
    own_nginx.stop()
    for name, blob in data.items():
        assert (mountpoint / name).read_bytes() == blob
    stats = daemon_stats(mountpoint)
    assert "s0.t0" not in stats["fallback"]["tensors"] and "s2.t2" in stats["fallback"]["tensors"]
    assert mounts.log().count("a read of it failed") >= 1  # the shard's other tensors went at once


@pytest.fixture
def far_apart(own_nginx: Nginx, tmp_path: Path) -> tuple[str, Path, dict[str, bytes]]:
    """One shard served by nginx (its URL), a local copy of it, and its tensors' bytes: "a", then 16
    MiB, then "c", so far on that reading "a" fetches none of "c" ahead (at most 8 chunks of 1 MiB)."""
    data = {"a": random_bytes(MIB, 1), "b": random_bytes(16 * MIB, 2), "c": random_bytes(MIB, 3)}
    (tmp_path / "copy").mkdir()
    write_reference(tmp_path / "copy" / "m.safetensors", {name: ("U8", [len(b)], b) for name, b in data.items()})
    shutil.copytree(tmp_path / "copy", own_nginx.root / "m")
    return f"{own_nginx.url}/m/m.safetensors", tmp_path / "copy", data


def test_with_the_store_down_a_tensor_in_the_cache_is_served_from_it_not_the_fallback(
    mounts: Mounts, own_nginx: Nginx, far_apart: tuple[str, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """A shard whose read failed sends its other tensors to their fallbacks at once, so that none
    waits for the timeout: not those whose bytes the mount's cache holds, which wait for nothing.
    Opened again, read with the kernel's copy dropped, they come from the cache."""
    url, copy, data = far_apart
    common = ["--remote-timeout", "2", "--cache-dir", str(tmp_path / "cache"), "--chunk-mb", "1"]
    mountpoint = mounts.mount(url, *common, "--prefetch-mb", "1", "--fallback", str(copy))  # type: ignore[arg-type]
    assert (mountpoint / "a").read_bytes() == data["a"]  # its chunks now in the cache
    own_nginx.stop()
    assert (mountpoint / "c").read_bytes() == data["c"]  # from the fallback, after the timeout
    with open(mountpoint / "a", "rb") as f:  # within the 30 s its shard's tensors go to the fallback at once
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel's copy dropped: read again
        assert f.read() == data["a"]
    stats = daemon_stats(mountpoint)
    assert stats["fallback"]["tensors"] == {"c": str(copy)}
    assert "a read of it failed" not in mounts.log()  # "a" did not go


def test_in_process_a_tensor_in_the_cache_is_served_from_it_not_the_fallback(
    own_nginx: Nginx, far_apart: tuple[str, Path, dict[str, bytes]], tmp_path: Path
) -> None:
    """As the mount: with the store down, a tensor whose chunks are cached is not sent to the fallback."""
    url, copy, data = far_apart
    remote = RemoteOptions(cache_dir=tmp_path / "cache", chunk_size=MIB, timeout=2)
    with open_model(url, remote=remote, cache=False, fallback=[copy]) as model:
        assert model.raw("a").tobytes() == data["a"]
        own_nginx.stop()
        assert model.raw("c").tobytes() == data["c"]  # from the fallback, after the timeout
        assert model.gate.copy("c") is not None
        assert model.raw("a").tobytes() == data["a"]  # its shard failing: from the cache all the same
        assert model.gate.copy("a") is None


def test_a_local_copy_heals_from_the_store(
    mounts: Mounts,
    seaweedfs: SeaweedFS,
    bucket: str,
    copies: tuple[Path, Path, dict[str, bytes]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The self-healing case: a local copy with a manifest, the store as its fallback; damage on disk
    (bytes flipped, a shard cut short) never reaches a reader."""
    primary, copy, data = copies
    upload(seaweedfs.store(bucket), "model", copy)
    for key, value in seaweedfs.env().items():
        monkeypatch.setenv(key, value)
    store = f"s3://{bucket}/model/"
    options = ["--endpoint-url", seaweedfs.endpoint, "--cache-dir", str(tmp_path / "cache"), "--fallback", store]
    mountpoint = mounts.mount(primary, *options)
    assert (mountpoint / "s0.t0").read_bytes() == data["s0.t0"]
    damage_in_place(primary, "s0.t1")
    damage_in_place(primary, "s1.t0")
    shard = primary / "model-00003-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    for name, blob in data.items():
        assert (mountpoint / name).read_bytes() == blob
    stats = daemon_stats(mountpoint)
    assert {"s0.t1", "s1.t0", "s2.t2"} <= set(stats["fallback"]["tensors"])
    assert set(stats["fallback"]["tensors"].values()) == {store}
