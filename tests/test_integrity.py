"""Manifests, verification, the hash cache, and verification while mounted."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

import tensorfs
import tensorfs.proof.integrity
import tensorfs.utils.identity
from conftest import Mounts, wait_until
from helpers import (
    MIB,
    entry,
    patience,
    random_bytes,
    raw_shard,
    reference_tensors,
    thread_read_bytes,
    write_index,
    write_reference,
    zeros_sha256,
)
from tensorfs.caches.hashes import HashCache
from tensorfs.cli import main
from tensorfs.mount.operations import TensorOperations
from tensorfs.mount.tree import Tree
from tensorfs.proof.integrity import CACHE_MIN_BYTES, Hasher, Integrity
from tensorfs.proof.manifest import ManifestError, format_manifest, parse_manifest, sha256sum_line


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(
        directory / "a.safetensors", {"w1": ("F32", [64, 64], random_bytes(16384, 1)), "e": ("U8", [0], b"")}
    )
    write_reference(
        directory / "b.safetensors",
        {
            "w2": ("BF16", [128], random_bytes(256, 2)),
            "sub/w3": ("I8", [10], random_bytes(10, 3)),
            "x\\y": ("U8", [1], b"z"),
        },
    )
    write_index(
        directory,
        {
            "w1": "a.safetensors",
            "e": "a.safetensors",
            "w2": "b.safetensors",
            "sub/w3": "b.safetensors",
            "x\\y": "b.safetensors",
        },
    )
    return directory


def expected_digests(directory: Path) -> dict[str, str]:
    return {
        name: hashlib.sha256(data).hexdigest()
        for shard in directory.glob("*.safetensors")
        for name, (_, _, data) in reference_tensors(shard).items()
    }


def flip_byte_in_place(shard: Path, tensor: str) -> None:
    """Corrupt one byte of a tensor, keeping the file's size (its mtime and ctime change)."""
    with tensorfs.open_model(shard) as model:
        offset = model.info(tensor).offset
    with open(shard, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_sha256sum_lines_and_parsing_round_trip() -> None:
    digests = {"a": "0" * 64, "b/c": "1" * 64, "back\\slash": "2" * 64, "new\nline": "3" * 64, "sp ace": "a" * 64}
    text = format_manifest(digests)
    assert text.splitlines()[0] == f"{'0' * 64}  a"
    assert sha256sum_line("f" * 64, "back\\slash") == f"\\{'f' * 64}  back\\\\slash\n"
    assert parse_manifest(text, "m") == digests
    assert parse_manifest(format_manifest(digests, as_json=True), "m") == digests
    assert parse_manifest(f"{'A' * 64} *binary\n", "m") == {"binary": "a" * 64}
    with pytest.raises(ManifestError, match="m:1: not a sha256sum line"):
        parse_manifest("nonsense\n", "m")
    with pytest.raises(ManifestError, match="listed twice"):
        parse_manifest(f"{'0' * 64}  a\n{'1' * 64}  a\n", "m")
    with pytest.raises(ManifestError, match="64-digit hex"):
        parse_manifest('{"a": "xyz"}', "m")


def test_manifest_matches_sha256sum_of_the_bytes(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["manifest", "--cache-dir", str(tmp_path / "cache"), str(model_dir)]) == 0
    out = capsys.readouterr().out
    assert parse_manifest(out, "stdout") == expected_digests(model_dir)
    assert [line.split("  ", 1)[1] for line in out.splitlines()] == ["e", "sub/w3", "w1", "w2", "x\\\\y"]
    assert main(["manifest", "--json", "--no-cache", "-o", str(tmp_path / "m.json"), str(model_dir)]) == 0
    assert json.loads((tmp_path / "m.json").read_text()) == expected_digests(model_dir)


def test_verify_round_trip_and_a_flipped_byte(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = ["--cache-dir", str(tmp_path / "cache")]
    assert main(["manifest", *cache, "-o", str(model_dir / "tensors.sha256"), str(model_dir)]) == 0
    assert main(["verify", *cache, str(model_dir)]) == 0
    assert capsys.readouterr().out == f"{model_dir}: all 5 tensors match {model_dir / 'tensors.sha256'}\n"
    flip_byte_in_place(model_dir / "b.safetensors", "w2")  # rewritten in place: the cache must not answer
    assert main(["verify", *cache, str(model_dir)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert err[0].startswith(
        f"error: {model_dir / 'b.safetensors'}: tensor 'w2': does not match {model_dir / 'tensors.sha256'}"
    )


def test_verify_lists_missing_and_unexpected(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    digests = expected_digests(model_dir)
    del digests["w1"]
    digests["ghost"] = "0" * 64
    manifest = tmp_path / "m.sha256"
    manifest.write_text(format_manifest(digests))
    assert main(["verify", "--no-cache", "--manifest", str(manifest), str(model_dir)]) == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {manifest}: tensor 'ghost': is in the manifest but not in the model",
        f"error: {manifest}: tensor 'w1': is in the model but not in the manifest",
    ]
    assert main(["verify", str(model_dir)]) == 1
    assert "no tensors.sha256 here; name a manifest with --manifest FILE" in capsys.readouterr().err


def big_model(directory: Path) -> Path:
    """Tensors worth caching (>= CACHE_MIN_BYTES) and one that is not, in two shards."""
    directory.mkdir()
    write_reference(
        directory / "a.safetensors",
        {"w1": ("U8", [512 << 10], random_bytes(512 << 10, 1)), "small": ("U8", [8], random_bytes(8, 2))},
    )
    write_reference(
        directory / "b.safetensors",
        {"w2": ("U8", [300 << 10], random_bytes(300 << 10, 3)), "w3": ("U8", [256 << 10], random_bytes(256 << 10, 4))},
    )
    return directory


def settled_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let files just written be cached (in this process); the racy window has a test of its own."""
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 0)


def test_cache_serves_unchanged_shards_and_never_changed_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settled_at_once(monkeypatch)
    model_dir = big_model(tmp_path / "model")
    assert CACHE_MIN_BYTES == 256 << 10
    with tensorfs.open_model(model_dir) as model:
        hasher = Hasher(model, HashCache(tmp_path / "cache"))
        first = hasher.hash_all()
    assert first == expected_digests(model_dir) and hasher.tensors_hashed == 4
    with tensorfs.open_model(model_dir) as model:
        hasher = Hasher(model, HashCache(tmp_path / "cache"))
        assert hasher.hash_all() == first
    # all from the cache, from a new connection, but the tensor too small to be worth a row
    assert (hasher.tensors_hashed, hasher.cache_hits) == (1, 3)
    flip_byte_in_place(model_dir / "a.safetensors", "w1")
    with tensorfs.open_model(model_dir) as model:
        hasher = Hasher(model, HashCache(tmp_path / "cache"))
        again = hasher.hash_all()
    assert again["w1"] != first["w1"] and again == expected_digests(model_dir)
    assert (hasher.tensors_hashed, hasher.cache_hits) == (2, 2)  # the changed shard hashed again, nothing else


def test_hashes_are_cached_in_a_few_transactions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One commit per tensor made a manifest of 60k small tensors 7x slower with a cache than without.
    tensors = {f"t{i:04d}": ("U8", [256 << 10], random_bytes(16, i) * (16 << 10)) for i in range(200)}
    write_reference(tmp_path / "m.safetensors", tensors)
    commits: list[int] = []
    real = HashCache.put_many
    monkeypatch.setattr(
        HashCache,
        "put_many",
        lambda self, identity, hashes: commits.append(len(hashes)) or real(self, identity, hashes),
    )
    with tensorfs.open_model(tmp_path / "m.safetensors") as model:
        digests = Hasher(model, HashCache(tmp_path / "cache")).hash_all()
    assert len(digests) == 200 and sum(commits) == 200 and len(commits) <= 2


def test_a_broken_cache_degrades_to_no_cache(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A tensor big enough for the hash cache (the model's others are too small to ever be looked up).
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    big = tensorfs.proof.integrity.CACHE_MIN_BYTES
    write_reference(
        model_dir / "m.safetensors", {"big": ("U8", [big], random_bytes(big, 1)), "small": ("U8", [3], b"abc")}
    )
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / HashCache.FILE_NAME).write_bytes(b"this is not a database" * 100)
    unwritable = tmp_path / "file-not-dir"
    unwritable.write_text("x")
    for directory in (corrupt, unwritable):
        with caplog.at_level(logging.WARNING), tensorfs.open_model(model_dir) as model:
            cache = HashCache(directory)
            assert Hasher(model, cache).hash_all() == expected_digests(model_dir)
            assert not cache.enabled
        assert "going on without it" in caplog.text
        caplog.clear()


def test_concurrent_openers_of_one_unverified_tensor_share_one_hashing(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with tensorfs.open_model(model_dir) as model:
        model.gate.set_integrity(Integrity(Hasher(model), expected_digests(model_dir)))
        ops = TensorOperations(Tree(model, "slash", {}))
        inode = ops.tree.tensor_inode("w1")
        opened: list[Any] = []

        async def open_many() -> None:
            async with trio.open_nursery() as nursery:
                for _ in range(6):
                    nursery.start_soon(lambda: _open(ops, inode, opened))

        trio.run(open_many)
        assert len(opened) == 6 and ops.gate.integrity.hasher.tensors_hashed == 1
        assert "w1" in ops.gate.integrity.verified


async def _open(ops: TensorOperations, inode: int, opened: list[Any]) -> None:
    opened.append(await ops.open(inode, os.O_RDONLY, None))


def test_a_mismatch_refuses_that_tensor_only(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    expected = expected_digests(model_dir)
    flip_byte_in_place(model_dir / "a.safetensors", "w1")
    with tensorfs.open_model(model_dir) as model:
        model.gate.set_integrity(Integrity(Hasher(model), expected))
        ops = TensorOperations(Tree(model, "slash", {}))
        with caplog.at_level(logging.ERROR), pytest.raises(tensorfs.mount.operations.pyfuse3.FUSEError) as caught:
            trio.run(ops.open, ops.tree.tensor_inode("w1"), os.O_RDONLY, None)
        assert caught.value.errno == errno.EIO
        assert "tensor 'w1' in shard" in caplog.text and "does not match the manifest" in caplog.text
        fh = trio.run(ops.open, ops.tree.tensor_inode("w2"), os.O_RDONLY, None).fh
        assert bytes(trio.run(ops.read, fh, 0, 1024)) == reference_tensors(model_dir / "b.safetensors")["w2"][2]
        sidecar = trio.run(ops.read, ops.tree.tensor_inode("w1") + 2, 0, 200)
        assert sidecar == f"{expected['w1']}  w1\n".encode()  # the manifest's value
        sums = trio.run(ops.read, ops.tree.sums_inode, 0, 10_000)
        assert f"{expected['sub/w3']}  sub/w3\n".encode() in sums


# -- through a real mount --------------------------------------------------------------------


def test_sha256sums_checks_the_whole_mount(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir, "--no-cache")
    result = subprocess.run(
        ["sha256sum", "--strict", "-c", ".tensorfs/SHA256SUMS"], cwd=mountpoint, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(": OK") == 5


def test_names_gnu_escapes_check_with_the_real_sha256sum(mounts: Mounts, tmp_path: Path) -> None:
    # sha256sum writes a name holding a backslash, a newline or a carriage return escaped, its line
    # marked with a leading backslash: tensorfs's lists must read back with coreutils' own -c.
    names = ["new\nline", "back\\slash", "carriage\rreturn", "sub/both\\\nx", "plain"]
    shard = tmp_path / "odd.safetensors"
    write_reference(shard, {name: ("U8", [7 + i], random_bytes(7 + i, i)) for i, name in enumerate(names)})
    manifest = tmp_path / "m.sha256"  # not the tensors.sha256 a mount would take: its sidecars are hashed
    result = mounts.run("manifest", "--no-cache", "-o", str(manifest), str(shard))
    assert result.returncode == 0, result.stderr
    mountpoint = mounts.mount(shard, "--no-cache")
    # what coreutils itself writes of the mounted files, in the manifest's order
    gnu = subprocess.run(["sha256sum", "--", *sorted(names)], cwd=mountpoint, capture_output=True, check=True)
    assert manifest.read_bytes() == gnu.stdout
    escaped = [line.startswith(b"\\") for line in gnu.stdout.splitlines()]
    assert escaped == [name != "plain" for name in sorted(names)]
    for listing in (manifest, mountpoint / ".tensorfs" / "SHA256SUMS"):
        result = subprocess.run(["sha256sum", "--strict", "-c", str(listing)], cwd=mountpoint, capture_output=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count(b": OK\n") == len(names) and b"FAILED" not in result.stdout, result.stdout
    for name in names:
        sidecar = mountpoint / f"{name}.sha256"
        result = subprocess.run(["sha256sum", "--strict", "-c", sidecar.name], cwd=sidecar.parent, capture_output=True)
        assert (result.returncode, result.stdout.count(b": OK\n")) == (0, 1), (name, result.stdout + result.stderr)


def test_mount_with_a_manifest_refuses_only_the_corrupt_tensor(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    (model_dir / "tensors.sha256").write_text(format_manifest(expected_digests(model_dir)))
    flip_byte_in_place(model_dir / "a.safetensors", "w1")
    mountpoint = mounts.mount(model_dir, "--cache-dir", str(tmp_path / "cache"))  # tensors.sha256 found in MODEL
    with pytest.raises(OSError) as caught:
        (mountpoint / "w1").read_bytes()
    assert caught.value.errno == errno.EIO
    assert (mountpoint / "w2").read_bytes() == reference_tensors(model_dir / "b.safetensors")["w2"][2]
    assert "tensor 'w1' in shard" in mounts.log() and "does not match the manifest" in mounts.log()
    result = subprocess.run(["sha256sum", "-c", ".tensorfs/SHA256SUMS"], cwd=mountpoint, capture_output=True, text=True)
    assert result.returncode == 1
    assert "w1: FAILED open or read" in result.stdout and "w2: OK" in result.stdout and "sub/w3: OK" in result.stdout


def test_a_sha256_is_hashed_in_a_worker_thread_while_other_reads_are_answered(mounts: Mounts, tmp_path: Path) -> None:
    # The shard of the mount under test ("upper") is a file of another tensorfs mount ("lower"): stopping
    # the lower daemon holds the upper one's hashing mid-way, in whatever thread does it, for as long as
    # the test likes. Meanwhile the upper daemon must answer reads of bytes already in memory.
    big = 256 * MIB
    source = tmp_path / "source"
    source.mkdir()
    small = random_bytes(MIB, 5)
    shard = source / "a.safetensors"
    shard.write_bytes(raw_shard({"big": entry("U8", [big], 0, big), "small": entry("U8", [MIB], big, big + MIB)}))
    os.truncate(shard, shard.stat().st_size + big)  # big: zeros, in a hole
    with open(shard, "ab") as f:
        f.write(small)
    lower = mounts.mount(source, "--no-cache")
    lower_pid = mounts.daemon_pid(lower)
    view = lower / ".tensorfs" / "model" / "a.safetensors"
    upper = mounts.mount(view, "--no-cache", "--log-file", str(tmp_path / "upper.log"))
    mounts.mountpoints.reverse()  # the upper mount holds the lower one's file: it goes first
    pid = mounts.daemon_pid(upper)
    with tensorfs.open_model(view) as model:
        offset = model.info("small").offset
    with open(view, "rb") as f:  # small's pages of the lower file are in memory from now on
        assert os.pread(f.fileno(), MIB, offset) == small
    before = thread_read_bytes(pid)
    sidecar: list[str] = []
    hashing = threading.Thread(target=lambda: sidecar.append((upper / "big.sha256").read_text()))
    hashing.start()
    try:

        def hashed() -> dict[int, int]:
            return {tid: count - before.get(tid, 0) for tid, count in thread_read_bytes(pid).items()}

        wait_until(lambda: max(hashed().values()) >= 8 * MIB, what="the hashing to be under way")
        os.kill(lower_pid, signal.SIGSTOP)  # from here the hashing cannot end
        try:
            worker = max(hashed().items(), key=lambda item: item[1])[0]
            assert worker != pid  # not the request thread
            other: list[bytes] = []  # a read of bytes in memory, answered while big is being hashed
            reader = threading.Thread(target=lambda: other.append((upper / "small").read_bytes()), daemon=True)
            reader.start()
            reader.join(patience(30))
            assert other == [small], "no answer while a hash ran"
            assert hashing.is_alive() and sum(hashed().values()) < big
        finally:
            os.kill(lower_pid, signal.SIGCONT)
    finally:
        hashing.join(patience(60))
    assert sidecar == [f"{zeros_sha256(big)}  big\n"]


def test_verify_all_refuses_to_mount_a_corrupt_model(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    manifest = tmp_path / "m.json"
    manifest.write_text(format_manifest(expected_digests(model_dir), as_json=True))
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    ok = mounts.mount(model_dir, "--manifest", str(manifest), "--verify", "all", "--no-cache")
    assert (ok / "w1").read_bytes() == reference_tensors(model_dir / "a.safetensors")["w1"][2]
    flip_byte_in_place(model_dir / "b.safetensors", "sub/w3")
    result = mounts.attempt(
        model_dir, "--manifest", str(manifest), "--verify", "all", "--no-cache", mountpoint=mountpoint
    )
    assert result.returncode == 1
    assert (
        result.stderr
        == f"error: {model_dir / 'b.safetensors'}: tensor 'sub/w3': does not match {manifest}; nothing mounted\n"
    )
    assert not os.path.ismount(mountpoint)
    incomplete = tmp_path / "incomplete.sha256"
    incomplete.write_text(format_manifest({"w1": "0" * 64}))
    result = mounts.attempt(model_dir, "--manifest", str(incomplete), mountpoint=mountpoint)
    assert result.returncode == 1 and "tensor 'w2': is in the model but not in the manifest" in result.stderr


def test_verify_off_ignores_the_manifest(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    wrong = {**expected_digests(model_dir), "w1": "0" * 64}
    (model_dir / "tensors.sha256").write_text(format_manifest(wrong))  # found in MODEL, and wrong about w1
    checked = mounts.mount(model_dir, "--no-cache")
    with pytest.raises(OSError) as caught:
        (checked / "w1").read_bytes()
    assert caught.value.errno == errno.EIO
    unchecked = mounts.mount(model_dir, "--no-cache", "--verify", "off")
    w1 = reference_tensors(model_dir / "a.safetensors")["w1"][2]
    assert (unchecked / "w1").read_bytes() == w1
    assert (unchecked / "w1.sha256").read_text() == f"{hashlib.sha256(w1).hexdigest()}  w1\n"  # the bytes' hash
    assert json.loads((unchecked / ".tensorfs" / "daemon.json").read_bytes())["options"]["manifest"] is False
    garbage = tmp_path / "garbage.sha256"
    garbage.write_text("not a manifest\n")
    ignored = mounts.mount(model_dir, "--no-cache", "--manifest", str(garbage), "--verify", "off")
    assert (ignored / "w1").read_bytes() == w1


def test_progress_line_only_on_a_terminal() -> None:
    import io

    from tensorfs.utils.progress import Progress

    shown = io.StringIO()
    with Progress(4 << 20, "hashing", shown, enabled=True) as progress:
        progress.advance(4 << 20)
    assert shown.getvalue().startswith("\rhashing 4.0 MiB / 4.0 MiB") and shown.getvalue().endswith("\n")
    quiet = io.StringIO()  # not a terminal: not a byte
    with Progress(10, "hashing", quiet) as progress:
        progress.advance(10)
    assert quiet.getvalue() == ""


def test_hashes_of_files_changed_too_lately_to_tell_are_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With second-grained timestamps a rewrite in the same second keeps the identity (and the hash).
    monkeypatch.setattr(tensorfs.utils.identity, "SETTLED_NS", 3600 * 10**9)
    model_dir = big_model(tmp_path / "model")
    for _ in range(2):
        with tensorfs.open_model(model_dir) as model:
            hasher = Hasher(model, HashCache(tmp_path / "cache"))
            assert hasher.hash_all() == expected_digests(model_dir)
        assert (hasher.tensors_hashed, hasher.cache_hits) == (4, 0)


def test_the_cache_answers_one_tensor_or_a_whole_shard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settled_at_once(monkeypatch)
    # more tensors than are asked for one by one, each big enough to be cached
    tensors = {f"t{i:03d}": ("U8", [256 << 10], random_bytes(8, i) * (32 << 10)) for i in range(100)}
    write_reference(tmp_path / "m.safetensors", tensors)
    with tensorfs.open_model(tmp_path / "m.safetensors") as model:
        first = Hasher(model, HashCache(tmp_path / "cache")).hash_all()
        whole = Hasher(model, HashCache(tmp_path / "cache"))
        assert whole.hash_all() == first  # the whole shard at once
        integrity = Integrity(Hasher(model, HashCache(tmp_path / "cache")))
        assert [integrity.digest(name) for name in ("t000", "t099")] == [first["t000"], first["t099"]]  # one each
        assert whole.tensors_hashed == integrity.hasher.tensors_hashed == 0
        assert first["t042"] == hashlib.sha256(tensors["t042"][2]).hexdigest()
