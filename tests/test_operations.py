"""Operating mounts: tools that never hang on a mount, records outside it, locks, logs, options, owners."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from conftest import Mounts, OtherUser, missing_root, require, wait_until
from helpers import (
    MIB,
    daemon_stats,
    entry,
    model_bytes,
    patience,
    random_bytes,
    raw_shard,
    reference_tensors,
    write_reference,
)
from tensorfs.mount.logs import default_log_file
from tensorfs.mount.mounttable import FUSE_CONNECTIONS as FUSECTL
from tensorfs.mount.mounttable import mounts as mount_table
from tensorfs.mount.mounttable import pid_alive, probe
from tensorfs.mount.runtime import escape_path, read_record, record_path
from tensorfs.proof.manifest import format_manifest


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(directory / "a.safetensors", {"w": ("U8", [4096], random_bytes(4096, 1)), "-": ("U8", [3], b"abc")})
    write_reference(directory / "b.safetensors", {"d/-": ("U8", [2], b"de"), "d/x": ("F32", [2], random_bytes(8, 2))})
    return directory


def status_lines(mounts: Mounts, *args: str) -> tuple[int, dict[str, str]]:
    """`tensorfs status` (it must return: a hang fails the test by its timeout): exit code, line per mount."""
    result = mounts.run("status", *args, timeout=60)
    lines = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    return result.returncode, lines


# -- hung and dead daemons ------------------------------------------------------------------


@pytest.mark.parametrize("lazy", [False, True])
def test_a_stopped_daemon_hangs_no_tool(mounts: Mounts, model_dir: Path, tmp_path: Path, lazy: bool) -> None:
    mountpoint = mounts.mount(model_dir)
    healthy = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    os.kill(pid, signal.SIGSTOP)
    stuck = subprocess.Popen(  # a reader caught in the hung mount
        [sys.executable, "-c", f"open({str(mountpoint / 'd' / 'x')!r}, 'rb').read()"], stderr=subprocess.DEVNULL
    )
    try:
        code, lines = status_lines(mounts)
        assert code == 1
        assert lines[str(mountpoint)].split()[1:3] == ["hung", str(pid)]
        assert "is stopped" in lines[str(mountpoint)] and f"run: tensorfs umount {mountpoint}" in lines[str(mountpoint)]
        assert lines[str(healthy)].split()[1] == "ok"
        records = [json.loads(line) for line in mounts.run("status", "--json", timeout=60).stdout.splitlines()]
        states = {r["mountpoint"]: r["state"] for r in records}
        assert (states[str(mountpoint)], states[str(healthy)]) == ("hung", "ok")
        result = mounts.run("umount", *(["--lazy"] if lazy else []), str(mountpoint), timeout=60)
        assert result.returncode == 0, result.stderr
        assert "daemon was hung" in result.stdout
        assert mount_table() and all(m.mountpoint != mountpoint for m in mount_table())
        assert not pid_alive(pid)
        stuck.wait(timeout=patience(30))  # the reader stuck in the hung mount is let go when its daemon goes
        assert not record_path(mountpoint).exists()
        code, lines = status_lines(mounts)
        assert str(mountpoint) not in lines and lines[str(healthy)].split()[1] == "ok"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        if stuck.poll() is None:
            stuck.kill()
            stuck.wait()


# A daemon that runs but never answers again (nor acts on SIGTERM): its request thread blocks for good
# in the first statfs it is asked.
MOUNT_A_DAEMON_THAT_WILL_HANG = """
import sys, time
import tensorfs.cli
from tensorfs.mount.operations import TensorOperations
async def statfs(self, ctx):
    time.sleep(3600)
