"""Shards that change under a mount: no wrong byte is served, no hashing kills the daemon.

Without a manifest, a shard whose status changes is held while the bytes served from it are read
again: all as their fingerprints say (a chmod, a chown, a touch, an xattr, a link made and removed,
the same bytes written again), it is served on and no reader is ended; one other, it is no longer
the file served: its tensors answer EIO until remounted. With a manifest, its tensors are verified
again before any more of their bytes are served. A shard replaced by rename keeps serving the file
that was validated (test_faults.py).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import pytest

import tensorfs
from conftest import Mounts, drop_caches, missing_root, require, wait_until
from helpers import (
    MIB,
    daemon_stats,
    entry,
    errno_of_reading,
    fingerprints_pending,
    invalidated,
    mib_sharded_model,
    model_bytes,
    patience,
    random_bytes,
    raw_shard,
    thread_read_bytes,
    write_reference,
    zeros_sha256,
)
from tensorfs.mount.mounttable import pid_alive
from tensorfs.mount.runtime import record_path
from tensorfs.proof.integrity import Hasher
from tensorfs.proof.manifest import format_manifest


def offset_of(model_dir: Path, name: str) -> int:
    with tensorfs.open_model(model_dir) as model:
        return model.info(name).offset


def overwrite_in_place(shard: Path, offset: int, data: bytes) -> None:
    """What `dd conv=notrunc` does: new bytes over old ones, the file's inode and size kept."""
    subprocess.run(
        ["dd", f"of={shard}", "bs=1", f"seek={offset}", "conv=notrunc", "status=none"], input=data, check=True
    )


def refused(reader: BinaryIO, validated: bytes, offset: int) -> bool:
    """Whether a read by an open reader gets EIO; until then it may only get the validated bytes
    (pages the kernel cached before the change, until the daemon has it drop them)."""
    try:
        assert os.pread(reader.fileno(), 4096, offset) == validated[offset : offset + 4096]
    except OSError as exc:
        return exc.errno == errno.EIO
    return False


def with_manifest(model_dir: Path) -> None:
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in model_bytes(model_dir).items()}
    (model_dir / "tensors.sha256").write_text(format_manifest(digests))


# -- without a manifest ---------------------------------------------------------------------


def test_a_shard_truncated_under_the_mount(mounts: Mounts, model_dir: Path) -> None:
    """Cut under the mount (and written again and again after): its tensors, their sidecars and
    SHA256SUMS are EIO, read as often as they are; the log says so in one ERROR line for the
    shard, one for each tensor refused, one for SHA256SUMS: no more."""
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "t1.0").read_bytes() == expected["t1.0"]  # its pages are then the kernel's
    reader = open(mountpoint / "t1.3", "rb")  # noqa: SIM115 - a reader served before the cut, reading on after it
    shard = model_dir / "s1.safetensors"
    try:
        assert reader.read(4096) == expected["t1.3"][:4096]
        os.truncate(shard, offset_of(model_dir, "t1.2") + 10)  # t1.2 and t1.3 lose bytes
        for _ in range(3):
            for name in ("t1.1", "t1.2", "t1.3", "t1.2.sha256", ".tensorfs/SHA256SUMS"):
                assert errno_of_reading(mountpoint / name) == errno.EIO, name
            with open(shard, "r+b") as written:  # changed again: still one shard, refused once
                written.write(b"\xff")
        invalidated(mountpoint)  # what the kernel had cached of the shard is dropped too
        assert refused(reader, expected["t1.3"], 3 * MIB)
    finally:
        reader.close()
    assert errno_of_reading(mountpoint / "t1.0") == errno.EIO  # no file of it is served again
    assert pid_alive(pid)
    for kept in ("t0.3", "t2.1"):
        assert (mountpoint / kept).read_bytes() == expected[kept]
    assert (mountpoint / "t2.1.sha256").read_text().startswith(hashlib.sha256(expected["t2.1"]).hexdigest())
    errors = [line.partition(" ERROR ")[2] for line in mounts.log().splitlines() if " ERROR " in line]
    said = f"its shard {shard} was changed under the mount; mount it again"
    assert sorted(errors) == sorted(
        [
            f"shard {shard} was changed in place under the mount: it is no longer the file that was validated, "
            "and its 4 tensors answer EIO until it is mounted again",
            *(f"tensor '{name}': refused (EIO): {said}" for name in ("t1.0", "t1.1", "t1.2", "t1.3")),
            f"SHA256SUMS: refused (EIO): shard {shard} was changed under the mount; mount it again",
        ]
    ), errors


