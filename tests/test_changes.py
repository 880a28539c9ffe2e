"""Shards that change under a mount: no wrong byte is served, no hashing kills the daemon.

Without a manifest a shard changed in place is no longer the validated file: its tensors answer
EIO until remounted. With one, its tensors are verified again before any more of their bytes are
served. A shard replaced by rename keeps serving the file that was validated (test_faults.py).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

import pytest

import tensorfs
from conftest import Mounts, wait_until
from helpers import MIB, errno_of_reading, mib_sharded_model, model_bytes
from tensorfs.integrity import Hasher, format_manifest
from tensorfs.mount.mounttable import pid_alive


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Three shards of four 1-4 MiB tensors, with an index."""
    return mib_sharded_model(tmp_path / "model", 3)


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
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "t1.0").read_bytes() == expected["t1.0"]  # its pages are then the kernel's
    reader = open(mountpoint / "t1.3", "rb")  # noqa: SIM115 - a reader served before the cut, reading on after it
    try:
        assert reader.read(4096) == expected["t1.3"][:4096]
        os.truncate(model_dir / "s1.safetensors", offset_of(model_dir, "t1.2") + 10)  # t1.2 and t1.3 lose bytes
        for name in ("t1.1", "t1.2", "t1.3", "t1.2.sha256", ".tensorfs/SHA256SUMS"):
            assert errno_of_reading(mountpoint / name) == errno.EIO, name
        wait_until(lambda: refused(reader, expected["t1.3"], 3 * MIB), what="the open reader to be refused")
    finally:
        reader.close()
    # what the kernel had cached of the shard is dropped too, soon: no file of it is served again
    wait_until(lambda: errno_of_reading(mountpoint / "t1.0") == errno.EIO, what="t1.0's cached pages to go")
    assert pid_alive(pid)
    for kept in ("t0.3", "t2.1"):
        assert (mountpoint / kept).read_bytes() == expected[kept]
    assert (mountpoint / "t2.1.sha256").read_text().startswith(hashlib.sha256(expected["t2.1"]).hexdigest())
    log = mounts.log()
    assert f"shard {model_dir / 's1.safetensors'} was changed in place under the mount" in log
    assert "tensor 't1.2': refused (EIO)" in log


def test_a_shard_overwritten_in_place_is_refused_until_remounted(mounts: Mounts, model_dir: Path) -> None:
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "t2.1").read_bytes() == expected["t2.1"]
    overwrite_in_place(model_dir / "s2.safetensors", offset_of(model_dir, "t2.1") + 5, b"\xff" * 64)
    for name in ("t2.0", "t2.3", "t2.3.sha256"):
        assert errno_of_reading(mountpoint / name) == errno.EIO, name
    wait_until(lambda: errno_of_reading(mountpoint / "t2.1") == errno.EIO, what="t2.1's cached pages to go")
    assert (mountpoint / "t0.1").read_bytes() == expected["t0.1"] and pid_alive(pid)
    assert f"shard {model_dir / 's2.safetensors'} was changed in place" in mounts.log()
    assert mounts.run("umount", str(mountpoint)).returncode == 0
    mounts.mount(model_dir, mountpoint=mountpoint)  # what is there now is validated afresh, and served
    assert (mountpoint / "t2.1").read_bytes() == model_bytes(model_dir)["t2.1"] != expected["t2.1"]


def test_the_view_of_a_shard_overwritten_in_place_is_refused(mounts: Mounts, model_dir: Path) -> None:
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    view = mountpoint / ".tensorfs" / "model" / "model.safetensors"
    served = view.read_bytes()  # and kept in the kernel's cache
    length = int.from_bytes(served[:8], "little")
    header = json.loads(served[8 : 8 + length])

    def read_of(name: str) -> bytes | int:
        begin, end = header[name]["data_offsets"]
        try:
            with open(view, "rb", buffering=0) as file:
                return os.pread(file.fileno(), end - begin, 8 + length + begin)
        except OSError as exc:
            return exc.errno or 0

    assert read_of("t2.1") == expected["t2.1"]
    overwrite_in_place(model_dir / "s2.safetensors", offset_of(model_dir, "t2.1") + 5, b"\xff" * 64)
    wait_until(lambda: read_of("t2.1") == errno.EIO, what="the view's cached pages of t2.1 to go")
    assert read_of("t2.2") == errno.EIO and read_of("t0.1") == expected["t0.1"]


def test_attributes_of_a_shard_may_change(mounts: Mounts, model_dir: Path) -> None:
    expected = model_bytes(model_dir)
    mountpoint = mounts.mount(model_dir)
    os.utime(model_dir / "s0.safetensors", ns=(10**18, 10**18))  # `touch`: the bytes are the same
    wait_until(lambda: (mountpoint / "t0.0").stat().st_mtime_ns == 10**18, what="the new mtime to show")
    assert (mountpoint / "t0.0").read_bytes() == expected["t0.0"]


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
        wait_until(lambda: refused(reader, expected["t1.1"], MIB), what="the open reader to be refused")
    finally:
        reader.close()
    assert errno_of_reading(mountpoint / "t1.1") == errno.EIO
    assert (mountpoint / "t1.0").read_bytes() == expected["t1.0"]  # same shard, bytes unchanged: verified again
    assert pid_alive(pid)
    log = mounts.log()
    assert f"shard {model_dir / 's1.safetensors'} changed under the mount" in log
    assert "tensor 't1.1' in shard" in log and "does not match the manifest" in log
    overwrite_in_place(model_dir / "s1.safetensors", where, expected["t1.1"][MIB : MIB + 100])  # put back
    wait_until(lambda: errno_of_reading(mountpoint / "t1.1") is None, what="t1.1 to verify again")
    assert (mountpoint / "t1.1").read_bytes() == expected["t1.1"]


def test_a_shard_truncated_under_a_mount_with_a_manifest(mounts: Mounts, model_dir: Path) -> None:
    # Verifying again hashes the lost bytes: read from the file, they are an error, never a SIGBUS.
    expected = model_bytes(model_dir)
    with_manifest(model_dir)
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "t0.3").read_bytes() == expected["t0.3"]
    os.truncate(model_dir / "s0.safetensors", offset_of(model_dir, "t0.3") + 3 * MIB)
    wait_until(lambda: errno_of_reading(mountpoint / "t0.3") == errno.EIO, what="t0.3 to be refused")
    assert errno_of_reading(mountpoint / "t0.2") is None  # before the cut: verified again, and served
    assert pid_alive(pid)
    assert "tensor 't0.3': bytes [3145728, 4194304) of the tensor are gone" in mounts.log()
    assert (mountpoint / "t1.2").read_bytes() == expected["t1.2"]


# -- hashing a shard that shrinks, out of a mount ---------------------------------------------------


SHRINK_THEN_HASH = """
import os, sys, tensorfs
from tensorfs.integrity import Hasher
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
import tensorfs.cli
real = tensorfs.cli.open_model
def open_then_shrink(path, **kwargs):
    model = real(path, **kwargs)
    os.truncate(sys.argv[2], int(sys.argv[3]))
    return model
tensorfs.cli.open_model = open_then_shrink
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
    assert (hasher.tensors_hashed, hasher.bytes_hashed) == (12, sum(map(len, expected.values())))