TensorOperations.statfs = statfs
sys.exit(tensorfs.cli.main(["mount", *sys.argv[1:]]))
"""


def test_umount_stops_a_daemon_that_runs_but_never_answers(mounts: Mounts, model_dir: Path) -> None:
    command = (sys.executable, "-c", MOUNT_A_DAEMON_THAT_WILL_HANG)
    mountpoint, daemon = mounts.mount_adopted(model_dir, command=command)
    pid = mounts.daemon_pid(mountpoint)
    assert (mountpoint / "-").read_bytes() == b"abc"  # it serves, until asked a statfs
    result = mounts.run("umount", str(mountpoint), timeout=60)
    assert (result.returncode, result.stderr) == (0, "")
    assert result.stdout == (
        f"{mountpoint}: detached; its daemon was hung (its daemon did not answer within 2 s) and has been stopped\n"
    )
    assert daemon.exit_status() == (pid, -signal.SIGKILL)  # SIGTERM could not reach it: SIGKILL did
    assert all(m.mountpoint != mountpoint for m in mount_table()) and not record_path(mountpoint).exists()


def test_probe_of_a_stopped_daemon_times_out(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    assert probe(mountpoint, 5) == "ok"
    os.kill(pid, signal.SIGSTOP)
    try:
        assert probe(mountpoint, 0.5) == "hung"  # statfs is never answered from the kernel's caches
    finally:
        os.kill(pid, signal.SIGCONT)
    assert probe(mountpoint, 30) == "ok"


def test_status_says_why_a_daemon_died(mounts: Mounts, model_dir: Path) -> None:
    killed = mounts.mount(model_dir)
    crashed = mounts.mount(model_dir)
    os.kill(mounts.daemon_pid(killed), signal.SIGKILL)
    os.kill(pid := mounts.daemon_pid(crashed), signal.SIGSEGV)
    wait_until(lambda: not pid_alive(pid), what="the daemon to die")
    code, lines = status_lines(mounts)
    assert code == 1
    assert lines[str(killed)].split()[1] == "dead" and "is gone (killed?)" in lines[str(killed)]
    assert f"daemon {pid} is gone: Fatal Python error: Segmentation fault" in lines[str(crashed)]
    for mountpoint in (killed, crashed):
        assert mounts.run("umount", str(mountpoint)).returncode == 0
    assert not {str(killed), str(crashed)} & set(status_lines(mounts)[1])


# -- one mountpoint, one mount --------------------------------------------------------------


def test_racing_mounts_of_one_mountpoint(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "contested"
    mountpoint.mkdir()
    mounts.watch(mountpoint)
    command = [sys.executable, "-m", "tensorfs.cli", "mount", "--log-file", str(mounts.log_file)]
    racers = [
        subprocess.Popen([*command, str(model_dir), str(mountpoint)], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    outcomes = []
    for racer in racers:
        _, stderr = racer.communicate(timeout=patience(120))
        outcomes.append((racer.returncode, stderr))
    outcomes.sort()
    assert [code for code, _ in outcomes] == [0, 1, 1]
    for _, message in outcomes[1:]:
        assert message == f"error: mountpoint {mountpoint} already holds a tensorfs mount (see `tensorfs status`)\n"
    assert [m.mountpoint for m in mount_table()].count(mountpoint) == 1
    assert not list(Path(os.environ["TENSORFS_RUNTIME_DIR"]).glob("*.lock"))  # nothing left behind


def test_symlinks_to_mountpoints(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    mounts.watch(real)
    result = mounts.run("mount", "--log-file", str(mounts.log_file), str(model_dir), str(link))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"mounted {real}: ")
    assert any(m.mountpoint == real for m in mount_table())
    again = mounts.run("mount", str(model_dir), str(link))
    assert again.returncode == 1 and f"mountpoint {real} already holds a tensorfs mount" in again.stderr
    code, lines = status_lines(mounts, str(link))
    assert code == 0 and lines[str(real)].split()[1] == "ok"
    result = mounts.run("umount", str(link))
    assert result.returncode == 0, result.stderr
    assert not os.path.ismount(real)


# -- options, values in force, the record ----------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value"),
    [("--max-background", "100000"), ("--readahead-kb", "999999999"), ("--readahead-kb", "3"), ("--prefetch-mb", "0")],
)
def test_options_out_of_the_kernels_range_are_refused(
    mounts: Mounts, model_dir: Path, tmp_path: Path, option: str, value: str
) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    result = mounts.attempt(model_dir, option, value, mountpoint=mountpoint)
    assert result.returncode == 2 and f"Invalid value for '{option}'" in result.stderr
    assert not os.path.ismount(mountpoint)


def test_the_values_in_force_are_read_back(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir, "--readahead-kb", "2048", "--max-background", "7")
    device = os.stat(mountpoint).st_dev
    readahead = int(Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb").read_text())
    record = read_record(mountpoint)
    assert record is not None
    daemon_json = json.loads((mountpoint / ".tensorfs" / "daemon.json").read_text())
    assert record["in_force"] == daemon_json["in_force"]
    assert record["in_force"]["readahead_kb"] == readahead
    background = Path(f"/sys/fs/fuse/connections/{os.minor(device)}/max_background")
    if os.geteuid() == 0:  # only root may tune the connection
        assert record["in_force"]["max_background"] == int(background.read_text()) == 7
        assert readahead == 2048


@pytest.mark.parametrize(
    ("option", "kib"),
    [((), 1024), (("--readahead-kb", "256"), 256), (("--readahead-kb", "0"), 128)],  # 0: FUSE's own, 128 KiB
)
def test_the_readahead_is_in_effect(mounts: Mounts, tmp_path: Path, option: tuple[str, ...], kib: int) -> None:
    require("root (only root may set a mount's readahead)", missing_root())
    write_reference(tmp_path / "m.safetensors", {"w": ("U8", [8 * MIB], random_bytes(8 * MIB, 3))})
    mountpoint = mounts.mount(tmp_path / "m.safetensors", "--debug", *option)
    device = os.stat(mountpoint).st_dev
    setting = Path(f"/sys/class/bdi/{os.major(device)}:{os.minor(device)}/read_ahead_kb")
    record = read_record(mountpoint)
    assert record is not None and int(setting.read_text()) == record["in_force"]["readahead_kb"] == kib
    with open(mountpoint / "w", "rb", buffering=0) as f:
        while f.read(64 * 1024):  # small reads: how much the kernel asks the daemon for is its readahead's
            pass
    sizes = [int(size) for size in re.findall(r"read\(fh=\d+ 'w', off=\d+, size=(\d+)\)", mounts.log())]
    assert sum(sizes) >= 8 * MIB and max(sizes) == kib * 1024


@pytest.mark.parametrize(("option", "mib"), [((), 32), (("--prefetch-mb", "3"), 3)])
def test_the_prefetch_window_is_in_effect(mounts: Mounts, tmp_path: Path, option: tuple[str, ...], mib: int) -> None:
    shard = tmp_path / "m.safetensors"
    shard.write_bytes(raw_shard({"w": entry("U8", [64 * MIB], 0, 64 * MIB)}))
    os.truncate(shard, shard.stat().st_size + 64 * MIB)  # zeros, in a hole
    mountpoint = mounts.mount(shard, *option)
    with open(mountpoint / "w", "rb", buffering=0) as f:
        assert f.read(4096) == bytes(4096)
    stats = daemon_stats(mountpoint)
    # The first read brought in what it asked for and one window ahead of it: exactly --prefetch-mb.
    assert (stats["prefetch_windows"], stats["prefetch_bytes"]) == (1, mib * MIB)
    record = read_record(mountpoint)
    assert record is not None and record["options"]["prefetch_mb"] == mib


# Run in a mount namespace of its own (unshare -m): fusectl unmounted there only, so that no other
# tensorfs daemon on the machine mounts it back first, and nothing outside changes.
FUSECTL_MISSING = """
import json, os, signal, subprocess, sys, time
from pathlib import Path
from tensorfs.mount.mounttable import FUSE_CONNECTIONS, mounts, daemon_pid, pid_alive
from tensorfs.mount.runtime import read_record
model, mountpoint, log = sys.argv[1:4]
def fusectl():
    return sum(1 for m in mounts() if m.mountpoint == FUSE_CONNECTIONS and m.fstype == "fusectl")
