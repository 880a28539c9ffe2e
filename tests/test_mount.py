"""Real mounts (FUSE): what readers see, what is refused, and the mount's lifecycle."""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tensorfs
from conftest import Mounts, wait_until
from helpers import (
    daemon_stats,
    entry,
    every_dtype_tensors,
    patience,
    random_bytes,
    raw_shard,
    reference_table,
    reference_tensors,
    write_index,
    write_reference,
)
from tensorfs.formats.dtypes import DTYPES
from tensorfs.mount.mounttable import pid_alive, tensorfs_mounts


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """Three shards with an index: every dtype, 0-d, empty, unicode and '/' names, packed F4/F6."""
    directory = tmp_path / "model"
    directory.mkdir()
    shard1 = every_dtype_tensors(seed=1)
    shard2 = {f"layers/{i}/w": ("BF16", [16, 8], random_bytes(256, 50 + i)) for i in range(4)}
    shard2["layers/name with spaces"] = ("F16", [3], random_bytes(6, 60))
    write_reference(directory / "model-00001-of-00003.safetensors", shard1, metadata={"format": "pt"})
    write_reference(directory / "model-00002-of-00003.safetensors", shard2)
    f6 = {"packed.f6": entry("F6_E2M3", [8], 0, 6), "packed.f6b": entry("F6_E3M2", [4], 6, 9)}
    (directory / "model-00003-of-00003.safetensors").write_bytes(raw_shard(f6, random_bytes(9, 70)))
    weight_map = {}
    for shard in sorted(directory.glob("*.safetensors")):
        weight_map.update(dict.fromkeys(reference_tensors(shard), shard.name))
    write_index(directory, weight_map)
    return directory