def refused_uncached(reader: BinaryIO, validated: bytes, offset: int) -> bool:
    """`refused`, with what the kernel cached of the file dropped first: the read is the daemon's to answer."""
    os.posix_fadvise(reader.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return refused(reader, validated, offset)


def test_a_shard_truncated_under_a_reader_already_served(mounts: Mounts, model_dir: Path) -> None:
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    with open(mountpoint / "t1.3", "rb", buffering=0) as reader:
        assert reader.read() == expected["t1.3"]  # served whole: the daemon holds its range as ready
        waits = daemon_stats(mountpoint)["page_waits"]
        os.posix_fadvise(reader.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        assert os.pread(reader.fileno(), 4096, 2 * MIB) == expected["t1.3"][2 * MIB : 2 * MIB + 4096]
        assert daemon_stats(mountpoint)["page_waits"] == waits  # answered on the path that brings in no pages
        os.truncate(model_dir / "s1.safetensors", offset_of(model_dir, "t1.3") + MIB)
        # Refused on that same path, both where the validated bytes are still in the file and where they are cut.
        for offset in (0, 2 * MIB):
            wait_until(lambda o=offset: refused_uncached(reader, expected["t1.3"], o), what=f"a read at {offset}")
    for name in ("t1.0", "t1.1"):  # never read before: nothing of them cached, the daemon answers
        assert errno_of_reading(mountpoint / name) == errno.EIO, name
    assert pid_alive(pid)
    for kept in ("t0.3", "t2.1"):
        assert (mountpoint / kept).read_bytes() == expected[kept]
    assert "tensor 't1.3': refused (EIO)" in mounts.log()


def sparse_model(directory: Path, big: int) -> dict[str, bytes]:
    """A shard whose tensor 'big' is `big` bytes of zeros (a hole: nothing on disk) after a 1 MiB 'small',
    and a shard of small tensors; every tensor's bytes but big's."""
    directory.mkdir()
    small = random_bytes(MIB, 7)
    header = {"small": entry("U8", [MIB], 0, MIB), "big": entry("U8", [big], MIB, MIB + big)}
    shard = directory / "a.safetensors"
    shard.write_bytes(raw_shard(header, small))
    os.truncate(shard, shard.stat().st_size + big)
    others = {f"o{i}": ("U8", [MIB], random_bytes(MIB, 8 + i)) for i in range(2)}
    write_reference(directory / "b.safetensors", others)
    return {"small": small, **{name: data for name, (_, _, data) in others.items()}}


def first_read(path: Path) -> bytes | int | None:
    """What one read of a file's first 4 KiB answers (the errno it fails with); the file opened first."""
    try:
        with open(path, "rb", buffering=0) as file:
            return os.pread(file.fileno(), 4096, 0)
    except OSError as exc:
        return exc.errno


def hashing_thread_reads(pid: int, before: dict[int, int]) -> int:
    """Bytes the daemon's worker threads have read since `before` (the request thread reads only requests)."""
    now = thread_read_bytes(pid)
    return sum(count - before.get(tid, 0) for tid, count in now.items() if tid != pid)


@pytest.mark.parametrize("hashing", ["sidecar", "verification"])
def test_a_shard_truncated_while_a_tensor_is_hashed(mounts: Mounts, tmp_path: Path, hashing: str) -> None:
    # 'sidecar': big.sha256 read, no manifest: the daemon hashes big. 'verification': big opened, with a
    # manifest: the daemon hashes big before serving a byte of it. Either way the shard is cut meanwhile.
    big = 1 << 30
    expected = sparse_model(tmp_path / "model", big)
    model_dir = tmp_path / "model"
    if hashing == "verification":
        digests = {name: hashlib.sha256(data).hexdigest() for name, data in expected.items()}
        (model_dir / "tensors.sha256").write_text(format_manifest({**digests, "big": zeros_sha256(big)}))
    mountpoint = mounts.mount(model_dir, "--no-cache")
    pid = mounts.daemon_pid(mountpoint)
    before = thread_read_bytes(pid)
    outcome: list[bytes | int | None] = []
    target = mountpoint / ("big.sha256" if hashing == "sidecar" else "big")
    reader = threading.Thread(target=lambda: outcome.append(first_read(target)))
    reader.start()
    try:
        wait_until(lambda: hashing_thread_reads(pid, before) >= 8 * MIB, what="the hashing to be under way")
        os.kill(pid, signal.SIGSTOP)
        try:
            hashed = hashing_thread_reads(pid, before)
            assert hashed < big, "the hashing finished before the shard could be cut"
            os.truncate(model_dir / "a.safetensors", offset_of(model_dir, "big") + 16 * MIB)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        reader.join(patience(60))
    assert not reader.is_alive() and outcome == [errno.EIO]
    assert pid_alive(pid)
    assert (mountpoint / "o1").read_bytes() == expected["o1"]  # the other shard is served
    log = mounts.log()
    if hashing == "sidecar":  # its shard is not the validated file any more
        assert errno_of_reading(mountpoint / "small") == errno.EIO
        assert f"shard {model_dir / 'a.safetensors'} was changed in place under the mount" in log
    else:  # its bytes are still in the file: verified again, and served
        assert (mountpoint / "small").read_bytes() == expected["small"]
        assert "tensor 'big' cannot be verified (refused, EIO)" in log and "of the tensor are gone" in log


def test_a_shard_overwritten_in_place_is_refused_until_remounted(mounts: Mounts, model_dir: Path) -> None:
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "t2.1").read_bytes() == expected["t2.1"]
    overwrite_in_place(model_dir / "s2.safetensors", offset_of(model_dir, "t2.1") + 5, b"\xff" * 64)
    for name in ("t2.0", "t2.3", "t2.3.sha256"):
        assert errno_of_reading(mountpoint / name) == errno.EIO, name
    invalidated(mountpoint)  # t2.1's cached pages gone too
    assert errno_of_reading(mountpoint / "t2.1") == errno.EIO
    assert (mountpoint / "t0.1").read_bytes() == expected["t0.1"] and pid_alive(pid)
    assert f"shard {model_dir / 's2.safetensors'} was changed in place" in mounts.log()
    assert mounts.run("umount", str(mountpoint)).returncode == 0
    mounts.mount(model_dir, mountpoint=mountpoint)  # what is there now is validated afresh, and served
    assert (mountpoint / "t2.1").read_bytes() == model_bytes(model_dir)["t2.1"] != expected["t2.1"]


@pytest.mark.parametrize("merged", [False, True], ids=["folder", "merged"])
def test_the_view_of_a_shard_overwritten_in_place_is_refused(mounts: Mounts, model_dir: Path, merged: bool) -> None:
    """A shard written in place under a mount (no manifest): the view's bytes of its tensors are
    refused, in its own file as it is (whose header stays served as validated) and in a merged file;
    another shard's tensors are served on."""
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir, *(["--view", "merged"] if merged else []))
    folder = mountpoint / ".tensorfs" / "model"

    def file_of(name: str) -> Path:
        return folder / ("model.safetensors" if merged else f"s{name[1]}.safetensors")

    def header_of(file: Path) -> tuple[int, dict[str, Any]]:
        with open(file, "rb") as opened:
            length = int.from_bytes(opened.read(8), "little")
            return length, json.loads(opened.read(length))

    headers = {name: header_of(file_of(name)) for name in ("t0.1", "t2.1", "t2.2")}
    for name in headers:
        file_of(name).read_bytes()  # and kept in the kernel's cache

    def read_of(name: str) -> bytes | int:
        length, header = headers[name]
        begin, end = header[name]["data_offsets"]
        try:
            with open(file_of(name), "rb", buffering=0) as file:
                return os.pread(file.fileno(), end - begin, 8 + length + begin)
        except OSError as exc:
            return exc.errno or 0

    assert read_of("t2.1") == expected["t2.1"]
    overwrite_in_place(model_dir / "s2.safetensors", offset_of(model_dir, "t2.1") + 5, b"\xff" * 64)
    invalidated(mountpoint)  # the view's cached pages of t2.1 gone too
    assert read_of("t2.1") == errno.EIO
    assert read_of("t2.2") == errno.EIO and read_of("t0.1") == expected["t0.1"]


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no-manifest"])
def test_attributes_of_a_shard_may_change(mounts: Mounts, model_dir: Path, tmp_path: Path, manifest: bool) -> None:
    """`touch`, `chmod` and `chown` of a shard under the mount: the mounted files show the new
    attributes; and since nothing tells a chmod from a write through a shared mapping whose mtime
    was set back (tests/test_hidden_writes.py), each may be a change of its bytes: with a manifest its
    tensors are verified again, without one the bytes served from it are read again and compared
    with their fingerprints; either way every byte is served on."""
    require("root (it gives a shard to another owner)", missing_root())
    expected = model_bytes(model_dir)
    sums = tmp_path / "tensors.sha256"
    sums.write_text(format_manifest({name: hashlib.sha256(blob).hexdigest() for name, blob in expected.items()}))
    mountpoint = mounts.mount(model_dir, *(["--manifest", str(sums)] if manifest else []))
    shard, tensor = model_dir / "s0.safetensors", mountpoint / "t0.0"
    os.utime(shard, ns=(10**18, 10**18))  # `touch`: the bytes are the same
    wait_until(lambda: tensor.stat().st_mtime_ns == 10**18, what="the new mtime to show")
    os.chmod(shard, 0o640)
    wait_until(lambda: stat.S_IMODE(tensor.stat().st_mode) & 0o444 == 0o440, what="the new mode to show")
    os.chown(shard, 4242, 4243)
    wait_until(lambda: (tensor.stat().st_uid, tensor.stat().st_gid) == (4242, 4243), what="the new owner to show")
    for name in ("t0.0", "t0.1", "t0.2", "t0.3"):
        assert (mountpoint / name).read_bytes() == expected[name], name
    assert (mountpoint / "t1.0").read_bytes() == expected["t1.0"]  # another shard: untouched, served
    said = mounts.log()
    assert f"shard {shard} changed under the mount" in said and "was changed in place" not in said