while fusectl():
    subprocess.run(["umount", str(FUSE_CONNECTIONS)], check=True)
found = {"before": fusectl(), "listed": sorted(os.listdir(FUSE_CONNECTIONS))}
tensorfs = [sys.executable, "-m", "tensorfs.cli"]
subprocess.run([*tensorfs, "mount", "-q", "--log-file", log, model, mountpoint], check=True)
pid = found["pid"] = daemon_pid(Path(mountpoint))
try:
    found["after"] = fusectl()
    tuned = FUSE_CONNECTIONS / str(os.minor(os.stat(mountpoint).st_dev)) / "max_background"
    found["max_background"] = int(tuned.read_text())
    found["in_force"] = read_record(Path(mountpoint))["in_force"]["max_background"]
finally:
    if subprocess.run([*tensorfs, "umount", mountpoint]).returncode != 0:
        subprocess.run(["fusermount3", "-u", "-z", mountpoint])
        if pid is not None and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
print(json.dumps(found))
"""


def test_fusectl_is_mounted_when_missing(model_dir: Path, tmp_path: Path, fuse: None) -> None:
    require("root (only root mounts fusectl and tunes a connection)", missing_root())
    mountpoint, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mountpoint.mkdir()
    result = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", FUSECTL_MISSING,
         str(model_dir), str(mountpoint), str(log)],
        capture_output=True, text=True, timeout=patience(120), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout)
    assert (found["before"], found["listed"], found["after"]) == (0, [], 1)
    assert found["max_background"] == found["in_force"] == 4
    assert f"mounted fusectl at {FUSECTL} to tune the FUSE connection" in log.read_text()
    assert not pid_alive(found["pid"])  # unmounted, in its namespace, and gone


def test_the_record_lives_outside_the_mount(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    path = record_path(mountpoint)
    assert path.parent == Path(os.environ["TENSORFS_RUNTIME_DIR"])
    record = json.loads(path.read_text())
    assert record["mountpoint"] == str(mountpoint) and record["pid"] == mounts.daemon_pid(mountpoint)
    assert record["source"] == str(model_dir) and record["tensors"] == 4
    assert mounts.run("umount", str(mountpoint)).returncode == 0
    assert not path.exists()  # removed on a clean exit


def test_mount_says_what_it_did_unless_quiet(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    loud, quiet = tmp_path / "loud", tmp_path / "quiet"
    for directory in (loud, quiet):
        directory.mkdir()
    result = mounts.attempt(model_dir, mountpoint=loud)
    assert result.returncode == 0 and result.stderr == ""
    pid = mounts.daemon_pid(loud)
    log = default_log_file(loud)
    assert result.stdout == f"mounted {loud}: 4 tensors (4.0 KiB), daemon {pid}, log {log}\n"
    assert log == Path(os.environ["XDG_STATE_HOME"]) / "tensorfs" / f"{escape_path(loud)}.log"
    assert escape_path(Path("/mnt/my-model/v1.0")) == "mnt-my\\x2dmodel-v1.0"  # as systemd-escape --path
    assert "serving" in log.read_text()  # each mount logs to its own file
    result = mounts.attempt(model_dir, "-q", mountpoint=quiet)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_the_default_log_file_without_xdg_state_home(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "my-mnt"
    mountpoint.mkdir()
    mounts.mountpoints.append(mountpoint)
    environment = {key: value for key, value in os.environ.items() if key != "XDG_STATE_HOME"}
    environment["HOME"] = str(tmp_path / "home")
    result = subprocess.run(
        [sys.executable, "-m", "tensorfs.cli", "mount", str(model_dir), str(mountpoint)],
        capture_output=True, text=True, env=environment, timeout=patience(120), check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    escaped = subprocess.run(["systemd-escape", "--path", str(mountpoint)], capture_output=True, text=True, check=True)
    log = tmp_path / "home" / ".local" / "state" / "tensorfs" / f"{escaped.stdout.strip()}.log"
    assert result.stdout.endswith(f", log {log}\n") and "\\x2d" in log.name
    assert "serving" in log.read_text()


def test_fsname_is_the_source(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    entry = next(m for m in mount_table() if m.mountpoint == mountpoint)
    assert (entry.fstype, entry.source) == ("fuse.tensorfs", str(model_dir))
    df = subprocess.run(["df", "--output=source", str(mountpoint)], capture_output=True, text=True, check=True)
    assert df.stdout.splitlines()[1] == str(model_dir)


# -- logs ---------------------------------------------------------------------------------------


def test_sighup_reopens_the_log_and_keeps_the_mount(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    rotated = mounts.log_file.with_name("daemon.log.1")
    mounts.log_file.rename(rotated)  # what logrotate does, before it sends SIGHUP
    os.kill(pid, signal.SIGHUP)
    wait_until(lambda: "SIGHUP: reopened the log file" in mounts.log(), what="the log file to be reopened")
    assert pid_alive(pid) and os.path.ismount(mountpoint)
    assert (mountpoint / "w").read_bytes() == reference_tensors(model_dir / "a.safetensors")["w"][2]
    assert "serving" in rotated.read_text() and "serving" not in mounts.log()


def test_sighup_when_the_log_cannot_be_reopened(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    mountpoint = mounts.mount(model_dir, "--log-file", str(logs / "daemon.log"))  # the last --log-file wins
    pid = mounts.daemon_pid(mountpoint)
    logs.rename(tmp_path / "logs.gone")  # its directory moved away: the file cannot be opened by name
    os.kill(pid, signal.SIGHUP)
    moved = tmp_path / "logs.gone" / "daemon.log"
    wait_until(lambda: "SIGHUP: could not reopen the log file" in moved.read_text(), what="the SIGHUP to be handled")
    assert pid_alive(pid) and (mountpoint / "-").read_bytes() == b"abc"  # logging on to the old file


def test_umount_of_a_hung_mount_it_cannot_find_the_daemon_of(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    os.kill(pid, signal.SIGSTOP)
    try:
        elsewhere = {**os.environ, "TENSORFS_RUNTIME_DIR": str(tmp_path / "other-run")}
        result = subprocess.run(
            [sys.executable, "-m", "tensorfs.cli", "umount", str(mountpoint)],
            capture_output=True, text=True, timeout=patience(60), env=elsewhere, check=False,
        )  # fmt: skip
        assert result.returncode == 1
        assert f"{mountpoint}: detached, but its daemon" in result.stderr and "stop it yourself" in result.stderr
        assert all(m.mountpoint != mountpoint for m in mount_table())
    finally:
        os.kill(pid, signal.SIGCONT)


def test_umount_returns_when_a_daemon_it_cannot_find_holds_its_question(
    mounts: Mounts, model_dir: Path, tmp_path: Path
) -> None:
    # The daemon takes umount's statfs and never answers: a request the daemon has taken is waited
    # for uninterruptibly, so umount cannot even exit unless something ends that request.
    require("root (only root may abort a FUSE connection (fusectl))", missing_root())
    mountpoint, _ = mounts.mount_adopted(model_dir, command=(sys.executable, "-c", MOUNT_A_DAEMON_THAT_WILL_HANG))
    elsewhere = {**os.environ, "TENSORFS_RUNTIME_DIR": str(tmp_path / "other-run")}
    output, errors = tmp_path / "umount.out", tmp_path / "umount.err"
    with open(output, "w") as out, open(errors, "w") as err:  # files, not pipes: a hung umount holds pipes open
        umount = subprocess.Popen(
            [sys.executable, "-m", "tensorfs.cli", "umount", str(mountpoint)], stdout=out, stderr=err, env=elsewhere
        )
    try:
        wait_until(lambda: umount.poll() is not None, what="umount to return", timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(mounts.daemon_pid(mountpoint), signal.SIGKILL)  # which lets a stuck umount go
        umount.wait(timeout=patience(60))
    assert umount.returncode == 1
    assert f"{mountpoint}: detached, but its daemon" in errors.read_text() and "stop it yourself" in errors.read_text()
    assert "its FUSE connection was aborted, so nothing waits on it" in errors.read_text()
    assert all(m.mountpoint != mountpoint for m in mount_table())


def test_status_of_named_mounts(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    first, second = mounts.mount(model_dir), mounts.mount(model_dir)
    link = tmp_path / "link"
    link.symlink_to(second)
    code, lines = status_lines(mounts, str(link))
    assert code == 0 and list(lines) == [str(second)]
    result = mounts.run("status", str(tmp_path))
    assert (result.returncode, result.stderr) == (1, f"error: {tmp_path}: not a tensorfs mount\n")
    assert str(first) in status_lines(mounts, str(first), str(second))[1]


def test_nothing_is_written_into_a_mount(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    result = mounts.run("manifest", "--no-cache", "-o", str(mountpoint / "m.sha256"), str(model_dir))
    assert (result.returncode, result.stderr) == (
        1,
        f"error: cannot write {mountpoint / 'm.sha256'}: Read-only file system\n",
    )


def test_debug_lines_show_requests_and_errors_name_tensors(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir, "--debug")
    (mountpoint / "d" / "x").read_bytes()
    with pytest.raises(FileNotFoundError):
        (mountpoint / "nope").stat()
    log = mounts.log()
    assert "object at 0x" not in log
    assert "lookup(parent_inode=1, name='d', uid=" in log
    assert "open(inode=" in log and " 'd/x', flags=" in log
    assert "read(fh=" in log and " 'd/x', off=0, size=" in log
    quiet_log = mounts.tmp_path / "quiet.log"
    quiet = mounts.mount(model_dir, "--log-file", str(quiet_log))  # the last --log-file wins
    assert (quiet / "d" / "x").read_bytes() == (mountpoint / "d" / "x").read_bytes()
    assert "serving" in quiet_log.read_text() and "lookup(" not in quiet_log.read_text()  # only with --debug


# -- names and manifests ------------------------------------------------------------------------


def test_a_tensor_named_dash_checks_with_sha256sum(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    result = subprocess.run(
        ["sha256sum", "--strict", "-c", ".tensorfs/SHA256SUMS"], cwd=mountpoint, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "./-: OK" in result.stdout and "d/-: OK" in result.stdout
    for directory, sidecar in ((mountpoint, "-.sha256"), (mountpoint / "d", "-.sha256")):
        result = subprocess.run(["sha256sum", "-c", "--", sidecar], cwd=directory, capture_output=True, text=True)
        assert (result.returncode, result.stdout) == (0, "./-: OK\n")


def test_a_manifest_beside_one_shard_file(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    digests = mounts.run("manifest", "--no-cache", str(model_dir))
    (model_dir / "tensors.sha256").write_text(digests.stdout)  # the whole model's: both shards
    shard = model_dir / "a.safetensors"
    result = mounts.run("verify", "--no-cache", str(shard))
    assert (result.returncode, result.stdout) == (0, f"{shard}: all 2 tensors match {model_dir / 'tensors.sha256'}\n")
    lines = digests.stdout.splitlines()
    lines[[line.endswith("  w") for line in lines].index(True)] = "0" * 64 + "  w"
    (model_dir / "tensors.sha256").write_text("\n".join(lines) + "\n")
    result = mounts.run("verify", "--no-cache", str(shard))
    assert result.returncode == 1 and f"{shard}: tensor 'w': does not match" in result.stderr
    mountpoint = mounts.mount(shard, "--no-cache")
    with pytest.raises(OSError) as caught:
        (mountpoint / "w").read_bytes()
    assert caught.value.errno == errno.EIO
    assert (mountpoint / "-").read_bytes() == b"abc"


# -- owners and permissions, seen by another user ----------------------------------------------


def as_nobody(path: Path) -> str:
    """Read a file as user nobody (with cat: Python itself may be out of nobody's reach): its length, or why not."""
    result = subprocess.run(["cat", str(path)], user=65534, group=65534, capture_output=True, check=False)
    return str(len(result.stdout)) if result.returncode == 0 else result.stderr.decode().rpartition(": ")[2].strip()


def test_permissions_follow_the_shards_for_other_users(
    mounts: Mounts, model_dir: Path, shared_dir: Path, other_user: OtherUser
) -> None:
    model = shared_dir / "model"
    shutil.copytree(model_dir, model)
    os.chmod(model, 0o755)
    os.chmod(model / "a.safetensors", 0o600)  # root's alone
    os.chmod(model / "b.safetensors", 0o644)
    mine = shared_dir / "mine"
    everyone = shared_dir / "everyone"
    for directory in (mine, everyone):
        directory.mkdir(mode=0o755)
    # Under a manifest: a chmod is a change of the shard like any (nothing tells it from a hidden
    # write), its tensors verified again before they are served on; without one, refused.
    sums = shared_dir / "tensors.sha256"
    sums.write_text(format_manifest({n: hashlib.sha256(b).hexdigest() for n, b in model_bytes(model).items()}))
    mounts.mount(model, "-o", "allow_other", "--manifest", str(sums), mountpoint=mine)
    mounts.mount(model, "-o", "allow_other,umask=0222,uid=65534,gid=65534", mountpoint=everyone)
    assert as_nobody(mine / "w") == "Permission denied"
    assert as_nobody(mine / "w.sha256") == "Permission denied"
    assert as_nobody(mine / ".tensorfs" / "SHA256SUMS") == "Permission denied"  # it tells of root's shard too
    assert as_nobody(mine / "d" / "x") == "8"
    assert as_nobody(everyone / "w") == "4096"
    st = (everyone / "w").stat()
    assert (stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid) == (0o444, 65534, 65534)
    os.chmod(model / "a.safetensors", 0o644)  # the shard opened up: the mount follows
    wait_until(lambda: as_nobody(mine / "w") == "4096", what="the new mode to be seen")


def test_bad_ownership_options(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    for option, words in (
        ("uid=nosuchuser", "uid takes a user name or number"),
        ("uid=99999999999", "uid takes a user name or number"),  # past uid_t: the kernel cannot hold it
        ("gid=4294967295", "gid takes a group name or number"),  # (gid_t)-1: "no group"
        ("uid=\u0663", "uid takes a user name or number"),  # a digit, but not one an id is written in
        ("umask=999", "umask takes an octal mask such as 022"),
    ):
        result = mounts.attempt(model_dir, "-o", option, mountpoint=mountpoint)
        assert (result.returncode, result.stderr) == (1, f"error: option '{option}': {words}\n")
        assert mount_table() and all(m.mountpoint != mountpoint for m in mount_table())


def test_concurrent_status_while_a_daemon_is_stopped_returns(mounts: Mounts, model_dir: Path) -> None:
    mountpoint = mounts.mount(model_dir)
    pid = mounts.daemon_pid(mountpoint)
    os.kill(pid, signal.SIGSTOP)
    try:
        results: list[int] = []
        threads = [
            threading.Thread(target=lambda: results.append(mounts.run("status", timeout=60).returncode))
            for _ in range(3)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert results == [1, 1, 1]
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_file_refused_10000_times_says_so_in_a_few_lines(mounts: Mounts, model_dir: Path) -> None:
    """A companion changed under the mount (other bytes, its size kept) is EIO for every read; read
    10,000 times, the log says so in one line, then at most one a minute, while the counters count
    each one (3,000 reads wrote 3,001 ERROR lines, 534 KB, at d4c56fe: a user of an -o allow_other
    mount could grow its owner's log without bound)."""
    config = model_dir / "config.json"
    config.write_text('{"hidden_size": 32}\n')
    mountpoint = mounts.mount(model_dir)
    view = mountpoint / ".tensorfs" / "model" / "config.json"
    assert view.read_text() == '{"hidden_size": 32}\n'
    config.write_text('{"hidden_size": 64}\n')  # other bytes, the same size
    before = daemon_stats(mountpoint)
    errors_before = sum(e["count"] for e in before["errors"] if (e["op"], e["errno"]) == ("read", errno.EIO))
    fd = os.open(view, os.O_RDONLY)
    try:
        refused = 0
        for _ in range(10_000):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # each read the daemon's to answer
            try:
                os.pread(fd, 64, 0)
            except OSError as exc:
                assert exc.errno == errno.EIO
                refused += 1
    finally:
        os.close(fd)
    assert refused == 10_000
    after = daemon_stats(mountpoint)
    errors_after = sum(e["count"] for e in after["errors"] if (e["op"], e["errno"]) == ("read", errno.EIO))
    assert errors_after - errors_before >= 10_000  # every one counted (the kernel tries a failed page twice)
    lines = [line for line in mounts.log().splitlines() if "config.json" in line and " ERROR " in line]
    assert 1 <= len(lines) <= 2, lines


def test_a_name_too_long_and_the_counters_as_a_file(mounts: Mounts, model_dir: Path, tmp_path: Path) -> None:
    """POSIX as callers test it: a name over the 255 bytes statfs says is ENAMETOOLONG (it was
    ENOENT); .tensorfs/stats.json says its true size, so shutil.copyfile and mmap take all of it (both
    took 0 bytes at d4c56fe; a private mapping: it is read with direct_io), each open a fresh snapshot."""
    import mmap

    mountpoint = mounts.mount(model_dir)
    assert os.statvfs(mountpoint).f_namemax == 255
    with pytest.raises(OSError) as caught:
        os.stat(mountpoint / ("x" * 256))
    assert caught.value.errno == errno.ENAMETOOLONG
    with pytest.raises(FileNotFoundError):
        os.stat(mountpoint / ("x" * 255))
    stats = mountpoint / ".tensorfs" / "stats.json"
    assert [p.name for p in (mountpoint / ".tensorfs").iterdir() if p.name == "stats.json"]  # listed too
    copied = tmp_path / "copied.json"
    shutil.copyfile(stats, copied)
    assert json.loads(copied.read_bytes())["pid"] == mounts.daemon_pid(mountpoint)
    with open(stats, "rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as mapped:
        assert len(mapped) == os.fstat(f.fileno()).st_size > 0
        assert json.loads(bytes(mapped))["version"] == json.loads(copied.read_bytes())["version"]
    before = json.loads(stats.read_bytes())["requests"].get("open", 0)
    assert json.loads(stats.read_bytes())["requests"]["open"] > before  # a fresh snapshot each open