def test_every_tensor_is_byte_exact_with_its_sidecars(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    expected = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        data_start = 8 + int.from_bytes(shard.read_bytes()[:8], "little")
        for name, (dtype, shape, offsets, data) in reference_table(shard)[0].items():
            expected[name] = (shard, dtype, shape, data, data_start, offsets)
    assert len(expected) == len(every_dtype_tensors()) + 5 + 2
    for name, (shard, dtype, shape, data, data_start, (begin, end)) in expected.items():
        path = mountpoint / name
        st = path.stat()
        readable = stat.S_IMODE(shard.stat().st_mode) & 0o444  # the shard's read bits, its owner
        assert (stat.S_IMODE(st.st_mode), st.st_size, st.st_uid) == (readable, len(data), shard.stat().st_uid), name
        assert st.st_mtime_ns == shard.stat().st_mtime_ns
        assert path.read_bytes() == data, name
        meta = json.loads((mountpoint / f"{name}.meta.json").read_bytes())
        assert meta == {  # where the reference reader finds the tensor
            "name": name,
            "dtype": dtype,
            "shape": shape,
            "nbytes": len(data),
            "shard": shard.name,
            "offset": data_start + begin,
            "data_offsets": [begin, end],
            "numpy_dtype": DTYPES[dtype].numpy_name,
        }
        with open(shard, "rb") as f:  # the offset points at the bytes in the shard file
            f.seek(meta["offset"])
            assert f.read(len(data)) == data
        array = tensorfs.memmap(path)
        if meta["numpy_dtype"] is None:
            assert array.tobytes() == data
        else:
            assert array.dtype == np.dtype(meta["numpy_dtype"]) and list(array.shape) == shape
            assert array.tobytes() == data
            if len(data):
                assert isinstance(array, np.memmap)
    # sha256sum -c passes on every sidecar, from the sidecar's own directory
    for directory in {(mountpoint / name).parent for name in expected}:
        sidecars = sorted(p.name for p in directory.iterdir() if p.name.endswith(".sha256"))
        result = subprocess.run(
            ["sha256sum", "--strict", "-c", *sidecars], cwd=directory, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.count(": OK") == len(sidecars)


def test_listing_and_control_files(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    root = sorted(os.listdir(mountpoint))
    assert ".tensorfs" in root and "layers" in root
    assert {"scalar", "scalar.meta.json", "scalar.sha256"} <= set(root)
    assert sorted(os.listdir(mountpoint / "layers" / "0")) == ["w", "w.meta.json", "w.sha256"]
    index = json.loads((mountpoint / ".tensorfs" / "index.json").read_bytes())
    assert index["weight_map"]["layers/3/w"] == "model-00002-of-00003.safetensors"
    assert index["metadata"]["total_size"] == sum(
        len(d) for s in model_dir.glob("*.safetensors") for _, _, d in reference_tensors(s).values()
    )
    metadata = json.loads((mountpoint / ".tensorfs" / "metadata.json").read_bytes())
    assert metadata == {
        "format": "safetensors",
        "shards": {s.name: reference_metadata(s) for s in sorted(model_dir.glob("*.safetensors"))},
    }
    daemon = json.loads((mountpoint / ".tensorfs" / "daemon.json").read_bytes())
    assert pid_alive(daemon["pid"]) and daemon["pid"] != os.getpid()
    assert daemon["source"] == str(model_dir) and daemon["version"] == tensorfs.__version__
    assert daemon["options"]["layout"] == "slash"
    assert stat.S_IMODE(os.stat(mountpoint).st_mode) == 0o555  # the model's directory is 0755
    device = os.stat(mountpoint).st_dev
    tuned = Path(f"/sys/fs/fuse/connections/{os.minor(device)}/max_background")
    if os.geteuid() == 0:  # as root the daemon tunes its connection (see serve._set_max_background)
        assert tuned.read_text().strip() == str(daemon["options"]["max_background"]) == "4"


def test_every_mutating_call_gets_erofs(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    tensor = mountpoint / "scalar"
    attempts = {
        "open for writing": lambda: os.open(tensor, os.O_WRONLY),
        "open read-write": lambda: os.open(tensor, os.O_RDWR),
        "create": lambda: os.open(mountpoint / "new", os.O_WRONLY | os.O_CREAT, 0o644),
        "truncate": lambda: os.truncate(tensor, 0),
        "mkdir": lambda: os.mkdir(mountpoint / "d"),
        "mknod": lambda: os.mknod(mountpoint / "fifo", stat.S_IFIFO | 0o644),
        "unlink": lambda: os.unlink(tensor),
        "rmdir": lambda: os.rmdir(mountpoint / "layers" / "0"),
        "rename": lambda: os.rename(tensor, mountpoint / "renamed"),
        "symlink": lambda: os.symlink("scalar", mountpoint / "link"),
        "link": lambda: os.link(tensor, mountpoint / "hard"),
        "chmod": lambda: os.chmod(tensor, 0o644),
        "chown": lambda: os.chown(tensor, 1, 1),
        "utime": lambda: os.utime(tensor, (0, 0)),
        "setxattr": lambda: os.setxattr(tensor, "user.x", b"1"),
        "removexattr": lambda: os.removexattr(tensor, "user.x"),
    }
    for what, attempt in attempts.items():
        with pytest.raises(OSError) as caught:
            attempt()
        assert caught.value.errno == errno.EROFS, what
    assert tensor.read_bytes() == reference_tensors(model_dir / "model-00001-of-00003.safetensors")["scalar"][2]


def test_the_kernel_stops_asking_what_is_answered_enosys(mounts: Mounts, model_dir: Path) -> None:
    """Flushes and extended attributes cost a round trip per file until the kernel is told, once, that
    they are not implemented: after that it answers by itself, and the daemon never hears of them."""
    mountpoint = mounts.mount(model_dir)
    expected = {
        name: data for s in model_dir.glob("*.safetensors") for name, (_, _, data) in reference_tensors(s).items()
    }
    assert len(expected) >= 5
    for name, data in expected.items():
        path = mountpoint / name
        assert path.read_bytes() == data  # an open, a read and a close (a flush, then a release)
        with pytest.raises(OSError) as caught:
            os.getxattr(path, "user.x")
        assert caught.value.errno == errno.EOPNOTSUPP
        with pytest.raises(OSError) as caught:
            os.listxattr(path)
        assert caught.value.errno == errno.EOPNOTSUPP
    counted = daemon_stats(mountpoint)
    assert counted["requests"]["open"] >= len(expected)
    assert {op: counted["requests"].get(op) for op in ("flush", "getxattr", "listxattr")} == {
        "flush": 1,
        "getxattr": 1,
        "listxattr": 1,
    }
    assert counted["errors"] == []


def test_bad_models_are_refused_with_nothing_mounted(mounts: Mounts, tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.safetensors").write_bytes(raw_shard({"x": entry("F32", [2], 0, 4)}, bytes(4)))
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = mounts.attempt(bad, mountpoint=mountpoint)
    assert result.returncode == 1
    assert (
        result.stderr
        == f"error: {bad / 'a.safetensors'}: tensor 'x': data_offsets [0, 4] hold 4 bytes but F32 [2] needs 8\n"
    )
    assert not os.path.ismount(mountpoint) and mounted_under(tmp_path) == []


def mounted_under(directory: Path) -> list[Path]:
    """The tensorfs mounts in `directory` (a test's own: other suites may mount elsewhere meanwhile)."""
    return [path for path in tensorfs_mounts() if directory in path.parents]


def test_bad_mountpoints_are_refused(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    a_file = tmp_path / "file"
    a_file.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    (full / "something").write_text("x")
    cases = {
        tmp_path / "missing": "does not exist",
        a_file: "is not a directory",
        full: "is not empty",
    }
    for mountpoint, words in cases.items():
        result = mounts.attempt(model_dir, mountpoint=mountpoint)
        assert result.returncode == 1 and words in result.stderr and "Traceback" not in result.stderr
        assert result.stderr.count("\n") == 1
    live = mounts.mount(model_dir)
    result = mounts.attempt(model_dir, mountpoint=live)
    assert result.returncode == 1 and "already holds a tensorfs mount" in result.stderr
    result = mounts.attempt(model_dir, "-o", "direct_io", mountpoint=tmp_path / "missing")
    assert result.returncode == 1 and "option 'direct_io' is not supported" in result.stderr
    spare = tmp_path / "spare"
    spare.mkdir()
    before = mounted_under(tmp_path)
    result = mounts.attempt(model_dir, "-o", "no_such_option", mountpoint=spare)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert f"error: cannot mount at {spare}" in result.stderr and "no_such_option" in result.stderr
    assert mounted_under(tmp_path) == before == [live]


@pytest.mark.parametrize(
    ("option", "why"),
    [
        ("rw", "the tree is read-only"),
        ("max_read=131072", "it breaks pyfuse3 3.5 with libfuse 3.14 (requests are already up to 1 MiB)"),
        ("allow_other,max_read=4096", "it breaks pyfuse3 3.5 with libfuse 3.14 (requests are already up to 1 MiB)"),
        ("direct_io", "it breaks np.memmap of the mounted files"),
    ],
)
def test_options_that_break_tensorfs_are_refused(
    mounts: Mounts, model_dir: Path, tmp_path: Path, option: str, why: str
) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounts.mountpoints.append(mountpoint)
    result = mounts.run("mount", "-o", option, str(model_dir), str(mountpoint))
    refused = option.rpartition(",")[2]
    assert (result.returncode, result.stdout, result.stderr) == (
        1,
        "",
        f"error: option '{refused}' is not supported: {why}\n",
    )
    assert not os.path.ismount(mountpoint) and mountpoint not in tensorfs_mounts()


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (
            "fallback=https://user:password@example.com/m/model.safetensors",
            "https://***@example.com/m/model.safetensors: option 'fallback': credentials in a URL are never sent",
        ),
        (  # FUSE's own option: refused by the URL's rule alone, else libfuse and /proc/mounts keep it
            "fsname=https://user:password@example.com/m",
            "https://***@example.com/m: option 'fsname': credentials in a URL are never sent",
        ),
        ("allow_other,fallback=/elsewhere/model", "option 'fallback': not FUSE's: give it as --fallback"),
        ("manifest=/elsewhere/m.sha256", "option 'manifest': not FUSE's: give it as --manifest"),
    ],
)
def test_mount_options_pass_the_gate_of_the_flags(
    mounts: Mounts, model_dir: Path, tmp_path: Path, option: str, said: str
) -> None:
    """-o with a URL that carries credentials, in any option, is refused as --fallback refuses it (not handed to
    libfuse, whose "fuse_session_new() failed" said nothing, and whose record would keep them); a
    tensorfs option given as -o is told to be given as its flag."""
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    mounts.mountpoints.append(mountpoint)
    result = mounts.run("mount", "-o", option, str(model_dir), str(mountpoint))
    assert result.returncode == 1 and result.stderr.startswith(f"error: {said}") and result.stderr.count("\n") == 1
    assert "password" not in result.stderr
    assert not os.path.ismount(mountpoint) and mountpoint not in tensorfs_mounts()


def test_status_and_umount(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    status = mounts.run("status")  # every mount on the machine: its exit code is theirs too
    assert status.returncode in (0, 1) and not status.stderr
    assert mounts.run("status", str(mountpoint)).returncode == 0
    line = next(line for line in status.stdout.splitlines() if line.startswith(str(mountpoint)))
    assert line.split()[1:4] == ["ok", str(pid), str(len(every_dtype_tensors()) + 5 + 2)]
    assert line.endswith(str(model_dir))
    records = [json.loads(line) for line in mounts.run("status", "--json").stdout.splitlines()]
    assert any(
        r["mountpoint"] == str(mountpoint) and r["state"] == "ok" and r["live"] and r["pid"] == pid for r in records
    )
    result = mounts.run("umount", str(mountpoint))
    assert result.returncode == 0, result.stderr
    assert not os.path.ismount(mountpoint) and not pid_alive(pid)  # umount waits for the daemon
    result = mounts.run("umount", str(mountpoint))
    assert result.returncode == 1 and "not mounted" in result.stderr


def test_busy_mount_needs_lazy_umount(mounts: Mounts, model_dir: Path) -> None:
    """A mount with a file open is refused a plain umount; --lazy detaches it at once, the daemon
    serves the open file on (its first read comes after the detach), and exits (0, unmounted) once
    the file is closed."""
    mountpoint, daemon = mounts.mount_adopted(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    expected = reference_tensors(model_dir / "model-00002-of-00003.safetensors")["layers/0/w"][2]
    with open(mountpoint / "layers" / "0" / "w", "rb") as held:
        result = mounts.run("umount", str(mountpoint))
        assert result.returncode == 1 and "--lazy" in result.stderr
        lazy = mounts.run("umount", "--lazy", str(mountpoint))
        assert lazy.returncode == 0, lazy.stderr
        assert not os.path.ismount(mountpoint) and mountpoint not in tensorfs_mounts()  # detached now
        assert pid_alive(pid)
        assert os.pread(held.fileno(), 1024, 0) == expected  # asked of the daemon, after the detach
        assert pid_alive(pid)
    assert daemon.exit_status(timeout=10) == (pid, 0)  # the last file closed: it ends
    assert f"unmounted {mountpoint}" in mounts.log()


def test_mount_with_a_full_output_stays_mounted_and_says_so(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    """`tensorfs mount ... > /dev/full`: the mount is made and stands (whole: served, its daemon and
    record there), the line that says so cannot be written: one line, exit 1. With -q nothing is
    written: exit 0."""
    for quiet in ((), ("-q",)):
        mountpoint = mounts.watch(tmp_path / f"full{len(quiet)}")
        mountpoint.mkdir()
        with open("/dev/full", "w") as full:
            result = subprocess.run(
                [sys.executable, "-m", "tensorfs.cli", "mount", *quiet, "--log-file", str(mounts.log_file),
                 str(model_dir), str(mountpoint)],
                stdout=full, stderr=subprocess.PIPE, text=True, timeout=patience(120), check=False,
            )  # fmt: skip
        if quiet:
            assert (result.returncode, result.stderr) == (0, "")
        else:
            assert (result.returncode, result.stderr) == (
                1,
                f"error: mounted {mountpoint}, but cannot write to standard output: No space left on device\n",
            )
        assert os.path.ismount(mountpoint)
        pid = mounts.daemon_pid(mountpoint)
        assert pid_alive(pid)
        assert (mountpoint / "layers" / "0" / "w").stat().st_size == 256
        assert mounts.run("status", str(mountpoint)).returncode == 0  # ok: nothing half-made
        assert mounts.run("umount", str(mountpoint)).returncode == 0
        assert not pid_alive(pid)


def test_umount_after_sigkill_and_mount_again(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="the daemon to die")
    with pytest.raises(OSError) as caught:
        os.listdir(mountpoint)
    assert caught.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)  # the connection is gone
    status = mounts.run("status")
    assert f"run: tensorfs umount {mountpoint}" in status.stdout
    result = mounts.attempt(model_dir, mountpoint=mountpoint)
    assert (
        result.returncode == 1 and f"holds a dead tensorfs mount: run `tensorfs umount {mountpoint}`" in result.stderr
    )
    result = mounts.run("umount", str(mountpoint))
    assert result.returncode == 0, result.stderr
    assert not os.path.ismount(mountpoint)
    mounts.mount(model_dir, mountpoint=mountpoint)
    assert (mountpoint / "scalar").read_bytes() == every_dtype_tensors(seed=1)["scalar"][2]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_foreground_daemon_unmounts_cleanly_on_signal(
    mounts: Mounts, model_dir: Path, tmp_path: Path, signum: int
) -> None:
    mountpoint = tmp_path / "fg"
    mountpoint.mkdir()
    mounts.watch(mountpoint)
    with subprocess.Popen(
        [sys.executable, "-m", "tensorfs.cli", "mount", "-f", str(model_dir), str(mountpoint)],
        stderr=subprocess.PIPE,
        text=True,
    ) as daemon:
        try:

            def mounted() -> bool:
                assert daemon.poll() is None, "the foreground daemon exited"
                return os.path.ismount(mountpoint)

            wait_until(mounted, what="the foreground mount", timeout=60)
            assert (mountpoint / "layers" / "0" / "w").stat().st_size == 256
            daemon.send_signal(signum)
            _, stderr = daemon.communicate(timeout=patience(30))
            assert daemon.returncode == 0, stderr
            assert not os.path.ismount(mountpoint)
            assert f"mounted {mountpoint} (in the foreground; Ctrl-C unmounts)" in stderr
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.communicate()


def test_foreground_debug_logs_to_stderr_with_libfuses_own_lines(
    mounts: Mounts, model_dir: Path, tmp_path: Path
) -> None:
    mountpoint = tmp_path / "fg"
    mountpoint.mkdir()
    mounts.mountpoints.append(mountpoint)
    with subprocess.Popen(
        [sys.executable, "-m", "tensorfs.cli", "mount", "-f", "--debug", str(model_dir), str(mountpoint)],
        stderr=subprocess.PIPE,
        text=True,
    ) as daemon:
        try:
            wait_until(lambda: os.path.ismount(mountpoint) or daemon.poll() is not None, what="the mount", timeout=60)
            assert (mountpoint / "scalar").stat().st_size == 4
            daemon.send_signal(signal.SIGTERM)
            _, stderr = daemon.communicate(timeout=patience(30))
        finally:
            if daemon.poll() is None:
                daemon.kill()
                daemon.communicate()
    assert daemon.returncode == 0, stderr
    assert " INFO serving " in stderr  # no --log-file in the foreground: the log is stderr
    assert "lookup(parent_inode=1, name='scalar', uid=" in stderr  # tensorfs's request lines
    assert "opcode: LOOKUP" in stderr  # and libfuse's own


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_background_daemon_unmounts_cleanly_on_signal(mounts: Mounts, model_dir: Path, signum: int) -> None:
    mountpoint, daemon = mounts.mount_adopted(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "layers" / "0" / "w").stat().st_size == 256
    os.kill(pid, signum)
    assert daemon.exit_status() == (pid, 0)
    assert not os.path.ismount(mountpoint)
    assert f"{signal.Signals(signum).name}: unmounting" in mounts.log() and f"unmounted {mountpoint}" in mounts.log()


def test_dotted_layout(mounts: Mounts, tmp_path: Path) -> None:
    write_reference(
        tmp_path / "m.safetensors", {"model.layers.0.w": ("U8", [2], b"ab"), "model.norm": ("U8", [1], b"c")}
    )
    mountpoint = mounts.mount(tmp_path / "m.safetensors", "--layout", "dotted")
    assert (mountpoint / "model" / "layers" / "0" / "w").read_bytes() == b"ab"
    assert json.loads((mountpoint / "model" / "norm.meta.json").read_bytes())["name"] == "model.norm"
    clash = tmp_path / "clash.safetensors"
    write_reference(clash, {"m.w": ("U8", [1], b"a"), "m.w.b": ("U8", [1], b"b")})
    target = tmp_path / "clash-mnt"
    target.mkdir()
    result = mounts.attempt(clash, "--layout", "dotted", mountpoint=target)
    assert result.returncode == 1 and "needs 'm/w' as a directory" in result.stderr


def test_relative_paths_and_a_daemon_that_holds_no_directory(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "relative-mnt"
    mountpoint.mkdir()
    mounts.watch(mountpoint)
    result = subprocess.run(
        [sys.executable, "-m", "tensorfs.cli", "mount", "--log-file", "daemon.log", "--cache-dir", "cache",
         "model", "relative-mnt"],
        cwd=tmp_path, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    pid = mounts.daemon_pid(mountpoint)
    assert os.readlink(f"/proc/{pid}/cwd") == "/"
    daemon = json.loads((mountpoint / ".tensorfs" / "daemon.json").read_bytes())
    assert daemon["source"] == str(model_dir) and daemon["log_file"] == str(tmp_path / "daemon.log")
    assert subprocess.run(["sha256sum", "-c", "scalar.sha256"], cwd=mountpoint, capture_output=True).returncode == 0
    assert (tmp_path / "cache" / "headers.sqlite").exists()  # the cache where it was asked for, not in /


def test_fsname_escapes() -> None:
    from tensorfs.mount.serve import fsname

    assert fsname(Path("/m/a,b\\c d%e/é")) == "/m/a\\,b\\\\c d%25e/%C3%A9"


def reference_metadata(shard: Path) -> dict[str, str] | None:
    """The shard's `__metadata__` as the reference reader reads it (None when it has none)."""
    from safetensors import safe_open

    with safe_open(str(shard), "np") as opened:
        found: dict[str, str] | None = opened.metadata()
        return found