# `tensorfs mount` with a shard overwritten in place at one of two moments: in the command, after it
# validated the model and before the daemon maps the files again ("reopen"); or in the daemon, after
# it mapped them and before it serves (and watches) them.
MOUNT_WITH_A_WRITE = """
import sys
import tensorfs.cli, tensorfs.mount.daemon, tensorfs.mount.serve
moment, shard, offset = sys.argv[1], sys.argv[2], int(sys.argv[3])
def overwrite():
    with open(shard, "r+b") as f:
        f.seek(offset)
        f.write(b"\\xff" * 64)
def before(module, name):
    real = getattr(module, name)
    def patched(*args, **kwargs):
        overwrite()
        return real(*args, **kwargs)
    setattr(module, name, patched)
before(*{"reopen": (tensorfs.mount.daemon, "snapshot"), "serving": (tensorfs.mount.serve, "serve")}[moment])
sys.exit(tensorfs.cli.main(["mount", *sys.argv[4:]]))
"""


def mount_with_a_write(mounts: Mounts, moment: str, shard: Path, offset: int, model_dir: Path) -> tuple[Path, str]:
    mountpoint = mounts.tmp_path / f"mnt{len(mounts.mountpoints)}"
    mountpoint.mkdir()
    mounts.mountpoints.append(mountpoint)
    arguments = [moment, str(shard), str(offset), "--log-file", str(mounts.log_file), str(model_dir), str(mountpoint)]
    result = subprocess.run(
        [sys.executable, "-c", MOUNT_WITH_A_WRITE, *arguments], capture_output=True, text=True, timeout=patience(120)
    )
    assert result.returncode in (0, 1), result.stderr
    return mountpoint, result.stderr if result.returncode else ""


