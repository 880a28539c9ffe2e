"""What a daemon counts, and where it shows: .tensorfs/stats.json, `tensorfs stats`, `tensorfs status`
and the Prometheus endpoint; all agree, and agree with what was read."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import Mounts
from helpers import MIB, free_port, patience, random_bytes, read_line, reap, scrape, write_reference
from tensorfs.mount.stats import Stats, quantile


def test_counting_units() -> None:
    stats = Stats(model_bytes=10 * MIB)
    stats.read("tensor", 100, 0.0003)
    stats.read("view", 50, 20.0)
    stats.touch("s", 0, 1)
    stats.touch("s", 5, MIB + 1)  # the first MiB again, and one more
    stats.error("read", errno.EIO)
    stats.prefetched("s", MIB, 4 * MIB + 100)  # a window over MiB 1 (read already) to 4
    stats.touch("s", 2 * MIB, 2 * MIB + 10)
    snapshot = stats.snapshot()
    assert snapshot["prefetch_ahead_bytes"] == 3 * MIB and snapshot["prefetch_hit_bytes"] == MIB  # MiB 2, 3, 4; then 2
    assert snapshot["prefetch_bytes"] == 3 * MIB + 100 and snapshot["touched_bytes"] == 3 * MIB
    assert snapshot["read_bytes"]["tensor"] == 100 and snapshot["reads"]["view"] == 1
    assert snapshot["errors"] == [{"op": "read", "errno": errno.EIO, "count": 1}]
    counts = snapshot["read_latency"]["counts"]
    assert sum(counts) == 2 and counts[-1] == 1  # 20 s: past every bound
    assert quantile(snapshot["read_latency"]["buckets"], counts, 0.5) == 0.0005
    assert snapshot["seconds_since_io_error"] is not None and json.dumps(snapshot)


def test_every_view_of_the_counters_agrees(mounts: Mounts, tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    tensors = {
        name: random_bytes(size, i) for i, (name, size) in enumerate([("a", 3 * MIB + 5), ("b", 4096), ("bad", 100)])
    }
    write_reference(directory / "m.safetensors", {name: ("U8", [len(data)], data) for name, data in tensors.items()})
    write_reference(directory / "other.safetensors", {"gone": ("U8", [MIB], random_bytes(MIB, 9))})
    manifest = mounts.run("manifest", str(directory)).stdout
    lines = [line if not line.endswith("  bad") else "0" * 64 + "  bad" for line in manifest.splitlines()]
    (directory / "tensors.sha256").write_text("\n".join(lines) + "\n")
    port = free_port()
    mountpoint = mounts.mount(directory, "--metrics", str(port))
    assert (mountpoint / "a").read_bytes() == tensors["a"]
    assert (mountpoint / "b").read_bytes() == tensors["b"]
    with pytest.raises(OSError) as refused:
        (mountpoint / "bad").read_bytes()  # its hash is not the manifest's
    assert refused.value.errno == errno.EIO
    with open(mountpoint / "gone", "rb", buffering=0) as gone:  # verified as it opens
        os.truncate(directory / "other.safetensors", 1000)  # then cut under the mount
        with pytest.raises(OSError) as cut:
            gone.read()
    assert cut.value.errno == errno.EIO

    raw = (mountpoint / ".tensorfs" / "stats.json").read_bytes()
    from_file = json.loads(raw)
    command = mounts.run("stats", "--json", str(mountpoint))
    assert command.returncode == 0, command.stderr
    from_command = json.loads(command.stdout)
    metrics = scrape(port)
    where = (("mountpoint", str(mountpoint)),)

    for snapshot in (from_file, from_command):
        assert snapshot["read_bytes"]["tensor"] == len(tensors["a"]) + len(tensors["b"])  # each byte once
        assert snapshot["integrity"] == {
            "verified": 3,
            "verify_failures": 1,
            "signature": None,
        }  # a, b and gone; bad; no signature
        errors = {(e["op"], e["errno"]): e["count"] for e in snapshot["errors"]}
        assert errors[("open", errno.EIO)] >= 1 and errors[("read", errno.EIO)] >= 1
        assert snapshot["tensors_opened"] == 3  # a, b and gone (bad was refused at open)
    assert from_command["reads"]["tensor"] == from_file["reads"]["tensor"]
    assert from_command["read_bytes"]["control"] == from_file["read_bytes"]["control"] + len(raw)  # that read
    assert metrics[("tensorfs_read_bytes_total", (("kind", "tensor"), *where))] == from_file["read_bytes"]["tensor"]
    assert metrics[("tensorfs_reads_total", (("kind", "tensor"), *where))] == from_file["reads"]["tensor"]
    assert metrics[("tensorfs_verification_failures_total", where)] == 1
    opens = metrics[("tensorfs_request_errors_total", (("errno", "EIO"), *where, ("op", "open")))]
    assert opens == dict(((e["op"], e["errno"]), e["count"]) for e in from_file["errors"])[("open", errno.EIO)]
    reads = sum(from_command["read_latency"]["counts"])
    assert metrics[("tensorfs_request_duration_seconds_count", (*where, ("op", "read")))] >= reads
    assert metrics[("tensorfs_model_bytes", where)] == sum(map(len, tensors.values())) + MIB

    status = mounts.run("status", str(mountpoint))
    line = status.stdout.splitlines()[1]
    assert status.returncode == 1 and line.split()[1] == "degraded"
    assert "1 tensor(s) failed verification" in line and "tensorfs stats" in line
    table = mounts.run("stats", str(mountpoint))
    assert table.returncode == 0 and "integrity  0 tensors verified, 1 refused" not in table.stdout
    assert "1 refused" in table.stdout and "read EIO" in table.stdout


def test_a_port_in_use_is_a_mount_error(mounts: Mounts, tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"x": ("U8", [1], b"x")})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        spare = tmp_path / "spare"
        spare.mkdir()
        result = mounts.attempt(directory, "--metrics", f"127.0.0.1:{port}", mountpoint=spare)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert f"cannot serve metrics on 127.0.0.1:{port}: Address already in use" in result.stderr
    assert not os.path.ismount(spare)
    bad = mounts.attempt(directory, "--metrics", "99999", mountpoint=spare)
    assert bad.returncode == 2 and "not [HOST:]PORT" in bad.stderr


def test_stats_of_a_hung_daemon_returns(mounts: Mounts, tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"x": ("U8", [1], b"x")})
    mountpoint = mounts.mount(directory)
    pid = mounts.daemon_pid(mountpoint)
    os.kill(pid, signal.SIGSTOP)
    try:
        result = mounts.run("stats", "--timeout", "0.5", str(mountpoint), timeout=60)
        assert result.returncode == 1 and "its daemon did not answer within 0.5 s" in result.stderr
    finally:
        os.kill(pid, signal.SIGCONT)
    not_one = mounts.run("stats", str(tmp_path))
    assert not_one.returncode == 1 and "not a tensorfs mount" in not_one.stderr


def test_json_logs_name_the_tensor_shard_and_errno(mounts: Mounts, tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"ok": ("U8", [4], b"abcd"), "bad": ("U8", [4], b"efgh")})
    manifest = mounts.run("manifest", str(directory)).stdout
    lines = [line if not line.endswith("  bad") else "0" * 64 + "  bad" for line in manifest.splitlines()]
    (directory / "tensors.sha256").write_text("\n".join(lines) + "\n")
    mountpoint = mounts.mount(directory, "--log-format", "json")
    assert (mountpoint / "ok").read_bytes() == b"abcd"
    with pytest.raises(OSError):
        (mountpoint / "bad").read_bytes()
    records = [json.loads(line) for line in mounts.log().splitlines()]  # every line is one object
    assert all({"time", "level", "pid", "event"} <= set(record) for record in records)
    refused = [record for record in records if record["level"] == "ERROR"]
    assert refused and refused[0]["fields"] == {
        "tensor": "bad",
        "shard": str(directory / "m.safetensors"),
        "errno": "EIO",
    }


def test_a_shard_changed_under_a_verifying_mount_is_degraded(mounts: Mounts, tmp_path: Path) -> None:
    directory = tmp_path / "model"
    directory.mkdir()
    write_reference(directory / "m.safetensors", {"x": ("U8", [4096], random_bytes(4096, 1))})
    assert mounts.run("manifest", "-o", str(directory / "tensors.sha256"), str(directory)).returncode == 0
    mountpoint = mounts.mount(directory)
    with open(directory / "m.safetensors", "r+b") as shard:  # in place: same inode, same size
        shard.seek(200)
        for _ in range(8):  # a burst of writes: one warning
            shard.write(b"\xff")
            shard.flush()
    from conftest import wait_until

    def status_line() -> str:
        return mounts.run("status", str(mountpoint)).stdout.splitlines()[1]

    wait_until(lambda: status_line().split()[1] == "degraded", what="the mount to say it is degraded")
    assert "1 shard(s) changed under it" in status_line()
    assert mounts.log().count("changed under the mount") == 1


@contextlib.contextmanager
def stopped_holding_nothing_in(pid: int, mountpoint: Path) -> Iterator[None]:
    """The process `pid` stopped (SIGSTOP) at a moment it holds no file open under `mountpoint`, for
    the block; let go after. A watcher that opens a file there now and then is never caught with one
    open by what the block does (an unmount), however the machine schedules it."""
    deadline = time.monotonic() + patience(30)
    while True:
        os.kill(pid, signal.SIGSTOP)
        while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
            assert time.monotonic() < deadline, f"process {pid} did not stop"
            time.sleep(0.001)
        held = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                held.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        if not any(path == str(mountpoint) or path.startswith(f"{mountpoint}/") for path in held):
            break
        os.kill(pid, signal.SIGCONT)
        assert time.monotonic() < deadline, f"process {pid} kept a file open under {mountpoint}"
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_stats_watch_draws_again_and_ends_on_ctrl_c_or_when_the_mount_goes(mounts: Mounts, tmp_path: Path) -> None:
    """`stats --watch` piped: a block again every interval (a blank line between), the rates over the
    last interval, what was read since in the next block; Ctrl-C ends it quietly (exit 0). With
    --json, one object a line; the mount unmounted under it, it ends with one error line, exit 1."""
    directory = tmp_path / "model"
    directory.mkdir()
    data = random_bytes(MIB, 3)
    write_reference(directory / "m.safetensors", {"x": ("U8", [MIB], data)})
    mountpoint = mounts.mount(directory)
    command = [sys.executable, "-m", "tensorfs.cli", "stats", "--watch", "0.1"]
    watcher = subprocess.Popen([*command, str(mountpoint)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert watcher.stdout is not None
        pending = bytearray()
        lines = [read_line(watcher.stdout.fileno(), 30, pending) for _ in range(2)]
        assert lines[0].startswith(f"{mountpoint}  up ") and lines[1].startswith("served     0 B in 0 reads")
        assert (mountpoint / "x").read_bytes() == data
        seen: list[str] = []
        while not (seen and seen[-1].startswith("served     1.0 MiB")):  # the read, in a later block
            seen.append(read_line(watcher.stdout.fileno(), 30, pending))
        rate = read_line(watcher.stdout.fileno(), 30, pending)
        assert rate.startswith("rate ") and "over the last" in rate, rate
        assert "" in seen and sum(line.startswith(f"{mountpoint}  up ") for line in seen) >= 1  # blocks, apart
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=patience(30)) == 0
        assert watcher.stderr is not None and watcher.stderr.read() == b""  # no traceback, nothing
    finally:
        reap(watcher)
    watcher = subprocess.Popen(
        [*command, "--json", str(mountpoint)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert watcher.stdout is not None and watcher.stderr is not None
        pending = bytearray()
        snapshots = [json.loads(read_line(watcher.stdout.fileno(), 30, pending)) for _ in range(2)]
        assert snapshots[1]["uptime_seconds"] > snapshots[0]["uptime_seconds"]
        with stopped_holding_nothing_in(watcher.pid, mountpoint):  # (its stats.json open: umount says busy)
            assert mounts.run("umount", str(mountpoint)).returncode == 0
        assert watcher.wait(timeout=patience(30)) == 1
        error = watcher.stderr.read()
        assert error == f"error: {mountpoint}: not mounted any more\n"
    finally:
        reap(watcher)
