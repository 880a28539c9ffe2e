"""Mounting as other file systems are mounted: mount(8) with -t fuse.tensorfs (and so /etc/fstab),
and systemd's readiness protocol."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Mounts, machine_lock, wait_until
from helpers import every_dtype_tensors, patience, write_reference
from tensorfs.cli.mount import mount
from tensorfs.errors import TensorfsError
from tensorfs.mount.helper import mount_arguments
from tensorfs.mount.mounttable import mount_at, pid_alive
from tensorfs.mount.runtime import read_record

HELPER = Path("/sbin/mount.fuse.tensorfs")


def test_mount_options_as_fstab_writes_them() -> None:
    words = ["/m", "/mnt", "-o", "ro,layout=dotted,readahead_kb=2048,dev,suid,allow_other,no_cache,x-systemd.automount"]
    assert mount_arguments([*words, "-o", "include=a.*,include=b.*,umask=0222"], mount) == [
        "-q", "--layout=dotted", "--readahead-kb=2048", "-o", "allow_other", "--no-cache",
        "--include=a.*", "--include=b.*", "-o", "umask=0222", "/m", "/mnt",
    ]  # fmt: skip
    for options, why in [
        ("bogus=1", "option 'bogus': not a tensorfs mount option"),
        ("no_cache=1", "option 'no_cache': takes no value"),
        ("layout", "option 'layout': needs a value"),
        ("foreground", "option 'foreground': not a tensorfs mount option"),
    ]:
        with pytest.raises(TensorfsError, match=why):
            mount_arguments(["/m", "/mnt", "-o", options], mount)
    with pytest.raises(TensorfsError, match=r"usage: mount\.tensorfs SOURCE MOUNTPOINT"):
        mount_arguments(["/m"], mount)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(directory / "m.safetensors", every_dtype_tensors())
    return directory


def test_mount_t_fuse_tensorfs(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    """`mount -t fuse.tensorfs` for real: mount(8) finds the helper at /sbin/mount.fuse.tensorfs (put
    there for this test only), as an fstab line would."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounts.watch(mountpoint)
    mounts.watch(tmp_path)  # where a bad option must stop a mount: taken away should one be made
    with machine_lock():  # the machine's /sbin: test_docs puts the helper there too
        if HELPER.exists() or HELPER.is_symlink():
            pytest.fail(f"{HELPER} is there already: not this test's to replace")
        HELPER.symlink_to(Path(sys.executable).parent / "mount.tensorfs")
        try:
            options = f"ro,layout=dotted,readahead_kb=2048,include=t.*,log_file={mounts.log_file},nofail"
            result = subprocess.run(
                ["mount", "-t", "fuse.tensorfs", str(model_dir), str(mountpoint), "-o", options],
                capture_output=True, text=True, check=False, timeout=patience(120),
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            bad = subprocess.run(
                ["mount", "-t", "fuse.tensorfs", str(model_dir), str(tmp_path), "-o", "ro,readahed_kb=1"],
                capture_output=True, text=True, check=False, timeout=patience(120),
            )  # fmt: skip
        finally:
            HELPER.unlink()
    assert mount_at(mountpoint) is not None
    assert (mountpoint / "t" / "f32").read_bytes() == every_dtype_tensors()["t.f32"][2]  # dotted: t/f32
    assert not (mountpoint / "scalar").exists()  # only the selection
    record = read_record(mountpoint)
    assert record is not None and record["options"]["readahead_kb"] == 2048
    assert bad.returncode != 0 and "option 'readahed_kb': not a tensorfs mount option" in bad.stderr
    assert mount_at(tmp_path) is None
    pid = int(str(record["pid"]))
    assert subprocess.run(["umount", str(mountpoint)], capture_output=True, check=False).returncode == 0
    wait_until(lambda: not pid_alive(pid), what="the daemon to leave after umount")


def test_tensorfs_run_as_mount_fuse_runs_it(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    """mount.fuse3 runs `tensorfs SRC MNT -o OPTS,dev,suid` (when no mount.fuse.tensorfs exists)."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounts.watch(mountpoint)
    options = f"ro,layout=dotted,log_file={mounts.log_file},dev,suid"
    result = mounts.run(str(model_dir), str(mountpoint), "-o", options)
    assert result.returncode == 0 and result.stdout == "", result.stderr
    assert (mountpoint / "t" / "f32").read_bytes() == every_dtype_tensors()["t.f32"][2]
    typo = mounts.run("mout", str(model_dir), str(mountpoint))  # a command misspelt is not a mount
    assert typo.returncode == 2 and "No such command 'mout'" in typo.stderr


def test_systemd_hears_the_mount_ready(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    """A Type=notify unit running `tensorfs mount -f`: READY=1 once the mount answers, STOPPING=1 at the end."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(60)
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounts.watch(mountpoint)
    daemon = subprocess.Popen(
        [sys.executable, "-m", "tensorfs.cli", "mount", "-f", "--log-file", str(mounts.log_file), str(model_dir), str(mountpoint)],
        env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")},
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert listener.recv(256) == b"READY=1"
        assert mount_at(mountpoint) is not None and json.loads((mountpoint / ".tensorfs" / "daemon.json").read_text())
        daemon.terminate()
        assert listener.recv(256) == b"STOPPING=1"
        assert daemon.wait(timeout=patience(60)) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        listener.close()