def test_a_shard_changed_before_the_daemon_maps_it_is_refused(mounts: Mounts, model_dir: Path) -> None:
    shard = model_dir / "s1.safetensors"
    mountpoint, error = mount_with_a_write(mounts, "reopen", shard, offset_of(model_dir, "t1.2"), model_dir)
    assert error == f"error: {shard}: changed while it was being validated; try again\n"
    assert not os.path.ismount(mountpoint) and not record_path(mountpoint).exists()


def test_a_shard_changed_before_the_daemon_serves_it_is_served_as_it_is(mounts: Mounts, model_dir: Path) -> None:
    """Written after the daemon mapped it, before it served a byte of it: seen at once (its size and
    times against those validated), and checked: no byte of it was served, so none can differ from
    what was; its tensors are served as the file holds them, each the same however often it is read
    (until then, d4c56fe refused them all, as it refused a chmod)."""
    expected = model_bytes(model_dir)
    shard = model_dir / "s1.safetensors"
    where = offset_of(model_dir, "t1.2")
    mountpoint, error = mount_with_a_write(mounts, "serving", shard, where, model_dir)
    assert error == "" and os.path.ismount(mountpoint)
    now = shard.read_bytes()[where : where + len(expected["t1.2"])]
    assert now[:64] == b"\xff" * 64 and now != expected["t1.2"]
    for _ in range(2):
        assert (mountpoint / "t1.0").read_bytes() == expected["t1.0"]
        assert (mountpoint / "t1.2").read_bytes() == now
    stats = daemon_stats(mountpoint)
    assert (stats["rechecked_shards"], stats["unchanged_shards"], stats["changed_shards"]) == (1, 1, 0)
    assert (mountpoint / "t0.1").read_bytes() == expected["t0.1"]


# -- with a manifest --------------------------------------------------------------------------


def test_a_shard_overwritten_in_place_with_a_manifest(mounts: Mounts, model_dir: Path) -> None:
    expected = model_bytes(model_dir)
    with_manifest(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "t1.1").read_bytes() == expected["t1.1"]  # verified, and cached by the kernel
    reader = open(mountpoint / "t1.1", "rb")  # noqa: SIM115 - a reader verified before the change
    try:
        assert reader.read(4096) == expected["t1.1"][:4096]
        where = offset_of(model_dir, "t1.1") + MIB
        overwrite_in_place(model_dir / "s1.safetensors", where, b"\x00" * 100)
        invalidated(mountpoint)
        assert refused(reader, expected["t1.1"], MIB)
    finally:
        reader.close()
    assert errno_of_reading(mountpoint / "t1.1") == errno.EIO
    assert (mountpoint / "t1.0").read_bytes() == expected["t1.0"]  # same shard, bytes unchanged: verified again
    assert pid_alive(pid)
    log = mounts.log()
    assert f"shard {model_dir / 's1.safetensors'} changed under the mount" in log
    assert "tensor 't1.1' in shard" in log and "does not match the manifest" in log
    overwrite_in_place(model_dir / "s1.safetensors", where, expected["t1.1"][MIB : MIB + 100])  # put back
    invalidated(mountpoint, 2)
    assert errno_of_reading(mountpoint / "t1.1") is None  # verified again
    assert (mountpoint / "t1.1").read_bytes() == expected["t1.1"]


def test_a_shard_truncated_under_a_mount_with_a_manifest(mounts: Mounts, model_dir: Path) -> None:
    # Verifying again hashes the lost bytes: read from the file, they are an error, never a SIGBUS.
    expected = model_bytes(model_dir)
    with_manifest(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "t0.3").read_bytes() == expected["t0.3"]
    os.truncate(model_dir / "s0.safetensors", offset_of(model_dir, "t0.3") + 3 * MIB)
    invalidated(mountpoint)
    assert errno_of_reading(mountpoint / "t0.3") == errno.EIO
    assert errno_of_reading(mountpoint / "t0.2") is None  # before the cut: verified again, and served
    assert pid_alive(pid)
    assert "tensor 't0.3': bytes [3145728, 4194304) of the tensor are gone" in mounts.log()
    assert (mountpoint / "t1.2").read_bytes() == expected["t1.2"]


# -- hashing a shard that shrinks, out of a mount ---------------------------------------------------


SHRINK_THEN_HASH = """
import os, sys, tensorfs
from tensorfs.proof.integrity import Hasher
with tensorfs.open_model(sys.argv[1]) as model:
    os.truncate(sys.argv[2], int(sys.argv[3]))
    try:
        Hasher(model).hash_all()
    except tensorfs.TensorfsError as exc:
        print(type(exc).__name__, exc)
"""


def test_hashing_a_shard_that_shrank_is_an_error_not_a_crash(model_dir: Path) -> None:
    cut = offset_of(model_dir, "t2.2") + 7
    shard = model_dir / "s2.safetensors"
    result = subprocess.run(
        [sys.executable, "-c", SHRINK_THEN_HASH, str(model_dir), str(shard), str(cut)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr  # -7 (SIGBUS) when hashing read the mapping
    assert result.stdout == (  # the largest tensors are hashed first: t2.3 lost all of its bytes
        f"ShardChangedError {shard}: tensor 't2.3': bytes [0, 4194304) of the tensor are gone: "
        "the shard shrank after it was validated\n"
    )


MANIFEST_OF_A_SHRINKING_SHARD = """
import os, sys
import tensorfs.cli, tensorfs.opening.source
real = tensorfs.opening.source.open_location
def open_then_shrink(*args, **kwargs):
    model = real(*args, **kwargs)
    os.truncate(sys.argv[2], int(sys.argv[3]))
    return model
tensorfs.opening.source.open_location = open_then_shrink
sys.exit(tensorfs.cli.main(["manifest", "--no-cache", sys.argv[1]]))
"""


def test_manifest_of_a_shard_that_shrinks_while_hashed(model_dir: Path) -> None:
    shard = model_dir / "s1.safetensors"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            MANIFEST_OF_A_SHRINKING_SHARD,
            str(model_dir),
            str(shard),
            str(shard.stat().st_size - 1),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (
        f"error: {shard}: tensor 't1.3': bytes [4194303, 4194304) of the tensor are gone: "
        "the shard shrank after it was validated\n"
    )


def test_hasher_counts_and_reads_through_the_file(model_dir: Path) -> None:
    expected = model_bytes(model_dir)
    with tensorfs.open_model(model_dir) as model:
        hasher = Hasher(model)
        digests = hasher.hash_all()
    assert digests == {name: hashlib.sha256(data).hexdigest() for name, data in expected.items()}
    assert (hasher.tensors_hashed, hasher.bytes_hashed) == (len(expected), sum(map(len, expected.values())))


# -- a truncation the daemon is never told of --------------------------------------------------------

# `tensorfs mount` whose daemon never learns that a shard changed: its watch drains inotify's events
# and reports none, and the shards' sizes and times tell it nothing.
MOUNT_BLIND = """
import sys
import tensorfs.cli
from tensorfs.sources.watch import ShardWatch
drain = ShardWatch.changes
def changes(self):
    drain(self)
    return []
ShardWatch.changes = changes
ShardWatch.check = lambda self, path, at_once=False: []
sys.exit(tensorfs.cli.main(["mount", *sys.argv[1:]]))
"""


def read_errors(mountpoint: Path) -> int:
    """The reads the daemon itself answered with EIO."""
    errors = daemon_stats(mountpoint)["errors"]
    return sum(e["count"] for e in errors if e["op"] == "read" and e["errno"] == errno.EIO)


def test_a_truncation_is_eio_without_change_detection(mounts: Mounts, model_dir: Path) -> None:
    # The EIO does not come from noticing the change: the daemon is never told of it. A tensor whose
    # range was served whole is answered from the mapping at once (its pages not brought in again),
    # and the kernel, copying the reply out of pages cut from the file, fails the request with EIO;
    # one never served fails to bring its pages in. The daemon never touches a mapped byte: no SIGBUS.
    expected = model_bytes(model_dir)
    mountpoint, daemon = mounts.mount_adopted(model_dir, command=(sys.executable, "-c", MOUNT_BLIND))
    pid = mounts.daemon_pid(mountpoint)
    with open(mountpoint / "t1.3", "rb", buffering=0) as served:
        assert served.read() == expected["t1.3"]  # its range is the daemon's, ready
        page = os.sysconf("SC_PAGE_SIZE")
        cut = -(-(offset_of(model_dir, "t1.2") + MIB) // page) * page  # t1.2 keeps its first MiB or so
        os.truncate(model_dir / "s1.safetensors", cut)
        drop_caches()  # the mounted files' pages too: the kernel asks the daemon again
        waits, errors = daemon_stats(mountpoint)["page_waits"], read_errors(mountpoint)
        with pytest.raises(OSError) as raised:
            os.pread(served.fileno(), MIB, MIB)
        assert raised.value.errno == errno.EIO
        # answered from the mapping, no pages brought in, no error of its own: the kernel's EIO
        assert daemon_stats(mountpoint)["page_waits"] == waits and read_errors(mountpoint) == errors
    assert errno_of_reading(mountpoint / "t1.3") == errno.EIO
    assert errno_of_reading(mountpoint / "t1.2") == errno.EIO  # never served: its pages cannot be brought in
    assert read_errors(mountpoint) > errors
    assert pid_alive(pid)
    for kept in ("t1.0", "t1.1", "t0.3", "t2.1"):  # before the cut, and other shards: the validated bytes
        assert (mountpoint / kept).read_bytes() == expected[kept], kept
    log = mounts.log()
    assert "changed in place" not in log and "the shard shrank after it was validated" in log  # never told
    assert mounts.run("umount", str(mountpoint)).returncode == 0
    assert daemon.exit_status() == (pid, 0)  # never SIGBUS (-7)


# -- changes inotify does not report: sizes and times must tell ----------------------------------

WRITE_THROUGH_A_MAPPING = """
import mmap, os, sys
path, offset, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fd = os.open(path, os.O_RDWR)
mapping = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
mapping[offset : offset + count] = bytes(0xFF ^ b for b in mapping[offset : offset + count])
mapping.close()
os.close(fd)
"""


def never_new(reader: BinaryIO, validated: bytes, offset: int) -> bool:
    """`refused_uncached`: the daemon answers; until it refuses, only the validated bytes (else AssertionError)."""
    return refused_uncached(reader, validated, offset)


def test_a_write_through_another_process_s_shared_mapping(mounts: Mounts, model_dir: Path) -> None:
    # inotify says nothing of writes through a mapping; the kernel moves the file's mtime at the
    # first write to a clean page, and the daemon's look at sizes and times sees it.
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    shard = model_dir / "s2.safetensors"
    where = offset_of(model_dir, "t2.1") + MIB
    with open(mountpoint / "t2.1", "rb", buffering=0) as reader:
        assert reader.read() == expected["t2.1"]  # served whole: the daemon answers it from the mapping at once
        subprocess.run([sys.executable, "-c", WRITE_THROUGH_A_MAPPING, str(shard), str(where), "4096"], check=True)
        assert shard.read_bytes()[where : where + 4096] != expected["t2.1"][MIB : MIB + 4096]  # the shard changed
        # The daemon's own mapping of the shard holds the new bytes now: it must refuse, not serve them.
        wait_until(lambda: never_new(reader, expected["t2.1"], MIB), what="the changed tensor to be refused")
    for name in ("t2.0", "t2.3"):  # the rest of the shard, never read: refused too
        assert errno_of_reading(mountpoint / name) == errno.EIO, name
    assert (mountpoint / "t1.1").read_bytes() == expected["t1.1"] and pid_alive(pid)
    assert f"shard {shard} was changed in place under the mount" in mounts.log()


def test_a_change_whose_event_is_lost_when_inotify_s_queue_overflows(mounts: Mounts, tmp_path: Path) -> None:
    # The daemon stopped, its inotify queue filled with attribute changes of two shards (events of one
    # file in a row would be merged into one), then a third shard written in place with its mtime set
    # back (rsync -t): that write's event is lost to the overflow, and the new ctime alone tells of it.
    model_dir = mib_sharded_model(tmp_path / "model", 4)
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    queue = int(Path("/proc/sys/fs/inotify/max_queued_events").read_text())
    fillers = [model_dir / "s0.safetensors", model_dir / "s1.safetensors"]
    shard = model_dir / "s2.safetensors"
    where = offset_of(model_dir, "t2.1") + MIB
    with open(mountpoint / "t2.1", "rb", buffering=0) as reader:
        assert reader.read() == expected["t2.1"]  # served whole: the daemon answers it from the mapping at once
        os.kill(pid, signal.SIGSTOP)
        try:
            for i in range(queue + 100):  # each an event of its own: more than the queue holds
                fillers[i % 2].chmod(0o600 if i % 4 < 2 else 0o400)
            before = shard.stat()
            with open(shard, "r+b") as f:  # not dd: a child forked now would close the open reader, whose
                f.seek(where)  # FLUSH waits for the stopped daemon
                f.write(b"\xff" * 64)
            os.utime(shard, ns=(before.st_atime_ns, before.st_mtime_ns))
            assert shard.stat().st_size == before.st_size and shard.stat().st_ctime_ns != before.st_ctime_ns
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: never_new(reader, expected["t2.1"], MIB), what="the changed tensor to be refused")
    assert errno_of_reading(mountpoint / "t2.0") == errno.EIO
    assert (mountpoint / "t3.2").read_bytes() == expected["t3.2"] and pid_alive(pid)  # untouched: served
    log = mounts.log()
    assert "inotify's queue overflowed" in log
    assert f"shard {shard} was changed in place under the mount" in log


NP_MEMMAP_READER = """
import hashlib, sys
import numpy as np
path, validated = sys.argv[1], sys.argv[2]
array = np.memmap(path, dtype=np.uint8, mode="r")
print(hashlib.sha256(array).hexdigest(), flush=True)  # every page touched: mapped, from the daemon
sys.stdin.readline()
while True:  # each look copies every byte out of the mapping again: validated bytes, or a fault
    if hashlib.sha256(array).hexdigest() != validated:
        print("other bytes", flush=True)
        sys.exit(3)
"""


@contextlib.contextmanager
def mapping_reader(script: str, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    """A process that maps a tensor file (`script`, one of those above), stopped however the test ends."""
    reader = subprocess.Popen([sys.executable, "-c", script, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        yield reader
    finally:
        if reader.poll() is None:
            reader.kill()
        reader.wait()
        for pipe in (reader.stdin, reader.stdout):
            if pipe is not None:
                pipe.close()


def answer(reader: subprocess.Popen[bytes], word: bytes = b"") -> str:
    """The reader's next line, once told `word` (if any)."""
    assert reader.stdin is not None and reader.stdout is not None
    if word:
        reader.stdin.write(word)
        reader.stdin.flush()
    return reader.stdout.readline().decode().strip()


def last_words(reader: subprocess.Popen[bytes], word: bytes) -> str:
    """All the reader says once told `word`, until it ends (within a deadline)."""
    assert reader.stdin is not None
    reader.stdin.write(word)
    reader.stdin.flush()
    return reader.communicate(timeout=patience(30))[0].decode()


def test_an_np_memmap_reader_of_a_changed_shard_sees_the_validated_bytes_or_a_fault(
    mounts: Mounts, model_dir: Path
) -> None:
    # Its mapped pages are dropped when the daemon learns of the change, and touched again they are
    # asked of the daemon, which refuses them: SIGBUS in the reader, as for any mapped file that fails.
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    validated = hashlib.sha256(expected["t1.2"]).hexdigest()
    with mapping_reader(NP_MEMMAP_READER, str(mountpoint / "t1.2"), validated) as reader:
        assert answer(reader) == validated
        overwrite_in_place(model_dir / "s1.safetensors", offset_of(model_dir, "t1.2") + MIB, b"\xff" * 64)
        said = last_words(reader, b"go\n")
    assert reader.returncode == -signal.SIGBUS and said == "", (reader.returncode, said)
    assert errno_of_reading(mountpoint / "t1.2") == errno.EIO
    assert (mountpoint / "t0.2").read_bytes() == expected["t0.2"] and pid_alive(pid)


# -- a change of a shard's status, its bytes as they were (no manifest) -------------------------

NP_MEMMAP_LOOKS = """
import hashlib, sys
import numpy as np
array = np.memmap(sys.argv[1], dtype=np.uint8, mode="r")
for line in sys.stdin:  # each line asked: every byte of the mapping copied out and hashed, again
    print(hashlib.sha256(array).hexdigest(), flush=True)
"""


def _same_bytes_again(shard: Path) -> None:
    data = shard.read_bytes()
    with open(shard, "r+b") as f:  # written again in place, every byte as it was
        f.write(data)


def _linked_and_unlinked(shard: Path) -> None:
    os.link(shard, shard.with_name("another-name"))
    os.unlink(shard.with_name("another-name"))


METADATA_CHANGES = {
    "chmod": lambda shard: os.chmod(shard, 0o640),
    "chown": lambda shard: os.chown(shard, 4242, 4243),
    "touch": lambda shard: os.utime(shard, ns=(10**18, 10**18)),
    "setxattr": lambda shard: os.setxattr(shard, "user.tensorfs-test", b"1"),
    "hardlink": _linked_and_unlinked,
    "same-bytes": _same_bytes_again,
}


@pytest.mark.parametrize("change", list(METADATA_CHANGES))
def test_a_change_that_leaves_a_shards_bytes_as_they_were_ends_no_reader(
    mounts: Mounts, model_dir: Path, change: str
) -> None:
    """No manifest; a process maps a tensor file (np.memmap) and hashes it, another tensor of the
    same shard is read, one is never read; then the shard's status changes, its bytes as they were.
    The daemon reads the bytes it served again (its counters say so), finds them as they were, and
    serves on: the mapping's reader, its pages dropped, reads them again through the daemon and
    lives; every tensor of the shard is served exact, the one never read too (at d4c56fe: EIO for
    all, and SIGBUS for the mapping's reader)."""
    require("root (chown)", missing_root())
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    validated = hashlib.sha256(expected["t1.2"]).hexdigest()
    with mapping_reader(NP_MEMMAP_LOOKS, str(mountpoint / "t1.2")) as reader:
        assert answer(reader, b"look\n") == validated
        assert (mountpoint / "t1.0").read_bytes() == expected["t1.0"]
        wait_until(lambda: fingerprints_pending(mountpoint) == 0, what="what was served to be fingerprinted")
        METADATA_CHANGES[change](model_dir / "s1.safetensors")

        def checked() -> bool:  # (reading stats.json takes in every change reported so far)
            stats = daemon_stats(mountpoint)
            return bool(stats["unchanged_shards"] + stats["changed_shards"] >= stats["rechecked_shards"])

        wait_until(checked, what="the daemon to read the shard's served bytes again")
        stats = daemon_stats(mountpoint)
        assert stats["changed_shards"] == 0 and stats["unchanged_shards"] == stats["rechecked_shards"]
        # Each a change the kernel reports but a link made and removed (whose events may come as one).
        assert stats["rechecked_shards"] >= (change != "hardlink")
        drop_caches()  # the mapping's pages too: read again, through the daemon
        assert answer(reader, b"look\n") == validated and reader.poll() is None
        for name in ("t1.0", "t1.1", "t1.2", "t1.3"):  # t1.1, t1.3: never read before
            assert (mountpoint / name).read_bytes() == expected[name], name
        assert (mountpoint / "t1.1.sha256").read_text().split()[0] == hashlib.sha256(expected["t1.1"]).hexdigest()
    assert pid_alive(pid) and "was changed in place" not in mounts.log()


def test_a_rewrite_of_bytes_served_after_a_chmod_is_refused(mounts: Mounts, model_dir: Path) -> None:
    """No manifest: a chmod (bytes as they were: served on), then bytes already served rewritten:
    refused, as any write of them; the mapping's reader gets SIGBUS, never other bytes."""
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    validated = hashlib.sha256(expected["t1.2"]).hexdigest()
    with mapping_reader(NP_MEMMAP_LOOKS, str(mountpoint / "t1.2")) as reader:
        assert answer(reader, b"look\n") == validated
        wait_until(lambda: fingerprints_pending(mountpoint) == 0, what="what was served to be fingerprinted")
        os.chmod(model_dir / "s1.safetensors", 0o640)
        wait_until(lambda: daemon_stats(mountpoint)["unchanged_shards"] >= 1, what="the chmod to be checked")
        overwrite_in_place(model_dir / "s1.safetensors", offset_of(model_dir, "t1.2") + MIB, b"\xff" * 64)
        wait_until(lambda: daemon_stats(mountpoint)["changed_shards"] == 1, what="the rewrite to be found")
        assert errno_of_reading(mountpoint / "t1.2") == errno.EIO
        assert errno_of_reading(mountpoint / "t1.1") == errno.EIO  # the rest of the shard too
        said = last_words(reader, b"look\n")
    assert reader.returncode == -signal.SIGBUS and said == "", (reader.returncode, said)
    assert (mountpoint / "t0.2").read_bytes() == expected["t0.2"]
